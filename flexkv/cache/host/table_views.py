"""`TableViews`: what every cache answers from its one slot table alone.

The bounded cache (`BoundedKVManager`) and the uncached twin
(`UncachedHistory`) each keep their host bookkeeping in one
`flexkv.cache.host.slots.SlotTable` under one lock. The protocol members that only
read that table (requests, slots, positions, sources) or admit a step into it
are the same for both, and live here once.
"""

from __future__ import annotations

from typing import Hashable

from ...step import BoundedKVStep, StreamPosition

__all__ = ["TableViews"]


class TableViews:
    """The protocol members every cache answers from its one `SlotTable` alone (`self.slots`, under
    its lock `self._lock`): the views of requests and sources, and admitting a step. A bounded, a
    grouped and the uncached cache all hold their bookkeeping in one table, so they share these."""

    #: The cache's one `flexkv.cache.host.slots.SlotTable` (not imported here: the table's module
    #: re-exports this class).
    slots: object

    @property
    def requests(self) -> tuple:
        """Admitted request ids, in admission order."""
        with self._lock:
            return self.slots.requests

    @property
    def free_slots(self) -> int:
        """How many slots are free."""
        with self._lock:
            return self.slots.free_slots

    def slot_of(self, request_id: Hashable) -> int:
        """The slot an admitted request holds (the same slot index in every layer group)."""
        with self._lock:
            return self.slots.slot_of(request_id)

    def written(self, request_id: Hashable) -> int:
        """Tokens the request has committed to its stream."""
        with self._lock:
            return self.slots.written(request_id)

    def position(self, request_id: Hashable) -> StreamPosition:
        """Where an admitted request's stream stands (`StreamPosition(source_len, written, source)`):
        the one record of it, which a step's `positions` must repeat."""
        with self._lock:
            return self.slots.position(request_id)

    @property
    def sources(self) -> dict:
        """Registered shared sources: index -> length (private sources: `private_sources`)."""
        with self._lock:
            return self.slots.sources

    @property
    def private_sources(self) -> dict:
        """Private sources: request id -> source place index."""
        with self._lock:
            return self.slots.private_sources

    def admit(self, step: BoundedKVStep) -> tuple:
        """Give each new request of `step` a free slot and check every declaration; returns what
        changed (`flexkv.cache.host.slots.Admission`, for `undo_admit`). Atomic: on any error nothing changes. A full pool
        raises `SlotsExhausted`; a bad declaration raises `ValueError`."""
        with self._lock:
            return self.slots.admit(step)

    def undo_admit(self, admission: tuple) -> None:
        """Take back one `admit` whose step failed: its new requests leave, the streams it started
        are unbound (private sources stay). A step transaction's abort calls it."""
        with self._lock:
            self.slots.undo(admission)
