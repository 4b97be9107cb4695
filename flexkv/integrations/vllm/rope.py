"""The model's rotary embedding inside vLLM, as flexkv's positions use it.

`served_rope_classes` are vLLM's rotary classes for the rope types `options.SERVED_ROPE` names: a row
of their cos/sin table is a rotation by a fixed set of frequencies, so rotations compose and a
longer table only adds rows (the plugin lengthens them to `max_model_len`). `model_rotary` finds the
model's own module among those vLLM built, for in-cache positions (`backend.turn_sinks` reads its
table).
"""

from __future__ import annotations

__all__ = ["served_rope_classes", "model_rotary"]


def served_rope_classes() -> tuple:
    """vLLM's rotary classes for the rope types of `options.SERVED_ROPE` (exact classes, not subclasses:
    a subclass may compute its rows another way)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import LinearScalingRotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    return (RotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding)


def model_rotary(head_size: int, max_model_len: int):
    """The model's rotary embedding for heads of `head_size`: the one module of vLLM's rope cache
    (`get_rope` builds one per set of parameters, shared by every layer) of a served type with that
    head size. Raises `ValueError` when there is none or several differ."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    found = {id(r): r for r in _ROPE_DICT.values()
             if type(r) in served_rope_classes() and r.head_size == head_size
             and r.cos_sin_cache.shape[0] >= max_model_len}
    kinds = {(r.rotary_dim, r.is_neox_style, r.cos_sin_cache.shape, tuple(r.cos_sin_cache[1].tolist()))
             for r in found.values()}
    if len(kinds) != 1:
        raise ValueError(
            f"flexkv serves positions='cache' with the model's rotary table, and found {len(kinds)} rotary "
            f"embeddings of head size {head_size} covering {max_model_len} positions (of types "
            f"{sorted({type(r).__name__ for r in found.values()})}); serve this model with "
            f'additional_config={{"flexkv": {{..., "positions": "stream"}}}}'
        )
    return next(iter(found.values()))
