"""What keeping elementwise ops out of the CPU FlexAttention kernel costs a decode step.

    PYTHONPATH=. python benchmarks/epilogue_barrier.py [--batch 8 --window 1020 --threads 1 ...]

Inductor's CPU FlexAttention template cannot take a fused epilogue, so a
compiled step that applies an elementwise op straight to the attention
output (`o * 2`, a gate) would fail to build; `BoundedKVManager` reads its
output through an identity gather that inductor does not fuse into the
kernel (`epilogue_barrier`, on by default on the CPU). Three variants of one
decode step (T = 1, every layer: attention, then the output projection and
the residual add, compiled with `fullgraph=True`), timed round-robin in one
process:

``projection, barrier``
    the default: the gather runs between the attention and the projection;
``projection, no barrier``
    `AttentionOptions(epilogue_barrier=False)`: the same model builds without it (the
    projection is a matmul, never fused into the kernel), so the difference
    is the barrier's whole cost;
``gated, barrier``
    an elementwise gate on the output before the projection, which only
    builds with the barrier.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from benchmarks.timing import decode_shape_args, round_robin
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions


def bench(args, barrier: bool, gated: bool):
    B, L, H, Hq, D = args.batch, args.layers, args.heads, args.q_heads, args.head_dim
    cfg = BoundedKVConfig(L, H, D, 1, 0, SinkWindow(args.sink, args.window), max_slots=B)
    m = BoundedKVManager(cfg, options=AttentionOptions.for_cache(cfg, "cpu", epilogue_barrier=barrier))
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(B, Hq, 1, D, generator=g) for _ in range(L)]
    k = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]
    v = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]
    wo = [torch.randn(Hq * D, Hq * D, generator=g) * (Hq * D) ** -0.5 for _ in range(L)]
    gate = torch.randn(B, Hq, 1, D, generator=g)
    x0 = torch.randn(B, 1, Hq * D, generator=g)

    def step_fn(plan, q, k, v, x):
        for i in range(L):
            o = m.attend(i, q[i], k[i], v[i], plan)
            if gated:
                o = o * torch.sigmoid(gate)
            x = x + o.transpose(1, 2).reshape(B, 1, Hq * D) @ wo[i]
        return x

    compiled = torch.compile(step_fn, fullgraph=True, dynamic=False)
    start = args.sink + args.window + 5
    rids = list(range(B))
    segs = tuple(Segment(r, 1) for r in rids)
    m.admit(BoundedKVStep(segs, {r: StreamPosition(0, 0) for r in rids}))

    def one(i):
        n = start + i
        m.commit(BoundedKVStep(segs, {r: StreamPosition(0, n - 1) for r in rids}))
        step = BoundedKVStep(segs, {r: StreamPosition(0, n) for r in rids})
        m.admit(step)
        out = compiled(m.plan(step), q, k, v, x0)
        m.commit(step)
        return out

    t0 = time.perf_counter()
    first = one(0)
    return one, time.perf_counter() - t0, first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    decode_shape_args(ap, steps=100)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    built = {
        "projection, barrier": bench(args, True, False),
        "projection, no barrier": bench(args, False, False),
        "gated, barrier": bench(args, True, True),
    }
    same = (built["projection, barrier"][2] - built["projection, no barrier"][2]).abs().max().item()
    if not same < 1e-4:
        raise AssertionError(f"the barrier changed the output by {same:.3g}: it must be an identity")
    timed = round_robin({name: fn for name, (fn, _, _) in built.items()}, args.steps, args.warmup)
    print(f"decode step, B {args.batch}, {args.layers} layers, {args.q_heads} q / {args.heads} kv heads x "
          f"{args.head_dim}, sink {args.sink} + window {args.window}, fp32, {torch.get_num_threads()} threads")
    print(f"{'variant':<24}{'ms/step p50':>12}{'p90':>9}{'compile s':>11}")
    res = {}
    for name, (_, comp, _) in built.items():
        p50, p90 = timed[name]
        res[name] = p50
        print(f"{name:<24}{p50:>12.3f}{p90:>9.3f}{comp:>11.1f}")
    cost = res["projection, barrier"] - res["projection, no barrier"]
    print(f"the barrier's cost (barrier - no barrier): {cost:+.3f} ms/step "
          f"({100 * cost / res['projection, no barrier']:+.1f}%); outputs differ by {same:.1e}")
    return res


if __name__ == "__main__":
    main()
