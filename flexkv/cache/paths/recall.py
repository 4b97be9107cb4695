"""The memory part of a `Recall` retention: block means kept once, blocks chosen on the device, merged by log-sum-exp.

A `flexkv.config.Recall` cache keeps `memory + block - 1` more cells in every
slot's ring, so the entries that left the window stay in the slot. The
window part (sinks, window, the step's own tokens) is attended by the
cache's usual paths, unchanged; this module attends the memory part of the
same softmax, and `CacheGroup.attend` merges the two by their log-sum-exps
(`flexkv.cache.paths.merge`), which is exact: the two key sets are disjoint.

Blocks are `block` stream entries counted from the first entry after the
sinks. `MemoryIndex` keeps, per layer and slot row, the mean key of each
block once it is whole (written when the step that writes its last entry
attends the layer; `ring_len / block + 1` blocks per row, so a block's mean
outlives its cells): a step scores `memory / block` means, not `memory`
keys. Per layer and step, all on the device, no host read (a compiled step
neither waits nor recompiles as memories fill):

1. the means of the blocks some query of the step may read, read from the
   index (under in-cache rotary positions, turned to the position just
   before the step's first window entry: the index keeps them un-rotated);
2. scored against the sum of the row's queries over the step and the KV
   head's query heads; a stable descending sort keeps the `top_k` highest
   (ties to the lower block);
3. the chosen blocks' keys and values (`top_k * block` per row and KV head)
   and the row's tail (the entries that left the window while their block
   is not yet whole, fewer than `block` per query) gathered from the ring,
   each query masked to its own memory, attended in float32 (float64 for a
   float64 cache) with the user's `score_mod`.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ...config import BoundedKVConfig
from ..host.layout import Layout
from ..positions.rotary import apply_rotary
from ..storage.slot_copy import SlotBuffer, plan_slot_rows

__all__ = ["MemoryIndex", "attend_memory", "check_recall_call"]


def check_recall_call(config: BoundedKVConfig, query_only, joined, relative: bool = False) -> None:
    """Refuse what the memory part does not serve, naming it (before anything is written)."""
    if relative:
        raise ValueError(f"attend: a RelativePositionScores score_mod is not served under {config.recall!r} "
                         f"(its table is formed for the window's distances); use a SinkWindow cache")
    if query_only is not None:
        raise ValueError(f"attend: query_only queries are not served under {config.recall!r} (their memory "
                         f"selection is not defined); attend them with a SinkWindow cache")
    if joined is not None:
        raise ValueError(f"attend: joined keys are not served under {config.recall!r}; merge the parts by "
                         f"return_lse=True and flexkv.merge_attention instead")


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class MemoryIndex(nn.Module):
    """Per layer, the mean key of each whole block of each slot row (`[rows + 1, blocks, H, D]`; the last
    row is where padding rows write), allocated once. Block `b` of a stream lives at `b % blocks`."""

    def __init__(self, config: BoundedKVConfig, layout: Layout, device: torch.device):
        super().__init__()
        recall = config.recall
        self.block = recall.block
        self.blocks = -(-layout.ring_len // recall.block) + 1
        self.rows = config.max_slots * config.rows_per_request
        self.rows_per_request = config.rows_per_request
        self.slots_base, self.slot_row_len = layout.slots_base, layout.slot_row_len
        shape = (self.rows + 1, self.blocks, config.num_heads, config.head_dim)
        for layer in range(config.num_layers):
            # Cache state, not model weights: kept out of a model's state_dict.
            self.register_buffer(f"means_{layer}", torch.zeros(shape, dtype=_work(config.dtype), device=device),
                                 persistent=False)

    def means(self, layer: int) -> torch.Tensor:
        return getattr(self, f"means_{layer}")

    @property
    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def slot_bytes(self) -> int:
        return self.memory_bytes // (self.rows + 1) * self.rows_per_request

    def slot_buffers(self):
        for buf in self.buffers():
            yield SlotBuffer(buf, 0, 0, self.rows_per_request)

    def row_of(self, plan) -> torch.Tensor:
        """`[N]`: each plan row's slot row, the spare row for padding rows."""
        return plan_slot_rows(plan, self.slots_base, self.slot_row_len, self.rows)[0]


def _cells(plan, j: torch.Tensor, ring: int, T: int, S: int) -> torch.Tensor:
    """Layer-tensor cells of stream entries `j` (`[N, ...]`) held by the ring after the step's write; a cell
    nothing reads elsewhere (sinks, entries not written or overwritten, padding rows)."""
    N = j.shape[0]
    view = (N,) + (1,) * (j.dim() - 1)
    end = plan.n.long().view(view) + T
    held = (j >= plan.sink.long().view(view)) & (j < end) & (j >= end - ring)
    cells = plan.ring_base.long().view(view) + torch.remainder(j, ring)
    return torch.where(held, cells, 0).clamp(0, S - 1)


@torch.library.custom_op("flexkv::gather_head_cells", mutates_args=())
def gather_head_cells(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Rows `flat` of layer tensor `x` (`[1, H, S, width]`) viewed as `[H * S, width]` (row `h * S + cell`
    is head `h`'s cell): `[len(flat), width]`. One op opaque to a compiled graph: inductor calls
    `index_select` as it is (a row copy) instead of generating a slower gather loop for it."""
    return x.reshape(-1, x.shape[-1]).index_select(0, flat)


@gather_head_cells.register_fake
def _(x, flat):
    return x.new_empty(flat.shape[0], x.shape[-1])


def _read(kc: torch.Tensor, scale: Optional[torch.Tensor], cells: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """Cells `[N, H, L]` (one list per KV head) of a layer tensor `[1, H, S, D]`, dequantized: `[N, H, L, D]`.
    Read as whole rows of the flattened `[H * S, D]` tensor (`index_select`: several times faster on the
    CPU than indexing by a head and a cell tensor)."""
    N, H, L = cells.shape
    S = kc.shape[2]
    flat = (torch.arange(H, device=kc.device).view(1, H, 1) * S + cells).reshape(-1)
    out = gather_head_cells(kc, flat).view(N, H, L, -1).to(work)
    if scale is None:
        return out
    return out * gather_head_cells(scale, flat).view(N, H, L, 1)


def index_blocks(index: MemoryIndex, layer: int, config: BoundedKVConfig, layout: Layout, kc: torch.Tensor,
                 key_scale: Optional[torch.Tensor], plan, T: int, rotary=None) -> None:
    """Write the mean key of every block the step's committed tokens make whole (at most `T // block + 1`
    per row); under in-cache positions (`rotary`) the keys are turned back to position 0 first."""
    bs = config.recall.block
    C = T // bs + 1
    N, H = plan.n.shape[0], kc.shape[1]
    work = index.means(layer).dtype
    n, sink, span = plan.n.long(), plan.sink.long(), plan.span.long()
    whole_after = torch.div(n + span - sink, bs, rounding_mode="floor")  # blocks whole after the step
    whole_before = torch.div(n - sink, bs, rounding_mode="floor").clamp_min(0)
    b = whole_after.view(N, 1) - 1 - torch.arange(C, device=n.device).view(1, C)  # [N, C]
    made = (b >= whole_before.view(N, 1)) & (b >= 0)
    j = sink.view(N, 1, 1) + b.view(N, C, 1) * bs + torch.arange(bs, device=n.device).view(1, 1, bs)  # [N, C, bs]
    cells = _cells(plan, j.view(N, C * bs), layout.ring_len, T, kc.shape[2]).view(N, 1, C * bs).expand(N, H, C * bs)
    keys = _read(kc, key_scale, cells, work)  # [N, H, C*bs, D]
    if rotary is not None:
        keys = rotary.rotate(keys, -j.view(N, C * bs))
    means = keys.view(N, H, C, bs, -1).mean(dim=3).transpose(1, 2)  # [N, C, H, D]
    rows = torch.where(made, index.row_of(plan).view(N, 1), index.rows)
    index.means(layer).index_put_((rows, torch.remainder(b, index.blocks)), means)


def _window_starts(config: BoundedKVConfig, plan, T: int) -> torch.Tensor:
    """`[N, T]`: the first window entry of each query (its memory ends there)."""
    n, sink = plan.n.long().view(-1, 1), plan.sink.long().view(-1, 1)
    if config.query_window is not None:
        return torch.maximum(sink, n + torch.arange(T, device=n.device).view(1, T) - config.query_window)
    return plan.lo.long().view(-1, 1).expand(-1, T)


def attend_memory(
    index: MemoryIndex,
    layer: int,
    config: BoundedKVConfig,
    layout: Layout,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scales: Optional[Tuple[torch.Tensor, torch.Tensor]],
    plan,
    *,
    scale: float,
    score_mod: Optional[Callable] = None,
    positions: str = "stream",
    rotary=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The memory part of a `Recall` layer's attention: `(out [N, Hq, T, Dv], lse [N, Hq, T])`, `lse = -inf`
    (and `out = 0`) where a query reads no memory entry. Writes the step's whole blocks into `index` first.

    `q`: the step's queries `[N, Hq, T, D]`, as `attend` got them (unscaled). `kc`, `vc`: the layer's
    key and value tensors `[1, H, S, *]` after the step's write; `scales` their per-cell scales when
    quantized. `rotary`: the layer's `Rotary` when its keys carry in-cache positions (memory read at
    the position before the step's first window entry), else None (read at the stream index).
    `score_mod(score, b, h, q_pos, kv_pos)` gets stream positions, or with `positions="cache"` in-cache
    ones (a memory entry then sits `q_pos - p + t_mem` for a query at stream index `p`).
    """
    recall = config.recall
    bs, k_top, MB = recall.block, recall.top_k, recall.memory_blocks
    N, Hq, T, D = q.shape
    H = kc.shape[1]
    g = Hq // H
    dev = q.device
    work = _work(q.dtype)
    ks, vs = (None, None) if scales is None else scales
    index_blocks(index, layer, config, layout, kc, ks, plan, T, rotary)

    n, sink = plan.n.long().view(N, 1), plan.sink.long().view(N, 1)
    w = _window_starts(config, plan, T)  # [N, T]
    whole = torch.div(w - sink, bs, rounding_mode="floor")  # [N, T]: blocks wholly out of each query's window
    oldest = (whole - MB).clamp_min(0)  # [N, T]: each query's oldest memory block
    writes = torch.arange(T, device=dev).view(1, T) < plan.span.long().view(N, 1)
    any_writes = writes.any(dim=1, keepdim=True)
    newest = torch.where(writes, whole, 0).amax(dim=1, keepdim=True)  # [N, 1]: end of the step's blocks
    NB = MB + T // bs + 1
    b = oldest[:, :1] + torch.arange(NB, device=dev).view(1, NB)  # [N, NB] candidate blocks
    valid = (b < newest) & any_writes
    t_mem = w[:, :1] - 1  # [N, 1]: just before the first query's first window entry
    reps = index.means(layer)[index.row_of(plan).view(N, 1), torch.remainder(b, index.blocks)]  # [N, NB, H, D]
    reps = reps.transpose(1, 2)  # [N, H, NB, D]
    if rotary is not None:
        reps = rotary.rotate(reps, t_mem.expand(N, NB))
    qsum = (q.to(work) * writes.to(work).view(N, 1, T, 1)).view(N, H, g, T, D).sum(dim=(2, 3))  # [N, H, D]
    score = torch.einsum("nhd,nhbd->nhb", qsum, reps).masked_fill(~valid.view(N, 1, NB), float("-inf"))
    ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
    live = torch.isfinite(ranked[..., :k_top])  # [N, H, k]
    chosen = b.view(N, 1, NB).expand(N, H, NB).gather(2, order[..., :k_top])  # [N, H, k] block numbers

    # The chosen blocks' entries (per KV head), then the tail (shared): every entry's stream index.
    e = torch.arange(bs, device=dev)
    j_sel = (sink.view(N, 1, 1, 1) + chosen.unsqueeze(-1) * bs + e).reshape(N, H, k_top * bs)
    L = bs + T
    j_tail = (sink + whole[:, :1] * bs + torch.arange(L, device=dev).view(1, L)).view(N, 1, L).expand(N, H, L)
    j_all = torch.cat([j_sel, j_tail], dim=2)  # [N, H, E]
    cells = _cells(plan, j_all, layout.ring_len, T, kc.shape[2])
    keys = _read(kc, ks, cells, work)
    if rotary is not None:  # each KV head reads other entries: turn with per-head angles
        cos, sin = rotary.cos_sin(t_mem.view(N, 1, 1) - j_all, keys.dtype)
        keys = apply_rotary(keys, cos, sin, rotary.layout)
    values = _read(vc, vs, cells, work)
    # Which query reads which entry: a chosen block inside its own memory, a tail entry inside its own tail.
    blk = torch.cat([chosen.unsqueeze(-1).expand(N, H, k_top, bs).reshape(N, H, k_top * bs),
                     torch.full((N, H, L), -1, dtype=torch.long, device=dev)], dim=2).view(N, H, 1, 1, -1)
    ok = torch.cat([live.unsqueeze(-1).expand(N, H, k_top, bs).reshape(N, H, k_top * bs),
                    torch.zeros(N, H, L, dtype=torch.bool, device=dev)], dim=2).view(N, H, 1, 1, -1)
    jq = j_all.view(N, H, 1, 1, -1)
    wq, wholeq, oldq = (x.view(N, 1, 1, T, 1) for x in (w, whole, oldest))
    in_tail = (jq >= sink.view(N, 1, 1, 1, 1) + wholeq * bs) & (jq < wq) & (blk < 0)
    reads = (ok & (blk >= oldq) & (blk < wholeq)) | in_tail  # [N, H, 1, T, E]

    scores = torch.einsum("nhgtd,nhsd->nhgts", q.to(work).view(N, H, g, T, D), keys) * scale
    if score_mod is not None:
        p = n.view(N, 1, 1, 1, 1) + torch.arange(T, device=dev).view(1, 1, 1, T, 1)
        kv_pos, q_pos = jq, p
        if positions == "cache":
            s = sink.view(N, 1, 1, 1, 1)
            evicted = (w - sink).view(N, 1, 1, T, 1)  # entries before each query's window, past the sinks
            q_pos = torch.where(p < s, p, p - evicted)
            kv_pos = q_pos - p + (t_mem.view(N, 1, 1, 1, 1) if rotary is not None else jq)
        bidx = torch.arange(N, device=dev).view(N, 1, 1, 1, 1)
        h = torch.arange(Hq, device=dev).view(1, H, g, 1, 1)
        scores = score_mod(scores, bidx, h, q_pos, kv_pos).to(work)
    scores = scores.masked_fill(~reads, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [N, H, g, T]
    weights = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("nhgts,nhsd->nhgtd", weights, values)
    return out.reshape(N, Hq, T, -1).to(q.dtype), lse.reshape(N, Hq, T)
