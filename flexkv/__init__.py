"""flexkv: a bounded key/value cache for streaming attention on FlexAttention.

Every request owns a fixed-size slot that keeps its attention sinks and a
sliding window; shared prefixes (sources) are read where they live; attention
over a step is one FlexAttention call per layer.

Start with `StreamSession` (the step loop: positions, lanes, padding,
compile); under it, `BoundedKVManager` is the cache with the engine-facing
`admit -> plan -> attend -> commit` step. The contract both implement is
docs/contract.md.
"""

from .compiling import warn_if_untested
from .config import BoundedKVConfig, SinkWindow
from .engine import (
    BoundedKVResource,
    BoundedKVSpec,
    EngineResourceInfo,
    NodeResourceSpec,
    Resource,
    apply_deployment,
    load_deployment,
)
from .groups import GroupedKVManager, GroupedPlan, LayerGroup
from .layout import Layout  # noqa: F401  (importable for inspection; not part of the public API)
from .manager import BoundedKVManager, SlotsExhausted, SourcesExhausted
from .planner import BoundedPlan
from .port import SwappedAttention, swap_attention
from .session import Chunk, StepResult, StreamSession
from .step import BoundedKVStep, ResourceStep, Segment, StreamPosition

__version__ = "0.1.0"

warn_if_untested()

__all__ = [
    # the step loop
    "StreamSession",
    "Chunk",
    "StepResult",
    # putting flexkv under an existing model's attention
    "swap_attention",
    "SwappedAttention",
    # the cache and its configuration
    "BoundedKVConfig",
    "SinkWindow",
    "BoundedKVManager",
    "SlotsExhausted",
    "SourcesExhausted",
    # one step, as an engine describes it
    "BoundedKVStep",
    "Segment",
    "StreamPosition",
    "BoundedPlan",
    # the seams to a serving engine
    "BoundedKVResource",
    "BoundedKVSpec",
    "EngineResourceInfo",
    "GroupedKVManager",
    "GroupedPlan",
    "LayerGroup",
    "NodeResourceSpec",
    "Resource",
    "ResourceStep",
    "apply_deployment",
    "load_deployment",
]
