"""A small streaming transformer with its own ring KV cache (a model written without flexkv).

The kind of model a streaming speech codec or speech LM ships: causal
self-attention over a local context, rotary positions on interleaved pairs,
layer scale, a gated feed-forward, and a streaming mode that carries a ring
buffer of keys and values per layer so the model can be fed a chunk of
frames at a time. It stands alone (torch only): `examples/port_ring_transformer.py`
puts flexkv under it without changing a line here.

Its conventions, as such models state them:

- `context`: how many keys a query attends, the query itself included:
  frame `p` attends frames `p - context + 1 .. p` offline;
- streaming: `with model.streaming(batch_size): y = model(chunk)` feeds
  `[batch, T, d_in]` chunks. Each attention layer writes the chunk's keys
  into a ring of `context` entries first, then attends what the ring holds,
  causally: a frame of the chunk sees the last `context` frames written up to
  the chunk's end, none after itself (for `T = 1` exactly the offline
  attention; for `T > 1` the chunk's early frames see a little less of the
  past than offline, as a ring that size must);
- activations are `[batch, time, heads, head_dim]` inside attention;
  positions are a per-stream offset, rotary angles in float32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerArgs:
    d_in: int = 32
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 4
    dim_feedforward: int = 160
    context: int = 48  # keys a query attends, itself included
    max_period: float = 10000.0
    layer_scale: float = 0.2
    d_out: int = 32


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_period: float):
    """Rotary embedding on interleaved pairs `(2i, 2i + 1)`.

    `q, k`: `[B, T, H, D]`; `positions`: `[B, T]` integer time steps. Angles in float32.
    """
    D = q.shape[-1]
    freqs = torch.exp(torch.arange(D // 2, device=q.device, dtype=torch.float32) * (-2 * math.log(max_period) / D))
    angles = positions.to(torch.float32)[:, :, None, None] * freqs  # [B, T, 1, D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)

    def rotate(x):
        xr, xi = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((xr * cos - xi * sin, xr * sin + xi * cos), dim=-1).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


class RingKVCache(nn.Module):
    """`capacity` keys and values per stream and head, overwritten oldest first."""

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, capacity: int, device=None, dtype=None):
        super().__init__()
        self.capacity = capacity
        shape = (batch_size, num_heads, capacity, head_dim)
        self.register_buffer("keys", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("values", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        # frames each stream has written so far
        self.register_buffer("end_offset", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)

    def reset(self) -> None:
        self.end_offset.zero_()

    def complete(self, k: torch.Tensor, v: torch.Tensor):
        """Write `k, v` (`[B, H, T, D]`, `T <= capacity`); return the ring's keys, values and the
        time step each ring entry holds (`[B, capacity]`, -1 where nothing was written yet)."""
        B, _, T, _ = k.shape
        assert T <= self.capacity, "a chunk longer than the ring would overwrite itself"
        t = torch.arange(T, device=k.device)
        slots = (self.end_offset[:, None] + t) % self.capacity  # [B, T]
        rows = torch.arange(B, device=k.device)[:, None]
        self.keys[rows, :, slots] = k.transpose(1, 2)
        self.values[rows, :, slots] = v.transpose(1, 2)
        end = self.end_offset + T
        self.end_offset.add_(T)
        c = torch.arange(self.capacity, device=k.device)
        held = end[:, None] - 1 - ((end[:, None] - 1 - c) % self.capacity)  # latest time step in each slot
        return self.keys, self.values, torch.where(held >= 0, held, -1)


class StreamingAttention(nn.Module):
    """Causal self-attention over the last `context` frames, rotary on interleaved pairs."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.head_dim = args.d_model // args.num_heads
        self.context = args.context
        self.max_period = args.max_period
        self.in_proj = nn.Linear(args.d_model, 3 * args.d_model, bias=False)
        self.out_proj = nn.Linear(args.d_model, args.d_model, bias=False)
        self.cache: Optional[RingKVCache] = None  # set in streaming mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        t = torch.arange(T, device=x.device)
        if self.cache is None:  # offline: the whole sequence at once
            positions = t.expand(B, T)
            q, k = apply_rope(q, k, positions, self.max_period)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))
            pos_k = positions
        else:
            positions = self.cache.end_offset[:, None] + t
            q, k = apply_rope(q, k, positions, self.max_period)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))
            k, v, pos_k = self.cache.complete(k, v)
        delta = positions[:, :, None] - pos_k[:, None, :]  # [B, T, keys]
        allowed = (pos_k[:, None, :] >= 0) & (delta >= 0) & (delta < self.context)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))


class GatedFeedForward(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.linear_in = nn.Linear(args.d_model, 2 * args.dim_feedforward, bias=False)
        self.linear_out = nn.Linear(args.dim_feedforward, args.d_model, bias=False)

    def forward(self, x):
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


class StreamingTransformerLayer(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.d_model)
        self.self_attn = StreamingAttention(args)
        self.layer_scale_1 = nn.Parameter(torch.full((args.d_model,), args.layer_scale))
        self.norm2 = nn.LayerNorm(args.d_model)
        self.gating = GatedFeedForward(args)
        self.layer_scale_2 = nn.Parameter(torch.full((args.d_model,), args.layer_scale))

    def forward(self, x):
        x = x + self.layer_scale_1 * self.self_attn(self.norm1(x))
        return x + self.layer_scale_2 * self.gating(self.norm2(x))


class StreamingTransformer(nn.Module):
    """`[B, T, d_in]` frames -> `[B, T, d_out]`, offline or chunk by chunk in streaming mode."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.input_proj = nn.Linear(args.d_in, args.d_model, bias=False)
        self.layers = nn.ModuleList(StreamingTransformerLayer(args) for _ in range(args.num_layers))
        self.out_norm = nn.LayerNorm(args.d_model)
        self.output_proj = nn.Linear(args.d_model, args.d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.output_proj(self.out_norm(h))

    @contextlib.contextmanager
    def streaming(self, batch_size: int) -> Iterator["StreamingTransformer"]:
        """Streaming mode for `batch_size` streams: every forward continues each stream."""
        p = next(self.parameters())
        a = self.args
        for layer in self.layers:
            layer.self_attn.cache = RingKVCache(batch_size, a.num_heads, a.d_model // a.num_heads, a.context,
                                                device=p.device, dtype=p.dtype)
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.self_attn.cache = None

    def cache_bytes(self) -> int:
        """Bytes of the ring caches held in streaming mode (0 offline)."""
        total = 0
        for layer in self.layers:
            cache = layer.self_attn.cache
            if cache is not None:
                total += sum(b.numel() * b.element_size() for b in (cache.keys, cache.values))
        return total
