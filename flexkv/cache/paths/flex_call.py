"""flexkv's FlexAttention call: a plan's block lists as a `BlockMask`, and the one kernel call.

Two ways in, both from `flexkv.cache.paths.flex_path.FlexPath`:

- `flex_call`: one inline `flex_attention` call with the step's `score_mod`
  and, when asked, its log-sum-exp;
- `flex_layer`: the same call from the plan's one table alone, inside the
  compiled region every layer of a step shares
  (`flexkv.cache.paths.kernel_sharing.layer_region`), for calls without a
  `score_mod` or sinks.

The plan lists each row's KV blocks once (every query block of a row visits
the same ones); `plan_block_mask` widens and repeats them into the shapes the
kernel reads, on the device side, reading nothing back.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from ..host.layout import Layout
from ..host.planner import table_views
from ..positions.masks import store_mask_mod
from .kernel_sharing import layer_region

__all__ = ["flex_call", "flex_layer", "plan_block_mask"]


def plan_block_mask(layout: Layout, device_type: str, plan, q_len: int, mask_mod: Callable,
                    own_buffers: bool = False, extra_blocks: Optional[torch.Tensor] = None) -> BlockMask:
    """`plan`'s block lists as FlexAttention's block mask for a query of `q_len` rows.

    `own_buffers`: the lists are views of one tensor inside the graph (`PlanView`); each is
    then made a buffer of its own (`clamp_min(0)` leaves counts and block indices as they are;
    a clone would be removed as a no-op), since inductor's CPU template names kernel arguments
    by their storage and would merge them (`TORCH_WORKAROUNDS["STORAGE_NAMES"]`).
    `extra_blocks`: `[N, E]` more partly masked blocks each row visits (made on the device, none of
    them in the row's plan: a `Recall` row's memory region), listed after its own.
    """
    N = plan.rows
    nq = layout.q_blocks(q_len)
    kv_num, kv_idx, full_num, full_idx = (
        plan.kv_num_blocks, plan.kv_indices, plan.full_kv_num_blocks, plan.full_kv_indices)
    if own_buffers:
        kv_num, kv_idx, full_num, full_idx = (x.clamp_min(0) for x in (kv_num, kv_idx, full_num, full_idx))
    if extra_blocks is not None:
        E = extra_blocks.shape[1]
        at = kv_num.view(N, 1).long() + torch.arange(E, device=kv_idx.device).view(1, E)
        kv_idx = F.pad(kv_idx.view(N, -1), (0, E)).scatter(1, at, extra_blocks.to(kv_idx.dtype))
        kv_idx = kv_idx[:, :layout.num_blocks].view(N, 1, 1, -1)
        kv_num = kv_num + E
    if device_type == "cpu" and kv_idx.shape[3] < layout.num_blocks:
        # The CPU kernel wants block lists as wide as the layer tensor (it reads only the first
        # kv_num_blocks of each); the plan stays compact and is widened here, on the device side
        # (TORCH_WORKAROUNDS["WIDE_BLOCK_LISTS"]).
        kv_idx = F.pad(kv_idx, (0, layout.num_blocks - kv_idx.shape[3]))
    if nq > 1:
        kv_num, full_num = (x.expand(N, 1, nq).contiguous() for x in (kv_num, full_num))
        kv_idx, full_idx = (x.expand(N, 1, nq, x.shape[3]).contiguous() for x in (kv_idx, full_idx))
    if not plan.full_blocks and device_type != "cpu":
        # No full-block tensors at all: CUDA's decode kernel then splits a row by its own blocks.
        # (The CPU kernel is given the plan's zero counts instead: torch 2.13's compiled CPU
        # kernel failed to build without full-block tensors: TORCH_WORKAROUNDS["FULL_BLOCKS_REQUIRED"].)
        full_num = full_idx = None
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(layout.q_block_size, layout.block_size),
        mask_mod=mask_mod,
        seq_lengths=(q_len, layout.total_len),
        compute_q_blocks=False,
    )


def flex_call(q, k_cache, v_cache, block_mask: BlockMask, kernel_options: dict, score_mod=None, lse: bool = False):
    """flexkv's one FlexAttention call (q already scaled): `(out, log-sum-exp or None)`."""
    out = flex_attention(q, k_cache, v_cache, score_mod=score_mod, block_mask=block_mask, scale=1.0,
                         enable_gqa=q.shape[1] != k_cache.shape[1], kernel_options=kernel_options,
                         return_aux=AuxRequest(lse=True) if lse else None)
    return (out[0], out[1].lse) if lse else (out, None)


class PlanView:
    """A plan's tensors as views of its table, inside a compiled region (see `flex_layer`)."""

    def __init__(self, table, rows, tokens, width, full_width, full_blocks):
        for name, view in table_views(table, rows, tokens, width, full_width).items():
            setattr(self, name, view)
        self.rows, self.tokens, self.full_blocks = rows, tokens, full_blocks


@layer_region
def flex_layer(q, k_cache, v_cache, table, store, rows, tokens, width, full_width, full_blocks, pack_gqa,
               options):
    """One layer's FlexAttention call from the plan's table alone: a region every layer shares.

    The plan enters as its one table (its named tensors are views of it, and a region takes no
    inputs that alias each other); everything else is static (`store`: the cache's
    `flexkv.cache.storage.store.LayerStore`).
    """
    plan = PlanView(table, rows, tokens, width, full_width, full_blocks)
    group = q.shape[2] // tokens
    block_mask = plan_block_mask(store.layout, store.device.type, plan, tokens * group,
                                 store_mask_mod(store, plan, tokens, pack_gqa), own_buffers=True)
    return flex_call(q, k_cache, v_cache, block_mask, options)[0]
