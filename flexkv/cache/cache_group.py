"""`CacheGroup`: one layer group of a cache: its config, layout, device store and attention paths.

A `flexkv.cache.manager.BoundedKVManager` keeps its requests in one slot
table and their tokens in one `CacheGroup` per layer group (layers that keep
the same part of every stream, `flexkv.cache.groups.LayerGroup`). A group
holds no host state of its own: its `config` (the group's retention, windows
and head sizes), its `layout` (`flexkv.cache.host.layout`), its device store
(`flexkv.cache.storage.store.LayerStore`: one key and one value tensor per
layer, registered buffers allocated once, and the scratch its paths asked
for) and its attention paths (`flexkv.cache.path_choice.AttentionPaths`,
one chosen per call in one place). The cache routes each model layer to its
group and the group's layer index; the group plans a step from the cache's
one read of the table (`plan_from`) and answers `attend` for its layers:
check the call, write the step's tokens into the store, run the chosen path
and apply the epilogue (learned sinks, the log-sum-exp, query-only queries).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..config import BoundedKVConfig, check_layer_index
from ..step import BoundedKVStep
from .attend_modes import Attended, AttendModes
from .host.layout import Layout
from .host.planner import BoundedPlan, build_plan
from .path_choice import AttentionPaths, PathCall
from .paths.attention_options import AttentionOptions
from .paths.flex_path import apart_from_kernel
from .paths.joint_path import KeyPart, check_joined
from .paths.query_only import attend_query_only, check_query_only
from .paths.recall import MemoryIndex, MemoryTurns, check_recall_call, memory_select, memory_step
from .paths.recall_attention import attend_joined, attend_with_window, join_window, memory_part
from .paths.recall_region import attend_in_region
from .paths.row_attention import device_geometry, mask_geometry, repeat_queries
from .paths.sinks import apply_learned_sinks, check_sinks
from .positions.masks import POSITION_MODES, make_score_mod, store_mask_mod
from .positions.relative_position import RelativePositionScores
from .positions.rotary import SinkRotation, stream_positions
from .storage.store import LayerStore

__all__ = ["CacheGroup", "StoreBuffers"]


class StoreBuffers:
    """Mixin for an `nn.Module` whose `_store` (a `LayerStore`, or None) lends its buffers (`k_cache_{i}`,
    `v_cache_{i}`, `k_scale_{i}`, ...) as the module's own attributes: a group's, and a one-group cache's."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            store = self.__dict__.get("_store")
            if store is not None and name in store._buffers:
                return store._buffers[name]
            raise


class CacheGroup(AttendModes, StoreBuffers, nn.Module):
    """One layer group's device state and attention (module docstring).

    Args:
        config: the group's `BoundedKVConfig` (its layers, retention and head sizes; dtype settled).
        device: where its tensors live (a `torch.device`).
        options: how attention is computed (`AttentionOptions`), fixed for the cache's life.
        block_size: FlexAttention's KV block size; None lets flexkv choose for the config and device.
        store: builds the group's device store, `store(config, device, layout)`; None builds a
            `LayerStore`.
    """

    def __init__(self, config: BoundedKVConfig, device: torch.device, options: AttentionOptions, *,
                 block_size: Optional[int] = None, store: Optional[Callable[..., LayerStore]] = None):
        super().__init__()
        self.config = config
        self.device = device
        self.layout = Layout.for_config(config, block_size, device.type)
        if config.recall is not None and options.reaches_flex(device.type, config, self.layout):
            self.layout = self.layout.with_recall_region(config)  # the memory FlexAttention reads (recall_region)
        built = LayerStore(config, device, self.layout) if store is None else store(config, device, self.layout)
        if not isinstance(built, LayerStore) or built.config != config or built.layout != self.layout:
            raise ValueError(f"store(config, device, layout) must return a flexkv.cache.storage.store.LayerStore "
                             f"of that config and layout, got {type(built).__name__}")
        #: How attention is computed (`AttentionOptions`), fixed for the cache's life.
        self._options = options
        #: The device state: every layer's tensors (`flexkv.cache.storage.store.LayerStore`), a submodule.
        self.store = built
        object.__setattr__(self, "_store", built)  # the same, read without nn.Module's lookup
        #: The attention paths over the store and the one choice among them (their scratch is allocated now).
        self.paths = AttentionPaths(built, options)
        #: A `Recall` retention's block means (`flexkv.cache.paths.recall.MemoryIndex`), copied with the slots,
        #: and the turns its layers read their memory at under ``"cache"``-mode rotations (`MemoryTurns`).
        self.memory_index = None if config.recall is None else MemoryIndex(config, self.layout, device)
        self.memory_turns = None if config.recall is None else MemoryTurns(config, device)
        if self.memory_index is not None:
            built.keep_slot_state(self.memory_index)
        #: One ``"cache"``-mode rotation of each kind (rotary, inputs rotated or not) handed out by `rotation`:
        #: what their layers share is made with each compiled step's plan (`SinkRotation.prepare`).
        self._rotations: list = []

    # ------------------------------------------------------------------ views

    @property
    def options(self) -> AttentionOptions:
        """How this group computes attention (`AttentionOptions`), fixed when it was built."""
        return self._options

    @property
    def memory_bytes(self) -> int:
        """Bytes held by every layer's key and value tensors (sources, slots, scratch, padding), and
        the scratch its attention paths allocated (`LayerStore.memory_bytes`): the rows path's group
        buffer (`gathered_rows.gather_scratch`: 4 MiB, on the CPU unless path="flex", for a cache
        with sources whose gathered step would be larger); with quantized slots their scales too,
        the one layer of dequantized scratch the FlexAttention path reads (allocated with the cache
        off the CPU, or on it with options path="flex"; under path="auto" without the keys' or the
        values' half where the kernel reads those cells as stored, `flexkv.cache.paths.float8_path`) and
        the group buffer cells widen into (`cpu_fast_rows.dequantize_scratch`, unless path="flex" or cpu_fast_paths=False)."""
        memory = 0 if self.memory_index is None else self.memory_index.memory_bytes + self.memory_turns.memory_bytes
        return self._store.memory_bytes + memory

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over all layers, rows, keys and values (and their scales when quantized):
        the memory of one request."""
        return self._store.slot_bytes + (0 if self.memory_index is None else self.memory_index.slot_bytes)

    # ------------------------------------------------------------ model side

    def rotation(self, layer_idx: int, rotary, mode: str = "stream", *, rotated_inputs: bool = False) -> SinkRotation:
        """Rotary positions for layer `layer_idx` (`flexkv.cache.positions.rotary.SinkRotation`): call it as
        `q, k = rotation(q, k, plan)` before `attend`; in ``"cache"`` mode run its `check_step`
        on the host before planning (`flexkv.model.step_context.StepContext` does)."""
        rotation = SinkRotation(self, check_layer_index(layer_idx, self.config.num_layers), rotary, mode,
                                rotated_inputs=rotated_inputs)
        self._store.keep_slot_state(rotation)
        rotaries = [r.rotary for r in self._rotations]
        rotation.rotary_index = next((i for i, r in enumerate(rotaries) if r is rotary), len(rotaries))
        if mode == "cache" and not any(r.rotary is rotary and r.rotated_inputs == rotation.rotated_inputs
                                       for r in self._rotations):
            self._rotations.append(rotation)  # one per kind: each makes its kind's parts with a plan
        if self.config.recall is not None:
            self.memory_turns.set(layer_idx, rotary if mode == "cache" else None)
        return rotation

    def stream_positions(self, plan: BoundedPlan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` int64 on the device (contract
        section 2; padding rows count from 0). Traceable: no host sync."""
        if not isinstance(plan, BoundedPlan):
            raise ValueError(f"stream_positions needs this cache's plan (cache.plan(step)), got {type(plan).__name__}")
        return stream_positions(plan, plan.tokens if tokens is None else tokens, self.config.reverse_step_order)

    # ---------------------------------------------------------------- planning

    def plan_from(self, step: BoundedKVStep, slots: dict, private: dict, eager_only: bool = False) -> BoundedPlan:
        """This group's plan of a checked step, from the cache's one read of its table (`slots`:
        `SlotTable.slots()`, `private`: its private places). The
        attention paths the step takes add their parts (`AttentionPaths.plan_parts`)."""
        plan = build_plan(self.config, self.layout, step, slots.__getitem__, self.device,
                          self.paths.full_blocks_at(len(step.segments) * self.config.rows_per_request,
                                                    step.step_tokens),
                          private_source=private.get, parts=not eager_only)
        self.paths.plan_parts(plan, eager_only)
        if not eager_only:
            for rotation in self._rotations:
                rotation.prepare(plan)
        if self.memory_index is not None:
            self._recall_parts(plan)
        return plan

    def _recall_parts(self, plan: BoundedPlan) -> None:
        """What every layer of a `Recall` step reads alike, made once with its plan (device ops on the plan's
        tensors, no host read) so that a compiled step takes it as inputs instead of forming it in every
        layer: the memory's geometry (`memory_step`), the window's gathered cells and mask (unpacked
        queries), and each rotary's turn of the query sum."""
        T = plan.tokens
        kc = self._store.layer_kv(0)[0]
        step = memory_step(self.memory_index, self.memory_turns, self.config, self.layout, plan, T, kc.shape[1],
                           kc.shape[2])
        plan.extras["recall"] = step
        plan.extras["recall_turns"] = self.memory_turns.turn_matrices(step.t_mem.neg())
        if any(self.paths.reach("rows", T)):  # the window's geometry, unless every step takes FlexAttention
            # A chunk the CPU fast paths serve already carries it (`FastRowsPath.plan_parts`): the same one.
            window = plan.extras.get("rows_geometry")
            if window is None:
                window = mask_geometry(self.layout, plan, store_mask_mod(self._store, plan, T, False), T, self.config.dtype,
                                       self.paths.rows.width)
            plan.extras["recall_window"] = window

    def slot_buffers(self):
        """Every buffer of this group that holds per-slot state (`LayerStore.slot_buffers`): each layer's
        keys and values, and the un-rotated sink keys of its ``"cache"``-mode rotations."""
        return self.store.slot_buffers()

    # -------------------------------------------------------------- attention

    def path_for(self, tokens: int, compiled: bool = True) -> str:
        """The attention path (`"rows"` or `"flex"`) a step of `tokens` tokens takes, compiled or
        eagerly (`AttentionOptions.path_for`)."""
        return self.paths.path_for(tokens, compiled)

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BoundedPlan, *,
                scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
                sinks: Optional[torch.Tensor] = None, want_lse: bool = False,
                query_only: Optional[torch.Tensor] = None, joined: Optional[Sequence[KeyPart]] = None):
        """Write the step's tokens into layer `layer_idx` and attend over what each row may read (the modes:
        `flexkv.cache.attend_modes`).

        `q`: `[N, Hq, T, D]` (`Hq` a multiple of `num_heads`), `k`: `[N, num_heads, T, D]`, `v`:
        `[N, num_heads, T, Dv]` (`D = head_dim`, `Dv = value_head_dim`) with `N =
        len(step.segments) * rows_per_request`. Returns `[N, Hq, T, Dv]`, or with `want_lse` an `Attended`
        over every query. `score_mod(score, b, h, q_pos, kv_pos)` gets stream positions (`positions="stream"`)
        or in-cache positions (`positions="cache"`). One attention path per call (`flexkv.cache.path_choice`:
        the rows path or one FlexAttention call), chosen by `options.route`; traceable by
        `torch.compile(fullgraph=True)`. `sinks`: learned sink logits `[Hq]` (`flexkv.cache.paths.sinks`),
        served from the same call's log-sum-exp. `want_lse`: each query's natural-log sum of exp of its scores
        `[N, Hq, T]` (at least float32; the sink logit included; -inf where a query reads nothing), so that
        attention over this cache and over another set of keys can be merged into one softmax exactly
        (`flexkv.cache.paths.merge.merge_attention`); on the CPU it takes the rows path under `path="auto"`, as
        sinks do (`CPU_NO_LSE`). `query_only`: queries `[N, Hq, Q, D]` that write nothing and attend what each
        row's newest own token attends (`flexkv.cache.paths.query_only`), appended after the step's `T` in the
        result (only with `want_lse`). `joined`: `KeyPart`s (keys and values kept elsewhere: another cache's
        `write_part`, keys recomputed every step) that join every query's softmax
        (`flexkv.cache.paths.joint_path`; no `score_mod` then; only with `want_lse`).
        """
        self._check_attend(layer_idx, q, k, v, plan)
        relative = self._check_extras(q, score_mod, positions, sinks, query_only)
        if joined is not None:
            joined = check_joined(joined, q, query_only, self.config, self.device, score_mod)
        N, Hq, T, D = q.shape
        H, c, compiling = k.shape[1], self.config, torch.compiler.is_compiling()
        if c.recall is not None:
            check_recall_call(c, query_only, joined, relative)
        # The call needs a log-sum-exp: for itself, its sinks, or a Recall memory joined to FlexAttention's window
        # (`join_window`: with a score_mod, or values the kernel reads as stored); else a Recall memory is read
        # in the window's softmax (`recall_region`, `attend_joined`).
        in_region = c.recall is not None and score_mod is None and not any(self.paths.flex.reads_cells(compiling))
        need_lse = sinks is not None or want_lse or (c.recall is not None and not in_region)
        route, path = self.paths.choose(T, Hq // H, compiling, score_mod is not None, need_lse, joined is not None)
        kc, vc = self._store.write(layer_idx, k, v, plan)  # after the choice, which may refuse the call
        ks, vs = self._store.layer_scales(layer_idx)
        scales = None if ks is None else (ks, vs)
        scale = D ** -0.5 if scale is None else scale
        if joined is not None:  # own and query-only queries in one softmax with the joined keys
            out, lse = path(PathCall(layer_idx, q, kc, vc, scales, plan, route, None, need_lse, False, compiling,
                                     query_only, joined, scale))
            return _epilogue(out, lse, sinks, True)
        g = Hq // H if route.pack_gqa else 1
        # A relative-position table is read at the query's own token (`RelativePositionScores.at`).
        sm = None if score_mod is None else make_score_mod(
            plan, self.layout.ring_len, T, score_mod.at if relative else score_mod, positions, c.reverse_step_order,
            c.query_window, group=g, query_index=relative)
        if c.recall is not None:  # the memory part in the same softmax (flexkv.cache.paths.recall)
            if in_region and route.path != "rows":  # one FlexAttention call, the chosen memory in its region
                out, lse = self._attend_in_region(layer_idx, q, kc, vc, scales, plan, route, scale, need_lse)
            else:
                out, lse = self._attend_recall(layer_idx, q, kc, vc, scales, plan, route, path, sm, scale, score_mod,
                                               positions, relative, compiling)
        else:
            # The scale is applied to q here rather than inside the call (TORCH_WORKAROUNDS["Q_VIEW"]): the
            # product is a fresh buffer. Packed, query head h * g + i sits at rows i * T .. i * T + T - 1 of KV
            # head h: the same [N, Hq, T] view serves the output and its log-sum-exp.
            qs = (q.reshape(N, H, g * T, D) if route.pack_gqa else q) * scale
            out, lse = path(PathCall(layer_idx, qs, kc, vc, scales, plan, route, sm, need_lse, relative, compiling))
            out = out.view(N, Hq, T, v.shape[3])
        own = _epilogue(out, lse, sinks, want_lse or query_only is not None)
        if query_only is None:
            return own
        extra = attend_query_only(self.paths.rows, query_only, kc, vc, plan, scale=scale, score_mod=score_mod,
                                  positions=positions, sinks=sinks, want_lse=True, scales=scales)
        return Attended(torch.cat([own[0], extra[0]], dim=2), torch.cat([own[1], extra[1]], dim=2))

    def _attend_recall(self, layer_idx, q, kc, vc, scales, plan, route, path, sm, scale, score_mod, positions, relative,
                       compiling):
        """`(out, lse)` of a `Recall` layer's call: its memory part and its window in one softmax. On the rows
        path the window's cells are gathered with the chosen memory entries, on the CPU into one call of its
        fused attention kernel (`attend_joined`), elsewhere or with a `score_mod` into the memory's softmax
        (`attend_with_window`). Through FlexAttention the chosen entries are copied next to the window and read
        in its one call (`_attend_in_region`, chosen in `_attend`); with a `score_mod` (or values read as
        stored) the window is attended with its log-sum-exp and the memory part joined (`join_window`)."""
        c = self.config
        N, Hq, T, D = q.shape
        H = kc.shape[1]
        g = Hq // H if route.pack_gqa else 1
        memo = {} if compiling else self._store.per_plan(plan)
        if route.path == "rows" and sm is None and q.device.type == "cpu":  # one fused CPU kernel call
            sel = memory_select(self.memory_index, self.memory_turns, layer_idx, q, kc, scales, plan, scale=scale)
            window = plan.extras["recall_window"]  # made with the plan (`_recall_parts`), unpacked queries
            return attend_joined(sel, self.memory_turns, layer_idx, c, plan, kc, vc, scales,
                                 device_geometry(window) if compiling else window, q.dtype, c.max_retained + T, memo)
        memory = memory_part(self.memory_index, self.memory_turns, layer_idx, c, q, kc, vc, scales, plan,
                             scale=scale, score_mod=score_mod, positions=positions)
        if route.path == "rows":
            window = plan.extras["recall_window"]  # made with the plan (`_recall_parts`), unpacked queries
            geometry = repeat_queries(device_geometry(window) if compiling else window, g)
            return attend_with_window(memory, kc, vc, scales, geometry, sm, q.dtype, c.max_retained + T, memo)
        qs = (q.reshape(N, H, g * T, D) if route.pack_gqa else q) * scale  # a fresh buffer (Q_VIEW, above)
        out, lse = path(PathCall(layer_idx, qs, kc, vc, scales, plan, route, sm, True, relative, compiling))
        return join_window((out.view(N, Hq, T, -1), lse), memory)

    def _attend_in_region(self, layer_idx, q, kc, vc, scales, plan, route, scale, need_lse):
        """A `Recall` layer through one FlexAttention call over its window and its chosen memory
        (`flexkv.cache.paths.recall_region`); `need_lse`: whether the call forms its log-sum-exp."""
        if not self.layout.recall_rows:
            raise RuntimeError("a Recall step took FlexAttention, but the cache's layout holds no memory region "
                               "(AttentionOptions.reaches_flex said no step would)")
        N, Hq, T, D = q.shape
        H = kc.shape[1]
        flex = self.paths.flex
        sel = memory_select(self.memory_index, self.memory_turns, layer_idx, q, kc, scales, plan, scale=scale)
        kf, vf = (kc, vc) if scales is None else flex.dequantized_layer(kc, scales[0], vc, scales[1], q.dtype)
        qs = (q.reshape(N, H, Hq // H * T, D) if route.pack_gqa else q) * scale  # a fresh buffer (Q_VIEW)
        out, lse = attend_in_region(sel, self.memory_turns, layer_idx, self.config, self._store, plan,
                                    (kc, vc, scales), (kf, vf), qs, route.pack_gqa, flex.kernel_options(qs, H),
                                    route.path == "region", need_lse)
        out = apart_from_kernel(out) if route.barrier else out
        return out.view(N, Hq, T, -1), None if lse is None else lse.reshape(N, Hq, T)

    def _check_extras(self, q, score_mod, positions, sinks, query_only) -> bool:
        """Check `attend`'s optional arguments; returns whether `score_mod` is a relative-position table."""
        if sinks is not None:
            check_sinks(sinks, q.shape[1], self.device)
        if query_only is not None:
            check_query_only(query_only, q)
        if positions not in POSITION_MODES:
            raise ValueError(f"attend: positions must be one of {POSITION_MODES}, got {positions!r}")
        relative = isinstance(score_mod, RelativePositionScores)
        if relative and positions != "stream":
            raise ValueError(f"attend: a RelativePositionScores score_mod reads stream positions; got "
                             f"positions={positions!r}: pass positions='stream'")
        if relative and query_only is not None:
            raise ValueError("attend: query_only queries take no RelativePositionScores score_mod (its table is "
                             "formed for the step's own queries); attend them with a score_mod of their own")
        return relative

    def write_part(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan: BoundedPlan) -> KeyPart:
        """Write the step's tokens into layer `layer_idx` as `attend` does, and return the cells each row's
        newest own token reads as a `KeyPart` that another cache's `attend_joined` reads in
        its softmax (`flexkv.cache.paths.joint_path`): the layer's attention for this step, computed there.
        `k`, `v` as in `attend`."""
        self._check_attend(layer_idx, k, k, v, plan)
        kc, vc = self._store.write(layer_idx, k, v, plan)
        ks, vs = self._store.layer_scales(layer_idx)
        return self.paths.joint.part(kc, vc, None if ks is None else (ks, vs), plan)

    def _check_attend(self, layer_idx, q, k, v, plan) -> None:
        c = self.config
        check_layer_index(layer_idx, c.num_layers)
        if (isinstance(plan, BoundedPlan) and type(q) is type(k) is type(v) is torch.Tensor
                and q.dtype == k.dtype == v.dtype == c.dtype and q.device == k.device == v.device == self.device
                and tuple(k.shape) == (plan.rows, c.num_heads, plan.tokens, c.head_dim)
                and tuple(v.shape) == (plan.rows, c.num_heads, plan.tokens, c.value_head_dim) and q.dim() == 4
                and q.shape[0] == plan.rows and q.shape[1] % c.num_heads == 0 and q.shape[2] == plan.tokens
                and q.shape[3] == c.head_dim and plan.tokens <= c.max_step_tokens):
            return  # every check below passes: one comparison chain (a compiled step traces this per layer)
        if not isinstance(plan, BoundedPlan):
            raise ValueError(f"attend needs this cache's plan: pass plan=manager.plan(step), got {type(plan).__name__}")
        N, T = plan.rows, plan.tokens
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"attend: {name} must be a 4-D tensor [N, heads, T, head_dim], got {got}")
            if t.dtype != c.dtype:
                raise ValueError(f"attend: {name} dtype expected {c.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"attend: {name} device expected {self.device}, got {t.device}")
        if q.shape[2] > c.max_step_tokens:
            raise ValueError(f"attend: T={q.shape[2]} exceeds max_step_tokens={c.max_step_tokens}")
        for name, t, width in (("k", k, c.head_dim), ("v", v, c.value_head_dim)):
            want_kv = (N, c.num_heads, T, width)
            if tuple(t.shape) != want_kv:
                dim = "head_dim" if name == "k" else "value_head_dim"
                raise ValueError(
                    f"attend: {name} shape expected {want_kv} (rows, num_heads, plan T, {dim}), got {tuple(t.shape)}"
                    + (f"; the plan was made for T={T}: set BoundedKVStep(tokens=...)" if t.shape[2] != T else "")
                )
        Hq = q.shape[1]
        if tuple(q.shape) != (N, Hq, T, c.head_dim) or Hq % c.num_heads:
            raise ValueError(
                f"attend: q shape expected ({N}, a multiple of num_heads={c.num_heads}, {T}, {c.head_dim}), "
                f"got {tuple(q.shape)}"
            )


def _epilogue(out: torch.Tensor, lse, sinks, return_lse: bool):
    """A call's output `[N, Hq, T, Dv]` with learned `sinks` joined (from its log-sum-exp `lse`), and the
    log-sum-exp `[N, Hq, T]` beside it with `return_lse` (the sink logit included)."""
    if lse is not None:
        N, Hq, T = out.shape[:3]
        lse = lse.reshape(N, Hq, T)
        if sinks is not None:
            out = apply_learned_sinks(out, lse, sinks)
            if return_lse:
                lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, Hq, 1))
    return Attended(out, lse) if return_lse else out
