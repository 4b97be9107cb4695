"""Fork, reorder and roll back against a decode step, and a speculative loop against plain decode.

Shape: the eager decode benchmark's (`benchmarks.eager.SHAPE`: 8 streams at steady state, 4 layers,
16 query / 8 KV heads x 64, 4 sinks + window 252, fp32), eager (`attention_path="auto"`: the rows
path), attention only. In one process, interleaved (`benchmarks.timing.interleaved`):

- `decode step`: admit, plan, `attend` of every layer, commit, one token per stream;
- `fork`: `fork_request` of one stream into a free slot (one batched copy of its slot in every layer),
  then `remove_request` of the copy;
- `reorder`: `reorder_requests` of all 8 streams by a permutation (a beam search's reorder: one
  gather and one scatter per layer buffer);
- `rollback`: `rollback_request` of 1 token of every stream and the `commit` of a step that puts it
  back (host work only);
- a speculative loop with drafts of `k` tokens: a verify step of `k + 1` tokens per stream, then
  `rollback_request` of the rejected ones. With an ideal draft (every token accepted) a round yields
  `k + 1` tokens, with a useless one (none accepted) 1; the figure is time per token kept, against
  plain decode's step. The drafter's own cost is left out (it is another model's).

    python -m benchmarks.branching --threads 1
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.eager import SHAPE
from benchmarks.timing import interleaved
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition


class Streams:
    """8 streams far past their window in one cache with a spare slot and room to take back `k` tokens."""

    def __init__(self, s: dict, k: int, seed: int = 0):
        self.s, self.k = s, k
        B, L, H, D = s["streams"], s["layers"], s["kv_heads"], s["head_dim"]
        self.cfg = BoundedKVConfig(num_layers=L, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=0,
                                   max_sources=0, retention=SinkWindow(s["sink"], s["window"]), max_slots=B + 1,
                                   max_step_tokens=k + 1, max_rollback=k)
        self.m = BoundedKVManager(self.cfg, "cpu")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in range(L):
                for buf in self.m.store.layer_kv(layer):
                    buf.copy_(torch.randn(buf.shape, generator=g))
        self.rids = list(range(B))
        self.inputs = {T: [tuple(torch.randn(B, h, T, D, generator=g) for h in (s["q_heads"], H, H))
                           for _ in range(L)] for T in (1, k + 1)}
        # Bring every stream past its window (rings wrapped) with host steps only: the content is random anyway.
        far = s["sink"] + 3 * (s["window"] + k + 1)
        self.step(k + 1, attend=False)
        while self.m.written(0) < far:
            self.step(k + 1, attend=False)

    def step(self, T: int, attend: bool = True):
        m = self.m
        pos = {r: StreamPosition(0, m.written(r) if r in m.requests else 0) for r in self.rids}
        step = BoundedKVStep(tuple(Segment(r, T) for r in self.rids), pos, tokens=T)
        m.admit(step)
        plan = m.plan(step)
        if attend:
            for layer, (q, k, v) in enumerate(self.inputs[T]):
                m.attend(layer, q, k, v, plan)
        m.commit(step)

    def fork(self):
        self.m.fork_request(0, "copy")
        self.m.remove_request("copy")

    def reorder(self):
        B = len(self.rids)
        self.m.reorder_requests({r: self.rids[(r * 3 + 1) % B] for r in self.rids})

    def rollback(self):
        m = self.m
        for r in self.rids:
            m.rollback_request(r, 1)
        pos = {r: StreamPosition(0, m.written(r)) for r in self.rids}
        m.commit(BoundedKVStep(tuple(Segment(r, 1) for r in self.rids), pos, tokens=1))

    def speculative(self, accepted: int):
        self.step(self.k + 1)
        rejected = self.k - accepted
        if rejected:
            for r in self.rids:
                self.m.rollback_request(r, rejected)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--draft", type=int, default=4, help="draft tokens per speculative round (k)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k = args.draft
    st = Streams(SHAPE, k)
    with torch.no_grad():
        t = interleaved({
            "decode step": lambda: st.step(1),
            "fork": st.fork,
            "reorder": st.reorder,
            "rollback": st.rollback,
            f"verify {k + 1}, ideal draft": lambda: st.speculative(k),
            f"verify {k + 1}, useless draft": lambda: st.speculative(0),
        })
    base = t["decode step"]["median_ms"]
    print(f"eager, {SHAPE['streams']} streams x {SHAPE['layers']} layers, {SHAPE['q_heads']}/{SHAPE['kv_heads']} heads "
          f"x {SHAPE['head_dim']}, sink {SHAPE['sink']} + window {SHAPE['window']}, threads {torch.get_num_threads()}")
    print(f"{'':34s} {'median ms':>10s} {'x decode step':>14s} {'ms per token kept':>18s}")
    kept = {f"verify {k + 1}, ideal draft": k + 1, f"verify {k + 1}, useless draft": 1, "decode step": 1}
    for name, r in t.items():
        per = f"{r['median_ms'] / kept[name]:18.3f}" if name in kept else ""
        print(f"{name:34s} {r['median_ms']:10.3f} {r['median_ms'] / base:14.2f} {per}")


if __name__ == "__main__":
    main()
