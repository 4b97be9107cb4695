"""Attention over each row's own cells with dense kernels: the CPU path for chunked steps.

A row of a step reads at most `max_retained + max_step_tokens` cells, and
the plan already names them: at most a few cell intervals per row
(`cell_lo{k}`, `cell_hi{k}`). This path brings those cells side by side and
runs dense attention over them, in one of two ways:

- **in place** (no sources, and the step uses at least half of the pool's
  slot rows): every cell a row reads lies in its slot row (sink region plus
  ring; the step's own tokens were just written into the ring), so the
  layer tensor's slot pool, viewed as `[slot rows, H, slot_row_len, D]`, is
  already a dense batch. The step's queries are scattered into slot order
  instead, the keys and values never move, and slot rows the step does not
  use attend nothing and are dropped;
- **gathered** (otherwise): the cells of each row's intervals are copied, in
  order, into a `[N, H, W, D]` block with `W = max_retained +
  max_step_tokens`; positions past a row's count are masked.

In both, the same `mask_mod` and `score_mod` that FlexAttention would run
decide, on the real cell indices, which cells a query reads and how it
scores them, so the result is exactly FlexAttention's over the whole layer
tensor. Without a `score_mod` the batch runs through
`scaled_dot_product_attention`'s fused CPU kernel; with one, the scores are
formed, modified and normalised explicitly (in float32, or float64 for
float64 inputs).

Shapes depend only on the config and the step's `N` and `T`, so a compiled
step does not recompile as streams move. Single-token decode stays on
FlexAttention, which reads the blocks a row needs in place with no copy
(see `BoundedKVManager.attend`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .layout import Layout
from .planner import INTERVALS

__all__ = ["attend_rows", "reads_in_place", "gather_width"]

_NEG_INF = float("-inf")


def reads_in_place(layout: Layout, rows: int) -> bool:
    """Whether a step of `rows` rows attends the slot pool in place (else it gathers)."""
    has_sources = bool(layout.source_row_len and layout.max_sources)
    return not has_sources and layout.max_slots * layout.rows_per_request <= 2 * rows


def gather_width(config) -> int:
    """Cells a gathered row holds: the most any row of `config` reads in one step."""
    return config.max_retained + config.max_step_tokens


def _dense(q, keys, values, b, cells, mask_mod, score_mod, extra=None, want_lse=False):
    """Attention of q `[B, H, Q, D]` over keys/values `[B, H, W, D]` whose cells are `cells` `[B, W]`,
    for plan rows `b` `[B]`; `extra` (`[B, W]` bool or None) further limits the readable positions.
    Returns the output, whether each query reads any cell (`[B, 1, Q or 1]`) and, with `want_lse`,
    each query's natural-log sum of exp of its scores (`[B, H, Q]`, at least float32, -inf where it
    reads nothing; else None)."""
    B, H, Q, _ = q.shape
    dev = q.device
    bb = b.view(B, 1, 1, 1)
    q_idx = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv_idx = cells.view(B, 1, 1, -1)
    allowed = mask_mod(bb, torch.zeros((), dtype=torch.long, device=dev), q_idx, kv_idx)
    if extra is not None:
        allowed = allowed & extra.view(B, 1, 1, -1)
    reads = allowed.any(dim=-1)
    if score_mod is None and not want_lse:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=1.0), reads, None
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(work), keys.to(work).transpose(-1, -2))
    if score_mod is not None:
        scores = score_mod(scores, bb, torch.arange(H, device=dev).view(1, H, 1, 1), q_idx, kv_idx)
    scores = scores.masked_fill(~allowed, _NEG_INF)
    top = torch.where(reads.unsqueeze(-1), scores.amax(dim=-1, keepdim=True), 0.0)
    probs = torch.exp(scores - top)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, values.to(work)) / total.clamp_min(1e-30)
    lse = (torch.log(total) + top).squeeze(-1) if want_lse else None
    return out.to(q.dtype), reads, lse


def _interval_cells(plan, width: int, device) -> tuple:
    """Per row, the cells of its intervals laid side by side: `([N, width] cells, [N, width] in use)`."""
    los = torch.stack([getattr(plan, f"cell_lo{k}") for k in range(INTERVALS)], dim=1).long()
    his = torch.stack([getattr(plan, f"cell_hi{k}") for k in range(INTERVALS)], dim=1).long()
    ends = torch.cumsum(his - los, dim=1)  # [N, K]: where each interval's cells end in the row
    starts = ends - (his - los)
    pos = torch.arange(width, device=device).view(1, -1)
    k = (pos.unsqueeze(-1) >= ends.unsqueeze(1)).sum(-1).clamp(max=INTERVALS - 1)  # [N, width]
    cells = torch.gather(los, 1, k) + pos - torch.gather(starts, 1, k)
    used = pos < ends[:, -1:]
    return torch.where(used, cells, 0), used


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout,
    plan,
    mask_mod: Callable,
    score_mod: Optional[Callable] = None,
    width: Optional[int] = None,
    return_lse: bool = False,
):
    """Attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over the
    cells each row may read, with the mask and score modifications of the FlexAttention path.
    Returns `[N, H, Q, Dv]`, `Dv` the value width of `v_cache`.

    `width`: cells per gathered row (`gather_width(config)`); needed unless the step reads in
    place. Queries that read nothing (padding rows) return zeros, as in FlexAttention. With
    `return_lse`, returns `(out, lse)`: each query's natural-log sum of exp of its scores
    (`[N, H, Q]`, float32; -inf where it reads nothing), as FlexAttention's log-sum-exp.
    """
    N, H, Q, D = q.shape
    Dv = v_cache.shape[-1]  # values may be narrower or wider than keys
    dev = q.device
    if reads_in_place(layout, N):
        Lr = layout.slot_row_len
        n_slot = layout.max_slots * layout.rows_per_request
        base = layout.slots_base
        live = plan.sink_base >= 0
        # Queries go to their slot rows; padding rows go to one extra row that is dropped.
        where = torch.where(live, plan.slot_row.long(), n_slot)
        rows = torch.zeros(n_slot + 1, dtype=torch.long, device=dev).index_put(
            (where,), torch.arange(N, device=dev))[:n_slot]
        q_slots = q.new_zeros(n_slot + 1, H, Q, D).index_put((where,), q)[:n_slot]
        keys = k_cache[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, D).transpose(0, 1)
        values = v_cache[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, Dv).transpose(0, 1)
        cells = base + torch.arange(n_slot, device=dev).view(-1, 1) * Lr + torch.arange(Lr, device=dev)
        out, reads, lse = _dense(q_slots, keys, values, rows, cells, mask_mod, score_mod, want_lse=return_lse)
        back = where.clamp(max=n_slot - 1)
        out, reads = out.index_select(0, back), reads.index_select(0, back) & live.view(N, 1, 1)
        lse = lse.index_select(0, back) if lse is not None else None
    else:
        if width is None:
            raise ValueError("attend_rows: width (gather_width(config)) is needed when the step gathers")
        cells, used = _interval_cells(plan, width, dev)
        flat = cells.view(-1)
        keys = k_cache[0].index_select(1, flat).view(H, N, width, D).transpose(0, 1)
        values = v_cache[0].index_select(1, flat).view(H, N, width, Dv).transpose(0, 1)
        out, reads, lse = _dense(q, keys, values, torch.arange(N, device=dev), cells, mask_mod, score_mod, used,
                                 want_lse=return_lse)
    out = torch.where(reads.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=dev))
    if return_lse:
        return out, torch.where(reads, lse, _NEG_INF)
    return out
