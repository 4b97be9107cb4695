"""The cache, one sub-package per role, bottom up: `host` (layout, slot table, planner, lifecycle,
transaction: plain Python), `storage` (the device buffers), `positions` (masks, rotary, relative
positions), `paths` (the attention paths and their choice), `cpu` (the rows path's CPU fast paths);
then the caches over them: `manager` (`BoundedKVManager`), `groups` (`GroupedKVManager`, per-layer
retention) and `protocol` (`StreamCache`, what every cache offers the doors above)."""
