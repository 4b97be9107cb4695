"""`flexkv run --model ID_OR_PATH`: a workload's traffic streamed through a trained language model.

The workload gives the retention (`sink`, `window`, `slot_dtype`), the
traffic (`requests` lanes, `stream_len`, `arrival`, `steps`, `seed`) and the
tokens each step writes (`span`); the model (a hub id, a transformers folder
or a GGUF file, `flexkv.integrations.transformers.pretrained`) replaces the
workload's random attention model, so its `layers`, heads and `dtype` are
not used. Every active request is one batch row of a `FlexKVCache`, fed its
own stretch of `reference_text()` (request `r` starts at token `r * 1009`
modulo the text), teacher-forced `span` tokens per step. The report is the
built-in run's (steps, tokens/s, step time, memory against an unbounded
cache, requests) plus the perplexity of the tokens predicted, and a check
of the first request against the model's own cache while its whole stream
fits the window.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

from .runner import percentile
from .traffic import Traffic
from .workload import Workload

__all__ = ["check_streamable", "request_start", "run_model"]

_OFFSET = 1009  # request r's text starts at token r * _OFFSET (mod the text): distinct, reproducible stretches


def request_start(rid: int, text_tokens: int, w: Workload) -> int:
    """Where request `rid`'s stretch of the text starts: `rid * 1009` modulo what leaves room for its stream."""
    return (rid * _OFFSET) % (text_tokens - (w.stream_len[1] + w.span + 1))


def check_streamable(w: Workload) -> None:
    """Refuse a workload a causal language model cannot stream exactly: one message, the value and the fix."""
    problems = []
    if w.source_len:
        problems.append(f"source_len {w.source_len} (a shared source: a language model's stream has none; use 0)")
    if w.rows != 1:
        problems.append(f"rows {w.rows} (one stream per request: use rows 1)")
    if w.query_window is not None:
        problems.append(f"query_window {w.query_window} (a causal model attends its own past: drop query_window)")
    if w.window_includes_step:
        problems.append("window_includes_step: true (a token attends itself on top of the window: use false)")
    if w.reverse_step_order:
        problems.append("reverse_step_order: true (tokens run forward: use false)")
    if w.score_bias != "none":
        problems.append(f"score_bias {w.score_bias} (the model brings its own positions: use none)")
    if w.final_tokens is not None:
        problems.append(f"final_tokens {w.final_tokens} (every step writes what it carries: drop final_tokens)")
    if w.step_tokens != w.span:
        problems.append(f"tokens {w.step_tokens} != span {w.span} (every token a step carries is written: "
                        f"drop tokens)")
    if problems:
        raise ValueError(f"workload {w.name!r} cannot be streamed through a language model exactly: "
                         + "; ".join(problems))


def run_model(w: Workload, model, tokenizer, *, device=None,
              progress: Optional[Callable[[dict], None]] = None, progress_every_s: float = 1.0) -> dict:
    """Drive `w`'s traffic through `model` with a `FlexKVCache`; returns the report (a plain dict)."""
    from transformers import DynamicCache

    from ..cache.storage.quantized import slot_dtype_named
    from ..config import SinkWindow
    from ..integrations.transformers import FlexKVCache
    from ..integrations.transformers.pretrained import reference_text

    check_streamable(w)
    wall0 = time.perf_counter()
    if device is not None:
        model = model.to(device)
    text = tokenizer(reference_text(), return_tensors="pt").input_ids[0].to(model.device)
    longest_possible = w.stream_len[1] + w.span + 1
    if text.numel() < longest_possible:
        raise ValueError(f"stream_len up to {w.stream_len[1]} is longer than the text ({text.numel()} tokens)")
    retention = SinkWindow(w.sink, w.window)
    cache = FlexKVCache(model, retention, max_streams=w.requests, prefill_chunk=max(w.span, 1),
                        slot_dtype=slot_dtype_named(w.slot_dtype))
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    token_bytes = 2 * cfg.num_hidden_layers * heads * head_dim * torch.finfo(model.dtype).bits // 8

    traffic = Traffic(w)
    offsets = {}

    def tokens_of(r, upto):  # the request's tokens [r.written, upto) and the ones they predict
        base = offsets.setdefault(r.rid, request_start(r.rid, text.numel(), w))
        return text[base + r.written:base + upto], text[base + r.written + 1:base + upto + 1]

    nll_sum, nll_count, evicted_sum, evicted_count = 0.0, 0, 0.0, 0
    step_times, arrived, finished, longest = [], len(traffic.active), 0, 0
    mem0 = cache.memory_bytes
    flat, unbounded_peak, unbounded_end, in_use_end = True, 0, 0, 0
    tracked = traffic.active[0].rid if traffic.active else None
    own = DynamicCache(config=cfg)
    check_worst, check_steps = 0.0, 0
    last_report = time.perf_counter()
    for step_no in range(w.steps):
        active = [r for r in traffic.active if not r.final]
        if active:
            x, y = zip(*(tokens_of(r, r.written + w.span) for r in active))
            x, y = torch.stack(x), torch.stack(y)
            t0 = time.perf_counter()
            with torch.no_grad():
                logits = model(x, cache=cache.select([r.rid for r in active])).logits
            step_times.append(time.perf_counter() - t0)
            nll = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), y.flatten(), reduction="none")
            nll = nll.view(len(active), w.span)
            nll_sum += nll.sum().item()
            nll_count += nll.numel()
            for row, r in enumerate(active):
                first = max(0, w.sink + w.window + 1 - r.written)  # the queries past the first eviction
                evicted_sum += nll[row, first:].sum().item()
                evicted_count += max(0, w.span - first)
                if r.rid == tracked and r.written + w.span <= w.sink + w.window + 1:
                    with torch.no_grad():
                        ref = model(x[row:row + 1], cache=own).logits
                    check_worst = max(check_worst, (ref[0] - logits[row]).abs().max().item())
                    check_steps += 1
        traffic.advance()
        for r in traffic.departed:
            finished += 1
            longest = max(longest, r.written)
            cache.finish(r.rid)
        arrived += len(traffic.arrived)
        flat = flat and cache.memory_bytes == mem0
        alive = traffic.active
        unbounded_end = sum(r.written for r in alive) * token_bytes
        unbounded_peak = max(unbounded_peak, unbounded_end)
        in_use_end = len(alive) * cache.stream_bytes
        longest = max([longest] + [r.written for r in alive])
        now = time.perf_counter()
        if progress is not None and (now - last_report >= progress_every_s or step_no + 1 == w.steps):
            last_report = now
            progress({"step": step_no + 1, "steps": w.steps, "active": len(alive),
                      "p50_ms": percentile(step_times[-200:], 50) * 1e3, "bounded_bytes": cache.memory_bytes,
                      "unbounded_bytes": unbounded_end, "elapsed_s": now - wall0})
    total_s = sum(step_times)
    tokens = nll_count
    return {
        "model": type(model).__name__,
        "workload": w.name,
        "layers": cfg.num_hidden_layers,
        "kv_heads": heads,
        "head_dim": head_dim,
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "steps": w.steps,
        "calls": len(step_times),
        "tokens": tokens,
        "tokens_per_s": tokens / total_s if total_s > 0 else float("nan"),
        "step_ms": {"p50": percentile(step_times, 50) * 1e3, "p95": percentile(step_times, 95) * 1e3,
                    "mean": statistics.fmean(step_times) * 1e3 if step_times else float("nan")},
        "memory": {"memory_bytes": cache.memory_bytes, "stream_bytes": cache.stream_bytes, "max_slots": w.requests,
                   "flat": flat, "unbounded_bytes_end": unbounded_end, "unbounded_bytes_peak": unbounded_peak,
                   "slots_in_use_bytes_end": in_use_end},
        "requests": {"arrived": arrived, "finished": finished, "longest_stream": longest, "sink": w.sink,
                     "window": w.window, "slot_dtype": w.slot_dtype},
        "perplexity": {"all": _exp(nll_sum, nll_count), "tokens": nll_count,
                       "past_first_eviction": _exp(evicted_sum, evicted_count), "tokens_past_first_eviction":
                       evicted_count},
        "reference": {"request": tracked, "steps": check_steps, "max_abs_error": check_worst if check_steps
                      else float("nan")},
        "wall_s": time.perf_counter() - wall0,
    }


def _exp(total: float, count: int) -> float:
    import math

    return math.exp(total / count) if count else float("nan")
