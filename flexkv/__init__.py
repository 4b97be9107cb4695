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

`import flexkv` loads this module and `compiling` only; each name of
`__all__` imports its module the first time it is used.
"""

import importlib as _importlib

from .compiling import warn_if_untested as _warn_if_untested

__version__ = "0.1.0"

#: What a user writes, grouped as it is used, each with the module that defines it. `import flexkv`
#: loads none of them (and so neither the CLI nor the serving seams): `flexkv.StreamSession` and
#: `from flexkv import StreamSession` import the session and what it needs the first time.
_PUBLIC = {
    # what a cache keeps
    "BoundedKVConfig": "config",
    "SinkWindow": "config",
    "Recall": "config",
    "LayerGroup": "cache.groups",
    "per_layer_groups": "cache.groups",
    # streaming a model: the step loop, and putting flexkv under its attention
    "StreamSession": "session",
    "Chunk": "session",
    "PerRequest": "session",
    "Stages": "session",
    "MultiCacheSession": "session",
    "swap_attention": "model.port",
    "StepContext": "model.step_context",
    "MultiStepContext": "model.multi_context",
    "CacheAttention": "model.wrap",
    "Rotary": "cache.positions.rotary",
    "RelativePosition": "cache.positions.relative_position",
    "RelativePositionScores": "cache.positions.relative_position",
    "UncachedHistory": "model.uncached",
    "merge_attention": "cache.paths.merge",
    "KeyPart": "cache.paths.joint_path",
    "Attended": "cache.attend_modes",
    "RecompileError": "compiling",
    "RecompileWarning": "compiling",
    # the caches
    "BoundedKVManager": "cache.manager",
    "StreamCache": "cache.protocol",
    "SlotsExhausted": "cache.host.slots",
    "SourcesExhausted": "cache.host.slots",
    # one step, as a caller describes it to a cache
    "BoundedKVStep": "step",
    "Segment": "step",
    "StreamPosition": "step",
}

__all__ = list(_PUBLIC)

#: The sub-packages, imported on first use as attributes too (`flexkv.serving.BoundedKVSpec`).
_SUBPACKAGES = ("config", "step", "compiling", "cache", "model", "session", "cli", "serving", "integrations")


#: Names of caches that are now `BoundedKVManager` itself, and how to build what they built.
_BUILT_AS = {
    "GroupedKVManager": "BoundedKVManager(config, device, groups=groups)",
    "build_cache": "BoundedKVManager(config, device, groups=groups)",
}


def __getattr__(name: str):
    if name in _BUILT_AS:
        raise AttributeError(f"flexkv.{name} is gone: every bounded cache is one class, build it as "
                             f"flexkv.{_BUILT_AS[name]}")
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


_warn_if_untested()
