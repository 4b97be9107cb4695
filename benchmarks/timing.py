"""Side-by-side timing for the benchmarks: variants interleaved in one process, medians of rounds.

On a machine other jobs share, a variant timed alone for a few seconds and
then another after it can see a different machine. `interleaved` instead
runs every variant once per round, in a rotating order, for several rounds,
and keeps each variant's median (and best) time per call, so the ratios
between variants compare runs under the same load.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch
from torch.utils.benchmark import Timer

__all__ = ["cycle", "decode_shape_args", "device_ms", "interleaved", "ratio", "round_robin"]


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int = 7, min_round_s: float = 0.2,
                clock: Callable[[], float] = time.perf_counter) -> Dict[str, dict]:
    """Time each `fns[name]()` per call: `{name: {"median_ms", "best_ms", "calls"}}`.

    Each variant is called once to warm up, then `rounds` rounds follow; in a
    round every variant runs `k` calls back to back (`k` sized from the
    warm-up so a round of one variant takes about `min_round_s`), the order
    of the variants rotating from round to round. `clock`: wall time by
    default; `time.thread_time` counts only the calling thread's CPU time
    (one torch thread on a machine other jobs share: time spent waiting for
    a core is left out).
    """
    calls = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        once = time.perf_counter() - t0
        calls[name] = max(1, min(1000, int(min_round_s / max(once, 1e-6))))
    per_call: Dict[str, list] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, k = fns[name], calls[name]
            t0 = clock()
            for _ in range(k):
                fn()
            per_call[name].append((clock() - t0) / k)
    return {name: dict(median_ms=statistics.median(ts) * 1e3, best_ms=min(ts) * 1e3, calls=calls[name])
            for name, ts in per_call.items()}


def ratio(a: dict, b: dict) -> float:
    """`a`'s median over `b`'s (how many times slower `a` is)."""
    return a["median_ms"] / b["median_ms"]


def decode_shape_args(ap, steps: int) -> None:
    """The decode-shape options two benchmarks share (batch, layers, heads, head size, sink, window,
    steps, warm-up, torch threads), added to the argparse parser `ap`."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def round_robin(fns: dict, steps: int, warmup: int, rounds: int = 5) -> dict:
    """ms per call of each `fn(i)`: `warmup` calls each, then `rounds` rounds of `steps // rounds`
    calls of every variant in turn, so load from other processes falls on all of them alike.
    Returns name -> (median, p90)."""
    for fn in fns.values():
        for i in range(1, 1 + warmup):
            fn(i)
    times = {name: [] for name in fns}
    i = 1 + warmup
    for _ in range(rounds):
        for name, fn in fns.items():
            for j in range(max(1, steps // rounds)):
                t0 = time.perf_counter()
                fn(i + j)
                times[name].append(1e3 * (time.perf_counter() - t0))
        i += max(1, steps // rounds)
    out = {}
    for name, t in times.items():
        t.sort()
        out[name] = (statistics.median(t), t[int(0.9 * (len(t) - 1))])
    return out


def cycle(step: Callable, inputs) -> Callable[[], None]:
    """A no-argument call for `interleaved`: each call runs `step` (without autograd) on the next of
    `inputs`, round and round."""
    state = {"i": 0}

    def one():
        state["i"] += 1
        with torch.no_grad():
            step(inputs[state["i"] % len(inputs)])

    return one


def device_ms(fn: Callable, device, iters: int = 20, warmup: int = 3) -> float:
    """Median time of one call: CUDA events on a GPU, `torch.utils.benchmark.Timer` on the CPU."""
    with torch.no_grad():
        if device.type != "cuda":
            fn()
            return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.3).median * 1e3
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
