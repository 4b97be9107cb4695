"""A `Recall` layer in one FlexAttention call: the chosen memory copied, turned, next to the window.

FlexAttention scores each key where it lies with one query per head, so a
key must already carry the rotation it is read at. The window's keys do (a
window entry is read at its own position in both position systems), memory
entries do not under in-cache positions: each is read at the position just
before the step's first window entry (docs/contract.md section 2). So, per
layer and step, on the device:

1. `memory_select` chooses each row's blocks (the means scored against the
   step's queries, as on every path);
2. the chosen blocks' and the tail's keys and values are copied into the
   row's region of the layer tensor (`Layout.with_recall_region`: whole KV
   blocks after the scratch cells, one region per slot row and one for
   padding rows), keys turned to their read position on the way
   (`turn_rows_`);
3. the plan's block lists gain the row's region blocks (`plan_block_mask`'s
   `extra_blocks`: a block mask built on the device from the selection), and
   the mask admits a region entry to exactly the queries the selection says
   read it (its block chosen and inside the query's memory, or in its tail).
   When every query of a row reads the same entries (a decode step, or a
   chunk under a per-step window) they are copied first, and the mask is one
   bound per row and head; a chunk under a per-query window marks each
   query's own;
4. one FlexAttention call reads sinks and window in place and the region:
   the memory is in the window's softmax, no log-sum-exp is joined, so the
   compiled CPU kernel (which returns none) serves it too. Compiled, every
   layer calls one shared region (`kernel_sharing.layer_region`), so a graph
   of any depth builds one kernel.

The region is scratch, rewritten by every layer of every step before it is
read: forks, rollbacks and resets never touch it.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ...config import BoundedKVConfig
from ..positions.masks import store_mask_mod
from ..storage.cell_rows import read_cells
from .flex_call import PlanView, flex_call, plan_block_mask
from .kernel_sharing import layer_region
from .recall import MemorySelection, MemoryTurns, turn_rows_

__all__ = ["attend_in_region"]


def attend_in_region(sel: MemorySelection, turns: MemoryTurns, layer: int, config: BoundedKVConfig, store, plan,
                     cells: Tuple[torch.Tensor, torch.Tensor, Optional[tuple]], flex: Tuple[torch.Tensor, torch.Tensor],
                     qs: torch.Tensor, pack: bool, kernel_options: dict, shared: bool,
                     lse: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(out, log-sum-exp or None)` of a `Recall` layer through FlexAttention, for a call without a `score_mod`.

    `store`: the group's `flexkv.cache.storage.store.LayerStore` (its layout holds the regions). `cells`: the
    layer's key and value tensors as stored and their scales (None unless quantized), read for the memory
    entries; `flex`: the tensors the kernel reads (the same, or their dequantized copies), into whose region
    the entries are written. `qs`: the scaled queries as the call lays them out (`[N, H, g * T, D]` packed,
    else `[N, Hq, T, D]`). `shared`: the call is traced as the one compiled region every layer shares
    (`kernel_sharing.layer_region`; compiled, without a log-sum-exp). `lse`: whether the call returns its
    log-sum-exp.
    """
    kc, vc, scales = cells
    kf, vf = flex
    ks, vs = (None, None) if scales is None else scales
    layout = store.layout
    step = plan.extras["recall"]
    N, H, g, T, D = sel.queries.shape
    S, R = kf.shape[2], layout.recall_row_len
    dev = qs.device
    work = sel.queries.dtype

    # The chosen blocks' entries, then the tail's: E entries a row, copied into its region.
    flat = torch.cat([sel.flat, step.tail_flat], dim=2)  # [N, H, E]
    E = flat.shape[2]
    keys = read_cells(kc, ks, flat, work, kf.dtype, fused=True)
    values = read_cells(vc, vs, flat, work, kf.dtype, fused=True)
    if sel.turn is not None:  # read at the position before the step's first window entry
        turn_rows_(keys, turns.tables(layer), torch.cat([sel.turn, step.tail_turn.expand(N, H, -1)], dim=2))
    start = step.region  # [N]: each row's region (made with the plan: CPU_MASK_CAPTURES)
    reads = sel.reads(step, config.query_window is not None)  # [N, H, T or 1, k]: which query reads which block
    k, bs = reads.shape[3], step.cand_entries.shape[3]
    blocks = reads.unsqueeze(-1).expand(N, H, reads.shape[2], k, bs).reshape(N, H, -1, k * bs)
    live = plan.ring_base.view(N, 1, 1, 1) >= 0  # padding rows read nothing
    cell = torch.arange(E, device=dev).view(1, 1, E)
    if T == 1 or config.query_window is None:
        # Every query of a row reads the same entries: those go first in its region (a stable partition on the
        # device), and the mask is one bound per row, `bound [N, 2]` (column 0): every KV head reads as many
        # (its live chosen blocks are the row's valid candidates, at most `top_k`: the same count for each head;
        # the tail is the row's).
        read = torch.cat([blocks[:, :, 0], step.tail_reads.view(N, 1, T, -1)[:, :, 0].expand(N, H, -1)],
                         dim=-1) & live.view(N, 1, 1)  # [N, H, E]
        before = torch.cumsum(read, dim=-1)
        count = before[..., -1:]
        place = torch.where(read, before - 1, count + cell - before)
        bound = _realized(start.view(N, 1) + count[:, 0].view(N, 1))
    else:
        # A chunk under a per-query window: each query has its own memory and tail, `bound [N, H, T, R]`.
        place = cell
        bound = torch.cat([blocks.expand(N, H, T, k * bs) & live,
                           step.tail_reads.view(N, 1, T, -1).expand(N, H, T, -1) & live,
                           torch.zeros(N, H, T, R - E, dtype=torch.bool, device=dev)], dim=-1)  # a cat (_realized)
    dest = ((torch.arange(H, device=dev) * S).view(1, H, 1) + start.view(N, 1, 1) + place).reshape(-1)
    kf.view(-1, kf.shape[3]).index_copy_(0, dest, keys.reshape(-1, kf.shape[3]).to(kf.dtype))
    vf.view(-1, vf.shape[3]).index_copy_(0, dest, values.reshape(-1, vf.shape[3]).to(vf.dtype))

    visited = -(-E // layout.block_size)  # the region's blocks this step fills
    extra = (start // layout.block_size).view(N, 1) + torch.arange(visited, device=dev).view(1, visited)
    if shared and not lse:
        out = _shared_call(qs, kf, vf, plan.table, start, bound, extra, store, plan.rows, T, plan.width,
                           plan.full_width, plan.full_blocks, pack, g, kernel_options)
        return out, None
    return _call(qs, kf, vf, plan, start, bound, extra, store, T, pack, g, kernel_options,
                 torch.compiler.is_compiling(), lse)


def _mask_mod(window: Callable, start: torch.Tensor, bound: torch.Tensor, T: int, pack: bool, g: int) -> Callable:
    """The step's retention mask (`window`) or a region entry the query reads: below its row's `bound [N, 2]`
    (column 0), or marked in `bound [N, H, T, R]` (a per-query window's chunk)."""
    if bound.dim() == 2:
        def mask_mod(b, h, q_idx, kv_idx):
            return window(b, h, q_idx, kv_idx) | ((kv_idx >= start[b]) & (kv_idx < bound[b, 0]))
    else:
        R = bound.shape[3]

        def mask_mod(b, h, q_idx, kv_idx):
            e = kv_idx - start[b]
            t, head = (q_idx % T, h) if pack else (q_idx, h // g)
            return window(b, h, q_idx, kv_idx) | ((e >= 0) & (e < R) & bound[b, head, t, e.clamp(0, R - 1)])
    return mask_mod


def _call(qs, kf, vf, plan, start, bound, extra, store, T, pack, g, options, own_buffers, lse):
    """The layer's FlexAttention call, traced inline: `(out, log-sum-exp or None)`."""
    mask_mod = _mask_mod(store_mask_mod(store, plan, T, pack), start, bound, T, pack, g)
    block_mask = plan_block_mask(store.layout, store.device.type, plan, qs.shape[2], mask_mod, own_buffers=own_buffers,
                                 extra_blocks=extra)
    return flex_call(qs, kf, vf, block_mask, options, lse=lse)


@layer_region
def _shared_call(qs, kf, vf, table, start, bound, extra, store, rows, tokens, width, full_width, full_blocks, pack, g,
                 options):
    """The same as one compiled region every layer of the graph shares (`flex_call.flex_layer`): the plan
    enters as its one table, the region's tensors beside it."""
    plan = PlanView(table, rows, tokens, width, full_width, full_blocks)
    return _call(qs, kf, vf, plan, start, bound, extra, store, tokens, pack, g, options, True, False)[0]


def _realized(x: torch.Tensor) -> torch.Tensor:
    """`x` with one more column that nothing reads, made by `torch.cat`: inductor's CPU lowering realizes a cat
    (an elementwise result a `mask_mod` captures it would not: CPU_MASK_CAPTURES)."""
    return torch.cat([x, x[..., :1]], dim=-1)
