"""The lifecycle of a cache's streams, written once over one slot table and the stores of its layer groups.

Every flexkv cache keeps its requests in one `flexkv.cache.host.slots.SlotTable`
and their tokens in one store per layer group: a `BoundedKVManager` in one
`LayerStore` per group (`flexkv.cache.cache_group.CacheGroup`), the uncached
twin (`flexkv.model.uncached.UncachedHistory`) in a whole-history reference
per group. `StreamLifecycle` is the one implementation of the
protocol's lifecycle members over them: each member takes the table's lock,
checks and changes the table, and tells every store what it must do about it
through the hooks of `StoreHooks` (each a no-op unless the store keeps
something the change touches).

| member                                    | the table                            | each store                      |
|-------------------------------------------|--------------------------------------|---------------------------------|
| `check_start`, `check_fork`, `check_reorder`, `check_rollback`, `rollback_limit` | checks (nothing changes) | its `config` (rollback: its ring) |
| `plan`                                    | checks, one read, notes the writes   | `_plan_step` (subclass): a plan |
| `commit`                                  | `written += span`                    | `end_step`, `on_commit`         |
| `reset_request` / `remove_request`        | rewinds / frees the slot             | `on_reset` / `on_remove`        |
| `fork_request` / `reorder_requests`       | a new slot / new positions           | slot copy (`_copy_slots`), `on_fork` / `on_reorder` |
| `rollback_request`                        | `written -= tokens`                  | `on_rollback`                   |
| `add_source` / `add_private_source`       | a source place                       | `write_source` (its share)      |
| `remove_source` / `remove_private_source` | frees the place                      | `on_remove_source` / `on_remove_private` |

A subclass sets `slots` and `_lock` (the table's lock), lists its stores in
`_stores`, and supplies `_plan_step` (the plan of a checked step from one
read of the table), `_source_shares` (each store's share of all-layer
source tensors, checked, and the source's length) and, when its stores keep
per-slot buffers, `_copy_slots` (the device copy a fork or reorder makes).
"""

from __future__ import annotations

from itertools import chain
from typing import Hashable

from ...step import BoundedKVStep, StreamPosition
from .table_views import TableViews

__all__ = ["StoreHooks", "StreamLifecycle"]


class StoreHooks:
    """What a store does when the table changes (every hook a no-op here); `config` is its group's config."""

    def slot_buffers(self):
        """The store's per-slot buffers (`flexkv.cache.storage.slot_copy.SlotBuffer`), copied by a fork or reorder."""
        return ()

    def write_source(self, index: int, keys, values, length: int, request_id=None) -> None:
        """Keep source place `index`'s share `keys`, `values` (`request_id`: a private source's request)."""

    def end_step(self) -> None:
        """The step is over: drop what the store kept for its layers."""

    def on_commit(self, step: BoundedKVStep) -> None: ...

    def on_reset(self, request_id: Hashable) -> None: ...

    def on_remove(self, request_id: Hashable) -> None: ...

    def on_fork(self, parent_id: Hashable, child_id: Hashable) -> None: ...

    def on_reorder(self, mapping: dict) -> None: ...

    def on_rollback(self, request_id: Hashable, written: int) -> None: ...

    def on_remove_source(self, index: int) -> None: ...

    def on_remove_private(self, request_id: Hashable) -> None: ...


class StreamLifecycle(TableViews):
    """The protocol's lifecycle members over `self.slots` and `self._stores` (module docstring), beside the
    table's views and `admit` (`TableViews`)."""

    _stores: tuple = ()

    def _plan_step(self, step: BoundedKVStep, slots: dict, private: dict, eager_only: bool):
        """The plan of a checked step from one read of the table (`slots`, `private`)."""
        raise NotImplementedError(f"{type(self).__name__} must define _plan_step (StreamLifecycle's planning hook)")

    def _source_shares(self, what: str, keys, values):
        """`([(store, keys, values), ...], length)`: each store's checked share of a source."""
        raise NotImplementedError(f"{type(self).__name__} must define _source_shares (StreamLifecycle's source hook)")

    def _store_configs(self) -> tuple:
        return tuple(s.config for s in self._stores)

    def _slot_buffers(self):
        return chain.from_iterable(s.slot_buffers() for s in self._stores)

    def _copy_slots(self, pairs: list) -> None:
        """Copy slot `a` into slot `b` for each `(a, b)` of `pairs` in every per-slot buffer of the stores, every
        source read before any destination is written. A subclass whose stores keep such buffers supplies it
        (the device copy lives with the stores: `flexkv.cache.storage.slot_copy.copy_slots`)."""
        if pairs and any(True for _ in self._slot_buffers()):
            raise NotImplementedError(f"{type(self).__name__} keeps per-slot buffers and must define _copy_slots "
                                      f"(StreamLifecycle's slot-copy hook)")

    # ------------------------------------------------------------------ streams

    def check_start(self, request_id: Hashable, source: int = 0, source_len: int = 0, *,
                    restart: bool = False) -> None:
        """Raise what `admit` would raise for `request_id` starting its stream on this declaration.

        `source`, `source_len` as in `StreamPosition`. With `restart`, the
        request is checked as if `reset_request` had rewound it first (its
        current stream and source binding are ignored). Changes nothing, and
        does not check for a free slot (`free_slots` says that).
        """
        with self._lock:
            self.slots.check_declaration(request_id, StreamPosition(source_len, 0, source), restart)

    def plan(self, step: BoundedKVStep):
        """Plan `step` (every request admitted) on host ints.

        Pure: it reads the slot table, never device data, and planning the
        same step twice gives equal plans.
        """
        return self._planned(step, eager_only=False)

    def plan_eager(self, step: BoundedKVStep):
        """`plan(step)` for a step whose layers run eagerly: an equal plan whose table parts are made when
        first read (cheaper for a one-token step). Not part of the cache protocol: flexkv's doors take it
        where a cache has it (`StepContext.begin(eager_only=True)`, `FlexKVCache` after an eager forward)
        and plan with `plan` otherwise; a plan that enters a compiled graph needs its parts made before
        the graph (`BoundedPlan.make_parts`)."""
        return self._planned(step, eager_only=True)

    def _planned(self, step: BoundedKVStep, eager_only: bool):
        with self._lock:
            self.slots.check_plannable(step)
            slots = self.slots.slots()
            private = self.slots.private_sources
            self.slots.note_writes(step)
        return self._plan_step(step, slots, private, eager_only)

    def commit(self, step: BoundedKVStep) -> None:
        """Record each request's written tokens: `written = position.written + span` (idempotent).

        Every store drops what it kept for the step's layers (`LayerStore.per_plan`: the rows path's
        eager geometry, whose mask bias is as large as the step's queries times the cells a row
        reads): the step is over.
        """
        for s in self._stores:
            s.end_step()
        with self._lock:
            self.slots.commit(step)
            for s in self._stores:
                s.on_commit(step)

    def reset_request(self, request_id: Hashable) -> None:
        """Rewind a request to an empty stream; it keeps its slot and may pick a new source.

        Its private source, if any, stays with it: the restarted stream may read it again
        (`source=-1`), or `remove_private_source` frees it for a new one.
        """
        with self._lock:
            self.slots.reset(request_id)
            for s in self._stores:
                s.on_reset(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        """Free the request's slot (and its private source, if any)."""
        with self._lock:
            self.slots.remove(request_id)
            for s in self._stores:
                s.on_remove(request_id)

    # ---------------------------------------------------- fork and roll back
    # The table changes once; every store copies its own slots, and each group's ring and retention
    # decide what can be taken back.

    def check_fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Raise what `fork_request(parent_id, child_id)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_fork(parent_id, child_id)

    def fork_request(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start request `child_id` as a copy of `parent_id`'s stream (contract section 5, "Fork and
        roll back"): the lowest free slot, a copy of the parent's slot in every layer of every
        group, and its position (`written`, source). Atomic: on any error nothing changes."""
        with self._lock:
            src, dst = self.slots.fork(parent_id, child_id)
            try:
                self._copy_slots([(src, dst)])
            except BaseException:
                self.slots.remove(child_id)
                raise
            for s in self._stores:
                s.on_fork(parent_id, child_id)

    def check_reorder(self, mapping) -> None:
        """Raise what `reorder_requests(mapping)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_reorder(mapping)

    def reorder_requests(self, mapping) -> None:
        """Each destination request continues its source request's stream: `mapping` is
        `{destination: source}` over admitted requests (a beam search's reorder), sources read as
        they were before the call, in one batched copy. Atomic: every source is gathered before
        any destination is written."""
        with self._lock:
            mapping = self.slots.check_reorder(mapping)
            self._copy_slots([(self.slots.slot_of(src), self.slots.slot_of(dst))
                              for dst, src in mapping.items() if dst != src])
            self.slots.reorder(mapping)
            for s in self._stores:
                s.on_reorder(mapping)

    def check_rollback(self, request_id: Hashable, tokens: int) -> None:
        """Raise what `rollback_request(request_id, tokens)` would raise; changes nothing."""
        with self._lock:
            self.slots.check_rollback(request_id, tokens, self._store_configs())

    def rollback_limit(self, request_id: Hashable) -> int:
        """How many of its last written tokens `request_id` can take back now (in every group)."""
        with self._lock:
            self.slots.slot_of(request_id)
            return self.slots.rollback_limit(request_id, self._store_configs())

    def rollback_request(self, request_id: Hashable, tokens: int) -> None:
        """Take back the request's last `tokens` written tokens: `written -= tokens`, exact while every
        group's slot still holds what the shorter stream reads (contract section 5, "Fork and roll
        back"); beyond that it raises `ValueError` and nothing changes. No device work."""
        with self._lock:
            self.slots.rollback(request_id, tokens, self._store_configs())
            written = self.slots.written(request_id)
            for s in self._stores:
                s.on_rollback(request_id, written)

    # ------------------------------------------------------------------ sources

    def add_source(self, keys, values) -> int:
        """Register a read-only prefix shared by requests; returns its index.

        `keys`: `[num_layers, rows_per_request, num_heads, L, head_dim]`, `values`
        the same with `value_head_dim`, `L <= max_source_len`, in the cache's
        dtype and on its device (every layer of every group: each group keeps its share).
        """
        shares, length = self._source_shares("add_source", keys, values)
        with self._lock:
            index = self.slots.next_place()
            for s, k, v in shares:
                s.write_source(index, k, v, length)
            self.slots.add_source(index, length)
            return index

    def add_private_source(self, request_id: Hashable, keys, values) -> int:
        """Give `request_id` a prefix of its own (a per-request prompt): its stream then declares
        `StreamPosition(source_len, written, source=-1)`.

        The entries live in one of the `max_sources` source places, like a shared
        source, reserved for this request; returns that place's index. The
        place is freed when the request is removed (`remove_request`) or by
        `remove_private_source`; `reset_request` keeps it for the restarted
        stream.
        Set it before the request's stream starts: before its first `admit`,
        or after `reset_request`.
        """
        shares, length = self._source_shares("add_private_source", keys, values)
        with self._lock:
            self.slots.check_private(request_id)
            index = self.slots.next_place()
            for s, k, v in shares:
                s.write_source(index, k, v, length, request_id)
            self.slots.add_private_source(request_id, index, length)
            return index

    def remove_private_source(self, request_id: Hashable) -> None:
        """Free `request_id`'s private source (its stream must not be reading it)."""
        with self._lock:
            self.slots.remove_private_source(request_id)
            for s in self._stores:
                s.on_remove_private(request_id)

    def remove_source(self, index: int) -> None:
        """Unregister a source no admitted request reads."""
        with self._lock:
            self.slots.remove_source(index)
            for s in self._stores:
                s.on_remove_source(index)
