"""Put a bounded cache under an existing attention module.

A model's attention computes `q, k, v` and hands them to a core
`(q, k, v) -> out` (the SDPA layout: `q [N, Hq, T, D]`, `k [N, H, T, D]`,
`v [N, H, T, Dv]`, `out [N, Hq, T, Dv]`, with `D = head_dim` and
`Dv = value_head_dim`, the same unless the config sets it).
`CacheAttention(context, layer)` is that core for
one layer of any flexkv cache (`flexkv.cache.protocol.StreamCache`): a
`BoundedKVManager`, a `GroupedKVManager` whose layer groups keep retention
of their own, or the uncached twin `flexkv.model.uncached.UncachedHistory` that
keeps every key, for checking a port. The same model runs on each.

Every core reads the step from a `StepContext`, the one object a model's
layers share: the host loop calls `context.begin(step)` (admit, checks,
plan), runs the model, then `context.commit()`, or `context.abort()` if the
model raised (`with context.stepping(step) as plan:` does both). The step is
one `flexkv.cache.transaction.StepTransaction`: an aborted step changes
nothing in the cache. Nothing about the step is
an argument of the layers, so the model's own forward signature stays as it
was. `context.stream_positions()` gives the step's stream index of every
own token (for a model that applies its own position encoding).

Compiled use: compile a function that takes the plan as an argument and
binds it before running the model::

    context = StepContext(manager)
    model = MyModel(attention=lambda i: CacheAttention(context, i))

    def forward(plan, x):
        context.bind(plan)  # inside the graph: the plan is an input, not a guard
        return model(x)

    step_fn = torch.compile(forward, fullgraph=True, dynamic=False)
    plan = context.begin(step)   # host: admit, check, plan (never waits on the device)
    y = step_fn(plan, x)
    context.commit()

Passing the plan as an argument makes it a graph input explicitly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, List, Optional

import torch
from torch import nn

from ..cache.masks import POSITION_MODES
from ..cache.protocol import check_cache
from ..cache.rotary import ROPE_POSITIONS, Rotary
from ..cache.transaction import StepTransaction
from ..config import check_layer_index
from ..step import BoundedKVStep
from .attendance import AttendanceRecord

__all__ = ["StepContext", "CacheAttention", "attention", "ROW_ORDERS",
           "rows_by_request", "rows_stacked"]

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


class StepContext:
    """The cache a model's attention layers share, and the step they are running.

    `cache` is any flexkv cache (`flexkv.cache.protocol.StreamCache`). Host side:
    `begin(step) -> plan`, then `commit()` after the forward (or `abort()`
    when it raised); `stepping(step)` is both as a `with` block. In a
    compiled step, call `bind(plan)` inside the compiled function.

    `plan` is the plan the layers read: the one place a step's current plan
    lives (caches keep none; every `attend` is given it).
    """

    def __init__(self, cache):
        self.cache = check_cache(cache, "StepContext")
        self.step: Optional[BoundedKVStep] = None
        self.plan: Any = None
        #: The step begun last (`flexkv.cache.transaction.StepTransaction`), None before the first.
        self.transaction: Optional[StepTransaction] = None
        self._checks: List[Callable[[BoundedKVStep], None]] = []
        #: attend calls per cache layer in the current step; `commit` refuses a step that did not attend
        #: every layer exactly once (`flexkv.model.attendance`)
        self.attendance = AttendanceRecord(self.cache.config.num_layers)
        self._commit_where = "StepContext.commit"  # who commits, for the attendance error (a session says so)

    @property
    def config(self):
        return self.cache.config

    def add_check(self, check: Callable[[BoundedKVStep], None]) -> None:
        """Run `check(step)` in every `begin` (host-side validation a layer needs)."""
        if check not in self._checks:
            self._checks.append(check)

    def begin(self, step: BoundedKVStep, transaction: Optional[StepTransaction] = None):
        """Check `step` (the layers' checks first, so a refused step admits nothing), admit and plan it;
        returns the plan.

        The step runs in `transaction` (a door that admitted more in it first, such as a
        session starting requests, or a step over several caches whose transaction this
        context's cache joins: `flexkv.model.multi_context`) or a new one. Refused while the
        step begun last is still open: `commit()` or `abort()` it first.
        """
        if self.transaction is not None and self.transaction.is_open:
            raise ValueError("StepContext.begin: the step begun last is still open; commit() it after its "
                             "forward, or abort() it if the forward failed")
        for check in self._checks:
            check(step)
        txn = StepTransaction(self.cache) if transaction is None else transaction
        plan = txn.begin(step, self.cache)
        self.transaction, self.step, self.plan = txn, step, plan
        self.attendance.start()
        # Before anything commits: every declared cache layer attended exactly once.
        txn.add_commit_check(lambda _txn: self.check_attendance(self._commit_where))
        return plan

    def bind(self, plan) -> None:
        """Make `plan` the one the layers read (call it inside a compiled step, on its argument)."""
        self.plan = plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Attention of layer `layer_idx` for the bound step, with no attention module in between:
        the cache's `attend(layer_idx, q, k, v, plan, **kwargs)`. Calling the context does the
        same: `context(layer_idx, q, k, v)`."""
        if self.plan is None:
            raise ValueError("StepContext.attend: no step; call begin(step) (and bind(plan) when compiled) first")
        self.attendance.attended(layer_idx)
        return self.cache.attend(layer_idx, q, k, v, self.plan, **kwargs)

    __call__ = attend

    def stream_positions(self, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each own token of the bound step, `[N, T]` int64 (contract section 2).

        The same for every cache (the uncached twin included): what a model
        that rotates its own queries and keys (or adds its own position
        encoding) needs. On the device and traceable for a bounded cache.
        Padding rows count from 0.
        """
        if self.plan is None:
            raise ValueError("StepContext.stream_positions: no step; call begin(step) first")
        return self.cache.stream_positions(self.plan, tokens)

    def stream_offsets(self) -> torch.Tensor:
        """Stream index of each row's first own token of the bound step, `[N]` int64: the row offset a
        position encoding that adds `arange(T)` itself takes (`stream_positions()` is
        `stream_offsets()[:, None] + arange(T)`). Refused with `reverse_step_order`, whose positions
        count down inside a step."""
        if self.plan is None:
            raise ValueError("StepContext.stream_offsets: no step; call begin(step) first")
        if self.config.reverse_step_order:
            raise ValueError(
                "stream_offsets(): with reverse_step_order=True a step's tokens sit at n + span - 1 - t (they "
                "count down), which no row offset + arange(T) gives; use stream_positions() [N, T]"
            )
        return self.cache.stream_positions(self.plan, 1)[:, 0]

    def check_attendance(self, where: str = "StepContext.commit") -> None:
        """Raise `flexkv.model.attendance.AttendanceError` unless the bound step attended every cache layer
        exactly once (`commit` does it before committing anything)."""
        self.attendance.check(where)

    def commit(self) -> None:
        """Commit the step begun last (its transaction's commit checks first); refused (nothing
        committed, the step aborted) when the step did not attend every cache layer exactly once."""
        if self.transaction is None:
            raise ValueError("StepContext.commit: no step was begun; call begin(step) first")
        self.transaction.commit()

    def abort(self) -> bool:
        """Take back the step begun last (its forward failed): the cache is as it was before
        `begin`. Returns False when no step is open (nothing to undo)."""
        return self.transaction is not None and self.transaction.abort()

    @contextlib.contextmanager
    def stepping(self, step: BoundedKVStep):
        """`with context.stepping(step) as plan:` begins `step`, commits it when the block ends,
        and aborts it when the block raises (any exception, `KeyboardInterrupt` included)."""
        plan = self.begin(step)
        try:
            yield plan
        except BaseException:
            self.abort()
            raise
        self.commit()

    def reset_request(self, request_id: Hashable) -> None:
        self.cache.reset_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        self.cache.remove_request(request_id)


class CacheAttention(nn.Module):
    """`(q, k, v) -> out` through layer `layer_idx` of the context's cache.

    Args:
        context: a `StepContext`.
        layer_idx: the cache layer this attention writes and reads.
        rotary: a `flexkv.cache.rotary.Rotary` to rotate `q` and `k` (un-rotated
            on input) at the step's positions, or None for no rotary.
        rope_positions: ``"stream"`` or ``"cache"`` (StreamingLLM's
            in-cache positions; see `flexkv.cache.rotary`).
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
        if rows not in ROW_ORDERS:
            raise ValueError(f"rows must be one of {ROW_ORDERS} (the model's order of a step's rows), got {rows!r}")
        check_layer_index(layer_idx, context.config.num_layers)
        if rotary is not None and not isinstance(rotary, Rotary):
            raise ValueError(f"rotary must be a flexkv.cache.rotary.Rotary or None, got {type(rotary).__name__}")
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
        self.context.attendance.attended(self.layer_idx)
        # `attend` gives q a buffer of its own (it folds the scale into q), so a q that is a view
        # of a projection's output lowers in compiled CPU FlexAttention.
        out = self.context.cache.attend(
            self.layer_idx, q, k, v, plan, scale=self.scale, score_mod=self.score_mod, positions=self.positions, **kw
        )
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
