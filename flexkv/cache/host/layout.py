"""Where every entry lives in a layer's KV tensor.

Each layer owns one key and one value tensor of shape `[1, num_heads, S, D]`
(KV batch 1: every query row of a step attends the same tensor). Along `S`
it holds, in order:

1. the sources: `max_sources * rows_per_request` source rows of
   `max_source_len` cells each (source `s`, row `r` at
   `(s * R + r) * max_source_len`);
2. the slot pool: `max_slots * rows_per_request` slot rows, each a sink
   region of `sink_capacity` cells followed by a ring of
   `ring_cells = window_capacity + max(max_step_tokens, max_rollback)` cells.
   The ring has headroom for one step so a step can write its own tokens
   before it attends without evicting anything that step still reads (and,
   with `max_rollback`, so a request can take back that many tokens);
3. a scratch area of `max_step_tokens` cells that padding rows write into
   and nobody reads (none when the config allows no padding segments,
   `BoundedKVConfig.padding_segments=False`);
4. under a `Recall` retention whose steps can take FlexAttention, from the
   next KV block on, one region per slot row (and one for padding rows, when
   steps may pad) of whole KV blocks that a step fills, per layer, with the
   memory entries it reads, turned to their read position
   (`with_recall_region`);
5. padding up to a whole number of KV blocks.

Within a slot row, a written stream entry `j` (`j >= source_len`) lives at
sink cell `j - source_len` if `j < ring_start = max(sink, source_len)`,
else at ring cell `j % ring_len`. All of this is integer arithmetic on the
host; nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ...config import BoundedKVConfig, is_int

__all__ = ["Layout", "DEFAULT_BLOCK_SIZE", "ALIGNED_BLOCK_PADDING", "default_block_size", "scratch_cells", "entry_cell",
           "cpu_kernel_block_exact", "CPU_GEMM_BLOCK_N"]

DEFAULT_BLOCK_SIZE = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


#: Columns of the register block of the micro-GEMM inside inductor's CPU FlexAttention template
#: (`GemmBlocking(1, 16, 1)` in `cpp_flex_attention_template.py`): a KV block is cut into tiles of
#: this many keys, the last one narrower when the block is not a multiple of it.
CPU_GEMM_BLOCK_N = 16
#: Width of the narrow last tile that the compiled CPU kernel gets wrong.
_CPU_BAD_TAIL = 8


def cpu_kernel_block_exact(kv_block_size: int) -> bool:
    """Whether torch's compiled CPU FlexAttention kernel computes exactly with this KV block size.

    Seen on torch 2.13.0 (CPU build, AVX2, fp32): with a KV block size of 8, 24, 40 or 136
    (8 more than a multiple of `CPU_GEMM_BLOCK_N`) the compiled kernel is off by 0.1 to 10 (NaN
    at times) as soon as a query reads more than one block, or a partly masked one, with or
    without a score_mod, for any query length (1 to 16 tested); torch's own `create_block_mask`
    at that block size gives the same wrong result, so the block lists are not at fault. Blocks
    of 4, 12, 16, 20, 32 are exact. The narrow last tile of 8 keys (one AVX2 vector) is the
    common factor. Eager FlexAttention and the rows path are exact at every block size.
    (`TORCH_WORKAROUNDS["CPU_BLOCK_TAIL"]`.)
    """
    return kv_block_size % CPU_GEMM_BLOCK_N != _CPU_BAD_TAIL


#: Most of what a layer tensor holds (1/16) that rounding it up to whole KV blocks may add on the CPU: one
#: whole-slot-row block of padding, or the last partly used block of a smaller block size.
ALIGNED_BLOCK_PADDING = 1 / 16


def scratch_cells(config: BoundedKVConfig) -> int:
    """Cells per layer tensor that padding rows write into: a step's `max_step_tokens`, or none for a
    cache whose steps never pad (`BoundedKVConfig.padding_segments=False`)."""
    return config.max_step_tokens if config.padding_segments else 0


def default_block_size(config: BoundedKVConfig, device_type: str) -> int:
    """The KV block size flexkv picks when none is given.

    CUDA (and `"meta"`, which plans as CUDA does): 128, the block
    FlexAttention's CUDA kernels are tuned for (smaller blocks shrink their
    tiles). On the CPU, without sources, when slot rows are at least 128
    cells: one block per slot row (`sink_capacity + ring_cells` cells), so every slot row is exactly one block and a
    decode row visits one block, none of it outside the row (the CPU kernel
    pays per visited block, and a 1025-cell row in blocks of 128 visits
    1152 cells in 9 blocks; one block per row decodes 20-30% faster, see
    docs/benchmarks.md) - as long as the padding this adds to the layer
    tensor (a block for the `max_step_tokens` scratch cells, none for a cache
    whose steps never pad) stays within `ALIGNED_BLOCK_PADDING` of the slot
    pool. Otherwise, a power of two near
    an eighth of the cells a row keeps (`max_retained + max_step_tokens`),
    between 16 and 128 (also when a slot row's length is a KV block size
    the compiled CPU kernel gets wrong, `cpu_kernel_block_exact`): a row's reads start and end inside a few partly used
    blocks (sinks, window, ring wrap), so the blocks should be small next to
    what a row keeps, but each visited block has a fixed cost, so not tiny; halved (down to 16) while
    rounding the layer tensor up to whole blocks would add more than `ALIGNED_BLOCK_PADDING` of the
    cells it holds (one stream of sink 4 + window 252 decoding a token per step holds 258 cells: 288
    in blocks of 32, 272 in blocks of 16).
    """
    if device_type in ("cuda", "meta"):
        return DEFAULT_BLOCK_SIZE
    row = config.sink_capacity + config.ring_cells
    pool = config.max_slots * config.rows_per_request * row
    scratch = scratch_cells(config)
    has_sources = bool(config.max_source_len and config.max_sources)
    # A row of 8 more than a multiple of 16 cells would be a block the compiled CPU kernel gets wrong.
    # A ring that holds a Recall memory is mostly cells a query does not read: not one block.
    if not has_sources and not config.memory_capacity and row >= DEFAULT_BLOCK_SIZE and _ceil_div(scratch, row) * row - scratch <= \
            ALIGNED_BLOCK_PADDING * pool and cpu_kernel_block_exact(row):
        return row
    cells = (config.max_retained + config.max_step_tokens) // 8
    block = 16
    while block * 2 <= min(cells, DEFAULT_BLOCK_SIZE):
        block *= 2
    held = config.max_sources * config.rows_per_request * config.max_source_len + pool + scratch
    while block > 16 and _ceil_div(held, block) * block - held > ALIGNED_BLOCK_PADDING * held:
        block //= 2
    return block


@dataclass(frozen=True)
class Layout:
    """Physical offsets of a config's sources, slots and scratch cells (plain ints)."""

    rows_per_request: int
    max_sources: int
    max_slots: int
    source_row_len: int
    sink_len: int
    ring_len: int
    step_tokens: int
    block_size: int
    q_block_size: int
    #: Scratch cells padding rows write into: `step_tokens`, or 0 when steps never pad.
    scratch_len: int
    #: Ring cells that hold a `Recall` retention's memory (entries that left the window), 0 without one.
    memory_len: int = 0
    #: A `Recall` step's memory reads through FlexAttention: `recall_rows` regions of `recall_row_len` cells
    #: (whole KV blocks) from `recall_base` on, one per slot row and one for padding rows (when steps may
    #: pad); 0 without them.
    recall_rows: int = 0
    recall_row_len: int = 0

    @classmethod
    def for_config(cls, config: BoundedKVConfig, block_size: Optional[int] = None,
                   device_type: str = "cpu") -> "Layout":
        """The layout of `config`; `block_size=None` takes `default_block_size(config, device_type)`."""
        if block_size is None:
            block_size = default_block_size(config, device_type)
        if not is_int(block_size) or block_size < 1:
            raise ValueError(
                f"block_size must be an int >= 1 (or None to let flexkv choose), got {block_size!r}")
        return cls(
            rows_per_request=config.rows_per_request,
            max_sources=config.max_sources,
            max_slots=config.max_slots,
            source_row_len=config.max_source_len,
            sink_len=config.sink_capacity,
            ring_len=config.ring_cells,
            step_tokens=config.max_step_tokens,
            block_size=block_size,
            q_block_size=DEFAULT_BLOCK_SIZE,
            scratch_len=scratch_cells(config),
            memory_len=config.memory_capacity,
        )

    @property
    def slot_row_len(self) -> int:
        """Cells per slot row: the sink region plus the ring."""
        return self.sink_len + self.ring_len

    @property
    def slots_base(self) -> int:
        return self.max_sources * self.rows_per_request * self.source_row_len

    @property
    def scratch_base(self) -> int:
        """First of the `scratch_len` cells padding rows write into (where they would be, when there are none)."""
        return self.slots_base + self.max_slots * self.rows_per_request * self.slot_row_len

    @property
    def recall_base(self) -> int:
        """First cell of the `Recall` regions: the first KV block after the scratch cells."""
        return _ceil_div(self.scratch_base + self.scratch_len, self.block_size) * self.block_size

    def with_recall_region(self, config: BoundedKVConfig) -> "Layout":
        """This layout with a region per slot row (and one for padding rows, when steps may pad) that holds what
        a `Recall` step reads of its memory: `top_k` blocks and the tail (`block + max_step_tokens` entries at
        most)."""
        recall = config.recall
        cells = (recall.top_k + 1) * recall.block + config.max_step_tokens
        rows = config.max_slots * config.rows_per_request + (1 if config.padding_segments else 0)
        return replace(self, recall_rows=rows, recall_row_len=_ceil_div(cells, self.block_size) * self.block_size)

    @property
    def total_len(self) -> int:
        """`S`: cells per layer tensor, rounded up to whole KV blocks."""
        return self.num_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        if self.recall_rows:
            return (self.recall_base + self.recall_rows * self.recall_row_len) // self.block_size
        return _ceil_div(self.scratch_base + self.scratch_len, self.block_size)

    @property
    def row_blocks(self) -> int:
        """The most KV blocks one row of a step can reach: its source row and its slot row.

        This is the width of a plan's block lists; it follows the retention, not the pool.
        """
        def spanned(first: int, length: int, stride: int) -> int:
            if length == 0:
                return 0
            aligned = first % self.block_size == 0 and stride % self.block_size == 0
            return _ceil_div(length, self.block_size) + (0 if aligned else 1)

        src = spanned(0, self.source_row_len, self.source_row_len) if self.max_sources else 0
        return min(self.num_blocks, src + spanned(self.slots_base, self.slot_row_len, self.slot_row_len))

    def q_blocks(self, tokens: int) -> int:
        """Query blocks for a step of `tokens` tokens."""
        return _ceil_div(tokens, self.q_block_size)

    def source_row(self, source: int, row: int) -> int:
        """First cell of source `source`, row `row`."""
        return (source * self.rows_per_request + row) * self.source_row_len

    def slot_row(self, slot: int, row: int) -> int:
        """First cell of slot `slot`, row `row` (its sink region; the ring follows)."""
        return self.slots_base + (slot * self.rows_per_request + row) * self.slot_row_len

    def slot_cells(self) -> int:
        """Cells one slot holds over all its rows (per layer, for keys or values)."""
        return self.rows_per_request * self.slot_row_len


def entry_cell(row: dict, ring_len: int, j: int) -> Tuple[str, int, int]:
    """Where retained stream entry `j` of a plan row lives: (region, physical cell, cell in region).

    `row` is `BoundedPlan.row(i)`. Regions: `"source"` (entry `j` of the
    source row), `"sink"` (the slot's sink region), `"ring"` (ring cell
    `j % ring_len`), as `Layout` lays a slot row out.
    """
    if j < row["src_len"]:
        return "source", row["src_base"] + j, j
    if j < row["ring_start"]:
        return "sink", row["sink_base"] + j - row["src_len"], j - row["src_len"]
    return "ring", row["ring_base"] + j % ring_len, j % ring_len
