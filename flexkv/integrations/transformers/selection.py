"""`Selection`: which stream each batch row of a `FlexKVCache`'s forwards is, and what those streams were fed.

One object per cache (`FlexKVCache.selected`) owns three facts that the
cache, its branching (beams, forks, `crop`), its `generate()` hooks and its
turn bookkeeping all read and change, always through the methods below:

| field     | what it says                                                              | reset by           |
|-----------|---------------------------------------------------------------------------|--------------------|
| `streams` | the stream id of each batch row (None: row `r` is stream `r`)             | `select`, `clear`  |
| `columns` | columns the selected streams took in since `select()` (`get_seq_length()`) | `select`, `clear`  |
| `owed`    | stream id -> the token `generate()` returned last and never fed (`turns`)  | `fed`, `forget`    |

Worked example: `select(["a", "b"])` gives `streams=("a", "b")`, `columns=0`;
a forward of 5 columns `advance(("a", "b"), 5)` -> `columns=5`; assisted
decoding's `crop(-2)` `take_back(2)` -> 3; a forward that fails restores the
`save()`d pair `(("a", "b"), 3)`.
"""

from __future__ import annotations

from typing import Hashable, Optional

__all__ = ["Selection"]


class Selection:
    """The batch rows of a cache's forwards (module docstring's table)."""

    def __init__(self):
        self.streams: Optional[tuple] = None
        self.columns = 0
        self.owed: dict = {}

    def rows(self, batch: int) -> tuple:
        """The stream of each of `batch` rows: the selection, or `0 .. batch - 1` before any."""
        return self.streams if self.streams is not None else tuple(range(batch))

    def select(self, streams: tuple) -> None:
        """Name the streams of the rows; `get_seq_length()` starts again at 0."""
        self.streams, self.columns = streams, 0

    def clear(self) -> None:
        """No selection and no columns (`FlexKVCache.reset`)."""
        self.streams, self.columns = None, 0

    def regroup(self, streams: tuple) -> None:
        """The rows are now `streams` (beams kept or forked); the columns count on."""
        self.streams = streams

    def advance(self, streams: tuple, columns: int) -> None:
        """A forward of `columns` columns over the rows `streams` was planned."""
        self.streams, self.columns = streams, self.columns + columns

    def take_back(self, columns: int) -> None:
        """`columns` fed columns no longer count (taken back by `crop`, or not the caller's)."""
        if not 0 <= columns <= self.columns:
            raise ValueError(f"Selection.take_back({columns}): only {self.columns} columns were fed since select()")
        self.columns -= columns

    def set_columns(self, columns: int) -> None:
        """The selected streams count `columns` columns since `select()` (a prompt prefilled once and forked)."""
        self.columns = columns

    def save(self) -> tuple:
        """`(streams, columns)`, for `restore` when what follows fails."""
        return self.streams, self.columns

    def restore(self, saved: tuple) -> None:
        self.streams, self.columns = saved

    def owe(self, stream_id: Hashable, token: int) -> None:
        """`generate()` returned `token` as `stream_id`'s last and did not feed it."""
        self.owed[stream_id] = int(token)

    def fed(self, stream_id: Hashable) -> None:
        """`stream_id` took in a token: whatever it was owed is in the stream now, or never will be."""
        self.owed.pop(stream_id, None)

    forget = fed  # a finished stream is owed nothing

    def __repr__(self):
        return f"Selection(streams={self.streams!r}, columns={self.columns}, owed={self.owed!r})"
