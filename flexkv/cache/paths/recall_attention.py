"""The attention of a `Recall` layer: its window and its chosen memory entries in one softmax.

Three finishes of what `flexkv.cache.paths.recall` chose (`memory_select`):
on the rows path on the CPU with no `score_mod`, the window's gathered
cells and the chosen entries in one call of PyTorch's fused CPU attention
kernel, which returns the log-sum-exp too (`attend_joined`); on the rows
path otherwise, the memory part's scores (`memory_part`, `score_mod`
applied) and the window's gathered cells in one softmax in torch
(`attend_with_window`); through FlexAttention with a `score_mod`, the
window's result joined to the memory part by their log-sum-exps
(`join_window`; without one, `flexkv.cache.paths.recall_region` reads the
memory in the window's own call). Memory keys are
turned to the position they are read at from the layer's table
(`MemoryTurns`), in place.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from ...config import BoundedKVConfig
from ..storage.cell_rows import read_cells
from .recall import (
    MemoryIndex,
    MemorySelection,
    MemoryStep,
    MemoryTurns,
    memory_select,
    turn_rows_,
    window_starts,
    work_dtype,
)

__all__ = ["MemoryCall", "attend_joined", "attend_with_window", "join_window", "memory_part"]


def _window_part(geo, H: int, S: int, width: int, work: torch.dtype, memo: dict):
    """`(W, flat [N, H, W], bias [N, 1, Q, W])`: the first `W` of the cells the rows path gathers for the step
    (`geo`: its `RowGeometry`) as rows of a layer tensor viewed `[H * S, D]`, and their mask in `work`. Made
    once per step in `memo` (compiled, `memo` is a fresh dict: no `id()` in the graph, which would recompile
    it every step)."""
    W = min(width, geo.cells.shape[-1])
    key = "recall_window" if torch.compiler.is_compiling() else ("recall_window", id(geo))
    shared = memo.get(key)
    if shared is None or shared[0] is not geo:
        N = geo.cells.shape[0]
        flat = (torch.arange(H, device=geo.cells.device) * S).view(1, H, 1) + geo.cells[:, :W].reshape(N, 1, W)
        shared = memo[key] = (geo, W, flat, geo.bias[..., :W].to(work))
    return shared[1:]


class MemoryCall(NamedTuple):
    """One layer's memory part as both of its finishes take it (`memory_part`)."""

    #: `[N, H, g, T, E]` each query's scores over its row's memory entries (scaled, `score_mod` applied,
    #: `-inf` where it does not read one) and `[N, H, E, Dv]` their values, in the work dtype.
    scores: torch.Tensor
    values: torch.Tensor
    #: `[N, H, g, T, D]` the scaled queries in the work dtype.
    queries: torch.Tensor



def memory_part(
    index: MemoryIndex,
    turns: MemoryTurns,
    layer: int,
    config: BoundedKVConfig,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scales: Optional[Tuple[torch.Tensor, torch.Tensor]],
    plan,
    *,
    scale: float,
    score_mod: Optional[Callable] = None,
    positions: str = "stream",
) -> MemoryCall:
    """The memory part of a `Recall` layer's attention (`MemoryCall`). Writes the step's whole blocks into
    `index` first.

    `q`: the step's queries `[N, Hq, T, D]`, as `attend` got them (unscaled). `kc`, `vc`: the layer's
    key and value tensors `[1, H, S, *]` after the step's write; `scales` their per-cell scales when
    quantized. `turns`: the layer's table when its keys carry in-cache positions (memory read at the
    position before the step's first window entry), else memory is read at its stream index. `plan`:
    the group's plan, carrying what its layers share (`plan.extras["recall"]`, a `MemoryStep`, and
    `["recall_turns"]`, `MemoryTurns.turn_matrices`). `score_mod(score, b, h, q_pos, kv_pos)` gets
    stream positions, or with `positions="cache"` in-cache ones (a memory entry then sits
    `q_pos - p + t_mem` for a query at stream index `p`).
    """
    bs, k_top = index.block, index.top_k
    N, Hq, T, D = q.shape
    H = kc.shape[1]
    g = Hq // H
    work = work_dtype(q.dtype)
    ks, vs = (None, None) if scales is None else scales
    tables = turns.tables(layer)
    step = plan.extras["recall"]
    sel = memory_select(index, turns, layer, q, kc, scales, plan, scale=scale)
    qw = sel.queries
    flat = torch.cat([sel.flat, step.tail_flat], dim=2)  # [N, H, E]
    keys = read_cells(kc, ks, flat, work, q.dtype)
    values = read_cells(vc, vs, flat, work, q.dtype)
    if tables is not None:
        turn_rows_(keys, tables, torch.cat([sel.turn, step.tail_turn.expand(N, H, -1)], dim=2))

    scores = (qw.reshape(N, H, g * T, D) @ keys.transpose(2, 3)).view(N, H, g, T, -1)
    if score_mod is not None:
        jq = torch.cat([sel.gathered(step.cand_entries), _tail_entries(step, bs, T).expand(N, H, -1)],
                       dim=2).view(N, H, 1, 1, -1)
        scores = _scored(score_mod, scores, jq, plan, config, step, N, H, g, T, Hq, positions, tables is not None,
                         work)
    # Which query reads which entry: a live chosen block inside its own memory, a tail entry inside its own tail.
    reads = sel.reads(step, config.query_window is not None)  # [N, H, T or 1, k]
    sel_scores = scores[..., :k_top * bs].view(N, H, g, T, k_top, bs)
    sel_scores.masked_fill_(~reads.view(N, H, 1, -1, k_top, 1), float("-inf"))
    scores[..., k_top * bs:].masked_fill_(~step.tail_reads, float("-inf"))
    return MemoryCall(scores, values, qw)


def attend_joined(sel: MemorySelection, turns: MemoryTurns, layer: int, config: BoundedKVConfig, plan,
                  kc: torch.Tensor, vc: torch.Tensor, scales: Optional[Tuple[torch.Tensor, torch.Tensor]], geo,
                  dtype: torch.dtype, width: int, memo: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """The window's cells, as the rows path gathers them (`geo`: its `RowGeometry` of the step, unpacked
    queries), and the chosen memory entries read in one gather and attended in one call of PyTorch's fused
    CPU attention kernel (which gives the log-sum-exp): `(out [N, Hq, T, Dv] in `dtype`, lse [N, Hq, T])`.
    For a step with no `score_mod`; `attend_with_window` takes one. `width`: the most cells a row of this
    step reads (`max_retained + T`). `memo`: where the step's layers share the window's cells and mask."""
    qw = sel.queries
    N, H, g, T, D = qw.shape
    ks, vs = (None, None) if scales is None else scales
    work = qw.dtype
    W, wflat, wbias = _window_part(geo, H, kc.shape[2], width, work, memo)
    step = plan.extras["recall"]
    flat = torch.cat([wflat, sel.flat, step.tail_flat], dim=2)  # [N, H, W + E]
    keys = read_cells(kc, ks, flat, work, dtype)
    values = read_cells(vc, vs, flat, work, dtype)
    if sel.turn is not None:  # the memory's keys turned where they lie
        turn_rows_(keys[:, :, W:], turns.tables(layer), torch.cat([sel.turn, step.tail_turn.expand(N, H, -1)], dim=2))
    # The additive mask: the window's, each chosen block's (0 or -inf for all its entries), the tail's.
    k_top, bs = sel.order.shape[2], step.cand_entries.shape[3]
    compiling = torch.compiler.is_compiling()  # then the host flags are not read (each would be a guard)
    if not compiling and step.full:  # every chosen block read: one mask for the step's layers
        shared = memo.get(("recall_full", id(geo)))
        if shared is None or shared[0] is not geo:
            shared = memo[("recall_full", id(geo))] = (geo, torch.cat(
                [wbias.expand(N, 1, T, W), torch.zeros(N, 1, T, k_top * bs, dtype=work, device=wbias.device),
                 step.tail_bias], dim=-1))
        bias = shared[1]
    else:
        reads = sel.reads(step, config.query_window is not None)  # [N, H, T or 1, k]
        blocks = torch.where(reads, torch.zeros((), dtype=work, device=reads.device), float("-inf"))
        blocks = blocks.unsqueeze(-1).expand(N, H, reads.shape[2], k_top, bs).reshape(N, H, -1, k_top * bs)
        bias = torch.cat([wbias.expand(N, H, T, W), blocks.expand(N, H, T, -1), step.tail_bias.expand(N, H, T, -1)],
                         dim=-1)
    if T > 1 and g > 1:  # packed query i * T + t reads as query t (under `full` T is 1)
        bias = bias.unsqueeze(2).expand(N, H, g, T, -1).reshape(N, H, g * T, -1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qw.reshape(N, H, g * T, D), keys, values, 0.0, False, attn_mask=bias, scale=1.0)[:2]
    if compiling or not (geo.all_read or step.real):  # the kernel gives a query reading nothing 0 and 0
        lse = lse.view(N, H, g, T).masked_fill(~geo.row_reads.view(N, 1, 1, -1), float("-inf"))
    return out.view(N, H * g, T, -1).to(dtype), lse.reshape(N, H * g, T)



def join_window(window: Tuple[torch.Tensor, torch.Tensor], memory: MemoryCall) -> Tuple[torch.Tensor, torch.Tensor]:
    """The window part `window = (out [N, Hq, T, Dv], lse [N, Hq, T])` (a path's result with its
    log-sum-exp, `-inf` or NaN where a query read nothing) and the memory part in one softmax: `(out,
    lse)` alike (exact: the key sets are disjoint)."""
    out_w, lse_w = window
    scores, values = memory.scores, memory.values
    N, H, g, T, _ = scores.shape
    lse_w = torch.nan_to_num(lse_w.reshape(N, H, g, T).to(scores.dtype), nan=float("-inf"), neginf=float("-inf"))
    lse = torch.logaddexp(lse_w, torch.logsumexp(scores, dim=-1))
    at = torch.where(torch.isneginf(lse), 0.0, lse)
    mem = torch.exp(scores - at.unsqueeze(-1)).view(N, H, g * T, -1) @ values  # [N, H, g * T, Dv]
    out = torch.exp(lse_w - at).view(N, H, g * T, 1) * out_w.reshape(N, H, g * T, -1).to(mem.dtype) + mem
    return out.view(N, H * g, T, -1).to(out_w.dtype), lse.reshape(N, H * g, T)


def attend_with_window(memory: MemoryCall, kc: torch.Tensor, vc: torch.Tensor,
                       scales: Optional[Tuple[torch.Tensor, torch.Tensor]], geo, window_score_mod: Optional[Callable],
                       dtype: torch.dtype, width: int, memo: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """The window's cells, as the rows path gathers them (`geo`: its `RowGeometry` of the step, packed
    queries), and the memory part in one softmax: `(out [N, Hq, T, Dv] in `dtype`, lse [N, Hq, T])`.
    One pass where the rows path and a join would make two: the window's own softmax, its log-sum-exp
    and the join are not formed. `window_score_mod`: the step's `score_mod` as the rows path takes it
    (layer-tensor cells, packed queries), or None. `width`: the most cells a row of this step reads
    (`max_retained + T`): a gathered row holds them first, so the rest of it is not read. `memo`: where
    the step's layers share the window's cells and mask (`memory_part`'s)."""
    scores_m, values_m, qw = memory
    N, H, g, T, D = qw.shape
    ks, vs = (None, None) if scales is None else scales
    work = qw.dtype
    W, flat, bias = _window_part(geo, H, kc.shape[2], width, work, memo)
    q = qw.reshape(N, H, g * T, D)
    scores = q @ read_cells(kc, ks, flat, work, dtype).transpose(2, 3)  # [N, H, g * T, W]
    if window_score_mod is not None:
        q_idx = torch.arange(g * T, device=q.device).view(1, 1, -1, 1)
        heads = torch.arange(H, device=q.device).view(1, H, 1, 1)
        scores = window_score_mod(scores, geo.batch_rows.view(N, 1, 1, 1), heads, q_idx,
                                  geo.cells[:, :W].reshape(N, 1, 1, W)).to(work)
    scores = torch.cat([scores + bias, scores_m.view(N, H, g * T, -1)], dim=-1)
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isneginf(top), 0.0, top)
    p = torch.exp(scores - top)
    total = p.sum(dim=-1, keepdim=True)
    out = p[..., :W] @ read_cells(vc, vs, flat, work, dtype) + p[..., W:] @ values_m
    out = out / total.clamp_min(torch.finfo(work).tiny)
    return out.view(N, H * g, T, -1).to(dtype), (torch.log(total) + top).view(N, H * g, T)


def _tail_entries(step: MemoryStep, bs: int, T: int) -> torch.Tensor:
    """`[N, 1, L]`: the tail's stream indices."""
    N = step.sink.shape[0]
    L = bs + T
    first = step.sink.view(N, 1) + step.whole.view(N, T)[:, :1] * bs
    return (first + torch.arange(L, device=first.device).view(1, L)).view(N, 1, L)


def _scored(score_mod, scores, jq, plan, config, step, N, H, g, T, Hq, positions, turned, work):
    """`score_mod` applied to the memory part's scores `[N, H, g, T, E]` at its positions (`memory_part`)."""
    dev = scores.device
    n = plan.n.long().view(N, 1, 1, 1, 1)
    p = n + torch.arange(T, device=dev).view(1, 1, 1, T, 1)
    kv_pos, q_pos = jq, p
    if positions == "cache":
        s = step.sink.view(N, 1, 1, 1, 1)
        w = window_starts(config, plan, T).view(N, 1, 1, T, 1)
        q_pos = torch.where(p < s, p, p - (w - s))  # entries before each query's window, past the sinks
        t_mem = w[:, :, :, :1] - 1
        kv_pos = q_pos - p + (t_mem if turned else jq)
    bidx = torch.arange(N, device=dev).view(N, 1, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, H, g, 1, 1)
    return score_mod(scores, bidx, h, q_pos, kv_pos).to(work)
