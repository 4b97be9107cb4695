"""What relative-position attention costs at a streaming conformer's shape, side by side.

One layer's attention (the cache write, the position term and the attention
itself; the projections are the same for every variant and left out), for
chunks of `--chunk` frames plus `--lookahead` frames over a window of
`--window` earlier frames, 4 requests:

- `plain`: `attend(q + u, k, v)`, no position term (what the cache costs
  without relative positions);
- `rel_pos`: `flexkv.cache.positions.relative_position`: the per-step table
  `(q + v) . p(d)` over the distances the window reaches, read by the
  score_mod (on the rows path, folded into SDPA's mask);
- `folded`: the workaround without it: `p(i - j)` split by the angle-
  difference identity into a query part and a key part, appended to each
  head (keys `head_dim + d_model` wide, values `head_dim`).

Every variant is checked against `rel_pos` on the first steps. Eager and
compiled (`--no-compile` skips the compiled ones); steps are taken
round-robin over the variants and the median is printed.

    PYTHONPATH=. python benchmarks/relative_position.py --threads 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.positions.relative_position import RelativePosition


def frequencies(dim: int) -> torch.Tensor:
    return torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * -(math.log(10000.0) / dim))


def encode(d: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal encoding of signed distances, interleaved sin/cos: `[len(d), dim]`."""
    ang = d.double().unsqueeze(1) * frequencies(dim)
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1).float()


class Shape:
    def __init__(self, args):
        self.B, self.H, self.D, self.dim = 4, args.heads, args.head_dim, args.heads * args.head_dim
        self.C, self.T, self.window = args.chunk, args.chunk + args.lookahead, args.window
        g = torch.Generator().manual_seed(0)
        self.w_pos = torch.randn(self.dim, self.dim, generator=g) / math.sqrt(self.dim)  # linear_pos
        self.u = torch.randn(self.H, self.D, generator=g) * 0.3
        self.v = torch.randn(self.H, self.D, generator=g) * 0.3

    def config(self, head_dim=None, value_head_dim=None):
        return BoundedKVConfig(num_layers=1, num_heads=self.H, head_dim=head_dim or self.D, value_head_dim=value_head_dim,
                               rows_per_request=1, max_source_len=0, max_sources=0,
                               retention=SinkWindow(0, self.window), max_slots=self.B, max_step_tokens=self.T,
                               dtype=torch.float32)


def plain(s: Shape):
    cache = BoundedKVManager(s.config())

    def step(q, k, v, plan):
        return cache.attend(0, q + s.u.view(1, s.H, 1, s.D), k, v, plan)
    return cache, step


def rel_pos(s: Shape):
    cache = BoundedKVManager(s.config())
    rel = RelativePosition(cache.config)
    pe = encode(rel.distances(), s.dim)

    def step(q, k, v, plan):
        pos = (pe @ s.w_pos.T).view(rel.size, s.H, s.D)
        term = rel.scores(q + s.v.view(1, s.H, 1, s.D), pos, cache.stream_positions(plan))
        return cache.attend(0, q + s.u.view(1, s.H, 1, s.D), k, v, plan, score_mod=term)
    return cache, step


def folded(s: Shape):
    """`(q + v) . W pe(i - j)` as a dot product: with `a_f, b_f` the query's weights on the sin and cos of
    frequency `w_f`, `a sin((i-j)w) + b cos((i-j)w) = (a sin iw + b cos iw) cos jw + (b sin iw - a cos iw) sin jw`."""
    F_ = s.dim // 2
    cache = BoundedKVManager(s.config(head_dim=s.D + 2 * F_, value_head_dim=s.D))
    w = frequencies(s.dim).float()
    Wh = s.w_pos.view(s.H, s.D, F_, 2)  # rows of head h, columns (f, sin|cos)
    scale = s.D ** -0.5

    def step(q, k, v, plan):
        N, T = q.shape[0], q.shape[2]
        i = cache.stream_positions(plan).float().view(N, 1, T, 1)
        ab = torch.einsum("nhtd,hdfc->nhtfc", q + s.v.view(1, s.H, 1, s.D), Wh)
        a, b = ab[..., 0], ab[..., 1]
        si, ci = torch.sin(i * w), torch.cos(i * w)
        qx = torch.cat([q + s.u.view(1, s.H, 1, s.D), a * si + b * ci, b * si - a * ci], dim=-1)
        kx = torch.cat([k, torch.cos(i * w).expand(N, s.H, T, F_), torch.sin(i * w).expand(N, s.H, T, F_)], dim=-1)
        return cache.attend(0, qx, kx, v, plan, scale=scale)
    return cache, step


VARIANTS = {"plain": plain, "rel_pos": rel_pos, "folded": folded}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--lookahead", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    s = Shape(args)
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    runs = {}
    for mode in modes:
        for name, make in VARIANTS.items():
            cache, fn = make(s)
            if mode == "compiled":
                fn = torch.compile(fn, fullgraph=True, dynamic=False)
            runs[(mode, name)] = dict(cache=cache, fn=fn, ms=[], out=[])
    g = torch.Generator().manual_seed(1)
    C, T = s.C, s.T
    compile_s = {}
    with torch.no_grad():
        for n in range(args.steps):
            q, k, v = (torch.randn(s.B, s.H, T, s.D, generator=g) for _ in range(3))
            for key, r in runs.items():
                cache = r["cache"]
                step = BoundedKVStep(tuple(Segment(f"r{b}", C) for b in range(s.B)),
                                     {f"r{b}": StreamPosition(0, n * C) for b in range(s.B)}, tokens=T)
                t0 = time.perf_counter()
                cache.admit(step)
                plan = cache.plan(step)
                out = r["fn"](q, k, v, plan)
                cache.commit(step)
                dt = time.perf_counter() - t0
                if n == 0:
                    compile_s[key] = dt
                elif n > 2:
                    r["ms"].append(1e3 * dt)
                if n < 8:
                    r["out"].append(out[:, :, :C])
    ref = runs[("eager", "rel_pos")]["out"]
    print(f"relative-position attention, one layer: {s.B} requests, {s.H} heads x {s.D}, chunk {C} + look-ahead "
          f"{T - C}, window {s.window}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'mode':9s} {'variant':8s} {'ms/step':>8s} {'vs plain':>9s} {'KV KiB/request':>15s} {'diff vs rel_pos':>16s}")
    for (mode, name), r in runs.items():
        med = statistics.median(r["ms"])
        base = statistics.median(runs[(mode, "plain")]["ms"])
        diff = "-" if name == "plain" else f"{max((a - b).abs().max().item() for a, b in zip(r['out'], ref)):.1e}"
        print(f"{mode:9s} {name:8s} {med:8.3f} {med / base:8.2f}x {r['cache'].slot_bytes / 1024:15.1f} {diff:>16s}")
    if "compiled" in modes:
        print("first compiled step (compile) s: " + ", ".join(
            f"{name} {compile_s[('compiled', name)]:.1f}" for name in VARIANTS))


if __name__ == "__main__":
    main()
