"""One compiled decode step of many streams: `SinkWindow`, the same asked for its log-sum-exp, and `Recall`.

`flexkv run`'s streaming-llm shape (4 layers, 8 KV heads of 64, 32 query
heads, sink 4 + window 1020) with `--streams` streams at `--fill` tokens
each (filled in 64-token chunks), then `--steps` decode steps of every
stream through one compiled function per cache; prints the median step.
The second line is what a step that needs a log-sum-exp costs on the CPU
(the compiled FlexAttention kernel returns none: the rows path, the window
gathered). `Recall` runs twice: the path flexkv picks (compiled on the CPU:
one FlexAttention call over the window in place and the chosen memory
copied next to it) and the rows path (`path="rows"`: the window and the
memory gathered into one fused CPU attention call).

    python -m benchmarks.recall_step --streams 32 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Recall, Segment, SinkWindow, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions

L, H, D, HQ = 4, 8, 64, 32


def step_ms(retention, streams: int, fill: int, steps: int, lse: bool = False, compiled: bool = True,
            path: str = "auto") -> float:
    cfg = BoundedKVConfig(num_layers=L, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=retention, max_slots=streams, max_step_tokens=64)
    m = BoundedKVManager(cfg, "cpu", options=AttentionOptions.for_cache(cfg, "cpu", path=path))
    ids = [f"r{j}" for j in range(streams)]
    written = 0
    with torch.no_grad():
        while written < fill:
            step = BoundedKVStep(tuple(Segment(r, 64) for r in ids), {r: StreamPosition(0, written) for r in ids},
                                 tokens=64)
            m.admit(step)
            plan = m.plan(step)
            for layer in range(L):
                m.attend(layer, torch.randn(streams, HQ, 64, D), torch.randn(streams, H, 64, D),
                         torch.randn(streams, H, 64, D), plan)
            m.commit(step)
            written += 64

    def decode(qs, ks, vs, plan):
        outs = []
        for layer in range(L):
            attend = m.attend_lse if lse else m.attend
            o = attend(layer, qs[layer], ks[layer], vs[layer], plan)
            outs.append(o.out if lse else o)
        return outs

    # dynamic=False as flexkv's own doors compile: `decode` is one code object for every cache here, so under
    # automatic dynamic shapes the later caches' plans would become symbols (TORCH_WORKAROUNDS["DYNAMIC_PLAN"]).
    fn = torch.compile(decode, fullgraph=True, dynamic=False) if compiled else decode
    qs = [torch.randn(streams, HQ, 1, D) for _ in range(L)]
    ks = [torch.randn(streams, H, 1, D) for _ in range(L)]
    vs = [torch.randn(streams, H, 1, D) for _ in range(L)]
    times = []
    with torch.no_grad():
        for _ in range(steps + 2):
            step = BoundedKVStep(tuple(Segment(r, 1) for r in ids), {r: StreamPosition(0, written) for r in ids},
                                 tokens=1)
            m.admit(step)
            plan = m.plan(step)
            t = time.perf_counter()
            fn(qs, ks, vs, plan)
            times.append(time.perf_counter() - t)
            m.commit(step)
            written += 1
    rest = sorted(times[2:])
    return rest[len(rest) // 2] * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recall_step", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--fill", type=int, default=3008, help="tokens each stream holds before the timed steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--memory", type=int, default=2048)
    p.add_argument("--eager", action="store_true", help="time the step uncompiled")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(streams=args.streams, fill=args.fill, steps=args.steps, compiled=not args.eager)
    recall = Recall(4, 1020, args.memory)
    for label, ret, lse, path in (("SinkWindow(4, 1020)", SinkWindow(4, 1020), False, "auto"),
                                  ("SinkWindow(4, 1020), log-sum-exp asked", SinkWindow(4, 1020), True, "auto"),
                                  (f"{recall}", recall, False, "auto"),
                                  (f"{recall}, path='rows'", recall, False, "rows")):
        ms = step_ms(ret, lse=lse, path=path, **kw)
        print(f"{label}: {ms:.1f} ms per {L}-layer decode step of {args.streams} streams", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
