"""The memory part of a `Recall` retention: choose blocks on the device, attend them, merge by log-sum-exp.

A `flexkv.config.Recall` cache keeps `memory` more cells in every slot's
ring, so an entry stays in the slot `memory` entries after it left the
window. The window part (sinks, window, the step's own tokens) is attended
by the cache's usual paths, unchanged; this module attends the memory part
of the same softmax and `CacheGroup.attend` merges the two by their
log-sum-exps (`flexkv.cache.paths.merge`), which is exact: the two key sets
are disjoint.

Per layer and step, all on the device, no host read (so a compiled step
neither waits nor recompiles as memories fill):

1. every row's candidate blocks: the `NB = (memory + T) // block + 2`
   stream-aligned blocks that can hold an entry some query of the step reads
   in memory (`[lo_0, hi_last)`), their keys gathered from the ring
   (`ring_base + j % ring_len`) and dequantized when the slots are;
2. under in-cache rotary positions, those keys turned to the position just
   before the step's first window entry (`Rotary.rotate` by `t_mem - j`:
   keys are stored rotated at their stream index);
3. each block's mean key over its entries in the step's memory, scored
   against the sum of the row's queries over the step and the KV head's
   query heads; a stable descending sort keeps the `top_k` highest (ties to
   the lower block), blocks without such entries never;
4. the selected blocks' keys and values (`top_k * block` per row and KV
   head) attended by each query with its own memory range as the mask, in
   float32 (float64 for a float64 cache), with the user's `score_mod`.

Cost per layer and step: a gather of `memory + T` keys per row and KV head
(the scoring), and attention over `top_k * block` entries per query.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ...config import BoundedKVConfig
from ..host.layout import Layout

__all__ = ["candidate_blocks", "attend_memory", "check_recall_call"]


def candidate_blocks(config: BoundedKVConfig, tokens: int) -> int:
    """How many blocks a row's step can hold memory entries in: `(memory + T) // block + 2`."""
    recall = config.recall
    return (recall.memory + tokens) // recall.block + 2


def check_recall_call(config: BoundedKVConfig, query_only, joined, relative: bool = False) -> None:
    """Refuse what the memory part does not serve, naming it (before anything is written)."""
    if relative:
        raise ValueError(f"attend: a RelativePositionScores score_mod is not served under {config.recall!r} "
                         f"(its table is formed for the window's distances); use a SinkWindow cache")
    if query_only is not None:
        raise ValueError(f"attend: query_only queries are not served under {config.recall!r} (their memory "
                         f"selection is not defined); attend them with a SinkWindow cache")
    if joined is not None:
        raise ValueError(f"attend: joined keys are not served under {config.recall!r}; merge the parts by "
                         f"return_lse=True and flexkv.merge_attention instead")


def _memory_ranges(config: BoundedKVConfig, plan, T: int):
    """`(lo, hi)`, each `[N, T]` int64: query `t` of row `b` reads memory entries `lo <= j < hi`."""
    recall = config.recall
    n = plan.n.long().view(-1, 1)
    sink = plan.sink.long().view(-1, 1)
    if config.query_window is not None:
        t = torch.arange(T, device=n.device).view(1, T)
        hi = torch.maximum(sink, n + t - config.query_window)
    else:
        hi = plan.lo.long().view(-1, 1).expand(-1, T)
    lo = torch.maximum(sink, hi - recall.memory)
    return lo, hi


def attend_memory(
    config: BoundedKVConfig,
    layout: Layout,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scales: Optional[Tuple[torch.Tensor, torch.Tensor]],
    plan,
    *,
    scale: float,
    score_mod: Optional[Callable] = None,
    positions: str = "stream",
    rotary=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The memory part of a `Recall` layer's attention: `(out [N, Hq, T, Dv], lse [N, Hq, T])`, `lse = -inf`
    (and `out = 0`) where a query reads no memory entry.

    `q`: the step's queries `[N, Hq, T, D]`, as `attend` got them (unscaled). `kc`, `vc`: the layer's
    key and value tensors `[1, H, S, *]` after the step's write; `scales` their per-cell scales when
    quantized. `rotary`: the layer's `Rotary` when its keys carry in-cache positions (memory read at
    the position before the step's first window entry), else None (read at the stream index).
    `score_mod(score, b, h, q_pos, kv_pos)` gets stream positions, or with `positions="cache"` in-cache
    ones (a memory entry then sits `q_pos - p + t_mem` for a query at stream index `p`).
    """
    recall = config.recall
    bs, k_top = recall.block, recall.top_k
    N, Hq, T, D = q.shape
    H = kc.shape[1]
    g = Hq // H
    dev = q.device
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    NB = candidate_blocks(config, T)

    lo, hi = _memory_ranges(config, plan, T)  # [N, T]
    span = plan.span.long().view(N, 1)
    writes = torch.arange(T, device=dev).view(1, T) < span  # queries that count in the selection
    # The step's memory, over the queries that write: [u_lo, u_hi) (empty for a row that writes nothing).
    big = torch.iinfo(torch.int64).max // 4
    u_lo = torch.where(writes, lo, big).amin(dim=1)
    u_hi = torch.where(writes, hi, -big).amax(dim=1)
    sink = plan.sink.long()
    first = torch.div(torch.clamp(u_lo, max=big // 2) - sink, bs, rounding_mode="floor").clamp_min(0)  # [N]
    e = torch.arange(NB * bs, device=dev)
    j = sink.view(N, 1) + first.view(N, 1) * bs + e.view(1, -1)  # [N, NB*bs] candidate stream indices
    in_step = (j >= u_lo.view(N, 1)) & (j < u_hi.view(N, 1))
    ring = layout.ring_len
    cells = plan.ring_base.long().view(N, 1) + torch.remainder(j, ring)
    # Entries the ring holds after the step's write; elsewhere (and for padding rows, whose regions lie out
    # of reach) a readable cell that nothing reads.
    end = plan.n.long().view(N, 1) + T
    held = (j >= sink.view(N, 1)) & (j < end) & (j >= end - ring)
    cells = torch.where(held, cells, 0).clamp(0, kc.shape[2] - 1)

    flat = cells.view(-1)
    keys = kc[0].index_select(1, flat)  # [H, N*L, D]
    if scales is not None:
        keys = keys.to(work) * scales[0][0].index_select(1, flat)
    keys = keys.to(work).view(H, N, -1, D).transpose(0, 1)  # [N, H, L, D]
    t_mem = None
    if rotary is not None:
        t_mem = (hi[:, :1] - 1)  # [N, 1]: just before the first query's first window entry
        keys = rotary.rotate(keys, t_mem - j)
    # 3: block means over the step's memory, scored against the row's summed queries.
    mask = in_step.to(work).view(N, 1, NB, bs, 1)
    kb = keys.view(N, H, NB, bs, D)
    count = in_step.view(N, NB, bs).sum(-1)  # [N, NB]
    mean = (kb * mask).sum(3) / count.clamp_min(1).to(work).view(N, 1, NB, 1)
    qsum = (q.to(work) * writes.to(work).view(N, 1, T, 1)).view(N, H, g, T, D).sum(dim=(2, 3))  # [N, H, D]
    score = torch.einsum("nhd,nhbd->nhb", qsum, mean)
    score = score.masked_fill((count == 0).view(N, 1, NB), float("-inf"))
    ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
    chosen = order[..., :k_top]  # [N, H, k]
    live = torch.isfinite(ranked[..., :k_top])  # [N, H, k]
    # 4: the chosen blocks' entries, read by each query within its own memory range.
    pick = chosen.view(N, H, k_top, 1).expand(N, H, k_top, bs)
    j_sel = j.view(N, 1, NB, bs).expand(N, H, NB, bs).gather(2, pick)  # [N, H, k, bs]
    ksel = kb.gather(2, pick.unsqueeze(-1).expand(N, H, k_top, bs, D)).reshape(N, H, 1, k_top * bs, D)
    c_sel = cells.view(N, 1, NB, bs).expand(N, H, NB, bs).gather(2, pick).reshape(N, H, k_top * bs)
    head = torch.arange(H, device=dev).view(1, H, 1)
    vsel = vc[0][head, c_sel]  # [N, H, k*bs, Dv]
    if scales is not None:
        vsel = vsel.to(work) * scales[1][0][head, c_sel]
    vsel = vsel.to(work).view(N, H, 1, k_top * bs, -1)
    j_sel = j_sel.reshape(N, H, 1, 1, k_top * bs)
    reads = (live.view(N, H, k_top, 1).expand(N, H, k_top, bs).reshape(N, H, 1, 1, k_top * bs)
             & (j_sel >= lo.view(N, 1, 1, T, 1)) & (j_sel < hi.view(N, 1, 1, T, 1)))  # [N, H, 1, T, k*bs]
    qg = q.to(work).view(N, H, g, T, D)
    scores = torch.einsum("nhgtd,nhgsd->nhgts", qg, ksel) * scale  # ksel broadcasts over g
    if score_mod is not None:
        p = plan.n.long().view(N, 1, 1, 1, 1) + torch.arange(T, device=dev).view(1, 1, 1, T, 1)
        kv_pos = j_sel
        q_pos = p
        if positions == "cache":
            evicted = _evicted(config, plan, T)  # [N, T]
            q_pos = torch.where(p < plan.sink.long().view(N, 1, 1, 1, 1), p, p - evicted.view(N, 1, 1, T, 1))
            kv_pos = q_pos - p + (t_mem.view(N, 1, 1, 1, 1) if t_mem is not None else j_sel)
        b = torch.arange(N, device=dev).view(N, 1, 1, 1, 1)
        h = torch.arange(Hq, device=dev).view(1, H, g, 1, 1)
        scores = score_mod(scores, b, h, q_pos, kv_pos).to(work)
    scores = scores.masked_fill(~reads, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [N, H, g, T]
    weights = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("nhgts,nhgsd->nhgtd", weights, vsel)
    return out.reshape(N, Hq, T, -1).to(q.dtype), lse.reshape(N, Hq, T)


def _evicted(config: BoundedKVConfig, plan, T: int) -> torch.Tensor:
    """`[N, T]`: entries each query has evicted (`flexkv.cache.positions.masks.make_score_mod`'s count)."""
    s = plan.sink.long().view(-1, 1)
    if config.query_window is None:
        return (plan.lo.long().view(-1, 1) - s).expand(-1, T)
    t = torch.arange(T, device=s.device).view(1, T)
    return (plan.n.long().view(-1, 1) + t - config.query_window - s).clamp_min(0)
