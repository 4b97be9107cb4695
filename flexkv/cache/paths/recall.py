"""The memory part of a `Recall` retention: block means kept once, blocks chosen on the device, one softmax.

A `flexkv.config.Recall` cache keeps `memory + block - 1` more cells in every
slot's ring, so the entries that left the window stay in the slot. The
window part (sinks, window, the step's own tokens) is attended by the
cache's usual paths; the memory part joins them in the same softmax
(exact: the two key sets are disjoint). This module keeps the memory and
chooses what a step reads of it (`memory_select`);
`flexkv.cache.paths.recall_attention` attends the choice with the window.

Blocks are `block` stream entries counted from the first entry after the
sinks. `MemoryIndex` keeps, per layer and slot row, the mean key of each
block once it is whole (written when the step that writes its last entry
attends the layer; `ring_len / block + 1` blocks per row, so a block's mean
outlives its cells): a step scores `memory / block` means, not `memory`
keys. What every layer of a step reads alike (positions, candidate blocks,
the tail's cells and mask) is made once per step (`memory_step`). Per layer
and step, all on the device, no host read (a compiled step neither waits
nor recompiles as memories fill):

1. the means of the blocks some query of the step may read, read from the
   index, scored against the sum of the row's queries over the step and
   the KV head's query heads (under in-cache rotary positions the sum is
   turned back from the position memory is read at: the index keeps means
   at position 0); a stable descending sort keeps the `top_k` highest (ties
   to the lower block);
2. the chosen blocks' keys and values (`top_k * block` per row and KV head)
   and the row's tail (the entries that left the window while their block
   is not yet whole, fewer than `block` per query) gathered from the ring,
   keys turned to their read position from a table (`MemoryTurns`), each
   query masked to its own memory, attended in float32 (float64 for a
   float64 cache) with the user's `score_mod` (`recall_attention`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from ...config import BoundedKVConfig
from ..host.layout import Layout
from ..positions.rotary import apply_rotary
from ..storage.cell_rows import read_cells
from ..storage.slot_copy import SlotBuffer, plan_slot_rows

__all__ = ["MemoryIndex", "MemorySelection", "MemoryStep", "MemoryTurns", "check_recall_call", "memory_select",
           "memory_step", "turn_rows_", "window_starts", "work_dtype"]


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
                         f"attend_lse and flexkv.merge_attention instead")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the memory part computes in for a cache of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class MemoryIndex(nn.Module):
    """Per layer, the mean key of each whole block of each slot row (`[rows + 1, blocks, H, D]`; the last
    row is where padding rows write), allocated once. Block `b` of a stream lives at `b % blocks`."""

    def __init__(self, config: BoundedKVConfig, layout: Layout, device: torch.device):
        super().__init__()
        recall = config.recall
        # Plain ints for the traced step: torch 2.11's compiler cannot read `Recall`'s fields inside a graph.
        self.block, self.top_k = recall.block, recall.top_k
        self.blocks = -(-layout.ring_len // recall.block) + 1
        self.rows = config.max_slots * config.rows_per_request
        self.rows_per_request = config.rows_per_request
        self.slots_base, self.slot_row_len = layout.slots_base, layout.slot_row_len
        shape = (self.rows + 1, self.blocks, config.num_heads, config.head_dim)
        for layer in range(config.num_layers):
            # Cache state, not model weights: kept out of a model's state_dict.
            self.register_buffer(f"means_{layer}", torch.zeros(shape, dtype=work_dtype(config.dtype), device=device),
                                 persistent=False)

    def means(self, layer: int) -> torch.Tensor:
        return getattr(self, f"means_{layer}")

    @property
    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def slot_bytes(self) -> int:
        return self.memory_bytes // (self.rows + 1) * self.rows_per_request

    def slot_buffers(self):
        for buf in self.buffers():
            yield SlotBuffer(buf, 0, 0, self.rows_per_request)

    def row_of(self, plan) -> torch.Tensor:
        """`[N]`: each plan row's slot row, the spare row for padding rows."""
        return plan_slot_rows(plan, self.slots_base, self.slot_row_len, self.rows)[0]


def _cells(plan, j: torch.Tensor, ring: int, T: int, S: int) -> torch.Tensor:
    """Layer-tensor cells of stream entries `j` (`[N, ...]`) held by the ring after the step's write; a cell
    nothing reads elsewhere (sinks, entries not written or overwritten, padding rows)."""
    N = j.shape[0]
    view = (N,) + (1,) * (j.dim() - 1)
    end = plan.n.long().view(view) + T
    held = (j >= plan.sink.long().view(view)) & (j < end) & (j >= end - ring)
    cells = plan.ring_base.long().view(view) + torch.remainder(j, ring)
    return torch.where(held, cells, 0).clamp(0, S - 1)


def _swap(x: torch.Tensor, rope_layout: str) -> torch.Tensor:
    """Each rotated pair's two dimensions exchanged (`(i, i + D/2)` for ``"half"``, `(2i, 2i + 1)` else)."""
    if rope_layout == "interleaved":
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x.roll(x.shape[-1] // 2, dims=-1)


def turn_rows_(x: torch.Tensor, tables, rows: torch.Tensor) -> torch.Tensor:
    """`x` `[N, H, E, D]` (a buffer of its own, or a view into one) turned in place by the rows `rows` `[N, H, E]`
    of a layer's table (`tables`: `MemoryTurns.tables`); returns `x`."""
    table, rope_layout, _ = tables
    cs = table.index_select(0, rows.reshape(-1)).view(tuple(x.shape[:3]) + table.shape[1:])
    swapped = _swap(x, rope_layout)
    return x.mul_(cs[..., 0, :]).addcmul_(swapped, cs[..., 1, :])


class MemoryTurns(nn.Module):
    """Cosine and sine tables of the turns a memory read makes under in-cache rotary positions, one table
    per distinct rotary (`[length, 2, head_dim]` in the work dtype: row `offset + d` holds the cosines
    and the signed sines of a turn by `d` positions), built once when a layer's rotation is set (`set`).

    A turn is a small distance, never a stream index: a memory entry at stream index `j` is read at
    `t_mem - j` past its cell's rotation (`t_mem` just before the step's first window entry), which lies
    between `-(max_step_tokens + block)` and `memory + block`. So a step reads its keys' turns as table
    rows, where a sine and cosine per entry and layer in float64 cost more than the attention. Two turns
    are by a stream index (`turn_at`, angles computed): the keys of a block made whole, turned back to
    position 0 for the index (once per block), and each row's query sum turned back to `t_mem` for
    scoring (one vector per row and head: the means themselves are never turned).
    """

    def __init__(self, config: BoundedKVConfig, device: torch.device):
        super().__init__()
        recall = config.recall
        self.offset = config.max_step_tokens + recall.block + 1
        self.length = self.offset + config.memory_capacity + 2 * recall.block + 1
        self.work = work_dtype(config.dtype)
        self.device = device
        self._kinds: list = []  # the (layout, angle dtype, frequencies) of each table
        self._rotaries: list = []  # a rotary of each kind (for the turns of unbounded stream indices)
        self.layer_table: list = [None] * config.num_layers

    def set(self, layer: int, rotary) -> None:
        """Layer `layer` reads its memory turned by `rotary` (a `Rotary`), or at stream positions (None)."""
        if rotary is None:
            self.layer_table[layer] = None
            return
        kind = (rotary.layout, rotary.angle_dtype, tuple(rotary.inv_freq.tolist()))
        if kind not in self._kinds:
            k = len(self._kinds)
            d = torch.arange(-self.offset, self.length - self.offset, device=self.device)
            cos, sin = rotary.cos_sin(d, self.work)
            # `apply_rotary(x, cos, sin)` is `x * cos + swap(x) * (sign * sin)`, `swap` exchanging each pair's
            # two dimensions and `sign` -1 on the first of them: the sines are kept signed (`_turn`).
            sign = apply_rotary(torch.ones(1, rotary.head_dim, dtype=self.work, device=self.device),
                                torch.zeros(1, rotary.head_dim, dtype=self.work, device=self.device),
                                torch.ones(1, rotary.head_dim, dtype=self.work, device=self.device), rotary.layout)
            self.register_buffer(f"turns_{k}", torch.stack((cos, sin * sign), dim=1), persistent=False)
            self._kinds.append(kind)
            self._rotaries.append(rotary)
        self.layer_table[layer] = (self._kinds.index(kind), rotary.layout)

    def tables(self, layer: int):
        """`(table [length, 2, D], layout, kind)` of layer `layer`'s turns (each row its cosines and signed
        sines), or None (memory read at stream positions)."""
        entry = self.layer_table[layer]
        if entry is None:
            return None
        return getattr(self, f"turns_{entry[0]}"), entry[1], entry[0]

    def turn_at(self, kind: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`x` `[N, H, P, D]` turned by the (unbounded) `positions` `[N, P]`, angles in the rotary's own dtype."""
        return self._rotaries[kind].rotate(x, positions)

    def turn_matrices(self, positions: torch.Tensor) -> dict:
        """Per table kind, `[N, D, D]`: the turn by `positions` `[N]` as a matrix (`x @ M` turns the rows `x` of
        a batch row)."""
        out = {}
        for kind, rotary in enumerate(self._rotaries):
            eye = torch.eye(rotary.head_dim, dtype=self.work, device=positions.device)
            rows = eye.expand(positions.shape[0], 1, -1, -1)
            out[kind] = rotary.rotate(rows, positions.view(-1, 1).expand(-1, rotary.head_dim)).squeeze(1)
        return out

    @property
    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class MemoryStep(NamedTuple):
    """What every layer of one step reads alike (`memory_step`): positions, candidate blocks, the tail."""

    #: `[N]` each plan row's slot row in the index (padding rows: the spare row).
    rows: torch.Tensor
    #: The blocks the step makes whole: `[N, C]` index rows (the spare row where none) and slots, and the
    #: flat cells of their entries `[N, H, C * block]`; `made` whether any row makes one (read from the host
    #: table; a compiled step writes at every step instead of reading it, which would be a guard).
    made_rows: torch.Tensor
    made_slots: torch.Tensor
    made_flat: torch.Tensor
    made: bool
    #: `[N, C * block]` the stream index of each entry of those blocks.
    made_entries: torch.Tensor
    #: `[N, 1, 1, T, 1]` 1 for each written query (a chunk's written queries choose together).
    writes: torch.Tensor
    #: `[N, NB]` candidate block numbers and their means' rows in a layer's index viewed as `[rows * blocks,
    #: H, D]`; `[N, 1, NB]` which are in no written query's memory; `[N]` `t_mem`, the position memory is
    #: read at (`memory_part`).
    cand: torch.Tensor
    cand_slots: torch.Tensor
    invalid: torch.Tensor
    t_mem: torch.Tensor
    #: `[N, 1, 1, T, 1]` each query's oldest memory block and first block not yet wholly out of its window.
    oldest: torch.Tensor
    whole: torch.Tensor
    #: `[N, H, L]` the tail's flat cells, `[N, 1, L]` its table rows, `[N, 1, 1, T, L]` which queries read
    #: which tail entry, and the same as an additive mask `[N, 1, T, L]` (0 or -inf, the work dtype).
    tail_flat: torch.Tensor
    tail_turn: torch.Tensor
    tail_reads: torch.Tensor
    tail_bias: torch.Tensor
    #: `[N, 1]` the first entry after the sinks.
    sink: torch.Tensor
    #: Each candidate block's entries: `[N, 1, NB, block]` their stream indices, `[N, H, 2, NB, block]` their
    #: flat cells (`[:, :, 0]`) and table rows (`[:, :, 1]`); `[N, 1, T, NB]` which query's memory holds
    #: each candidate. A layer gathers its chosen blocks' from these.
    cand_entries: torch.Tensor
    cand_cells: torch.Tensor
    cand_inside: torch.Tensor
    #: `[N]` the first cell of each row's region the memory is copied into for FlexAttention
    #: (`flexkv.cache.paths.recall_region`; `Layout.with_recall_region`), 0 where the layout holds none.
    region: torch.Tensor
    #: Known on the host (not read when compiling: a flag read there would be a guard): every row writes a
    #: token (`real`: each query reads at least itself), and also the step is one token a row and every
    #: row's memory holds `top_k` blocks or more (`full`: every chosen block is live and read).
    real: bool = False
    full: bool = False


def window_starts(config: BoundedKVConfig, plan, T: int) -> torch.Tensor:
    """`[N, T]`: the first window entry of each query (its memory ends there)."""
    n, sink = plan.n.long().view(-1, 1), plan.sink.long().view(-1, 1)
    if config.query_window is not None:
        return torch.maximum(sink, n + torch.arange(T, device=n.device).view(1, T) - config.query_window)
    return plan.lo.long().view(-1, 1).expand(-1, T)


def _blocks_made(plan, bs: int) -> bool:
    """Whether some row's step makes a block whole (host table: no device read)."""
    for i in range(plan.rows):
        n, sink, span = plan.field("n", i), plan.field("sink", i), plan.field("span", i)
        if span and (n + span - sink) // bs > max((n - sink) // bs, 0):
            return True
    return False


def _host_flags(config: BoundedKVConfig, plan, T: int) -> Tuple[bool, bool]:
    """`(real, full)` of `MemoryStep`, from the plan's host table."""
    if torch.compiler.is_compiling():
        return False, False
    recall = config.recall
    real = all(plan.field("span", i) > 0 for i in range(plan.rows))
    if not real or T != 1:
        return real, False
    for i in range(plan.rows):
        n, sink = plan.field("n", i), plan.field("sink", i)
        w = plan.field("lo", i) if config.query_window is None else max(sink, n - config.query_window)
        if min((w - sink) // recall.block, recall.memory_blocks) < recall.top_k:
            return real, False
    return real, True


def memory_step(index: MemoryIndex, turns: MemoryTurns, config: BoundedKVConfig, layout: Layout, plan, T: int,
                H: int, S: int) -> MemoryStep:
    """The layer-independent part of a `Recall` step (`MemoryStep`), from the plan's tensors on the device."""
    recall = config.recall
    bs, MB = recall.block, recall.memory_blocks
    N = plan.n.shape[0]
    dev = plan.n.device
    work = index.means(0).dtype
    ring = layout.ring_len
    n, sink, span = plan.n.long().view(N, 1), plan.sink.long().view(N, 1), plan.span.long().view(N, 1)
    rows = index.row_of(plan)
    head_base = (torch.arange(H, device=dev) * S).view(1, H, 1, 1)

    # Blocks the step's committed tokens make whole (at most T // block + 1 per row).
    C = T // bs + 1
    whole_after = torch.div(n + span - sink, bs, rounding_mode="floor")
    whole_before = torch.div(n - sink, bs, rounding_mode="floor").clamp_min(0)
    b_made = whole_after - 1 - torch.arange(C, device=dev).view(1, C)  # [N, C]
    made = (b_made >= whole_before) & (b_made >= 0)
    j_made = sink.view(N, 1, 1) + b_made.view(N, C, 1) * bs + torch.arange(bs, device=dev).view(1, 1, bs)
    made_cells = _cells(plan, j_made.view(N, 1, C * bs), ring, T, S)
    made_flat = head_base.view(1, H, 1) + made_cells  # [N, H, C * bs]
    made_rows = torch.where(made, rows.view(N, 1), index.rows)
    made_slots = torch.remainder(b_made, index.blocks)
    any_made = torch.compiler.is_compiling() or _blocks_made(plan, bs)

    # Each query's memory: the blocks wholly out of its window, the newest MB of them.
    w = window_starts(config, plan, T)  # [N, T]
    whole = torch.div(w - sink, bs, rounding_mode="floor")
    oldest = (whole - MB).clamp_min(0)
    written = torch.arange(T, device=dev).view(1, T) < span
    newest = torch.where(written, whole, 0).amax(dim=1, keepdim=True)  # [N, 1]: end of the step's blocks
    NB = MB + T // bs + 1
    cand = oldest[:, :1] + torch.arange(NB, device=dev).view(1, NB)  # [N, NB]
    invalid = ((cand >= newest) | ~written.any(dim=1, keepdim=True)).view(N, 1, NB)
    t_mem = w[:, :1] - 1  # [N, 1]: just before the first query's first window entry

    # The tail (shared by the KV heads): entries out of the window whose block is not yet whole.
    L = bs + T
    j_tail = sink + whole[:, :1] * bs + torch.arange(L, device=dev).view(1, L)  # [N, L]
    tail_flat = head_base.view(1, H, 1) + _cells(plan, j_tail, ring, T, S).view(N, 1, L)
    tail_turn = (t_mem - j_tail + turns.offset).clamp(0, turns.length - 1).view(N, 1, L)
    jq = j_tail.view(N, 1, 1, 1, L)
    tail_reads = (jq >= (sink + whole * bs).view(N, 1, 1, T, 1)) & (jq < w.view(N, 1, 1, T, 1))
    tail_bias = torch.where(tail_reads, torch.zeros((), dtype=work, device=dev), float("-inf")).view(N, 1, T, L)
    live_row = plan.ring_base.long().view(N, 1, 1, 1) >= 0  # padding rows carry a negative ring base
    ring_flat = head_base + torch.where(live_row, plan.ring_base.long().view(N, 1, 1, 1), 0)  # [N, H, 1, 1]
    cand_rows = rows.view(N, 1) * index.blocks + torch.remainder(cand, index.blocks)
    entries = sink.view(N, 1, 1, 1) + cand.view(N, 1, NB, 1) * bs + torch.arange(bs, device=dev).view(1, 1, 1, bs)
    cand_flat = ring_flat + torch.remainder(entries, ring)  # an entry `j` sits `j % ring_len` past its ring's start
    cand_turn = (t_mem.view(N, 1, 1, 1) - entries + turns.offset).clamp(0, turns.length - 1)
    cand_cells = torch.stack([cand_flat, cand_turn.expand(N, H, NB, bs)], dim=2)
    blk = cand.view(N, 1, 1, NB)
    cand_inside = (blk >= oldest.view(N, 1, T, 1)) & (blk < whole.view(N, 1, T, 1))
    return MemoryStep(
        rows, made_rows, made_slots, made_flat, any_made, j_made.view(N, C * bs),
        written.to(work).view(N, 1, 1, T, 1), cand, cand_rows, invalid, t_mem.view(N),
        oldest.view(N, 1, 1, T, 1), whole.view(N, 1, 1, T, 1), tail_flat, tail_turn, tail_reads, tail_bias, sink,
        entries, cand_cells, cand_inside, layout.recall_base * (layout.recall_rows > 0) + rows * layout.recall_row_len,
        *_host_flags(config, plan, T))


class MemorySelection(NamedTuple):
    """One layer's memory blocks chosen for a step, and where their entries sit (`memory_select`)."""

    #: `[N, H, g, T, D]` the scaled queries in the work dtype.
    queries: torch.Tensor
    #: `[N, H, k]` each chosen block's place among the step's candidates (`MemoryStep.cand`), and whether
    #: it is a block of the row's memory (a row with fewer candidates chooses some that are not).
    order: torch.Tensor
    live: torch.Tensor
    #: `[N, H, k * bs]` the chosen entries' flat cells and their turn table rows (None: memory read at stream
    #: positions).
    flat: torch.Tensor
    turn: Optional[torch.Tensor]

    def gathered(self, per_candidate: torch.Tensor) -> torch.Tensor:
        """`[N, H, k * bs]`: the chosen blocks' rows of `per_candidate` `[N, 1 or H, NB, bs]`."""
        N, H, k = self.order.shape
        bs = per_candidate.shape[3]
        return per_candidate.expand(N, H, -1, bs).gather(2, self.order.unsqueeze(-1).expand(N, H, k, bs)).view(N, H, -1)

    def reads(self, step: "MemoryStep", windowed: bool) -> torch.Tensor:
        """`[N, H, T or 1, k]`: which query reads which chosen block (a live block inside its own memory;
        under one window start per step (`windowed` False) every candidate is inside every query's)."""
        N, H, k = self.order.shape
        live = self.live.view(N, H, 1, k)
        if not windowed:
            return live
        inside = step.cand_inside
        T = inside.shape[2]
        return live & inside.expand(N, H, T, -1).gather(3, self.order.view(N, H, 1, k).expand(N, H, T, k))


def memory_select(index: MemoryIndex, turns: MemoryTurns, layer: int, q: torch.Tensor, kc: torch.Tensor, scales, plan,
                  *, scale: float) -> MemorySelection:
    """Choose layer `layer`'s memory blocks for the step (`MemorySelection`). Writes the step's whole blocks'
    means into `index` first. Arguments as `memory_part`'s."""
    bs, k_top = index.block, index.top_k
    N, Hq, T, D = q.shape
    H = kc.shape[1]
    work = work_dtype(q.dtype)
    tables = turns.tables(layer)
    step = plan.extras["recall"]  # made with the plan (`memory_step`)
    means = index.means(layer)

    # The step's whole blocks' means, each turned back to position 0 (compiled: every step, no guard on it).
    if torch.compiler.is_compiling() or step.made:
        keys = read_cells(kc, None if scales is None else scales[0], step.made_flat, work, q.dtype,
                          fused=True)  # [N, H, C * bs, D]
        if tables is not None:
            keys = turns.turn_at(tables[2], keys, -step.made_entries)
        C = keys.shape[2] // bs
        means.index_put_((step.made_rows, step.made_slots), keys.view(N, H, C, bs, -1).mean(dim=3).transpose(1, 2))

    qw = (q.to(work) * scale).view(N, H, Hq // H, T, D)  # scaled: the ranking is the same
    order, live = _choose(step, means, qw, turns, tables, plan.extras["recall_turns"], k_top)
    N, H, k = order.shape
    cells = step.cand_cells.gather(3, order.view(N, H, 1, k, 1).expand(N, H, 2, k, bs))  # [N, H, 2, k, bs]
    return MemorySelection(qw, order, live, cells[:, :, 0].reshape(N, H, k * bs),
                           None if tables is None else cells[:, :, 1].reshape(N, H, k * bs))


def _choose(step: MemoryStep, means: torch.Tensor, qw: torch.Tensor, turns: MemoryTurns, tables, turn_matrices: dict,
            k_top: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(order, live)`, each `[N, H, k]`: the places among the step's candidates of the `k` blocks whose means
    score highest against the row's written queries summed over the step and the KV head's group (a stable
    sort: ties to the lower block), and whether each is a block of the memory."""
    N, H = qw.shape[:2]
    NB = step.cand.shape[1]
    reps = means.view(-1, H, qw.shape[-1]).index_select(0, step.cand_slots.view(-1)).view(N, NB, H, -1)  # at 0
    # The row's written queries (a one-token step's only query is written, or its row reads no memory).
    qsum = (qw if qw.shape[3] == 1 else qw * step.writes).sum(dim=(2, 3))  # [N, H, D]
    if tables is not None:  # q . R(t_mem) m = R(-t_mem) q . m: one matrix per row and step
        turn = turn_matrices.get(tables[2])
        if turn is None:  # a rotation set after the step was planned
            turn = turns.turn_matrices(step.t_mem.neg())[tables[2]]
        qsum = torch.bmm(qsum, turn)
    score = (reps * qsum.unsqueeze(1)).sum(dim=-1).transpose(1, 2).masked_fill(step.invalid, float("-inf"))
    ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
    return order[..., :k_top], ranked[..., :k_top] > float("-inf")  # a score is finite, or not in the memory
