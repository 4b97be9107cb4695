"""`StreamModel`: the small attention model that `flexkv run` and the benchmarks stream through a cache.

A stack of attention layers with random projections shaped by a `Workload`
(and, for `score_bias: relative`, a Transformer-XL-style relative bias on
in-cache positions), whose layers call an `attend(layer, q, k, v)` they are
given: `BoundedKVManager.attend` in `flexkv run`, other caches in the
benchmarks.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .workload import Workload

__all__ = ["StreamModel"]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class StreamModel(nn.Module):
    """`layers` attention layers with random projections (pre-norm, residual).

    `forward`-style use goes through `layer(l, x, attend)`: `x [N, T, d_model]`
    with `N = segments * rows`, `attend(l, q, k, v) -> [N, q_heads, T, D]`
    with `q [N, q_heads, T, D]`, `k, v [N, kv_heads, T, D]` (views of the
    projections' outputs; attend with the default scale). Weights are
    registered buffers (nothing to train) drawn from `seed`, one set per layer.
    With `score_bias == "relative"`, `score_mod(l)` adds `bias_l[h, q_pos -
    kv_pos + max_tokens - 1]` on in-cache positions (`positions == "cache"`).
    """

    VOCAB = 256

    def __init__(self, workload: Workload, *, seed: int = 0, device="cpu"):
        super().__init__()
        w = workload
        self.workload = w
        g = torch.Generator().manual_seed(seed)
        d, hq, hk, dh = w.d_model, w.num_q_heads, w.kv_heads, w.head_dim
        dtype = w.torch_dtype

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        self.register_buffer("embed", rand(self.VOCAB, d, scale=1.0))
        for l in range(w.layers):
            self.register_buffer(f"wq_{l}", rand(d, hq * dh, scale=d ** -0.5))
            self.register_buffer(f"wk_{l}", rand(d, hk * dh, scale=d ** -0.5))
            self.register_buffer(f"wv_{l}", rand(d, hk * dh, scale=d ** -0.5))
            self.register_buffer(f"wo_{l}", rand(hq * dh, d, scale=(hq * dh) ** -0.5))
        self.bias_len = w.window + 2 * w.max_tokens
        if w.score_bias == "relative":
            for l in range(w.layers):
                self.register_buffer(f"bias_{l}", rand(hq, self.bias_len, scale=0.5))
        self.positions = "cache" if w.score_bias == "relative" else "stream"

    def score_mod(self, l: int, device=None) -> Optional[Callable]:
        """Layer `l`'s score_mod, or None without a score bias.

        `device` moves the bias table (the float64 reference runs on the CPU).
        """
        if self.workload.score_bias != "relative":
            return None
        bias = getattr(self, f"bias_{l}")
        if device is not None:
            bias = bias.detach().to(device)
        shift = self.workload.max_tokens - 1
        top = self.bias_len - 1

        def relative_bias(score, b, h, q_pos, kv_pos):
            return score + bias[h, (q_pos - kv_pos + shift).clamp(0, top)]

        return relative_bias

    def qkv(self, l: int, x: torch.Tensor):
        """Layer `l`'s q, k, v for `x [N, T, d_model]`, in the `[N, heads, T, D]` layout."""
        w = self.workload
        N, T, _ = x.shape
        h = _rms(x)
        q = (h @ getattr(self, f"wq_{l}")).view(N, T, w.num_q_heads, w.head_dim).transpose(1, 2)
        k = (h @ getattr(self, f"wk_{l}")).view(N, T, w.kv_heads, w.head_dim).transpose(1, 2)
        v = (h @ getattr(self, f"wv_{l}")).view(N, T, w.kv_heads, w.head_dim).transpose(1, 2)
        return q, k, v

    def layer(self, l: int, x: torch.Tensor, attend: Callable):
        """One layer: returns `(x_next, q, k, v, o)` (the last four for checking)."""
        N, T, _ = x.shape
        q, k, v = self.qkv(l, x)
        o = attend(l, q, k, v)
        x = x + o.transpose(1, 2).reshape(N, T, -1) @ getattr(self, f"wo_{l}")
        return x, q, k, v, o


