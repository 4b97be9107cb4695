"""Put a bounded cache under an existing attention module.

A model's attention computes `q, k, v` and hands them to a core
`(q, k, v) -> out` (the SDPA layout: `q [N, Hq, T, D]`, `k, v [N, H, T,
D]`, `out [N, Hq, T, D]`). This module gives two interchangeable cores:

- `BoundedAttention`: one layer of a `BoundedKVManager`; writes the step's
  tokens into the slot pool and attends what the retention policy keeps;
- `UncachedAttention`: the same attention over the whole history kept by an
  `UncachedHistory`, nothing evicted, for checking a port.

Both read the step from a `StepContext`, the one object a model's layers
share: the host loop calls `context.begin(step)` (admit, checks, plan),
runs the model, then `context.commit()`. Nothing about the step is an
argument of the layers, so the model's own forward signature stays as it was.

Compiled use: compile a function that takes the plan as an argument and
binds it before running the model::

    context = StepContext(manager)
    model = MyModel(attention=lambda i: BoundedAttention(context, i))

    def forward(plan, x):
        context.bind(plan)  # inside the graph: the plan is an input, not a guard
        return model(x)

    step_fn = torch.compile(forward, fullgraph=True, dynamic=False)
    plan = context.begin(step)   # host: admit, check, plan (never waits on the device)
    y = step_fn(plan, x)
    context.commit()

Passing the plan as an argument makes it a graph input explicitly. (A plan
that `begin` left on the context and the layers read from there also runs
without recompiling on torch 2.13: the compiler guards on the plan tensors'
shapes, not on which plan it is. The argument keeps that from depending on
guard details.)
"""

from __future__ import annotations

from typing import Callable, Hashable, List, Optional, Union

import torch
from torch import nn

from .manager import BoundedKVManager
from .planner import BoundedPlan
from .rotary import ROPE_POSITIONS, Rotary, SinkRotation
from .step import BoundedKVStep
from .uncached import UncachedHistory

__all__ = ["StepContext", "BoundedAttention", "UncachedAttention", "attention"]

Cache = Union[BoundedKVManager, UncachedHistory]


class StepContext:
    """The cache a model's attention layers share, and the step they are running.

    `cache` is a `BoundedKVManager` (the layers are `BoundedAttention`) or an
    `UncachedHistory` (the layers are `UncachedAttention`). Host side:
    `begin(step) -> plan`, then `commit()` after the forward. In a compiled
    step, call `bind(plan)` inside the compiled function.
    """

    def __init__(self, cache: Cache):
        if not isinstance(cache, (BoundedKVManager, UncachedHistory)):
            raise ValueError(
                f"StepContext: cache must be a BoundedKVManager or an UncachedHistory, got {type(cache).__name__}"
            )
        self.cache = cache
        self.step: Optional[BoundedKVStep] = None
        self.plan: Optional[BoundedPlan] = None
        self._checks: List[Callable[[BoundedKVStep], None]] = []

    @property
    def config(self):
        return self.cache.config

    def add_check(self, check: Callable[[BoundedKVStep], None]) -> None:
        """Run `check(step)` in every `begin` (host-side validation a layer needs)."""
        if check not in self._checks:
            self._checks.append(check)

    def begin(self, step: BoundedKVStep) -> Optional[BoundedPlan]:
        """Admit `step`, run the layers' checks, plan it; returns the plan (None for an uncached history)."""
        self.cache.admit(step)
        for check in self._checks:
            check(step)
        plan = self.cache.plan(step)
        self.step, self.plan = step, plan
        return plan

    def bind(self, plan: Optional[BoundedPlan]) -> None:
        """Make `plan` the one the layers read (call it inside a compiled step, on its argument)."""
        self.plan = plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Attention of layer `layer_idx` for the bound step, with no attention module in between.

        `BoundedKVManager.attend(layer_idx, q, k, v, plan, **kwargs)` with the
        bound plan, or `UncachedHistory.attend` with the begun step. Calling
        the context does the same: `context(layer_idx, q, k, v)`.
        """
        if isinstance(self.cache, UncachedHistory):
            if self.step is None:
                raise ValueError("StepContext.attend: no step; call begin(step) first")
            return self.cache.attend(layer_idx, q, k, v, self.step, **kwargs)
        return self.cache.attend(layer_idx, q, k, v, self.plan, **kwargs)

    __call__ = attend

    def commit(self) -> None:
        """Commit the step begun last."""
        if self.step is None:
            raise ValueError("StepContext.commit: no step was begun; call begin(step) first")
        self.cache.commit(self.step)

    def reset_request(self, request_id: Hashable) -> None:
        self.cache.reset_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        self.cache.remove_request(request_id)


def _check_common(context, layer_idx, rotary, rope_positions, positions, want):
    if not isinstance(context, StepContext):
        raise ValueError(f"expected a StepContext, got {type(context).__name__}")
    if not isinstance(context.cache, want):
        raise ValueError(
            f"this StepContext holds a {type(context.cache).__name__}; use flexkv.wrap.attention(context, ...) "
            f"to get the matching attention core"
        )
    n = context.config.num_layers
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < n:
        raise ValueError(f"layer_idx must be an int in [0, {n}), got {layer_idx!r}")
    if rotary is not None and not isinstance(rotary, Rotary):
        raise ValueError(f"rotary must be a flexkv.rotary.Rotary or None, got {type(rotary).__name__}")
    if rope_positions not in ROPE_POSITIONS:
        raise ValueError(f"rope_positions must be one of {ROPE_POSITIONS}, got {rope_positions!r}")
    if positions not in ("stream", "cache"):
        raise ValueError(f"positions must be 'stream' or 'cache', got {positions!r}")


class BoundedAttention(nn.Module):
    """`(q, k, v) -> out` through layer `layer_idx` of the context's `BoundedKVManager`.

    Args:
        context: a `StepContext` over a `BoundedKVManager`.
        layer_idx: the cache layer this attention writes and reads.
        rotary: a `flexkv.rotary.Rotary` to rotate `q` and `k` (un-rotated
            on input) at the step's positions, or None for no rotary.
        rope_positions: ``"stream"`` or ``"cache"`` (StreamingLLM's
            in-cache positions, served by `flexkv.rotary.SinkRotation`).
        scale, score_mod, positions: as `BoundedKVManager.attend`.

    `forward(q, k, v)`: `q [N, Hq, T, D]`, `k, v [N, H, T, D]` ->
    `[N, Hq, T, D]`, where `N` is the step's rows.
    """

    def __init__(
        self,
        context: StepContext,
        layer_idx: int,
        *,
        rotary: Optional[Rotary] = None,
        rope_positions: str = "stream",
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
    ):
        super().__init__()
        _check_common(context, layer_idx, rotary, rope_positions, positions, BoundedKVManager)
        object.__setattr__(self, "context", context)  # shared, not a submodule
        self.layer_idx = layer_idx
        self.scale = scale
        self.score_mod = score_mod
        self.positions = positions
        self.rope = None if rotary is None else SinkRotation(context.cache, layer_idx, rotary, rope_positions)
        if self.rope is not None and rope_positions == "cache":
            context.add_check(self.rope.check_step)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.context.plan
        if self.rope is not None:
            q, k = self.rope(q, k, plan)
        # `attend` gives q a buffer of its own (it folds the scale into q), so a q that is a view
        # of a projection's output lowers in compiled CPU FlexAttention.
        return self.context.cache.attend(
            self.layer_idx, q, k, v, plan, scale=self.scale, score_mod=self.score_mod, positions=self.positions
        )

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, positions={self.positions!r}"


class UncachedAttention(nn.Module):
    """The uncached twin of `BoundedAttention`: same arguments, attention over an `UncachedHistory`."""

    def __init__(
        self,
        context: StepContext,
        layer_idx: int,
        *,
        rotary: Optional[Rotary] = None,
        rope_positions: str = "stream",
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
    ):
        super().__init__()
        _check_common(context, layer_idx, rotary, rope_positions, positions, UncachedHistory)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "rotary", rotary)
        self.layer_idx = layer_idx
        self.rope_positions = rope_positions
        self.scale = scale
        self.score_mod = score_mod
        self.positions = positions

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context.step is None:
            raise ValueError("UncachedAttention: no step; call context.begin(step) before the forward")
        return self.context.cache.attend(
            self.layer_idx, q, k, v, self.context.step, scale=self.scale, score_mod=self.score_mod,
            positions=self.positions, rotary=self.rotary, rope_positions=self.rope_positions,
        )

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, positions={self.positions!r}, rope_positions={self.rope_positions!r}"


def attention(context: StepContext, layer_idx: int, **kwargs) -> nn.Module:
    """The attention core matching the context's cache: `BoundedAttention` or `UncachedAttention`."""
    if isinstance(context, StepContext) and isinstance(context.cache, UncachedHistory):
        return UncachedAttention(context, layer_idx, **kwargs)
    return BoundedAttention(context, layer_idx, **kwargs)
