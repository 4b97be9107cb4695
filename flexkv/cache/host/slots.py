"""`SlotTable`: a cache's host bookkeeping, in plain Python.

Which request holds which slot, what each has committed, which source it
started on, which source places are taken (shared, or reserved as a
request's private source): everything a step is checked and planned
against, and nothing on a device. A cache is one table and the device
stores of its layers: `BoundedKVManager` holds one table that every layer
group's store shares, the uncached twin one table beside its dense history.
Every check reads only fields no layer group changes (slots, sources, step
length, padding: a group changes only its retention, windows and head sizes),
so one table serves every group and
there is nothing to keep in step between groups.

The table does not lock itself: every cache that uses it holds `lock`
around its calls (one lock for every store that shares the table). The
planner reads slots and private places from it. All the checks of a step
and of a request's declaration live here (docs/contract.md section 5), so
every front door refuses the same things with the same message.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, NamedTuple, Optional, Tuple

from ...config import BoundedKVConfig, is_int
from ...step import BoundedKVStep, Segment, StreamPosition

__all__ = ["SlotTable", "TableViews", "Admission", "SlotsExhausted", "SourcesExhausted", "rollback_floor"]


class SlotsExhausted(RuntimeError):
    """`admit` needed more free slots than the pool has; nothing was admitted."""


class SourcesExhausted(RuntimeError):
    """`add_source` found every one of `max_sources` places taken."""


@dataclass
class _Request:
    slot: int
    written: int = 0
    source: Optional[int] = None  # bound by the first admit after creation or reset
    source_len: Optional[int] = None
    #: One past the highest stream index a planned step of this stream may have written into its slot
    #: (since the stream started): what a rollback checks the ring against.
    reach: int = 0


def rollback_floor(config: BoundedKVConfig, source_len: int, reach: int) -> int:
    """The fewest written tokens a stream can roll back to exactly, in a cache of `config`.

    Ring cell `j % ring_cells` holds stream entry `j` until entry `j + ring_cells` is written, so
    once entries up to `reach` (exclusive) have been written, the ring holds intact the entries
    from `reach - ring_cells` on. A stream rolled back to `written = m` (length `n = source_len +
    m`) needs its ring entries from `max(ring_start, n - window)` on (every later query reads at
    most `window` entries before itself, and a `Recall` memory the `memory_capacity` entries before
    those; sinks below `ring_start` live in cells of their own), so `m` is exact when that is at
    least `reach - ring_cells`, or when nothing of the ring is needed (`n <= ring_start`, returned
    as 0 when the whole stream lies in the sink region).
    """
    pol = config.retention_for(source_len)
    ring_start = max(pol.sink, source_len)
    intact = reach - config.ring_cells
    if ring_start >= intact:
        return 0
    return max(0, intact + pol.window + config.memory_capacity - source_len)


class Admission(NamedTuple):
    """What one `admit` changed: the requests it gave a slot, and those whose stream it started
    (bound to the declared source). `SlotTable.undo` takes exactly that back."""

    new: Tuple[Hashable, ...] = ()
    started: Tuple[Hashable, ...] = ()


class SlotTable:
    """Slots, requests and source places of one cache (not thread-safe: its users hold `lock`)."""

    def __init__(self, config: BoundedKVConfig):
        self.config = config
        #: Held by every cache and store that uses this table, around each of its calls.
        self.lock = threading.RLock()
        self._requests: dict = {}
        self._free = list(range(config.max_slots))  # kept sorted: the lowest free slot goes first
        self._sources: dict = {}  # place -> registered length (shared and private)
        self._private: dict = {}  # request id -> place of its private source

    # ------------------------------------------------------------------ views

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: Hashable) -> int:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is not admitted; admit(step) a step that carries it first")
        return req.slot

    def written(self, request_id: Hashable) -> int:
        self.slot_of(request_id)
        return self._requests[request_id].written

    def position(self, request_id: Hashable) -> StreamPosition:
        """Where an admitted request's stream stands: its source, source length and written tokens."""
        self.slot_of(request_id)
        req = self._requests[request_id]
        if req.source_len is None:
            raise ValueError(
                f"request {request_id!r} was reset and has not declared its source yet; its next admitted "
                f"step declares it (StreamPosition(source_len, 0, source))"
            )
        return StreamPosition(req.source_len, req.written, req.source)

    @property
    def requests(self) -> tuple:
        return tuple(self._requests)

    @property
    def sources(self) -> dict:
        private = set(self._private.values())
        return {i: n for i, n in self._sources.items() if i not in private}

    @property
    def private_sources(self) -> dict:
        return dict(self._private)

    def slots(self) -> dict:
        """Request id -> slot, for the planner."""
        return {rid: r.slot for rid, r in self._requests.items()}

    def snapshot(self) -> tuple:
        """Everything the table holds, as plain values (equal snapshots: the same state). A stream's
        `reach` is left out: it records what planned steps may have written into the slot, which a
        failed step does too (see `reach`)."""
        return (
            tuple((rid, r.slot, r.written, r.source, r.source_len) for rid, r in self._requests.items()),
            tuple(self._free), tuple(sorted(self._sources.items())), tuple(self._private.items()),
        )

    # ---------------------------------------------------------------- sources

    def next_place(self) -> int:
        """The lowest free source place, or `SourcesExhausted`."""
        c = self.config
        index = next((i for i in range(c.max_sources) if i not in self._sources), None)
        if index is None:
            raise SourcesExhausted(
                f"all max_sources={c.max_sources} source places are taken ({len(self._private)} by private "
                f"sources); remove_source() a shared one, remove a request with a private one, "
                f"or raise max_sources"
            )
        return index

    def add_source(self, index: int, length: int) -> None:
        self._sources[index] = length

    def check_private(self, request_id: Hashable) -> None:
        """Raise unless `request_id` may be given a private source now."""
        if request_id is None:
            raise ValueError("add_private_source: request_id None is reserved for padding segments")
        if request_id in self._private:
            raise ValueError(
                f"add_private_source: request {request_id!r} already has private source "
                f"{self._private[request_id]}; reset_request() or remove_private_source() it first"
            )
        req = self._requests.get(request_id)
        if req is not None and req.source_len is not None:
            raise ValueError(
                f"add_private_source: request {request_id!r} has started its stream (source {req.source}, "
                f"source_len={req.source_len}); reset_request() it first"
            )

    def add_private_source(self, request_id: Hashable, index: int, length: int) -> None:
        self._sources[index] = length
        self._private[request_id] = index

    def remove_private_source(self, request_id: Hashable) -> None:
        if request_id not in self._private:
            raise ValueError(f"remove_private_source: request {request_id!r} has no private source")
        req = self._requests.get(request_id)
        if req is not None and req.source == -1 and req.source_len:
            raise ValueError(
                f"remove_private_source: request {request_id!r} is reading it; reset_request() it "
                f"first, or remove_request() it (which frees the private source too)"
            )
        self._free_private(request_id)

    def _free_private(self, request_id: Hashable) -> None:
        index = self._private.pop(request_id, None)
        if index is not None:
            del self._sources[index]

    def remove_source(self, index: int) -> None:
        owner = next((rid for rid, i in self._private.items() if i == index), None)
        if owner is not None:
            raise ValueError(
                f"remove_source: source {index} is request {owner!r}'s private source; "
                f"remove_private_source({owner!r}) or remove_request({owner!r}) frees it"
            )
        if index not in self._sources:
            raise ValueError(f"remove_source: no source {index!r}; registered: {sorted(self._sources)}")
        users = [rid for rid, r in self._requests.items() if r.source == index and r.source_len]
        if users:
            raise ValueError(
                f"remove_source: source {index} is still read by requests {users}; remove or reset them first"
            )
        del self._sources[index]

    # ----------------------------------------------------------------- checks

    def check_step(self, step: BoundedKVStep) -> int:
        """Shape checks every step operation runs first; returns T."""
        c = self.config
        if not isinstance(step, BoundedKVStep):
            raise ValueError(f"expected a BoundedKVStep, got {type(step).__name__}")
        if not step.segments:
            raise ValueError("a step needs at least one segment (use Segment(None, 0) for padding)")
        T = step.step_tokens
        if not is_int(T) or not 1 <= T <= c.max_step_tokens:
            raise ValueError(
                f"step tokens T={T!r} must be an int in [1, max_step_tokens={c.max_step_tokens}]; "
                f"raise max_step_tokens or split the step"
            )
        seen = set()
        for seg in step.segments:
            if not isinstance(seg, Segment):
                raise ValueError(f"segments must be Segment objects, got {seg!r}")
            if not is_int(seg.span) or seg.span < 0:
                raise ValueError(f"segment {seg.request_id!r}: span must be an int >= 0, got {seg.span!r}")
            if seg.span > c.max_step_tokens:
                raise ValueError(
                    f"segment {seg.request_id!r}: span={seg.span} exceeds max_step_tokens={c.max_step_tokens}"
                )
            if seg.span > T:
                raise ValueError(
                    f"segment {seg.request_id!r}: span={seg.span} exceeds the step's T={T}; "
                    f"set BoundedKVStep(tokens=...) to at least the largest span"
                )
            rid = seg.request_id
            if rid is None:
                if not c.padding_segments:
                    raise ValueError(
                        "a padding segment (request id None) in a step of a cache built with padding_segments=False "
                        "(it holds no scratch cells for padding rows to write into); give every row a request, or "
                        "build the cache with padding_segments=True"
                    )
                continue
            if rid in seen:
                raise ValueError(f"request {rid!r} appears twice in one step; give each request one segment")
            seen.add(rid)
            pos = step.positions.get(rid)
            if not isinstance(pos, StreamPosition):
                raise ValueError(
                    f"request {rid!r} has no StreamPosition in step.positions (got {pos!r}); "
                    f"every non-padding segment needs one"
                )
        return T

    def check_plannable(self, step: BoundedKVStep) -> int:
        """The checks of `plan(step)`: the step's shape, and every request admitted; returns T."""
        T = self.check_step(step)
        self.check_admitted(step, "request {rid} is not admitted; call admit(step) before plan(step)")
        return T

    def check_admitted(self, step: BoundedKVStep, message: str) -> None:
        """Raise unless every request of `step` holds a slot; `message` names it as `{rid}`."""
        for seg in step.segments:
            if seg.request_id is not None and seg.request_id not in self._requests:
                raise ValueError(message.format(rid=repr(seg.request_id)))

    def check_declaration(self, rid: Hashable, pos: StreamPosition, restart: bool = False) -> None:
        """Every check of one request's declaration; changes nothing.

        `admit` runs them for every request of a step, and `check_start` for a
        request about to start (or, with `restart`, restart) its stream.
        """
        if rid is None:
            raise ValueError("request id None is reserved for padding segments; use any other hashable id")
        c = self.config
        L, w, src = pos.source_len, pos.written, pos.source
        if not is_int(src) or src < -1:
            raise ValueError(
                f"request {rid!r}: source must be a registered source index >= 0, or -1 for the "
                f"request's private source, got {src!r}"
            )
        for name, val in (("source_len", L), ("written", w)):
            if not is_int(val) or val < 0:
                raise ValueError(f"request {rid!r}: {name} must be an int >= 0, got {val!r}")
        if not c.min_source_len <= L <= c.max_source_len:
            raise ValueError(
                f"request {rid!r}: source_len={L} is outside [min_source_len={c.min_source_len}, "
                f"max_source_len={c.max_source_len}]"
                + ("; start it on a registered source" if L < c.min_source_len else "")
            )
        if L > 0 and src == -1:
            if rid not in self._private:
                raise ValueError(
                    f"request {rid!r}: source=-1 declares a private source, but none was added; "
                    f"add_private_source({rid!r}, keys, values) first"
                )
            if L > self._sources[self._private[rid]]:
                raise ValueError(
                    f"request {rid!r}: source_len={L} is longer than its private source "
                    f"({self._sources[self._private[rid]]} entries)"
                )
        elif L > 0:
            owner = next((o for o, i in self._private.items() if i == src), None)
            if owner is not None:
                raise ValueError(
                    f"request {rid!r}: source {src} is request {owner!r}'s private source; "
                    f"declare a shared source, or source=-1 with a private source of its own"
                )
            if src not in self._sources:
                raise ValueError(
                    f"request {rid!r}: unknown source {src}; registered sources: {sorted(self._sources)} "
                    f"(add_source() it first)"
                )
            if L > self._sources[src]:
                raise ValueError(
                    f"request {rid!r}: source_len={L} is longer than source {src} "
                    f"({self._sources[src]} entries)"
                )
        req = self._requests.get(rid)
        committed = 0 if req is None or restart else req.written
        if w != committed:
            raise ValueError(
                f"request {rid!r}: written={w} but {committed} tokens are committed; "
                f"positions must follow commit()"
            )
        if not restart and req is not None and req.source_len is not None and (
            L != req.source_len or (L > 0 and src != req.source)
        ):
            raise ValueError(
                f"request {rid!r}: stream started with source {req.source} (source_len={req.source_len}) "
                f"but this step declares source {src} (source_len={L}); reset_request() to change it"
            )

    # -------------------------------------------------------------- lifecycle

    def admit(self, step: BoundedKVStep) -> Admission:
        """Check `step` and every declaration, then give each new request the lowest free slot (atomic);
        returns what changed."""
        c = self.config
        self.check_step(step)
        new = []
        for seg in step.segments:
            rid = seg.request_id
            if rid is None:
                continue
            self.check_declaration(rid, step.positions[rid])
            if rid not in self._requests:
                new.append(rid)
        if len(new) > len(self._free):
            raise SlotsExhausted(
                f"step needs {len(new)} new slot(s) but only {len(self._free)} of max_slots={c.max_slots} "
                f"are free; remove_request() finished requests or raise max_slots"
            )
        for rid in new:
            self._requests[rid] = _Request(slot=self._free.pop(0))
        started = []
        for seg in step.segments:
            if seg.request_id is not None:
                req = self._requests[seg.request_id]
                if req.source_len is None:
                    pos = step.positions[seg.request_id]
                    req.source, req.source_len = pos.source, pos.source_len
                    started.append(seg.request_id)
        return Admission(tuple(new), tuple(started))

    def undo(self, admission: Admission) -> None:
        """Take back what one `admit` did (the step that admitted failed): its new requests leave
        (their slots go back to the pool), and the streams it started are unbound again. Requests
        removed since are skipped."""
        for rid in admission.new:
            req = self._requests.pop(rid, None)
            if req is not None:
                self._free.append(req.slot)
        self._free.sort()
        for rid in admission.started:
            req = self._requests.get(rid)
            if req is not None and rid not in admission.new:
                req.written, req.source, req.source_len, req.reach = 0, None, None, 0

    def commit(self, step: BoundedKVStep) -> None:
        """`written = position.written + span` for each request of `step` (idempotent)."""
        self.check_step(step)
        self.check_admitted(step, "commit: request {rid} is not admitted")
        for seg in step.segments:
            if seg.request_id is not None:
                self._requests[seg.request_id].written = step.positions[seg.request_id].written + seg.span

    def reset(self, request_id: Hashable) -> None:
        """Rewind a request to an empty stream; it keeps its slot (and its private source)."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"reset_request: request {request_id!r} is not admitted")
        req.written, req.source, req.source_len, req.reach = 0, None, None, 0

    def reach(self, request_id: Hashable) -> int:
        """One past the highest stream index a planned step of the request may have written into its
        slot since its stream started: a step that failed after planning counts too, since its
        tokens may be in the ring (what a later rollback checks against)."""
        self.slot_of(request_id)
        return self._requests[request_id].reach

    def note_writes(self, step: BoundedKVStep) -> None:
        """Record that `step` (planned now) may write its `T` own tokens into its requests' slots."""
        T = step.step_tokens
        for seg in step.segments:
            if seg.request_id is not None:
                req = self._requests[seg.request_id]
                req.reach = max(req.reach, step.positions[seg.request_id].length + T)

    # ------------------------------------------------------ fork and roll back

    def rollback_limit(self, request_id: Hashable, configs=None) -> int:
        """How many of its last written tokens `request_id` can take back now, exactly, in a cache whose
        layer groups have `configs` (default: the table's own config)."""
        req = self._requests[request_id]
        if not req.written:
            return 0
        floor = max(rollback_floor(c, req.source_len, req.reach) for c in (configs or (self.config,)))
        return req.written - min(req.written, floor)

    def check_rollback(self, request_id: Hashable, tokens: int, configs=None, what: str = "rollback_request") -> None:
        """Raise unless `request_id` can take back its last `tokens` written tokens exactly in every layer
        group (`configs`, default the table's config: each group's ring and retention decide); changes nothing."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"{what}: request {request_id!r} is not admitted")
        if not is_int(tokens) or tokens < 0:
            raise ValueError(f"{what}: tokens must be an int >= 0 (how many written tokens to take back), got {tokens!r}")
        if tokens > req.written:
            raise ValueError(
                f"{what}: request {request_id!r} has written {req.written} tokens, so it cannot take back {tokens}"
            )
        if tokens == 0:
            return
        m = req.written - tokens
        for c in configs or (self.config,):
            pol = c.retention_for(req.source_len)
            in_sinks = req.source_len + m <= max(pol.sink, req.source_len)
            if not in_sinks and m < rollback_floor(c, req.source_len, req.reach):
                raise ValueError(
                    f"{what}: request {request_id!r} cannot take back {tokens} tokens: its slot's ring "
                    f"({c.ring_cells} cells: window {c.window_capacity} + max(max_step_tokens={c.max_step_tokens}, "
                    f"max_rollback={c.max_rollback})) has overwritten entries the stream would read again; at most "
                    f"{self.rollback_limit(request_id, configs)} can be taken back now. Build the cache with "
                    f"BoundedKVConfig(max_rollback=...) at least the tokens a step writes plus those taken back after it"
                )

    def rollback(self, request_id: Hashable, tokens: int, configs=None) -> None:
        """`written -= tokens`, checked first (`check_rollback`); the slot's cells stay as they are."""
        self.check_rollback(request_id, tokens, configs)
        self._requests[request_id].written -= tokens

    def _check_copyable(self, parent: Hashable, what: str) -> _Request:
        req = self._requests.get(parent)
        if req is None:
            raise ValueError(f"{what}: request {parent!r} is not admitted")
        if req.source == -1 and req.source_len:
            raise ValueError(
                f"{what}: request {parent!r} reads its private source (source=-1, source_len={req.source_len}), "
                f"which belongs to it alone; register the prefix with add_source() and start the stream on it "
                f"to share it with copies"
            )
        return req

    def check_fork(self, parent: Hashable, child: Hashable) -> None:
        """Raise unless `child` can start as a copy of `parent`'s stream now; changes nothing."""
        self._check_copyable(parent, "fork_request")
        if child is None:
            raise ValueError("fork_request: request id None is reserved for padding segments")
        try:
            hash(child)
        except TypeError:
            raise ValueError(f"fork_request: request ids must be hashable, got {child!r}") from None
        if child in self._requests:
            raise ValueError(f"fork_request: request {child!r} already holds a slot; remove_request() it first")
        if child in self._private:
            raise ValueError(
                f"fork_request: request {child!r} has a private source of its own; a fork continues its parent's "
                f"stream (and source): remove_private_source({child!r}) first"
            )
        if not self._free:
            raise SlotsExhausted(
                f"fork_request: no free slot for {child!r} (max_slots={self.config.max_slots}); remove_request() "
                f"finished requests or raise max_slots"
            )

    def fork(self, parent: Hashable, child: Hashable) -> tuple:
        """Give `child` the lowest free slot and `parent`'s table entry; returns `(parent slot, child slot)`."""
        self.check_fork(parent, child)
        p = self._requests[parent]
        self._requests[child] = _Request(self._free.pop(0), p.written, p.source, p.source_len, p.reach)
        return p.slot, self._requests[child].slot

    def check_reorder(self, mapping) -> dict:
        """`mapping` (`{destination: source request}`) checked; returns it as a dict. Changes nothing."""
        try:
            mapping = dict(mapping)
        except (TypeError, ValueError):
            raise ValueError(
                f"reorder_requests: mapping must be a dict (or pairs) of destination request -> source request, "
                f"got {mapping!r}"
            ) from None
        for dst, src in mapping.items():
            if dst not in self._requests:
                raise ValueError(f"reorder_requests: destination request {dst!r} is not admitted")
            if dst != src:
                self._check_copyable(src, "reorder_requests")
                if dst in self._private:
                    raise ValueError(
                        f"reorder_requests: destination request {dst!r} has a private source; it would continue "
                        f"{src!r}'s stream on another source: remove_private_source({dst!r}) first"
                    )
        return mapping

    def reorder(self, mapping) -> list:
        """Every destination takes its source's table entry as it was before the call (so sources
        and destinations may overlap); returns the `(source slot, destination slot)` pairs to copy."""
        mapping = self.check_reorder(mapping)
        before = {rid: (r.slot, r.written, r.source, r.source_len, r.reach) for rid, r in self._requests.items()}
        pairs = []
        for dst, src in mapping.items():
            if dst == src:
                continue
            slot, written, source, source_len, reach = before[src]
            req = self._requests[dst]
            req.written, req.source, req.source_len, req.reach = written, source, source_len, reach
            pairs.append((slot, req.slot))
        return pairs

    def remove(self, request_id: Hashable) -> None:
        """Free the request's slot and its private source."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"remove_request: request {request_id!r} is not admitted")
        self._free_private(request_id)
        self._free.append(req.slot)
        self._free.sort()



from .table_views import TableViews  # noqa: E402  (its home since slots.py passed 600 lines; importable here too)
