"""Attention over each row's own cells with dense kernels: the CPU path for chunked steps.

Everything a row of a step may read lies in two runs of cells: its slot row
(sink region plus ring, `slot_row_len` cells; the step's own tokens were
just written into the ring) and, when the cache has sources, its source row
(`source_row_len` cells). This path attends each run as a dense batch and,
when there are two, merges them by their log-sum-exp:

- slot rows, read in place: the layer tensor's slot pool viewed as
  `[slot rows, H, slot_row_len, D]` (no copy). The step's queries are
  scattered into slot order instead, so the keys and values never move;
  slot rows the step does not use attend nothing and are dropped. When the
  pool has many more slot rows than the step (more than twice), the step's
  slot rows are gathered instead, so the work follows the step;
- source rows, gathered: sources are shared, so several rows of a step can
  read one source row; each row's source row is copied next to it.

Inside each batch the same `mask_mod` and `score_mod` that FlexAttention
would run decide, on the real cell indices, which cells a query reads and
how it scores them, so the result is exactly FlexAttention's over the whole
layer tensor. Without a `score_mod` the batches run through
`scaled_dot_product_attention`'s fused CPU kernel; with one, the scores are
formed, modified and normalised explicitly (in float32).

Shapes depend only on the config and the step's `N` and `T`, so a compiled
step does not recompile as streams move. It pays for slot rows outside the
step (or a gather) and for masked cells inside the runs, which is cheap next
to a chunk of many queries; single-token decode stays on FlexAttention,
which visits only the blocks a row reads (see `BoundedKVManager.attend`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .layout import Layout

__all__ = ["attend_rows"]

_NEG_INF = float("-inf")


def _dense(q, keys, values, b, cells, mask_mod, score_mod, need_lse: bool):
    """Attention of q `[B, H, Q, D]` over keys/values `[B, H, W, D]` whose cells are `cells` `[B, W]`,
    for plan rows `b` `[B]`. Returns the output, the log-sum-exp `[B, H, Q]` (or None) and whether each
    query reads any cell (`[B, 1, Q or 1]`)."""
    B, H, Q, _ = q.shape
    dev = q.device
    bb = b.view(B, 1, 1, 1)
    q_idx = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv_idx = cells.view(B, 1, 1, -1)
    allowed = mask_mod(bb, torch.zeros((), dtype=torch.long, device=dev), q_idx, kv_idx)
    reads = allowed.any(dim=-1)
    if score_mod is not None:
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))
        scores = score_mod(scores, bb, torch.arange(H, device=dev).view(1, H, 1, 1), q_idx, kv_idx)
        scores = scores.masked_fill(~allowed, _NEG_INF)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(reads.unsqueeze(-1), lse.unsqueeze(-1), 0.0))
        out = torch.matmul(probs, values.float()).to(q.dtype)
        return out, (lse if need_lse else None), reads
    if not need_lse:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=1.0), None, reads
    bias = torch.zeros((), dtype=q.dtype, device=dev).masked_fill(~allowed, _NEG_INF)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=bias, scale=1.0)[:2]
    return out, torch.where(reads, lse, _NEG_INF), reads


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout,
    plan,
    mask_mod: Callable,
    score_mod: Optional[Callable] = None,
) -> torch.Tensor:
    """Attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over the
    cells each row may read, with the mask and score modifications of the FlexAttention path.

    Queries that read nothing (padding rows) return zeros, as in FlexAttention.
    """
    N, H, Q, D = q.shape
    dev = q.device
    R = layout.rows_per_request
    Lr = layout.slot_row_len
    n_slot = layout.max_slots * R
    base = layout.slots_base
    has_sources = bool(layout.source_row_len and layout.max_sources)
    arange_r = torch.arange(Lr, device=dev)
    slot_row = plan.slot_row.long()

    pool_k = k_cache[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, D)
    pool_v = v_cache[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, D)
    if n_slot <= 2 * N:
        # Queries go to their slot rows; padding rows go to one extra row that is dropped.
        live = plan.sink_base >= 0
        where = torch.where(live, slot_row, n_slot)
        rows = torch.zeros(n_slot + 1, dtype=torch.long, device=dev).index_put(
            (where,), torch.arange(N, device=dev))[:n_slot]
        q_slots = q.new_zeros(n_slot + 1, H, Q, D).index_put((where,), q)[:n_slot]
        cells = base + torch.arange(n_slot, device=dev).view(-1, 1) * Lr + arange_r
        out, lse, reads = _dense(q_slots, pool_k.transpose(0, 1), pool_v.transpose(0, 1), rows, cells,
                                 mask_mod, score_mod, has_sources)
        back = where.clamp(max=n_slot - 1)
        out, reads = out.index_select(0, back), reads.index_select(0, back) & live.view(N, 1, 1)
        lse = lse.index_select(0, back) if lse is not None else None
    else:
        keys = pool_k.index_select(1, slot_row).transpose(0, 1)
        values = pool_v.index_select(1, slot_row).transpose(0, 1)
        cells = base + slot_row.view(-1, 1) * Lr + arange_r
        out, lse, reads = _dense(q, keys, values, torch.arange(N, device=dev), cells,
                                 mask_mod, score_mod, has_sources)

    if has_sources:
        Ls = layout.source_row_len
        n_src = layout.max_sources * R
        src_row = plan.src_row.long()
        keys = k_cache[0, :, :n_src * Ls].view(H, n_src, Ls, D).index_select(1, src_row).transpose(0, 1)
        values = v_cache[0, :, :n_src * Ls].view(H, n_src, Ls, D).index_select(1, src_row).transpose(0, 1)
        cells = src_row.view(-1, 1) * Ls + torch.arange(Ls, device=dev)
        out2, lse2, reads2 = _dense(q, keys, values, torch.arange(N, device=dev), cells, mask_mod, score_mod, True)
        # Merge the two partial softmaxes by their log-sum-exp.
        top = torch.maximum(lse, lse2)
        top = torch.where(torch.isfinite(top), top, 0.0)
        w1 = torch.exp(lse - top).unsqueeze(-1)
        w2 = torch.exp(lse2 - top).unsqueeze(-1)
        total = w1 + w2
        mixed = (torch.nan_to_num(out.float()) * w1 + torch.nan_to_num(out2.float()) * w2) / torch.where(
            total > 0, total, 1.0)
        out = mixed.to(q.dtype)
        reads = reads | reads2
    return torch.where(reads.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=dev))
