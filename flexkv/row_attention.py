"""Attention over each row's own cells, gathered: the CPU path for chunked steps.

Everything a row of a step may read lies in two contiguous runs of cells:
its source row (`source_row_len` cells) and its slot row (sink region plus
ring, `slot_row_len` cells; the step's own tokens were just written into the
ring). This path copies those runs for every row of the step into a
`[N, H, W, D]` block (`W = source_row_len + slot_row_len`, or just the slot
row when the cache has no sources), evaluates the same `mask_mod` and
`score_mod` FlexAttention would on the gathered cells' indices, and runs
dense attention over the block.

It computes exactly what FlexAttention computes over the whole layer tensor:
the cells it leaves out are cells no row may read. Shapes depend only on the
config and the step's `N` and `T`, so a compiled step does not recompile as
streams move. It pays one copy of the gathered cells, which is cheap next to
the attention of a chunk of many queries and costly for single-token decode,
where FlexAttention reads the cells in place (see `BoundedKVManager.attend`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .layout import Layout

__all__ = ["gather_row_cells", "attend_rows"]


def gather_row_cells(cache: torch.Tensor, layout: Layout, plan) -> tuple:
    """The cells of every row's source row and slot row: `([N, H, W, D], cell indices [N, W])`."""
    H, D = cache.shape[1], cache.shape[3]
    R = layout.rows_per_request
    Lr = layout.slot_row_len
    n_slot_rows = layout.max_slots * R
    base = layout.slots_base
    slots = cache[0, :, base:base + n_slot_rows * Lr].view(H, n_slot_rows, Lr, D)
    slot_row = plan.slot_row.long()
    parts = [slots.index_select(1, slot_row)]
    cells = [base + slot_row.view(-1, 1) * Lr + torch.arange(Lr, device=cache.device)]
    Ls = layout.source_row_len
    if Ls and layout.max_sources:
        n_src_rows = layout.max_sources * R
        sources = cache[0, :, :n_src_rows * Ls].view(H, n_src_rows, Ls, D)
        src_row = plan.src_row.long()
        parts.insert(0, sources.index_select(1, src_row))
        cells.insert(0, src_row.view(-1, 1) * Ls + torch.arange(Ls, device=cache.device))
    block = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return block.transpose(0, 1), (cells[0] if len(cells) == 1 else torch.cat(cells, dim=1))


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout,
    plan,
    mask_mod: Callable,
    score_mod: Optional[Callable] = None,
) -> torch.Tensor:
    """Attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over each
    row's gathered cells, with the mask and score modifications of the FlexAttention path.

    Queries whose mask is empty (padding rows) return zeros, as in FlexAttention.
    """
    N, H, Q, D = q.shape
    keys, cells = gather_row_cells(k_cache, layout, plan)
    values, _ = gather_row_cells(v_cache, layout, plan)
    b = torch.arange(N, device=q.device).view(N, 1, 1, 1)
    q_idx = torch.arange(Q, device=q.device).view(1, 1, Q, 1)
    kv_idx = cells.view(N, 1, 1, -1)
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    allowed = mask_mod(b, zero, q_idx, kv_idx)  # [N, 1, Q or 1, W]
    attended = allowed.any(dim=-1, keepdim=True)
    if score_mod is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=1.0)
    else:
        h = torch.arange(H, device=q.device).view(1, H, 1, 1)
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))
        scores = score_mod(scores, b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.float()).to(q.dtype)
    return torch.where(attended, out, torch.zeros((), dtype=out.dtype, device=out.device))
