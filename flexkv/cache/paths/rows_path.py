"""The rows path as a cache's attention path: each row's cells, then dense attention (`row_attention`).

`flexkv.cache.paths.choice` chooses it per call; this module answers the three
things every path answers (`flexkv.cache.paths.choice.AttentionPath`), in one of
two ways set by `AttentionOptions.cpu_fast_paths`:

- off: the plain reference, `row_attention.mask_geometry` and
  `row_attention.attend_rows` (no scratch, no plan parts, no memos, no
  custom ops);
- on (the default): through the one boundary of the CPU fast paths,
  `flexkv.cache.cpu.cpu_fast_rows`, which computes the same thing.

With the fast paths on:

- **scratch**: the group buffer the rows path widens quantized cells into
  (`cpu_fast_rows.dequantize_scratch`), or copies gathered rows into
  (`gathered_rows.gather_scratch`, unquantized caches whose compiled steps
  gather too);
- **plan parts**: a chunk (T > 1) that takes this path eagerly and compiled
  on the CPU gets its geometry (`row_attention.RowGeometry`) with its plan,
  formed once by device ops on the plan's tensors and read by every layer;
- **the call**: the geometry of the step (built with the plan, at the
  first layer eagerly, or traced in every layer of a compiled step), then
  `cpu_fast_rows.attend` over the layer's cells.
"""

from __future__ import annotations

from ..cpu import cpu_fast_rows
from .row_attention import attend_rows, device_geometry, gather_width, mask_geometry, repeat_queries

__all__ = ["RowsPath"]


class RowsPath:
    """The rows path of one store (`flexkv.cache.storage.store.LayerStore`); `fast`: through the CPU fast paths
    (`AttentionOptions.cpu_fast_paths`), else the plain reference."""

    name = "rows"

    def __init__(self, store, fast: bool = True):
        self.store = store
        self.fast = fast
        self.width = gather_width(store.config)  # cells a gathered row holds (the config is frozen)
        self._pools: dict = {}  # eager in-place views of each layer's slot pool, by layer (`_slot_pool`)

    def scratch(self, eager: bool, compiled: bool) -> dict:
        """The buffers this path needs when a cache's steps reach it `eager`ly and/or `compiled`: the
        group buffer quantized cells are widened into (reached at all), or unquantized gathered rows
        copied into (reached compiled: CPU `"auto"`, or path `"rows"`)."""
        s = self.store
        if not self.fast:
            return {"rows": None}
        if s.config.slot_dtype is not None:
            return {"rows": cpu_fast_rows.dequantize_scratch(s.config, s.layout, s.device) if eager or compiled else None}
        return {"rows": cpu_fast_rows.gather_scratch(s.config, self.width, s.device) if compiled else None}

    def plan_parts(self, plan, eager: bool, compiled: bool) -> None:
        """A CPU chunk this path serves eagerly and compiled gets its geometry with its plan
        (`plan.rows_geometry`, unpacked queries). A one-token step builds it at its first layer
        instead, from the host table (eagerly; `row_geometry`), since that geometry carries host
        facts of one plan a compiled step must not specialise on."""
        s = self.store
        if self.fast and eager and compiled and s.device.type == "cpu" and plan.tokens > 1:
            T = plan.tokens
            plan.rows_geometry = self.geometry(plan, s.mask_mod(plan, T, False), T, s.config.dtype)

    def __call__(self, call):
        """`(out, log-sum-exp or None)` of one `attend` call (`flexkv.cache.paths.choice.PathCall`)."""
        s, plan, qs = self.store, call.plan, call.q
        T = plan.tokens
        pack, gT = call.route.pack_gqa, qs.shape[2]
        geometry = mask_mod = None
        ahead = getattr(plan, "rows_geometry", None)  # built with the plan (`plan_parts`), unpacked
        if ahead is not None and ahead.bias.dtype == qs.dtype:
            # Every layer of the step reads the one geometry built with the plan, compiled too (a
            # compiled step takes it as inputs instead of forming it again in every layer).
            g = gT // T
            if call.compiling:
                geometry = repeat_queries(device_geometry(ahead), g)
            else:
                geometry = self.eager_geometry(plan, (gT, T, pack, qs.dtype), lambda: repeat_queries(ahead, g))
        elif call.compiling:
            mask_mod = s.mask_mod(plan, T, pack)
        else:
            # Eagerly, every layer of the step shares the plan's geometry (cells, mask bias): built at
            # the first layer. Everything the mask depends on besides the plan and the cache's config
            # is in the key.
            geometry = self.eager_geometry(
                plan, (gT, T, pack, qs.dtype),
                lambda: self.geometry(plan, s.mask_mod(plan, T, pack), gT, qs.dtype))
        out = self.attend(call.layer, qs, call.k_cells, call.v_cells, plan, mask_mod, call.score_mod, lse=call.lse,
                          geometry=geometry, additive=call.additive, scales=call.scales, compiling=call.compiling)
        return out if call.lse else (out, None)

    def geometry(self, plan, mask_mod, q_len: int, dtype):
        """The step's `row_attention.RowGeometry` for queries of length `q_len`: through
        `cpu_fast_rows.geometry` (memos in the store's `memos`), or the plain `mask_geometry`."""
        lay = self.store.layout
        if self.fast:
            return cpu_fast_rows.geometry(lay, plan, mask_mod, q_len, dtype, self.width, self.store.memos)
        return mask_geometry(lay, plan, mask_mod, q_len, dtype, self.width)

    def attend(self, layer: int, qs, kc, vc, plan, mask_mod, score_mod, *, lse: bool, geometry, additive: bool = False,
               scales=None, compiling: bool = False, buffers: bool = True):
        """Attention of the scaled queries `qs` over layer `layer`'s cells `kc`, `vc` (`attend_rows`'s
        result): the one place the rows path enters the CPU fast paths (`cpu_fast_rows.attend`), or
        runs the plain reference (`row_attention.attend_rows`). `buffers`: the fast paths may use the
        cache's scratch and slot pool views (query-only queries do not)."""
        lay = self.store.layout
        if not self.fast:
            return attend_rows(qs, kc, vc, lay, plan, mask_mod, score_mod, width=self.width, return_lse=lse,
                               geometry=geometry, additive=additive, scales=scales)
        in_place = geometry is not None and geometry.in_place
        pool = self._slot_pool(layer, kc, vc) if buffers and in_place and not compiling else None
        return cpu_fast_rows.attend(qs, kc, vc, lay, plan, mask_mod, score_mod, width=self.width, return_lse=lse,
                                    geo=geometry, additive=additive, scales=scales,
                                    scratch=self.store.scratch.get("rows") if buffers else None, pool=pool)

    def eager_geometry(self, plan, key: tuple, build):
        """The rows path's geometry of `plan` under `key`, built once per plan (eager calls only)."""
        state = self.store.per_plan(plan)
        geo = state.get(key)
        if geo is None:
            geo = state[key] = build()
        return geo

    def _slot_pool(self, layer_idx: int, kc, vc) -> tuple:
        """`cpu_fast_rows.slot_pool` of layer `layer_idx`'s buffers `kc`, `vc`, made once per buffer
        (eager calls only): the buffers are written in place, so their views stay current."""
        entry = self._pools.get(layer_idx)
        if entry is None or entry[0] is not kc or entry[1] is not vc:
            entry = self._pools[layer_idx] = (kc, vc, cpu_fast_rows.slot_pool(kc, vc, self.store.layout))
        return entry[2]
