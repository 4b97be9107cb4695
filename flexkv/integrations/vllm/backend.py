"""vLLM's CPU attention with flexkv's sink + window retention.

`FlexKVCPUBackend` takes the place of vLLM's `CPU_ATTN` backend (vLLM's CPU platform selects no
other) and is vLLM's own backend for every layer of an engine without the `flexkv` entry, and
for the model's own sliding-window layers. For a full-attention decoder layer of an engine with
the entry, `FlexKVCPUImpl` attends what contract section 2 says a per-query window attends:
query `p` reads the sinks `j < sink` and `p - window <= j <= p`.

Positions (`options.serving_positions`): vLLM's rotary embedding turns every query and key by its
stream index before attention sees it. That is `"stream"`. For `"cache"` (StreamingLLM's in-cache
positions) nothing about a window key changes: it keeps its distance to the query. Only a sink key
sits `e` positions closer to the query in-cache than by stream index, where `e = p - sink - window`
is the number of entries the query's stream has evicted; so each query reads its sink keys turned
by a further `e` positions (`turn_sinks`), taken from the model's own rotary table.

Such a layer keeps vLLM's own cache: vLLM's layout and vLLM's write (`cpu_attn_reshape_and_cache`,
in the per-ISA order `cpu_layout` finds). A step in which no request has evicted anything (every
stream at most `sink + window + 1` long: the retention is then plain causal attention) goes to
vLLM's own kernel unchanged. A decode step past eviction (one query per request) that does not go to
vLLM's kernel (below) runs one batched path over every request at once: each query gathers its
`sink + window + 1` candidate keys through the block table (reading vLLM's layout,
`cpu_layout.RegionReader`), keeps those `query_window_attends` (flexkv.cache.positions.masks) admits, and
takes a softmax over them in float32. A step with prompt chunks past eviction (`band_attention`) takes
each request's queries a tile of up to `BAND_TILE` at a time: the tile's `T` queries attend one span of
`window + T` entries (gathered once per request) through PyTorch's fused CPU attention kernel, each
query masked to its own window, and the sinks in torch, the two joined by their log-sum-exps (the
per-token gather read `T * (sink + window + 1)` entries: on SmolLM2 with a window of 1,020, a served
prompt ran at about 20 tokens/s that way).

The requests of a step that decode one token past eviction (the whole step, or beside prompt chunks:
`decode_batch`) go to vLLM's own sliding-window kernel, with a window of `sink + window + 1` keys:
before it runs, each request's sink keys and values are copied (read from the sink slots, which
nothing overwrites) into the `sink` slots just below its query's window, entries the retention has
already evicted (`decode_plan`; the block manager keeps those slots, `spec.SinkWindowManager`). That
is O(sink) work per request and layer: one gather and one scatter over the layer's flat cache
(`decode_elements`). Until a request has evicted `sink` entries the copies would land on the sinks
themselves, so a step holding one takes the other paths.
With prefix caching on, the slots below a window may lie in a block the prefix cache hands to other
requests (a shared system prompt's tail), so those blocks are not written: the block holding the
window's first entry is copied whole into a scratch block the request holds past its tokens, the
sinks are written below the window there, and the kernel reads a block table with the scratch in its
place (one block copy more per request and layer).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import vllm.envs as envs
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ...cache.positions.masks import query_window_attends
from .cpu_layout import RegionReader, element_index, region_order, split_cache
from .options import check_engine, serving_positions, startup_line
from .requests import own_retention_unserved
from .rope import model_rotary, turned
from .spec import SCRATCH_BLOCKS

__all__ = ["FlexKVCPUBackend", "FlexKVCPUImpl", "sink_window_attention", "band_attention", "band_plan", "step_gather",
           "turn_sinks", "decode_plan", "DecodePlan", "decode_batch", "DecodeBatch", "decode_elements"]

logger = init_logger("vllm.flexkv")  # under vLLM's logger, whose handler prints INFO
_announced = set()

#: bytes of gathered keys (or values) one tile of query tokens may take
TILE_BYTES = 64 << 20


def step_gather(block_table, query_start_loc, seq_lens, n: int, sink: int, window: int, bs: int, per_token: int,
                max_len=None, rows=None) -> list:
    """Where every query token of a step reads, in tiles of tokens: `[(t0, t1, blocks, offsets, keep, evicted)]`,
    `blocks`/`offsets` `[T, S]` the block and in-block offset of each candidate key (the sink slots
    first), `keep` `[T, S]` whether the query attends it (`query_window_attends`), `evicted` `[T]` how
    many entries the query's stream has evicted (`p - sink - window`, at least 0). The same for every
    layer of the step. `rows` `[R, 2]`: each request's own (sink, window), none wider than `sink` and
    `window` (`requests.row_retention`); None: every request keeps `sink` and `window`."""
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
        s, w = (sink, window) if rows is None else (rows[row[t0:t1], 0:1], rows[row[t0:t1], 1:2])
        # A sink slot past the request's own sinks, and a window slot below them (or before the stream), would
        # duplicate the other kind's slot of the same entry: drop them.
        keep = query_window_attends(j, p, s, w) & torch.where(is_sink, j < s, j >= s) & (j >= 0)
        jc = j.clamp(min=0)
        evicted = (p - s - w).clamp(min=0)[:, 0]
        out.append((t0, t1, block_table[row[t0:t1, None], jc // bs].to(torch.long), jc % bs, keep[:, None, None, :],
                    evicted))
    return out


def turn_sinks(k, sinks: int, evicted, cos_sin, neox: bool):
    """`k` `[T, H, S, D]` (float32) with its first `sinks` slots turned by `evicted[t]` positions (`rope.turned`), in
    place: each query reads its sink keys at their in-cache positions. Rows with nothing evicted are left as
    they are."""
    rows = (evicted > 0).nonzero().flatten()
    if sinks == 0 or rows.numel() == 0:
        return k
    k[rows, :, :sinks] = turned(k[rows, :, :sinks], evicted[rows], cos_sin, neox)
    return k


class DecodeBatch(NamedTuple):
    """The one-query requests of a step as a batch of their own (`decode_batch`): vLLM's kernel attends them."""

    #: `[D]` their indices among the step's requests, and their query rows of the step
    requests: torch.Tensor
    queries: torch.Tensor
    #: vLLM's metadata of the batch: `[D]` stream lengths, `[D + 1]` query starts, `[D, blocks]` block table
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    #: whether it is the whole step (then `queries` are its first rows and nothing is gathered)
    whole: bool


def decode_batch(block_table, query_start_loc, seq_lens) -> DecodeBatch:
    """The requests of a step that decode one token, as vLLM's kernel takes a batch (a step mixing them with
    prompt chunks attends the chunks elsewhere)."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    one = (counts == 1).nonzero().flatten()
    whole = len(one) == len(counts)
    sub = torch.arange(len(one) + 1, dtype=query_start_loc.dtype)
    return DecodeBatch(one, query_start_loc[one].to(torch.long), seq_lens[one], sub, block_table[one], whole)


class DecodePlan(NamedTuple):
    """Where a decode step copies its requests' sinks (`decode_plan`); the same for every layer."""

    #: `[R]` the requests that copy; `(blocks, offsets)` `[R, sink]` where each one's sinks are read
    rows: torch.Tensor
    sources: tuple
    #: `[R * sink]` the physical slots the copies are written to, just below each query's window
    targets: torch.Tensor
    #: `[R]` how many entries each has evicted (its sinks are turned by that much under "cache" positions)
    evicted: torch.Tensor
    #: the block table the kernel reads: vLLM's, or a copy with scratch blocks in place of the blocks below
    #: each window
    table: torch.Tensor
    #: `(sources, targets)` physical blocks copied whole before the sinks are written, or None
    copies: Optional[tuple]


def decode_plan(block_table, seq_lens, sink: int, window: int, bs: int, scratch: bool = False):
    """Where a decode step (one query per request, at stream index `seq_lens - 1`) copies its requests'
    sinks (`DecodePlan`), or None when some request has evicted fewer than `sink` entries but more than
    none (its copies would overwrite its own sinks).

    The copies go to the `sink` slots just below each query's window. Without `scratch` they are
    written where they lie (blocks of evicted entries the manager keeps). With `scratch` (prefix
    caching, where those blocks may be cached and read by other requests) nothing of the request's
    own blocks is written: the block holding the window's first entry is copied whole into the
    request's first scratch block (the one after the block its query lands in, `spec.SinkWindowManager`),
    the slots below it (when the copies reach into the block before) are taken by the second scratch
    block, and the kernel reads a block table with those in their places."""
    p = seq_lens.to(torch.long) - 1
    evicted = p - sink - window
    if sink and ((evicted > 0) & (evicted < sink)).any():
        return None
    rows = (evicted >= sink).nonzero().flatten() if sink else evicted[:0]
    i = torch.arange(sink)
    src = block_table[rows[:, None], i[None, :] // bs].to(torch.long), (i % bs).expand(len(rows), sink)
    first = p[rows] - window  # each query's first window entry
    dst = (first - sink)[:, None] + i[None, :]
    table, copies = block_table, None
    if scratch and len(rows):
        last = p[rows] // bs  # the block the query lands in; the scratch blocks follow it
        table = block_table.clone()
        below = (first - 1) // bs
        copies = (block_table[rows, below].to(torch.long), block_table[rows, last + 1].to(torch.long))
        table[rows, below] = block_table[rows, last + 1]
        lowest = (first - sink) // bs
        straddle = lowest != below
        table[rows[straddle], lowest[straddle]] = block_table[rows[straddle], last[straddle] + 2]
    targets = (table[rows[:, None], dst // bs].to(torch.long) * bs + dst % bs).flatten()
    return DecodePlan(rows, src, targets, evicted[rows], table, copies)


def decode_elements(plan: DecodePlan, orders, heads: int):
    """`(src, dst)`: the elements a decode step's sink copies read, `[R, sink, 2, heads, head_size]` (each sink's
    key and value), and the flat positions they are written to, alike, in a layer's cache flattened
    (`cpu_layout.element_index`, through the region `orders`). The same for every layer of the step."""
    blocks, offsets = plan.sources
    bs = orders[0].shape[0]
    dst = element_index(plan.targets // bs, plan.targets % bs, orders, heads).view((len(plan.rows),) + blocks.shape[1:]
                                                                                    + (2, heads, -1))
    return element_index(blocks, offsets, orders, heads), dst


def _token_major(cache, blocks, offsets):
    return cache[blocks, :, offsets]


def sink_window_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                          sink: int, window: int, scale: float, out, max_len=None, gather=None, rotary=None,
                          read_keys=_token_major, read_values=_token_major, rows=None) -> None:
    """Attention of every query token under a per-query sink + window, written into `out`.

    `query` `[N, Hq, D]` are the step's tokens of every request in order; `query_start_loc` `[R + 1]`
    where each request's tokens start; `seq_lens` `[R]` each request's length with this step's
    tokens; `key_cache` / `value_cache` `[blocks, H, B, D]` hold every token's key and value (this
    step's included) at `block_table[r, j // B]`, offset `j % B`. `out` `[N, Hq, D]`. `gather`: the
    step's `step_gather` (made here when None; every layer of a step may share one). `rotary`:
    `(cos_sin, neox)` of the model's rotary table for in-cache positions (`turn_sinks`), None for stream
    positions. `read_keys` / `read_values`: `(cache, blocks [T, S], offsets [T, S]) -> [T, S, H, D]`
    (`cpu_layout.RegionReader` for vLLM's layout; token-major `[blocks, H, B, D]` caches by default).
    `rows` `[R, 2]`: each request's own sink and window, within `sink` and `window` (`step_gather`).
    """
    n, hq, d = query.shape
    h, bs = key_cache.shape[1], key_cache.shape[2]
    g = hq // h
    if gather is None:
        gather = step_gather(block_table, query_start_loc, seq_lens, n, sink, window, bs, h * d * 4, max_len, rows)
    sinks = min(sink, max_len) if max_len is not None else sink
    for t0, t1, blocks, offs, keep, evicted in gather:
        # [T, S, H, D] gathered, read as [T, H, S, D]; the GQA group rides on the query axis.
        k = read_keys(key_cache, blocks, offs).float().transpose(1, 2)
        if rotary is not None:
            turn_sinks(k, sinks, evicted, *rotary)
        v = read_values(value_cache, blocks, offs).float().transpose(1, 2)
        q = query[t0:t1].float().view(t1 - t0, h, g, d)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
        out[t0:t1] = o.reshape(t1 - t0, hq, d).to(out.dtype)


#: query tokens of one request attended together by `band_attention`: a tile's span (`window + T` keys) holds
#: `window + 1` each query reads, so smaller tiles waste less of it; below 32 the calls cost more than they save
BAND_TILE = 64


class BandTile(NamedTuple):
    """One tile of a request's query tokens (`band_plan`)."""

    #: the tile's rows of the step, and its span as a slice of its request's span
    t0: int
    t1: int
    j0: int
    j1: int
    #: `[T * group, j1 - j0]` 0 where a query (each repeated for its `group` query heads) reads a span entry,
    #: `-inf` elsewhere
    mask: torch.Tensor
    #: `[T]` whether each query reads some span entry (one within its sinks reads none)
    spans: torch.Tensor


class BandRequest(NamedTuple):
    """One request of a step with prompt chunks (`band_plan`): where its sinks and its span lie, and its tiles."""

    #: the request's rows of the step
    q0: int
    q1: int
    sinks: int
    #: `(blocks, offsets)` `[1, S]` of the sinks and `[1, J]` of the span (the window entries past the sinks that
    #: some query of the request reads, oldest first)
    sink_at: tuple
    span_at: tuple
    #: `[Q, S]` which sink each query reads; `[Q]` each query's eviction count under the request's retention
    reach: torch.Tensor
    evicted: torch.Tensor
    tiles: list


def band_plan(block_table, query_start_loc, seq_lens, sink: int, window: int, bs: int, rows=None,
              group: int = 1, skip=()) -> list:
    """Where `band_attention` reads, the same for every layer of a step: a `BandRequest` per request (but those
    in `skip`, attended elsewhere), its query tokens in tiles of `BAND_TILE`, under each request's own (sink,
    window) (`rows`); `group` query heads per KV head. Host tensors."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    own = rows.tolist() if rows is not None else None
    out = []
    for r in range(len(starts) - 1):
        if r in skip:
            continue
        q0, q1 = starts[r], starts[r + 1]
        s, w = own[r] if own is not None else (sink, window)
        first = lens[r] - (q1 - q0)  # stream index of the request's first query token
        sinks = min(s, lens[r])
        i = torch.arange(sinks)
        lo = max(s, first - w)  # the request's span: window entries past the sinks, up to its last query
        j = torch.arange(lo, max(lo, lens[r]))  # empty while the stream is within its sinks
        tiles = []
        for t0 in range(q0, q1, BAND_TILE):
            t1 = min(q1, t0 + BAND_TILE)
            p = torch.arange(first + t0 - q0, first + t1 - q0)  # [T] the queries' stream indices
            j0 = max(lo, int(p[0]) - w) - lo
            j1 = max(j0, int(p[-1]) + 1 - lo)
            jt = j[j0:j1]
            keep = (jt[None, :] >= p[:, None] - w) & (jt[None, :] <= p[:, None])
            mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf")).repeat_interleave(group, dim=0)
            tiles.append(BandTile(t0, t1, j0, j1, mask, keep.any(dim=1)))
        p = torch.arange(first, lens[r])
        out.append(BandRequest(q0, q1, sinks, (block_table[r, i // bs].to(torch.long)[None], (i % bs)[None]),
                               (block_table[r, j // bs].to(torch.long)[None], (j % bs)[None]),
                               i[None, :] <= p[:, None], (p - s - w).clamp(min=0), tiles))
    return out


def _span_attention(q, k, v, mask, spans, scale):
    """`(out [T, H, g, D], lse [T, H, g])`: the tile's queries `[T, H, g, D]` over span keys and values `[H, J, D]`
    under `mask` (`BandTile.mask`), through PyTorch's CPU flash-attention kernel, which gives the log-sum-exp
    the join with the sinks needs (`scaled_dot_product_attention` does not return it). A query that reads no
    span entry (`spans` false) gets 0 and `-inf` (the kernel gives it 0 and 0)."""
    T, H, g, D = q.shape
    if k.shape[1] == 0:
        return q.new_zeros(q.shape), q.new_full((T, H, g), float("-inf"))
    rows = q.permute(1, 0, 2, 3).reshape(1, H, T * g, D)  # row t * g + i: query t, its i-th head of the group
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, k[None], v[None], 0.0, False,
                                                                          attn_mask=mask[None, None], scale=scale)[:2]
    lse = lse.view(H, T, g).permute(1, 0, 2).masked_fill(~spans[:, None, None], float("-inf"))
    return out.view(H, T, g, D).permute(1, 0, 2, 3), lse


def band_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sink: int, window: int,
                   scale: float, out, rotary=None, read_keys=_token_major, read_values=_token_major, rows=None,
                   plan=None) -> None:
    """What `sink_window_attention` computes, a request's consecutive query tokens at a time: each request's
    span (the window entries past the sinks its queries read) and sinks are gathered once per layer; a tile
    of `T` queries attends its `window + T` entries of the span through one fused CPU attention call, each
    query masked to its own window (`query_window_attends`); the request's queries attend their sinks in
    torch (with `rotary`, each query's sink keys turned by its own eviction count, `turn_sinks`), and the
    two parts are joined by their log-sum-exps into one softmax, in float32. For steps with prompt chunks.
    Host tensors (vLLM's CPU metadata); arguments as `sink_window_attention`'s; `plan`: the step's
    `band_plan` (made here when None; every layer of a step may share one)."""
    n, hq, d = query.shape
    h, bs = key_cache.shape[1], key_cache.shape[2]
    g = hq // h
    if plan is None:
        plan = band_plan(block_table, query_start_loc, seq_lens, sink, window, bs, rows, g)
    for q0, q1, sinks, sink_at, span_at, reach, evicted, tiles in plan:
        k = read_keys(key_cache, *span_at)[0].float().transpose(0, 1)  # [H, J, D]
        v = read_values(value_cache, *span_at)[0].float().transpose(0, 1)
        q = query[q0:q1].float().view(q1 - q0, h, g, d)
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:3])
        for t0, t1, j0, j1, mask, spans in tiles:
            o[t0 - q0:t1 - q0], lse[t0 - q0:t1 - q0] = _span_attention(q[t0 - q0:t1 - q0], k[:, j0:j1], v[:, j0:j1],
                                                                       mask, spans, scale)
        if sinks:
            ks = read_keys(key_cache, *sink_at)[0].float().transpose(0, 1).expand(q1 - q0, -1, -1, -1)  # [Q, H, S, D]
            if rotary is not None:
                ks = turn_sinks(ks.clone(), sinks, evicted, *rotary)
            scores = (torch.einsum("thgd,thsd->thgs", q, ks) * scale).masked_fill(~reach[:, None, None, :],
                                                                                 float("-inf"))
            total = torch.logaddexp(lse, torch.logsumexp(scores, -1))  # every query reads a key: finite
            sink_v = read_values(value_cache, *sink_at)[0].float().transpose(0, 1)
            o = o * torch.exp(lse - total)[..., None] + \
                torch.einsum("thgs,hsd->thgd", torch.exp(scores - total[..., None]), sink_v)
        out[q0:q1] = o.reshape(q1 - q0, hq, d).to(out.dtype)


class FlexKVCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with flexkv's retention on full-attention decoder layers when configured."""

    def __init__(self, *args, **kwargs) -> None:
        # vLLM's arguments pass through as vLLM gives them (a newer vLLM may add some); what flexkv needs
        # is read back from the attributes vLLM's class sets.
        super().__init__(*args, **kwargs)
        retention = check_engine(get_current_vllm_config())
        windowed = getattr(self, "sliding_window", -1) not in (None, -1)
        if retention is not None and not windowed:
            why = []
            attn_type = getattr(self, "attn_type", AttentionType.DECODER)
            if attn_type != AttentionType.DECODER:
                why.append(f"a layer of attention type {attn_type!r} (flexkv keeps decoder self-attention only)")
            if getattr(self, "alibi_slopes", None) is not None:
                why.append("ALiBi slopes (not applied by flexkv's attention)")
            if getattr(self, "sinks", None) is not None:
                why.append("learned attention-sink logits (not applied by flexkv's attention)")
            if getattr(self, "logits_soft_cap", 0):
                why.append(f"logits soft-capping at {self.logits_soft_cap} (not applied by flexkv's attention)")
            if getattr(self, "kv_sharing_target_layer_name", None) is not None:
                why.append(f"a layer reading another layer's cache ({self.kv_sharing_target_layer_name})")
            if why:
                raise ValueError(f"flexkv cannot serve {retention!r} exactly for this model: it has " + "; ".join(why))
        #: the layer's retention, or None: vLLM's own attention (no flexkv entry, or a sliding-window layer)
        self.retention = None if windowed else retention
        self.positions = None
        self._rotary = None
        self._readers = None
        if self.retention is not None:
            cfg = get_current_vllm_config()
            #: "cache" or "stream" (options.serving_positions)
            self.positions = serving_positions(cfg)
            self.max_model_len = cfg.model_config.max_model_len
            #: blocks a request holds past its tokens for a decode step's sink copies: with prefix caching, where
            #: the slots below a window may lie in a cached block other requests read (`decode_plan`)
            self.scratch_blocks = SCRATCH_BLOCKS if cfg.cache_config.enable_prefix_caching else 0
            line = startup_line(self.retention, self.positions, self.max_model_len, bool(self.scratch_blocks),
                                own_retention_unserved(cfg, current_platform))
            if line not in _announced:
                _announced.add(line)
                logger.info(line)

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
        rows = attn_metadata.__dict__.get("flexkv_rows")  # requests of their own retention (requests.py)
        if rows is None:
            evicting = attn_metadata.max_seq_len > pol.sink + pol.window + 1
        else:
            seq = attn_metadata.seq_lens[:rows.shape[0]].to(torch.long)
            evicting = bool((seq > rows.sum(1) + 1).any())
        if not evicting:
            # no stream of the step has evicted anything: the retention is causal attention, vLLM's own kernel
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        blocks, heads, bs, _ = kv_cache.shape
        key_cache, value_cache = split_cache(kv_cache)
        if self._readers is None:
            orders = region_order(layer.isa, kv_cache.dtype, bs, self.head_size)
            self._readers = tuple(RegionReader(order) for order in orders)
        rotary = None
        if self.positions == "cache":
            if self._rotary is None:
                rope = model_rotary(self.head_size, self.max_model_len)
                self._rotary = (rope.cos_sin_cache, rope.is_neox_style)
            rotary = self._rotary
        memo = attn_metadata.__dict__.setdefault("_flexkv", {})
        decoded = None  # the step's requests attended below, when the step also holds prompt chunks
        if rows is None:  # the step's one-query requests on vLLM's sliding-window kernel, the sinks copied below
            entry = ("decode", pol.sink, pol.window, bs)
            if entry not in memo:
                batch = decode_batch(attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens)
                plan = decode_plan(batch.block_table, batch.seq_lens, pol.sink, pol.window, bs,
                                   scratch=bool(self.scratch_blocks)) if len(batch.requests) else None
                # the elements the sink copies read and write: the same in every layer's cache
                moves = None if plan is None else decode_elements(plan, tuple(r.order for r in self._readers), heads)
                memo[entry] = (batch, plan, moves)
            batch, plan, moves = memo[entry]
            if plan is not None:
                self._decode_in_window(layer, query, kv_cache, key_cache, value_cache, batch, output, memo, plan,
                                       moves, rotary)
                if batch.whole:
                    return output
                decoded = batch
        out = output[:n].view(n, self.num_heads, self.head_size)
        if attn_metadata.max_query_len > 1:  # prompt chunks: each request's queries a tile at a time
            entry = ("band", pol.sink, pol.window, bs, rows is None)
            if entry not in memo:  # the same for every layer of the step
                memo[entry] = band_plan(attn_metadata.block_table, attn_metadata.query_start_loc,
                                        attn_metadata.seq_lens, pol.sink, pol.window, bs, rows,
                                        self.num_heads // self.num_kv_heads,
                                        () if decoded is None else set(decoded.requests.tolist()))
            band_attention(query[:n].view(n, self.num_heads, self.head_size), key_cache, value_cache,
                           attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens, pol.sink,
                           pol.window, self.scale, out, rotary=rotary, read_keys=self._readers[0],
                           read_values=self._readers[1], rows=rows, plan=memo[entry])
            return output
        # Every full-attention layer of the step reads the same places: found once, kept on the step's metadata.
        entry = (pol.sink, pol.window, bs, heads * self.head_size * 4, rows is None)
        gather = memo.get(entry)
        if gather is None:
            gather = memo[entry] = step_gather(attn_metadata.block_table, attn_metadata.query_start_loc,
                                               attn_metadata.seq_lens, n, pol.sink, pol.window, bs, entry[3],
                                               attn_metadata.max_seq_len, rows)
        sink_window_attention(query[:n].view(n, self.num_heads, self.head_size), key_cache, value_cache,
                              attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                              pol.sink, pol.window, self.scale, out, gather=gather, rotary=rotary,
                              max_len=attn_metadata.max_seq_len, read_keys=self._readers[0],
                              read_values=self._readers[1])
        return output

    def _decode_in_window(self, layer, query, kv_cache, key_cache, value_cache, batch, output, memo, plan, moves,
                          rotary) -> None:
        """The step's one-query requests (`batch`, a `DecodeBatch`) on vLLM's sliding-window kernel: the sinks
        copied below each query's window first (`plan`, `moves`: `decode_plan`'s and `decode_elements`';
        `key_cache`, `value_cache`: `kv_cache`'s halves, `split_cache`)."""
        src, dst = moves
        if plan.copies is not None:  # the blocks below the windows, copied whole into the scratch blocks first
            whole = kv_cache.view(kv_cache.shape[0], -1)
            whole.index_copy_(0, plan.copies[1], whole.index_select(0, plan.copies[0]))
        if plan.rows.numel():
            flat = kv_cache.view(-1)
            moved = flat.index_select(0, src.view(-1)).view(src.shape)  # [R, S, 2, H, D]: each sink's key, value
            if rotary is not None:
                k = moved[:, :, 0].transpose(1, 2).float()  # [R, H, S, D]
                moved[:, :, 0] = turned(k, plan.evicted, *rotary).transpose(1, 2).to(moved.dtype)
            flat.index_copy_(0, dst.view(-1), moved.view(-1))
        reach = self.retention.sink + self.retention.window + 1  # keys vLLM's window spans: sinks, window, query
        entry = ("scheduler", reach)
        if entry not in memo:
            memo[entry] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=batch.seq_lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=batch.seq_lens, dtype=query.dtype,
                query_start_loc=batch.query_start_loc, causal=True, sliding_window_size=reach,
                isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype)
        d = batch.seq_lens.shape[0]
        if batch.whole:
            q, out = query[:d], output[:d]
        else:  # a step mixing decodes with prompt chunks: the decodes' rows gathered, attended, put back
            q, out = query.index_select(0, batch.queries), output.new_empty((d,) + output.shape[1:])
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=self.scale,
            causal=True, alibi_slopes=None, sliding_window=reach, block_table=plan.table,
            softcap=0, scheduler_metadata=memo[entry], s_aux=None, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        if not batch.whole:
            output.index_copy_(0, batch.queries, out)


class FlexKVCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend whose implementation applies flexkv's retention where configured."""

    @staticmethod
    def get_impl_cls():
        return FlexKVCPUImpl
