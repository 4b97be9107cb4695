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
which queries read anything) is `RowGeometry`, built by `row_geometry`: a
caller attending several layers of one plan eagerly builds it once and
passes it to every layer (`BoundedKVManager.attend` does).

Shapes depend only on the config and the step's `N` and `T`, so a compiled
step does not recompile as streams move.
"""

from __future__ import annotations

from array import array
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import quantized_rows
from .gathered_rows import gathered_attention
from .layout import Layout
from .planner import INTERVALS
from .quantized import dequantize
from .row_cells import batch_cells, gather_kv

__all__ = ["attend_rows", "reads_in_place", "gather_width", "row_geometry", "repeat_queries", "device_geometry",
           "RowGeometry", "dequantize_scratch", "slot_pool"]

_NEG_INF = float("-inf")


def reads_in_place(layout: Layout, rows: int) -> bool:
    """Whether a step of `rows` rows attends the slot pool in place (else it gathers)."""
    has_sources = bool(layout.source_row_len and layout.max_sources)
    return not has_sources and layout.max_slots * layout.rows_per_request <= 2 * rows


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


def device_geometry(geo: RowGeometry) -> RowGeometry:
    """`geo` without what is known of one plan on the host (`identity`, `all_read` left False): what a
    compiled step may read of a geometry that comes with each plan, since a flag it read would be
    a guard, and a plan that flips it a recompile."""
    return RowGeometry(geo.in_place, geo.q_len, geo.batch_rows, geo.cells, geo.bias, geo.reads, geo.row_reads,
                       geo.to_batch, geo.back)


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


_SLOT_CELLS: dict = {}
_ARANGE: dict = {}
_ALL_READ: dict = {}
#: The array type code of a bias laid out on the host, by dtype (others are laid out in float32 and cast:
#: 0 and -inf are exact in every float dtype).
_HOST_FLOAT = {torch.float32: "f", torch.float64: "d"}


def _cached(table: dict, key, make):
    """A small constant tensor (never written to) made once per key and shared by every geometry."""
    t = table.get(key)
    if t is None:
        t = table[key] = make()
    return t


#: The last one-token geometry built per `(layout, q_len, dtype)`, with the rows it was built from: a
#: stream past its sink and window reads the same cells step after step, and so gets the same geometry.
_LAST_ONE_TOKEN: dict = {}


def _one_token_in_place(layout: Layout, plan, q_len: int, dtype: torch.dtype) -> RowGeometry:
    """`row_geometry` of a one-token step that reads in place, from the plan's host table.

    A row's one token attends exactly the cells of its intervals (`BoundedPlan.cell_intervals`,
    the union over its queries, and it has one), so the bias is laid out on the host (0 over each
    interval, -inf elsewhere) instead of evaluating `mask_mod` on every cell: one tensor made from a
    host buffer in place of some forty small device ops per step. When the step holds every slot
    row in order and each reads something (one stream decoding alone, or a full batch), the index
    and read tensors are shared constants and the geometry says so (`identity`, `all_read`), so
    that `attend_rows` skips the gathers and the zero fill. The tests check it equals the general
    construction. It depends on nothing but each row's slot row and cell intervals (and the
    layout, query length and dtype): the geometry of the last step with the same rows is returned
    again (its tensors are never written to).
    """
    N = plan.rows
    rows = tuple(None if plan.field("sink_base", i) < 0 else (plan.field("slot_row", i), tuple(plan.cell_intervals(i)))
                 for i in range(N))
    key = (layout, q_len, dtype)
    last = _LAST_ONE_TOKEN.get(key)
    if last is not None and last[0] == rows:
        return last[1]
    geo = _build_one_token(layout, rows, q_len, dtype)
    if len(_LAST_ONE_TOKEN) >= 16:
        _LAST_ONE_TOKEN.clear()
    _LAST_ONE_TOKEN[key] = (rows, geo)
    return geo


def _build_one_token(layout: Layout, rows: tuple, q_len: int, dtype: torch.dtype) -> RowGeometry:
    """`_one_token_in_place` from each plan row's `(slot row, cell intervals)` (None: a padding row)."""
    N = len(rows)
    Lr = layout.slot_row_len
    n_slot = layout.max_slots * layout.rows_per_request
    base = layout.slots_base
    code = _HOST_FLOAT.get(dtype, "f")
    bias = array(code, [_NEG_INF]) * (n_slot * Lr)
    batch_rows = [0] * n_slot
    to_batch, live = [], []
    slot_reads = [False] * n_slot
    for i, row in enumerate(rows):
        if row is None:  # a padding row: reads nothing
            to_batch.append(n_slot)
            live.append(False)
            continue
        s, intervals = row
        to_batch.append(s)
        live.append(True)
        batch_rows[s] = i
        lo_s = base + s * Lr
        for lo, hi in intervals:
            a, b = max(lo, lo_s) - lo_s, min(hi, lo_s + Lr) - lo_s
            if a < b:
                bias[s * Lr + a:s * Lr + b] = array(code, bytes(bias.itemsize * (b - a)))
                slot_reads[s] = True
    cells = _cached(_SLOT_CELLS, (base, n_slot, Lr), lambda: base + torch.arange(n_slot * Lr).view(n_slot, Lr))
    bias = torch.frombuffer(bias, dtype=torch.float32 if code == "f" else torch.float64)
    if bias.dtype != dtype:
        bias = bias.to(dtype)
    bias = bias.view(n_slot, 1, 1, Lr).expand(n_slot, 1, q_len, Lr)
    back = [min(t, n_slot - 1) for t in to_batch]
    row_reads = [slot_reads[b] and ok for b, ok in zip(back, live)]
    identity = N == n_slot and to_batch == list(range(N))
    all_read = all(slot_reads) and all(row_reads)
    if identity:
        batch_rows = to_batch = back = _cached(_ARANGE, N, lambda: torch.arange(N))
    else:
        index = torch.tensor(batch_rows + to_batch + back)
        batch_rows, to_batch, back = index[:n_slot], index[n_slot:n_slot + N], index[n_slot + N:]
    if all_read:
        reads = _cached(_ALL_READ, n_slot, lambda: torch.ones(n_slot, 1, 1, dtype=torch.bool)).expand(n_slot, 1, q_len)
        row_reads = reads if N == n_slot else _cached(
            _ALL_READ, N, lambda: torch.ones(N, 1, 1, dtype=torch.bool)).expand(N, 1, q_len)
    else:
        flags = torch.tensor(slot_reads + row_reads)
        reads = flags[:n_slot].view(n_slot, 1, 1).expand(n_slot, 1, q_len)
        row_reads = flags[n_slot:].view(N, 1, 1).expand(N, 1, q_len)
    return RowGeometry(True, q_len, batch_rows, cells, bias, reads, row_reads, to_batch, back, identity, all_read)


def row_geometry(layout: Layout, plan, mask_mod: Callable, q_len: int, dtype: torch.dtype,
                 width: Optional[int] = None) -> RowGeometry:
    """The rows path's view of `plan` for queries of length `q_len` (a folded GQA group counts).

    `mask_mod` is the FlexAttention mask of the step (`flexkv.cache.masks.make_mask_mod`), `dtype` the
    queries' dtype (the bias is formed in it), `width` the cells per gathered row
    (`gather_width(config)`; needed unless the step reads in place).
    """
    if (plan.tokens == 1 and not torch.compiler.is_compiling() and hasattr(plan, "cell_intervals")
            and plan.table.device.type == "cpu" and reads_in_place(layout, plan.rows)):
        return _one_token_in_place(layout, plan, q_len, dtype)  # eager: reads the host table
    return mask_geometry(layout, plan, mask_mod, q_len, dtype, width)


def mask_geometry(layout: Layout, plan, mask_mod: Callable, q_len: int, dtype: torch.dtype,
                  width: Optional[int] = None) -> RowGeometry:
    """`row_geometry` built by evaluating `mask_mod` on every cell a row may read (any step, any device)."""
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
            raise ValueError("row_geometry: width (gather_width(config)) is needed when the step gathers")
        cells, used = _interval_cells(plan, width, dev)
        batch_rows = torch.arange(N, device=dev)
        allowed = mask_mod(batch_rows.view(-1, 1, 1, 1), zero, q_idx, cells.view(N, 1, 1, width))
        allowed = allowed & used.view(N, 1, 1, width)
        in_place = False
    bias = torch.where(allowed, torch.zeros((), dtype=dtype, device=dev),
                       torch.full((), _NEG_INF, dtype=dtype, device=dev))
    reads = bias.amax(dim=-1) == 0
    if in_place:
        back = to_batch.clamp(max=n_slot - 1)
        row_reads = reads.index_select(0, back) & live.view(N, 1, 1)
    else:
        to_batch = back = None
        row_reads = reads
    return RowGeometry(in_place, q_len, batch_rows, cells, bias, reads, row_reads, to_batch, back)


def slot_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Layout) -> tuple:
    """A layer's slot pool as the in-place batch: keys `[slot rows, H, slot_row_len, D]` and values
    (`[.., Dv]`), views of the layer tensors `[1, H, S, D]`."""
    n_slot = layout.max_slots * layout.rows_per_request
    return tuple(batch_cells(x, 0, n_slot, None, layout.slots_base, layout.slot_row_len)
                 for x in (k_cache, v_cache))


def _dense(q, keys, values, geo: RowGeometry, score_mod, want_lse, additive=False):
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
        scores = score_mod(scores, geo.batch_rows.view(B, 1, 1, 1), heads, q_idx, geo.cells.view(B, 1, 1, -1))
    scores = scores + geo.bias.to(work)
    top = torch.where(geo.reads.unsqueeze(-1), scores.amax(dim=-1, keepdim=True), 0.0)
    probs = torch.exp(scores - top)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, values.to(work)) / total.clamp_min(1e-30)
    lse = (torch.log(total) + top).squeeze(-1) if want_lse else None
    return out.to(q.dtype), lse


def dequantize_scratch(config, layout: Layout, device) -> torch.Tensor:
    """The float32 buffer the rows path dequantizes groups of batch rows into (quantized slots):
    `quantized_rows.DEQUANTIZE_GROUP_BYTES` of keys and values, or one batch row of the widest kind
    if that is more, with room for the staging float8 cells pass through
    (`quantized_rows.scratch_width`)."""
    width = max(layout.slot_row_len, gather_width(config))
    cell = quantized_rows.scratch_width(config.head_dim, config.value_head_dim, config.slot_dtype)
    row = config.num_heads * width * cell
    group = quantized_rows.DEQUANTIZE_GROUP_BYTES // 4 * cell // (config.head_dim + config.value_head_dim)
    return torch.empty(max(group, row), dtype=torch.float32, device=device)


def _dense_dequantized(q, k_cache, v_cache, scales, cells, base, row_len, geo: RowGeometry, score_mod, want_lse,
                       additive, scratch):
    """`_dense` over quantized cells, batch rows as in `row_cells.batch_cells`. With `scratch`
    (`dequantize_scratch`), groups of rows that fit in it are dequantized there and attended one
    after the other: a step without `score_mod` or log-sum-exp as one op
    (`quantized_rows.grouped_attention`, opaque to a compiled graph), others eagerly here; without
    (or compiled with either), all rows at once into fresh tensors. A compiled decode step without
    either on the CPU reads the cells inside inductor's kernels (`quantized_rows.reduced_decode`)."""
    B, H = q.shape[:2]
    W = geo.bias.shape[-1]
    D, Dv = k_cache.shape[-1], v_cache.shape[-1]
    if score_mod is None and not want_lse and quantized_rows.reduces_decode(q, k_cache.dtype):
        return quantized_rows.reduced_decode(q, k_cache, v_cache, scales[0], scales[1], geo.bias, cells, base,
                                             row_len), None
    if scratch is not None and score_mod is None and not want_lse:
        return quantized_rows.grouped_attention(q, k_cache, v_cache, scales[0], scales[1], geo.bias, cells, base,
                                                row_len, scratch), None
    if torch.compiler.is_compiling():
        scratch = None  # inductor plans the buffers of the traced path
    step = B if scratch is None else quantized_rows.group_rows(scratch, B, H, W,
                                                               quantized_rows.scratch_width(D, Dv, k_cache.dtype))
    outs, lses = [], []
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        kv = []
        for x, sc, off in ((k_cache, scales[0], 0), (v_cache, scales[1], (b1 - b0) * H * W * D)):
            c, s = (batch_cells(t, b0, b1, cells, base, row_len) for t in (x, sc))
            out = dequantize(c, s, q.dtype) if scratch is None else quantized_rows.dequantized_group(
                scratch, off, c, s, (b1 - b0) * H * W * (D + Dv))
            kv.append(out if out.dtype == q.dtype else out.to(q.dtype))
        part = geo if (b0, b1) == (0, B) else geo._replace(
            batch_rows=geo.batch_rows[b0:b1], cells=geo.cells[b0:b1], bias=geo.bias[b0:b1], reads=geo.reads[b0:b1])
        out, lse = _dense(q[b0:b1], kv[0], kv[1], part, score_mod, want_lse, additive)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), (torch.cat(lses) if want_lse else None)


def _zeros_empty_rows(geo: RowGeometry, scales, device) -> bool:
    """Whether `_dense` (or `gathered_rows.gathered_attention`) already gives zeros for the queries
    that read nothing, so `attend_rows` needs no zero fill (one kernel less per layer of a compiled
    step): gathered rows of unquantized cells on the CPU (not rows read in place, where a padding
    row reads another slot row's output back). There the fused kernel returns zeros for a query
    whose every score is masked (`tests/test_compiled.py` checks that on every torch release CI
    runs), and the explicit softmax divides zero weights by its floor."""
    return not geo.in_place and scales is None and device.type == "cpu"


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
    scratch: Optional[torch.Tensor] = None,
    pool: Optional[tuple] = None,
):
    """Attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over the
    cells each row may read, with the mask and score modifications of the FlexAttention path.
    Returns `[N, H, Q, Dv]`, `Dv` the value width of `v_cache`.

    `width`: cells per gathered row (`gather_width(config)`); needed unless the step reads in
    place. `geometry`: `row_geometry(layout, plan, mask_mod, Q, q.dtype, width)` built once for
    several calls on the same plan (else built here). Queries that read nothing (padding rows)
    return zeros, as in FlexAttention. Returns `[N, H, Q, Dv]` (`Dv` the values' head size); with
    `return_lse`, `(out, lse)`: each query's natural-log sum of exp of its scores (`[N, H, Q]`,
    float32; -inf where it reads nothing), as FlexAttention's log-sum-exp. `additive`: `score_mod`
    only adds a term to each score (`RelativePositionScores`); see `_dense`.
    `scales`: `(k_scale, v_scale)`, `[1, H, S, 1]` each, for quantized cells
    (`flexkv.cache.quantized`): the cells a row reads are dequantized as they are read, into `q`'s dtype;
    `scratch` (`dequantize_scratch`) holds them a group of rows at a time. Unquantized, `scratch`
    (`gathered_rows.gather_scratch`) holds gathered rows a group at a time, for steps without a
    `score_mod` or log-sum-exp (`gathered_rows.gathered_attention`).
    `pool`: `slot_pool(k_cache, v_cache, layout)` made once by a caller attending in place eagerly.
    """
    N, H, Q, D = q.shape
    geo = geometry if geometry is not None else row_geometry(layout, plan, mask_mod, Q, q.dtype, width)
    if geo.in_place:
        # Each slot row takes its plan row's queries (rows the step leaves out take row 0's, and
        # read nothing): one gather (none when the slot rows are the plan's rows in order).
        q_b = q if geo.identity else q.index_select(0, geo.batch_rows)
        cells, base, row_len = None, layout.slots_base, layout.slot_row_len
        B = layout.max_slots * layout.rows_per_request
    else:
        q_b, cells, base, row_len, B = q, geo.cells, 0, 0, N
    if scales is None:
        if cells is not None and scratch is not None and score_mod is None and not return_lse and not (
                q.requires_grad and torch.is_grad_enabled()):
            # Gathered rows, a group at a time in the cache's buffer (one opaque op when compiled; it
            # has no backward, so a query that wants a gradient gathers the step as before).
            out, lse = gathered_attention(q_b, k_cache, v_cache, geo.bias, cells, scratch), None
        elif pool is not None and geo.in_place:
            out, lse = _dense(q_b, *pool, geo, score_mod, return_lse, additive)
        else:
            if cells is not None and torch.compiler.is_compiling():
                keys, values = gather_kv(k_cache, v_cache, cells)  # one opaque op, not two gather kernels
            else:
                keys, values = (batch_cells(x, 0, B, cells, base, row_len) for x in (k_cache, v_cache))
            out, lse = _dense(q_b, keys, values, geo, score_mod, return_lse, additive)
    else:
        out, lse = _dense_dequantized(q_b, k_cache, v_cache, scales, cells, base, row_len, geo, score_mod, return_lse,
                                      additive, scratch)
    if geo.in_place and not geo.identity:
        out = out.index_select(0, geo.back)
        lse = lse.index_select(0, geo.back) if lse is not None else None
    reads = geo.row_reads
    if not (geo.all_read or _zeros_empty_rows(geo, scales, q.device)):
        out = torch.where(reads.unsqueeze(-1), out, 0.0)
    if return_lse:
        return out, torch.where(reads, lse, _NEG_INF)
    return out
