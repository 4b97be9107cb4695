"""flexkv's retention as vLLM's FlexAttention metadata reads it: a logical mask and a block hint.

Plain torch, no vLLM import (tested in the main suite): `retention_mask_mod` is
`query_window_attends` from `flexkv.cache.positions.masks` as a logical `mask_mod`
(query and key as stream indices), `retention_block_hint` the
`BlockSparsityHint` function that keeps a query block's KV blocks holding a
sink or reaching its window. `set_retention` puts both on a
`FlexAttentionMetadata`; `apply_retention` does so and makes its block mask
again. To build the block mask once, `flexkv.integrations.vllm.flex_backend`'s
builder runs vLLM's own build inside `building_with(sink, window)`, under which
every `FlexAttentionMetadata` vLLM makes takes the retention as it is made
(`install_metadata_hook`), before vLLM builds its block mask.
"""

from __future__ import annotations

import contextlib
import contextvars

from ...cache.positions.masks import query_window_attends

__all__ = ["apply_retention", "set_retention", "retention_block_hint", "retention_mask_mod", "building_with",
           "install_metadata_hook"]

#: (sink, window) of the `SinkWindowSpec` whose metadata vLLM is building, or None
_BUILDING = contextvars.ContextVar("flexkv_building", default=None)


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


def set_retention(metadata, sink: int, window: int) -> None:
    """`metadata`'s logical mask and block hint for the retention (neither its mask nor its block mask made)."""
    from vllm.v1.attention.backends.flex_attention import BlockSparsityHint  # only where vLLM is installed

    # vLLM's builder passes a sliding-window spec's `sliding_window` into the metadata when it captures full CUDA
    # graphs (its default on CUDA), and `SinkWindowSpec` is one: its mask would AND vLLM's window over the
    # retention's and drop the sinks. The retention's mask says the window itself.
    metadata.sliding_window = None
    metadata.logical_mask_mod = retention_mask_mod(sink, window)
    metadata.block_sparsity_hint = BlockSparsityHint(retention_block_hint(sink, window))
    metadata.flexkv_retention = (sink, window)


@contextlib.contextmanager
def building_with(sink: int, window: int):
    """Within it, every `FlexAttentionMetadata` made takes the retention as it is made (`install_metadata_hook`)."""
    token = _BUILDING.set((sink, window))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def install_metadata_hook() -> None:
    """Wrap `FlexAttentionMetadata.__post_init__` (once): inside `building_with`, the metadata takes the retention
    (`set_retention`) before vLLM's own `__post_init__` makes its mask, so the block mask vLLM's builder makes
    next is the retention's. Outside it, nothing changes."""
    from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadata

    own = FlexAttentionMetadata.__post_init__
    if getattr(own, "_flexkv", False):
        return

    def post_init(self):
        asked = _BUILDING.get()
        if asked is not None:
            set_retention(self, *asked)
        own(self)

    post_init._flexkv = True
    post_init.__wrapped__ = own
    FlexAttentionMetadata.__post_init__ = post_init


def apply_retention(metadata, sink: int, window: int):
    """`metadata` (a `FlexAttentionMetadata` of a `SinkWindowSpec` layer) attending the retention: its
    logical mask, its block hint, and the mask and block mask made again from them. Returns it."""
    set_retention(metadata, sink, window)
    metadata.mask_mod = metadata.get_mask_mod()
    metadata.block_mask = (metadata._build_block_mask_direct() if metadata.direct_build
                           else metadata.build_block_mask())
    return metadata
