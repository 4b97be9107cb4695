"""flexkv: a bounded key/value cache for streaming attention on FlexAttention.

Every request owns a fixed-size slot that keeps its attention sinks and a
sliding window; shared prefixes (sources) are read where they live; attention
over a step is one FlexAttention call per layer.
"""

from .config import BoundedKVConfig, SinkWindow
from .engine import (
    BoundedKVResource,
    BoundedKVSpec,
    EngineResourceInfo,
    NodeResourceSpec,
    Resource,
    ResourceStep,
    apply_deployment,
    load_deployment,
)
from .groups import GroupedKVManager, GroupedPlan, LayerGroup
from .layout import Layout
from .manager import BoundedKVManager, SlotsExhausted, SourcesExhausted
from .planner import BoundedPlan
from .step import BoundedKVStep, Segment, StreamPosition

__version__ = "0.1.0"

__all__ = [
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedKVResource",
    "BoundedKVSpec",
    "BoundedKVStep",
    "BoundedPlan",
    "EngineResourceInfo",
    "GroupedKVManager",
    "GroupedPlan",
    "LayerGroup",
    "Layout",
    "NodeResourceSpec",
    "Resource",
    "ResourceStep",
    "Segment",
    "SinkWindow",
    "SlotsExhausted",
    "SourcesExhausted",
    "StreamPosition",
    "apply_deployment",
    "load_deployment",
]
