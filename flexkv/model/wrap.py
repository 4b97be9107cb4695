"""Put a bounded cache under an existing attention module.

A model's attention computes `q, k, v` and hands them to a core
`(q, k, v) -> out` (the SDPA layout: `q [N, Hq, T, D]`, `k [N, H, T, D]`,
`v [N, H, T, Dv]`, `out [N, Hq, T, Dv]`, with `D = head_dim` and
`Dv = value_head_dim`, the same unless the config sets it).
`CacheAttention(context, layer)` is that core for
one layer of any flexkv cache (`flexkv.cache.protocol.StreamCache`): a
`BoundedKVManager` (one retention, or layer groups keeping retention of
their own), or the uncached twin `flexkv.model.uncached.UncachedHistory` that
keeps every key, for checking a port. The same model runs on each.

Every core reads the step from the `flexkv.model.step_context.StepContext` its
layers share (begin, attend, commit; compiled use there), and attends through
it. `attention(context, layer)` builds a core; `rows_by_request` and
`rows_stacked` convert between flexkv's row order and a stacked batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..cache.positions.masks import POSITION_MODES
from ..cache.positions.rotary import ROPE_POSITIONS, Rotary
from ..config import check_layer_index
from .step_context import StepContext

__all__ = ["CacheAttention", "attention", "ROW_ORDERS", "rows_by_request", "rows_stacked"]

#: How a model orders a step's `N = B * R` attention rows (`R = rows_per_request`): request by request
#: (row `lane * R + r`, flexkv's order), or stacked (row `r * B + lane`: every request's first row, then every
#: request's second row, as a classifier-free-guidance pipeline's `torch.cat([x_cond, x_uncond])` gives).
ROW_ORDERS = ("request", "stacked")


def rows_by_request(x: torch.Tensor, rows_per_request: int) -> torch.Tensor:
    """Stacked rows (`r * B + lane` along dim 0) -> flexkv's request-by-request order (`lane * R + r`)."""
    if rows_per_request == 1:
        return x
    return x.unflatten(0, (rows_per_request, -1)).transpose(0, 1).flatten(0, 1)


def rows_stacked(x: torch.Tensor, rows_per_request: int) -> torch.Tensor:
    """`rows_by_request`'s inverse: flexkv's row order -> stacked rows."""
    if rows_per_request == 1:
        return x
    return x.unflatten(0, (-1, rows_per_request)).transpose(0, 1).flatten(0, 1)


class CacheAttention(nn.Module):
    """`(q, k, v) -> out` through layer `layer_idx` of the context's cache.

    Args:
        context: a `StepContext`.
        layer_idx: the cache layer this attention writes and reads.
        rotary: a `flexkv.cache.positions.rotary.Rotary` to rotate `q` and `k` (un-rotated
            on input) at the step's positions, or None for no rotary.
        rope_positions: ``"stream"`` or ``"cache"`` (StreamingLLM's
            in-cache positions; see `flexkv.cache.positions.rotary`).
        scale, score_mod, positions, sinks: as `BoundedKVManager.attend`.
        rows: how the model orders the step's rows (`ROW_ORDERS`):
            ``"request"`` (flexkv's: a request's `rows_per_request` rows
            side by side) or ``"stacked"`` (every request's first row, then
            every request's second row: classifier-free guidance written as
            `torch.cat([x_cond, x_uncond])`). `q, k, v`, the output and
            `stream_positions()` are in the model's order.

    `forward(q, k, v)`: `q [N, Hq, T, D]`, `k [N, H, T, D]`,
    `v [N, H, T, Dv]` -> `[N, Hq, T, Dv]`, where `N` is the step's rows,
    `D` the config's `head_dim` and `Dv` its `value_head_dim`.
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
        sinks: Optional[torch.Tensor] = None,
        rows: str = "request",
    ):
        super().__init__()
        if not isinstance(context, StepContext):
            raise ValueError(f"expected a StepContext, got {type(context).__name__}")
        context._the_cache("attention")  # a layer attends one cache: context[name] of a named context
        if rows not in ROW_ORDERS:
            raise ValueError(f"rows must be one of {ROW_ORDERS} (the model's order of a step's rows), got {rows!r}")
        check_layer_index(layer_idx, context.config.num_layers)
        if rotary is not None and not isinstance(rotary, Rotary):
            raise ValueError(f"rotary must be a flexkv.cache.positions.rotary.Rotary or None, got {type(rotary).__name__}")
        if rope_positions not in ROPE_POSITIONS:
            raise ValueError(f"rope_positions must be one of {ROPE_POSITIONS}, got {rope_positions!r}")
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES} (what a score_mod receives), got {positions!r}")
        object.__setattr__(self, "context", context)  # shared, not a submodule
        self.layer_idx = layer_idx
        self.scale = scale
        self.score_mod = score_mod
        self.positions = positions
        self.rope_positions = rope_positions
        self.rows = rows
        self._R = context.config.rows_per_request if rows == "stacked" else 1
        object.__setattr__(self, "sinks", sinks)  # the model's parameter, not this module's
        rope = None if rotary is None else context.cache.rotation(layer_idx, rotary, rope_positions)
        if isinstance(rope, nn.Module):
            self.rope = rope  # holds per-request cache state (StreamingLLM's un-rotated sink keys)
        else:
            object.__setattr__(self, "rope", rope)
        if rope is not None and rope_positions == "cache":
            context.add_check(rope.check_step)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.context.plan
        if plan is None:
            raise ValueError("CacheAttention: no step; call context.begin(step) before the forward")
        R = self._R
        if R > 1:
            q, k, v = rows_by_request(q, R), rows_by_request(k, R), rows_by_request(v, R)
        if self.rope is not None:
            q, k = self.rope(q, k, plan)
        kw = {} if self.sinks is None else {"sinks": self.sinks}
        # The context's attend counts the call for the step's attendance check. The cache's `attend`
        # gives q a buffer of its own (it folds the scale into q), so a q that is a view of a
        # projection's output lowers in compiled CPU FlexAttention.
        out = self.context.attend(self.layer_idx, q, k, v, scale=self.scale, score_mod=self.score_mod,
                                  positions=self.positions, **kw)
        return rows_stacked(out, R) if R > 1 else out

    def stream_positions(self, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each own token of the bound step, `[N, T]` (`StepContext.stream_positions`):
        what a model that applies its own position encoding rotates `q` and `k` at (rows in the core's
        `rows` order)."""
        pos = self.context.stream_positions(tokens)
        return rows_stacked(pos, self._R) if self._R > 1 else pos

    def stream_offsets(self) -> torch.Tensor:
        """Stream index of each row's first own token, `[N]` (`StepContext.stream_offsets`): for a position
        encoding that takes one offset per row and adds `arange(T)` itself (rows in the core's `rows` order)."""
        off = self.context.stream_offsets()
        return rows_stacked(off, self._R) if self._R > 1 else off

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, positions={self.positions!r}, rope_positions={self.rope_positions!r}"


def attention(context: StepContext, layer_idx: int, **kwargs) -> CacheAttention:
    """`CacheAttention(context, layer_idx, **kwargs)`: the attention core for any cache."""
    return CacheAttention(context, layer_idx, **kwargs)
