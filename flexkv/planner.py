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

plus the block-sparse description FlexAttention needs: the blocks where the
mask decides cell by cell (`kv_num_blocks`, `kv_indices`) and the blocks every
query of the row attends whole (`full_kv_*`, no mask evaluated), and the cell each of the step's
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

    def __init__(self, rows: int, tokens: int, q_blocks: int, width: int, host: tuple, device, full_width: int = 1):
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
        self.full_kv_indices = buf[o:o + nq * full_width].view(rows, 1, q_blocks, full_width)
        o += nq * full_width
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

    def blocks(self, i: int, full: bool = False) -> list:
        """KV blocks flat row `i` visits (first query block): the masked ones, or with
        `full=True` the ones every query attends whole (no mask evaluated)."""
        nq = self.kv_num_blocks.shape[2]
        width = self.kv_indices.shape[3]
        o = len(ROW_FIELDS) * self.rows
        if full:
            o += self.rows * nq * (1 + width)
            width = self.full_kv_indices.shape[3]
        count = self.host[o + i * nq]
        start = o + self.rows * nq + i * nq * width
        return list(self.host[start:start + count])

    def write_cells(self, i: int) -> list:
        """Cells the `T` tokens of flat row `i` are written to."""
        start = len(self.host) - self.rows * self.tokens + i * self.tokens
        return list(self.host[start:start + self.tokens])

    def __repr__(self):
        return f"BoundedPlan(rows={self.rows}, tokens={self.tokens}, device={self.device})"


def _cells(a: int, b: int, L: int, ring_start: int, src: int, base: int, ring_base: int, ring: int, out: list) -> None:
    """Append the cell intervals holding stream indices [a, b) of one row to `out`."""
    if a < min(b, L):  # the source
        out.append((src + a, src + min(b, L)))
    lo, hi = max(a, L), min(b, ring_start)
    if lo < hi:  # the slot's sink region
        out.append((base + lo - L, base + hi - L))
    lo = max(a, ring_start)
    if lo < b:  # the ring, split where it wraps
        first = lo % ring
        stop = first + (b - lo)
        out.append((ring_base + first, ring_base + min(stop, ring)))
        if stop > ring:
            out.append((ring_base, ring_base + stop - ring))


def _merge(intervals: list) -> list:
    out: list = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _classify(reached: list, everyone: list, block: int) -> tuple:
    """KV blocks split into partial ones (the mask decides cell by cell) and full ones.

    `reached`: cells some query of the row attends; `everyone`: cells every
    query attends. A block wholly inside `everyone` needs no mask at all.
    """
    full: list = []
    for lo, hi in _merge(everyone):
        full.extend(range(-(-lo // block), hi // block))
    full_set = set(full)
    partial: list = []
    for lo, hi in _merge(reached):
        for blk in range(lo // block, (hi - 1) // block + 1):
            if blk not in full_set and (not partial or partial[-1] < blk):
                partial.append(blk)
    return partial, full


def build_plan(
    config: BoundedKVConfig,
    layout: Layout,
    step: BoundedKVStep,
    slot_of: Callable[[Hashable], int],
    device,
    full_blocks: bool = False,
) -> BoundedPlan:
    """Plan `step` for the cache described by `config`/`layout`.

    `slot_of(request_id)` gives an admitted request's slot. The step must
    already be valid (the manager checks it); this function only computes.
    `full_blocks`: list the blocks every query of a row attends whole as full
    blocks (FlexAttention skips the mask there). A win on CUDA; on the CPU the
    compiled kernel ran slower with full blocks, so there every block is masked.
    """
    R = layout.rows_per_request
    T = step.step_tokens
    ring = layout.ring_len
    block = layout.block_size
    qw = config.query_window
    reverse = config.reverse_step_order
    nq = layout.q_blocks(T)
    width = layout.num_blocks
    full_width = width if full_blocks else 1
    segments = step.segments
    rows = len(segments) * R

    cols = [[0] * rows for _ in ROW_FIELDS]
    (c_src_base, c_src_len, c_sink_base, c_ring_start, c_ring_base,
     c_n, c_n_mod, c_sink, c_lo, c_span) = cols
    num_blocks: list = []
    indices: list = []
    full_num: list = []
    full_indices: list = []
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
                full_num.extend([0] * nq)
                full_indices.extend([0] * (nq * full_width))
                writes.extend(scratch)
                i += 1
            continue
        pos = step.positions[rid]
        L, n, span = pos.source_len, pos.length, seg.span
        pol = config.retention_for(L)
        s = pol.sink
        ring_start = max(s, L)
        lo = pol.window_start(n, span)
        # Stream intervals attended by some query (reach) and by every query (common) of the row.
        if qw is None:
            reach = [(0, min(s, n)), (lo, n), (n, n + T)]
            common = reach
        else:
            reach = [(0, min(s, n + T)), (max(0, n - qw), n + T)]
            common = [(0, min(s, n + 1)), (max(0, n + T - 1 - qw), n + 1)]
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

            geometry = (L, ring_start, src, base, ring_base, ring)
            reached: list = []
            everyone: list = []
            for a, b in reach:
                _cells(a, b, *geometry, reached)
            if full_blocks:
                for a, b in common:
                    _cells(a, b, *geometry, everyone)
            partial, full = _classify(reached, everyone, block)
            num_blocks.extend([len(partial)] * nq)
            indices.extend((partial + [0] * (width - len(partial))) * nq)
            full_num.extend([len(full)] * nq)
            full_indices.extend((full + [0] * (full_width - len(full))) * nq)
            writes.extend(
                base + (j - L) if j < ring_start else ring_base + j % ring for j in own
            )
            i += 1

    host = [v for col in cols for v in col]
    host += num_blocks
    host += indices
    host += full_num
    host += full_indices
    host += writes
    return BoundedPlan(rows, T, nq, width, tuple(host), device, full_width)
