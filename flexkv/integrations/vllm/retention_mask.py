"""flexkv's retention as vLLM's FlexAttention metadata reads it: a logical mask and a block hint.

Plain torch, no vLLM import (tested in the main suite): `retention_mask_mod` is
`query_window_attends` from `flexkv.cache.positions.masks` as a logical `mask_mod`
(query and key as stream indices), `retention_block_hint` the
`BlockSparsityHint` function that keeps a query block's KV blocks holding a
sink or reaching its window, and `apply_retention` sets both on a
`FlexAttentionMetadata` and makes its block mask again
(`flexkv.integrations.vllm.flex_backend`).
"""

from __future__ import annotations

from ...cache.positions.masks import query_window_attends

__all__ = ["apply_retention", "retention_block_hint", "retention_mask_mod"]


def retention_mask_mod(sink: int, window: int):
    """The logical `mask_mod(b, h, q, kv)` of a per-query sink + window (contract section 2)."""

    def sink_window(b, h, q_idx, kv_idx):
        return query_window_attends(kv_idx, q_idx, sink, window)

    return sink_window


def retention_block_hint(sink: int, window: int):
    """`hint_fn(q_block [T, 1], kv_block [1, K], block_size)`: whether a KV block may hold an entry a
    query of the query block attends: a sink, or an entry no older than the block's first query's window."""

    def hint(q_block, kv_block, block_size: int):
        first_kept = q_block * block_size - window  # the oldest window entry of the block's first query
        return (kv_block * block_size < sink) | ((kv_block + 1) * block_size - 1 >= first_kept)

    return hint


def apply_retention(metadata, sink: int, window: int):
    """`metadata` (a `FlexAttentionMetadata` of a `SinkWindowSpec` layer) attending the retention: its
    logical mask, its block hint, and the mask and block mask made again from them. Returns it."""
    from vllm.v1.attention.backends.flex_attention import BlockSparsityHint  # only where vLLM is installed

    # vLLM's builder passes a sliding-window spec's `sliding_window` into the metadata when it captures full CUDA
    # graphs (its default on CUDA), and `SinkWindowSpec` is one: its mask would AND vLLM's window over the
    # retention's and drop the sinks. The retention's mask says the window itself.
    metadata.sliding_window = None
    metadata.logical_mask_mod = retention_mask_mod(sink, window)
    metadata.block_sparsity_hint = BlockSparsityHint(retention_block_hint(sink, window))
    metadata.mask_mod = metadata.get_mask_mod()
    metadata.block_mask = (metadata._build_block_mask_direct() if metadata.direct_build
                           else metadata.build_block_mask())
    return metadata
