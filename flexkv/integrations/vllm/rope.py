"""The model's rotary embedding inside vLLM, as flexkv's positions use it.

`served_rope_classes` are vLLM's rotary classes for the rope types `options.SERVED_ROPE` names: a row
of their cos/sin table is a rotation by a fixed set of frequencies, so rotations compose and a
longer table only adds rows (the plugin lengthens them to `max_model_len`). `model_rotary` finds the
model's own module among those vLLM built, for in-cache positions, and `turned` turns keys by a number of
positions with its table (both backends' sink keys).
"""

from __future__ import annotations

import torch

from ...cache.positions.rotary import apply_rotary

__all__ = ["served_rope_classes", "model_rotary", "turned"]


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


def turned(x, evicted, cos_sin, neox: bool):
    """`x` `[R, H, S, D]` (float32) turned by `evicted[r]` positions, a new tensor: `cos_sin` is the model's rotary
    table (`[positions, rotary_dim]`, cosines then sines); `neox`: dimension `i` pairs with `i + rotary_dim / 2`
    (flexkv's `"half"` layout), else `2i` with `2i + 1` (`"interleaved"`); dimensions past `rotary_dim` are not
    rotated. A row turned by 0 comes back as it was. No host synchronisation (a CUDA graph may hold it)."""
    cos, sin = cos_sin[evicted].float().chunk(2, dim=-1)  # [R, rotary_dim / 2]
    widen = (lambda t: torch.cat((t, t), -1)) if neox else (lambda t: torch.repeat_interleave(t, 2, dim=-1))
    cos, sin = widen(cos)[:, None, None, :], widen(sin)[:, None, None, :]
    rd = cos.shape[-1]
    out = x.clone()
    out[..., :rd] = apply_rotary(x[..., :rd], cos, sin, "half" if neox else "interleaved")
    return out
