"""The cache, one sub-package per role, bottom up: `host` (layout, slot table, planner, lifecycle,
transaction: plain Python), `storage` (the device buffers), `positions` (masks, rotary, relative
positions), `paths` (the attention paths and their choice), `cpu` (the rows path's CPU fast paths);
then the cache over them: `groups` (layer groups: which layers keep what), `cache_group` (one group's
layout, store and paths), `manager` (`BoundedKVManager`: one table, the lifecycle, a `CacheGroup` per
group) and `protocol` (`StreamCache`, what every cache offers the doors above)."""
