"""vLLM's CPU attention with flexkv's sink + window retention.

`FlexKVCPUBackend` takes the place of vLLM's `CPU_ATTN` backend (vLLM's CPU platform selects no
other) and is vLLM's own backend for every layer of an engine without the `flexkv` entry, and
for the model's own sliding-window layers. For a full-attention decoder layer of an engine with
the entry, `FlexKVCPUImpl` attends what contract section 2 says a per-query window attends:
query `p` reads the sinks `j < sink` and `p - window <= j <= p`. Positions are stream indices, as
vLLM's rotary embedding applies them.

Such a layer stores its keys and values in vLLM's block layout `[blocks, heads, block, 2 * head]`
in plain token order (vLLM's CPU kernel stores them in an ISA-specific order, which flexkv does
not read), and every step runs one batched path over every query token of every request at once
(in tiles of tokens, never a loop per request): each token gathers its `sink + window + 1`
candidate keys through the block table, keeps those `query_window_attends` (flexkv.cache.masks)
admits, and takes a softmax over them in float32.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ...cache.masks import query_window_attends
from .options import check_engine

__all__ = ["FlexKVCPUBackend", "FlexKVCPUImpl", "sink_window_attention", "step_gather"]

#: bytes of gathered keys (or values) one tile of query tokens may take
TILE_BYTES = 64 << 20


def step_gather(block_table, query_start_loc, seq_lens, n: int, sink: int, window: int, bs: int, per_token: int,
                max_len=None) -> list:
    """Where every query token of a step reads, in tiles of tokens: `[(t0, t1, blocks, offsets, keep)]`,
    `blocks`/`offsets` `[T, S]` the block and in-block offset of each candidate key, `keep` `[T, S]`
    whether the query attends it (`query_window_attends`). The same for every layer of the step."""
    dev = query_start_loc.device
    starts = query_start_loc.to(torch.long)
    tokens = torch.arange(n, device=dev)
    row = torch.searchsorted(starts[1:], tokens, right=True)
    pos = seq_lens.to(torch.long)[row] - (starts[row + 1] - tokens)  # stream index of each query
    # Candidate slots: the sinks, then the window up to the query. In streams no longer than
    # `max_len` a window wider than `max_len - 1` already reaches the stream's start, and there are
    # at most `max_len` sinks: the candidates shrink, the attended set (decided below) does not.
    sinks, wide = sink, window
    if max_len is not None:
        sinks, wide = min(sink, max_len), min(window, max(max_len - 1, 0))
    slots = sinks + wide + 1
    offsets = torch.cat([torch.arange(sinks, device=dev), torch.arange(-wide, 1, device=dev)])
    is_sink = torch.arange(slots, device=dev) < sinks
    tile = max(1, TILE_BYTES // (slots * per_token))
    out = []
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        p = pos[t0:t1, None]
        j = torch.where(is_sink, offsets, p + offsets)  # [T, slots] candidate stream indices
        # A window slot below the sinks duplicates a sink slot (or is before the stream): drop it.
        keep = query_window_attends(j, p, sink, window) & (is_sink | (j >= sink)) & (j >= 0)
        jc = j.clamp(min=0)
        out.append((t0, t1, block_table[row[t0:t1, None], jc // bs].to(torch.long), jc % bs, keep[:, None, None, :]))
    return out


def sink_window_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                          sink: int, window: int, scale: float, out, max_len=None, gather=None) -> None:
    """Attention of every query token under a per-query sink + window, written into `out`.

    `query` `[N, Hq, D]` are the step's tokens of every request in order; `query_start_loc` `[R + 1]`
    where each request's tokens start; `seq_lens` `[R]` each request's length with this step's
    tokens; `key_cache` / `value_cache` `[blocks, H, B, D]` hold every token's key and value (this
    step's included) at `block_table[r, j // B]`, offset `j % B`. `out` `[N, Hq, D]`. `gather`: the
    step's `step_gather` (made here when None; every layer of a step may share one).
    """
    n, hq, d = query.shape
    h, bs = key_cache.shape[1], key_cache.shape[2]
    g = hq // h
    if gather is None:
        gather = step_gather(block_table, query_start_loc, seq_lens, n, sink, window, bs, h * d * 4, max_len)
    for t0, t1, blocks, offs, keep in gather:
        # [T, S, H, D] gathered, read as [T, H, S, D]; the GQA group rides on the query axis.
        k = key_cache[blocks, :, offs].float().transpose(1, 2)
        v = value_cache[blocks, :, offs].float().transpose(1, 2)
        q = query[t0:t1].float().view(t1 - t0, h, g, d)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
        out[t0:t1] = o.reshape(t1 - t0, hq, d).to(out.dtype)


class FlexKVCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with flexkv's retention on full-attention decoder layers when configured."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        retention = check_engine(get_current_vllm_config())
        if retention is not None and sliding_window is None:
            why = []
            if attn_type != AttentionType.DECODER:
                why.append(f"a layer of attention type {attn_type!r} (flexkv keeps decoder self-attention only)")
            if alibi_slopes is not None:
                why.append("ALiBi slopes (not applied by flexkv's attention)")
            if sinks is not None:
                why.append("learned attention-sink logits (not applied by flexkv's attention)")
            if logits_soft_cap:
                why.append(f"logits soft-capping at {logits_soft_cap} (not applied by flexkv's attention)")
            if kv_sharing_target_layer_name is not None:
                why.append(f"a layer reading another layer's cache ({kv_sharing_target_layer_name})")
            if why:
                raise ValueError(f"flexkv cannot serve {retention!r} exactly for this model: it has " + "; ".join(why))
        #: the layer's retention, or None: vLLM's own attention (no flexkv entry, or a sliding-window layer)
        self.retention = retention if sliding_window is None else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        pol = self.retention
        if pol is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            # vLLM fuses an output quantization only where the backend says it can
            # (`fused_output_quant_supported`, False here), so this is vLLM asking for what it was told is absent.
            raise NotImplementedError("vLLM passed an output scale to flexkv's attention, which does not fuse output "
                                      "quantization: turn off vLLM's attention + quantization fusion pass "
                                      "(compilation_config={'pass_config': {'fuse_attn_quant': False}})")
        n = attn_metadata.num_actual_tokens
        blocks, heads, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, heads, 2 * bs, -1).chunk(2, dim=2)
        out = output[:n].view(n, self.num_heads, self.head_size)
        # Every full-attention layer of the step reads the same places: found once, kept on the step's metadata.
        memo = attn_metadata.__dict__.setdefault("_flexkv_gather", {})
        key = (pol.sink, pol.window, bs, heads * self.head_size * 4)
        gather = memo.get(key)
        if gather is None:
            gather = memo[key] = step_gather(attn_metadata.block_table, attn_metadata.query_start_loc,
                                             attn_metadata.seq_lens, n, pol.sink, pol.window, bs, key[3],
                                             attn_metadata.max_seq_len)
        sink_window_attention(query[:n].view(n, self.num_heads, self.head_size), key_cache, value_cache,
                              attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                              pol.sink, pol.window, self.scale, out, gather=gather)
        return output


    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.retention is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        blocks, heads, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, heads, 2 * bs, -1).chunk(2, dim=2)
        n = min(slot_mapping.shape[0], key.shape[0])
        slots = slot_mapping[:n].to(torch.long)
        ok = slots >= 0  # padding tokens have no slot
        slots = slots[ok]
        key_cache[slots // bs, :, slots % bs] = key[:n][ok].to(key_cache.dtype)
        value_cache[slots // bs, :, slots % bs] = value[:n][ok].to(value_cache.dtype)


class FlexKVCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend whose implementation applies flexkv's retention where configured."""

    @staticmethod
    def get_impl_cls():
        return FlexKVCPUImpl
