"""Per-step cost of rotary positions on a bounded cache.

    PYTHONPATH=. python benchmarks/rotary_positions.py [--batch 8 --window 1020 ...]

Times one decode step (T=1, every layer's attention, no projections) at
steady state - every stream past its window - for four ways of giving a
rotary model its positions, all compiled with `fullgraph=True`:

``flexkv stream``
    `SinkRotation(mode="stream")` + `BoundedKVManager.attend`: keys rotated
    once at their stream index.
``flexkv cache``
    `SinkRotation(mode="cache")` + `attend`: StreamingLLM's in-cache
    positions; each step rewrites the `sink` cells of every row, O(sink).
``re-rotate``
    StreamingLLM's reference method (and the old transformers `SinkCache`):
    a dense per-request cache of un-rotated keys (sink + window + the new
    token), every key rotated at its in-cache position at every step, then
    SDPA. O(window) rotation work per layer per step. Written as cheaply as
    it goes: a ring, no concatenation, positions handed in from the host.
``dense rotated``
    the same dense cache holding keys already rotated, no re-rotation: the
    floor under ``re-rotate`` (its difference is the re-rotation itself).

Prints ms per step and the two differences that matter: what ``cache``
costs over ``stream`` in flexkv, and what re-rotation costs over the dense
floor.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from benchmarks.timing import decode_shape_args, round_robin
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.positions.rotary import Rotary, SinkRotation


def bench_flexkv(args, mode: str):
    B, L, H, Hq, D = args.batch, args.layers, args.heads, args.q_heads, args.head_dim
    cfg = BoundedKVConfig(L, H, D, 1, 0, SinkWindow(args.sink, args.window), max_slots=B)
    m = BoundedKVManager(cfg)
    rot = Rotary(D)
    rope = [SinkRotation(m, i, rot, mode) for i in range(L)]
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(B, Hq, 1, D, generator=g) for _ in range(L)]
    k = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]
    v = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]

    def step_fn(plan, q, k, v):
        outs = []
        for i in range(L):
            qr, kr = rope[i](q[i], k[i], plan)
            outs.append(m.attend(i, qr, kr, v[i], plan))
        return outs

    compiled = torch.compile(step_fn, fullgraph=True, dynamic=False)
    start = args.sink + args.window + 5  # steady state: the window has wrapped
    rids = list(range(B))

    segs = tuple(Segment(r, 1) for r in rids)
    m.admit(BoundedKVStep(segs, {r: StreamPosition(0, 0) for r in rids}))

    def one(i):
        n = start + i
        # jump every stream to length n: what the cells hold does not change the cost
        m.commit(BoundedKVStep(segs, {r: StreamPosition(0, n - 1) for r in rids}))
        step = BoundedKVStep(segs, {r: StreamPosition(0, n) for r in rids})
        m.admit(step)
        compiled(m.plan(step), q, k, v)
        m.commit(step)

    t0 = time.perf_counter()
    one(0)
    return one, time.perf_counter() - t0


def bench_dense(args, rerotate: bool):
    B, L, H, Hq, D = args.batch, args.layers, args.heads, args.q_heads, args.head_dim
    S, W, sink = args.sink + args.window + 1, args.window, args.sink
    rot = Rotary(D)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(B, H, S, D, generator=g) for _ in range(L)]
    values = [torch.randn(B, H, S, D, generator=g) for _ in range(L)]
    q = [torch.randn(B, Hq, 1, D, generator=g) for _ in range(L)]
    k = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]
    v = [torch.randn(B, H, 1, D, generator=g) for _ in range(L)]
    qpos = torch.full((1,), S - 1)
    b_idx, h_idx = torch.arange(B).view(B, 1, 1), torch.arange(H).view(1, H, 1)

    def step_fn(cell, cell_pos, new_pos, q, k, v):
        outs = []
        for i in range(L):
            kc, vc = caches[i], values[i]
            # one index_put_ with full index tensors writes in place (an index_copy_ copies the buffer)
            index = (b_idx, h_idx, cell.view(1, 1, 1))
            if rerotate:  # store un-rotated, rotate every cached key at its in-cache position
                kc.index_put_(index, k[i])
                vc.index_put_(index, v[i])
                keys = rot.rotate(kc, cell_pos)
            else:  # store rotated once
                kc.index_put_(index, rot.rotate(k[i], new_pos))
                vc.index_put_(index, v[i])
                keys = kc
            outs.append(F.scaled_dot_product_attention(rot.rotate(q[i], qpos), keys, vc, enable_gqa=Hq != H))
        return outs

    compiled = torch.compile(step_fn, fullgraph=True, dynamic=False)
    start = sink + W + 5

    def one(i):
        n = start + i  # stream index of the new token
        c = sink + (n - sink) % (W + 1)  # its ring cell
        # stream index held by each ring cell, then its in-cache position: sinks 0..sink-1, window after
        ring = torch.arange(W + 1)
        j = n - ((c - sink - ring) % (W + 1))
        cell_pos = torch.cat([torch.arange(sink), sink + j - (n - W)])
        compiled(torch.tensor([c]), cell_pos, torch.tensor([n]), q, k, v)

    t0 = time.perf_counter()
    one(0)
    return one, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    decode_shape_args(ap, steps=60)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    built = {
        "flexkv stream": bench_flexkv(args, "stream"),
        "flexkv cache": bench_flexkv(args, "cache"),
        "re-rotate": bench_dense(args, True),
        "dense rotated": bench_dense(args, False),
    }
    timed = round_robin({name: fn for name, (fn, _) in built.items()}, args.steps, args.warmup)
    print(f"decode step, B {args.batch}, {args.layers} layers, {args.q_heads} q / {args.heads} kv heads x "
          f"{args.head_dim}, sink {args.sink} + window {args.window}, fp32, {torch.get_num_threads()} threads")
    print(f"{'variant':<16}{'ms/step p50':>12}{'p90':>9}{'compile s':>11}")
    res = {}
    for name, (_, comp) in built.items():
        p50, p90 = timed[name]
        res[name] = p50
        print(f"{name:<16}{p50:>12.2f}{p90:>9.2f}{comp:>11.1f}")
    print(f"cache positions in flexkv (cache - stream):   {res['flexkv cache'] - res['flexkv stream']:+.2f} ms/step")
    print(f"re-rotating the window (re-rotate - dense):   {res['re-rotate'] - res['dense rotated']:+.2f} ms/step")
    return res


if __name__ == "__main__":
    main()
