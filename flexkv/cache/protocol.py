"""`StreamCache`: what every flexkv cache offers the front doors above it.

Three caches meet it: `BoundedKVManager` (one retention for every layer),
`GroupedKVManager` (layer groups with retention of their own) and the
uncached twin `flexkv.model.uncached.UncachedHistory` (every key kept, for
checking a port; either retention form). `StreamSession`, `flexkv.model.wrap` and
the engine seam use a cache only through these members, so each of them
serves every retention the core has, and a model written against one cache
runs on the others unchanged.

The members, by what they are for:

============================  ===============================================
step lifecycle                `admit(step)`, `plan(step) -> plan`,
                              `attend(layer, q, k, v, plan, **kw)`,
                              `commit(step)`, `reset_request(id)`,
                              `remove_request(id)`
declarations                  `check_start(id, source, source_len, *,
                              restart=False)`: raises what `admit` would,
                              changes nothing (the one home of those checks)
sources                       `add_source`, `remove_source`, `sources`,
                              `add_private_source`, `remove_private_source`,
                              `private_sources`
views                         `config` (the shape every layer shares),
                              `layer_config(layer)` (the layer's retention and
                              windows), `requests`, `written(id)`,
                              `free_slots`, `memory_bytes`
model side                    `stream_positions(plan, tokens=None)` (`[N, T]`
                              stream index of every own token),
                              `rotation(layer, rotary, mode)` (rotary
                              positions for one layer), `compilable`
============================  ===============================================

A plan is whatever the cache's `plan` returns; callers hand it back to the
same cache's `attend` and `stream_positions` and never look inside.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Protocol, runtime_checkable

import torch

from ..config import BoundedKVConfig
from ..step import BoundedKVStep

__all__ = ["StreamCache", "check_cache", "PROTOCOL_MEMBERS"]

#: Every member a `StreamCache` has (methods and attributes), for `check_cache`'s message.
PROTOCOL_MEMBERS = (
    "config", "compilable", "layer_config", "check_start", "admit", "plan", "attend", "commit", "reset_request",
    "remove_request", "add_source", "remove_source", "sources", "add_private_source", "remove_private_source",
    "private_sources", "requests", "written", "free_slots", "memory_bytes", "stream_positions", "rotation",
)


@runtime_checkable
class StreamCache(Protocol):
    """The cache protocol (module docstring). `isinstance(x, StreamCache)` checks the members exist."""

    config: BoundedKVConfig
    compilable: bool

    def layer_config(self, layer_idx: int) -> BoundedKVConfig: ...

    def check_start(self, request_id: Hashable, source: int = 0, source_len: int = 0, *,
                    restart: bool = False) -> None: ...

    def admit(self, step: BoundedKVStep) -> None: ...

    def plan(self, step: BoundedKVStep) -> Any: ...

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any = None,
               **kwargs) -> torch.Tensor: ...

    def commit(self, step: BoundedKVStep) -> None: ...

    def reset_request(self, request_id: Hashable) -> None: ...

    def remove_request(self, request_id: Hashable) -> None: ...

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int: ...

    def remove_source(self, index: int) -> None: ...

    @property
    def sources(self) -> dict: ...

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int: ...

    def remove_private_source(self, request_id: Hashable) -> None: ...

    @property
    def private_sources(self) -> dict: ...

    @property
    def requests(self) -> tuple: ...

    def written(self, request_id: Hashable) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def memory_bytes(self) -> int: ...

    def stream_positions(self, plan: Any, tokens: Optional[int] = None) -> torch.Tensor: ...

    def rotation(self, layer_idx: int, rotary, mode: str = "stream"): ...


def check_cache(cache, where: str):
    """Return `cache` if it meets `StreamCache`, else raise `ValueError` naming what it lacks."""
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(cache, name)]
    if missing:
        raise ValueError(
            f"{where}: the cache must be a flexkv cache (BoundedKVManager, GroupedKVManager or "
            f"flexkv.model.uncached.UncachedHistory, or anything meeting flexkv.cache.protocol.StreamCache); "
            f"{type(cache).__name__} lacks {', '.join(missing)}"
        )
    return cache
