"""The seams between flexkv and a serving engine.

An engine declares the caches its model needs as `NodeResourceSpec`s, builds
each one with `Resource.build(spec, info)` once it knows the device and KV
dtype (`EngineResourceInfo`), and hands every model step its `BoundedKVStep`.
A deployment's YAML file can retune the declared specs per `resource_key`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from ..config import BoundedKVConfig, check_config

__all__ = [
    "EngineResourceInfo",
    "NodeResourceSpec",
    "Resource",
    "BoundedKVSpec",
    "BoundedKVResource",
    "apply_deployment",
    "load_deployment",
]


@dataclass(frozen=True)
class EngineResourceInfo:
    """What the engine knows when it builds resources: where they live, the KV dtype, and
    which share of the attention heads this process holds.

    For tensor-parallel attention give `process_group` (the group the heads
    are split over; this process's rank and the group's size are read from
    it), or `rank` and `world_size` directly. Leaving all three unset means
    one process holding every head.
    """

    device: torch.device | str
    kv_dtype: torch.dtype = torch.float32
    process_group: Any = None
    rank: Optional[int] = None
    world_size: Optional[int] = None

    @property
    def tensor_parallel(self) -> bool:
        """Whether any of `process_group`, `rank`, `world_size` was given."""
        return self.process_group is not None or self.rank is not None or self.world_size is not None


@dataclass(frozen=True)
class NodeResourceSpec:
    """A resource declared by a model: its key and the graph nodes that use it."""

    resource_key: str
    nodes: tuple = ()

    def __post_init__(self):
        if not isinstance(self.resource_key, str) or not self.resource_key:
            raise ValueError(f"resource_key must be a non-empty str, got {self.resource_key!r}")
        object.__setattr__(self, "nodes", tuple(self.nodes))

    def apply_yaml_overrides(self, **overrides) -> "NodeResourceSpec":
        if overrides:
            unknown = ", ".join(sorted(overrides))
            raise ValueError(f"resource {self.resource_key!r} accepts no YAML overrides, got: {unknown}")
        return self


class Resource:
    """Builds the runtime object for a spec once the engine's device and dtype are known."""

    def build(self, spec: NodeResourceSpec, info: EngineResourceInfo):  # pragma: no cover - interface
        raise TypeError(f"{type(self).__name__} does not implement build()")


@dataclass(frozen=True)
class BoundedKVSpec(NodeResourceSpec):
    """Declares one bounded KV cache to an engine.

    `groups`: layer groups that keep retention of their own (`LayerGroup`s,
    or one `SinkWindow` per layer), as `BoundedKVManager(groups=...)` takes them.
    """

    config: Optional[BoundedKVConfig] = None
    groups: Optional[tuple] = None

    def __post_init__(self):
        super().__post_init__()
        check_config(self.config, "BoundedKVSpec.config")
        if self.groups is not None:
            from ..cache.groups import as_layer_groups

            object.__setattr__(self, "groups", as_layer_groups(self.config, self.groups))

    def apply_yaml_overrides(self, max_slots: Any = None, **unknown) -> "BoundedKVSpec":
        """Return a copy retuned by a deployment's YAML block.

        Only `max_slots` may be set; any other key is an error naming it, so a
        typo in a deployment file never passes silently.
        """
        if unknown:
            names = ", ".join(repr(k) for k in sorted(unknown))
            raise ValueError(
                f"unknown key(s) {names} in the YAML block for resource {self.resource_key!r}; "
                f"allowed: 'max_slots'"
            )
        if max_slots is None:
            return self
        return dataclasses.replace(self, config=self.config.replace(max_slots=max_slots))


class BoundedKVResource(Resource):
    """Builds the cache a `BoundedKVSpec` declares, settling `dtype=None` from the engine.

    The result is a `BoundedKVManager` with the spec's `groups` (None: one group of every layer).
    When `info` names a tensor-parallel share (see `EngineResourceInfo`), it is a
    `flexkv.serving.distributed.ShardedKVManager` holding this rank's KV heads of every group.
    """

    def build(self, spec: BoundedKVSpec, info: EngineResourceInfo):
        from ..cache.manager import BoundedKVManager

        if not isinstance(spec, BoundedKVSpec):
            raise ValueError(f"BoundedKVResource.build needs a BoundedKVSpec, got {type(spec).__name__}")
        config = spec.config
        if config.dtype is None:
            config = config.replace(dtype=info.kv_dtype)
        if info.tensor_parallel:
            from .distributed import ShardedKVManager

            return ShardedKVManager(config, info.device, groups=spec.groups, process_group=info.process_group,
                                    rank=info.rank, world_size=info.world_size)
        return BoundedKVManager(config, info.device, groups=spec.groups)


def apply_deployment(specs: Sequence[NodeResourceSpec], blocks: Mapping[str, Any]) -> list:
    """Apply per-resource override blocks (keyed by `resource_key`) to `specs`.

    `blocks` is the parsed deployment mapping: `{resource_key: {field: value}}`.
    A key naming no declared resource, or a block that is not a mapping, is an
    error; specs without a block are returned unchanged.
    """
    if blocks is None:
        return list(specs)
    if not isinstance(blocks, Mapping):
        raise ValueError(f"a deployment must be a mapping of resource_key -> overrides, got {type(blocks).__name__}")
    by_key = {s.resource_key: s for s in specs}
    for key in blocks:
        if key not in by_key:
            known = ", ".join(repr(k) for k in by_key) or "none"
            raise ValueError(f"deployment names unknown resource {key!r}; declared resources: {known}")
    out = []
    for spec in specs:
        block = blocks.get(spec.resource_key)
        if block is None:
            out.append(spec)
            continue
        if not isinstance(block, Mapping):
            raise ValueError(
                f"the deployment block for resource {spec.resource_key!r} must be a mapping, got {block!r}"
            )
        out.append(spec.apply_yaml_overrides(**dict(block)))
    return out


def load_deployment(source, specs: Iterable[NodeResourceSpec]) -> list:
    """Read a deployment YAML (a path or a YAML string) and apply its `resources:` blocks.

    The file holds a top-level `resources:` mapping keyed by `resource_key`.
    """
    import os

    import yaml

    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and os.path.exists(source)):
        with open(source) as fh:
            text = fh.read()
    else:
        text = source
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"deployment is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"a deployment file must be a mapping with a 'resources:' key, got {type(data).__name__}")
    unknown = set(data) - {"resources"}
    if unknown:
        raise ValueError(f"unknown top-level key(s) {sorted(unknown)} in deployment; allowed: 'resources'")
    return apply_deployment(list(specs), data.get("resources") or {})
