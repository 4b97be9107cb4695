"""Whether a model hands flexkv's plan to every attention layer, and what each layer's attention receives.

The plan of a forward reaches a layer's attention only as a keyword the
model's forward passes down through its decoder layers (`flexkv_step`);
some models route attention through transformers' attention interface but
drop those keywords on the way (StableLM's decoder layer calls its attention
without them). `probe_attention` runs the model once on one token with its
attention switched to flexkv and a recording plan, and reads off which
layers attended and the KV heads and key and value widths each received, so
that `FlexKVCache` refuses such a model (or sizes one whose config says
otherwise) when it is built, not in its first `generate()`.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .registration import ATTN_IMPLEMENTATION, UnplannedAttention, register

__all__ = ["probe_attention"]


class _Recorder:
    """Stands in for a `FlexKVForward` in the probe: records what each layer's attention receives."""

    def __init__(self):
        self.seen: Dict[int, Tuple[int, int, int]] = {}
        self.calls: Dict[int, int] = {}

    def attend(self, layer_idx, q, k, v, scale=None, **kwargs):
        self.seen.setdefault(int(layer_idx), (int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1])))
        self.calls[int(layer_idx)] = self.calls.get(int(layer_idx), 0) + 1
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def probe_attention(model, configs) -> Dict[int, Tuple[int, int, int]]:
    """`{layer: (kv_heads, head_dim, value_head_dim)}` as each layer's attention received them in a one-token forward.

    `configs`: the config objects the model's attention reads `_attn_implementation` from; each is
    switched to flexkv for the probe and restored afterwards. Raises `ValueError` when the model
    runs flexkv attention without the plan (its layers drop the forward's keywords).
    """
    register()
    saved = [cfg._attn_implementation_internal for cfg in configs]
    recorder = _Recorder()
    probe = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
        # Eager even where the user compiled the forward: a probe must not compile a graph of its own.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(input_ids=probe, use_cache=False, flexkv_step=recorder)
    except UnplannedAttention as exc:
        flag = getattr(type(model), "_supports_attention_backend", None)
        raise ValueError(
            f"{type(model).__name__} routes attention through transformers' attention interface, but its layers do "
            f"not hand the forward's keyword arguments down to it (transformers marks the class "
            f"_supports_attention_backend={flag}), so the plan flexkv gives each forward never reaches the attention "
            f"({exc.where}); FlexKVCache cannot serve this model"
        ) from None
    finally:
        for cfg, value in zip(configs, saved):
            cfg._attn_implementation_internal = value
    twice = {i: n for i, n in sorted(recorder.calls.items()) if n > 1}
    if twice:
        i, n = next(iter(twice.items()))
        raise ValueError(
            f"{type(model).__name__}'s layers {sorted(twice)} call their attention more than once per forward "
            f"(layer {i}: {n} calls in a one-token forward, as differential attention or a recurrent-depth loop do); "
            f"flexkv keeps one set of keys and values per layer and writes it on each call, so FlexKVCache cannot "
            f"serve this model"
        )
    return recorder.seen


def reconcile(model, specs, seen) -> list:
    """`specs` with each attention layer's head sizes as the probe saw them; refuses a layer the
    config and the probe disagree on (attention or not)."""
    from dataclasses import replace

    name = type(model).__name__
    silent = [s.index for s in specs if s.attends and s.index not in seen]
    if silent:
        raise ValueError(
            f"{name}'s config names layers {silent} attention layers, but they ran no attention in a one-token "
            f"forward; config.layer_types does not describe this model, and FlexKVCache cannot serve it"
        )
    extra = sorted(i for i in seen if not (0 <= i < len(specs) and specs[i].attends))
    if extra:
        raise ValueError(
            f"{name}'s layers {extra} ran attention in a one-token forward, but its config names them "
            f"{[specs[i].layer_type if 0 <= i < len(specs) else None for i in extra]}; config.layer_types does not "
            f"describe this model, and FlexKVCache cannot serve it"
        )
    out = []
    for s in specs:
        if s.attends and seen[s.index] != (s.kv_heads, s.head_dim, s.value_head_dim):
            heads, dim, vdim = seen[s.index]
            s = replace(s, kv_heads=heads, head_dim=dim, value_head_dim=vdim)
        out.append(s)
    return out
