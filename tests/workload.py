"""A random streaming workload that drives a cache and the dense reference side by side.

Requests join, leave and reset between steps; segments go padding and come
back; spans vary (look-ahead when `span < T`, read-only when `span == 0`).
Every step's outputs are compared with `flexkv.model.reference.ReferenceCache`.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, StreamPosition
from flexkv.model.reference import ReferenceCache


def score_bias(score, b, h, q_pos, kv_pos):
    """A relative-position bias (ALiBi-like, per head) used to check `score_mod` positions."""
    return score - 0.07 * (h + 1) * (q_pos - kv_pos) + 0.01 * b


class Workload:
    """Streams random steps through `manager` and `ReferenceCache`, recording the worst error.

    `attend(manager, plan, qs, ks, vs)` runs one model step over all layers
    (lists of per-layer `[N, H, T, D]` tensors, values `[N, H, T, Dv]`) and returns the per-layer
    outputs; the default calls `manager.attend` eagerly. `fixed_tokens`
    keeps T constant (a fixed batch shape for compiled steps).
    """

    def __init__(
        self,
        config: BoundedKVConfig,
        *,
        q_heads: Optional[int] = None,
        segments: int = 3,
        seed: int = 0,
        block_size: int = 16,
        manager: Optional[BoundedKVManager] = None,
        attend: Optional[Callable] = None,
        fixed_tokens: Optional[int] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        churn: float = 0.25,
        num_sources: Optional[int] = None,
    ):
        self.cfg = config
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.q_heads = q_heads or config.num_heads
        self.manager = manager if manager is not None else BoundedKVManager(config, "cpu", block_size=block_size)
        self.ref = ReferenceCache(config)
        self.attend_fn = attend
        self.fixed_tokens = fixed_tokens
        self.score_mod = score_mod
        self.positions = positions
        self.churn = churn
        self.worst = 0.0
        self.steps = 0
        self.next_id = 0
        self.slots: list = [None] * segments  # request id or None per segment position
        self.state: dict = {}  # rid -> [source, source_len, written]
        self.sources: dict = {}
        if config.max_source_len > 0:
            count = num_sources if num_sources is not None else self.rng.randint(1, config.max_sources)
            for _ in range(count):
                length = self.rng.randint(max(config.min_source_len, 1), config.max_source_len)
                self.add_source(length)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=self.cfg.dtype)

    def add_source(self, length: int) -> int:
        c = self.cfg
        shape = (c.num_layers, c.rows_per_request, c.num_heads, length, c.head_dim)
        k, v = self.randn(*shape), self.randn(*shape[:4], c.value_head_dim)
        idx = self.manager.add_source(k, v)
        self.ref.add_source(idx, k, v)
        self.sources[idx] = length
        return idx

    def _new_request(self):
        c = self.cfg
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.sources:
            src = self.rng.choice(sorted(self.sources))
            hi = min(c.max_source_len, self.sources[src])
            length = self.rng.randint(c.min_source_len, hi)
        else:
            src, length = 0, 0
        self.state[rid] = [src, length, 0]
        return rid

    def _churn(self):
        added = 0
        for i, rid in enumerate(self.slots):
            roll = self.rng.random()
            if rid is not None and roll < self.churn / 2:
                self.manager.remove_request(rid)
                self.ref.remove_request(rid)
                del self.state[rid]
                self.slots[i] = None
            elif rid is not None and roll < self.churn * 0.7:
                self.manager.reset_request(rid)
                self.ref.reset_request(rid)
                self.state[rid][2] = 0
            elif rid is None and roll < 0.7 and self.manager.free_slots > added:
                self.slots[i] = self._new_request()
                added += 1

    def make_step(self) -> BoundedKVStep:
        c = self.cfg
        T = self.fixed_tokens or self.rng.randint(1, c.max_step_tokens)
        segs, pos = [], {}
        for rid in self.slots:
            if rid is None:
                segs.append(Segment(None, 0))
                continue
            src, length, written = self.state[rid]
            span = self.rng.choice([T, T, self.rng.randint(0, T)])
            segs.append(Segment(rid, span))
            pos[rid] = StreamPosition(length, written, source=src)
        return BoundedKVStep(tuple(segs), pos, tokens=T)

    def step(self, check: bool = True) -> BoundedKVStep:
        """One step: churn, admit, plan, attend every layer, compare, commit."""
        if self.steps:
            self._churn()
        c = self.cfg
        step = self.make_step()
        T = step.step_tokens
        N = len(step.segments) * c.rows_per_request
        self.manager.admit(step)
        plan = self.manager.plan(step)
        qs = [self.randn(N, self.q_heads, T, c.head_dim) for _ in range(c.num_layers)]
        ks = [self.randn(N, c.num_heads, T, c.head_dim) for _ in range(c.num_layers)]
        vs = [self.randn(N, c.num_heads, T, c.value_head_dim) for _ in range(c.num_layers)]
        if self.attend_fn is None:
            outs = [
                self.manager.attend(l, qs[l], ks[l], vs[l], plan, score_mod=self.score_mod, positions=self.positions)
                for l in range(c.num_layers)
            ]
        else:
            outs = self.attend_fn(self.manager, plan, qs, ks, vs)
        for l in range(c.num_layers):
            exp = self.ref.attend(l, qs[l], ks[l], vs[l], step, score_mod=self.score_mod, positions=self.positions)
            if check:
                assert outs[l].shape == exp.shape
                err = (outs[l].double() - exp).abs().max().item()
                self.worst = max(self.worst, err)
        self.manager.commit(step)
        self.ref.commit(step)
        for seg in step.segments:
            if seg.request_id is not None:
                self.state[seg.request_id][2] += seg.span
        self.steps += 1
        return step
