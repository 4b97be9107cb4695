"""`BoundedKVManager`: a slot table and the device store of its layers.

Host state (which request holds which slot, what each has committed) lives
in a `flexkv.cache.slots.SlotTable`, plain Python objects behind its lock.
Device state is one key and one value tensor per layer, registered buffers
allocated once (see `flexkv.cache.layout`), and the attention step over them.
A step goes `admit -> plan -> attend (per layer) -> commit`.

A manager keeps a table of its own, or (`slots=`) stores one layer group of
a `flexkv.cache.groups.GroupedKVManager` over the table every group shares:
the lifecycle then acts on that one table, and only sources (which must
reach every group's tensors) go through the grouped cache.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Hashable, Optional

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from ..config import BoundedKVConfig, check_config, check_layer_index
from ..step import BoundedKVStep, StreamPosition
from . import quantized
from .attention_options import AttentionOptions, Route
from .flex_call import flex_call, flex_layer, plan_block_mask
from .gathered_rows import gather_scratch
from .kernel_options import cpu_kernel_block_exact, flex_kernel_options
from .layout import Layout
from .masks import POSITION_MODES, make_mask_mod, make_score_mod
from .planner import BoundedPlan, build_plan
from .query_only import attend_query_only, check_query_only
from .relative_position import RelativePositionScores
from .rotary import SinkRotation, stream_positions
from .row_attention import (
    attend_rows,
    dequantize_scratch,
    device_geometry,
    gather_width,
    repeat_queries,
    row_geometry,
    slot_pool,
)
from .sinks import apply_learned_sinks, check_sinks
from .slot_copy import SlotBuffer, fork_slot, reorder_slots
from .slots import SlotsExhausted, SlotTable, SourcesExhausted, TableViews
from .sources import check_source_shapes

__all__ = ["BoundedKVManager", "SlotsExhausted", "SourcesExhausted"]

def _apart_from_kernel(out: torch.Tensor) -> torch.Tensor:
    """`out` itself, read through a gather along its first dimension.

    Inductor fuses an elementwise consumer of a template's output into the
    template's kernel only when the consumer reads the output at the index it
    writes; the CPU FlexAttention template then fails ("Unsupported for
    `epilogue_nodes` in CppFlexAttentionTemplate"). An indirect read is not
    that index, so the consumer (`o * 2`, a gate, the caller's own ops) runs
    as a kernel of its own, fused with this gather: one extra read of the
    output, no extra kernel when something elementwise follows.
    """
    return out.index_select(0, torch.arange(out.shape[0], device=out.device))


class _MovedToOptions:
    """A former attention knob of the manager: settable no more (the options are fixed at build)."""

    def __set_name__(self, owner, name):
        self.name = name
        self.field = "path" if name == "attention_path" else name

    def _moved(self):
        return AttributeError(
            f"BoundedKVManager.{self.name} is fixed when the cache is built: pass "
            f"options=AttentionOptions.for_cache(config, device, {self.field}=...) to BoundedKVManager "
            f"and read it as manager.options.{self.field}")

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise self._moved()

    def __set__(self, obj, value):
        raise self._moved()


class BoundedKVManager(TableViews, nn.Module):
    """A bounded sink + window KV cache for `config.max_slots` requests (docs/contract.md section 5).

    Args:
        config: the cache's `BoundedKVConfig`; its `dtype` must be settled
            (build through `BoundedKVResource` to take the engine's).
        device: where the KV tensors live. `"meta"` allocates nothing and
            still plans, exactly as CUDA would (block size and full blocks), which
            shows that planning never touches device data.
        block_size: FlexAttention's KV block size (cells per block); None (the default) lets
            flexkv choose for the config and device (`flexkv.cache.layout.default_block_size`).
        slots: the `SlotTable` to keep the requests in; None (the default) makes one. A
            `GroupedKVManager` passes the table all its groups share; such a manager stores one
            group and refuses sources of its own (the grouped cache writes them in every group).
        options: how attention is computed (`flexkv.cache.attention_options.AttentionOptions`:
            path, GQA packing, full blocks, epilogue barrier, kernel sharing), fixed for the cache's
            life; None (the default) takes `AttentionOptions.for_cache(config, device)`.
    """

    def __init__(self, config: BoundedKVConfig, device="cpu", *, block_size: Optional[int] = None,
                 slots: Optional[SlotTable] = None, options: Optional[AttentionOptions] = None):
        super().__init__()
        check_config(config)
        if config.dtype is None:
            raise ValueError(
                "config.dtype is None: the KV dtype is settled by the engine; build the cache with "
                "BoundedKVResource().build(spec, EngineResourceInfo(device, kv_dtype)) or set config.dtype"
            )
        self.config = config
        self.device = torch.device(device)
        self.layout = Layout.for_config(config, block_size, self.device.type)
        #: Whether the compiled CPU FlexAttention kernel is exact at this cache's KV block size
        #: (`flexkv.cache.kernel_options.cpu_kernel_block_exact`; where it is not, `"auto"` takes the
        #: rows path and `"flex"` is refused). A plain bool: every compiled layer reads it.
        self._cpu_kernel_exact = self.device.type != "cpu" or cpu_kernel_block_exact(self.layout.block_size)
        shape = (1, config.num_heads, self.layout.total_len, config.head_dim)
        v_shape = shape[:3] + (config.value_head_dim,)
        # Quantized slots (flexkv.cache.quantized): cells in slot_dtype, plus a scale per cell and head.
        cells = config.dtype if config.slot_dtype is None else config.slot_dtype
        for i in range(config.num_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=cells, device=self.device))
            self.register_buffer(f"v_cache_{i}", torch.zeros(v_shape, dtype=cells, device=self.device))
            if config.slot_dtype is not None:
                for kv in "kv":
                    self.register_buffer(f"{kv}_scale_{i}", torch.ones(shape[:3] + (1,), dtype=quantized.SCALE_DTYPE,
                                                                      device=self.device))
        # With a plan's write cells `[N, 1, T]`, the index of the step's `[N, H, T, D]` keys in a
        # layer tensor `[1, H, S, D]`: one index_put per tensor, nothing reshaped.
        self.register_buffer("_zero_index", torch.zeros(1, 1, 1, dtype=torch.long, device=self.device),
                             persistent=False)
        self.register_buffer(
            "_head_index", torch.arange(config.num_heads, device=self.device).view(1, -1, 1), persistent=False
        )
        if slots is not None and not isinstance(slots, SlotTable):
            raise ValueError(f"slots must be a flexkv.cache.slots.SlotTable or None, got {type(slots).__name__}")
        if slots is not None:
            slots.check_shares(config, "this manager")
        #: Whether the table is shared with other layer groups' stores (then sources come through them all).
        self._shared = slots is not None
        #: Host bookkeeping: slots, requests, source places (`flexkv.cache.slots`), under its lock.
        self.slots = SlotTable(config) if slots is None else slots
        self._lock = self.slots.lock
        if options is None:
            options = AttentionOptions.for_cache(config, self.device)
        elif not isinstance(options, AttentionOptions):
            raise ValueError(
                f"options must be a flexkv.cache.attention_options.AttentionOptions or None, got "
                f"{type(options).__name__}; build one with AttentionOptions.for_cache(config, device, ...)")
        #: How attention is computed (`AttentionOptions`), fixed for the cache's life.
        self._options = options
        # Quantized slots on the FlexAttention path: dequantized copies of one layer, allocated now
        # when the options let a step take that path (`_allocate_scratch`).
        self._scratch_k = self._scratch_v = None
        # Compiled float8 steps on CUDA may read cells as stored (`_cells_in_kernel`); values read so
        # take a second call over one zero cell (`quantized.lse_values`).
        self._in_kernel_device = (self.device.type in quantized.CELLS_IN_KERNEL
                                  and config.slot_dtype == torch.float8_e4m3fn)
        self._lse_values = None
        #: The rows path's group buffer: quantized cells are dequantized into it, gathered rows copied.
        self._row_scratch = None
        self._allocate_scratch()
        # Per-slot buffers kept for this store outside it (the "cache"-mode rotations it made): a
        # fork or reorder copies their slots too. Weak, so a dropped rotation is dropped here.
        self._slot_state = weakref.WeakSet()
        # Eagerly, the per-plan work (the rows path's cells and mask bias, the write cells) is done
        # once per plan and reused by every layer: the last plan seen (a weak reference) and what its
        # layers share, dropped at commit. A plain list, so that a step's start and end do not go
        # through `nn.Module.__setattr__`.
        self._eager_step: list = [None, {}]
        self._gather_width = gather_width(config)  # cells a gathered row holds (the config is frozen)
        self._kv_names = tuple((f"k_cache_{i}", f"v_cache_{i}") for i in range(config.num_layers))
        self._routes: dict = {}  # eager `options.route` decisions, by kind of call (`_route`)
        self._pools: dict = {}  # eager in-place views of each layer's slot pool, by layer (`_slot_pool`)
        cuda = self.device.type == "cuda"
        # Read once, on the host: what the CUDA kernels are tuned and split by.
        self._capability = torch.cuda.get_device_capability(self.device) if cuda else None
        self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else None
        # A KV block the CUDA kernels cannot compile is refused here, not at the first compiled step.
        flex_kernel_options(self.device.type, 1, config.num_heads, config.num_heads, config.head_dim,
                            config.dtype, self.layout.block_size, q_block_size=self.layout.q_block_size)

    # Former knobs, now `options` fields: setting one raises and says how to pass it.
    pack_gqa = _MovedToOptions()
    epilogue_barrier = _MovedToOptions()
    full_blocks = _MovedToOptions()
    attention_path = _MovedToOptions()
    share_flex_kernel = _MovedToOptions()

    # ------------------------------------------------------------------ views

    @property
    def options(self) -> AttentionOptions:
        """How this cache computes attention (`AttentionOptions`), fixed when it was built."""
        return self._options


    # ------------------------------------------------------ the cache protocol
    # What every flexkv cache offers the front doors above it (`flexkv.cache.protocol.StreamCache`).

    #: `attend` traces under `torch.compile(fullgraph=True)`.
    compilable = True

    def layer_config(self, layer_idx: int) -> BoundedKVConfig:
        """The config that governs layer `layer_idx` (its retention and windows): this cache's own."""
        check_layer_index(layer_idx, self.config.num_layers)
        return self.config

    def layer_manager(self, layer_idx: int):
        """`(manager, index in it)` holding layer `layer_idx`: this manager and the same index.
        Deprecated, goes in flexkv 0.3 (nothing calls it: a layer's config is `layer_config`)."""
        warnings.warn("BoundedKVManager.layer_manager() is deprecated and goes in flexkv 0.3; the layer lives in "
                      "this cache at the index you hold, and layer_config(layer_idx) gives its config",
                      DeprecationWarning, stacklevel=2)
        return self, check_layer_index(layer_idx, self.config.num_layers)

    def rotation(self, layer_idx: int, rotary, mode: str = "stream") -> SinkRotation:
        """Rotary positions for layer `layer_idx` (`flexkv.cache.rotary.SinkRotation`): call it as
        `q, k = rotation(q, k, plan)` before `attend`; in ``"cache"`` mode run its `check_step`
        on the host before planning (`flexkv.model.wrap.StepContext` does)."""
        rotation = SinkRotation(self, check_layer_index(layer_idx, self.config.num_layers), rotary, mode)
        self._slot_state.add(rotation)
        return rotation

    def stream_positions(self, plan: BoundedPlan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` int64 on the device (contract
        section 2; padding rows count from 0). Traceable: no host sync."""
        if not isinstance(plan, BoundedPlan):
            raise ValueError(f"stream_positions needs this cache's plan (cache.plan(step)), got {type(plan).__name__}")
        return stream_positions(plan, plan.tokens if tokens is None else tokens, self.config.reverse_step_order)

    def _layer_kv(self, layer_idx):
        """Layer `layer_idx`'s key and value buffers, `[1, num_heads, S, head_dim]` and `[.., value_head_dim]`.

        Every layer keeps tensors of its own (`k_cache_{i}`, `v_cache_{i}`):
        inductor's CPU FlexAttention kernel reads a key or value view from its
        storage's start, ignoring the view's offset (torch 2.11 to 2.15), so a
        layer sliced out of one stacked tensor would read layer 0 when compiled.

        Under `torch.compile` a layer index may arrive as a symbolic int (a
        compiled `attend` called with one layer after another). It is compared
        with each layer here, which specialises the graph on its value with a
        guard instead of formatting a buffer name from it: each layer then
        gets its graph once, during warm-up, and none later. A plain int is
        looked up directly, compiled too: comparing it with every layer would
        make tracing a step grow with the square of its layer count.
        """
        if type(layer_idx) is int and 0 <= layer_idx < self.config.num_layers:
            k, v = self._kv_names[layer_idx]
            # Straight from the module's buffers: nn.Module's attribute lookup costs more than the
            # rest of a one-token write eagerly, and more to trace than the lookup here.
            buffers = self._buffers
            return buffers[k], buffers[v]
        return self._layer_named(layer_idx, "k_cache", "v_cache")

    def _layer_named(self, layer_idx, key: str, value: str):
        """Layer `layer_idx`'s buffers `{key}_{i}` and `{value}_{i}`, for an index that is not a plain
        int (a symbolic int under `torch.compile`): compared with each layer in turn."""
        for i in range(self.config.num_layers):
            if layer_idx == i:
                return getattr(self, f"{key}_{i}"), getattr(self, f"{value}_{i}")
        raise ValueError(f"layer_idx must be an int in [0, {self.config.num_layers}), got {layer_idx!r}")

    def _layer_scales(self, layer_idx):
        """Layer `layer_idx`'s key and value scales `[1, num_heads, S, 1]` (quantized slots), else (None, None)."""
        if self.config.slot_dtype is None:
            return None, None
        if type(layer_idx) is int and 0 <= layer_idx < self.config.num_layers:
            return getattr(self, f"k_scale_{layer_idx}"), getattr(self, f"v_scale_{layer_idx}")
        return self._layer_named(layer_idx, "k_scale", "v_scale")

    def _dequantized_layer(self, kc, ks, vc, vs, dtype):  # quantized slots
        """Quantized slots on the FlexAttention path: the layer's cells dequantized into scratch tensors
        of the cache's dtype, allocated once and shared by every layer (FlexAttention takes no
        per-cell value scale, and its CPU kernel no 8-bit input). Written with `copy_`: inductor's
        CPU FlexAttention template read a dequantize computed inside the graph wrongly. A scale of
        None leaves its cells as stored (`_cells_in_kernel`)."""
        out = []
        for cells, scale, scratch in ((kc, ks, self._scratch_k), (vc, vs, self._scratch_v)):
            if scale is not None:
                if scratch is None:
                    raise RuntimeError("quantized slots on the FlexAttention path, but the cache's options allocated "
                                       "no dequantized scratch (path='rows'?)")
                cells = scratch.copy_(quantized.dequantize(cells, scale, dtype))
            out.append(cells)
        return out

    def _cells_in_kernel(self, compiling: bool) -> tuple:
        """`(keys, values)`: whether this step's FlexAttention call reads the key (value) cells as stored
        (`AttentionOptions.quantized_keys_in_kernel`, `quantized_values_in_kernel`): compiled, float8
        slots, CUDA, where the kernels widen them in registers."""
        if not self._in_kernel_device or not (compiling or quantized.CELLS_IN_KERNEL[self.device.type] == "eager"):
            return False, False
        return self._options.quantized_keys_in_kernel, self._options.quantized_values_in_kernel

    def _allocate_scratch(self) -> None:
        """At construction: allocate the FlexAttention path's dequantized scratch when a quantized
        cache's options let a step take that path (path "flex", or "auto" off the CPU), and the rows
        path's group buffer when they let a step take that one: quantized cells are widened into it,
        unquantized gathered rows copied into it (`gathered_rows.gather_scratch`; path "rows", or
        "auto" on the CPU)."""
        path = self._options.path
        if self.config.slot_dtype is None:
            if path == "rows" or (path == "auto" and self.device.type == "cpu"):
                self._row_scratch = gather_scratch(self.config, gather_width(self.config), self.device)
            return
        if path != "flex":
            self._row_scratch = dequantize_scratch(self.config, self.layout, self.device)
        if path == "flex" or (path == "auto" and self.device.type != "cpu"):
            # An eager step on the FlexAttention path (path="flex") reads dequantized cells, in
            # kernel options or not: only "auto" (eager steps take the rows path) spares a copy.
            c, S, o = self.config, self.layout.total_len, self._options
            spared = self._in_kernel_device and path == "auto"
            if not (spared and o.quantized_keys_in_kernel):
                self._scratch_k = torch.empty(1, c.num_heads, S, c.head_dim, dtype=c.dtype, device=self.device)
            if not (spared and o.quantized_values_in_kernel):
                self._scratch_v = torch.empty(1, c.num_heads, S, c.value_head_dim, dtype=c.dtype, device=self.device)
            if self._in_kernel_device and o.quantized_values_in_kernel:
                self._lse_values = quantized.lse_values(c.slot_dtype, self.device)

    def _cache_buffers(self):
        for i in range(self.config.num_layers):
            yield from self._layer_kv(i)
            if self.config.slot_dtype is not None:
                yield from self._layer_scales(i)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by every layer's key and value tensors (sources, slots, scratch, padding), and
        the rows path's group buffer (`gathered_rows.gather_scratch`: 4 MiB, on the CPU unless
        path="flex", for a cache with sources whose gathered step would be larger); with quantized
        slots their scales too, the one layer of dequantized scratch the FlexAttention path reads
        (allocated with the cache off the CPU, or on it with options path="flex"; under path="auto"
        without the keys' or the values' half where the kernel reads those cells as stored) and
        the group buffer cells widen into (`row_attention.dequantize_scratch`, unless path="flex")."""
        # The FlexAttention path's layer copy (quantized slots), the zero cell of its value-scaled
        # calls and the rows path's group buffer.
        scratch = [t for t in (self._scratch_k, self._scratch_v, self._lse_values, self._row_scratch) if t is not None]
        return sum(b.numel() * b.element_size() for b in (*self._cache_buffers(), *scratch))

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over all layers, rows, keys and values (and their scales when quantized):
        the memory of one request."""
        c = self.config
        per_cell = (quantized.cell_bytes(c.head_dim, c.dtype, c.slot_dtype)
                    + quantized.cell_bytes(c.value_head_dim, c.dtype, c.slot_dtype))
        return c.num_layers * c.num_heads * per_cell * self.layout.slot_cells()

    # ---------------------------------------------------------------- sources

    def _check_source(self, what: str, keys, values) -> int:
        """Validate a source's keys and values for this store; returns its length."""
        length = check_source_shapes(self.config, what, keys, values)
        for name, t in (("keys", keys), ("values", values)):
            if t.dtype != self.config.dtype:
                raise ValueError(f"{what}: {name} dtype expected {self.config.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{what}: {name} device expected {self.device}, got {t.device}")
        return length

    def _source_tensors(self, what: str, keys, values):
        """`(keys, values, length)` of a source as this store keeps it, checked; changes nothing."""
        return keys, values, self._check_source(what, keys, values)

    def _write_source(self, index: int, keys, values, length: int) -> None:
        """Copy a checked source into source place `index` of every layer (under the lock)."""
        c = self.config
        with torch.no_grad():
            for layer in range(c.num_layers):
                kc, vc = self._layer_kv(layer)
                ks, vs = self._layer_scales(layer)
                for r in range(c.rows_per_request):
                    base = self.layout.source_row(index, r)
                    cells = slice(base, base + length)
                    if c.slot_dtype is None:
                        kc[0, :, cells].copy_(keys[layer, r])
                        vc[0, :, cells].copy_(values[layer, r])
                        continue
                    for buf, scale, x in ((kc, ks, keys[layer, r]), (vc, vs, values[layer, r])):
                        q, sc = quantized.quantize(x, c.slot_dtype)
                        buf[0, :, cells].copy_(q)
                        scale[0, :, cells].copy_(sc)

    def _own_sources(self, what: str) -> None:
        if self._shared:
            raise ValueError(
                f"{what}: this manager stores one layer group of a GroupedKVManager (it shares that cache's slot "
                f"table); call {what} on the GroupedKVManager, which writes the source into every group"
            )

    def _own_slots(self, what: str) -> None:
        if self._shared:
            raise ValueError(
                f"{what}: this manager stores one layer group of a GroupedKVManager (it shares that cache's slot "
                f"table); call {what} on the GroupedKVManager, which copies or checks every group's slots"
            )

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a read-only prefix shared by requests; returns its index.

        `keys`: `[num_layers, rows_per_request, num_heads, L, head_dim]`, `values`
        the same with `value_head_dim`, `L <= max_source_len`, in the cache's
        dtype and on its device.
        """
        self._own_sources("add_source")
        keys, values, length = self._source_tensors("add_source", keys, values)
        with self._lock:
            index = self.slots.next_place()
            self._write_source(index, keys, values, length)
            self.slots.add_source(index, length)
            return index

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Give `request_id` a prefix of its own (a per-request prompt): its stream then declares
        `StreamPosition(source_len, written, source=-1)`.

        The entries live in one of the `max_sources` source places, like a shared
        source, reserved for this request; returns that place's index. The
        place is freed when the request is removed (`remove_request`) or by
        `remove_private_source`; `reset_request` keeps it for the restarted
        stream.
        Set it before the request's stream starts: before its first `admit`,
        or after `reset_request`.
        """
        self._own_sources("add_private_source")
        keys, values, length = self._source_tensors("add_private_source", keys, values)
        with self._lock:
            self.slots.check_private(request_id)
            index = self.slots.next_place()
            self._write_source(index, keys, values, length)
            self.slots.add_private_source(request_id, index, length)
            return index

    def remove_private_source(self, request_id: Hashable) -> None:
        """Free `request_id`'s private source (its stream must not be reading it)."""
        with self._lock:
            self.slots.remove_private_source(request_id)

    def remove_source(self, index: int) -> None:
        """Unregister a source no admitted request reads."""
        with self._lock:
            self.slots.remove_source(index)

    # -------------------------------------------------------------- lifecycle

    def check_start(self, request_id: Hashable, source: int = 0, source_len: int = 0, *,
                    restart: bool = False) -> None:
        """Raise what `admit` would raise for `request_id` starting its stream on this declaration.

        `source`, `source_len` as in `StreamPosition`. With `restart`, the
        request is checked as if `reset_request` had rewound it first (its
        current stream and source binding are ignored). Changes nothing, and
        does not check for a free slot (`free_slots` says that).
        """
        with self._lock:
            self.slots.check_declaration(request_id, StreamPosition(source_len, 0, source), restart)

    def plan(self, step: BoundedKVStep, *, eager_only: bool = False) -> BoundedPlan:
        """Plan `step` (every request admitted) on host ints.

        Pure: it reads the slot table, never device data, and planning the
        same step twice gives equal plans. `eager_only=True`: the plan is
        read by eager calls only, and its table parts are made when first
        read (cheaper for a one-token step); a plan that enters a compiled
        graph must be made without it (`BoundedPlan.make_parts`).
        """
        with self._lock:
            self.slots.check_plannable(step)
            slots = self.slots.slots()
            private = self.slots.private_sources
            self.slots.note_writes(step)
        return self._plan_from(step, slots, private, eager_only)

    def _plan_from(self, step: BoundedKVStep, slots: dict, private: dict, eager_only: bool = False) -> BoundedPlan:
        """This store's plan of a checked step, from the table's slots and private places.

        A chunk the rows path will serve on the CPU gets the rows path's geometry with its plan
        (`rows_geometry`, unpacked queries): formed once per step, device ops on the plan's tensors
        (nothing read back), and read by every layer, eager or compiled. A one-token step builds
        it at its first layer instead, from the host table (eagerly; `row_geometry`), since that
        geometry carries host facts of one plan a compiled step must not specialise on."""
        plan = build_plan(self.config, self.layout, step, slots.__getitem__, self.device,
                          self._full_blocks_at(len(step.segments) * self.config.rows_per_request, step.step_tokens),
                          private_source=private.get, parts=not eager_only)
        c, path = self.config, self._options.path
        if self.device.type == "cpu" and path != "flex" and plan.tokens > 1:
            T = plan.tokens
            plan.rows_geometry = row_geometry(self.layout, plan, self._mask_mod(plan, T, False), T, c.dtype,
                                              gather_width(c))
        return plan

    def commit(self, step: BoundedKVStep) -> None:
        """Record each request's written tokens: `written = position.written + span` (idempotent).

        Also drops the rows path's eager per-plan geometry (its mask bias is as large as the step's
        queries times the cells a row reads): the step is over.
        """
        self._end_step()
        with self._lock:
            self.slots.commit(step)

    def _end_step(self) -> None:
        """Drop what this store kept for the step's layers (the rows path's eager geometry)."""
        self._eager_step[:] = (None, {})

    def reset_request(self, request_id: Hashable) -> None:
        """Rewind a request to an empty stream; it keeps its slot and may pick a new source.

        Its private source, if any, stays with it: the restarted stream may read it again
        (`source=-1`), or `remove_private_source` frees it for a new one.
        """
        with self._lock:
            self.slots.reset(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        """Free the request's slot (and its private source, if any)."""
        with self._lock:
            self.slots.remove(request_id)

    # --------------------------------------------------- fork and roll back

    def slot_buffers(self):
        """Every buffer of this store that holds per-slot state (`flexkv.cache.slot_copy.SlotBuffer`):
        each layer's keys and values, and the un-rotated sink keys of its ``"cache"``-mode rotations."""
        lay = self.layout
        for buf in self._cache_buffers():
            yield SlotBuffer(buf, 2, lay.slots_base, lay.slot_cells())
        for rotation in list(self._slot_state):
            yield from rotation.slot_buffers()

    def check_fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Raise what `fork_request(parent_id, child_id)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_fork(parent_id, child_id)

    def fork_request(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start request `child_id` as a copy of `parent_id`'s stream (contract section 5, "Fork and
        roll back"): the lowest free slot, a copy of the parent's slot in every layer, and its
        position (`written`, source). Atomic: on any error nothing changes."""
        self._own_slots("fork_request")
        with self._lock:
            fork_slot(self.slots, self.slot_buffers(), parent_id, child_id)

    def check_reorder(self, mapping) -> None:
        """Raise what `reorder_requests(mapping)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_reorder(mapping)

    def reorder_requests(self, mapping) -> None:
        """Each destination request continues its source request's stream: `mapping` is
        `{destination: source}` over admitted requests (a beam search's reorder), sources read as
        they were before the call, in one batched copy. Atomic: every source is gathered before
        any destination is written."""
        self._own_slots("reorder_requests")
        with self._lock:
            reorder_slots(self.slots, self.slot_buffers(), mapping)

    def check_rollback(self, request_id: Hashable, tokens: int) -> None:
        """Raise what `rollback_request(request_id, tokens)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_rollback(request_id, tokens, (self.config,))

    def rollback_limit(self, request_id: Hashable) -> int:
        """How many of its last written tokens `request_id` can take back now."""
        with self._lock:
            self.slots.slot_of(request_id)
            return self.slots.rollback_limit(request_id, (self.config,))

    def rollback_request(self, request_id: Hashable, tokens: int) -> None:
        """Take back the request's last `tokens` written tokens: `written -= tokens`, exact while the
        slot still holds what the shorter stream reads (contract section 5, "Fork and roll back");
        beyond that it raises `ValueError` and nothing changes. No device work."""
        self._own_slots("rollback_request")
        with self._lock:
            self.slots.rollback(request_id, tokens, (self.config,))

    # -------------------------------------------------------------- attention

    def _full_blocks_at(self, rows: int, tokens: int) -> bool:
        """Whether a step of `rows` x `tokens` is planned with full blocks.

        CUDA's decode kernel splits the KV length `SPLIT_KV` ways when the batch is small
        (`rows * num_heads <= SMs`); with full blocks each split covers a share of the whole
        layer tensor rather than of the row's blocks, so a row's work lands in one or two
        splits. Such steps list every block as masked instead.
        """
        if not self._options.full_blocks:
            return False
        if self._sm_count is not None and tokens < self.layout.q_block_size:
            return rows * self.config.num_heads > self._sm_count
        return True

    def path_for(self, tokens: int, compiled: bool = True) -> str:
        """The attention path (`"rows"` or `"flex"`) a step of `tokens` tokens takes, compiled or
        eagerly (`AttentionOptions.path_for`)."""
        return self._options.path_for(self.device.type, tokens, compiled, self.config.dtype,
                                      quantized=self.config.slot_dtype is not None,
                                      flex_exact=self._cpu_kernel_exact)

    def _mask_mod(self, plan, tokens: int, pack_gqa: bool) -> Callable:
        """The step's retention `mask_mod` (`flexkv.cache.masks`); the one place every path builds it."""
        return make_mask_mod(plan, self.layout.ring_len, tokens, self.config.query_window, pack_gqa=pack_gqa,
                             causal_step=self.config.causal_step)

    def _eager_plan_state(self, plan: BoundedPlan) -> dict:
        """What the eager layers of `plan`'s step share, made by the first layer that needs each part
        (the rows path's geometry, the write index); dropped when another plan is attended or the
        step commits."""
        ref, state = self._eager_step
        if ref is None or ref() is not plan:
            state = {}
            self._eager_step[:] = (weakref.ref(plan), state)
        return state

    def _eager_geometry(self, plan: BoundedPlan, key: tuple, build: Callable):
        """The rows path's geometry of `plan` under `key`, built once per plan (eager calls only)."""
        state = self._eager_plan_state(plan)
        geo = state.get(key)
        if geo is None:
            geo = state[key] = build()
        return geo

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

    def _block_mask(self, plan: BoundedPlan, q_len: int, mask_mod: Callable, own_buffers: bool = False) -> BlockMask:
        """The plan's block lists as FlexAttention's block mask (`flexkv.cache.flex_call.plan_block_mask`)."""
        return plan_block_mask(self.layout, self.device.type, plan, q_len, mask_mod, own_buffers=own_buffers)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: BoundedPlan,
        *,
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        query_only: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Write the step's tokens into layer `layer_idx` and attend over what each row may read.

        `q`: `[N, Hq, T, D]` (`Hq` a multiple of `num_heads`), `k`:
        `[N, num_heads, T, D]`, `v`: `[N, num_heads, T, Dv]` (`D = head_dim`,
        `Dv = value_head_dim`) with `N = len(step.segments) * rows_per_request`.
        Returns `[N, Hq, T, Dv]`. `score_mod(score, b, h, q_pos, kv_pos)` gets
        stream positions (`positions="stream"`) or in-cache positions
        (`positions="cache"`). One attention call (`flex_attention`, or on the
        rows path `flexkv.cache.row_attention`), chosen by `options.route`; traceable by
        `torch.compile(fullgraph=True)`. `sinks`: learned sink logits `[Hq]`
        (see `flexkv.cache.sinks`), served from the same call's log-sum-exp.
        `return_lse`: `(out, lse)`, each query's natural-log sum of exp of its
        scores `[N, Hq, T]` (at least float32; the sink logit included; -inf
        where a query reads nothing), so that attention over this cache and
        over another set of keys can be merged into one softmax exactly
        (`flexkv.cache.merge.merge_attention`). On the CPU it takes the rows
        path under `path="auto"`, as sinks do (`CPU_NO_LSE`).
        `query_only`: queries `[N, Hq, Q, D]` that write nothing and attend
        what each row's newest own token attends (`flexkv.cache.query_only`);
        then the call returns `(out, query_only_out)`, each an `(out, lse)`
        pair with `return_lse`.
        """
        self._check_attend(layer_idx, q, k, v, plan)
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
        N, Hq, T, D = q.shape
        H = k.shape[1]
        compiling = torch.compiler.is_compiling()
        c = self.config
        ks, vs = self._layer_scales(layer_idx)
        # Quantized float8 slots compiled on CUDA, when the options say so: the kernel reads the key
        # cells as stored, each score times its key's scale (a score_mod of its own), and the value
        # cells as stored, in two calls (`quantized.value_scaled_attention`).
        keys_in_kernel, values_in_kernel = self._cells_in_kernel(compiling)
        want_lse = sinks is not None or return_lse  # the route's `sinks`: the call needs a log-sum-exp
        route = self._route(T, Hq // H, compiling, score_mod is not None or keys_in_kernel or values_in_kernel,
                            want_lse or values_in_kernel, ks is not None)
        g = Hq // H if route.pack_gqa else 1
        kc, vc = self._write(layer_idx, k, v, plan)  # after the route, which may refuse the call
        if query_only is not None:
            extra = attend_query_only(self, query_only, kc, vc, plan, scale=D ** -0.5 if scale is None else scale,
                                      score_mod=score_mod, positions=positions, sinks=sinks, want_lse=return_lse,
                                      scales=None if ks is None else (ks, vs))
            extra = extra if return_lse else extra[0]
        sm = None
        if score_mod is not None:
            # A relative-position table is read at the query's own token (`RelativePositionScores.at`).
            sm = make_score_mod(plan, self.layout.ring_len, T, score_mod.at if relative else score_mod, positions,
                                c.reverse_step_order, c.query_window, group=g, query_index=relative)
        # The scale is applied to q here rather than inside the call (TORCH_WORKAROUNDS["Q_VIEW"]):
        # the product is a fresh buffer. Packed, query head h * g + i sits at rows i * T .. i * T + T - 1
        # of KV head h: the same [N, Hq, T] view serves the output and its log-sum-exp.
        qs = (q.reshape(N, H, g * T, D) if route.pack_gqa else q) * (D ** -0.5 if scale is None else scale)
        if route.path == "rows":
            out, lse = self._attend_rows(layer_idx, qs, kc, vc, plan, route, sm, compiling, want_lse, relative,
                                         scales=None if ks is None else (ks, vs))
        else:
            group = 1 if route.pack_gqa else Hq // H
            if ks is not None:
                # Quantized slots: FlexAttention reads a dequantized copy of the layer, or (compiled
                # CUDA kernels take float8 cells with higher-precision queries) the cells as stored.
                kc, vc = self._dequantized_layer(kc, None if keys_in_kernel else ks, vc,
                                                 None if values_in_kernel else vs, q.dtype)
                if keys_in_kernel:
                    sm = quantized.key_scale_score_mod(ks, group, sm)
            if values_in_kernel:
                block_mask = self._step_block_mask(plan, qs, route)
                options = self._kernel_options(qs, H)
                out, lse = quantized.value_scaled_attention(
                    lambda values, mod: flex_call(qs, kc, values, block_mask, options, score_mod=mod, lse=True),
                    vc, vs, group, sm, self._lse_values)
            elif route.path == "region":
                out, lse = flex_layer(qs, kc, vc, plan.table, self, N, T, plan.width, plan.full_width,
                                       plan.full_blocks, route.pack_gqa, self._kernel_options(qs, H)), None
            else:
                out, lse = self._attend_flex(qs, kc, vc, plan, route, sm, want_lse)
        if route.barrier:
            out = _apart_from_kernel(out)
        out = out.view(N, Hq, T, v.shape[3])
        if want_lse:
            lse = lse.reshape(N, Hq, T)
            if sinks is not None:
                out = apply_learned_sinks(out, lse, sinks)
                if return_lse:
                    lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, Hq, 1))
        own = (out, lse) if return_lse else out
        return own if query_only is None else (own, extra)

    def _route(self, tokens: int, group: int, compiling: bool, score_mod: bool, sinks: bool,
               quantized: bool) -> Route:
        """`options.route` for an attend call; eagerly decided once per kind of call and kept (the
        options are fixed when the cache is built), compiled decided while tracing."""
        key = (tokens, group, score_mod, sinks, quantized)
        route = None if compiling else self._routes.get(key)
        if route is None:
            route = self._options.route(self.device.type, tokens, group, compiling, dtype=self.config.dtype,
                                        flex_exact=self._cpu_kernel_exact, score_mod=score_mod, sinks=sinks,
                                        quantized=quantized)
            if not compiling:
                self._routes[key] = route
        return route

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan: BoundedPlan):
        """Write the step's keys and values at the plan's cells of layer `layer_idx` (quantized slots:
        quantized, cells and scales side by side); its buffers."""
        kc, vc = self._layer_kv(layer_idx)
        N, H, T, D = k.shape
        if self.config.slot_dtype is None and not torch.compiler.is_compiling():
            # Eagerly: one copy per tensor along the cell axis, at the plan's cells made int64 once for
            # every layer of the step (an advanced-index write costs several times more per call).
            state = self._eager_plan_state(plan)
            cells = state.get("write")
            if cells is None:
                cells = state["write"] = plan.write_index.view(N * T).long()
            for buf, x in ((kc, k), (vc, v)):
                buf.index_copy_(2, cells, x if N == 1 else x.transpose(0, 1).reshape(1, H, N * T, x.shape[3]))
            return kc, vc
        # Compiled (and quantized): the keys as they come, at the plan's int32 cells; each op here is
        # traced again in every layer of a step.
        index = (self._zero_index, self._head_index, plan.write_index)
        ks, vs = self._layer_scales(layer_idx)
        if ks is not None:
            (k, k_sc), (v, v_sc) = (quantized.quantize(x, self.config.slot_dtype) for x in (k, v))
            ks.index_put_(index, k_sc)
            vs.index_put_(index, v_sc)
        kc.index_put_(index, k)
        vc.index_put_(index, v)
        return kc, vc

    def _kernel_options(self, qs: torch.Tensor, H: int) -> dict:
        """FlexAttention's kernel options for a scaled query `qs` over `H` KV heads."""
        lay = self.layout
        return flex_kernel_options(self.device.type, qs.shape[2], H, qs.shape[1], qs.shape[3], qs.dtype,
                                   lay.block_size, q_block_size=lay.q_block_size, capability=self._capability)

    def _attend_rows(self, layer_idx: int, qs, kc, vc, plan: BoundedPlan, route: Route, sm, compiling: bool,
                     lse: bool, additive: bool = False, scales=None):
        """The rows path (`flexkv.cache.row_attention`): `(out, log-sum-exp or None)`."""
        lay, T = self.layout, plan.tokens
        pack, gT = route.pack_gqa, qs.shape[2]
        width = self._gather_width
        geometry = mask_mod = None
        ahead = getattr(plan, "rows_geometry", None)  # built with the plan (`_plan_from`), unpacked
        if ahead is not None and ahead.bias.dtype == qs.dtype:
            # Every layer of the step reads the one geometry built with the plan, compiled too (a
            # compiled step takes it as inputs instead of forming it again in every layer).
            g = gT // T
            if compiling:
                geometry = repeat_queries(device_geometry(ahead), g)
            else:
                geometry = self._eager_geometry(plan, (gT, T, pack, qs.dtype), lambda: repeat_queries(ahead, g))
        elif compiling:
            mask_mod = self._mask_mod(plan, T, pack)
        else:
            # Eagerly, every layer of the step shares the plan's geometry (cells, mask bias):
            # built at the first layer. Everything the mask depends on besides the plan and the
            # cache's config is in the key.
            geometry = self._eager_geometry(
                plan, (gT, T, pack, qs.dtype),
                lambda: row_geometry(lay, plan, self._mask_mod(plan, T, pack), gT, qs.dtype, width))
        pool = None if compiling or not geometry.in_place else self._slot_pool(layer_idx, kc, vc)
        out = attend_rows(qs, kc, vc, lay, plan, mask_mod, sm, width=width, return_lse=lse, geometry=geometry,
                          additive=additive, scales=scales,
                          scratch=self._row_scratch, pool=pool)
        return out if lse else (out, None)

    def _slot_pool(self, layer_idx: int, kc: torch.Tensor, vc: torch.Tensor) -> tuple:
        """`row_attention.slot_pool` of layer `layer_idx`'s buffers `kc`, `vc`, made once per buffer
        (eager calls only): the buffers are written in place, so their views stay current."""
        entry = self._pools.get(layer_idx)
        if entry is None or entry[0] is not kc or entry[1] is not vc:
            entry = self._pools[layer_idx] = (kc, vc, slot_pool(kc, vc, self.layout))
        return entry[2]

    def _attend_flex(self, qs, kc, vc, plan: BoundedPlan, route: Route, sm, lse: bool):
        """One inline FlexAttention call: `(out, log-sum-exp or None)`."""
        # Compiled, the plan's block lists are views of its one table inside the graph: each gets a
        # buffer of its own, as in `flex_call.flex_layer`.
        return flex_call(qs, kc, vc, self._step_block_mask(plan, qs, route), self._kernel_options(qs, kc.shape[1]),
                         score_mod=sm, lse=lse)

    def _step_block_mask(self, plan: BoundedPlan, qs, route: Route):
        """The FlexAttention block mask of an inline call (`_attend_flex`) for scaled queries `qs`."""
        return self._block_mask(plan, qs.shape[2], self._mask_mod(plan, plan.tokens, route.pack_gqa),
                                own_buffers=torch.compiler.is_compiling())


