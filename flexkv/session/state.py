"""A request's carried model state in a `StreamSession` (`initial_state`).

`initial_state` makes a new (or reset) request's state: a tensor or a
tuple/list/dict of tensors, from the request id or from nothing
(`state_factory`). Every step hands `fn` each running request's state
stacked by lane, and `fn` returns `(outputs, new_state)` shaped like what it
was given (`check_new_state`); each request keeps its lane of `new_state`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Hashable, List, Tuple

import torch

from .feeds import flatten, map_tensors, pad_by_lane

__all__ = ["state_factory", "check_new_state", "stack_states", "lane_states", "check_rollback_state"]


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


def stack_states(states: Dict[int, Any], B: int, template=None) -> Tuple[List[torch.Tensor], Any]:
    """The states of lane -> state stacked by lane, `[B, ...]` per tensor, zeros on the other lanes, and
    their structure; with no states (a warm-up step), zeros shaped like `template` (one new state)."""
    leaves = {lane: flatten(state, f"the state on lane {lane}") for lane, state in states.items()}
    like = next(iter(leaves.values())) if leaves else flatten(template, "initial_state()")
    return pad_by_lane({lane: lv for lane, (lv, _) in leaves.items()}, like[0], B, None), like[1]


def lane_states(new_state, lanes: Dict[Hashable, int]) -> Dict[Hashable, Any]:
    """Request id -> its lane's share of the step's `new_state`."""
    return {rid: map_tensors(lambda t, lane=lane: t[lane], new_state) for rid, lane in lanes.items()}


def check_rollback_state(request_id, has_state: bool, current, takes_back: bool, state) -> None:
    """A rollback's `state`: required (and shaped like the request's `current` one) when the session
    carries model state (`has_state`) and tokens are taken back; refused without."""
    if state is not None and not has_state:
        raise ValueError("rollback: state= is for a session with initial_state; this one carries none")
    if state is None and has_state and takes_back:
        raise ValueError(
            f"rollback: request {request_id!r} carries a model state (initial_state), which the session "
            f"cannot take back by itself; pass state=... with its state from before those tokens"
        )
    if state is not None:
        leaves, spec = flatten(state, "rollback's state")
        have, have_spec = flatten(current, f"the state of request {request_id!r}")
        if spec != have_spec or [(t.shape, t.dtype) for t in leaves] != [(t.shape, t.dtype) for t in have]:
            raise ValueError(
                f"rollback: state must be shaped like request {request_id!r}'s state "
                f"({[tuple(t.shape) for t in have]}), got {[tuple(t.shape) for t in leaves]}"
            )

