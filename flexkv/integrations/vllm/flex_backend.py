"""flexkv's retention in vLLM's FlexAttention backend: the path for CUDA.

vLLM's `FlexAttentionBackend` attends through the block table: each step's
metadata (`FlexAttentionMetadata`) turns a *logical* `mask_mod` (query and
key as stream indices) into one over the physical cache, and lists, per
query, the KV blocks the kernel visits (`_build_block_mask_direct`), pruned
by a `BlockSparsityHint`. flexkv's backend keeps all of that and changes two
things for a layer whose spec is a `SinkWindowSpec`:

- the logical `mask_mod` is `retention_mask.retention_mask_mod`: `query_window_attends`
  from `flexkv.cache.positions.masks`, the predicate flexkv's own FlexAttention mask and
  the CPU backend use (query `p` reads `j <= p` with `j < sink` or
  `j >= p - window`);
- the block hint `retention_mask.retention_block_hint` keeps a query block's KV blocks that
  hold a sink or reach its window, so blocks wholly between the sinks and the
  window (the ones `SinkWindowManager` gave back to the pool, null in the
  block table) are never visited.

Positions are stream indices, as vLLM's rotary embedding applies them
(`positions="cache"` is refused here: the CPU backend serves it). The
mask and block hint are unit-tested on CPU tensors against
`create_block_mask(...).to_dense()` and against `sink_window_attention`
(tests/test_vllm_flex.py); the backend has not run on a GPU.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadataBuilder,
)

from .options import check_engine, serving_positions
from .retention_mask import apply_retention
from .spec import SinkWindowSpec

__all__ = ["FlexKVFlexAttentionBackend", "FlexKVFlexAttentionBuilder", "FlexKVFlexAttentionImpl"]


class FlexKVFlexAttentionImpl(FlexAttentionImpl):
    """vLLM's FlexAttention implementation; `retention` says what a full-attention decoder layer keeps
    (None: vLLM's own attention). vLLM's class refuses ALiBi, soft-capping and KV sharing itself; learned
    sink logits, which it would take and ignore, are refused here."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 **kwargs) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **kwargs)
        retention = check_engine(get_current_vllm_config())
        if retention is not None and sliding_window is None:
            if attn_type != AttentionType.DECODER:
                raise ValueError(f"flexkv cannot serve {retention!r} for a layer of attention type {attn_type!r}: "
                                 f"flexkv keeps decoder self-attention only")
            if kwargs.get("sinks") is not None:
                raise ValueError(f"flexkv cannot serve {retention!r} exactly for this model: it has learned "
                                 f"attention-sink logits, which vLLM's FlexAttention does not apply")
        #: the layer's retention, or None: vLLM's own attention (no flexkv entry, or a sliding-window layer)
        self.retention = retention if sliding_window is None else None
        #: always "stream" here: in-cache positions are served by the CPU backend only, and asking for them is refused
        self.positions = serving_positions(get_current_vllm_config(), backend_serves_cache=False) \
            if self.retention is not None else None


class FlexKVFlexAttentionBuilder(FlexAttentionMetadataBuilder):
    """vLLM's FlexAttention metadata, with flexkv's retention for a `SinkWindowSpec` group."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        out = super().build(common_prefix_len, common_attn_metadata, fast_build)
        spec = self.kv_cache_spec
        if isinstance(spec, SinkWindowSpec):
            apply_retention(out, spec.sink, spec.sliding_window - 1)
        return out


class FlexKVFlexAttentionBackend(FlexAttentionBackend):
    """vLLM's FlexAttention backend whose metadata applies flexkv's retention where the spec says so."""

    @staticmethod
    def get_builder_cls():
        return FlexKVFlexAttentionBuilder

    @staticmethod
    def get_impl_cls():
        return FlexKVFlexAttentionImpl
