"""StreamingLLM's in-cache rotary positions inside a transformers model (`positions="cache"`).

The model rotates queries and keys at stream positions; per chunk and KV
layer, `CachePositions` undoes that rotation with the layer's own angles and
hands the raw queries and keys to `flexkv.cache.rotary.SinkRotation`, which
rotates them at in-cache positions (distances to the sinks measured as if
the evicted tokens were never there).
"""

from __future__ import annotations

import torch

from ...cache.groups import GroupedKVManager, GroupedPlan
from ...cache.rotary import Rotary, check_cache_step, rotate_half
from ...step import BoundedKVStep
from .model_config import text_config

__all__ = ["CachePositions"]

_LINEAR_ROPE = ("default", "linear", "llama3", "yarn")


def _layer_uses_rope(cfg, layer_idx: int) -> bool:
    flags = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = rotary, 0 = none
    if flags is not None and layer_idx < len(flags):
        return bool(flags[layer_idx])
    return True


class CachePositions:
    """StreamingLLM's in-cache rotary positions per layer, through `flexkv.cache.rotary.SinkRotation`.

    The model rotates `q` and `k` at the stream positions the cache gave it.
    Per chunk and layer this undoes that rotation with the layer's own angles
    (float32, as the model's rotary embedding computes them) and hands the
    raw `q`, `k` to the layer's `SinkRotation`, which rotates them back at
    stream positions (float64 angles) and rewrites the slot's sink cells
    rotated `e` positions on: O(sink) per step. Layers that use no rotary
    (SmolLM3's `no_rope_layers`) and layers whose group keeps no sinks
    (where in-cache and stream distances agree) are left untouched. A rope
    whose angles are not `position * inv_freq` with a fixed `inv_freq`
    cannot be undone this way and is refused.
    """

    def __init__(self, manager: GroupedKVManager, model, kv_owner):
        """`kv_owner[k]`: the model layer whose keys KV layer `k` of `manager` holds."""
        base = getattr(model, "base_model", model)
        cfg = text_config(model.config)
        emb = getattr(base, "rotary_emb", None)
        types = getattr(cfg, "layer_types", None)
        c = manager.config
        self.layers: list = []
        self.inv_freq: list = []
        rotaries: dict = {}
        for kv in range(c.num_layers):
            i = kv_owner[kv]
            layer_config = manager.layer_config(kv)
            if layer_config.sink_capacity == 0 or not _layer_uses_rope(cfg, i):
                self.layers.append(None)
                self.inv_freq.append(None)
                continue
            layer_type = types[i] if types is not None and i < len(types) else None
            inv_freq = getattr(emb, "inv_freq", None)
            rope_type = getattr(emb, "rope_type", "default")
            if inv_freq is None and layer_type is not None:
                inv_freq = getattr(emb, f"{layer_type}_inv_freq", None)
            if isinstance(rope_type, dict):
                rope_type = rope_type.get(layer_type, "default")
            if not isinstance(inv_freq, torch.Tensor):
                raise ValueError(
                    f"rope_positions='cache' needs the model's rotary embedding ({type(base).__name__}.rotary_emb.inv_freq) "
                    f"for layer {i}; {type(model).__name__} has none: use rope_positions='stream'"
                )
            if rope_type not in _LINEAR_ROPE:
                raise ValueError(
                    f"rope_positions='cache' needs angles position * inv_freq with a fixed inv_freq (rope types "
                    f"{_LINEAR_ROPE}); layer {i}'s rope_type is {rope_type!r}: use rope_positions='stream'"
                )
            head_dim = layer_config.head_dim
            if inv_freq.numel() * 2 != head_dim:
                raise ValueError(
                    f"rope_positions='cache' needs rotary over the whole head (layer {i}: 2 * {inv_freq.numel()} "
                    f"frequencies != head_dim {head_dim}): use rope_positions='stream'"
                )
            key = (id(inv_freq), head_dim)
            if key not in rotaries:
                rotary = Rotary(head_dim).to(manager.device)
                with torch.no_grad():
                    rotary.inv_freq.copy_(inv_freq.to(torch.float64))
                rotaries[key] = (rotary, inv_freq.detach().to(device=manager.device, dtype=torch.float32).clone())
            rotary, inv32 = rotaries[key]
            self.layers.append(manager.rotation(kv, rotary, "cache"))
            self.inv_freq.append(inv32)
        # The retentions (one config per layer group) whose queries must share one eviction count within a step.
        self.configs = []
        for kv, r in enumerate(self.layers):
            layer_config = manager.layer_config(kv)
            if r is not None and not any(layer_config is c for c in self.configs):
                self.configs.append(layer_config)
        self.manager = manager
        if not self.configs and not any(_layer_uses_rope(cfg, i) for i in kv_owner):
            raise ValueError(f"rope_positions='cache' re-rotates rotary layers; {type(model).__name__} has none")

    @property
    def memory_bytes(self) -> int:
        return sum(r.memory_bytes for r in self.layers if r is not None)

    @property
    def slot_bytes(self) -> int:
        """Un-rotated sink bytes one slot holds over every layer."""
        return sum(r.slot_bytes for r in self.layers if r is not None)

    def chunk_limit(self, tokens: int, lengths) -> int:
        """Shrink a chunk so every query in it shares one eviction count in each rotated group."""
        for config in self.configs:
            pol = config.retention_for(0)
            limit = pol.sink + pol.window + 1
            room = min(limit - n for n in lengths)
            tokens = max(1, min(tokens, room))
        return tokens

    def check_step(self, step: BoundedKVStep) -> None:
        for config in self.configs:
            check_cache_step(config, step)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, plan: GroupedPlan):
        """Re-rotate KV layer `layer_idx`'s chunk `q`, `k` at in-cache positions (rewriting its sink cells)."""
        rot = self.layers[layer_idx]
        if rot is None:
            return q, k
        pos = self.manager.stream_positions(plan, k.shape[2])  # [N, T]: the positions the model rotated at
        freqs = pos.float().unsqueeze(-1) * self.inv_freq[layer_idx]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q_raw = q * cos - rotate_half(q) * sin
        k_raw = k * cos - rotate_half(k) * sin
        return rot(q_raw, k_raw, plan)


