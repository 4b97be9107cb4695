"""What `enable(model)` installs: forward hooks that plan and commit, a guard around `generate()`, and
the mask builder `generate()` calls for a compileable cache (with a FlexKVCache: the 2-D padding mask).

A forward that carries a flexkv cache (`cache=` or `past_key_values=`) is
planned by the pre-hook (`cache.prepare`), runs with the model's attention
switched to `"flexkv"`, and is committed by the forward hook when it
returns, or rolled back when it raises. torch runs a forward hook on the
way out of an `Exception` only, so a `KeyboardInterrupt` (or any other
`BaseException`) in a layer skips it: the forward stays pending and the
model stays switched. The next forward through the model's hooks, with the
cache or without, rolls such a forward back before it runs, and `generate()`
does so at once on its way out. The guard around `generate()` also refuses
decoding modes flexkv does not serve before anything happens, and runs the
others through `branching.generate_branching` (prompts that `generate()`
repeats are prefilled once and forked; a failed call leaves the streams as
they were).
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers.masking_utils import create_masks_for_generate

from .branching import generate_branching
from .chunked_forward import chunked_call, join_outputs
from .model_config import text_config
from .plan import FlexKVForward, compiled_forward
from .registration import ATTN_IMPLEMENTATION, register
from .shim import CacheShim
from .turns import check_continuation, record_owed_tokens, strip_first_column, with_owed_tokens

__all__ = ["enable", "disable", "switch", "ModelState", "check_model", "attention_configs", "SUPPORTED_MODES"]

#: The `generate()` decoding modes a FlexKVCache serves: greedy and sampled decoding, beam search (streams
#: reordered by forks), assisted generation and prompt lookup (rejected draft tokens rolled back).
SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")

#: Why the other modes are refused.
_REFUSED_BECAUSE = {
    "contrastive_search": "transformers runs it from hub code (transformers-community/contrastive-search) that "
                          "flexkv is not checked against",
    "group_beam_search": "transformers runs it from hub code (transformers-community/group-beam-search) that "
                         "flexkv is not checked against; plain beam search (num_beams) is served",
    "constrained_beam_search": "transformers runs it from hub code (transformers-community/constrained-beam-search) "
                               "that flexkv is not checked against; plain beam search (num_beams) is served",
    "dola_generation": "transformers runs it from hub code (transformers-community/dola), and it reads the hidden "
                       "states of early layers, which flexkv is not checked against",
}


def _attention_modules(model) -> dict:
    """`{layer_idx: module}` of the modules whose forward calls transformers' attention interface."""
    found = {}
    for mod in model.modules():
        layer = getattr(mod, "layer_idx", None)
        if not isinstance(layer, int) or isinstance(layer, bool):
            continue
        try:
            names = inspect.unwrap(type(mod).forward).__code__.co_names
        except AttributeError:  # pragma: no cover - a forward that is not a plain function
            continue
        if "ALL_ATTENTION_FUNCTIONS" in names:
            found.setdefault(layer, mod)
    return found


def check_model(model, attention_layers=None) -> None:
    """Refuse a model whose attention flexkv cannot take over (before anything about it is touched).

    `attention_layers`: the layers that must run their attention through
    transformers' attention interface (None: check only the model's kind).
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; FlexKVCache supports decoder-only LMs")
    if attention_layers is None:
        return
    routed = _attention_modules(model)
    missing = [i for i in attention_layers if i not in routed]
    shared = {i: m for i, m in routed.items() if i not in attention_layers and (i < 0 or i > max(attention_layers))}
    if missing and shared:
        # Zamba2: one attention block serves several layers and is told the layer in each call.
        idx, mod = next(iter(shared.items()))
        raise ValueError(
            f"{type(model).__name__}'s layers {missing} share one attention module ({type(mod).__name__}, "
            f"layer_idx={idx}) that is handed the layer index as an argument of each call, so flexkv's attention "
            f"function cannot tell whose keys and values a call holds"
        )
    if missing and not getattr(type(model), "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__}'s attention layers {missing} do not call transformers' attention interface "
            f"(ALL_ATTENTION_FUNCTIONS), so flexkv cannot take their attention over"
        )


def _find_cache(args, kwargs):
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name still works).
    cache = kwargs.get("cache")
    if not isinstance(cache, CacheShim):
        cache = kwargs.get("past_key_values")
    if not isinstance(cache, CacheShim):
        if any(isinstance(a, CacheShim) for a in args):
            raise ValueError("pass a FlexKVCache by keyword (cache=... or past_key_values=...), not positionally")
        return None
    return cache


class ModelState:
    """What `enable` installed on a model: hooks, the configs a planned forward switches to flexkv,
    and the forward its hooks planned that has not ended yet."""

    def __init__(self, configs):
        self.handles: list = []
        self.configs = configs
        #: each config's instance dict where setting `_attn_implementation_internal` there is all its
        #: `__setattr__` would do (no validator, no attribute map for it); else the config (`switch`)
        self.targets = [_plain_target(cfg) for cfg in configs]
        self.depth = 0
        self.saved: list = []
        #: the forward the hooks planned and have not committed or rolled back (None: none)
        self.running = None
        #: the instance attribute `generate` had before `enable` wrapped it (None: the class's own)
        self.generate = None
        #: while this model drafts for another's assisted `generate()`: the FlexKVCache it drafts with
        self.assistant_cache = None
        #: the model's own instance attribute `create_masks_for_generate` before `enable` (None: none)
        self.create_masks = None
        #: torch.compile's automatic dynamic shapes as they were before a compiled forward turned them off
        self._dynamic_before = None

    def static_shapes(self, on: bool) -> None:
        """Turn torch.compile's automatic dynamic shapes off for a compiled forward (`on`), or restore them.

        A flexkv forward's graph is shaped by its plan: under automatic dynamic shapes (`dynamic=None`)
        the recompile that follows the prefill would make every plan size a symbol, and torch 2.13's
        shared FlexAttention region and CPU template fail on those (`TORCH_WORKAROUNDS["DYNAMIC_PLAN"]`).
        Static, the decode step compiles one graph however long the streams run."""
        cfg = torch._dynamo.config
        if on and self._dynamic_before is None:
            self._dynamic_before = cfg.automatic_dynamic_shapes
            cfg.automatic_dynamic_shapes = False
        elif not on and self._dynamic_before is not None:
            cfg.automatic_dynamic_shapes, self._dynamic_before = self._dynamic_before, None

    def recover(self) -> bool:
        """Roll back a forward the hooks planned whose end never ran (interrupted by a `BaseException`).

        Returns whether there was one. Safe to call at any time outside a running forward.
        """
        fwd, self.running = self.running, None
        self.static_shapes(False)
        if fwd is None:
            return False
        cache = fwd.cache
        if cache.pending_forward is not None and cache.pending_forward.forward is fwd:
            cache.rollback()
        return True


def _pre_forward(state: ModelState, module, args, kwargs):
    """Forward pre-hook: plan a forward that carries a FlexKVCache and hand the plan down as keywords.

    Traced (transformers' `generate(compile_config=...)` compiles the module's `__call__`, hooks
    included), planning runs outside the graph: it is host work whose every int would otherwise be
    guarded on, a recompile per token."""
    if kwargs.get("flexkv_step") is not None:
        return None  # inside a forward planned further up (the LM head's forward calls the base model's)
    if torch.compiler.is_compiling():
        return _plan_outside_graph(state, module, args, kwargs)
    return _plan_forward(state, module, args, kwargs)


def _plan_forward(state: ModelState, module, args, kwargs):
    # Not inside a planned forward: a forward these hooks planned and that is still pending was
    # interrupted (KeyboardInterrupt skips forward hooks); undo it before this forward runs.
    state.recover()
    cache = _find_cache(args, kwargs)
    if cache is None:
        return None
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args:
        input_ids = args[0]
    if len(args) > 1:
        raise ValueError("with a FlexKVCache, pass the forward's inputs by keyword (input_ids=..., attention_mask=...)")
    mask = kwargs.get("attention_mask")
    extra = cache.prepare(input_ids, mask, inputs_embeds=kwargs.get("inputs_embeds"))
    fwd = extra["flexkv_step"]
    fwd.owner = module
    state.running = fwd
    kwargs = dict(kwargs)
    kwargs.update(extra)
    # Consumed: flexkv masks attention itself. Models with recurrent layers get the padding
    # mask of this forward's columns for those layers only (see FlexKVCache.model_masks).
    kwargs["attention_mask"] = cache.model_masks(mask, fwd)
    if compiled_forward(module):
        state.static_shapes(True)
        try:  # a forward compiled by hand: its chunks run the compiled forward one by one
            split = chunked_call(module, fwd, args, kwargs)
        except BaseException:
            state.recover()
            raise
        if split is not None:
            return split
    return args, kwargs


_plan_outside_graph = torch.compiler.disable(_plan_forward)


def _post_forward(state: ModelState, module, args, kwargs, result):
    """Forward hook (run on success and on `Exception`): commit the forward this module planned, or roll it back."""
    fwd = kwargs.get("flexkv_step") if isinstance(kwargs, dict) else None
    if not isinstance(fwd, FlexKVForward) or fwd.owner is not module:
        return None  # not a forward these hooks planned, or the base model's inside the LM's
    if torch.compiler.is_compiling():
        return _end_outside_graph(state, module, fwd, result)
    return _end_forward(state, module, fwd, result)


def _end_forward(state: ModelState, module, fwd, result):
    if fwd.whole is not None:  # the last chunk of a forward run chunk by chunk (`chunked_call`)
        try:
            result = None if result is None else join_outputs(fwd.earlier, result)
        except BaseException:  # the whole forward goes back, Ctrl-C included
            state.recover()
            raise
        _end_forward(state, module, fwd.whole, result)
        return result
    if state.running is fwd:
        state.running = None
    state.static_shapes(False)
    cache = fwd.cache
    if cache.pending_forward is None or cache.pending_forward.forward is not fwd:
        return None
    if result is None:
        cache.rollback()
    else:
        cache.commit()
    return None


_end_outside_graph = torch.compiler.disable(_end_forward)


def attention_configs(model) -> list:
    """The config objects the model's attention layers and mask builders read `_attn_implementation` from."""
    found = {}
    for cfg in (model.config, text_config(model.config)):
        found.setdefault(id(cfg), cfg)
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if isinstance(getattr(mod, "layer_idx", None), int) and hasattr(cfg, "_attn_implementation_internal"):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


_IMPL = "_attn_implementation_internal"


def _plain_target(cfg):
    """Where `switch` sets `cfg`'s attention implementation: its instance dict when the config's
    `__setattr__` would only store the value there (transformers' strict configs run the field's
    validators and map aliased names first; a validator or alias for it means the config itself)."""
    validators = getattr(type(cfg), "__validators__", None)
    plain = (isinstance(getattr(cfg, "__dict__", None), dict) and _IMPL in cfg.__dict__
             and not (isinstance(validators, dict) and validators.get(_IMPL))
             and _IMPL not in (getattr(cfg, "attribute_map", None) or {}))
    return cfg.__dict__ if plain else cfg


def switch(state: ModelState, on: bool) -> None:
    """Run the model's attention through flexkv (nesting counted), or restore what it was.

    Once per forward: each config's value is set in its instance dict where that is all its
    `__setattr__` would do (`ModelState.targets`), since the strict config's own `__setattr__`
    costs more than the rest of the switch."""
    if on:
        if state.depth == 0:
            state.saved = [t[_IMPL] if type(t) is dict else getattr(t, _IMPL) for t in state.targets]
            for t in state.targets:
                if type(t) is dict:
                    t[_IMPL] = ATTN_IMPLEMENTATION
                else:
                    setattr(t, _IMPL, ATTN_IMPLEMENTATION)
        state.depth += 1
    else:
        state.depth = max(0, state.depth - 1)
        if state.depth == 0:
            for t, value in zip(state.targets, state.saved):
                if type(t) is dict:
                    t[_IMPL] = value
                else:
                    setattr(t, _IMPL, value)
            state.saved = []


# The `generate()` arguments that decide its decoding mode (`GenerationConfig.get_generation_mode`).
_MODE_FIELDS = ("num_beams", "num_beam_groups", "do_sample", "penalty_alpha", "top_k", "constraints",
                "force_words_ids", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "dola_layers")


def _check_compile_config(model, compile_config, config) -> None:
    """Refuse a `compile_config` with `fullgraph=True` where generate() would compile: transformers compiles the
    model's `__call__`, flexkv's planning hooks included, and they run on the host (a graph break)."""
    if compile_config is None or not compile_config.fullgraph or config.disable_compile:
        return
    if model.device.type == "cpu" and not getattr(compile_config, "_compile_all_devices", False):
        return  # transformers does not compile on the CPU unless asked
    raise ValueError(
        "generate(compile_config=CompileConfig(fullgraph=True)) with a FlexKVCache: transformers compiles the "
        "model's __call__, and flexkv's hooks in it plan each forward on the host, outside the graph, which "
        "fullgraph=True forbids. Use CompileConfig(fullgraph=False) (transformers' default: the forward still "
        "compiles as one graph), or compile the forward itself: model.forward = torch.compile(model.forward, "
        "fullgraph=True)"
    )


def _generation_config(model, args, kwargs):
    """The generation config `generate(*args, **kwargs)` will run with (its mode fields and
    `num_return_sequences` as the call sets them)."""
    config = kwargs.get("generation_config")
    if config is None and len(args) > 1:
        config = args[1]
    config = copy.deepcopy(config if config is not None else model.generation_config)
    for name in _MODE_FIELDS + ("num_return_sequences",):
        if name in kwargs:
            setattr(config, name, kwargs[name])
    return config


def _generation_mode(model, args, kwargs) -> str:
    """The decoding mode `generate(*args, **kwargs)` will run, as transformers decides it."""
    mode = _generation_config(model, args, kwargs).get_generation_mode(kwargs.get("assistant_model"))
    return getattr(mode, "value", mode)


def _assistant_cache(model, kwargs):
    """Pop `assistant_cache=` (a FlexKVCache built for `assistant_model`) from `generate()`'s keywords."""
    cache = kwargs.pop("assistant_cache", None)
    if cache is None:
        return None, None
    assistant = kwargs.get("assistant_model")
    state = getattr(assistant, "_flexkv_state", None)
    if not isinstance(cache, CacheShim) or state is None or cache.bound_model is not assistant:
        raise ValueError(
            "generate(assistant_cache=...) takes a FlexKVCache built for the assistant_model "
            "(FlexKVCache(assistant_model, retention, max_rollback=...)), given with assistant_model="
        )
    return cache, state


def _guarded_generate(state: ModelState, model, generate, *args, **kwargs):
    """`model.generate` under flexkv: refuse unsupported modes first; leave the cache usable however it ends."""
    cache = _find_cache(args, kwargs)
    drafting = state.assistant_cache
    if cache is None and drafting is not None and getattr(kwargs.get("generation_config"), "is_assistant", False):
        # This model drafts for another's assisted generate(): its first draft starts the FlexKVCache
        # it was given (later drafts are handed it back by transformers).
        kwargs["cache"] = cache = drafting
    if cache is None:
        if "assistant_cache" in kwargs:
            raise ValueError("generate(assistant_cache=...) drafts with a FlexKVCache only when the main model "
                             "runs with one too: pass cache=FlexKVCache(model, ...)")
        return generate(*args, **kwargs)
    state.recover()
    config = _generation_config(model, args, kwargs)
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    mode = getattr(mode, "value", mode)
    if mode not in SUPPORTED_MODES:
        why = _REFUSED_BECAUSE.get(mode)
        raise ValueError(
            f"FlexKVCache does not support generate() in {mode.replace('_', ' ')} mode"
            + (f": {why}" if why else "")
        )
    if mode == "assisted_generation" and not cache.is_croppable:
        raise ValueError(
            "FlexKVCache does not support generate() in assisted generation mode for this model: assisted "
            "decoding and prompt lookup take back rejected draft tokens, but the model's recurrent layers "
            f"{list(cache.recurrent_states.layers)} keep a state that cannot be taken back"
        )
    _check_compile_config(model, kwargs.get("compile_config", config.compile_config), config)
    # A stream continued with only new tokens first attends the token generate() returned last (turns.py).
    check_continuation(cache, args, kwargs)
    columns = cache.selected.columns
    owed = with_owed_tokens(cache, model, args, kwargs)
    if owed is not None:
        args, kwargs = owed
    drafter, drafter_state = _assistant_cache(model, kwargs)
    if drafter_state is not None:
        drafter_state.assistant_cache = drafter
    try:
        result = generate_branching(cache, model, generate, mode, config, args, kwargs)
    except BaseException:
        state.recover()  # an interrupted forward (e.g. Ctrl-C) is undone now, not at the next forward
        if owed is not None and cache.selected.columns > columns:
            cache.selected.take_back(1)
        raise
    finally:
        if drafter_state is not None:
            drafter_state.assistant_cache = None
    if owed is not None:
        result = strip_first_column(result)
        if cache.selected.columns > columns:
            cache.selected.take_back(1)  # get_seq_length() counts the caller's columns
    record_owed_tokens(cache, result, columns)
    return result


def _padding_mask_for_flexkv(masks, *args, **kwargs):
    """`generate()`'s mask builder for a compileable cache: with a FlexKVCache, the 2-D padding mask
    as given (flexkv plans its forwards from it and builds the attention pattern itself); else the
    model's own builder (`masks`)."""
    if isinstance(kwargs.get("cache"), CacheShim) or isinstance(kwargs.get("past_key_values"), CacheShim):
        return kwargs.get("attention_mask")
    return masks(*args, **kwargs)


def enable(model) -> None:
    """Install flexkv's forward hooks on `model` and its guard around `model.generate` (idempotent).

    Registers the `"flexkv"` attention function and installs the hooks that
    plan a forward given a `FlexKVCache`, switch the model's attention to
    flexkv for that forward, and commit (or, if it raised, roll back) its
    tokens afterwards; and, as the instance attribute
    `create_masks_for_generate`, a mask builder that passes a FlexKVCache's
    2-D padding mask through (the model's own builder serves other caches). Forwards and `generate()` calls without a
    `FlexKVCache` are untouched.
    """
    check_model(model)
    register()
    if getattr(model, "_flexkv_state", None) is not None:
        return
    state = ModelState(attention_configs(model))
    mods = [model]
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        mods.append(base)
    for mod in mods:
        state.handles.append(mod.register_forward_pre_hook(functools.partial(_pre_forward, state), with_kwargs=True))
        state.handles.append(mod.register_forward_hook(functools.partial(_post_forward, state), with_kwargs=True,
                                                       always_call=True))
    own_masks = model.__dict__.get("create_masks_for_generate")
    masks = getattr(model, "create_masks_for_generate", None) or create_masks_for_generate
    state.create_masks = own_masks
    model.create_masks_for_generate = functools.partial(_padding_mask_for_flexkv, masks)
    generate = getattr(model, "generate", None)
    if callable(generate):
        state.generate = model.__dict__.get("generate")
        guarded = functools.partial(_guarded_generate, state, model, generate)
        functools.update_wrapper(guarded, generate)
        model.generate = guarded
    model._flexkv_state = state


def disable(model) -> None:
    """Undo `enable`: remove the hooks and the `generate` guard (a FlexKVCache built for the model no
    longer plans its forwards)."""
    state = getattr(model, "_flexkv_state", None)
    if state is None:
        return
    state.recover()
    for h in state.handles:
        h.remove()
    if state.create_masks is None:
        model.__dict__.pop("create_masks_for_generate", None)
    else:
        model.create_masks_for_generate = state.create_masks
    if "generate" in model.__dict__:
        if state.generate is None:
            del model.generate
        else:
            model.generate = state.generate
    if state.depth:
        state.depth = 1
        switch(state, on=False)
    model._flexkv_state = None
