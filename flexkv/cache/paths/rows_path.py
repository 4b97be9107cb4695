"""The rows path as a cache's attention path: each row's cells, then dense attention (`row_attention`).

`flexkv.cache.path_choice` chooses it per call; this module is the plain
reference a reader should see first: `row_attention.mask_geometry` and
`row_attention.attend_rows`, with no scratch, no plan parts, no memos and no
custom ops. The CPU fast paths are a class of their own over the same calls,
`flexkv.cache.cpu.fast_rows_path.FastRowsPath`, chosen once when the cache is
built (`AttentionOptions.cpu_fast_paths`); both compute the same thing.
"""

from __future__ import annotations

from ..positions.masks import store_mask_mod
from .row_attention import attend_rows, gather_width, mask_geometry

__all__ = ["RowsPath"]


class RowsPath:
    """The plain rows path of one store (`flexkv.cache.storage.store.LayerStore`)."""

    name = "rows"

    def __init__(self, store):
        self.store = store
        self.width = gather_width(store.config)  # cells a gathered row holds (the config is frozen)

    def scratch(self, eager: bool, compiled: bool) -> dict:
        """The plain path allocates nothing."""
        return {"rows": None}

    def plan_parts(self, plan, eager: bool, compiled: bool) -> None:
        """The plain path adds nothing to a plan."""

    def step_geometry(self, call):
        """`(geometry, mask_mod)` of a call: eagerly, the plan's geometry (cells, mask bias), built at
        the first layer and shared by every layer of the step (everything the mask depends on besides
        the plan and the cache's config is in the key); compiled, the mask to trace instead."""
        s, plan, qs = self.store, call.plan, call.q
        T, pack, gT = plan.tokens, call.route.pack_gqa, call.q.shape[2]
        if call.compiling:
            return None, store_mask_mod(s, plan, T, pack)
        return self.eager_geometry(plan, (gT, T, pack, qs.dtype),
                                   lambda: self.geometry(plan, store_mask_mod(s, plan, T, pack), gT, qs.dtype)), None

    def __call__(self, call):
        """`(out, log-sum-exp or None)` of one `attend` call (`flexkv.cache.path_choice.PathCall`)."""
        geometry, mask_mod = self.step_geometry(call)
        out = self.attend(call.layer, call.q, call.k_cells, call.v_cells, call.plan, mask_mod, call.score_mod,
                          lse=call.lse, geometry=geometry, additive=call.additive, scales=call.scales,
                          compiling=call.compiling)
        return out if call.lse else (out, None)

    def geometry(self, plan, mask_mod, q_len: int, dtype):
        """The step's `row_attention.RowGeometry` for queries of length `q_len`."""
        return mask_geometry(self.store.layout, plan, mask_mod, q_len, dtype, self.width)

    def attend(self, layer: int, qs, kc, vc, plan, mask_mod, score_mod, *, lse: bool, geometry, additive: bool = False,
               scales=None, compiling: bool = False, buffers: bool = True):
        """Attention of the scaled queries `qs` over layer `layer`'s cells `kc`, `vc`
        (`row_attention.attend_rows`'s result). `buffers`: whether the call may use the cache's
        scratch (query-only queries do not; the plain path never does)."""
        return attend_rows(qs, kc, vc, self.store.layout, plan, mask_mod, score_mod, width=self.width,
                           return_lse=lse, geometry=geometry, additive=additive, scales=scales)

    def eager_geometry(self, plan, key: tuple, build):
        """The rows path's geometry of `plan` under `key`, built once per plan (eager calls only)."""
        state = self.store.per_plan(plan)
        geo = state.get(key)
        if geo is None:
            geo = state[key] = build()
        return geo
