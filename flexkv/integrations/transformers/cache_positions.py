"""StreamingLLM's in-cache rotary positions inside a transformers model (`positions="cache"`).

Under rotary positions a window key keeps its distance to the query whichever
position mode is used; only the sink keys sit closer in-cache, by the number
of entries evicted so far. So the model's own queries and keys, rotated at
stream positions, go to the cache as they are, and per chunk and KV layer
`CachePositions` has `flexkv.cache.positions.rotary.SinkRotation` (`rotated_inputs`)
rewrite the few sink cells rotated that many positions further on: O(sink)
per step, nothing un-rotated.

A chunk whose queries have evicted different numbers of entries (a chunk of
a prompt past the window, under the model's per-query window) reads each
sink at its own offset per query. `attend_per_query` serves it exactly as
two parts of one softmax: the cache's call with the sinks scored out, and
the sinks scored with each query turned back by its own eviction count,
merged by their log-sum-exps (`flexkv.cache.paths.merge`).
"""

from __future__ import annotations

import warnings

import torch

from ...cache.groups import GroupRotation
from ...cache.manager import BoundedKVManager
from ...cache.paths.merge import merge_attention
from ...cache.positions.rotary import Rotary, apply_rotary, check_cache_config, eviction_shared
from ...step import BoundedKVStep
from .model_config import text_config

__all__ = ["CachePositions", "warn_past_trained_context"]

_LINEAR_ROPE = ("default", "linear", "llama3", "yarn")


def _layer_uses_rope(cfg, layer_idx: int) -> bool:
    flags = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = rotary, 0 = none
    if flags is not None and layer_idx < len(flags):
        return bool(flags[layer_idx])
    return True


class CachePositions:
    """StreamingLLM's in-cache rotary positions per layer, through `flexkv.cache.positions.rotary.SinkRotation`.

    The model rotates `q` and `k` at the stream positions the cache gave it;
    they are attended as they are. Per chunk and layer the layer's
    `SinkRotation` keeps the sink keys as written and rewrites the slot's sink
    cells rotated `e` positions on (float64 angles from the layer's own
    `inv_freq`): O(sink) per step. Layers that use no rotary
    (SmolLM3's `no_rope_layers`) and layers whose group keeps no sinks
    (where in-cache and stream distances agree) are left untouched. A rope
    whose angles are not `position * inv_freq` with a fixed `inv_freq`
    cannot be undone this way and is refused.
    """

    def __init__(self, manager: BoundedKVManager, model, kv_owner):
        """`kv_owner[k]`: the model layer whose keys KV layer `k` of `manager` holds."""
        base = getattr(model, "base_model", model)
        cfg = text_config(model.config)
        emb = getattr(base, "rotary_emb", None)
        types = getattr(cfg, "layer_types", None)
        c = manager.config
        self.layers: list = []
        rotaries: dict = {}
        for kv in range(c.num_layers):
            i = kv_owner[kv]
            layer_config = manager.layer_config(kv)
            # A layer that keeps no sinks needs no rewrite, unless a Recall memory is read at in-cache positions.
            if (layer_config.sink_capacity == 0 and layer_config.recall is None) or not _layer_uses_rope(cfg, i):
                self.layers.append(None)
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
            check_cache_config(layer_config)
            self.layers.append((inv_freq, head_dim))
        # Every check passed: only now does any layer register its sink copies with the cache.
        for kv, wanted in enumerate(self.layers):
            if wanted is None:
                continue
            inv_freq, head_dim = wanted
            key = (id(inv_freq), head_dim)
            if key not in rotaries:
                rotary = Rotary(head_dim).to(manager.device)
                with torch.no_grad():
                    rotary.inv_freq.copy_(inv_freq.to(torch.float64))
                rotaries[key] = rotary
            rotation = manager.rotation(kv, rotaries[key], "cache", rotated_inputs=True)
            # The layer's `SinkRotation` (a several-group cache hands it out inside a `GroupRotation`).
            self.layers[kv] = rotation.rotation if isinstance(rotation, GroupRotation) else rotation
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

    def shares_eviction(self, step: BoundedKVStep) -> bool:
        """Whether every query of each stream in `step` has evicted as many entries as the others (one
        rotation of the sink cells serves the step); if not, `attend_per_query` serves it."""
        return all(eviction_shared(config, step) for config in self.configs)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, plan):
        """KV layer `layer_idx`'s chunk `q`, `k` (rotated at stream positions) for `attend`, after rewriting the
        layer's sink cells at in-cache positions."""
        rot = self.layers[layer_idx]
        if rot is not None:
            # `rot(q, k, plan)` without two module calls per layer: with rotated inputs it only rewrites.
            rot.rewrite_sinks(k, self.manager.group_plan(layer_idx, plan))
        return q, k

    def attend_per_query(self, context, model_layer: int, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, plan, *, scale=None, score_mod=None, sinks=None):
        """Attend KV layer `layer_idx` (model layer `model_layer`, through the forward's `context`) for a chunk
        whose queries evicted different numbers of entries, or None for a layer whose sinks need no rotation
        (attend it as usual).

        Part one is the cache's own call with the sink entries scored out (`-inf`), part two the sink
        entries scored against each query turned back by its own eviction count `e` (its in-cache distance
        to a sink is `e` less than the stream distance), both with the model's `score_mod`; the two are one
        softmax, merged by log-sum-exp. `q`, `k` are rotated at stream positions, as the model gives them.
        """
        rotation = self.layers[layer_idx]
        if rotation is None:
            return None
        gplan = self.manager.group_plan(layer_idx, plan)
        config = self.manager.layer_config(layer_idx)
        pol = config.retention_for(0)
        S = pol.sink
        rotation.keep_sink_keys(k, gplan)  # the cells' rotation is not read here: part two reads the copies

        def without_sinks(score, b, h, q_pos, kv_pos):
            if score_mod is not None:
                score = score_mod(score, b, h, q_pos, kv_pos)
            return torch.where(kv_pos < S, float("-inf"), score)

        out, lse = context.attend_lse(model_layer, q, k, v, plan=plan, scale=scale, score_mod=without_sinks,
                                      sinks=sinks)
        # A query that reads only sinks (a stream's first tokens, batched beside a stream past its window) has
        # every score of this part at -inf: whatever the path made of it (-inf or NaN), it contributes nothing.
        dead = ~torch.isfinite(lse)
        out = torch.where(dead.unsqueeze(-1), torch.zeros_like(out), out)
        lse = torch.where(dead, float("-inf"), lse)

        keys, values, _ = rotation.sink_entries(gplan)  # [N, H, S, D], [N, H, S, Dv]
        N, Hq, T, D = q.shape
        H = keys.shape[1]
        pos, readable = rotation.query_sinks(gplan)  # [N, T]; the sinks each query reads, [N, T, S]
        cos, sin = rotation.query_turn(gplan, q.dtype)  # each query turned back by its own eviction count
        q_back = apply_rotary(q, cos.unsqueeze(-3), sin.unsqueeze(-3), rotation.rotary.layout)
        scale = D ** -0.5 if scale is None else scale
        work = torch.promote_types(torch.float32, q.dtype)  # scores and weights in at least float32
        qg = q_back.view(N, H, Hq // H, T, D).to(work)
        scores = torch.einsum("nhgtd,nhsd->nhgts", qg, keys.to(work)) * scale
        if score_mod is not None:
            b = torch.arange(N, device=q.device).view(N, 1, 1, 1, 1)
            h = torch.arange(Hq, device=q.device).view(1, H, Hq // H, 1, 1)
            offs = torch.arange(keys.shape[2], device=q.device)  # the sink cells' stream positions
            scores = score_mod(scores, b, h, pos.view(N, 1, 1, T, 1), offs)
        scores = scores.masked_fill(~readable.view(N, 1, 1, T, -1), float("-inf"))
        sink_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - torch.where(torch.isneginf(sink_lse), 0.0, sink_lse).unsqueeze(-1))
        sink_out = torch.einsum("nhgts,nhsd->nhgtd", weights, values.to(work))
        sink_out = sink_out.reshape(N, Hq, T, -1).to(out.dtype)
        merged, _ = merge_attention((out, lse), (sink_out, sink_lse.reshape(N, Hq, T)))
        return merged


def warn_past_trained_context(rows, written, lengths, limit: int, reason=None) -> bool:
    """Warn (and return True) when a stream under stream positions would run past the model's trained context
    `limit`: rotary distances past it were never seen in training and quality falls apart (StreamingLLM's
    finding). `reason`: why in-cache positions are not served for this model, if they are not."""
    for sid, w, n in zip(rows, written, lengths):
        if w + n > limit:
            why = "" if reason is None else f" (in-cache positions are not served for this model: {reason})"
            warnings.warn(
                f"FlexKVCache: stream {sid!r} reaches position {w + n}, past the model's trained context "
                f"(max_position_embeddings={limit}), under rope_positions='stream'{why}; rotary distances this "
                f"long were not trained and the output degrades. Use rope_positions='cache' (StreamingLLM's "
                f"in-cache positions) where the model allows it, or finish the stream and start a new one "
                f"before that position.",
                RuntimeWarning,
                stacklevel=5,
            )
            return True
    return False
