"""`LayerStore`: a cache's device state, its layers' key and value tensors and what is kept beside them.

A `BoundedKVManager` is a slot table (host state, `flexkv.cache.host.slots`), a
store (this module: device state) and the attention paths over it
(`flexkv.cache.path_choice`). The store holds, for each of `config.num_layers`
layers:

==================  ==========================  ========================================
buffer              shape                       holds
==================  ==========================  ========================================
`k_cache_{i}`       `[1, H, S, head_dim]`       key cells (`slot_dtype` when quantized)
`v_cache_{i}`       `[1, H, S, value_head_dim]` value cells
`k_scale_{i}`,      `[1, H, S, 1]` float32      a scale per cell and head (quantized
`v_scale_{i}`                                   slots only, `flexkv.cache.storage.quantized`)
==================  ==========================  ========================================

with `S = layout.total_len` (`flexkv.cache.host.layout`), plus the scratch the
cache's attention paths asked for when it was built (`scratch`), the
per-slot buffers kept for it outside it (a ``"cache"``-mode rotation's
un-rotated sink keys), and the memos of one step (`per_plan`) and of the
cache's life (`memos`). Its public surface is what the rest of the cache
reads and writes: `layer_kv`, `layer_scales`, `write`, `write_keys`, the
source calls (`source_tensors`, `write_source`), `mask_mod`,
`memory_bytes`, `slot_bytes` and `slot_buffers`.

Worked numbers: 2 layers, 8 KV heads of 128, a 1024-cell slot row, 4 slots
and no sources in bfloat16 hold `2 layers * 2 (k, v) * 8 * 128 * 2 bytes`
= 8 KiB per cell, times `S` cells (slot pool, scratch cells, padding).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from ...config import BoundedKVConfig, resolve_device
from ..host.layout import Layout
from ..host.lifecycle import StoreHooks
from ..host.sources import check_source_shapes
from . import quantized
from .slot_copy import SlotBuffer

__all__ = ["LayerStore"]


class LayerStore(StoreHooks, nn.Module):
    """The key and value tensors of `config.num_layers` layers, laid out by `layout` (module docstring).

    Args:
        config: the cache's `BoundedKVConfig` (its `dtype` settled).
        device: where the tensors live (`"meta"` allocates nothing).
        layout: where every entry lives along a layer's cell axis (`Layout.for_config`).
    """

    def __init__(self, config: BoundedKVConfig, device, layout: Layout):
        super().__init__()
        self.config = config
        self.device = resolve_device(device)
        self.layout = layout
        shape = (1, config.num_heads, layout.total_len, config.head_dim)
        v_shape = shape[:3] + (config.value_head_dim,)
        # Quantized slots (flexkv.cache.storage.quantized): cells in slot_dtype, plus a scale per cell and head.
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
        self._kv_names = tuple((f"k_cache_{i}", f"v_cache_{i}") for i in range(config.num_layers))
        #: Buffers the attention paths asked for when the cache was built, by name (None: not allocated):
        #: counted in `memory_bytes`. Plain tensors, not registered buffers (they hold no cache state).
        self.scratch: dict = {}
        #: Memos kept for the cache's life by the paths that read them (small constant tensors, the last
        #: geometry of a one-token step): never written to once made.
        self.memos: dict = {}
        # Per-slot buffers kept for this store outside it (the "cache"-mode rotations made over it): a
        # fork or reorder copies their slots too. Weak, so a dropped rotation is dropped here.
        self._slot_state = weakref.WeakSet()
        # What the eager layers of one plan's step share (`per_plan`): a weak reference to the plan and
        # its dict, dropped at `end_step`. A plain list, so a step's start and end skip
        # `nn.Module.__setattr__`.
        self._eager_step: list = [None, {}]

    # ------------------------------------------------------------ layers

    def layer_kv(self, layer_idx):
        """Layer `layer_idx`'s key and value buffers, `[1, num_heads, S, head_dim]` and `[.., value_head_dim]`.

        Every layer keeps tensors of its own (`k_cache_{i}`, `v_cache_{i}`):
        inductor's CPU FlexAttention kernel reads a key or value view from its
        storage's start, ignoring the view's offset (torch 2.11 to 2.15), so a
        layer sliced out of one stacked tensor would read layer 0 when compiled
        (`TORCH_WORKAROUNDS["VIEW_OFFSET"]`).

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

    def layer_scales(self, layer_idx):
        """Layer `layer_idx`'s key and value scales `[1, num_heads, S, 1]` (quantized slots), else (None, None)."""
        if self.config.slot_dtype is None:
            return None, None
        if type(layer_idx) is int and 0 <= layer_idx < self.config.num_layers:
            return getattr(self, f"k_scale_{layer_idx}"), getattr(self, f"v_scale_{layer_idx}")
        return self._layer_named(layer_idx, "k_scale", "v_scale")

    def cell_buffers(self):
        """Every layer's key and value cells (and their scales when quantized), in layer order."""
        for i in range(self.config.num_layers):
            yield from self.layer_kv(i)
            if self.config.slot_dtype is not None:
                yield from self.layer_scales(i)

    # ------------------------------------------------------------ writes

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan):
        """Write a step's keys `[N, H, T, D]` and values at the plan's cells of layer `layer_idx`
        (quantized slots: quantized, cells and scales side by side); returns the layer's buffers."""
        kc, vc = self.layer_kv(layer_idx)
        N, H, T, D = k.shape
        if self.config.slot_dtype is None and not torch.compiler.is_compiling():
            # Eagerly: one copy per tensor along the cell axis, at the plan's cells made int64 once for
            # every layer of the step (an advanced-index write costs several times more per call).
            state = self.per_plan(plan)
            cells = state.get("write")
            if cells is None:
                cells = state["write"] = plan.write_index.view(N * T).long()
            for buf, x in ((kc, k), (vc, v)):
                buf.index_copy_(2, cells, x if N == 1 else x.transpose(0, 1).reshape(1, H, N * T, x.shape[3]))
            return kc, vc
        # Compiled (and quantized): the keys as they come, at the plan's int32 cells; each op here is
        # traced again in every layer of a step.
        index = (self._zero_index, self._head_index, plan.write_index)
        ks, vs = self.layer_scales(layer_idx)
        if ks is not None:
            (k, k_sc), (v, v_sc) = (quantized.quantize(x, self.config.slot_dtype) for x in (k, v))
            ks.index_put_(index, k_sc)
            vs.index_put_(index, v_sc)
        kc.index_put_(index, k)
        vc.index_put_(index, v)
        return kc, vc

    def write_keys(self, layer_idx: int, cells: torch.Tensor, keys: torch.Tensor) -> None:
        """Overwrite key cells of layer `layer_idx`: `cells` `[N, 1, C]` of `keys` `[N, H, C, D]` (quantized
        slots: quantized from `keys`, their scales beside them, as `write` does)."""
        kc = self.layer_kv(layer_idx)[0]
        index = (self._zero_index, self._head_index, cells)
        ks = self.layer_scales(layer_idx)[0]
        if ks is not None:
            keys, scale = quantized.quantize(keys, self.config.slot_dtype)
            ks.index_put_(index, scale)
        kc.index_put_(index, keys)

    # ----------------------------------------------------------- sources

    def check_source(self, what: str, keys, values) -> int:
        """Validate a source's keys and values for this store; returns its length."""
        length = check_source_shapes(self.config, what, keys, values)
        for name, t in (("keys", keys), ("values", values)):
            if t.dtype != self.config.dtype:
                raise ValueError(f"{what}: {name} dtype expected {self.config.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{what}: {name} device expected {self.device}, got {t.device}")
        return length

    def source_tensors(self, what: str, keys, values):
        """`(keys, values, length)` of a source as this store keeps it, checked; changes nothing. A
        store that keeps part of each source (a tensor-parallel rank's heads) takes its part here."""
        return keys, values, self.check_source(what, keys, values)

    def write_source(self, index: int, keys, values, length: int, request_id=None) -> None:
        """Copy a checked source (`source_tensors`) into source place `index` of every layer."""
        c = self.config
        with torch.no_grad():
            for layer in range(c.num_layers):
                kc, vc = self.layer_kv(layer)
                ks, vs = self.layer_scales(layer)
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

    # ------------------------------------------------------ one step's memo

    def per_plan(self, plan) -> dict:
        """What the eager layers of `plan`'s step share, made by the first layer that needs each part
        (the rows path's geometry, the write index); dropped when another plan is attended or the
        step ends (`end_step`)."""
        ref, state = self._eager_step
        if ref is None or ref() is not plan:
            state = {}
            self._eager_step[:] = (weakref.ref(plan), state)
        return state

    def end_step(self) -> None:
        """Drop what this store kept for the step's layers (`per_plan`)."""
        self._eager_step[:] = (None, {})

    # ------------------------------------------------------------ memory

    @property
    def memory_bytes(self) -> int:
        """Bytes held by every layer's cells (and scales) and by the scratch the paths allocated."""
        scratch = [t for t in self.scratch.values() if t is not None]
        return sum(b.numel() * b.element_size() for b in (*self.cell_buffers(), *scratch))

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over all layers, rows, keys and values (and their scales when quantized)."""
        c = self.config
        per_cell = (quantized.cell_bytes(c.head_dim, c.dtype, c.slot_dtype)
                    + quantized.cell_bytes(c.value_head_dim, c.dtype, c.slot_dtype))
        return c.num_layers * c.num_heads * per_cell * self.layout.slot_cells()

    def keep_slot_state(self, owner) -> None:
        """Copy `owner`'s per-slot buffers (its `slot_buffers()`) with this store's slots in a fork or
        reorder, for as long as `owner` lives."""
        self._slot_state.add(owner)

    def slot_buffers(self):
        """Every buffer that holds per-slot state (`flexkv.cache.storage.slot_copy.SlotBuffer`): each layer's
        cells (and scales), and those kept for it outside it (`keep_slot_state`)."""
        lay = self.layout
        for buf in self.cell_buffers():
            yield SlotBuffer(buf, 2, lay.slots_base, lay.slot_cells())
        for owner in list(self._slot_state):
            yield from owner.slot_buffers()

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={c.num_layers}, heads={c.num_heads}, cells={self.layout.total_len}, dtype={c.dtype}"
                + ("" if c.slot_dtype is None else f", slot_dtype={c.slot_dtype}"))


def store_of(cache) -> Optional[LayerStore]:
    """The `LayerStore` of a cache that has one (`cache.store`), or `cache` itself if it is one."""
    return cache if isinstance(cache, LayerStore) else getattr(cache, "store", None)
