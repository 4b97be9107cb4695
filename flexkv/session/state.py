"""A request's carried model state in a `StreamSession` (`initial_state`).

`initial_state` makes a new (or reset) request's state: a tensor or a
tuple/list/dict of tensors, from the request id or from nothing
(`state_factory`). Every step hands `fn` each running request's state
stacked by lane, and `fn` returns `(outputs, new_state)` shaped like what it
was given (`check_new_state`); each request keeps its lane of `new_state`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable, List

import torch

from .feeds import flatten

__all__ = ["state_factory", "check_new_state"]


def state_factory(initial_state: Callable) -> Callable[[Hashable], Any]:
    """`initial_state` as a function of the request id: it may take the id, or nothing."""
    try:
        params = [p for p in inspect.signature(initial_state).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # a builtin without a signature: called without arguments
        params = []
    if len(params) > 1:
        raise ValueError(
            f"initial_state must take no argument or one (the request id), got {initial_state!r} taking {len(params)}"
        )
    if params:
        return initial_state
    return lambda request_id: initial_state()


def check_new_state(result, state_leaves: List[torch.Tensor], state_spec) -> Any:
    """`fn`'s `(outputs, new_state)`, with `new_state` checked against the state it was given."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError("with initial_state, fn must return (outputs, new_state)")
    outputs, new_state = result
    try:
        leaves, spec = flatten(new_state, "the new_state fn returned")
    except ValueError:
        leaves, spec = None, None
    given = [(tuple(t.shape), t.dtype) for t in state_leaves]
    got = None if leaves is None else [(tuple(t.shape), t.dtype) for t in leaves]
    if spec != state_spec or got != given:
        what = type(new_state).__name__ if leaves is None else [s for s, _ in got]
        raise ValueError(
            f"with initial_state, fn must return (outputs, new_state) with new_state shaped like the state it "
            f"was given (every request's state stacked by lane: {[s for s, _ in given]}, dtypes "
            f"{[d for _, d in given]}); the second item it returned is {what}. A model without state must not "
            f"be given initial_state; one whose outputs are a pair must return ((out1, out2), new_state)"
        )
    return outputs, new_state
