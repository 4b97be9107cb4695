"""The host cost of one session step: `StreamSession.step` and `MultiCacheSession.step` on a tiny cache.

Shape: the smallest step a session runs, so the session's own bookkeeping (feeds, lanes, padding, the
step transaction, plan, attendance check, commit, cutting the result) is most of it: 2 streams, one
token each, caches of 1 layer, 1 head x 8, fp32, eager (`compile=False`), attention only. In one
process, interleaved (`benchmarks.timing.interleaved`, CPU time of the calling thread):

- `one-cache session`: `StreamSession.step` over one cache;
- `two-cache session`: `MultiCacheSession.step` over two such caches;
- `context by hand`: a `StepContext` over one cache, `begin` / attend / `commit`, positions kept by the
  caller (the attention and the cache's own host work, without a session).

    PYTHONPATH=. python -m benchmarks.session_step --threads 1
"""

from __future__ import annotations

import argparse
import time

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

STREAMS, HEADS, HEAD_DIM = 2, 1, 8


def config():
    return BoundedKVConfig(num_layers=1, num_heads=HEADS, head_dim=HEAD_DIM, rows_per_request=1, max_source_len=0,
                           max_sources=0, retention=SinkWindow(2, 14), max_slots=STREAMS, max_step_tokens=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(STREAMS, 1, 3, HEADS, HEAD_DIM)
    feeds = {rid: x[rid] for rid in range(STREAMS)}
    multi_feeds = {rid: {"a": x[rid], "b": x[rid]} for rid in range(STREAMS)}

    def attend(attn, x):  # x [B, T, 3, H, D] -> the one layer's output
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
        return attn(0, q, k, v).transpose(1, 2)

    one = StreamSession(config(), compile=False)
    two = MultiCacheSession({"a": config(), "b": config()}, compile=False)

    def two_fn(attn, x):
        return {name: attend(attn[name], x[name]) for name in ("a", "b")}

    ctx = StepContext(BoundedKVManager(config()))
    written = [0]
    qkv = tuple(x[:, :, i].transpose(1, 2) for i in range(3))

    def by_hand():
        step = BoundedKVStep(tuple(Segment(rid, 1) for rid in range(STREAMS)),
                             {rid: StreamPosition(0, written[0]) for rid in range(STREAMS)})
        with ctx.stepping(step):
            ctx(0, *qkv)
        written[0] += 1

    variants = {"one-cache session": lambda: one.step(feeds, attend),
                "two-cache session": lambda: two.step(multi_feeds, two_fn),
                "context by hand": by_hand}
    with torch.no_grad():
        for _ in range(40):  # every stream past its window (the ring wrapped)
            for fn in variants.values():
                fn()
        times = interleaved(variants, rounds=args.rounds, clock=time.thread_time)
    print(f"{STREAMS} streams x 1 token, caches of 1 layer, {HEADS} head x {HEAD_DIM}, fp32, eager, "
          f"threads={torch.get_num_threads()} (thread CPU time per step)")
    for name, t in times.items():
        print(f"  {name:18s} {t['median_ms'] * 1e3:8.1f} us/step (best {t['best_ms'] * 1e3:.1f})")


if __name__ == "__main__":
    main()
