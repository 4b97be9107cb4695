"""The host planner: a step's segments and positions become one small integer table.

Planning uses plain Python ints only. It never reads a device tensor, so it
never waits for the device: the table is packed on the host, copied to the
device with one non-blocking copy (from pinned memory on CUDA), and split
into views there. The same step planned twice gives equal plans, and the
plan of a `"meta"` cache equals the plan of a CUDA cache of the same config
and block geometry (only the copy differs).

Its cost follows the step, not the pool: each row is described by a fixed
number of cell intervals, and its block lists are only as wide as the blocks
one row can reach (`Layout.row_blocks`), however many slots the pool has.

Stages, per row of the step:

1. stream ranges: the stream indices some query of the row attends
   (`reach`), and for full blocks those every query attends (`common`; a
   causal per-step window shares its window and the step's first token);
2. cells: each stream range becomes at most four physical cell intervals
   (source, sink region, ring before and after it wraps), merged;
3. blocks: the KV blocks those intervals touch, split into full ones (every
   query attends every cell, no mask evaluated; only with `full_blocks`) and
   partial ones (the mask decides cell by cell);
4. writes: the cell each of the step's `T` tokens is written to.

Worked example (block 8; source of 4 cells at 0-3; slot 0's sink region at
4-6 and its ring of 6 cells at 7-12; `SinkWindow(3, 4)`): a request with
`source_len=2`, 9 written, a step of one token (`n = 11`, `lo = 7`) reaches
stream `[0, 3)` and `[7, 12)`: source cells `[0, 2)`, sink cell `[4, 5)` and
ring cells `7 + j % 6` for `j` in 7..11, i.e. `[8, 13)`; merged `[0, 2)`,
`[4, 5)`, `[8, 13)`; blocks `[0, 1]`.

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
`src_row`     index of the row's source row among all source rows
`slot_row`    index of the row's slot row among all slot rows
`cell_lo{k}`  `k < INTERVALS`: the cells some query of the row attends are
`cell_hi{k}`  the union of `[cell_lo{k}, cell_hi{k})` (empty ones are 0, 0)
============  ==========================================================

then the block lists (`kv_num_blocks`, `kv_indices`, `full_kv_num_blocks`,
`full_kv_indices`, one list per row: every query block of a row visits the
same blocks) and the cell each of the step's `T` tokens is written to
(`write_index`, `[N, 1, T]`: shaped to index a layer tensor `[1, H, S, D]`
together with a head index `[1, H, 1]`, so that every layer writes the step's
`[N, H, T, D]` keys as they come). Padding rows point every region out
of reach, so their mask is empty.
"""

from __future__ import annotations

import functools
from array import array
from typing import Callable, Hashable, Optional

import torch

from ...config import BoundedKVConfig, resolve_device
from ...step import BoundedKVStep
from .layout import Layout

__all__ = ["BoundedPlan", "ROW_FIELDS", "INTERVALS", "MASK_INTERVALS", "PLAN_TABLE", "build_plan", "table_spans", "table_views"]

#: Cell intervals per row: sinks and window each reach the source, the sink region and the ring,
#: and the ring splits where it wraps; merged, no row needs more than this.
INTERVALS = 6
#: Cell intervals a per-step window's row can need: the sinks (in the source, or in the slot's sink
#: region when the source is shorter than the sinks) and the window (in the source, and in the ring,
#: split where it wraps). The window never reaches the sink region (it starts at or after the sinks).
#: A per-step mask (`flexkv.cache.positions.masks`) tests these first ones only.
MASK_INTERVALS = 4
SCALAR_FIELDS = (
    "src_base", "src_len", "sink_base", "ring_start", "ring_base", "n", "n_mod", "sink", "lo", "span",
    "src_row", "slot_row",
)
ROW_FIELDS = SCALAR_FIELDS + tuple(f"cell_{e}{k}" for k in range(INTERVALS) for e in ("lo", "hi"))
_FAR = 1 << 30  # a base no cell index can reach: padding rows' regions start here
_SINK_BASE, _RING_BASE = SCALAR_FIELDS.index("sink_base"), SCALAR_FIELDS.index("ring_base")

#: The plan table's one definition, in the order its parts lie: `(name, ints per row, view)`.
#: Ints per row is 1 or the name of a plan size (`"width"`, `"full_width"`, `"tokens"`); the view
#: is the shape after the row axis (`"n"` standing for ints per row), or None for one flat run
#: (row-major) of `rows * ints per row`. The planner emits the parts in this order, `table_views`
#: cuts them out of the device table and `BoundedPlan`'s host readers find them by `table_spans`.
PLAN_TABLE = tuple((name, 1, None) for name in ROW_FIELDS) + (
    ("kv_num_blocks", 1, (1, 1)),
    ("kv_indices", "width", (1, 1, "n")),
    ("full_kv_num_blocks", 1, (1, 1)),
    ("full_kv_indices", "full_width", (1, 1, "n")),
    ("write_index", "tokens", (1, "n")),
)
#: The parts after the row fields, in `PLAN_TABLE` order (`build_plan` emits them in this order).
_TAIL_PARTS = tuple(name for name, _, _ in PLAN_TABLE[len(ROW_FIELDS):])


def table_spans(rows: int, tokens: int, width: int, full_width: int) -> dict:
    """Where each part of a plan table lies: name -> `(offset, ints per row, view)` (`PLAN_TABLE`).

    A fresh dict on each call (the caller may change it); `_spans` keeps one per plan shape.
    """
    return dict(_spans(rows, tokens, width, full_width))


def _compute_spans(rows: int, tokens: int, width: int, full_width: int) -> dict:
    """`table_spans` in plain Python (what a compiled graph traces)."""
    sizes = {"width": width, "full_width": full_width, "tokens": tokens}
    spans = {}
    o = 0
    for name, per_row, view in PLAN_TABLE:
        n = sizes.get(per_row, per_row)
        spans[name] = (o, n, view)
        o += rows * n
    spans[None] = (o, 0, None)  # the end: the table's length
    return spans


#: `table_spans`, computed once per plan shape (an eager step plans every token); never changed.
_spans = functools.lru_cache(maxsize=256)(_compute_spans)


def _part_span(name: str, rows: int, tokens: int, width: int, full_width: int) -> tuple:
    """`table_spans(...)[name]` in plain Python, no cache and no dict built (what a compiled graph traces)."""
    sizes = {"width": width, "full_width": full_width, "tokens": tokens}
    o = 0
    for part, per_row, view in PLAN_TABLE:
        n = sizes.get(per_row, per_row)
        if part == name:
            return o, n, view
        o += rows * n
    raise AttributeError(name)


_PART_NAMES = frozenset(name for name, _, _ in PLAN_TABLE)
_SCALAR_INDEX = {name: f for f, name in enumerate(SCALAR_FIELDS)}


class BoundedPlan:
    """Everything `attend` needs for one step, as device tensors.

    Attributes read inside a compiled step are tensors, plus `rows` (N) and
    `tokens` (T), which only change when the batch shape changes. `host`
    keeps the packed table as bytes, for equality, hashing and inspection.
    Each part of the table (`PLAN_TABLE`: the per-row fields, block lists and
    write cells) is an attribute, a view of the device `table`: made with the
    plan, or with `parts=False` when first read (`make_parts`).
    """

    def __init__(self, rows: int, tokens: int, width: int, table: array, device, full_blocks: bool = False,
                 parts: bool = True):
        full_width = width if full_blocks else 1
        self.rows = rows
        #: Whether blocks every query reads whole are listed apart (a host bool: it shapes the graph).
        self.full_blocks = full_blocks
        self.tokens = tokens
        self.width = width
        self.full_width = full_width
        self._table = table  # kept alive: on the CPU the plan's tensors are views of it
        self._spans = _spans(rows, tokens, width, full_width)  # where the host readers find each part
        self.device = resolve_device(device)
        buf = torch.frombuffer(table, dtype=torch.int32) if len(table) else torch.zeros(0, dtype=torch.int32)
        if self.device.type == "cuda":
            buf = buf.pin_memory()
            buf = buf.to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            buf = buf.to(self.device)
        self.table = buf
        end = self._spans[None][0]
        if end != buf.shape[0]:
            raise AssertionError(f"plan table holds {buf.shape[0]} ints, its parts {end}")
        #: What the step's attention paths made for it beside the table, name -> value (the rows path's
        #: geometry of a CPU chunk): filled while the cache plans the step (`AttentionPaths.plan_parts`),
        #: read by those paths only; the planner's own fields are never changed after it.
        self.extras: dict = {}
        #: Whether the table parts were all made with the plan (False: each is made when first read).
        self.parts_made = False
        if parts:
            self.make_parts()

    def make_parts(self) -> None:
        """Make every table part (`PLAN_TABLE`) an attribute now, as a view of `table`.

        A plan that enters a compiled graph needs its parts made before the graph: the graph then
        takes each as an input of its own. Made inside the graph, they would be views of one input,
        and inductor's CPU FlexAttention template, which names the tensors a `score_mod` reads by
        their storage, merged them and failed to build. A plan only eager calls read can skip this
        (`parts=False`): a one-token step reads two or three of the thirty parts, and making them all
        costs more than planning the step.
        """
        if self.parts_made:
            return
        for name, view in table_views(self.table, self.rows, self.tokens, self.width, self.full_width).items():
            self.__dict__.setdefault(name, view)
        self.parts_made = True

    def __getattr__(self, name: str):
        # Only reached for an attribute the plan does not hold: a table part of a plan made with
        # `parts=False`, made now (eagerly kept for the plan's other readers).
        if name not in _PART_NAMES:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        if torch.compiler.is_compiling():  # traced: plain arithmetic on the plan's sizes, nothing kept
            o, n, view = _part_span(name, self.rows, self.tokens, self.width, self.full_width)
        else:
            o, n, view = self._spans[name]
        part = self.table[o:o + self.rows * n]
        if view is not None:
            part = part.view(self.rows, *(n if d == "n" else d for d in view))
        if not torch.compiler.is_compiling():
            self.__dict__[name] = part
        return part

    @property
    def host(self) -> bytes:
        """The packed host table, as bytes (for equality, digests and inspection)."""
        return self._table.tobytes()

    def __eq__(self, other):
        if not isinstance(other, BoundedPlan):
            return NotImplemented
        return (self.rows, self.tokens, self.width, self.full_blocks, self.host) == (
            other.rows, other.tokens, other.width, other.full_blocks, other.host)

    __hash__ = None

    def _host(self, name: str, i: int) -> list:
        """Flat row `i`'s ints of table part `name`, read from the host table."""
        o, n, _ = self._spans[name]
        return list(self._table[o + i * n:o + (i + 1) * n])

    def field(self, name: str, i: int) -> int:
        """The host value of flat row `i`'s scalar field `name` (one of `SCALAR_FIELDS`)."""
        return self._table[_SCALAR_INDEX[name] * self.rows + i]

    def row(self, i: int) -> dict:
        """The host values of flat row `i`'s scalar fields, by name (for inspection and tests)."""
        # The per-row fields lie first, one int per row each, in `ROW_FIELDS` order.
        t, R = self._table, self.rows
        return {name: t[f * R + i] for f, name in enumerate(SCALAR_FIELDS)}

    def cell_intervals(self, i: int) -> list:
        """The non-empty cell intervals `(lo, hi)` some query of flat row `i` attends, in order."""
        t, R = self._table, self.rows
        first = len(SCALAR_FIELDS) * R + i  # cell_lo0; then cell_hi0, cell_lo1, ... one row-run each
        out = []
        for k in range(INTERVALS):
            lo, hi = t[first + 2 * k * R], t[first + (2 * k + 1) * R]
            if lo < hi:
                out.append((lo, hi))
        return out

    def blocks(self, i: int, full: bool = False) -> list:
        """KV blocks flat row `i` visits: the masked ones, or with `full=True` the ones every
        query attends whole (no mask evaluated)."""
        prefix = "full_kv" if full else "kv"
        count = self._host(f"{prefix}_num_blocks", i)[0]
        return self._host(f"{prefix}_indices", i)[:count]

    def write_cells(self, i: int) -> list:
        """Cells the `T` tokens of flat row `i` are written to."""
        return self._host("write_index", i)

    def __repr__(self):
        return f"BoundedPlan(rows={self.rows}, tokens={self.tokens}, width={self.width}, device={self.device})"


def table_views(buf: torch.Tensor, rows: int, tokens: int, width: int, full_width: int) -> dict:
    """The named views of a packed plan table `buf` (`BoundedPlan`'s attributes), by name.

    Used by `BoundedPlan` on the table it copies to the device, and inside a compiled graph that
    takes the table as its one plan input. The parts and their order are `PLAN_TABLE`'s.
    """
    spans = _compute_spans(rows, tokens, width, full_width)  # traced in a compiled region: no cache
    end = spans[None][0]
    if end != buf.shape[0]:
        raise AssertionError(f"plan table holds {buf.shape[0]} ints, its views {end}")
    # The per-row fields lie first, one int per row each: cut them in one op (an eager step makes a
    # plan per token, and each slice costs an op).
    o = len(ROW_FIELDS) * rows
    views = dict(zip(ROW_FIELDS, buf[:o].view(len(ROW_FIELDS), rows).unbind(0)))
    for name, (o, n, view) in spans.items():
        if name in views or name is None:
            continue
        part = buf[o:o + rows * n]
        views[name] = part if view is None else part.view(rows, *(n if d == "n" else d for d in view))
    return views


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
    """Sorted, disjoint, non-adjacent intervals covering the same cells."""
    intervals.sort()
    out: list = []
    for lo, hi in intervals:
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _touched(merged: list, block: int) -> list:
    """Every block some cell of the merged intervals lies in, ascending."""
    out: list = []
    last = -1
    for lo, hi in merged:
        first = max(lo // block, last + 1)
        last = (hi - 1) // block
        out.extend(range(first, last + 1))
    return out


def _inside(merged: list, block: int) -> list:
    """Every block wholly inside the merged intervals, ascending."""
    out: list = []
    for lo, hi in merged:
        out.extend(range(-(-lo // block), hi // block))
    return out


@functools.lru_cache(maxsize=64)
def _layout_facts(layout: Layout) -> tuple:
    """The layout's derived sizes a plan reads, computed once per layout (a frozen dataclass; each
    is a property that recomputes, and an eager step plans every token)."""
    return (layout.row_blocks, layout.source_row_len, layout.slot_row_len, layout.slots_base, layout.sink_len,
            layout.scratch_base)


def build_plan(
    config: BoundedKVConfig,
    layout: Layout,
    step: BoundedKVStep,
    slot_of: Callable[[Hashable], int],
    device,
    full_blocks: bool = False,
    private_source: Optional[Callable[[Hashable], Optional[int]]] = None,
    parts: bool = True,
) -> BoundedPlan:
    """Plan `step` for the cache described by `config`/`layout`.

    `slot_of(request_id)` gives an admitted request's slot. The step must
    already be valid (the manager checks it); this function only computes.
    `full_blocks`: list the blocks every query of a row attends whole as full
    blocks (FlexAttention skips the mask there). `private_source(request_id)`
    gives the source place of a request that declares `source=-1`. `parts=False`: the plan's
    table parts are made when first read (a plan only eager calls read; `BoundedPlan.make_parts`).
    """
    R = layout.rows_per_request
    T = step.step_tokens
    width, Ls, Lr, slots_base, sink_len, scratch_base = _layout_facts(layout)
    qw = config.query_window
    sizes = (R, T, layout.ring_len, layout.block_size, Ls, Lr, slots_base, sink_len, qw, config.causal_step,
             config.reverse_step_order, INTERVALS if qw is not None else MASK_INTERVALS)
    rows = len(step.segments) * R
    out = _PlanRows(rows, width, width if full_blocks else 1)
    _plan_rows(out, step, config, sizes, slot_of, private_source, full_blocks, list(range(scratch_base, scratch_base + T)))
    return BoundedPlan(rows, T, width, out.table(), device, full_blocks, parts)


class _PlanRows:
    """The plan table's columns while `build_plan` fills them, row by row (`PLAN_TABLE` order)."""

    def __init__(self, rows: int, width: int, full_width: int):
        self.cols = [[0] * rows for _ in range(len(ROW_FIELDS))]
        self.num_blocks = [0] * rows
        self.full_num = [0] * rows
        self.indices = array("i", bytes(4 * rows * width))
        self.full_indices = array("i", bytes(4 * rows * full_width))
        self.width, self.full_width = width, full_width
        self.writes: list = []

    def padding(self, i: int, scratch: list) -> None:
        """A padding row: its regions out of reach, its tokens written to the scratch cells."""
        self.cols[_SINK_BASE][i] = self.cols[_RING_BASE][i] = -_FAR
        self.writes.extend(scratch)

    def cells_and_blocks(self, i: int, reached: list, partial: list, full: list) -> None:
        """Row `i`'s cell intervals and (partial, full) block lists."""
        cols = self.cols
        for k, (clo, chi) in enumerate(reached):
            cols[len(SCALAR_FIELDS) + 2 * k][i], cols[len(SCALAR_FIELDS) + 2 * k + 1][i] = clo, chi
        if full:
            self.full_num[i] = len(full)
            self.full_indices[i * self.full_width:i * self.full_width + len(full)] = array("i", full)
        self.num_blocks[i] = len(partial)
        self.indices[i * self.width:i * self.width + len(partial)] = array("i", partial)

    def table(self) -> array:
        """The row fields (in `ROW_FIELDS` order), then the rest."""
        table = array("i", [x for col in self.cols for x in col])
        tail = {"kv_num_blocks": self.num_blocks, "kv_indices": self.indices, "full_kv_num_blocks": self.full_num,
                "full_kv_indices": self.full_indices, "write_index": self.writes}
        for name in _TAIL_PARTS:
            table.extend(tail[name])
        return table


def _intervals(ranges, geometry) -> list:
    """The merged cell intervals of stream `ranges` in a row of `geometry`."""
    cells: list = []
    for a, b in ranges:
        if a < b:
            _cells(a, b, *geometry, cells)
    return _merge(cells)


def _plan_rows(out: _PlanRows, step: BoundedKVStep, config: BoundedKVConfig, sizes: tuple, slot_of, private_source,
               full_blocks: bool, scratch: list) -> None:
    """Fill every row of the step's segments. `sizes`: the layout's and config's facts a plan reads (rows per
    request, step tokens, ring, block, source row, slot row, slots base, sink cells, query window, causal and
    reverse step, interval limit), read once per plan (a layout's are properties that recompute)."""
    R, T, ring, block, Ls, Lr, slots_base, sink_len, qw, causal, reverse, limit = sizes
    cols, writes, i = out.cols, out.writes, 0
    (c_src_base, c_src_len, c_sink_base, c_ring_start, c_ring_base, c_n, c_n_mod, c_sink, c_lo, c_span, c_src_row,
     c_slot_row) = cols[:len(SCALAR_FIELDS)]
    for seg in step.segments:
        rid = seg.request_id
        if rid is None:
            for _ in range(R):
                out.padding(i, scratch)
                i += 1
            continue
        pos = step.positions[rid]
        L, n, span = pos.source_len, pos.length, seg.span
        pol = config.retention_for(L)
        s = pol.sink
        ring_start = max(s, L)
        # Stage 1: stream ranges attended by some query (reach) and by every query (common).
        lo = pol.window_start(n, span)
        if qw is None:
            reach = ((0, min(s, n)), (min(lo, n), n + T))
            # Causal inside the step: query t reads own tokens up to t, so only the first is common.
            common = ((0, min(s, n)), (min(lo, n), n + 1)) if causal else reach
        else:
            reach = ((0, min(s, n + T)), (max(0, n - qw), n + T))
            common = ((0, min(s, n + 1)), (max(0, n + T - 1 - qw), n + 1))
        slot = slot_of(rid)
        own = [n + span - 1 - t if t < span else n + t for t in range(T)] if reverse else range(n, n + T)
        source = private_source(rid) if pos.source == -1 and L else pos.source
        n_mod = n % ring
        for r in range(R):
            src_row = source * R + r if L else 0
            src = src_row * Ls
            slot_row = slot * R + r
            base = slots_base + slot_row * Lr
            ring_base = base + sink_len
            c_src_base[i], c_src_len[i], c_sink_base[i], c_ring_start[i], c_ring_base[i] = (src, L, base, ring_start,
                                                                                            ring_base)
            c_n[i], c_n_mod[i], c_sink[i], c_lo[i], c_span[i], c_src_row[i], c_slot_row[i] = (n, n_mod, s, lo, span,
                                                                                            src_row, slot_row)
            # Stage 2: cell intervals.
            geometry = (L, ring_start, src, base, ring_base, ring)
            reached = []
            for a, b in reach:
                if a < b:
                    _cells(a, b, *geometry, reached)
            reached = _merge(reached)
            if len(reached) > limit:
                raise AssertionError(f"row {i} needs {len(reached)} cell intervals: {reached}")
            # Stage 3: blocks.
            partial, full = _touched(reached, block), []
            if full_blocks:
                full = _inside(reached if common is reach else _intervals(common, geometry), block)
                if full:
                    full_set = set(full)
                    partial = [blk for blk in partial if blk not in full_set]
            out.cells_and_blocks(i, reached, partial, full)
            # Stage 4: where the step's tokens go.
            writes.extend(base + (j - L) if j < ring_start else ring_base + j % ring for j in own)
            i += 1
