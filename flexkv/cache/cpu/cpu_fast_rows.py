"""The rows path's CPU fast paths, which `FastRowsPath` (`flexkv.cache.cpu.fast_rows_path`) runs.

`flexkv.cache.paths.row_attention.attend_rows` is the rows path as a reader
should see it: each row's cells read in place or gathered, dequantized if
quantized, then SDPA (or an explicit softmax). Everything here computes the
same thing faster on the CPU, each measured (`benchmarks/`):

- **host-built one-token geometry** (`geometry`): an eager decode step that
  reads in place lays its mask bias out on the host from the plan's cell
  intervals instead of some forty small device ops, and returns the last
  step's geometry again when the rows read the same cells; its memos (small
  constant tensors, the last geometry) belong to the cache
  (`LayerStore.memos`), never to the process;
- **eager slot pool views** (`slot_pool`), made once per layer buffer;
- **gathered rows a group at a time** in a buffer the cache allocates once
  (`flexkv.cache.cpu.gathered_rows`, custom op `flexkv::gathered_rows_attention`),
  so the pages of fresh full-step copies are not faulted in every call;
- **the gather of a compiled step as one opaque op** (`flexkv.cache.paths.row_cells.gather_kv`);
- **quantized cells widened a group of rows at a time** in a scratch
  buffer, as one op when compiled (`flexkv.cache.cpu.quantized_rows`, custom op
  `flexkv::quantized_rows_attention`), float8 widened through its bits
  (`flexkv.cache.storage.quantized.widen_into`), and a compiled quantized decode as
  sums of products inductor reads each cell once for (`quantized_rows.reduced_decode`);
- **no zero fill** where the kernel already gives zeros (`_zeros_empty_rows`),
  and no query gather where the geometry is known to be the identity.

`tests/test_cpu_fast_paths.py` checks both sides against the dense float64
reference, eagerly and compiled, and that with the switch off none of this runs.
"""

from __future__ import annotations

from array import array
from typing import Callable, Optional

import torch

from ..host.layout import Layout
from ..paths.row_attention import NEG_INF, RowGeometry, dense_attention, gather_width, mask_geometry, reads_in_place
from ..paths.row_cells import batch_cells, gather_kv
from ..storage.quantized import dequantize
from . import quantized_rows
from .gathered_rows import gather_scratch, gathered_attention

__all__ = ["attend", "geometry", "slot_pool", "dequantize_scratch", "gather_scratch", "one_token_in_place"]

#: The array type code of a bias laid out on the host, by dtype (others are laid out in float32 and cast:
#: 0 and -inf are exact in every float dtype).
_HOST_FLOAT = {torch.float32: "f", torch.float64: "d"}


def _cached(memos: dict, table: str, key, make):
    """A small constant tensor (never written to) made once per key in the cache's `memos`, shared by
    every geometry of that cache."""
    found = memos.setdefault(table, {})
    t = found.get(key)
    if t is None:
        t = found[key] = make()
    return t


def one_token_in_place(layout: Layout, plan, q_len: int, dtype: torch.dtype, memos: dict) -> RowGeometry:
    """`geometry` of a one-token step that reads in place, from the plan's host table.

    A row's one token attends exactly the cells of its intervals (`BoundedPlan.cell_intervals`,
    the union over its queries, and it has one), so the bias is laid out on the host (0 over each
    interval, -inf elsewhere) instead of evaluating `mask_mod` on every cell: one tensor made from a
    host buffer in place of some forty small device ops per step. When the step holds every slot
    row in order and each reads something (one stream decoding alone, or a full batch), the index
    and read tensors are shared constants and the geometry says so (`identity`, `all_read`), so
    that `attend_rows` skips the gathers and the zero fill. The tests check it equals the general
    construction. It depends on nothing but each row's slot row and cell intervals (and the
    layout, query length and dtype): the geometry of the last step with the same rows is returned
    again (its tensors are never written to). `memos`: the cache's (`LayerStore.memos`), which keep
    the last one-token geometry per `(layout, q_len, dtype)` and the shared constants.
    """
    N = plan.rows
    rows = tuple(None if plan.field("sink_base", i) < 0 else (plan.field("slot_row", i), tuple(plan.cell_intervals(i)))
                 for i in range(N))
    key = (layout, q_len, dtype)
    last_geometry = memos.setdefault("last_one_token", {})
    last = last_geometry.get(key)
    if last is not None and last[0] == rows:
        return last[1]
    geo = _build_one_token(layout, rows, q_len, dtype, memos)
    if len(last_geometry) >= 16:
        last_geometry.clear()
    last_geometry[key] = (rows, geo)
    return geo


def _build_one_token(layout: Layout, rows: tuple, q_len: int, dtype: torch.dtype, memos: dict) -> RowGeometry:
    """`one_token_in_place` from each plan row's `(slot row, cell intervals)` (None: a padding row)."""
    N = len(rows)
    Lr = layout.slot_row_len
    n_slot = layout.max_slots * layout.rows_per_request
    base = layout.slots_base
    code = _HOST_FLOAT.get(dtype, "f")
    bias = array(code, [NEG_INF]) * (n_slot * Lr)
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
    cells = _cached(memos, "slot_cells", (base, n_slot, Lr), lambda: base + torch.arange(n_slot * Lr).view(n_slot, Lr))
    bias = torch.frombuffer(bias, dtype=torch.float32 if code == "f" else torch.float64)
    if bias.dtype != dtype:
        bias = bias.to(dtype)
    bias = bias.view(n_slot, 1, 1, Lr).expand(n_slot, 1, q_len, Lr)
    back = [min(t, n_slot - 1) for t in to_batch]
    row_reads = [slot_reads[b] and ok for b, ok in zip(back, live)]
    identity = N == n_slot and to_batch == list(range(N))
    all_read = all(slot_reads) and all(row_reads)
    if identity:
        batch_rows = to_batch = back = _cached(memos, "arange", N, lambda: torch.arange(N))
    else:
        index = torch.tensor(batch_rows + to_batch + back)
        batch_rows, to_batch, back = index[:n_slot], index[n_slot:n_slot + N], index[n_slot + N:]
    if all_read:
        reads = _cached(memos, "all_read", n_slot, lambda: torch.ones(n_slot, 1, 1, dtype=torch.bool)).expand(n_slot, 1, q_len)
        row_reads = reads if N == n_slot else _cached(
            memos, "all_read", N, lambda: torch.ones(N, 1, 1, dtype=torch.bool)).expand(N, 1, q_len)
    else:
        flags = torch.tensor(slot_reads + row_reads)
        reads = flags[:n_slot].view(n_slot, 1, 1).expand(n_slot, 1, q_len)
        row_reads = flags[n_slot:].view(N, 1, 1).expand(N, 1, q_len)
    return RowGeometry(True, q_len, batch_rows, cells, bias, reads, row_reads, to_batch, back, identity, all_read)


def geometry(layout: Layout, plan, mask_mod: Callable, q_len: int, dtype: torch.dtype,
             width: Optional[int] = None, memos: Optional[dict] = None) -> RowGeometry:
    """`row_attention.mask_geometry` (arguments alike), built from the host table for an eager
    one-token step that reads in place (`one_token_in_place`, memos in `memos`: the cache's
    `LayerStore.memos`; None: none kept)."""
    if (plan.tokens == 1 and not torch.compiler.is_compiling() and hasattr(plan, "cell_intervals")
            and plan.table.device.type == "cpu" and reads_in_place(layout, plan.rows)):
        return one_token_in_place(layout, plan, q_len, dtype, {} if memos is None else memos)  # eager: reads the host table
    return mask_geometry(layout, plan, mask_mod, q_len, dtype, width)


def slot_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Layout) -> tuple:
    """A layer's slot pool as the in-place batch: keys `[slot rows, H, slot_row_len, D]` and values
    (`[.., Dv]`), views of the layer tensors `[1, H, S, D]`."""
    n_slot = layout.max_slots * layout.rows_per_request
    return tuple(batch_cells(x, 0, n_slot, None, layout.slots_base, layout.slot_row_len)
                 for x in (k_cache, v_cache))


def dequantize_scratch(config, layout: Layout, device) -> torch.Tensor:
    """The float32 buffer the rows path dequantizes groups of batch rows into (quantized slots):
    `quantized_rows.DEQUANTIZE_GROUP_BYTES` of keys and values, or one batch row of the widest kind
    if that is more, with room for the staging float8 cells pass through
    (`quantized_rows.scratch_width`); never more than every batch row a step can hold
    (`max_slots * rows_per_request`), so a small cache gets a small buffer."""
    width = max(layout.slot_row_len, gather_width(config))
    cell = quantized_rows.scratch_width(config.head_dim, config.value_head_dim, config.slot_dtype)
    row = config.num_heads * width * cell
    group = quantized_rows.DEQUANTIZE_GROUP_BYTES // 4 * cell // (config.head_dim + config.value_head_dim)
    every_row = config.max_slots * config.rows_per_request * row
    return torch.empty(max(min(group, every_row), row), dtype=torch.float32, device=device)


def _dense_dequantized(q, k_cache, v_cache, scales, cells, base, row_len, geo: RowGeometry, score_mod, want_lse,
                       additive, scratch):
    """`row_attention.dense_attention` over quantized cells, batch rows as in `row_cells.batch_cells`. With `scratch`
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
            batch_rows=geo.batch_rows[b0:b1], cells=geo.cells[b0:b1], bias=geo.bias[b0:b1], reads=geo.reads[b0:b1],
            kv_stream=None if geo.kv_stream is None else geo.kv_stream[b0:b1])
        out, lse = dense_attention(q[b0:b1], kv[0], kv[1], part, score_mod, want_lse, additive)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), (torch.cat(lses) if want_lse else None)


def _zeros_empty_rows(geo: RowGeometry, scales, device) -> bool:
    """Whether `row_attention.dense_attention` (or `gathered_rows.gathered_attention`) already gives zeros for the queries
    that read nothing, so `attend` needs no zero fill (one kernel less per layer of a compiled
    step): gathered rows of unquantized cells on the CPU (not rows read in place, where a padding
    row reads another slot row's output back). There the fused kernel returns zeros for a query
    whose every score is masked (`tests/test_compiled.py` checks that on every torch release CI
    runs), and the explicit softmax divides zero weights by its floor."""
    return not geo.in_place and scales is None and device.type == "cpu"


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout,
    plan,
    mask_mod: Callable,
    score_mod: Optional[Callable] = None,
    width: Optional[int] = None,
    return_lse: bool = False,
    geo: Optional[RowGeometry] = None,
    additive: bool = False,
    scales: Optional[tuple] = None,
    scratch: Optional[torch.Tensor] = None,
    pool: Optional[tuple] = None,
):
    """`row_attention.attend_rows` (arguments alike; `geo` its `geometry`) through the fast paths:
    attention of `q` (`[N, H, Q, D]`, already scaled; `Q` may hold a folded GQA group) over the
    cells each row may read, with the mask and score modifications of the FlexAttention path.
    Returns `[N, H, Q, Dv]`, `Dv` the value width of `v_cache`.

    `width`: cells per gathered row (`gather_width(config)`); needed unless the step reads in
    place. `geo`: `geometry(layout, plan, mask_mod, Q, q.dtype, width)` built once for
    several calls on the same plan (else built here). Queries that read nothing (padding rows)
    return zeros, as in FlexAttention. Returns `[N, H, Q, Dv]` (`Dv` the values' head size); with
    `return_lse`, `(out, lse)`: each query's natural-log sum of exp of its scores (`[N, H, Q]`,
    float32; -inf where it reads nothing), as FlexAttention's log-sum-exp. `additive`: `score_mod`
    only adds a term to each score (`RelativePositionScores`); see `row_attention.dense_attention`.
    `scales`: `(k_scale, v_scale)`, `[1, H, S, 1]` each, for quantized cells
    (`flexkv.cache.storage.quantized`): the cells a row reads are dequantized as they are read, into `q`'s dtype;
    `scratch` (`dequantize_scratch`) holds them a group of rows at a time. Unquantized, `scratch`
    (`gathered_rows.gather_scratch`) holds gathered rows a group at a time, for steps without a
    `score_mod` or log-sum-exp (`gathered_rows.gathered_attention`).
    `pool`: `slot_pool(k_cache, v_cache, layout)` made once by a caller attending in place eagerly.
    """
    N, H, Q, D = q.shape
    geo = geo if geo is not None else geometry(layout, plan, mask_mod, Q, q.dtype, width)
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
            out, lse = dense_attention(q_b, *pool, geo, score_mod, return_lse, additive)
        else:
            if cells is not None and torch.compiler.is_compiling():
                keys, values = gather_kv(k_cache, v_cache, cells)  # one opaque op, not two gather kernels
            else:
                keys, values = (batch_cells(x, 0, B, cells, base, row_len) for x in (k_cache, v_cache))
            out, lse = dense_attention(q_b, keys, values, geo, score_mod, return_lse, additive)
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
        return out, torch.where(reads, lse, NEG_INF)
    return out
