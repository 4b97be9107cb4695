"""flexkv: a bounded key/value cache for streaming attention on FlexAttention.

Every request owns a fixed-size slot that keeps its attention sinks and a
sliding window; shared prefixes (sources) are read where they live; attention
over a step is one FlexAttention call per layer. The contract is
docs/contract.md; README.md shows the ways in.

The package in layers, each importing only its own layer or below:

1. `config`, `step`, `compiling`: what a cache is, what one step says, and
   running under `torch.compile` on the supported torch releases;
2. `flexkv.cache`: the cache itself (layout, planner, masks, attention
   paths, the slot pool, layer groups, the cache protocol);
3. `flexkv.model`: the model side (a cache under a model's attention, a
   ported model's swap, the dense reference and the uncached twin);
4. `flexkv.session`: the step loop;
5. `flexkv.cli` (`flexkv run`, `flexkv show`), `flexkv.serving` (engine
   seams, tensor parallelism) and `flexkv.integrations` (transformers).
"""

import importlib as _importlib
import sys as _sys

from .cache.groups import GroupedKVManager, GroupedPlan, LayerGroup, build_cache, per_layer_groups
from .cache.manager import BoundedKVManager, SlotsExhausted, SourcesExhausted
from .cache.planner import BoundedPlan
from .cache.protocol import StreamCache
from .cache.relative_position import RelativePosition, RelativePositionScores
from .cache.rotary import Rotary
from .compiling import RecompileError, RecompileWarning, warn_if_untested
from .config import BoundedKVConfig, SinkWindow
from .model.port import SwappedAttention, swap_attention
from .model.uncached import UncachedHistory
from .model.wrap import CacheAttention, StepContext
from .serving.engine import BoundedKVResource, BoundedKVSpec, EngineResourceInfo, load_deployment
from .session import Chunk, PerRequest, StepResult, StreamSession
from .step import BoundedKVStep, Segment, StreamPosition

__version__ = "0.1.0"

warn_if_untested()

__all__ = [
    # what a cache keeps
    "BoundedKVConfig",
    "SinkWindow",
    "LayerGroup",
    "per_layer_groups",
    # streaming a model: the step loop, and putting flexkv under its attention
    "StreamSession",
    "Chunk",
    "PerRequest",
    "StepResult",
    "swap_attention",
    "SwappedAttention",
    "StepContext",
    "CacheAttention",
    "Rotary",
    "RelativePosition",
    "RelativePositionScores",
    "UncachedHistory",
    "RecompileError",
    "RecompileWarning",
    # the caches
    "BoundedKVManager",
    "GroupedKVManager",
    "StreamCache",
    "build_cache",
    "SlotsExhausted",
    "SourcesExhausted",
    # one step, as an engine describes it
    "BoundedKVStep",
    "Segment",
    "StreamPosition",
    "BoundedPlan",
    "GroupedPlan",
    # building caches inside a serving engine
    "BoundedKVResource",
    "BoundedKVSpec",
    "EngineResourceInfo",
    "load_deployment",
]

#: Module paths from before the package was laid out in sub-packages; `import flexkv.manager`
#: and `from flexkv.wrap import StepContext` keep working and name the same modules.
MOVED_MODULES = {
    "layout": "cache.layout", "planner": "cache.planner", "masks": "cache.masks",
    "row_attention": "cache.row_attention", "sinks": "cache.sinks", "kernel_options": "cache.kernel_options",
    "kernel_sharing": "cache.kernel_sharing", "rotary": "cache.rotary", "manager": "cache.manager",
    "groups": "cache.groups", "protocol": "cache.protocol",
    "reference": "model.reference", "uncached": "model.uncached", "wrap": "model.wrap", "port": "model.port",
    "workload": "cli.workload", "stream_model": "cli.stream_model", "traffic": "cli.traffic", "show": "cli.show",
    "runner": "cli.runner", "engine": "serving.engine", "distributed": "serving.distributed",
}
for _old, _new in MOVED_MODULES.items():
    _module = _importlib.import_module(f"{__name__}.{_new}")
    _sys.modules[f"{__name__}.{_old}"] = _module
    globals()[_old] = _module
del _old, _new, _module
