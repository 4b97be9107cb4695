"""The retention over a paged KV cache, as the FlexAttention (GPU) path attends it: torch alone.

vLLM's FlexAttention backend lays a step out as one FlexAttention call: the step's query tokens,
every request's side by side, along the query axis, and the paged cache flattened to one axis of
`blocks * block_size` physical slots. A request's logical block `i` lives at physical block
`block_table[r, i]`; block 0 is the null block that freed entries point to. This module computes,
from plain tensors (no vLLM import, so it runs and is tested wherever torch runs), what flexkv adds
to that call:

- `PagedBatch`: the step's layout (block table, stream lengths, where each request's queries start,
  the request of each query row), with `query_positions` (each row's stream index) and
  `physical_to_logical` (each physical block's logical index per request, -1 where it holds none of
  the request's entries).
- `retention_block_mask`: the `BlockMask` over the physical cache: per block of query rows, the
  physical blocks that hold an entry one of its queries attends (a sink, or an entry of its
  window), built on the device from the block table with static shapes and no host
  synchronisation (a CUDA graph may hold it); its `mask_mod` is `query_window_attends` on logical
  indices, false for a slot that holds none of the query's request's live entries.
- `sink_scores` and `in_cache_score_mod`: in-cache positions (StreamingLLM's) over a cache whose
  keys are rotated at stream indices. Only a sink key's score differs from the kernel's own: the
  query at stream index `p` reads it turned by `e = max(0, p - sink - window)` more positions.
  `sink_scores` computes the step's few sink scores apart (O(sink) per query and layer) and
  `in_cache_score_mod` puts them in place of the sink keys' scores.

`flexkv.integrations.vllm.flex_backend` calls `sink_scores` and `in_cache_score_mod` with vLLM's
own metadata (whose block mask vLLM builds from the same hint); `benchmarks/cuda_check.py`
("paged" section) runs the whole call on CUDA with torch alone against a dense reference.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from ...cache.positions.masks import query_window_attends
from .rope import turned

__all__ = ["PagedBatch", "paged_batch", "query_positions", "physical_to_logical", "logical_kv_index",
           "retention_block_mask", "sink_scores", "in_cache_score_mod"]


class PagedBatch(NamedTuple):
    """One step over a paged cache. Tensors live on the cache's device."""

    #: `[R, max_blocks]` int: request `r`'s logical block `i` is physical block `block_table[r, i]` (0: null)
    block_table: torch.Tensor
    #: `[R]` int: each request's stream length once this step's tokens are in the cache
    seq_lens: torch.Tensor
    #: `[R + 1]` int: request `r`'s query tokens are rows `query_start_loc[r]:query_start_loc[r + 1]`
    query_start_loc: torch.Tensor
    #: `[rows]` int: the request of each query row; rows past the step's tokens (padding) name any request
    doc_ids: torch.Tensor
    #: entries per block
    block_size: int
    #: physical blocks in the cache (its flattened length is `num_blocks * block_size`)
    num_blocks: int


def paged_batch(block_table, seq_lens, query_lens, block_size: int, num_blocks: int, rows: int = 0) -> PagedBatch:
    """A `PagedBatch` from each request's query length (host data, as a scheduler has it), padded to `rows`
    query rows (at least the step's tokens); padding rows name the last request."""
    query_lens = torch.as_tensor(query_lens, dtype=torch.int64)
    if (query_lens < 1).any():
        raise ValueError(f"paged_batch: every request needs at least one query token, got query_lens "
                         f"{query_lens.tolist()}")
    tokens = int(query_lens.sum())
    rows = max(rows, tokens)
    device = block_table.device
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    starts[1:] = query_lens.cumsum(0)
    doc = torch.full((rows,), len(query_lens) - 1, dtype=torch.int64)
    doc[:tokens] = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    return PagedBatch(block_table, torch.as_tensor(seq_lens, device=device).long(), starts.to(device), doc.to(device),
                      block_size, num_blocks)


def query_positions(batch: PagedBatch) -> torch.Tensor:
    """`[rows]`: each query row's stream index (its request's stream length, less its query tokens, plus its
    offset among them)."""
    doc = batch.doc_ids.long()
    starts = batch.query_start_loc.long()
    first = batch.seq_lens.long() - (starts[1:] - starts[:-1])  # stream index of each request's first query
    return torch.arange(doc.shape[0], device=doc.device) - starts[doc] + first[doc]


def physical_to_logical(batch: PagedBatch) -> torch.Tensor:
    """`[R, num_blocks]` long: for each request and physical block, the largest logical block index of the
    request's live blocks (those below its stream length) that maps there, or -1; the null block is -1."""
    table = batch.block_table.long()
    r, width = table.shape
    logical = torch.arange(width, device=table.device)
    live = logical[None, :] < (batch.seq_lens.long()[:, None] + batch.block_size - 1) // batch.block_size
    live = live & (table > 0)  # the null block maps to nothing; every write to it carries -1
    out = torch.full((r, batch.num_blocks), -1, dtype=torch.long, device=table.device)
    return out.scatter_reduce_(1, torch.where(live, table, 0), torch.where(live, logical, -1), reduce="amax")


def logical_kv_index(batch: PagedBatch, to_logical: torch.Tensor, q_idx, physical_kv_idx):
    """(`valid`, logical index) of physical slot `physical_kv_idx` for query row `q_idx`: valid when the slot
    holds one of the row's request's entries below its stream length."""
    req = batch.doc_ids[q_idx]
    block = to_logical[req, physical_kv_idx // batch.block_size]
    kv = block * batch.block_size + physical_kv_idx % batch.block_size
    return (block >= 0) & (kv < batch.seq_lens[req]), kv


def retention_block_mask(batch: PagedBatch, sink: int, window: int, q_block: int = 16,
                         compute_q_blocks: bool = True) -> BlockMask:
    """The retention's `BlockMask` over the flattened paged cache (`[1, 1, rows, num_blocks * block_size]`,
    KV blocks of `block_size`, query blocks of `q_block` rows). Each query block lists the physical blocks,
    in ascending order, that hold an entry one of its rows attends. Static shapes, no host synchronisation.
    `compute_q_blocks=False` skips the transposed (backward) tables, as vLLM does on CUDA; inductor's CPU
    template needs them."""
    rows, bs = batch.doc_ids.shape[0], batch.block_size
    pos = query_positions(batch)
    doc = batch.doc_ids.long()
    table = batch.block_table.long()[doc]  # [rows, max_blocks]
    logical = torch.arange(table.shape[1], device=table.device)
    first_window = (pos - window).clamp(min=0) // bs  # the block of each row's oldest window entry
    read = (logical[None, :] <= pos[:, None] // bs) & ((logical[None, :] * bs < sink) |
                                                       (logical[None, :] >= first_window[:, None]))
    pages = torch.where(read, table, 0)
    pad = (-rows) % q_block
    if pad:
        pages = torch.cat((pages, pages.new_zeros(pad, pages.shape[1])))
    groups = pages.shape[0] // q_block
    present = torch.zeros(groups, batch.num_blocks, dtype=torch.bool, device=pages.device)
    present.scatter_(1, pages.view(groups, -1), True)
    present[:, 0] = False  # the null block holds nothing a query reads
    counts = present.sum(1, dtype=torch.int32)
    order = torch.sort((~present).to(torch.int8), dim=1, stable=True).indices.to(torch.int32)
    to_logical = physical_to_logical(batch)

    def mask_mod(b, h, q_idx, kv_idx):
        # The row's stream index from the batch's own tensors, not `pos`: inductor's CPU template takes the
        # tensors a mask reads only as buffers, and `pos` is an expression it would have to form.
        req = batch.doc_ids[q_idx]
        p = q_idx + batch.seq_lens[req] - batch.query_start_loc[req + 1]
        valid, kv = logical_kv_index(batch, to_logical, q_idx, kv_idx)
        return valid & query_window_attends(kv, p, sink, window)

    return BlockMask.from_kv_blocks(counts[None, None], order[None, None], BLOCK_SIZE=(q_block, bs),
                                    mask_mod=mask_mod, seq_lengths=(rows, batch.num_blocks * bs),
                                    compute_q_blocks=compute_q_blocks)


def sink_scores(query, key_cache, batch: PagedBatch, sink: int, window: int, scale: float, cos_sin,
                neox: bool, positions=None) -> torch.Tensor:
    """`[T, Hq, sink]`: each of the first `T = query.shape[0]` query rows' scaled scores (float32) against its
    request's sink keys at in-cache positions. `query` `[T, Hq, D]` and `key_cache` `[slots, H, D]` (the paged
    cache flattened) are rotated at stream indices; `cos_sin`, `neox`: the model's rotary table (`rope.turned`).
    `positions`: each row's stream index (default `query_positions(batch)`). A sink slot past a request's
    stream scores whatever the cache holds there; the mask never admits it. No host synchronisation."""
    t = query.shape[0]
    heads, d = key_cache.shape[1], key_cache.shape[2]
    req = batch.doc_ids[:t].long()
    p = (query_positions(batch) if positions is None else positions)[:t]
    evicted = (p - sink - window).clamp(min=0)
    j = torch.arange(sink, device=query.device)
    bs = batch.block_size
    slots = batch.block_table[:, j // bs].long() * bs + j % bs  # [R, sink]
    k = key_cache[slots[req]].float().transpose(1, 2)  # [T, H, sink, D], rotated at stream indices j
    k = turned(k, evicted, cos_sin, neox)  # at j + e: the query's distance to it in the cache
    q = query.float().view(t, heads, -1, d)  # [T, H, G, D]: the GQA group of each key head
    return (torch.einsum("thgd,thsd->thgs", q, k) * scale).reshape(t, -1, sink)


def in_cache_score_mod(scores, sink: int, logical_kv: Callable) -> Callable:
    """FlexAttention's `score_mod` over the physical cache for in-cache positions: a sink key's score is the
    query row's from `scores` (`sink_scores`), every other key's the kernel's own. `logical_kv(q_idx,
    physical_kv_idx)` gives a slot's logical index for a query row (where the slot is not the row's, any
    value: the mask drops it)."""

    def in_cache(score, b, h, q_idx, physical_kv_idx):
        kv = logical_kv(q_idx, physical_kv_idx)
        return torch.where(kv < sink, scores[q_idx, h, kv.clamp(0, sink - 1)].to(score.dtype), score)

    return in_cache
