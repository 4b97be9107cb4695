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

Positions: vLLM's rotary embedding turns every query and key by its stream
index. That is `"stream"`. For `"cache"` (StreamingLLM's in-cache positions,
the default for a served rope type) only a sink key's score changes: the
query at stream index `p` reads it `e = max(0, p - sink - window)` positions
closer than its stream index says. The step's sink scores are computed apart
and FlexAttention's `score_mod` puts them in place of the sinks' scores; every
other score is the kernel's own. One FlexAttention call per layer either way.
What that computes lives in `paged` (torch alone, no vLLM import: `sink_scores`,
`in_cache_score_mod`, and a block mask built from a block table); this module
hands it vLLM's metadata.

The mask, the block hint and both positions are unit-tested on CPU tensors
against `create_block_mask(...).to_dense()` and against the CPU backend's
`sink_window_attention` (tests/test_vllm_flex.py); `paged` against a dense
reference (tests/test_vllm_paged.py, and on CUDA `benchmarks/cuda_check.py`'s
paged section). The backend itself has not run on a GPU.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadataBuilder,
)

from .options import check_engine, serving_positions
from .paged import PagedBatch, in_cache_score_mod
from .paged import sink_scores as paged_sink_scores
from .retention_mask import apply_retention, building_with, install_metadata_hook
from .rope import model_rotary
from .spec import SinkWindowSpec

__all__ = ["FlexKVFlexAttentionBackend", "FlexKVFlexAttentionBuilder", "FlexKVFlexAttentionImpl", "sink_scores",
           "cache_position_score_mod"]


def _batch(metadata) -> PagedBatch:
    """vLLM's FlexAttention metadata as `paged.PagedBatch`."""
    return PagedBatch(metadata.block_table, metadata.seq_lens, metadata.query_start_loc, metadata.doc_ids,
                      metadata.block_size, metadata.num_blocks)


def sink_scores(query, key_cache, metadata, sink: int, window: int, scale: float, cos_sin, neox: bool):
    """`paged.sink_scores` with vLLM's metadata (`FlexAttentionMetadata`): its requests' block table, where each
    token's request starts and its stream offset (`decode_offset`, vLLM's own count)."""
    t = query.shape[0]
    req = metadata.doc_ids[:t].long()
    p = torch.arange(t, device=query.device) - metadata.query_start_loc[req] + metadata.decode_offset[req]
    return paged_sink_scores(query, key_cache, _batch(metadata), sink, window, scale, cos_sin, neox, positions=p)


def cache_position_score_mod(metadata, scores, sink: int):
    """`paged.in_cache_score_mod` over vLLM's paged cache: physical indices turned logical by vLLM's own
    metadata, as it turns them for its mask."""
    def logical_kv(q_idx, physical_kv_idx):
        return metadata._convert_physical_to_logical(metadata.doc_ids, q_idx, physical_kv_idx)[2]

    return in_cache_score_mod(scores, sink, logical_kv)


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
        #: "cache" or "stream" (options.serving_positions)
        self.positions = serving_positions(get_current_vllm_config()) if self.retention is not None else None
        self._rotary = None
        self._max_model_len = get_current_vllm_config().model_config.max_model_len

    def _turns_sinks(self) -> bool:
        return self.retention is not None and self.positions == "cache" and self.retention.sink > 0

    def _find_rotary(self) -> None:
        rope = model_rotary(self.head_size, self._max_model_len)  # reads the table on the host
        self._rotary = (rope.cos_sin_cache, rope.is_neox_style)

    def process_weights_after_loading(self, act_dtype):
        super().process_weights_after_loading(act_dtype)
        if self._turns_sinks():
            # Once the model is built and before vLLM captures any CUDA graph: finding the table reads it on
            # the host, which a capture must not do.
            self._find_rotary()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        pol = self.retention
        if not self._turns_sinks() or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self._rotary is None:  # vLLM calls process_weights_after_loading first; this is for a caller that did not
            self._find_rotary()
        t = attn_metadata.num_actual_tokens
        # vLLM's own view of its cache ([blocks, heads, block, 2 * head] as [slots, heads, head] keys)
        key_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)[0].view(-1, self.num_kv_heads,
                                                                                    self.head_size)
        scores = sink_scores(query[:t], key_cache, attn_metadata, pol.sink, pol.window, self.scale, *self._rotary)
        own = attn_metadata.transformed_score_mod
        if own is not None:  # vLLM 0.32 sets none for a decoder; one would be dropped here, so refuse it
            raise NotImplementedError("vLLM's FlexAttention metadata carries a score_mod of its own, which flexkv's "
                                      "in-cache positions would replace; serve this model with "
                                      'additional_config={"flexkv": {..., "positions": "stream"}}')
        attn_metadata.transformed_score_mod = cache_position_score_mod(attn_metadata, scores, pol.sink)
        try:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        finally:
            attn_metadata.transformed_score_mod = own


class FlexKVFlexAttentionBuilder(FlexAttentionMetadataBuilder):
    """vLLM's FlexAttention metadata, with flexkv's retention for a `SinkWindowSpec` group: vLLM's own build runs
    with the retention set on the metadata as it is made (`retention_mask.building_with`), so the block mask
    vLLM builds before anything can read the metadata (for CUDA graph capture) is the retention's, built once.
    A metadata vLLM made another way gets it afterwards (`apply_retention`, a second block mask)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install_metadata_hook()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        spec = self.kv_cache_spec
        if not isinstance(spec, SinkWindowSpec):
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        retention = (spec.sink, spec.sliding_window - 1)
        with building_with(*retention):
            out = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if out.__dict__.get("flexkv_retention") != retention:
            apply_retention(out, *retention)
        return out


class FlexKVFlexAttentionBackend(FlexAttentionBackend):
    """vLLM's FlexAttention backend whose metadata applies flexkv's retention where the spec says so."""

    @staticmethod
    def get_builder_cls():
        return FlexKVFlexAttentionBuilder

    @staticmethod
    def get_impl_cls():
        return FlexKVFlexAttentionImpl
