"""What a transformers model's config says about each of its layers, as `FlexKVCache` needs it.

`read_layers(model)` gives one `LayerSpec` per decoder layer: whether the
layer runs softmax attention (and over which sliding window, with how many
KV heads of which key and value widths, and whose keys and values), and
whether it keeps a recurrent state (linear attention, Mamba, short
convolutions). It reads the config the way the model's own masks and cache
do (`config.layer_types`, `sliding_window`, `per_layer_config`,
`kv_sharing_modes`, the latent-attention widths) and refuses, with the
layer and the reason, what flexkv cannot serve exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ...cache.groups import LayerGroup
from ...config import SinkWindow

__all__ = ["LayerSpec", "read_layers", "layer_windows", "layer_groups", "text_config", "absolute_positions",
           "softcap_of", "ATTENTION_TYPES", "RECURRENT_TYPES", "HYBRID_TYPES"]

#: Layer types (`config.layer_types`) whose layer runs softmax attention, with or without a window.
ATTENTION_TYPES = ("full_attention", "sliding_attention")
#: Layer types whose layer keeps only a fixed-size state (linear attention, Mamba, short convolution).
RECURRENT_TYPES = ("linear_attention", "conv")
#: Layer types whose layer does both (Falcon-H1 runs attention and Mamba side by side): the attention they run.
HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}

# Layer types transformers knows that flexkv does not serve, and why.
_REFUSED_TYPES = {
    "chunked_attention": "it attends within fixed chunks of the stream (Llama 4), which a sink + window does not keep",
    "indexed_attention": "a learned indexer picks which past tokens each query attends (DeepSeek-V3.2's sparse "
                         "attention), so what a stream must keep is not a sink + window",
    "compressed_sparse_attention": "it attends compressed blocks of the whole history, not a sink + window",
    "heavily_compressed_attention": "it attends compressed blocks of the whole history, not a sink + window",
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the cache serves it.

    `window`: the model's own sliding window of an attention layer (None:
    full attention). `kv_heads`, `head_dim`, `value_head_dim`: the layer's
    keys and values as its attention receives them (the names of
    `BoundedKVConfig`). `kv_source`: the layer whose keys and values this
    layer attends (itself, or, for Gemma 3n/4's shared-KV layers, the last
    layer of its type that computes them).
    """

    index: int
    layer_type: str
    attends: bool
    recurrent: bool
    window: Optional[int] = None
    kv_heads: int = 0
    head_dim: int = 0
    value_head_dim: int = 0
    kv_source: Optional[int] = None


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def layer_windows(cfg, layers: int) -> List[Optional[int]]:
    """The model's own sliding window of each attention layer (None: full attention), as its masks apply them.

    With `config.layer_types`, layers typed `"sliding_attention"` (or
    `"hybrid_sliding"`) attend the last `config.sliding_window` tokens
    (themselves included) and the other attention layers everything. Without
    it, every layer slides when `config.sliding_window` is set (Mistral,
    Phi-3), none otherwise. Recurrent-only layers get None too.
    """
    types = _layer_types(cfg, layers)
    sw = getattr(cfg, "sliding_window", None)
    out = []
    for i, t in enumerate(types):
        kind = HYBRID_TYPES.get(t, t)
        if kind != "sliding_attention":
            out.append(None)
            continue
        if not _positive_int(sw):
            raise ValueError(
                f"layer {i} is a {t} layer but config.sliding_window={sw!r} is not a positive int"
            )
        out.append(sw)
    return out


def _layer_types(cfg, layers: int) -> List[str]:
    """`config.layer_types` checked (or derived, for configs without it), one per layer."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sw = getattr(cfg, "sliding_window", None)
        if sw is None or getattr(cfg, "use_sliding_window", True) is False:
            return ["full_attention"] * layers
        return ["sliding_attention"] * layers
    types = list(types)
    if len(types) < layers:
        raise ValueError(f"config.layer_types names {len(types)} layers but the model has {layers}")
    served = ATTENTION_TYPES + RECURRENT_TYPES + tuple(HYBRID_TYPES)
    for i, t in enumerate(types[:layers]):
        if t in served:
            continue
        why = _REFUSED_TYPES.get(t)
        if why is not None:
            raise ValueError(f"layer {i} is of type {t!r}: {why}; FlexKVCache serves the layer types {served}")
        raise ValueError(f"layer {i} is of type {t!r}; FlexKVCache serves the layer types {served} only")
    return types[:layers]


def _head_sizes(cfg, i: int) -> tuple:
    """`(kv_heads, head_dim, value_head_dim)` of layer `i`'s keys and values as its attention receives them."""
    heads = getattr(cfg, "num_attention_heads", None)
    nope, rope, v_dim = (getattr(cfg, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if _positive_int(rope) and _positive_int(v_dim) and isinstance(nope, int):
        # Multi-head latent attention: the model expands its cached latents into one key of
        # `nope + rope` and one value of `v_head_dim` per query head before attention
        # (`config.head_dim` is only the rotary part there).
        return heads, nope + rope, v_dim
    layer_cfg = cfg
    per_layer = getattr(cfg, "per_layer_config", None)
    if per_layer is not None:
        try:
            layer_cfg = per_layer[i]
        except (IndexError, KeyError, TypeError):
            layer_cfg = cfg
    head_dim = getattr(layer_cfg, "head_dim", None) or (cfg.hidden_size // heads if _positive_int(heads) else None)
    kv_heads = getattr(layer_cfg, "num_key_value_heads", None) or heads
    return kv_heads, head_dim, head_dim


def _kv_sources(cfg, types: List[str], layers: int) -> List[int]:
    """The layer whose keys and values each layer attends (`kv_sharing_modes`, Gemma 3n and 4)."""
    try:
        modes = getattr(cfg, "kv_sharing_modes", None)
    except ValueError:
        modes = None
    if modes is None:
        return list(range(layers))
    modes = list(modes)[:layers]
    out = []
    for i, mode in enumerate(modes):
        if mode != "reuse":
            out.append(i)
            continue
        # The model hands a shared layer the keys and values its type's "store" layer computed.
        stores = [j for j in range(i) if modes[j] == "store" and types[j] == types[i]]
        if not stores:
            raise ValueError(
                f"layer {i} reuses the keys and values of an earlier {types[i]} layer (kv_sharing_modes), "
                f"but no earlier layer of that type stores them"
            )
        out.append(stores[-1])
    return out


def read_layers(model) -> tuple:
    """`(text config, [LayerSpec per layer])` for a decoder-only LM; refuses what flexkv cannot serve."""
    cfg = text_config(model.config)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not _positive_int(layers):
        raise ValueError(
            f"model config has no usable num_hidden_layers (got {layers!r}); FlexKVCache needs a decoder-only LM config"
        )
    types = _layer_types(cfg, layers)
    heads = getattr(cfg, "num_attention_heads", None)
    if any(t not in RECURRENT_TYPES for t in types) and not _positive_int(heads):
        raise ValueError(
            f"model config has no usable num_attention_heads (got {heads!r}); "
            f"FlexKVCache needs a decoder-only LM config"
        )
    windows = layer_windows(cfg, layers)
    sources = _kv_sources(cfg, types, layers)
    specs = []
    for i, t in enumerate(types):
        attends = t not in RECURRENT_TYPES
        recurrent = t in RECURRENT_TYPES or t in HYBRID_TYPES
        kv_heads = head_dim = value_head_dim = 0
        if attends:
            kv_heads, head_dim, value_head_dim = _head_sizes(cfg, i)
            for name, val in (("KV heads", kv_heads), ("head_dim", head_dim), ("value head_dim", value_head_dim)):
                if not _positive_int(val):
                    raise ValueError(
                        f"layer {i}: the model config gives no usable {name} (got {val!r}); "
                        f"FlexKVCache needs a decoder-only LM config"
                    )
        specs.append(LayerSpec(i, t, attends, recurrent, windows[i], kv_heads, head_dim, value_head_dim,
                               sources[i] if attends else None))
    for s in specs:
        src = specs[s.kv_source] if s.attends else None
        if src is not None and (src.window, src.kv_heads, src.head_dim, src.value_head_dim) != (
            s.window, s.kv_heads, s.head_dim, s.value_head_dim
        ):
            raise ValueError(
                f"layer {s.index} attends the keys and values of layer {src.index}, but the config gives the two "
                f"layers different windows or head sizes"
            )
    return cfg, specs


def layer_groups(specs, retention: SinkWindow, sliding_retention: Optional[SinkWindow]) -> tuple:
    """The `LayerGroup`s of the layers that keep keys and values, and each model layer's KV layer.

    Returns `(groups, kv_layer)`: groups over KV-layer indices (one per kind
    of attention and head size: full attention keeps `retention`, each
    distinct sliding window its own), and `kv_layer[i]` the KV-layer index
    model layer `i` attends (None for recurrent-only layers). A layer that
    attends another layer's keys and values shares that layer's KV layer.
    """
    owners = [s for s in specs if s.attends and s.kv_source == s.index]
    kv_index = {s.index: k for k, s in enumerate(owners)}
    kv_layer = [kv_index[s.kv_source] if s.attends else None for s in specs]
    keys = []
    for s in owners:
        key = (s.window, s.kv_heads, s.head_dim, s.value_head_dim)
        if key not in keys:
            keys.append(key)
    # Full-attention groups first, then sliding windows from narrow to wide (stable for reports).
    keys.sort(key=lambda k: (k[0] is not None, k[0] or 0))
    shapes = {k[1:] for k in keys}
    sizes = sorted({k[0] for k in keys if k[0] is not None})
    groups = []
    for window, kv_heads, head_dim, value_head_dim in keys:
        layers = tuple(kv_index[s.index] for s in owners if (s.window, s.kv_heads, s.head_dim, s.value_head_dim) == (
            window, kv_heads, head_dim, value_head_dim))
        if window is None:
            keep, name = retention, "full_attention"
        else:
            if sliding_retention is None:
                keep = SinkWindow(0, window - 1)
            else:
                if sliding_retention.window + 1 > window:
                    raise ValueError(
                        f"sliding_retention window={sliding_retention.window} attends {sliding_retention.window + 1} "
                        f"tokens, more than the model's sliding_window={window}; use window <= {window - 1}"
                    )
                keep = sliding_retention
            name = "sliding_attention" if len(sizes) == 1 else f"sliding_attention({window})"
        if len(shapes) > 1 and sum(1 for k in keys if k[0] == window) > 1:
            name += f"[{kv_heads}x{head_dim}]"
        groups.append(LayerGroup(layers, keep, keep.window, name, num_heads=kv_heads, head_dim=head_dim,
                                 value_head_dim=value_head_dim))
    return tuple(groups), kv_layer


def absolute_positions(model, cfg) -> Optional[tuple]:
    """`(limit, module name)` for a model with learned absolute position embeddings, else None."""
    base = getattr(model, "base_model", model)
    if getattr(base, "rotary_emb", None) is not None:
        return None
    for name in ("wpe", "embed_positions", "position_embeddings"):
        emb = getattr(base, name, None)
        if isinstance(emb, torch.nn.Embedding):
            limit = getattr(cfg, "max_position_embeddings", None)
            if not isinstance(limit, int) or limit < 1:
                limit = emb.num_embeddings
            return min(limit, emb.num_embeddings), name
    return None


def softcap_of(cfg) -> Optional[float]:
    cap = getattr(cfg, "attn_logit_softcapping", None)
    return None if cap is None else float(cap)
