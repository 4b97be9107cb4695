"""One step over two caches: `MultiCacheSession` against the same caches stepped without it.

Shape: a two-rate streaming encoder's attention (4 streams; a slow stack of 4 layers at 25 frames per
chunk, per-query window 100, and a fast stack of 4 layers at 50 frames per chunk, per-query window 200;
4 heads x 64, fp32), eager, attention only, every stream far past both windows. In one process,
interleaved (`benchmarks.timing.interleaved`):

- `multi-cache session`: `MultiCacheSession.step`, one transaction over both caches (padding, lanes, the
  attendance check of both caches, the commit of both or neither);
- `two sessions`: a `StreamSession` per cache, each stepped on its own (what a port does without a
  multi-cache step: the first commits before the second runs);
- `two contexts by hand`: a `StepContext` per cache, `begin` / attend / `commit` each, positions kept
  by the caller (the least host work, and no atomicity).

    PYTHONPATH=. python -m benchmarks.multi_cache --threads 1
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import interleaved
from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    MultiCacheSession,
    Segment,
    SinkWindow,
    StepContext,
    StreamPosition,
    StreamSession,
)

STREAMS, LAYERS, HEADS, HEAD_DIM = 4, 4, 4, 64
RATES = {"slow": (25, 100), "fast": (50, 200)}  # frames per chunk, per-query window


def configs():
    return {name: BoundedKVConfig(num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, rows_per_request=1,
                                  max_source_len=0, max_sources=0, retention=SinkWindow(0, window), max_slots=STREAMS,
                                  max_step_tokens=frames, query_window=window)
            for name, (frames, window) in RATES.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfgs = configs()
    chunk = {name: torch.randn(STREAMS, frames, 3, HEADS, HEAD_DIM) for name, (frames, _) in RATES.items()}
    feeds = {rid: {name: chunk[name][rid] for name in RATES} for rid in range(STREAMS)}

    def attend_all(attn, x):  # x [B, T, 3, H, D] -> every layer's output
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
        return [attn(layer, q, k, v) for layer in range(LAYERS)]

    multi = MultiCacheSession(cfgs, compile=False)

    def multi_fn(attn, x):
        return {name: torch.stack(attend_all(attn[name], x[name]), 2) for name in RATES}

    sessions = {name: StreamSession(cfg, compile=False) for name, cfg in cfgs.items()}

    def session_fn(attn, x):
        return torch.stack(attend_all(attn, x), 2)

    contexts = {name: StepContext(BoundedKVManager(cfg)) for name, cfg in cfgs.items()}
    written = {name: 0 for name in RATES}
    layer_inputs = {name: tuple(chunk[name][:, :, i].transpose(1, 2) for i in range(3)) for name in RATES}

    def step_multi():
        multi.step(feeds, multi_fn)

    def step_sessions():
        for name, s in sessions.items():
            s.step({rid: feeds[rid][name] for rid in feeds}, session_fn)

    def step_contexts():
        for name, ctx in contexts.items():
            frames = RATES[name][0]
            step = BoundedKVStep(tuple(Segment(rid, frames) for rid in range(STREAMS)),
                                 {rid: StreamPosition(0, written[name]) for rid in range(STREAMS)})
            with ctx.stepping(step):
                for layer in range(LAYERS):
                    ctx(layer, *layer_inputs[name])
            written[name] += frames

    with torch.no_grad():
        for _ in range(12):  # every stream far past both windows (rings wrapped)
            step_multi()
            step_sessions()
            step_contexts()
        plan_ms = 1e3 * min(multi.step(feeds, multi_fn).plan_s for _ in range(5))
        times = interleaved({"multi-cache session": step_multi, "two sessions": step_sessions,
                             "two contexts by hand": step_contexts}, rounds=args.rounds)
    print(f"two caches, {STREAMS} streams x ({LAYERS} layers at 25 + {LAYERS} at 50 frames per chunk), "
          f"{HEADS} heads x {HEAD_DIM}, fp32, eager, threads={torch.get_num_threads()}")
    base = times["two contexts by hand"]["median_ms"]
    for name, t in times.items():
        print(f"  {name:22s} {t['median_ms']:8.2f} ms/step (best {t['best_ms']:.2f})  {t['median_ms'] / base:.2f}x")
    print(f"  multi-cache session host planning (both caches): {plan_ms:.2f} ms")


if __name__ == "__main__":
    main()
