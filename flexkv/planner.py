"""The host planner: a step's segments and positions become one small integer table.

Planning uses plain Python ints only. It never reads a device tensor, so it
never waits for the device: the table is packed on the host, copied to the
device with one non-blocking copy (from pinned memory on CUDA), and split
into views there. The same step planned twice gives equal plans.

Per flat row `i` (segment `i // R`, row `i % R`) the table holds:

============  ==========================================================
`src_base`    first cell of the row's source row
`src_len`     the request's `source_len` (0 for padding rows)
`sink_base`   first cell of the slot row's sink region
`ring_start`  first stream index kept in the ring: `max(sink, src_len)`
`ring_base`   first cell of the slot row's ring
`n`           stream length before the step
`n_mod`       `n % ring_len`
`sink`        the resolved policy's `sink`
`lo`          first stream index of the per-step window
`span`        tokens the row writes this step
============  ==========================================================

plus the block-sparse description FlexAttention needs (`kv_num_blocks`,
`kv_indices` and zero-count full blocks) and the cell each of the step's
`T` tokens is written to (`write_index`, `[N * T]`, row-major).
Padding rows point every region out of reach, so their mask is empty.
"""

from __future__ import annotations

from array import array
from typing import Callable, Hashable, Mapping

import torch

from .config import BoundedKVConfig
from .layout import Layout
from .step import BoundedKVStep

__all__ = ["BoundedPlan", "ROW_FIELDS", "build_plan"]

ROW_FIELDS = ("src_base", "src_len", "sink_base", "ring_start", "ring_base", "n", "n_mod", "sink", "lo", "span")
_FAR = 1 << 30  # a base no cell index can reach: padding rows' regions start here


class BoundedPlan:
    """Everything `attend` needs for one step, as device tensors.

    Attributes read inside a compiled step are tensors, plus `rows` (N) and
    `tokens` (T), which only change when the batch shape changes. `host`
    keeps the packed table as a tuple of ints, for equality and inspection.
    """

    def __init__(self, rows: int, tokens: int, q_blocks: int, width: int, host: tuple, device):
        self.rows = rows
        self.tokens = tokens
        self.host = host
        self.device = torch.device(device)
        n_fields = len(ROW_FIELDS)
        buf = torch.frombuffer(array("i", host), dtype=torch.int32) if host else torch.zeros(0, dtype=torch.int32)
        if self.device.type == "cuda":
            buf = buf.pin_memory()
        buf = buf.to(self.device, non_blocking=True)
        self.table = buf
        o = 0
        for name in ROW_FIELDS:
            setattr(self, name, buf[o:o + rows])
            o += rows
        nq = rows * q_blocks
        self.kv_num_blocks = buf[o:o + nq].view(rows, 1, q_blocks)
        o += nq
        self.kv_indices = buf[o:o + nq * width].view(rows, 1, q_blocks, width)
        o += nq * width
        self.full_kv_num_blocks = buf[o:o + nq].view(rows, 1, q_blocks)
        o += nq
        self.full_kv_indices = buf[o:o + nq].view(rows, 1, q_blocks, 1)
        o += nq
        self.write_index = buf[o:o + rows * tokens]
        o += rows * tokens
        assert o == len(host), (o, len(host), n_fields)

    def __eq__(self, other):
        if not isinstance(other, BoundedPlan):
            return NotImplemented
        return (self.rows, self.tokens, self.host) == (other.rows, other.tokens, other.host)

    __hash__ = None

    def row(self, i: int) -> dict:
        """The host values of flat row `i`, by field name (for inspection and tests)."""
        return {name: self.host[k * self.rows + i] for k, name in enumerate(ROW_FIELDS)}

    def blocks(self, i: int) -> list:
        """The KV blocks flat row `i` visits (first query block), from the host table."""
        n_fields = len(ROW_FIELDS)
        nq = self.kv_num_blocks.shape[2]
        width = self.kv_indices.shape[3]
        count = self.host[n_fields * self.rows + i * nq]
        start = n_fields * self.rows + self.rows * nq + i * nq * width
        return list(self.host[start:start + count])

    def write_cells(self, i: int) -> list:
        """Cells the `T` tokens of flat row `i` are written to."""
        start = len(self.host) - self.rows * self.tokens + i * self.tokens
        return list(self.host[start:start + self.tokens])

    def __repr__(self):
        return f"BoundedPlan(rows={self.rows}, tokens={self.tokens}, device={self.device})"


def _add_blocks(out: list, first: int, stop: int, block: int) -> None:
    """Append the blocks covering cells [first, stop) to `out`, skipping a repeat of its last block."""
    if stop <= first:
        return
    b0, b1 = first // block, (stop - 1) // block + 1
    if out and out[-1] >= b0:
        b0 = out[-1] + 1
    out.extend(range(b0, b1))


def build_plan(
    config: BoundedKVConfig,
    layout: Layout,
    step: BoundedKVStep,
    slot_of: Callable[[Hashable], int],
    device,
) -> BoundedPlan:
    """Plan `step` for the cache described by `config`/`layout`.

    `slot_of(request_id)` gives an admitted request's slot. The step must
    already be valid (the manager checks it); this function only computes.
    """
    R = layout.rows_per_request
    T = step.step_tokens
    ring = layout.ring_len
    block = layout.block_size
    qw = config.query_window
    reverse = config.reverse_step_order
    nq = layout.q_blocks(T)
    width = layout.num_blocks
    segments = step.segments
    rows = len(segments) * R

    cols = [[0] * rows for _ in ROW_FIELDS]
    (c_src_base, c_src_len, c_sink_base, c_ring_start, c_ring_base,
     c_n, c_n_mod, c_sink, c_lo, c_span) = cols
    num_blocks: list = []
    indices: list = []
    writes: list = []
    scratch = list(range(layout.scratch_base, layout.scratch_base + T))

    i = 0
    for seg in segments:
        rid = seg.request_id
        if rid is None:
            for _ in range(R):
                c_sink_base[i] = c_ring_base[i] = -_FAR
                num_blocks.extend([0] * nq)
                indices.extend([0] * (nq * width))
                writes.extend(scratch)
                i += 1
            continue
        pos = step.positions[rid]
        L, n, span = pos.source_len, pos.length, seg.span
        pol = config.retention_for(L)
        s = pol.sink
        ring_start = max(s, L)
        lo = pol.window_start(n, span)
        # The lowest window start over the step's queries decides which source blocks are read.
        lo_read = lo if qw is None else max(s, n - qw)
        slot = slot_of(rid)
        # Stream index of each of the step's tokens, then the cell it is written to.
        if reverse:
            own = [n + span - 1 - t if t < span else n + t for t in range(T)]
        else:
            own = range(n, n + T)
        for r in range(R):
            src = layout.source_row(pos.source, r) if L else 0
            base = layout.slot_row(slot, r)
            ring_base = base + layout.sink_len
            c_src_base[i] = src
            c_src_len[i] = L
            c_sink_base[i] = base
            c_ring_start[i] = ring_start
            c_ring_base[i] = ring_base
            c_n[i] = n
            c_n_mod[i] = n % ring
            c_sink[i] = s
            c_lo[i] = lo
            c_span[i] = span

            blocks: list = []
            _add_blocks(blocks, src, src + min(s, L), block)
            _add_blocks(blocks, src + max(lo_read, s), src + L, block)
            _add_blocks(blocks, base, base + min(ring_start, n + T) - L, block)
            if n + T > ring_start:
                _add_blocks(blocks, ring_base, ring_base + ring, block)
            row_indices = blocks + [0] * (width - len(blocks))
            num_blocks.extend([len(blocks)] * nq)
            indices.extend(row_indices * nq)
            writes.extend(
                base + (j - L) if j < ring_start else ring_base + j % ring for j in own
            )
            i += 1

    host = [v for col in cols for v in col]
    host += num_blocks
    host += indices
    host += [0] * (rows * nq)  # full_kv_num_blocks: no full blocks
    host += [0] * (rows * nq)  # full_kv_indices
    host += writes
    return BoundedPlan(rows, T, nq, width, tuple(host), device)
