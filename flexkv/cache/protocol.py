"""`StreamCache`: what every flexkv cache offers the front doors above it.

Two caches meet it: `BoundedKVManager` (one retention for every layer, or
layer groups with retention of their own) and the uncached twin `flexkv.model.uncached.UncachedHistory` (every key kept, for
checking a port; either retention form); `ShardedKVManager` is a
`BoundedKVManager` holding one rank's heads. `StreamSession`,
`flexkv.model.wrap`, the transformers integration and the engine seam use a
cache only through these members, so each of them serves every retention
the core has, and a model written against one cache runs on the others
unchanged.

The class body below is the one statement of the protocol: its members are
grouped by what they are for (the step lifecycle, declarations, sources,
views, fork and roll back, the model side), `PROTOCOL_MEMBERS` is read from it, and
tests/test_protocol.py checks that every cache's public signatures are its
signatures. A step transaction (`flexkv.cache.host.transaction`) drives the
lifecycle: `admit` returns what it changed (`flexkv.cache.host.slots.Admission`)
and `undo_admit` takes that back when the step fails.

A plan is whatever the cache's `plan` returns; callers hand it back to the
same cache's `attend` and `stream_positions` and never look inside. The
cache keeps no current plan: `attend` is given the plan every time (a
model's layers read it from `flexkv.model.step_context.StepContext.plan`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..config import BoundedKVConfig
from ..step import BoundedKVStep, StreamPosition
from .attend_modes import Attended
from .host.slots import Admission
from .paths.joint_path import KeyPart

__all__ = ["StreamCache", "check_cache", "PROTOCOL_MEMBERS", "protocol_members"]


@runtime_checkable
class StreamCache(Protocol):
    """The cache protocol (module docstring). `isinstance(x, StreamCache)` checks the members exist."""

    # ---------------------------------------------------------------- views
    #: the shape every layer shares (heads, slots, sources, dtype)
    config: BoundedKVConfig
    #: whether `attend` traces under `torch.compile(fullgraph=True)`
    compilable: bool

    def layer_config(self, layer_idx: int) -> BoundedKVConfig: ...

    @property
    def requests(self) -> tuple: ...

    def written(self, request_id: Hashable) -> int: ...

    def position(self, request_id: Hashable) -> StreamPosition: ...

    def slot_of(self, request_id: Hashable) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def memory_bytes(self) -> int: ...

    # ---------------------------------------------------------- declarations
    def check_start(self, request_id: Hashable, source: int = 0, source_len: int = 0, *,
                    restart: bool = False) -> None: ...

    # ------------------------------------------------------- step lifecycle
    def admit(self, step: BoundedKVStep) -> Admission: ...

    def undo_admit(self, admission: Admission) -> None: ...

    def plan(self, step: BoundedKVStep) -> Any: ...

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, *,
               scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def attend_lse(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, *,
                   scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
                   sinks: Optional[torch.Tensor] = None) -> Attended: ...

    def attend_query_only(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                          query_only: torch.Tensor, *, scale: Optional[float] = None,
                          score_mod: Optional[Callable] = None, positions: str = "stream",
                          sinks: Optional[torch.Tensor] = None) -> Attended: ...

    def attend_joined(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                      parts: Sequence[KeyPart], *, query_only: Optional[torch.Tensor] = None,
                      scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> Attended: ...

    def commit(self, step: BoundedKVStep) -> None: ...

    def reset_request(self, request_id: Hashable) -> None: ...

    def remove_request(self, request_id: Hashable) -> None: ...

    # ---------------------------------------------------- fork and roll back
    # docs/contract.md section 5, "Fork and roll back"; each `check_*` raises what its operation would.
    def check_fork(self, parent_id: Hashable, child_id: Hashable) -> None: ...

    def fork_request(self, parent_id: Hashable, child_id: Hashable) -> None: ...

    def check_reorder(self, mapping) -> None: ...

    def reorder_requests(self, mapping) -> None: ...

    def check_rollback(self, request_id: Hashable, tokens: int) -> None: ...

    def rollback_limit(self, request_id: Hashable) -> int: ...

    def rollback_request(self, request_id: Hashable, tokens: int) -> None: ...

    # -------------------------------------------------------------- sources
    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int: ...

    def remove_source(self, index: int) -> None: ...

    @property
    def sources(self) -> dict: ...

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int: ...

    def remove_private_source(self, request_id: Hashable) -> None: ...

    @property
    def private_sources(self) -> dict: ...

    # ----------------------------------------------------------- model side
    def stream_positions(self, plan: Any, tokens: Optional[int] = None) -> torch.Tensor: ...

    def rotation(self, layer_idx: int, rotary, mode: str = "stream", *, rotated_inputs: bool = False): ...


def protocol_members(protocol: type = StreamCache) -> tuple:
    """The members a protocol class declares (annotated attributes, then methods and properties), in order."""
    names = list(protocol.__dict__.get("__annotations__", {}))
    names += [n for n in protocol.__dict__ if not n.startswith("_") and n not in names]
    return tuple(names)


#: Every member a `StreamCache` has (methods and attributes), read from the class body.
PROTOCOL_MEMBERS = protocol_members(StreamCache)


def check_cache(cache, where: str):
    """Return `cache` if it meets `StreamCache`, else raise `ValueError` naming what it lacks."""
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(cache, name)]
    if missing:
        raise ValueError(
            f"{where}: the cache must be a flexkv cache (BoundedKVManager or "
            f"flexkv.model.uncached.UncachedHistory, or anything meeting flexkv.cache.protocol.StreamCache); "
            f"{type(cache).__name__} lacks {', '.join(missing)}"
        )
    return cache
