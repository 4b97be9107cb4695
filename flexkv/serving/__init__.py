"""The seams to a serving engine: declaring and building caches (`engine`), and tensor-parallel
caches that hold one rank's share of the KV heads (`distributed`).

`from flexkv.serving import BoundedKVSpec` loads the engine seam only; `flexkv.serving.distributed`
is imported where it is used."""

from .engine import BoundedKVResource, BoundedKVSpec, EngineResourceInfo, load_deployment

__all__ = ["BoundedKVSpec", "BoundedKVResource", "EngineResourceInfo", "load_deployment"]
