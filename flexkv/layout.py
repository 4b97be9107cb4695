"""Where every entry lives in a layer's KV tensor.

Each layer owns one key and one value tensor of shape `[1, num_heads, S, D]`
(KV batch 1: every query row of a step attends the same tensor). Along `S`
it holds, in order:

1. the sources: `max_sources * rows_per_request` source rows of
   `max_source_len` cells each (source `s`, row `r` at
   `(s * R + r) * max_source_len`);
2. the slot pool: `max_slots * rows_per_request` slot rows, each a sink
   region of `sink_capacity` cells followed by a ring of
   `window_capacity + max_step_tokens` cells. The ring has headroom for one
   step so a step can write its own tokens before it attends without
   evicting anything that step still reads;
3. a scratch area of `max_step_tokens` cells that padding rows write into
   and nobody reads;
4. padding up to a whole number of KV blocks.

Within a slot row, a written stream entry `j` (`j >= source_len`) lives at
sink cell `j - source_len` if `j < ring_start = max(sink, source_len)`,
else at ring cell `j % ring_len`. All of this is integer arithmetic on the
host; nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import BoundedKVConfig

__all__ = ["Layout", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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

    @classmethod
    def for_config(cls, config: BoundedKVConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> "Layout":
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        return cls(
            rows_per_request=config.rows_per_request,
            max_sources=config.max_sources,
            max_slots=config.max_slots,
            source_row_len=config.max_source_len,
            sink_len=config.sink_capacity,
            ring_len=config.window_capacity + config.max_step_tokens,
            step_tokens=config.max_step_tokens,
            block_size=block_size,
            q_block_size=DEFAULT_BLOCK_SIZE,
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
        """First of the `step_tokens` cells padding rows write into."""
        return self.slots_base + self.max_slots * self.rows_per_request * self.slot_row_len

    @property
    def total_len(self) -> int:
        """`S`: cells per layer tensor, rounded up to whole KV blocks."""
        return self.num_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        return _ceil_div(self.scratch_base + self.step_tokens, self.block_size)

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
