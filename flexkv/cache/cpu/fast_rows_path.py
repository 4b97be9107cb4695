"""The rows path through the CPU fast paths: `FastRowsPath`, the plain `RowsPath` with each step sped up.

Chosen once, when a cache is built, unless `AttentionOptions.cpu_fast_paths`
is off (`flexkv.cache.path_choice`). It computes what the plain path
computes (`tests/test_cpu_fast_paths.py` checks both against the float64
reference) and differs in three places:

- **scratch**: the group buffer the rows path widens quantized cells into
  (`cpu_fast_rows.dequantize_scratch`), or copies gathered rows into
  (`gathered_rows.gather_scratch`, unquantized caches whose compiled steps
  gather too);
- **plan parts**: a chunk (T > 1) that takes this path eagerly and compiled
  on the CPU gets its geometry (`row_attention.RowGeometry`) with its plan,
  formed once by device ops on the plan's tensors and read by every layer;
- **the call**: the step's geometry through `cpu_fast_rows.geometry`
  (host-built for one-token steps, memoised in the store), then
  `cpu_fast_rows.attend` over the layer's cells and the cache's buffers.
"""

from __future__ import annotations

from ..paths.row_attention import device_geometry, repeat_queries, with_stream_index
from ..paths.rows_path import RowsPath
from ..positions.masks import store_mask_mod
from . import cpu_fast_rows

__all__ = ["FastRowsPath"]


class FastRowsPath(RowsPath):
    """The rows path of one store through the CPU fast paths (module docstring)."""

    def __init__(self, store):
        super().__init__(store)
        self._pools: dict = {}  # eager in-place views of each layer's slot pool, by layer (`_slot_pool`)

    def scratch(self, eager: bool, compiled: bool) -> dict:
        """The buffers this path needs when a cache's steps reach it `eager`ly and/or `compiled`: the
        group buffer quantized cells are widened into (reached at all), or unquantized gathered rows
        copied into (reached compiled: CPU `"auto"`, or path `"rows"`)."""
        s = self.store
        if s.config.slot_dtype is not None:
            return {"rows": cpu_fast_rows.dequantize_scratch(s.config, s.layout, s.device) if eager or compiled else None}
        return {"rows": cpu_fast_rows.gather_scratch(s.config, self.width, s.device) if compiled else None}

    def plan_parts(self, plan, eager: bool, compiled: bool) -> None:
        """A CPU chunk this path serves eagerly and compiled gets its geometry with its plan
        (`plan.extras["rows_geometry"]`, unpacked queries). A one-token step builds it at its first layer
        instead, from the host table (eagerly; `row_geometry`), since that geometry carries host
        facts of one plan a compiled step must not specialise on."""
        s = self.store
        if eager and compiled and s.device.type == "cpu" and plan.tokens > 1:
            T = plan.tokens
            geometry = self.geometry(plan, store_mask_mod(s, plan, T, False), T, s.config.dtype)
            # With each cell's stream index: a compiled layer's `score_mod` reads it instead of forming it.
            plan.extras["rows_geometry"] = with_stream_index(geometry, s.layout, plan)

    def step_geometry(self, call):
        """As `RowsPath.step_geometry`, except that every layer of a step whose plan carries its
        geometry (`plan_parts`) reads that one, compiled too (a compiled step takes it as inputs
        instead of forming it again in every layer)."""
        plan, qs = call.plan, call.q
        ahead = plan.extras.get("rows_geometry")  # built with the plan (`plan_parts`), unpacked
        if ahead is None or ahead.bias.dtype != qs.dtype:
            return super().step_geometry(call)
        T, gT = plan.tokens, qs.shape[2]
        g = gT // T
        if call.compiling:
            return repeat_queries(device_geometry(ahead), g), None
        return self.eager_geometry(plan, (gT, T, call.route.pack_gqa, qs.dtype),
                                   lambda: repeat_queries(ahead, g)), None

    def geometry(self, plan, mask_mod, q_len: int, dtype):
        """The step's geometry through `cpu_fast_rows.geometry` (memos in the store's `memos`)."""
        return cpu_fast_rows.geometry(self.store.layout, plan, mask_mod, q_len, dtype, self.width, self.store.memos)

    def attend(self, layer: int, qs, kc, vc, plan, mask_mod, score_mod, *, lse: bool, geometry, additive: bool = False,
               scales=None, compiling: bool = False, buffers: bool = True):
        """`cpu_fast_rows.attend`: `RowsPath.attend`'s result, using the cache's scratch and slot pool
        views where `buffers` allows."""
        in_place = geometry is not None and geometry.in_place
        pool = self._slot_pool(layer, kc, vc) if buffers and in_place and not compiling else None
        return cpu_fast_rows.attend(qs, kc, vc, self.store.layout, plan, mask_mod, score_mod, width=self.width,
                                    return_lse=lse, geo=geometry, additive=additive, scales=scales,
                                    scratch=self.store.scratch.get("rows") if buffers else None, pool=pool)

    def _slot_pool(self, layer_idx: int, kc, vc) -> tuple:
        """`cpu_fast_rows.slot_pool` of layer `layer_idx`'s buffers `kc`, `vc`, made once per buffer
        (eager calls only): the buffers are written in place, so their views stay current."""
        entry = self._pools.get(layer_idx)
        if entry is None or entry[0] is not kc or entry[1] is not vc:
            entry = self._pools[layer_idx] = (kc, vc, cpu_fast_rows.slot_pool(kc, vc, self.store.layout))
        return entry[2]
