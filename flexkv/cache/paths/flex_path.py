"""The FlexAttention path as a cache's attention path: one `flex_attention` call per layer.

`flexkv.cache.path_choice` chooses it per call (route `"flex"`: an inline call
with the step's `score_mod` and log-sum-exp; `"region"`: the call every
compiled layer shares, `flex_call.flex_layer`). What it answers:

- **scratch**: with quantized slots, one layer's cells dequantized into the
  cache's dtype (`dequantized_layer`), allocated when the cache's steps
  reach this path (FlexAttention takes no per-cell value scale, and its CPU
  kernel no 8-bit input);
- **plan parts**: whether a step is planned with full blocks
  (`full_blocks_at`, an input of the planner);
- **the call**: the block mask from the plan's block lists, the kernel
  options for the shapes, the call, and the epilogue barrier a compiled
  CPU step needs (`TORCH_WORKAROUNDS["EPILOGUE_FUSION"]`).

Compiled CUDA kernels may read float8 cells as stored instead of the copy:
that variant is `flexkv.cache.paths.float8_path`.
"""

from __future__ import annotations

import torch

from ..positions.masks import store_mask_mod
from ..storage import quantized
from .flex_call import flex_call, flex_layer, plan_block_mask
from .kernel_options import flex_kernel_options

__all__ = ["FlexPath", "apart_from_kernel"]


def apart_from_kernel(out: torch.Tensor) -> torch.Tensor:
    """`out` itself, read through a gather along its first dimension (its last when the first has one
    entry: a gather of index 0 alone is a direct read to inductor, which then fuses as before).

    Inductor fuses an elementwise consumer of a template's output into the
    template's kernel only when the consumer reads the output at the index it
    writes; the CPU FlexAttention template then fails ("Unsupported for
    `epilogue_nodes` in CppFlexAttentionTemplate"). An indirect read is not
    that index, so the consumer (`o * 2`, a gate, the caller's own ops) runs
    as a kernel of its own, fused with this gather: one extra read of the
    output, no extra kernel when something elementwise follows.
    """
    dim = 0 if out.shape[0] > 1 else out.dim() - 1
    return out.index_select(dim, torch.arange(out.shape[dim], device=out.device))


class FlexPath:
    """The FlexAttention path of one store (`flexkv.cache.storage.store.LayerStore`) under `options`."""

    name = "flex"

    def __init__(self, store, options):
        self.store = store
        self.options = options
        cuda = store.device.type == "cuda"
        # Read once, on the host: what the CUDA kernels are tuned and split by.
        self.capability = torch.cuda.get_device_capability(store.device) if cuda else None
        self.sm_count = torch.cuda.get_device_properties(store.device).multi_processor_count if cuda else None
        c, lay = store.config, store.layout
        # A KV block the CUDA kernels cannot compile is refused here, not at the first compiled step.
        flex_kernel_options(store.device.type, 1, c.num_heads, c.num_heads, c.head_dim, c.dtype, lay.block_size,
                            q_block_size=lay.q_block_size)

    def reads_cells(self, compiling: bool) -> tuple:
        """`(keys, values)`: whether a call reads the key (value) cells as stored: never here (the
        float8 variant answers otherwise)."""
        return False, False

    def scratch(self, eager: bool, compiled: bool) -> dict:
        """Quantized slots: one layer of dequantized keys and values when steps reach this path."""
        c = self.store.config
        if c.slot_dtype is None or not (eager or compiled):
            return {}
        return {"flex_keys": self._copy(c.head_dim), "flex_values": self._copy(c.value_head_dim)}

    def _copy(self, width: int) -> torch.Tensor:
        s = self.store
        return torch.empty(1, s.config.num_heads, s.layout.total_len, width, dtype=s.config.dtype, device=s.device)

    def full_blocks_at(self, rows: int, tokens: int) -> bool:
        """Whether a step of `rows` x `tokens` is planned with full blocks.

        CUDA's decode kernel splits the KV length `SPLIT_KV` ways when the batch is small
        (`rows * num_heads <= SMs`); with full blocks each split covers a share of the whole
        layer tensor rather than of the row's blocks, so a row's work lands in one or two
        splits. Such steps list every block as masked instead.
        """
        if not self.options.full_blocks:
            return False
        if self.sm_count is not None and tokens < self.store.layout.q_block_size:
            return rows * self.store.config.num_heads > self.sm_count
        return True

    def __call__(self, call):
        """`(out, log-sum-exp or None)` of one `attend` call (`flexkv.cache.path_choice.PathCall`)."""
        kc, vc, qs, plan = call.k_cells, call.v_cells, call.q, call.plan
        if call.scales is not None:
            kc, vc = self.dequantized_layer(kc, call.scales[0], vc, call.scales[1], qs.dtype)
        if call.route.path == "region":
            out, lse = flex_layer(qs, kc, vc, plan.table, self.store, plan.rows, plan.tokens, plan.width,
                                  plan.full_width, plan.full_blocks, call.route.pack_gqa,
                                  self.kernel_options(qs, kc.shape[1])), None
        else:
            out, lse = flex_call(qs, kc, vc, self.block_mask(call), self.kernel_options(qs, kc.shape[1]),
                                 score_mod=call.score_mod, lse=call.lse)
        return (apart_from_kernel(out) if call.route.barrier else out), lse

    def dequantized_layer(self, kc, ks, vc, vs, dtype):
        """Quantized slots: the layer's cells dequantized into the scratch copies of the cache's dtype,
        shared by every layer. Written with `copy_`: inductor's CPU FlexAttention template read a
        dequantize computed inside the graph wrongly. A scale of None leaves its cells as stored."""
        out = []
        for cells, scale, name in ((kc, ks, "flex_keys"), (vc, vs, "flex_values")):
            if scale is not None:
                scratch = self.store.scratch.get(name)
                if scratch is None:
                    raise RuntimeError("quantized slots on the FlexAttention path, but the cache's options allocated "
                                       "no dequantized scratch (path='rows'?)")
                cells = scratch.copy_(quantized.dequantize(cells, scale, dtype))
            out.append(cells)
        return out

    def kernel_options(self, qs: torch.Tensor, H: int) -> dict:
        """FlexAttention's kernel options for a scaled query `qs` over `H` KV heads."""
        lay = self.store.layout
        return flex_kernel_options(self.store.device.type, qs.shape[2], H, qs.shape[1], qs.shape[3], qs.dtype,
                                   lay.block_size, q_block_size=lay.q_block_size, capability=self.capability)

    def block_mask(self, call):
        """The block mask of an inline call (`flex_call.plan_block_mask`): compiled, the plan's block
        lists are views of its one table inside the graph, and each gets a buffer of its own."""
        s, plan = self.store, call.plan
        return plan_block_mask(s.layout, s.device.type, plan, call.q.shape[2],
                               store_mask_mod(s, plan, plan.tokens, call.route.pack_gqa), own_buffers=call.compiling)
