"""The rows path over quantized cells inside a compiled graph: one opaque op.

Traced by inductor, the rows path's dequantize of a decode step (every cell
of the layer's slot pool) becomes fresh full-size buffers in the cache's dtype
on every call: a pass out to memory and back that faults in new pages each
time (the FlexAttention path's dequantized copy of the layer costs the same).
Eagerly, the rows path instead dequantizes a group of batch rows at a time
into one small buffer the cache allocates once, and attends each group while
its cells are still in the CPU's caches (`DEQUANTIZE_GROUP_BYTES`).

`grouped_attention` is that eager loop registered as a custom op
(`flexkv::quantized_rows_attention`), so a compiled step runs it as written:
inductor sees only its inputs (the step's queries, the layer's cells and
scales, the mask bias), the output, and the scratch buffer it writes. It
covers the step with no `score_mod` and no log-sum-exp (plain
`scaled_dot_product_attention` per group); a step with either runs the
traced rows path.

A compiled decode step (a few queries per row and head, `REDUCED_DECODE_MAX_QUERIES`) instead
traces `reduced_decode`: the scores and the output written as sums of products over the cells,
which inductor builds into kernels that read each 8-bit cell once and widen it in registers.
A decode step reads every cell of the window for one query, so it is bound by the bytes it
reads: the layer's cells at a quarter of the unquantized bytes, against the group loop's widened
copies written and read again. Its cost grows with the queries per cell (each query widens the
cell again, where a matrix product would share it), and float8 cells widen through some twenty
vector instructions per sixteen cells where int8 takes one, hence the per-dtype limit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..paths.row_cells import batch_cells
from ..storage.quantized import dequantize_into, widen_into

__all__ = ["grouped_attention", "reduced_decode", "reduces_decode", "group_rows", "scratch_width", "dequantized_group",
           "widened_group", "DEQUANTIZE_GROUP_BYTES", "FUSED_SCALES_MAX_QUERIES", "REDUCED_DECODE_MAX_QUERIES"]

#: Quantized cells are dequantized and attended in groups of batch rows whose float32 keys and
#: values take about this many bytes, in a buffer the cache allocates once
#: (`cpu_fast_rows.dequantize_scratch`): a group stays in the CPU's caches between its dequantize
#: and its attention.
DEQUANTIZE_GROUP_BYTES = 4 << 20
#: Up to this many queries per batch row and head (a decode step's, a GQA group folded in), float32
#: steps apply the scales to scores and probabilities (`grouped_attention`); longer query blocks
#: dequantize the cells for the fused attention kernel, which is faster there.
FUSED_SCALES_MAX_QUERIES = 8
#: A compiled float32 step on the CPU with at most this many queries per batch row and head (a
#: GQA group folded in) traces `reduced_decode`, by cell dtype: measured against the group loop
#: (`benchmarks.quantized`), int8 is faster up to 4 queries (0.48x of the unquantized decode step
#: at 1, 0.71x at 4 against 1.25x and 1.04x), float8 at one (1.53x against 2.01x; 2.15x against
#: 1.55x at 4).
REDUCED_DECODE_MAX_QUERIES = {torch.int8: 4, torch.float8_e4m3fn: 1}


def scratch_width(width: int, value_width: int, slot_dtype) -> int:
    """float32 numbers of the group buffer one cell of one head takes: its key and value widened
    (`width + value_width`), and for float8 cells the int16 staging their bits pass through
    (`quantized.widen_into`), for a key and a value together."""
    cell = width + value_width
    return cell + (cell + 1) // 2 if slot_dtype == torch.float8_e4m3fn else cell


def group_rows(scratch: torch.Tensor, rows: int, heads: int, width: int, cell_width: int) -> int:
    """How many batch rows of `width` cells over `heads` heads (`cell_width` float32 numbers of
    the buffer per cell: `scratch_width`) fit in `scratch` at a time (at least one: the cache
    sizes it for one)."""
    return max(1, min(rows, scratch.numel() // (heads * width * cell_width)))


def _group_buffer(scratch: torch.Tensor, offset: int, cells: torch.Tensor) -> torch.Tensor:
    """The part of `scratch` from `offset` (counted in its own elements) shaped as `cells`
    (`[rows, H, W, width]`) and laid out as they are (heads outermost), so a widening pass walks
    both in order."""
    rows, H, W, w = cells.shape
    return scratch[offset:offset + rows * H * W * w].view(H, rows, W, w).transpose(0, 1)


def _staging(scratch: torch.Tensor, offset: Optional[int], cells: torch.Tensor) -> Optional[torch.Tensor]:
    """int16 room for `cells`' bits in float32 `scratch` from `offset` (None: no room given)."""
    if offset is None or cells.dtype != torch.float8_e4m3fn:
        return None
    return _group_buffer(scratch[offset:].view(torch.int16), 0, cells)


def dequantized_group(scratch: torch.Tensor, offset: int, cells: torch.Tensor, scale: torch.Tensor,
                      staging: Optional[int] = None) -> torch.Tensor:
    """`cells * scale` (`[rows, H, W, width]`) written into `scratch` from `offset`; float32.
    `staging`: where in `scratch` float8 cells' bits may pass (`scratch_width`)."""
    return dequantize_into(_group_buffer(scratch, offset, cells), cells, scale, _staging(scratch, staging, cells))


def widened_group(scratch: torch.Tensor, offset: int, cells: torch.Tensor, staging: Optional[int] = None):
    """`cells` as float32 numbers, unscaled and divided by a power of two, written into `scratch`
    from `offset`: `(numbers, factor)` as `quantized.widen_into` returns them."""
    return widen_into(_group_buffer(scratch, offset, cells), cells, _staging(scratch, staging, cells))


def reduces_decode(q: torch.Tensor, cell_dtype: torch.dtype) -> bool:
    """Whether a step of queries `q` (`[B, H, Q, D]`) over cells of `cell_dtype` takes `reduced_decode`:
    while a graph is compiled, on the CPU, float32 queries, `Q <= REDUCED_DECODE_MAX_QUERIES[cell_dtype]`."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and torch.compiler.is_compiling()
            and q.shape[2] <= REDUCED_DECODE_MAX_QUERIES.get(cell_dtype, 0))


def reduced_decode(q: torch.Tensor, k_cells: torch.Tensor, v_cells: torch.Tensor, k_scale: torch.Tensor,
                   v_scale: torch.Tensor, bias: torch.Tensor, cells: Optional[torch.Tensor], base: int,
                   row_len: int) -> torch.Tensor:
    """`grouped_attention` (arguments alike, no scratch) as sums of products for a compiled graph:
    `softmax(sum_d q * k_cells * k_scale + bias) * v_scale`, then its sum with `v_cells` over the
    cells. Inductor reduces each sum in one kernel that reads every cell once; run without it (an
    eager backend), the products would be formed in full (`[B, H, Q, W, D]`), so `attend` takes
    this only while compiling (`reduces_decode`). Equal to the reference up to the order of the
    float32 sums."""
    kc, vc, ks, vs = (batch_cells(x, 0, q.shape[0], cells, base, row_len) for x in (k_cells, v_cells, k_scale, v_scale))
    scores = (q.unsqueeze(3) * kc.to(q.dtype).unsqueeze(2)).sum(-1) * ks.transpose(-1, -2) + bias
    probs = torch.softmax(scores, dim=-1) * vs.transpose(-1, -2)
    return (probs.unsqueeze(-1) * vc.to(q.dtype).unsqueeze(2)).sum(3)


@torch.library.custom_op("flexkv::quantized_rows_attention", mutates_args=("scratch",))
def grouped_attention(q: torch.Tensor, k_cells: torch.Tensor, v_cells: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, bias: torch.Tensor, cells: Optional[torch.Tensor], base: int,
                      row_len: int, scratch: torch.Tensor) -> torch.Tensor:
    """Attention of `q` (`[B, H, Q, D]`, scaled) over quantized cells with an additive mask `bias`
    (`[B, 1, Q, W]`), a group of batch rows at a time widened into `scratch` (float32). Batch rows
    as in `row_cells.batch_cells`. Returns `[B, H, Q, Dv]` in `q`'s dtype.

    float32 queries, at most `FUSED_SCALES_MAX_QUERIES` per row and head (decode): the scales are
    applied to the scores and the probabilities instead of the cells (`softmax(q.k * k_scale + bias)`, then `(p * v_scale) @ v`), which saves two passes over
    the widened cells; the products round differently from the reference's `q.(k * k_scale)` by
    a few float32 ulps; float8 cells widen to their numbers times 2**-8
    (`quantized.widen_into`), and the 2**8 joins the scores (`addcmul`'s value) and the output.
    Otherwise the cells are dequantized and run through `scaled_dot_product_attention` in `q`'s
    dtype, as the reference computes."""
    B, H = q.shape[:2]
    W = bias.shape[-1]
    D, Dv = k_cells.shape[-1], v_cells.shape[-1]
    step = group_rows(scratch, B, H, W, scratch_width(D, Dv, k_cells.dtype))
    fused = q.dtype == torch.float32 and q.shape[2] <= FUSED_SCALES_MAX_QUERIES
    outs = []
    # Read in place, every group's cells and scales are slices of one view per tensor, made once.
    whole = None if cells is not None else [batch_cells(x, 0, B, None, base, row_len)
                                            for x in (k_scale, v_scale, k_cells, v_cells)]
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        n = b1 - b0
        if whole is None:
            ks, vs, kc, vc = (batch_cells(x, b0, b1, cells, base, row_len) for x in (k_scale, v_scale, k_cells, v_cells))
        else:
            ks, vs, kc, vc = (x[b0:b1] for x in whole)
        staging = n * H * W * (D + Dv)
        if fused:
            keys, k_factor = widened_group(scratch, 0, kc, staging)
            scores = torch.addcmul(bias[b0:b1], torch.matmul(q[b0:b1], keys.transpose(-1, -2)), ks.transpose(-1, -2),
                                   value=k_factor)
            probs = torch.softmax(scores, dim=-1).mul_(vs.transpose(-1, -2))
            values, v_factor = widened_group(scratch, n * H * W * D, vc, staging)
            out = torch.matmul(probs, values)
            outs.append(out if v_factor == 1.0 else out.mul_(v_factor))
            continue
        keys = dequantized_group(scratch, 0, kc, ks, staging)
        values = dequantized_group(scratch, n * H * W * D, vc, vs, staging)
        outs.append(F.scaled_dot_product_attention(q[b0:b1], keys.to(q.dtype), values.to(q.dtype),
                                                   attn_mask=bias[b0:b1], scale=1.0))
    # Contiguous, as the op's fake says: SDPA lays its output out as the queries are (a model's
    # `[B, Q, H, D]` projection seen as `[B, H, Q, D]`), and a compiled graph reads it by the fake's strides.
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


@grouped_attention.register_fake
def _(q, k_cells, v_cells, k_scale, v_scale, bias, cells, base, row_len, scratch):
    return q.new_empty(q.shape[:3] + (v_cells.shape[-1],))
