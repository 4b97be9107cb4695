"""What a `FlexKVCache` reads from its model before it is built, and the checks that refuse a model or a
retention it cannot serve (`survey`).

Nothing here touches the model's hooks or configs: `survey` reads the config, runs the model once on one
token to see what reaches each attention layer (and, for recurrent layers, the states its own cache keeps),
and returns a `ModelSurvey`; `FlexKVCache.__init__` builds the cache from it and only then enables the
model. A refused model or retention raises before anything is allocated.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from transformers.cache_utils import Cache

from ...config import SinkWindow, is_int
from .hooks import attention_configs, check_model
from .model_config import absolute_positions, layer_groups, read_layers, softcap_of
from .recurrent import RecurrentStates, probe_states
from .routing import probe_attention, reconcile

__all__ = ["ModelSurvey", "check_retention", "own_cache_class", "survey"]


# Models whose forward takes no cache but an instance of their own class (MiniMax raises for any
# other); a FlexKVCache for them is also an instance of that class, with every method its own.
_OWN_CACHE_CLASSES = ("MiniMaxCache",)

# Recurrent mixers whose multi-token forward starts from a zero state whatever the cache holds
# (Jamba's Mamba scan takes no initial state): a stream can continue through them one token at a time.
_RESTART_ON_MULTI_TOKEN = {
    "JambaMambaMixer": "Jamba's Mamba layers start a multi-token forward from an empty state",
}


def check_retention(name: str, value) -> None:
    if not isinstance(value, SinkWindow):
        raise ValueError(f"{name} must be a flexkv.SinkWindow(sink, window), got {value!r}")
    if value.window_includes_step:
        raise ValueError(
            f"{name} {value} has window_includes_step=True; a language model's tokens attend "
            f"themselves on top of the window: use SinkWindow(sink, window) (window_includes_step=False)"
        )


def own_cache_class(model):
    module = sys.modules.get(type(model).__module__)
    for name in _OWN_CACHE_CLASSES:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, Cache):
            return cls
    return None



def _check_used(name: str, specs, retention, sliding_retention) -> None:
    """Refuse a retention no layer would keep, and a missing one some layer needs."""
    full = [s.index for s in specs if s.attends and s.window is None]
    sliding = [s.index for s in specs if s.attends and s.window is not None]
    if retention is None and full:
        raise ValueError(
            f"retention=None, but {name}'s layers {full} are full-attention layers: pass retention=SinkWindow(sink, "
            f"window), what a stream keeps there (None is for models whose every attention layer slides)"
        )
    if retention is not None and not full:
        windows = sorted({s.window for s in specs if s.attends})
        raise ValueError(
            f"every attention layer of {name} slides (sliding_window={windows[0] if len(windows) == 1 else windows}), "
            f"so retention={retention} would be used nowhere: pass retention=None to keep the model's own window "
            f"there, or keep something else with sliding_retention=SinkWindow(sink, window), window <= "
            f"{windows[0] - 1}"
        )
    if sliding_retention is not None and not sliding:
        raise ValueError(
            f"{name} has no sliding-window layer, so sliding_retention={sliding_retention} would be used nowhere; "
            f"drop it (retention= is what its full-attention layers keep)"
        )


@dataclass(frozen=True)
class ModelSurvey:
    """The facts a `FlexKVCache` is built on, read from its model by `survey`."""

    #: the model's text config (`read_layers`)
    config: object
    #: one `LayerSpec` per model layer, reconciled with what a one-token forward showed
    specs: tuple
    #: the cache's layer groups (`flexkv.cache.groups.LayerGroup`), one per distinct retention and shape
    groups: tuple
    #: model layer -> the KV layer it attends (None: a recurrent-only layer)
    kv_layer: tuple
    #: Gemma 2's attention logit soft-cap (None: none)
    softcap: Optional[float]
    #: whether the model adds absolute position embeddings (`model_config.absolute_positions`)
    absolute: bool
    #: why a stream continues one token at a time through some recurrent layer (empty: it need not)
    restarts: list
    #: the recurrent layers' state slots (None: no recurrent layer)
    states: Optional[RecurrentStates]
    device: object


def survey(model, retention: Optional[SinkWindow], sliding_retention: Optional[SinkWindow], max_streams: int,
           prefill_chunk: int, device=None) -> ModelSurvey:
    """Check the arguments against `model` and read what a cache for it is built on (module docstring)."""
    if not is_int(max_streams) or max_streams < 1:
        raise ValueError(f"max_streams must be an int >= 1 (streams the cache holds at once), got {max_streams!r}")
    if not is_int(prefill_chunk) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
    check_model(model)
    cfg, specs = read_layers(model)
    attention = [s.index for s in specs if s.attends]
    if not attention:
        raise ValueError(
            f"{type(model).__name__} has no attention layer (layer types {sorted({s.layer_type for s in specs})}): "
            f"its own cache already keeps a fixed-size state per stream, and a sink + window has nothing to bound"
        )
    check_model(model, attention)
    _check_used(type(model).__name__, specs, retention, sliding_retention)
    # One one-token forward: the plan reaches every attention layer, with the head sizes it says.
    specs = reconcile(model, specs, probe_attention(model, attention_configs(model)))
    groups, kv_layer = layer_groups(specs, retention, sliding_retention)
    if device is None:
        device = model.device
    recurrent = [s.index for s in specs if s.recurrent]
    states = None
    if recurrent:
        shapes = probe_states(model)
        missing = [i for i in recurrent if not any(key[0] == i for key in shapes)]
        extra = sorted({key[0] for key in shapes if key[0] not in recurrent})
        if missing or extra:
            raise ValueError(
                f"{type(model).__name__}'s config names layers {recurrent} recurrent, but on a one-token forward "
                f"with its own cache layers {sorted({key[0] for key in shapes})} kept a recurrent state; flexkv "
                f"cannot tell which state belongs to which layer"
            )
        states = RecurrentStates(shapes, max_streams, device)
    restarts = sorted({
        why for mod in model.modules() if isinstance(getattr(mod, "layer_idx", None), int)
        for name, why in _RESTART_ON_MULTI_TOKEN.items() if type(mod).__name__ == name
    })
    return ModelSurvey(cfg, tuple(specs), tuple(groups), tuple(kv_layer), softcap_of(cfg),
                       absolute_positions(model, cfg), restarts, states, device)
