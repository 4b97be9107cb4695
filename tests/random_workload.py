"""`RandomWorkload`: random streaming steps through a cache and the dense reference, side by side.

Requests join, leave and reset between steps; segments go padding and come
back; spans vary (look-ahead tokens when `span < T`, read-only steps when
`span == 0`); requests start on random sources and lengths. Every step's
outputs are compared with `flexkv.model.reference.ReferenceCache` on the same
inputs (for a cache with quantized slots, on what the cache reads back for
them: `flexkv.cache.storage.quantized.round_trip`): the worst difference is kept, and
with a `tolerance` the first step, layer and request over it fails there
(`check_close`). The test suite drives its property
and compiled tests with it, and `benchmarks/cuda_check.py` its checks on a
GPU: run it on a new device or torch release before trusting either.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import torch

from flexkv.cache.manager import BoundedKVManager
from flexkv.cache.storage.quantized import round_trip
from flexkv.config import BoundedKVConfig
from flexkv.model.reference import ReferenceCache
from flexkv.step import BoundedKVStep, Segment, StreamPosition

__all__ = ["RandomWorkload", "score_bias", "relative_error", "check_close"]


def score_bias(score, b, h, q_pos, kv_pos):
    """A relative-position bias (ALiBi-like, per head and row) for checking `score_mod` positions."""
    return score - 0.07 * (h + 1) * (q_pos - kv_pos) + 0.01 * b


def relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """`||out - want|| / ||want||` over every element (float64), 0 for two zero tensors."""
    out, want = out.double().cpu(), want.double().cpu()
    scale = want.norm().item()
    diff = (out - want).norm().item()
    return diff / scale if scale else diff


def check_close(out: torch.Tensor, want: torch.Tensor, tolerance: float, where: str) -> float:
    """The largest `|out - want|` (float64, on the CPU); past `tolerance` (or NaN), an AssertionError
    that names `where` (the step, layer and request being compared), the difference and the first
    element over it, so a failure says where a run broke, not only by how much."""
    if tuple(out.shape) != tuple(want.shape):
        raise AssertionError(f"{where}: output {tuple(out.shape)}, reference {tuple(want.shape)}")
    diff = (out.double().cpu() - want.double().cpu()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if not worst <= tolerance:
        first = tuple((~(diff <= tolerance)).nonzero()[0].tolist())
        raise AssertionError(f"{where}: |output - reference| reaches {worst:.3g} > {tolerance:g} "
                             f"(first at index {first} of shape {tuple(diff.shape)})")
    return worst


class RandomWorkload:
    """Streams random steps through a cache and `ReferenceCache`, recording the worst errors.

    Args:
        config: the cache's configuration.
        manager: the cache under test (default: a `BoundedKVManager` of
            `config` on `device` with `block_size`).
        q_heads: query heads (default `config.num_heads`; a multiple of it for GQA).
        segments: segments per step (padding ones included).
        seed: seeds the traffic and every tensor.
        attend: `attend(manager, plan, qs, ks, vs) -> outputs`, one model step
            over all layers (lists of per-layer `q [N, Hq, T, D]`,
            `k [N, H, T, D]`, `v [N, H, T, Dv]`); default: `manager.attend`
            per layer, eagerly.
        fixed_tokens: keep `T` constant (a fixed batch shape for a compiled
            step); default: a random `T` per step.
        score_mod, positions, sinks: passed to every `attend` and to the reference.
        churn: how often requests leave or reset between steps.
        num_sources: sources registered at the start (default: a random count).
        tolerance: the largest absolute difference allowed; `step` raises at
            the first layer and segment past it, naming the step, layer and
            request. None: only record the differences.

    `worst` is the largest absolute difference seen, `worst_relative` the
    largest norm-relative one (per layer and step).
    """

    def __init__(
        self,
        config: BoundedKVConfig,
        *,
        manager: Optional[BoundedKVManager] = None,
        device="cpu",
        q_heads: Optional[int] = None,
        segments: int = 3,
        seed: int = 0,
        block_size: Optional[int] = 16,
        attend: Optional[Callable] = None,
        fixed_tokens: Optional[int] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        churn: float = 0.25,
        num_sources: Optional[int] = None,
        tolerance: Optional[float] = None,
    ):
        self.cfg = config
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.q_heads = q_heads or config.num_heads
        self.manager = manager if manager is not None else BoundedKVManager(config, device, block_size=block_size)
        self.device = self.manager.device
        self.ref = ReferenceCache(config)
        self.attend_fn = attend
        self.fixed_tokens = fixed_tokens
        self.score_mod = score_mod
        self.positions = positions
        self.sinks = sinks
        self.churn = churn
        self.tolerance = tolerance
        self.worst = 0.0
        self.worst_relative = 0.0
        self.steps = 0
        self.next_id = 0
        self.slots: list = [None] * segments  # request id or None per segment position
        self.state: dict = {}  # rid -> [source, source_len, written]
        self.sources: dict = {}
        if config.max_source_len > 0:
            count = num_sources if num_sources is not None else self.rng.randint(1, config.max_sources)
            for _ in range(count):
                self.add_source(self.rng.randint(max(config.min_source_len, 1), config.max_source_len))

    def randn(self, *shape) -> torch.Tensor:
        """Seeded normal values in the cache's dtype, drawn on the CPU and moved to its device."""
        draw = torch.float64 if self.cfg.dtype == torch.float64 else torch.float32
        return torch.randn(*shape, generator=self.gen, dtype=draw).to(self.cfg.dtype).to(self.device)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache reads back for keys or values `x`: `x`, or its quantized round trip."""
        return round_trip(x, self.cfg.slot_dtype)

    def add_source(self, length: int) -> int:
        """Register a random source of `length` entries with the cache and the reference; returns its index."""
        c = self.cfg
        shape = (c.num_layers, c.rows_per_request, c.num_heads, length, c.head_dim)
        k, v = self.randn(*shape), self.randn(*shape[:4], c.value_head_dim)
        idx = self.manager.add_source(k, v)
        self.ref.add_source(idx, self.stored(k), self.stored(v))
        self.sources[idx] = length
        return idx

    def _new_request(self):
        c = self.cfg
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.sources:
            src = self.rng.choice(sorted(self.sources))
            length = self.rng.randint(c.min_source_len, min(c.max_source_len, self.sources[src]))
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
        """The next step's segments and positions (spans of `T`, some shorter, some 0)."""
        T = self.fixed_tokens or self.rng.randint(1, self.cfg.max_step_tokens)
        segs, pos = [], {}
        for rid in self.slots:
            if rid is None:
                segs.append(Segment(None, 0))
                continue
            src, length, written = self.state[rid]
            segs.append(Segment(rid, self.rng.choice([T, T, self.rng.randint(0, T)])))
            pos[rid] = StreamPosition(length, written, source=src)
        return BoundedKVStep(tuple(segs), pos, tokens=T)

    def step(self, check: bool = True) -> BoundedKVStep:
        """One step: churn, admit, plan, attend every layer, compare with the reference, commit."""
        if self.steps:
            self._churn()
        c = self.cfg
        step = self.make_step()
        T = step.step_tokens
        N = len(step.segments) * c.rows_per_request
        self.manager.admit(step)
        plan = self.manager.plan(step)
        self.plan = plan
        qs = [self.randn(N, self.q_heads, T, c.head_dim) for _ in range(c.num_layers)]
        ks = [self.randn(N, c.num_heads, T, c.head_dim) for _ in range(c.num_layers)]
        vs = [self.randn(N, c.num_heads, T, c.value_head_dim) for _ in range(c.num_layers)]
        kw = dict(score_mod=self.score_mod, positions=self.positions, sinks=self.sinks)
        with torch.no_grad():
            if self.attend_fn is None:
                outs = [self.manager.attend(l, qs[l], ks[l], vs[l], plan, **kw) for l in range(c.num_layers)]
            else:
                outs = self.attend_fn(self.manager, plan, qs, ks, vs)
        R = c.rows_per_request
        for l in range(c.num_layers):
            want = self.ref.attend(l, qs[l], self.stored(ks[l]), self.stored(vs[l]), step, **kw)
            if check:
                if tuple(outs[l].shape) != tuple(want.shape):
                    raise AssertionError(f"step {self.steps}, layer {l}: output {tuple(outs[l].shape)}, "
                                         f"reference {tuple(want.shape)}")
                for i, seg in enumerate(step.segments if self.tolerance is not None else ()):
                    who = "a padding segment" if seg.request_id is None else f"request {seg.request_id!r}"
                    check_close(outs[l][i * R:(i + 1) * R], want[i * R:(i + 1) * R], self.tolerance,
                                f"step {self.steps} (T={T}), layer {l}, {who} (segment {i}, rows {i * R}.."
                                f"{(i + 1) * R - 1})")
                self.worst = max(self.worst, (outs[l].double().cpu() - want).abs().max().item())
                self.worst_relative = max(self.worst_relative, relative_error(outs[l], want))
        self.manager.commit(step)
        self.ref.commit(step)
        for seg in step.segments:
            if seg.request_id is not None:
                self.state[seg.request_id][2] += seg.span
        self.steps += 1
        return step
