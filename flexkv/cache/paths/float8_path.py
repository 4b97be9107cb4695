"""The FlexAttention path reading float8 cells as stored: compiled CUDA kernels only, off by default.

CUDA's compiled FlexAttention kernels take float8 keys and values beside
higher-precision queries and widen them in registers
(`quantized.CELLS_IN_KERNEL`). A float8 cache there may skip the dequantized
copy of a layer (`flex_path.FlexPath.dequantized_layer`):

- `AttentionOptions.quantized_keys_in_kernel`: the kernel reads key cells as
  stored, each score times its key's scale (`quantized.key_scale_score_mod`);
- `AttentionOptions.quantized_values_in_kernel`: the kernel reads value
  cells as stored, in two calls (`quantized.value_scaled_attention`: the
  scales as a log in `score_mod`, then a call over one zero cell for the
  step's own log-sum-exp).

Everything CUDA-only about float8 cells is here: which calls read cells as
stored (`reads_cells`), what that spares of the copy and what it adds (the
zero cell, `scratch`), and the calls themselves. On every other device the
cache takes `flex_path.FlexPath` unchanged. Both options stay off until
`benchmarks/cuda_check.py`'s quantized section has shown them correct and
faster on a device; the tests run them on the CPU through a kernel stand-in
that widens cells as CUDA's does.
"""

from __future__ import annotations

import torch

from ..storage import quantized
from .flex_call import flex_call
from .flex_path import FlexPath, apart_from_kernel

__all__ = ["Float8FlexPath", "reads_cells_in_kernel"]


def reads_cells_in_kernel(store) -> bool:
    """Whether `store`'s FlexAttention calls may read its cells as stored: float8 slots on a device whose
    kernels widen them (`quantized.CELLS_IN_KERNEL`)."""
    return store.device.type in quantized.CELLS_IN_KERNEL and store.config.slot_dtype == torch.float8_e4m3fn


class Float8FlexPath(FlexPath):
    """`FlexPath` whose calls, compiled (or as `quantized.CELLS_IN_KERNEL` says), read the float8 cells
    the options name as stored."""

    name = "flex"

    def reads_cells(self, compiling: bool) -> tuple:
        """`(keys, values)`: whether this call's kernel reads the key (value) cells as stored."""
        if not (compiling or quantized.CELLS_IN_KERNEL[self.store.device.type] == "eager"):
            return False, False
        return self.options.quantized_keys_in_kernel, self.options.quantized_values_in_kernel

    def scratch(self, eager: bool, compiled: bool) -> dict:
        """`FlexPath.scratch` less the copy of what the kernel reads as stored (when only compiled steps
        reach this path: an eager step reads the copies), plus the zero cell of the values' second call."""
        if not (eager or compiled):
            return {}
        c, o = self.store.config, self.options
        out = {"flex_keys": None if o.quantized_keys_in_kernel and not eager else self._copy(c.head_dim),
               "flex_values": None if o.quantized_values_in_kernel and not eager else self._copy(c.value_head_dim)}
        if o.quantized_values_in_kernel:
            out["lse_values"] = quantized.lse_values(c.slot_dtype, self.store.device)
        return out

    def __call__(self, call):
        keys, values = self.reads_cells(call.compiling)
        if not (keys or values):
            return super().__call__(call)
        ks, vs = call.scales
        qs = call.q
        kc, vc = self.dequantized_layer(call.k_cells, None if keys else ks, call.v_cells, None if values else vs,
                                        qs.dtype)
        # Unpacked, a KV head serves `group` query heads through `enable_gqa`; packed, one.
        group = 1 if call.route.pack_gqa else qs.shape[1] // kc.shape[1]
        sm = quantized.key_scale_score_mod(ks, group, call.score_mod) if keys else call.score_mod
        block_mask, options = self.block_mask(call), self.kernel_options(qs, kc.shape[1])
        if values:
            out, lse = quantized.value_scaled_attention(
                lambda v, mod: flex_call(qs, kc, v, block_mask, options, score_mod=mod, lse=True),
                vc, vs, group, sm, self.store.scratch["lse_values"])
        else:
            out, lse = flex_call(qs, kc, vc, block_mask, options, score_mod=sm, lse=call.lse)
        return (apart_from_kernel(out) if call.route.barrier else out), lse
