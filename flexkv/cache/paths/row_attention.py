"""Attention over each row's own cells with dense kernels: the rows path.

A row of a step reads at most `max_retained + max_step_tokens` cells, and
the plan already names them: at most a few cell intervals per row
(`cell_lo{k}`, `cell_hi{k}`). This path brings those cells side by side and
runs dense attention over them, in one of two ways:

- **in place** (no sources, and the step uses at least half of the pool's
  slot rows): every cell a row reads lies in its slot row (sink region plus
  ring; the step's own tokens were just written into the ring), so the
  layer tensor's slot pool, viewed as `[slot rows, H, slot_row_len, D]`, is
  already a dense batch. The step's queries are gathered into slot order
  instead, the keys and values never move, and slot rows the step does not
  use attend nothing and are dropped;
- **gathered** (otherwise): the cells of each row's intervals are copied, in
  order, into a `[N, H, W, D]` block with `W = max_retained +
  max_step_tokens`; positions past a row's count are masked.

In both, the same `mask_mod` and `score_mod` that FlexAttention would run
decide, on the real cell indices, which cells a query reads and how it
scores them, so the result is exactly FlexAttention's over the whole layer
tensor. The mask is formed once per call as an additive bias (0 where a
query reads a cell, -inf elsewhere) in the query's dtype, which is what
SDPA adds to the scores; inductor writes a float bias several times faster
than a bool mask on the CPU. Without a `score_mod` the batch runs through
`scaled_dot_product_attention`'s fused kernel; with one, the scores are
formed, modified and normalised explicitly (in float32, or float64 for
float64 inputs).

What depends on the plan alone (which cells each batch row holds, the bias,
which queries read anything) is `RowGeometry`, built by `mask_geometry`: a
caller attending several layers of one plan eagerly builds it once and
passes it to every layer (`BoundedKVManager.attend` does).

`attend_rows` here is the plain reference: the cells read in place or
gathered, dequantized if quantized, then SDPA or an explicit softmax. The
CPU speed work over it (custom ops, group buffers, host-built one-token
geometry and its memos) is `flexkv.cache.cpu.cpu_fast_rows`, which the rows
path enters unless `AttentionOptions.cpu_fast_paths` is off; both compute
what the same queries attend.

Shapes depend only on the config and the step's `N` and `T`, so a compiled
step does not recompile as streams move.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..host.layout import Layout
from ..host.planner import INTERVALS
from ..positions.masks import stream_index
from ..storage.quantized import SCALE_DTYPE
from .row_cells import batch_cells

__all__ = ["attend_rows", "reads_in_place", "gather_width", "interval_cells", "mask_geometry", "repeat_queries",
           "device_geometry", "RowGeometry", "dense_attention", "NEG_INF"]

NEG_INF = float("-inf")


def reads_in_place(layout: Layout, rows: int) -> bool:
    """Whether a step of `rows` rows attends the slot pool in place (else it gathers). Never for a
    ring that holds a `Recall` memory: the window would be read beside every memory cell."""
    has_sources = bool(layout.source_row_len and layout.max_sources)
    return not has_sources and not layout.memory_len and layout.max_slots * layout.rows_per_request <= 2 * rows


def gather_width(config) -> int:
    """Cells a gathered row holds: the most any row of `config` reads in one step."""
    return config.max_retained + config.max_step_tokens


class RowGeometry(NamedTuple):
    """What the rows path derives from a plan alone, for queries of length `q_len`.

    `B` batch rows (the slot rows in place, the plan's rows gathered), each
    holding `W` key positions.
    """

    in_place: bool
    q_len: int
    #: `[B]`: the plan row each batch row attends for (in place: slot rows the step leaves out get
    #: row 0, whose cells they never hold, so they read nothing).
    batch_rows: torch.Tensor
    #: `[B, W]`: the layer-tensor cell each key position holds.
    cells: torch.Tensor
    #: `[B, 1, Q, W]`: 0 where the query reads the cell, -inf elsewhere (the query's dtype).
    bias: torch.Tensor
    #: `[B, 1, Q]`: whether the query reads any cell.
    reads: torch.Tensor
    #: `[N, 1, Q]`: the same for the plan's rows (padding rows read nothing).
    row_reads: torch.Tensor
    #: In place: `[N]`, the batch row of each plan row (padding rows: the extra row `B`).
    to_batch: Optional[torch.Tensor]
    #: In place: `[N]`, the batch row each plan row's output is read back from.
    back: Optional[torch.Tensor]
    #: Known on the host: the batch rows are the plan's rows in order (`batch_rows`, `to_batch` and
    #: `back` are `arange(N)`), so the queries and outputs need no gather. False: not known.
    identity: bool = False
    #: Known on the host: every query reads some cell (`reads` and `row_reads` all True), so no
    #: output needs zeroing. False: not known.
    all_read: bool = False
    #: `[B, W]`: the stream index of the entry each key position holds (`with_stream_index`), read by a
    #: `score_mod` instead of forming it from the cells in every layer; None: not made.
    kv_stream: Optional[torch.Tensor] = None


def device_geometry(geo: RowGeometry) -> RowGeometry:
    """`geo` without what is known of one plan on the host (`identity`, `all_read` left False): what a
    compiled step may read of a geometry that comes with each plan, since a flag it read would be
    a guard, and a plan that flips it a recompile."""
    return RowGeometry(geo.in_place, geo.q_len, geo.batch_rows, geo.cells, geo.bias, geo.reads, geo.row_reads,
                       geo.to_batch, geo.back, kv_stream=geo.kv_stream)


def with_stream_index(geo: RowGeometry, layout: Layout, plan) -> RowGeometry:
    """`geo` with each key position's stream index (`kv_stream`), made once for every layer of the step."""
    _, j = stream_index(plan, layout.ring_len, plan.tokens, geo.batch_rows.view(-1, 1), geo.cells)
    return geo._replace(kv_stream=j)


def repeat_queries(geo: RowGeometry, group: int) -> RowGeometry:
    """`geo` for a GQA group of `group` folded into the query axis (packed query `i * Q + t` reads
    as query `t`): its mask and reads repeated `group` times along the queries."""
    if group == 1:
        return geo

    def tiled(t: torch.Tensor, dim: int) -> torch.Tensor:  # a mask alike for every query stays broadcast
        if t.shape[dim] == 1:
            return t
        reps = [1] * t.dim()
        reps[dim] = group
        return t.repeat(*reps)

    return geo._replace(q_len=geo.q_len * group, bias=tiled(geo.bias, 2), reads=tiled(geo.reads, 2),
                        row_reads=tiled(geo.row_reads, 2))


def interval_cells(plan, width: int, device) -> tuple:
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


def mask_geometry(layout: Layout, plan, mask_mod: Callable, q_len: int, dtype: torch.dtype,
                  width: Optional[int] = None) -> RowGeometry:
    """The rows path's view of `plan` for queries of length `q_len` (a folded GQA group counts), built by
    evaluating `mask_mod` on every cell a row may read (any step, any device).

    `mask_mod` is the FlexAttention mask of the step (`flexkv.cache.positions.masks.make_mask_mod`), `dtype` the
    queries' dtype (the bias is formed in it), `width` the cells per gathered row
    (`gather_width(config)`; needed unless the step reads in place).
    """
    N = plan.rows
    dev = plan.write_index.device
    zero = torch.zeros((), dtype=torch.long, device=dev)
    q_idx = torch.arange(q_len, device=dev).view(1, 1, q_len, 1)
    if reads_in_place(layout, N):
        Lr = layout.slot_row_len
        n_slot = layout.max_slots * layout.rows_per_request
        live = plan.sink_base >= 0
        # Queries go to their slot rows; padding rows go to one extra row that is dropped.
        to_batch = torch.where(live, plan.slot_row.long(), n_slot)
        batch_rows = torch.zeros(n_slot + 1, dtype=torch.long, device=dev).index_put(
            (to_batch,), torch.arange(N, device=dev))[:n_slot]
        cells = layout.slots_base + torch.arange(n_slot, device=dev).view(-1, 1) * Lr + torch.arange(Lr, device=dev)
        allowed = mask_mod(batch_rows.view(-1, 1, 1, 1), zero, q_idx, cells.view(n_slot, 1, 1, Lr))
        in_place = True
    else:
        if width is None:
            raise ValueError("mask_geometry: width (gather_width(config)) is needed when the step gathers")
        cells, used = interval_cells(plan, width, dev)
        batch_rows = torch.arange(N, device=dev)
        allowed = mask_mod(batch_rows.view(-1, 1, 1, 1), zero, q_idx, cells.view(N, 1, 1, width))
        allowed = allowed & used.view(N, 1, 1, width)
        in_place = False
    bias = torch.where(allowed, torch.zeros((), dtype=dtype, device=dev),
                       torch.full((), NEG_INF, dtype=dtype, device=dev))
    reads = bias.amax(dim=-1) == 0
    if in_place:
        back = to_batch.clamp(max=n_slot - 1)
        row_reads = reads.index_select(0, back) & live.view(N, 1, 1)
    else:
        to_batch = back = None
        row_reads = reads
    return RowGeometry(in_place, q_len, batch_rows, cells, bias, reads, row_reads, to_batch, back)


def dense_attention(q, keys, values, geo: RowGeometry, score_mod, want_lse, additive=False):
    """Attention of q `[B, H, Q, D]` over keys `[B, H, W, D]` and values `[B, H, W, Dv]` with the
    geometry's bias. Returns the output and, with `want_lse`, each query's natural-log sum of exp
    of its scores (`[B, H, Q]`, at least float32; else None). `additive`: `score_mod` only adds a
    term to the score; in float32 or float64 it is then evaluated once on zero scores and added
    to the mask, and the fused kernel runs."""
    B, H, Q, _ = q.shape
    dev = q.device
    if score_mod is not None and additive and not want_lse and q.dtype in (torch.float32, torch.float64):
        q_idx = torch.arange(Q, device=dev).view(1, 1, Q, 1)
        heads = torch.arange(H, device=dev).view(1, H, 1, 1)
        term = score_mod(torch.zeros((), dtype=q.dtype, device=dev), geo.batch_rows.view(B, 1, 1, 1), heads, q_idx,
                         geo.cells.view(B, 1, 1, -1))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=geo.bias + term.to(q.dtype), scale=1.0), None
    if score_mod is None and not want_lse:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=geo.bias, scale=1.0), None
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(work), keys.to(work).transpose(-1, -2))
    if score_mod is not None:
        q_idx = torch.arange(Q, device=dev).view(1, 1, Q, 1)
        heads = torch.arange(H, device=dev).view(1, H, 1, 1)
        b = geo.batch_rows.view(B, 1, 1, 1)
        at_stream = getattr(score_mod, "at_stream_index", None)
        if geo.kv_stream is not None and at_stream is not None:
            scores = at_stream(scores, b, heads, q_idx, geo.kv_stream.view(B, 1, 1, -1))
        else:
            scores = score_mod(scores, b, heads, q_idx, geo.cells.view(B, 1, 1, -1))
    scores = scores + geo.bias.to(work)
    top = torch.where(geo.reads.unsqueeze(-1), scores.amax(dim=-1, keepdim=True), 0.0)
    probs = torch.exp(scores - top)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, values.to(work)) / total.clamp_min(1e-30)
    lse = (torch.log(total) + top).squeeze(-1) if want_lse else None
    return out.to(q.dtype), lse


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
    geometry: Optional[RowGeometry] = None,
    additive: bool = False,
    scales: Optional[tuple] = None,
):
    """Attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over the
    cells each row may read, with the mask and score modifications of the FlexAttention path: the
    plain reference of the rows path (`flexkv.cache.cpu.cpu_fast_rows.attend` computes the same faster).

    `width`: cells per gathered row (`gather_width(config)`); needed unless the step reads in place.
    `geometry`: `mask_geometry(layout, plan, mask_mod, Q, q.dtype, width)` built once for several
    calls on the same plan (else built here). Queries that read nothing (padding rows) return zeros,
    as in FlexAttention. Returns `[N, H, Q, Dv]` (`Dv` the values' head size); with `return_lse`,
    `(out, lse)`: each query's natural-log sum of exp of its scores (`[N, H, Q]`, at least float32;
    -inf where it reads nothing). `additive`: `score_mod` only adds a term to each score
    (`dense_attention`). `scales`: `(k_scale, v_scale)`, `[1, H, S, 1]` each, for quantized cells
    (`flexkv.cache.storage.quantized`): the cells read are dequantized (`cells * scale` in float32) into
    `q`'s dtype.
    """
    N, H, Q, D = q.shape
    geo = geometry if geometry is not None else mask_geometry(layout, plan, mask_mod, Q, q.dtype, width)
    if geo.in_place:
        # Each slot row takes its plan row's queries; its keys and values are the slot row itself.
        q_b = q.index_select(0, geo.batch_rows)
        cells, base, row_len, B = None, layout.slots_base, layout.slot_row_len, layout.max_slots * layout.rows_per_request
    else:
        q_b, cells, base, row_len, B = q, geo.cells, 0, 0, N
    keys, values = (batch_cells(x, 0, B, cells, base, row_len) for x in (k_cache, v_cache))
    if scales is not None:
        k_scale, v_scale = (batch_cells(s, 0, B, cells, base, row_len) for s in scales)
        keys = (keys.to(SCALE_DTYPE) * k_scale).to(q.dtype)
        values = (values.to(SCALE_DTYPE) * v_scale).to(q.dtype)
    out, lse = dense_attention(q_b, keys, values, geo, score_mod, return_lse, additive)
    if geo.in_place:
        # Back to plan rows (a padding row reads the last slot row's output, zeroed below).
        out = out.index_select(0, geo.back)
        lse = lse.index_select(0, geo.back) if lse is not None else None
    reads = geo.row_reads
    out = torch.where(reads.unsqueeze(-1), out, 0.0)
    if return_lse:
        return out, torch.where(reads, lse, NEG_INF)
    return out
