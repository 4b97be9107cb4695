"""What one model step tells the cache: which requests, where they stand, how much they write.

This is the bottom of flexkv's import graph: it imports nothing from the
package, so every other module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, NamedTuple, Optional, Tuple

__all__ = ["StreamPosition", "Segment", "BoundedKVStep"]


class StreamPosition(NamedTuple):
    """Where a request stands when a step starts.

    The stream holds `source_len` entries of registered source `source` (or,
    with `source=-1`, of the request's own private source, see
    `BoundedKVManager.add_private_source`), then `written` tokens the request
    wrote; the step's first token sits at stream index `source_len + written`. A plain named tuple
    (`source_len, written, source = pos`, `pos._replace(written=...)`);
    `BoundedKVManager.admit` checks the values and names the request when one
    is wrong.
    """

    source_len: int
    written: int
    source: int = 0

    @property
    def length(self) -> int:
        """Stream length `n` before the step."""
        return self.source_len + self.written


@dataclass(frozen=True)
class Segment:
    """One request's share of a step: `rows_per_request` rows that write `span` tokens.

    `request_id=None` marks a padding segment: its rows read and write nothing
    and return zeros, so a batch can keep a fixed shape.
    """

    request_id: Optional[Hashable]
    span: int


@dataclass(frozen=True)
class BoundedKVStep:
    """One step of a batch: its segments and the position of every request in it.

    `tokens` is the step's `T` (tokens per row in `q, k, v`); it defaults to
    the largest span (at least 1). Give it explicitly when the step carries
    look-ahead tokens past every span, e.g. a last chunk with `span=0`.
    """

    segments: Tuple[Segment, ...]
    positions: Mapping[Hashable, StreamPosition] = field(default_factory=dict)
    tokens: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(self.segments))

    @property
    def step_tokens(self) -> int:
        """The step's `T`: `tokens` if given, else max(1, largest span)."""
        if self.tokens is not None:
            return self.tokens
        spans = [s.span for s in self.segments if isinstance(s.span, int)]
        return max([1] + spans)
