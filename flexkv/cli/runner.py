"""Run a workload end to end through the compiled cache and report on it.

`run_workload(workload)` builds the cache and a `StreamModel`, compiles the
model step, warms every batch shape up on all-padding steps, then drives
`Traffic` for `workload.steps` model steps through a `StreamSession` (which
admits, pads, plans, runs the compiled layers and commits), then departures. It measures step and planning time, counts graphs
compiled after the warm-up (there should be none), follows slot memory
against what an unbounded cache would hold, and checks a few steps of a few
tracked requests against the float64 `flexkv.model.reference`. The result is a
plain dict (`report`), ready for JSON.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from ..cache.manager import BoundedKVManager
from ..cache.storage.quantized import round_trip
from ..compiling import graphs_compiled
from ..model.reference import ReferenceCache
from ..session import Chunk, Stages, StreamSession
from ..step import BoundedKVStep, Segment
from .stream_model import StreamModel
from .traffic import Traffic
from .workload import Workload

__all__ = ["run_workload", "model_step", "graphs_compiled", "percentile", "resident_bytes", "fixed_mmap_threshold"]


def resident_bytes() -> Optional[int]:
    """This process's resident memory in bytes (None where /proc is absent)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def fixed_mmap_threshold(threshold: int = 1 << 20) -> bool:
    """Have glibc serve every allocation of `threshold` bytes or more by mmap, returned to the system when
    freed; True where it took the setting (glibc only).

    For a process that runs a model for a long time (`flexkv run` and `benchmarks/streaming_perplexity.py`
    set it): glibc raises its mmap threshold to the size of the largest block freed, so large tensors
    made afresh at every step (a language model's `[chunk, vocab]` logits, 12.6 MB on SmolLM2) come
    from its heaps after the first; with torch's intra-op threads allocating and freeing in several
    arenas, the perplexity benchmark's resident memory grew by ~375 KB per token (1.0 -> 2.5 GB over
    4,096 tokens of the window-only line, 24 GB by 62,000 tokens) while the cache's own memory stayed
    fixed; with a fixed threshold it stays at ~1.0 GB, at the same speed. `flexkv run`'s resident set
    climbed 533 -> 592 MB over a 10,000-step run without it and held 527-533 MB with it.
    (`MALLOC_ARENA_MAX=1` also stops it.) A library cannot choose this for its users' processes;
    docs/cli.md ("process") says when a long-running one should set it.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold))


def percentile(values: List[float], q: int) -> float:
    """The q-th percentile (q in 1..99) of `values`, linear between ranks; nan when empty."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _attend(model: StreamModel, attn) -> Callable:
    """Layer `l`'s attention for `model.layer`: the session's public attention (its `StepContext`, which
    counts the call for the step's attendance check), with the layer's score_mod and positions."""
    def attend(l, q, k, v):
        return attn(l, q, k, v, score_mod=model.score_mod(l), positions=model.positions)

    return attend


def _layer(model: StreamModel, l: int):
    """Model layer `l` as a step stage: `(x, records) -> (x, records + ((q, k, v, o),))`; layer 0 takes the
    session's inputs `[B, T, rows, d_model]` as the model's rows `[B * rows, T, d_model]`."""
    def layer(attn, carry):
        if l == 0:
            B, T = carry.shape[:2]
            x, records = carry.transpose(1, 2).reshape(B * model.workload.rows, T, -1), ()
        else:
            x, records = carry
        x, q, k, v, o = model.layer(l, x, _attend(model, attn))
        return x, records + ((q, k, v, o),)

    return layer


def model_step(model: StreamModel, mode: str) -> Callable:
    """The run's step function for `StreamSession.step`: `fn(attn, x) -> (x_out, records)` with
    `records[l] = (q, k, v, o)` of layer `l`.

    `mode="layer"`: `Stages`, one per layer, so the session compiles one graph per layer (each with its
    own code object); `mode="graph"`: one function, one graph for the whole step. Shapes are static
    (the session compiles with `dynamic=False`): a workload has one or two batch shapes, each compiled
    once at warm-up. docs/cli.md says when each mode compiles faster.
    """
    stages = [_layer(model, l) for l in range(model.workload.layers)]
    if mode == "layer":
        return Stages(*stages)
    if mode == "graph":
        def whole_step(attn, x):
            for stage in stages:
                x = stage(attn, x)
            return x

        return whole_step
    raise ValueError(f"compile mode must be 'layer' or 'graph', got {mode!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Tracker:
    """Written keys/values of the requests checked against the reference (host copies, stream order).

    Only what a check can read is kept: the chunks holding a request's first `sink` entries and the
    chunks holding its last `window + memory + max step` entries (a query reads its sinks, the window
    before it and, with a `Recall` memory, the `memory + block - 1` entries before that). The chunks
    between are dropped as the stream grows, and `stream` hands the reference
    zeros in their place: a check that read them would fail, not pass. So a long-lived tracked request
    holds a bounded copy, and a long run's memory stays flat with checks on."""

    def __init__(self, workload: Workload, limit: int):
        self.w = workload
        self.limit = limit
        self.hist: Dict[int, _Tracked] = {}
        self.slot_dtype = workload.config().slot_dtype
        self.head = workload.sink
        self.tail = (max(workload.window, workload.query_window or 0) + workload.config().memory_capacity
                     + workload.max_tokens)

    def offer(self, rid: int) -> None:
        """Track `rid` if there is room; longer-lived requests are preferred by the caller's order."""
        if len(self.hist) < self.limit and rid not in self.hist:
            L = self.w.layers
            self.hist[rid] = _Tracked([[] for _ in range(L)], [[] for _ in range(L)])

    def record(self, rid: int, rows: slice, span: int, records) -> None:
        if span == 0:
            return
        t = self.hist[rid]
        for l, (q, k, v, o) in enumerate(records):
            kk, vv = k[rows, :, :span], v[rows, :, :span]
            if self.w.reverse_step_order:  # token t < span sits at n + span - 1 - t
                kk, vv = kk.flip(2), vv.flip(2)
            # What a quantized cache reads back for them (the same values when unquantized).
            t.keys[l].append(round_trip(kk.detach(), self.slot_dtype).to("cpu", copy=True))
            t.values[l].append(round_trip(vv.detach(), self.slot_dtype).to("cpu", copy=True))
        t.lengths.append(span)
        # Drop the oldest chunk after the head while the chunks after it still hold `tail` entries.
        head, after = self._head_chunks(t.lengths), sum(t.lengths)
        after -= sum(t.lengths[:head])
        while head < len(t.lengths) - 1 and after - t.lengths[head] >= self.tail:
            after -= t.lengths[head]
            t.dropped += t.lengths.pop(head)
            for chunks in (*t.keys, *t.values):
                del chunks[head]

    def _head_chunks(self, lengths: List[int]) -> int:
        """How many leading chunks hold the first `sink` entries."""
        head, total = 0, 0
        while head < len(lengths) and total < self.head:
            total += lengths[head]
            head += 1
        return head

    def stored_entries(self, rid: int) -> int:
        """Entries of `rid` held now (what the bound above limits)."""
        return sum(self.hist[rid].lengths)

    def stream(self, rid: int):
        """`(keys, values)` per layer, `[rows, heads, written, dim]` in stream order, zeros where dropped."""
        w, t = self.w, self.hist[rid]
        head = self._head_chunks(t.lengths)
        gap = [torch.zeros(w.rows, w.kv_heads, t.dropped, w.head_dim, dtype=w.torch_dtype)] if t.dropped else []
        empty = torch.zeros(w.rows, w.kv_heads, 0, w.head_dim, dtype=w.torch_dtype)

        def cat(chunks):
            parts = chunks[:head] + gap + chunks[head:]
            return torch.cat(parts, dim=2) if parts else empty

        return [cat(c) for c in t.keys], [cat(c) for c in t.values]


@dataclasses.dataclass
class _Tracked:
    """One tracked request's kept chunks (per layer), their lengths, and the entries dropped after the head."""

    keys: List[list]
    values: List[list]
    lengths: List[int] = dataclasses.field(default_factory=list)
    dropped: int = 0


def _feeds(w: Workload, traffic: Traffic, inputs: Callable):
    """The session feeds of the next model step: `("main", feeds)` and maybe `("final", feeds)`.

    Requests in their regular phase write `span` of the step's `tokens`; a
    request at its end feeds one final chunk of `final_tokens` that writes
    `final_span` (see `Traffic`).
    """
    out = []
    regular = [(i, r) for i, r in enumerate(traffic.lanes) if r is not None and not r.final]
    if regular:
        x = inputs(w.step_tokens)
        out.append(("main", {r.rid: x[i] if w.span == w.step_tokens else Chunk(x[i], span=w.span)
                             for i, r in regular}))
    final = [(i, r) for i, r in enumerate(traffic.lanes) if r is not None and r.final]
    if final:
        x = inputs(w.final_tokens)
        out.append(("final", {r.rid: Chunk(x[i], span=w.final_span) for i, r in final}))
    return out


class _WorkloadRun:
    """One run of a workload, in stages: set-up, warm-up, steps (each with its checks and its memory
    and progress accounting), then the report. `run_workload` drives it."""

    def __init__(self, w: Workload, device, progress, progress_every_s: float):
        self.w, self.device = w, device
        self.progress, self.progress_every_s = progress, progress_every_s
        self.wall0 = time.perf_counter()
        self.cfg = w.config()
        torch.manual_seed(w.seed)
        self.manager = BoundedKVManager(self.cfg, device, block_size=w.block_size)
        self.model = StreamModel(w, seed=w.seed, device=device)
        self.gen = torch.Generator().manual_seed(w.seed + 1)
        token_sizes = sorted({w.step_tokens} | ({w.final_tokens} if w.final_tokens is not None else set()))
        # The session owns positions, lanes (one per request, `requests` of them), padding, the compile
        # (per layer or whole, `model_step`), the attendance check and the step.
        self.session = StreamSession(self.manager, batch_sizes=(w.requests,), token_sizes=token_sizes)
        self.sources = []
        for _ in range(w.sources if w.source_len else 0):
            shape = (w.layers, w.rows, w.kv_heads, w.source_len, w.head_dim)
            k = torch.randn(shape, generator=self.gen).to(w.torch_dtype)
            v = torch.randn(shape, generator=self.gen).to(w.torch_dtype)
            self.sources.append((self.session.add_source(k.to(device), v.to(device)), k, v))
        self.step_fn = model_step(self.model, w.compile)
        self.traffic = Traffic(w)
        self.tracker = _Tracker(w, w.check_requests)
        self.checks: List[dict] = []
        self.step_times: List[float] = []  # per model step (all its calls)
        self.call_times: List[float] = []
        self.plan_times: List[float] = []
        self.memory_series: List[dict] = []
        self.tokens = self.finished = self.longest = self.unbounded_peak = 0
        self.mem0 = self.manager.memory_bytes
        self.mem_flat = True
        self.source_bytes = len(self.sources) * w.source_len * w.entry_bytes
        self.last_progress = time.perf_counter()

    # ------------------------------------------------------------ model

    def inputs(self, T):
        """Embedded random tokens for every lane: `[requests, T, rows, d_model]`, one feed per lane."""
        w = self.w
        ids = torch.randint(0, StreamModel.VOCAB, (w.requests * w.rows, T), generator=self.gen).to(self.device)
        return self.model.embed[ids].view(w.requests, w.rows, T, -1).transpose(1, 2)

    # ------------------------------------------------------------ stages

    def warm_up(self) -> None:
        """One all-padding step of each batch shape compiles everything the run needs."""
        self.graphs0 = graphs_compiled()
        t0 = time.perf_counter()
        self.session.warmup(self.step_fn, self.inputs(1)[0])
        _sync(self.device)
        self.compile_s = time.perf_counter() - t0
        self.graphs_warm = graphs_compiled()
        self.rss_start = resident_bytes()  # after the compile: what the run itself adds is measured from here
        self.arrived = len(self.traffic.active)
        self._start(self.traffic.active)

    def _start(self, reqs) -> None:
        # Prefer tracking requests that will outlive the window, so checks land after the rings wrap.
        w = self.w
        for r in reqs:
            self.session.start(r.rid, source=r.source, source_len=w.source_len)
        long_enough = w.sink + w.window + w.memory + w.span
        for r in sorted(reqs, key=lambda r: (r.length < long_enough, r.rid)):
            self.tracker.offer(r.rid)

    def _check(self, step_no, kind, st, rid, lane, records) -> None:
        """Compare every layer's output rows of `rid` with the float64 reference."""
        R = self.w.rows
        seg, pos = st.segments[lane], st.positions[rid]
        ref = ReferenceCache(self.cfg)
        sd = self.cfg.slot_dtype
        for idx, k, v in self.sources:
            ref.add_source(idx, round_trip(k, sd), round_trip(v, sd))
        keys, values = self.tracker.stream(rid)
        ref.load_stream(rid, keys, values)
        sub = BoundedKVStep((Segment(rid, seg.span),), {rid: pos}, tokens=st.step_tokens)
        rows = slice(lane * R, lane * R + R)
        err = 0.0
        for l, (q, k, v, o) in enumerate(records):
            want = ref.attend(l, q[rows].cpu(), round_trip(k[rows], sd).cpu(), round_trip(v[rows], sd).cpu(), sub,
                              score_mod=self.model.score_mod(l, device="cpu"), positions=self.model.positions)
            err = max(err, float((o[rows].double().cpu() - want).abs().max()))
        self.checks.append({
            "step": step_no, "kind": kind, "request": rid, "stream_len": pos.length,
            "written": pos.written, "span": seg.span, "tokens": st.step_tokens, "max_abs_error": err,
        })

    def step(self, step_no: int) -> None:
        """One model step: its calls (a regular one, and a final chunk when due), checks, traffic."""
        w, R = self.w, self.w.rows
        last = step_no == w.steps - 1
        step_s = 0.0
        for kind, feeds in _feeds(w, self.traffic, self.inputs):
            _sync(self.device)
            t0 = time.perf_counter()
            res = self.session.step(feeds, self.step_fn)
            _sync(self.device)
            t2 = time.perf_counter()
            _, records = res.outputs
            st = res.step
            self.plan_times.append(res.plan_s)
            self.call_times.append(t2 - t0)
            step_s += t2 - t0
            # Reference checks: a tracked request at its last regular step or its final step
            # (its longest stream), and whatever is tracked at the end of the run.
            # The budget is released evenly over the run, so checks do not all land early.
            allowed = w.check_steps if last else (w.check_steps * (step_no + 1)) // w.steps
            by_id = {r.rid: r for r in self.traffic.active}
            for rid, lane in res.lanes.items():
                if rid not in self.tracker.hist or len(self.checks) >= allowed:
                    continue
                r = by_id[rid]
                if kind == "final" or last or r.written + w.span >= r.length:
                    self._check(step_no, kind, st, rid, lane, records)
            for rid, lane in res.lanes.items():
                if rid in self.tracker.hist:
                    self.tracker.record(rid, slice(lane * R, lane * R + R), st.segments[lane].span, records)
            for seg in st.segments:
                if seg.request_id is not None:
                    self.tokens += seg.span
                    self.longest = max(self.longest, st.positions[seg.request_id].length + seg.span)
        self.step_times.append(step_s)
        self.traffic.advance()
        for r in self.traffic.departed:
            self.session.finish(r.rid)
            self.tracker.hist.pop(r.rid, None)
            self.finished += 1
        self.arrived += len(self.traffic.arrived)
        self._start(self.traffic.arrived)
        self._account(step_no, step_s, last)

    def _account(self, step_no: int, step_s: float, last: bool) -> None:
        """Memory over the run, and progress every `progress_every_s`."""
        m, w = self.manager, self.w
        if m.memory_bytes != self.mem0:
            self.mem_flat = False
        active = self.traffic.active
        unbounded = self.source_bytes + sum(r.written for r in active) * w.entry_bytes
        self.unbounded_peak = max(self.unbounded_peak, unbounded)
        self.memory_series.append({
            "step": step_no,
            "active": len(active),
            "bounded_bytes": m.memory_bytes,
            "slots_in_use_bytes": len(active) * m.slot_bytes,
            "unbounded_bytes": unbounded,
            "step_ms": step_s * 1e3,
        })
        now = time.perf_counter()
        if self.progress is not None and (now - self.last_progress >= self.progress_every_s or last):
            self.last_progress = now
            self.progress({
                "step": step_no + 1, "steps": w.steps, "active": len(active),
                "p50_ms": percentile(self.step_times[-200:], 50) * 1e3,
                "plan_ms": percentile(self.plan_times[-200:], 50) * 1e3,
                "bounded_bytes": m.memory_bytes, "unbounded_bytes": unbounded,
                "elapsed_s": now - self.wall0,
            })

    def _process_memory(self) -> dict:
        """The process's resident memory after warm-up and at the end, and its growth per 1,000 finished
        requests (None where it cannot be read). Host state that outlived its request shows here."""
        start, end = self.rss_start, resident_bytes()
        growth = None if start is None or end is None or not self.finished else \
            (end - start) * 1000 / self.finished
        return {"rss_start_bytes": start, "rss_end_bytes": end, "rss_growth_per_1000_requests_bytes": growth}

    def report(self) -> dict:
        w, m, cfg = self.w, self.manager, self.cfg
        step_times, plan_times = self.step_times, self.plan_times
        total_s = sum(step_times)
        slots_bytes = cfg.max_slots * m.slot_bytes
        end = self.memory_series[-1] if self.memory_series else {}
        step_p50 = percentile(step_times, 50)
        plan_p50 = percentile(plan_times, 50)
        return {
            "workload": w.name,
            "summary": w.summary(),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "compile_mode": w.compile,
            "steps": w.steps,
            "calls": len(self.call_times),
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / total_s if total_s > 0 else float("nan"),
            "step_ms": {
                "p50": step_p50 * 1e3,
                "p95": percentile(step_times, 95) * 1e3,
                "mean": total_s / max(len(step_times), 1) * 1e3,
                "max": max(step_times) * 1e3 if step_times else float("nan"),
            },
            "compile_s": self.compile_s,
            "graphs_compiled": self.graphs_warm - self.graphs0,
            "recompiles_after_warmup": graphs_compiled() - self.graphs_warm,
            "plan_ms": {
                "p50": plan_p50 * 1e3,
                "mean": sum(plan_times) / max(len(plan_times), 1) * 1e3,
                "fraction_of_step": plan_p50 / step_p50 if step_p50 > 0 else float("nan"),
            },
            "memory": {
                "memory_bytes": m.memory_bytes,
                "slot_bytes": m.slot_bytes,
                "max_slots": cfg.max_slots,
                "slots_bytes": slots_bytes,
                "sources_bytes": self.source_bytes,
                "other_bytes": m.memory_bytes - slots_bytes - self.source_bytes,
                "flat": self.mem_flat,
                "slots_in_use_bytes_end": end.get("slots_in_use_bytes", 0),
                "unbounded_bytes_end": end.get("unbounded_bytes", 0),
                "unbounded_bytes_peak": self.unbounded_peak,
            },
            "process": self._process_memory(),
            "requests": {"arrived": self.arrived, "finished": self.finished, "longest_stream": self.longest,
                         "window": w.window, "sink": w.sink},
            "reference": {
                "checks": self.checks,
                "max_abs_error": max((c["max_abs_error"] for c in self.checks), default=float("nan")),
            },
            "wall_s": time.perf_counter() - self.wall0,
            "series": self.memory_series,
        }


def run_workload(
    workload: Workload,
    *,
    device="cpu",
    progress: Optional[Callable[[dict], None]] = None,
    progress_every_s: float = 2.0,
) -> dict:
    """Run `workload` and return its report (see the module docstring and docs/cli.md)."""
    run = _WorkloadRun(workload, torch.device(device), progress, progress_every_s)
    run.warm_up()
    with torch.no_grad():
        for step_no in range(workload.steps):
            run.step(step_no)
    return run.report()
