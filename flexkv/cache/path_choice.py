"""A cache's attention paths, and the one place each `attend` call's path is chosen.

Every path takes one call in one shape (`PathCall`) and answers three
questions (`AttentionPath`):

==================  ===========================================================
`scratch(e, c)`     the buffers it needs when the cache's steps reach it eagerly
                    (`e`) and/or compiled (`c`), allocated when the cache is built
`plan_parts(p, ..)` what it adds to a plan `p` before any layer reads it
`path(call)`        `(out, log-sum-exp or None)` of one call
==================  ===========================================================

`AttentionPaths` builds a cache's paths once and decides, from the options
alone (`AttentionOptions.path_for` and `route`), which steps reach which
path: the same rule sizes the scratch, adds the plan parts and routes each
call. The paths:

It sits beside the caches, above `paths` and `cpu`: it is the one module that
enters the CPU speed work, which builds on the rows path's pieces, so the
choice lives above both rather than inside `paths`.

- `rows_path.RowsPath`: each row's cells, then dense attention (`flexkv.cache.paths.row_attention`); or,
  for a cache on the CPU, unless `AttentionOptions.cpu_fast_paths` is off, the same path through the CPU
  fast paths (`flexkv.cache.cpu.fast_rows_path.FastRowsPath`), the one class chosen here when the cache
  is built;
- `flex_path.FlexPath`: one FlexAttention call (inline, or the region every compiled layer shares);
- `float8_path.Float8FlexPath`: FlexPath reading float8 cells as stored, for compiled CUDA kernels;
- `joint_path.JointPath`: a call with keys joined from elsewhere (`attend_joined`): the
  row's cells, the joined keys and the query-only queries in one softmax.

Otherwise query-only queries (`flexkv.cache.paths.query_only`) are one more
rows-path call beside the call's path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Protocol, Tuple

import torch

from .cpu.fast_rows_path import FastRowsPath
from .host.layout import cpu_kernel_block_exact
from .paths.attention_options import AttentionOptions, Route
from .paths.flex_path import FlexPath
from .paths.float8_path import Float8FlexPath, reads_cells_in_kernel
from .paths.joint_path import JointPath
from .paths.rows_path import RowsPath

__all__ = ["AttentionPaths", "AttentionPath", "PathCall"]

#: The route of every call with joined keys: one softmax over gathered rows, the GQA group folded in there.
JOINT_ROUTE = Route("joint", False, False)


class PathCall(NamedTuple):
    """One `attend` call as every path takes it, after the step's write."""

    #: The layer's index in the cache.
    layer: int
    #: The scaled queries, `[N, H, g * T, D]` with the GQA group folded in (`route.pack_gqa`) or `[N, Hq, T, D]`.
    q: torch.Tensor
    #: The layer's key and value buffers (`LayerStore.layer_kv`), the step's tokens written.
    k_cells: torch.Tensor
    v_cells: torch.Tensor
    #: Quantized slots: the layer's `(key scales, value scales)`; else None.
    scales: Optional[tuple]
    plan: object
    route: Route
    #: The step's `score_mod` as built for the route (`flexkv.cache.positions.masks.make_score_mod`), or None.
    score_mod: Optional[Callable]
    #: Whether the call returns its log-sum-exp.
    lse: bool
    #: `score_mod` only adds a term to each score (`RelativePositionScores`).
    additive: bool
    compiling: bool
    #: The joint path's: the query-only queries `[N, Hq, Q, D]` (or None), the joined `KeyPart`s and the
    #: scale of the scores (its queries, `q` included, come unscaled).
    query_only: Optional[torch.Tensor] = None
    joined: tuple = ()
    scale: float = 1.0


class AttentionPath(Protocol):
    """What every attention path answers (module docstring)."""

    name: str

    def scratch(self, eager: bool, compiled: bool) -> dict: ...

    def plan_parts(self, plan, eager: bool, compiled: bool) -> None: ...

    def __call__(self, call: PathCall) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class AttentionPaths:
    """The attention paths of one store under `options`, and the choice among them.

    Args:
        store: the cache's `flexkv.cache.storage.store.LayerStore` (its config, device and layout).
        options: the cache's `AttentionOptions`.
    """

    def __init__(self, store, options: AttentionOptions):
        self.store = store
        self.options = options
        c = store.config
        self.device_type = store.device.type
        self.quantized = c.slot_dtype is not None
        #: Whether the compiled CPU FlexAttention kernel is exact at this cache's KV block size
        #: (`flexkv.cache.host.layout.cpu_kernel_block_exact`; where it is not, `"auto"` takes the
        #: rows path and `"flex"` is refused). A plain bool: every compiled layer reads it.
        self.flex_exact = self.device_type != "cpu" or cpu_kernel_block_exact(store.layout.block_size)
        # The fast paths were built and measured on the CPU (docs/benchmarks.md); elsewhere the plain path runs.
        self.rows = (FastRowsPath if options.cpu_fast_paths and self.device_type == "cpu" else RowsPath)(store)
        self.flex = (Float8FlexPath if reads_cells_in_kernel(store) else FlexPath)(store, options)
        self.joint = JointPath(store)
        self._routes: dict = {}  # eager decisions, by kind of call (`choose`)
        self._reach: dict = {}  # `reach` decisions, by path and one token or more
        for path in (self.rows, self.flex):
            store.scratch.update(path.scratch(*self.reach(path.name)))

    def path_for(self, tokens: int, compiled: bool) -> str:
        """`"rows"` or `"flex"`: the path a step of `tokens` tokens takes (`AttentionOptions.path_for`)."""
        return self.options.path_for(self.device_type, tokens, compiled, self.store.config.dtype,
                                     quantized=self.quantized, flex_exact=self.flex_exact)

    def reach(self, name: str, tokens: Optional[int] = None) -> tuple:
        """`(eager, compiled)`: whether steps of `tokens` tokens (None: of any length) take path `name`
        eagerly, and compiled. The one rule behind the scratch, the plan parts and each call's route;
        decided once per question (the options are fixed when the cache is built)."""
        key = (name, None if tokens is None else min(tokens, 2))  # only one token or more matters
        found = self._reach.get(key)
        if found is None:
            lengths = (1, 2) if tokens is None else (key[1],)
            found = self._reach[key] = tuple(any(self.path_for(t, compiled) == name for t in lengths)
                                             for compiled in (False, True))
        return found

    def plan_parts(self, plan, eager_only: bool = False) -> None:
        """Add to `plan` what the paths its step takes read from it (`AttentionPath.plan_parts`); a plan
        made for eager calls only (`eager_only`) gets what eager calls read."""
        eager, compiled = self.reach("rows", plan.tokens)
        self.rows.plan_parts(plan, eager, compiled and not eager_only)

    def full_blocks_at(self, rows: int, tokens: int) -> bool:
        """Whether a step of `rows` x `tokens` is planned with full blocks (`FlexPath.full_blocks_at`)."""
        return self.flex.full_blocks_at(rows, tokens)

    def choose(self, tokens: int, group: int, compiling: bool, score_mod: bool, lse: bool, joined: bool = False):
        """`(Route, path)` of an `attend` call: the joint path for a call with `joined` keys, else
        `options.route` (which may refuse it), decided once per kind of call eagerly (the options are
        fixed when the cache is built), while tracing compiled."""
        if joined:
            return JOINT_ROUTE, self.joint
        key = (tokens, group, score_mod, lse)
        found = None if compiling else self._routes.get(key)
        if found is None:
            keys, values = self.flex.reads_cells(compiling)
            # Cells read as stored need a score_mod of their own (no shared region); values, a log-sum-exp.
            route = self.options.route(self.device_type, tokens, group, compiling, dtype=self.store.config.dtype,
                                       flex_exact=self.flex_exact, score_mod=score_mod or keys or values,
                                       sinks=lse or values, quantized=self.quantized)
            found = (route, self.rows if route.path == "rows" else self.flex)
            if not compiling:
                self._routes[key] = found
        return found
