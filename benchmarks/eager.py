"""Eager decode (no `torch.compile`): flexkv with default settings against a plain eager ring cache.

Shape: 8 streams at steady state (far past the window, rings wrapped), 4 layers, 16 query / 8 KV
heads x 64, 4 sinks + window 252, one token per step, fp32, attention only (write + attention of
every layer; flexkv also admits, plans and commits).

- `flexkv`: `BoundedKVManager.attend` per layer, called eagerly, every setting left to flexkv;
- `flexkv/plain` (with `--plain`): the same with `AttentionOptions(cpu_fast_paths=False)`: the rows
  path's plain reference in place of its CPU fast paths (`flexkv.cache.cpu.cpu_fast_rows`);
- `flexkv/flex` (with `--flex`): the same with `AttentionOptions(path="flex")` (uncompiled FlexAttention,
  which forms every score of the whole layer tensor);
- `ring`: what a model without flexkv does eagerly: per layer a `[B, H, sink + window + 1, D]`
  key and value tensor, the step's token written at its ring cell (one `index_put_` each), then
  `scaled_dot_product_attention(enable_gqa=True)` over the whole ring.

The first step of each is checked against the others (same cache content, same inputs). Times
are medians of `benchmarks.timing.interleaved` rounds.

    python -m benchmarks.eager --threads 1
    python -m benchmarks.eager --threads 1 --plain
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.timing import cycle, interleaved
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.host.layout import entry_cell
from flexkv.cache.paths.attention_options import AttentionOptions

SHAPE = dict(streams=8, layers=4, q_heads=16, kv_heads=8, head_dim=64, sink=4, window=252)


class Eager:
    """flexkv and a plain ring cache from the same content, stepping the same inputs."""

    def __init__(self, s: dict, seed: int = 0, path: str = "auto", fast: bool = True):
        self.s = s
        B, L, H, D = s["streams"], s["layers"], s["kv_heads"], s["head_dim"]
        g = torch.Generator().manual_seed(seed)
        self.cfg = BoundedKVConfig(num_layers=L, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=0,
                                   max_sources=0, retention=SinkWindow(s["sink"], s["window"]), max_slots=B)
        self.m = m = BoundedKVManager(self.cfg, "cpu", options=AttentionOptions.for_cache(self.cfg, "cpu", path=path,
                                                                                    cpu_fast_paths=fast))
        with torch.no_grad():
            for l in range(L):
                for buf in m.store.layer_kv(l):
                    buf.copy_(torch.randn(buf.shape, generator=g))
        self.rids = list(range(B))
        self.ring_len = s["window"] + 1  # the ring keeps the window and the step's token
        self.written = [s["sink"] + 3 * self.ring_len + 7 * i for i in self.rids]
        m.admit(BoundedKVStep(tuple(Segment(r, 1) for r in self.rids), {r: StreamPosition(0, 0) for r in self.rids}))
        m.commit(BoundedKVStep(tuple(Segment(r, 1) for r in self.rids),
                               {r: StreamPosition(0, self.written[r] - 1) for r in self.rids}))
        # The ring cache: cell c < sink holds stream entry c, cell sink + j % ring_len holds j >= sink.
        plan = m.plan(self.step())
        C = s["sink"] + self.ring_len
        self.K, self.V = [], []
        for l in range(L):
            kc, vc = m.store.layer_kv(l)
            K = torch.zeros(B, H, C, D)
            V = torch.zeros_like(K)
            for i, n in enumerate(self.written):
                row = plan.row(i)
                for j in list(range(s["sink"])) + list(range(n - s["window"], n)):
                    c = j if j < s["sink"] else s["sink"] + j % self.ring_len
                    cell = entry_cell(row, m.layout.ring_len, j)[1]
                    K[i, :, c] = kc[0, :, cell]
                    V[i, :, c] = vc[0, :, cell]
            self.K.append(K)
            self.V.append(V)
        self.ring_n = list(self.written)
        self.inputs = [[(torch.randn(B, s["q_heads"], 1, D, generator=g), torch.randn(B, H, 1, D, generator=g),
                         torch.randn(B, H, 1, D, generator=g)) for _ in range(L)] for _ in range(2)]

    def step(self) -> BoundedKVStep:
        return BoundedKVStep(tuple(Segment(r, 1) for r in self.rids),
                             {r: StreamPosition(0, self.written[r]) for r in self.rids})

    def flexkv(self, inputs):
        st = self.step()
        self.m.admit(st)
        plan = self.m.plan(st)
        out = [self.m.attend(l, q, k, v, plan) for l, (q, k, v) in enumerate(inputs)]
        self.m.commit(st)
        self.written = [n + 1 for n in self.written]
        return out

    def ring(self, inputs):
        s = self.s
        rows = torch.arange(s["streams"])
        cells = torch.tensor([s["sink"] + n % self.ring_len for n in self.ring_n])
        out = []
        for l, (q, k, v) in enumerate(inputs):
            self.K[l][rows, :, cells] = k[:, :, 0]
            self.V[l][rows, :, cells] = v[:, :, 0]
            out.append(F.scaled_dot_product_attention(q, self.K[l], self.V[l], enable_gqa=True))
        self.ring_n = [n + 1 for n in self.ring_n]
        return out


def run(rounds: int = 7, flex: bool = False, plain: bool = False) -> dict:
    a = Eager(SHAPE)
    with torch.no_grad():
        fo, ro = a.flexkv(a.inputs[0]), a.ring(a.inputs[0])
    err = max(float((x - y).abs().max()) for x, y in zip(fo, ro))
    if not err < 1e-4:
        raise AssertionError(f"flexkv and the ring cache disagree by {err:.3g} on the first step")
    fns = {"flexkv": cycle(a.flexkv, a.inputs), "ring": cycle(a.ring, a.inputs)}
    if plain:
        c = Eager(SHAPE, fast=False)
        with torch.no_grad():
            e3 = max(float((x - y).abs().max()) for x, y in zip(c.flexkv(c.inputs[0]), fo))
        if not e3 < 1e-4:
            raise AssertionError(f"flexkv/plain disagrees with flexkv by {e3:.3g}")
        fns["flexkv/plain"] = cycle(c.flexkv, c.inputs)
    if flex:
        b = Eager(SHAPE, path="flex")
        with torch.no_grad():
            e2 = max(float((x - y).abs().max()) for x, y in zip(b.flexkv(b.inputs[0]), fo))
        if not e2 < 1e-4:
            raise AssertionError(f"flexkv/flex disagrees with flexkv by {e2:.3g}")
        fns["flexkv/flex"] = cycle(b.flexkv, b.inputs)
    return dict(times=interleaved(fns, rounds=rounds), err=err)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--flex", action="store_true", help="also time AttentionOptions path='flex' (slow)")
    ap.add_argument("--plain", action="store_true", help="also time AttentionOptions cpu_fast_paths=False")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.rounds, args.flex, args.plain)
    t = r["times"]
    ring = t["ring"]["median_ms"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), eager decode, "
          f"{SHAPE['streams']} streams x {SHAPE['layers']} layers, {SHAPE['q_heads']} q / {SHAPE['kv_heads']} kv heads "
          f"x {SHAPE['head_dim']}, sink {SHAPE['sink']} + window {SHAPE['window']}; medians of {args.rounds} rounds "
          f"(first-step difference {r['err']:.2g})")
    for name, x in t.items():
        print(f"  {name:12s} {x['median_ms']:8.3f} ms  (best {x['best_ms']:.3f})  {x['median_ms'] / ring:6.2f}x ring")


if __name__ == "__main__":
    main()
