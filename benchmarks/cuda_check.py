"""flexkv on a CUDA device: correctness, recompiles, decode bandwidth, host planning.

    python -m benchmarks.cuda_check [--json PATH] [--cpu] [--budget SECONDS]

Written to fit one run in a 10-minute window: output is line-buffered, the
JSON file (`--json`) is rewritten after every correctness row and every
section, so a run cut short still leaves what it measured; the correctness
checks run in two passes, every workload in bf16 (or its only dtype) before
the timing and the fp32 rows after it; the time budget for optional variants
(`--budget`) counts from the first timing, not from the start; and after
`--deadline` seconds (500 on CUDA) nothing new starts.

1. Random workloads (requests joining, leaving and resetting, padding
   segments, varying spans) run through a compiled model step that calls
   `BoundedKVManager.attend` for every layer, and every output is compared
   with the dense float64 reference (`flexkv.model.reference.ReferenceCache`) by a
   norm-relative error, `||out - ref|| / ||ref||` per step, in fp32 and bf16:
   GQA, chunked steps, sources, CFG rows (`rows_per_request=2`), reverse step
   order, per-query windows with a score_mod, a step whose GQA group packs
   more than 128 query rows (T=33, 4-way GQA), which torch's decode kernel
   cannot tile by default, a workload planned with full blocks forced on
   (blocks every query reads whole skip the mask; the check fails if no plan
   listed one), and learned sinks at T=1 (the decode kernel) and T=33 with
   4-way GQA (the main kernel), whose log-sum-exp each kernel forms its own
   way. A workload that fails as shipped is run again with
   `flex_kernel_options` injected, to tell whether those options fix it.
2. Recompiles after the first (compiling) step are counted with
   `torch._dynamo.utils.counters["stats"]["unique_graphs"]`; 0 is expected.
3. Decode at 64 requests x window 4096 (sink 4) x 32 query / 8 KV heads x
   head_dim 128 in bf16: the compiled `attend` of one layer and of every
   layer, SDPA (`enable_gqa`) over the same retained entries laid out
   contiguously (its output is compared with flexkv's, norm-relative), and a
   device copy of the bytes the step must read (the retained keys and values
   of every row). GPU times come from CUDA events, warm-up excluded. `GB/s`
   is bytes read over time; the copy's is bytes moved (read + write) over
   time, and `% copy` is the one over the other. Then, while the budget
   lasts, the same layer under other settings, most informative first: no
   full-block tensors, a small batch as shipped and without full-block
   tensors, torch's own kernel options, the main kernel forced (a variant
   whose options equal the shipped ones is not run).
4. Host planning (`manager.plan`) and a whole step (admit, plan, every
   layer, commit) are timed with `torch.utils.benchmark.Timer`.
5. Quantized slots (after everything above, `--skip-quantized` to leave it
   out): decode at the bench shape with float8 e4m3 cells (a float32 scale
   per cell and head) against bf16 cells, one compiled layer each: as
   shipped (FlexAttention over the dequantized layer), then on CUDA with the
   kernel reading cells as stored (`QUANTIZED_VARIANTS`): keys and values,
   keys alone (`AttentionOptions(quantized_keys_in_kernel=True)`, the scale in
   `score_mod`), values alone (`quantized_values_in_kernel=True`, two calls:
   `flexkv.cache.storage.quantized.value_scaled_attention`), while the deadline
   allows. Time, bytes the step must read over time, and the norm-relative
   error against a bf16 cache holding the dequantized cells.
6. The vLLM plugin's paged path (`benchmarks/cuda_paged.py`, after the first
   correctness pass; `--paged-only` runs it alone, `--skip-paged` leaves it
   out): the retention's block mask over a paged cache and the in-cache sink
   `score_mod` (`flexkv.integrations.vllm.paged`, torch alone) in one compiled
   FlexAttention call with vLLM's kernel options, against a dense reference
   written from docs/vllm.md (fp32, bf16, both position modes), recompiles
   over steps of 1, 8, 64 and 512 tokens, a CUDA graph captured over padded
   rows and replayed with new content, and decode time against a plain
   sliding window of the same size at 4k, 32k and 128k positions.

The kernel options each compiled `flex_attention` call received are printed
once per distinct call. Without a CUDA device (or with `--cpu`) the same
checks run at tiny shapes on the CPU. Each section reports its own errors and
the run goes on; the exit code is 1 when any correctness check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.benchmark import Timer

import flexkv.cache.paths.flex_call as flex_call_module
from benchmarks import cuda_paged
from benchmarks.timing import device_ms as gpu_ms
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Recall, Segment, SinkWindow, StreamPosition
from flexkv.cache.host.layout import entry_cell
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.paths.kernel_options import decode_split_kv, flex_kernel_options
from flexkv.cache.storage import quantized
from flexkv.compiling import fresh_function
from tests.random_workload import RandomWorkload, relative_error, score_bias

#: Norm-relative tolerances, `||out - ref|| / ||ref||`: an absolute bound on bf16 outputs of a few
#: thousand keys (values of order 1e-2) would not see a missing block.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


# --------------------------------------------------------------- kernel options


def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def flexkv_options(capability) -> Callable:
    """`flex_kernel_options` for the shapes `flex_attention` is called with."""

    def options(query, key, block_mask):
        q_block, kv_block = block_mask.BLOCK_SIZE
        return flex_kernel_options(
            query.device.type, query.shape[2], key.shape[1], query.shape[1], query.shape[3], query.dtype,
            kv_block, q_block_size=q_block, capability=capability,
        )

    return options


@contextlib.contextmanager
def kernel_options_as(options: Optional[Callable], drop_full_blocks: bool = False):
    """Make `attend` call `flex_attention` with `kernel_options=options(query, key, block_mask)`.

    Replaces whatever `attend` passes (`options=None` leaves it). With
    `drop_full_blocks`, the block mask is rebuilt without its full-block
    tensors (exact only when the plan lists no full blocks): torch's decode
    kernel splits a row's work differently when they are absent. Dynamo
    guards on the patched global, so a function compiled inside the context
    must also run inside it.
    """
    if not hasattr(flex_call_module, "flex_attention"):
        raise RuntimeError("flexkv.cache.paths.flex_call no longer calls flex_attention by that name; cannot set kernel "
                           "options")
    original = flex_call_module.flex_attention

    def flex_attention(query, key, value, *args, **kwargs):
        block_mask = kwargs.get("block_mask", args[1] if len(args) > 1 else None)
        if drop_full_blocks and block_mask is not None:
            block_mask = BlockMask.from_kv_blocks(
                block_mask.kv_num_blocks, block_mask.kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths, compute_q_blocks=False)
            if "block_mask" in kwargs:
                kwargs["block_mask"] = block_mask
            else:
                args = (args[0], block_mask) + tuple(args[2:])
        if options is not None:
            kwargs["kernel_options"] = options(query, key, block_mask)
        return original(query, key, value, *args, **kwargs)

    flex_call_module.flex_attention = flex_attention
    try:
        yield
    finally:
        flex_call_module.flex_attention = original


class CompiledOptions:
    """Records the kernel options of every FlexAttention call inductor lowers (as the lowering leaves
    them, torch's own defaults filled in); `report_new` prints each distinct one once.

    It wraps inductor's lowering rather than `flex_attention`: code dynamo traces may not keep a
    record (a list it appends to becomes a side effect replayed, and guarded, on every call).
    Graphs served from the FX graph cache are not lowered again, so they show nothing.
    """

    def __init__(self):
        self.calls: list = []
        self.printed: set = set()

    @contextlib.contextmanager
    def recording(self):
        try:
            from torch._inductor import lowering
            op = torch.ops.higher_order.flex_attention
            original = lowering.lowerings[op]
        except (ImportError, AttributeError, KeyError):
            yield
            return
        calls = self.calls

        def sizes(node):
            try:
                return [int(x) for x in node.get_size()]
            except Exception:
                return "?"

        def flex_attention_lowering(query, key, value, subgraph, block_mask, scale, kernel_options, *rest, **kw):
            out = original(query, key, value, subgraph, block_mask, scale, kernel_options, *rest, **kw)
            try:
                calls.append((sizes(query), sizes(key), str(query.get_dtype()).replace("torch.", ""),
                              dict(kernel_options)))
            except Exception:
                pass
            return out

        lowering.lowerings[op] = flex_attention_lowering
        try:
            yield
        finally:
            lowering.lowerings[op] = original

    def report_new(self, report: dict) -> None:
        for q, k, dtype, options in self.calls:
            line = f"q {q} k {k} {dtype}: {dict(sorted(options.items()))}"
            if line in self.printed:
                continue
            self.printed.add(line)
            report.setdefault("kernel_options_compiled", []).append(line)
            print(f"  compiled FlexAttention: {line}")


# ------------------------------------------------------------------ workloads


class Stream:
    """Random steps through a compiled model step and the dense reference (`tests/random_workload.py`)."""

    def __init__(self, name: str, cfg: BoundedKVConfig, device, *, q_heads: int, tokens: int, segments: int,
                 block_size: int, seed: int, churn: float = 0.2, score_mod=None, positions: str = "stream",
                 compiled: bool = True, sinks: bool = False, full_blocks: bool = False, path: str = "auto"):
        options = AttentionOptions.for_cache(cfg, device, path=path, full_blocks=True) if full_blocks else \
            AttentionOptions.for_cache(cfg, device, path=path)
        m = BoundedKVManager(cfg, torch.device(device), block_size=block_size, options=options)
        if full_blocks:
            # Every step planned with full blocks, whatever the batch (CUDA's default turns them off
            # for small decode batches): the kernels' full-block branch is what this checks.
            m.paths.full_blocks_at = lambda rows, tokens: True
        gen = torch.Generator().manual_seed(seed)
        learned = (torch.randn(q_heads, generator=gen) * 2).to(m.device) if sinks else None
        layers = cfg.num_layers

        def model_step(plan, qs, ks, vs):
            return [m.attend(l, qs[l], ks[l], vs[l], plan, score_mod=score_mod, positions=positions, sinks=learned)
                    for l in range(layers)]

        run = model_step
        if compiled:
            run = torch.compile(fresh_function(model_step, f"check_{name}"), fullgraph=True, dynamic=False)
        self.work = RandomWorkload(
            cfg, manager=m, q_heads=q_heads, segments=segments, seed=seed, fixed_tokens=tokens, churn=churn,
            score_mod=score_mod, positions=positions, sinks=learned, num_sources=cfg.max_sources,
            attend=lambda manager, plan, qs, ks, vs: run(plan, qs, ks, vs))
        self.full_blocks_seen = 0

    def step(self) -> tuple:
        """One step; returns the largest norm-relative and absolute error over its layers' outputs."""
        w = self.work
        w.worst = w.worst_relative = 0.0
        w.step()
        self.full_blocks_seen += sum(len(w.plan.blocks(i, full=True)) for i in range(w.plan.rows))
        return w.worst_relative, w.worst


def _retention_with_sources(sink: int, window: int):
    def retention(n):
        return SinkWindow(1 + (n + sink) % 4, window + n % 3, window_includes_step=n % 2 == 1)

    return retention


def workload_specs(cuda: bool) -> list:
    """(name, config, stream kwargs, steps, dtypes): CUDA-sized or CPU-tiny."""
    D = 64 if cuda else 16
    win = 70 if cuda else 11
    steps = 30 if cuda else 10
    blk = (16, 32, 64) if cuda else (8, 16, 16)
    both = (torch.float32, torch.bfloat16)
    return [
        ("src+cfg+gqa4+chunk+reverse",
         BoundedKVConfig(num_layers=2 if cuda else 1, num_heads=2, head_dim=D, rows_per_request=2,
                         max_source_len=40 if cuda else 6, retention=_retention_with_sources(1, win),
                         reverse_step_order=True, max_step_tokens=4, max_slots=4, max_sources=2),
         dict(q_heads=8, tokens=4, segments=3, block_size=blk[0]), steps, both),
        ("per-query-window+score_mod+gqa4",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=SinkWindow(2, win), query_window=win - 5, max_step_tokens=9, max_slots=4),
         dict(q_heads=8, tokens=9, segments=3, block_size=blk[1], score_mod=score_bias, positions="cache"),
         steps, (torch.float32,)),
        ("decode-tile-T33-gqa4",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=SinkWindow(4, 3 * win), max_step_tokens=33, max_slots=4),
         dict(q_heads=8, tokens=33, segments=3, block_size=blk[2]), max(steps // 2, 6), both),
        # Sources several blocks long, read whole from the first step: planned as full blocks.
        ("full-blocks-forced-decode-gqa4",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=4 * win,
                         min_source_len=2 * win, retention=SinkWindow(4, 8 * win), max_step_tokens=1, max_slots=4,
                         max_sources=1),
         dict(q_heads=8, tokens=1, segments=3, block_size=blk[1], full_blocks=True, churn=0.05), steps, both),
        ("full-blocks-forced-chunk-src",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=4 * win,
                         retention=SinkWindow(2, 6 * win), max_step_tokens=4, max_slots=4, max_sources=1),
         dict(q_heads=4, tokens=4, segments=3, block_size=blk[1], full_blocks=True, churn=0.05), steps, both),
        ("sinks-decode-gqa4",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=SinkWindow(4, 3 * win), max_step_tokens=1, max_slots=4),
         dict(q_heads=8, tokens=1, segments=3, block_size=blk[2], sinks=True), steps, both),
        ("sinks-T33-gqa4-main-kernel",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=SinkWindow(4, 3 * win), max_step_tokens=33, max_slots=4),
         dict(q_heads=8, tokens=33, segments=3, block_size=blk[2], sinks=True), max(steps // 2, 6), both),
        # A memory of what left the window, its top blocks chosen on the device; streams long enough to fill and
        # wrap the memory. Without a score_mod, one FlexAttention call reads the window in place and the chosen
        # entries copied next to it (`recall_region`: one bound per row and head, or under a per-query window
        # each query's own entries); with one, the window's log-sum-exp is joined with the memory part.
        ("recall-chunk-gqa4",
         BoundedKVConfig(num_layers=2 if cuda else 1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=Recall(2, win // 2, 8 * (win // 4), win // 4, 2), max_step_tokens=8, max_slots=4),
         dict(q_heads=8, tokens=8, segments=3, block_size=blk[1], churn=0.02), steps * 2, both),
        ("recall-query-window-chunk-gqa4",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=Recall(2, win // 2, 8 * (win // 4), win // 4, 2), query_window=win // 2,
                         max_step_tokens=4, max_slots=4),
         dict(q_heads=8, tokens=4, segments=3, block_size=blk[1], churn=0.02), steps * 3, both),
        ("recall-decode-gqa4-cache-positions",
         BoundedKVConfig(num_layers=1, num_heads=2, head_dim=D, rows_per_request=1, max_source_len=0,
                         retention=Recall(4, win, 4 * 8, 8, 2), max_step_tokens=1, max_slots=4),
         dict(q_heads=8, tokens=1, segments=3, block_size=blk[2], score_mod=score_bias, positions="cache",
              churn=0.02), steps * 8, (torch.float32,)),
    ]


def run_workload(name, cfg, kw, steps, device, dtype, seed=0, options: Optional[Callable] = None,
                 compiled: bool = True) -> dict:
    """Run one workload; returns its figures (raises only on a setup error). `compiled=False` runs eagerly."""
    cfg = cfg.replace(dtype=dtype)
    res = dict(name=name, dtype=str(dtype).replace("torch.", ""), steps=steps, tol=TOL[dtype],
               kernel_options="flex_kernel_options" if options else "as shipped", ok=False)
    torch._dynamo.reset()
    ctx = kernel_options_as(options) if options else contextlib.nullcontext()
    with ctx:
        s = Stream(f"{name}_{res['dtype']}_{'opt' if options else 'ship'}", cfg, device, seed=seed,
                   compiled=compiled, **kw)
        t0 = time.perf_counter()
        try:
            rel, worst = s.step()
            if device_type(device) == "cuda":
                torch.cuda.synchronize()
            res["compile_s"] = time.perf_counter() - t0
            graphs = _unique_graphs()
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                r, w = s.step()
                rel, worst = max(rel, r), max(worst, w)
            res["step_ms"] = (time.perf_counter() - t0) / max(steps - 1, 1) * 1e3
            res["recompiles"] = _unique_graphs() - graphs
            res["rel_err"] = rel
            res["max_abs_err"] = worst
            res["ok"] = rel <= TOL[dtype] and res["recompiles"] == 0
            if kw.get("full_blocks"):
                res["full_blocks_planned"] = s.full_blocks_seen
                if not s.full_blocks_seen:
                    res["ok"] = False
                    res["error"] = "no plan listed a full block: the workload does not check the full-block path"
        except Exception as e:  # a compile or kernel failure is a result, not a crash of the check
            res.setdefault("compile_s", time.perf_counter() - t0)
            res["error"] = f"{type(e).__name__}: {_first_line(e)}"
    return res


#: Messages of a device fault after which the CUDA context is unusable: every later kernel fails with it.
CONTEXT_FAULTS = ("illegal memory access", "unspecified launch failure", "device-side assert")


def context_fault(error: Optional[str]) -> bool:
    """Whether a row's error is a fault that leaves the CUDA context unusable for the rest of the run."""
    return bool(error) and any(f in error for f in CONTEXT_FAULTS)


def device_type(device) -> str:
    return torch.device(device).type


def _first_line(e: BaseException) -> str:
    lines = [l for l in str(e).splitlines() if l.strip()]
    keep = [l for l in lines if "Error" in l or "error" in l] or lines
    return (keep[0] if keep else repr(e))[:300]


def correctness_rows(cuda: bool, first: bool) -> list:
    """The (workload, dtype) checks of one pass: the first pass holds each workload's first-listed
    dtype that is not fp32 (bf16, what a GPU serves) or its only one; the second, the rest."""
    out = []
    for name, cfg, kw, steps, dtypes in workload_specs(cuda):
        lead = next((d for d in dtypes if d != torch.float32), dtypes[0])
        for dtype in dtypes:
            if (dtype == lead) == first:
                out.append((name, cfg, kw, steps, dtype))
    return out


def correctness(device: torch.device, report: dict, save: Callable[[], None],
                recorder: Optional[CompiledOptions] = None, first: Optional[bool] = None,
                deadline: Optional[float] = None, skip: tuple = ()) -> None:
    """The workloads of `workload_specs` (`first`: one pass of `correctness_rows`; None: both), the
    report saved after every row; past `deadline` (a `time.monotonic()` value) the rest are skipped.
    (The kernel options `attend` passes are `flex_kernel_options` already: no second run with them.)"""
    cuda = device.type == "cuda"
    rows = report.setdefault("correctness", [])
    todo = correctness_rows(cuda, True) + correctness_rows(cuda, False) if first is None else \
        correctness_rows(cuda, first)
    for name, cfg, kw, steps, dtype in todo:
        lost = report.get("context_lost")
        if lost:
            # Rows run after a fault would only repeat it: say so instead of listing them as failures.
            report.setdefault("skipped", []).append(f"correctness {name} {dtype}: the CUDA context was lost at {lost}")
            print(f"  (skipped: the CUDA context was lost at {lost}) {name} {str(dtype).replace('torch.', '')}")
            continue
        if any(part in name for part in skip):
            report.setdefault("skipped", []).append(f"correctness {name} {dtype}: --skip")
            continue
        if deadline is not None and time.monotonic() > deadline:
            report.setdefault("skipped", []).append(f"correctness {name} {dtype}: past the deadline")
            print(f"  (skipped, past the deadline) {name} {str(dtype).replace('torch.', '')}")
            continue
        try:
            res = run_workload(name, cfg, kw, steps, device, dtype)
            if recorder is not None:
                recorder.report_new(report)
        except Exception as e:
            res = dict(name=name, dtype=str(dtype), ok=False, error=f"{type(e).__name__}: {_first_line(e)}")
            traceback.print_exc()
        rows.append(res)
        _print_correctness_row(res)
        if context_fault(res.get("error")):
            report["context_lost"] = f"{name} {str(dtype).replace('torch.', '')}"
            print(f"  the CUDA context is unusable after this fault: the rest of the run is skipped; run each "
                  f"workload apart with `python -m benchmarks.cuda_probe NAME ship` (and --skip {name})")
        save()


# --------------------------------------------------------------------- timing


def bench_shape(cuda: bool) -> dict:
    if cuda:
        return dict(requests=64, window=4096, sink=4, q_heads=32, kv_heads=8, head_dim=128, layers=4,
                    dtype=torch.bfloat16, block=128, small_batch=4)
    return dict(requests=4, window=252, sink=4, q_heads=8, kv_heads=2, head_dim=32, layers=2,
                dtype=torch.float32, block=64, small_batch=1)


class Decode:
    """Every request far past its window (rings wrapped), random cache content, one decode step."""

    def __init__(self, device: torch.device, shape: dict, *, full_blocks: Optional[bool] = None, seed: int = 0,
                 slot_dtype: Optional[torch.dtype] = None, in_kernel: tuple = (False, False)):
        s = shape
        self.device, self.s = device, s
        self.cfg = BoundedKVConfig(num_layers=s["layers"], num_heads=s["kv_heads"], head_dim=s["head_dim"],
                                   rows_per_request=1, max_source_len=0, retention=SinkWindow(s["sink"], s["window"]),
                                   max_slots=s["requests"], max_step_tokens=1, max_sources=0, dtype=s["dtype"],
                                   slot_dtype=slot_dtype)
        changes = {} if full_blocks is None else {"full_blocks": full_blocks}
        if any(in_kernel):
            changes.update(quantized_keys_in_kernel=in_kernel[0], quantized_values_in_kernel=in_kernel[1])
        options = AttentionOptions.for_cache(self.cfg, device, **changes) if changes else None
        self.m = m = BoundedKVManager(self.cfg, device, block_size=s["block"], options=options)
        g = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for name, buf in m.named_buffers():
                if name.startswith(("k_cache_", "v_cache_")):
                    x = torch.randn(buf.shape, generator=g, device=device, dtype=s["dtype"])
                    if slot_dtype is None:
                        buf.copy_(x)
                    else:  # quantized slots: the cells and scales of that content
                        cells, scale = quantized.quantize(x, slot_dtype)
                        buf.copy_(cells)
                        getattr(m, name.replace("_cache_", "_scale_")).copy_(scale)
        B, ring = s["requests"], s["window"] + 1
        base = s["sink"] + 3 * ring
        self.written = [base + (7 * i) % 11 for i in range(B)]  # staggered ring offsets
        rids = list(range(B))
        m.admit(BoundedKVStep(tuple(Segment(r, 1) for r in rids), {r: StreamPosition(0, 0) for r in rids}))
        m.commit(BoundedKVStep(tuple(Segment(r, 1) for r in rids),
                               {r: StreamPosition(0, self.written[r] - 1) for r in rids}))
        self.kept = s["sink"] + s["window"]
        N, Hq, H, D = B, s["q_heads"], s["kv_heads"], s["head_dim"]
        self.q = torch.randn(N, Hq, 1, D, generator=g, device=device, dtype=s["dtype"])
        self.k = [torch.randn(N, H, 1, D, generator=g, device=device, dtype=s["dtype"]) for _ in range(s["layers"])]
        self.v = [torch.randn(N, H, 1, D, generator=g, device=device, dtype=s["dtype"]) for _ in range(s["layers"])]

    def step(self, requests: Optional[int] = None) -> BoundedKVStep:
        rids = range(requests or self.s["requests"])
        return BoundedKVStep(tuple(Segment(r, 1) for r in rids),
                             {r: StreamPosition(0, self.written[r]) for r in rids})

    def advance(self, step: BoundedKVStep) -> None:
        self.m.commit(step)
        for seg in step.segments:
            self.written[seg.request_id] += 1

    def read_bytes(self, rows: Optional[int] = None) -> int:
        """Retained keys and values every row of the step must read, one layer."""
        s = self.s
        itemsize = torch.empty((), dtype=s["dtype"]).element_size()
        return 2 * (rows or s["requests"]) * s["kv_heads"] * self.kept * s["head_dim"] * itemsize

    def layer_fn(self, layer: int = 0, tag: str = ""):
        m = self.m

        def attend_layer(plan, q, k, v):
            return m.attend(layer, q, k, v, plan)

        return torch.compile(fresh_function(attend_layer, f"decode{layer}{tag}"), fullgraph=True, dynamic=False)

    def contiguous_kv(self, plan, layer: int = 0):
        """The retained entries of every row, in stream order, as `[N, H, kept, D]` keys and values."""
        ring = self.m.layout.ring_len
        cells = []
        for i, n in enumerate(self.written):
            row = plan.row(i)
            kept = list(range(self.s["sink"])) + list(range(n - self.s["window"], n))
            cells.append([entry_cell(row, ring, j)[1] for j in kept])
        idx = torch.tensor(cells, device=self.device)
        kc, vc = getattr(self.m, f"k_cache_{layer}")[0], getattr(self.m, f"v_cache_{layer}")[0]
        return kc[:, idx].permute(1, 0, 2, 3).contiguous(), vc[:, idx].permute(1, 0, 2, 3).contiguous()


#: Section 5's float8 caches, in the order they run: (name, (keys, values) read by the kernel as stored).
QUANTIZED_VARIANTS = (
    ("fp8 cells (dequantized layer), 1 layer", (False, False)),
    ("fp8 cells (keys and values in the kernel), 1 layer", (True, True)),
    ("fp8 cells (keys in the kernel), 1 layer", (True, False)),
    ("fp8 cells (values in the kernel), 1 layer", (False, True)),
)


def quantized_decode(device: torch.device, report: dict, save: Callable[[], None],
                     deadline: Optional[float] = None) -> None:
    """Section 5: float8 cells against bf16 cells at the bench shape, one compiled layer each; the
    variants that read cells in the kernel (CUDA only) while `deadline` (monotonic) allows."""
    cuda = device.type == "cuda"
    s = bench_shape(cuda)
    t = report.setdefault("quantized", {})
    rows = t.setdefault("rows", [])
    torch._dynamo.reset()
    fp8 = Decode(device, s, slot_dtype=torch.float8_e4m3fn)
    # The bf16 twin holds exactly what the float8 cells read back, and steps the same inputs.
    twin = Decode(device, s)
    with torch.no_grad():
        for l in range(s["layers"]):
            for i, buf in enumerate(twin.m.store.layer_kv(l)):
                buf.copy_(quantized.dequantize(fp8.m.store.layer_kv(l)[i], fp8.m.store.layer_scales(l)[i], s["dtype"]))
    k = quantized.round_trip(fp8.k[0], torch.float8_e4m3fn)
    v = quantized.round_trip(fp8.v[0], torch.float8_e4m3fn)
    q = fp8.q
    kept = fp8.kept
    N, H, D = s["requests"], s["kv_heads"], s["head_dim"]
    bf16_bytes = twin.read_bytes()
    fp8_bytes = 2 * N * H * kept * (D * 1 + 4)  # one byte a number, a float32 scale per cell and head
    t["read_bytes_per_layer"] = dict(bf16=bf16_bytes, fp8=fp8_bytes)
    want = None
    try:
        f = twin.layer_fn(0, "q-bf16")
        plan = twin.m.plan(twin.step())
        with torch.no_grad():
            want = f(plan, q, k, v).clone()
        rows.append(_row(f"{str(s['dtype']).split('.')[-1]} cells, 1 layer", gpu_ms(lambda: f(plan, q, k, v), device), bf16_bytes))
    except Exception as e:
        _section_error(report, "quantized/bf16", e)
    save()
    for name, in_kernel in QUANTIZED_VARIANTS:
        if any(in_kernel) and not cuda:
            continue
        if deadline is not None and time.monotonic() > deadline:
            report.setdefault("skipped", []).append(f"quantized/{name}: past the deadline")
            continue
        try:
            # Options are fixed when a cache is built: each variant is a cache of its own, with the
            # same seed (the same cells and inputs).
            d8 = Decode(device, s, slot_dtype=torch.float8_e4m3fn, in_kernel=in_kernel) if any(in_kernel) else fp8
            f = d8.layer_fn(0, f"q-fp8-{int(in_kernel[0])}{int(in_kernel[1])}")
            plan = d8.m.plan(d8.step())
            with torch.no_grad():
                got = f(plan, q, k, v).clone()
            err = relative_error(got, want) if want is not None else None
            row = _row(name, gpu_ms(lambda: f(plan, q, k, v), device), fp8_bytes, rel_err=err,
                       ok=err is not None and err < 1e-2)
            print(f"    norm-relative error against bf16 cells holding the dequantized values: {err}")
            rows.append(row)
        except Exception as e:
            _section_error(report, f"quantized/{name}", e)
            rows.append(dict(name=name, ok=False, error=_first_line(e)))
        save()


def _row(name, ms, nbytes=None, copy_gbs=None, **extra):
    r = dict(name=name, ms=ms, **extra)
    if nbytes is not None and ms:
        r["gb_s"] = nbytes / (ms * 1e-3) / 1e9
        if copy_gbs:
            r["copy_fraction"] = r["gb_s"] / copy_gbs
    _print_timing_row(r)
    return r


def timing(device: torch.device, report: dict, budget_s: float, save: Callable[[], None],
           recorder: Optional[CompiledOptions] = None, hard_deadline: Optional[float] = None) -> None:
    """Decode timing at the bench shape, then variants until `budget_s` seconds after its start (and
    not past `hard_deadline`, a `time.monotonic()` value)."""
    deadline = time.monotonic() + budget_s  # counted from the first timing, not from the script's start
    cuda = device.type == "cuda"
    s = bench_shape(cuda)
    t = report.setdefault("timing", {})
    t["budget_s"] = budget_s
    t["shape"] = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in s.items()}
    rows = t.setdefault("rows", [])
    torch._dynamo.reset()
    d = Decode(device, s)
    nbytes = d.read_bytes()
    t["read_bytes_per_layer"] = nbytes
    if cuda:
        props = torch.cuda.get_device_properties(device)
        t["sm_count"] = props.multi_processor_count
        t["torch_split_kv"] = decode_split_kv(s["requests"], s["kv_heads"], props.multi_processor_count)
        t["torch_split_kv_small_batch"] = decode_split_kv(s["small_batch"], s["kv_heads"], props.multi_processor_count)

    # Device copy of the bytes the step reads: the bandwidth the step is measured against.
    copy_gbs = None
    try:
        src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
        dst = torch.empty_like(src)
        ms = gpu_ms(lambda: dst.copy_(src), device)
        copy_gbs = 2 * nbytes / (ms * 1e-3) / 1e9
        rows.append(_row("copy (read+write)", ms, 2 * nbytes))
        src = dst = None  # free them (a closure above reads them, so not `del`)
    except Exception as e:
        _section_error(report, "timing/copy", e)
    save()

    step = d.step()
    plan = d.m.plan(step)
    q, k, v = d.q, d.k[0], d.v[0]
    out = None
    f1 = None
    try:
        f1 = d.layer_fn(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = f1(plan, q, k, v).clone()
        if cuda:
            torch.cuda.synchronize(device)
        t["compile_s"] = time.perf_counter() - t0
        print(f"  (compile of one layer's attend: {t['compile_s']:.1f} s)")
        if recorder is not None:
            recorder.report_new(report)
        rows.append(_row("flexkv attend, 1 layer", gpu_ms(lambda: f1(plan, q, k, v), device), nbytes, copy_gbs))
    except Exception as e:
        _section_error(report, "timing/flexkv 1 layer", e)
    save()

    # SDPA over the same retained entries (plus the step's own token) laid out contiguously.
    try:
        Kc, Vc = d.contiguous_kv(plan, 0)
        Kc, Vc = torch.cat([Kc, k], dim=2), torch.cat([Vc, v], dim=2)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q, Kc, Vc, enable_gqa=True)
        if out is not None:
            rel = relative_error(out, ref)
            tol = TOL[s["dtype"]]
            t["flexkv_vs_sdpa"] = dict(rel_err=rel, tol=tol, ok=rel <= tol,
                                       max_abs_err=(out.double() - ref.double()).abs().max().item())
            print(f"  flexkv vs SDPA at this shape: ||diff|| / ||SDPA|| {rel:.3g} (tol {tol:g}) "
                  f"{'ok' if rel <= tol else 'FAIL'}")
        rows.append(_row("SDPA enable_gqa, contiguous", gpu_ms(
            lambda: F.scaled_dot_product_attention(q, Kc, Vc, enable_gqa=True), device), nbytes, copy_gbs))
        Kc = Vc = None  # free them (a closure above reads them, so not `del`)
    except Exception as e:
        _section_error(report, "timing/sdpa", e)
    save()

    # Every layer, then the host side: plan alone and whole steps.
    try:
        fns = [f1] + [d.layer_fn(l) for l in range(1, s["layers"])]

        def layers():
            return [fns[l](plan, q, d.k[l], d.v[l]) for l in range(s["layers"])]

        with torch.no_grad():
            layers()  # compiles the other layers' functions
        rows.append(_row(f"flexkv attend, {s['layers']} layers", gpu_ms(layers, device),
                         nbytes * s["layers"], copy_gbs))
        t["plan_ms"] = Timer(stmt="plan(step)", globals={"plan": d.m.plan, "step": step}).blocked_autorange(
            min_run_time=0.5).median * 1e3
        print(f"  host plan (manager.plan): {t['plan_ms']:.3f} ms")

        def whole_step():
            st = d.step()
            d.m.admit(st)
            p = d.m.plan(st)
            outs = [fns[l](p, q, d.k[l], d.v[l]) for l in range(s["layers"])]
            d.advance(st)
            return outs

        with torch.no_grad():
            whole_step()
            t["step_ms"] = Timer(stmt="step()", globals={"step": whole_step}).blocked_autorange(
                min_run_time=1.0).median * 1e3
        t["plan_fraction_of_step"] = t["plan_ms"] / t["step_ms"]
        print(f"  whole step (admit, plan, {s['layers']} layers, commit; synchronised): {t['step_ms']:.3f} ms, "
              f"plan {100 * t['plan_fraction_of_step']:.1f}% of it")
    except Exception as e:
        _section_error(report, "timing/layers+host", e)
    save()

    if cuda:
        variants(d, report, min(deadline, hard_deadline) if hard_deadline is not None else deadline,
                 copy_gbs, save, recorder)


def variant_runs(d: "Decode") -> tuple:
    """The variants, most informative first, and the names of those left out because their kernel
    options equal what `attend` ships at this shape. Each run: (name, kernel options (a function of
    query, key, block mask; None keeps the shipped ones), full blocks planned (None: as shipped),
    drop the full-block tensors, requests (None: all))."""
    m, s = d.m, d.s
    group = s["q_heads"] // s["kv_heads"]
    packed = group > 1 and m.options.pack_gqa
    shipped = flex_kernel_options(
        d.device.type, group if packed else 1, s["kv_heads"], s["kv_heads"] if packed else s["q_heads"],
        s["head_dim"], s["dtype"], m.layout.block_size,
        q_block_size=m.layout.q_block_size, capability=_capability(d.device))
    small = s["small_batch"]
    runs = [
        ("no full-block tensors", None, False, True, None),
        (f"small batch {small}, as shipped", None, None, False, small),
        (f"small batch {small}, no full-block tensors", None, False, True, small),
        ("kernel_options=None (torch defaults)", lambda q_, k_, bm: None, None, False, None),
        ("main kernel (FORCE_USE_FLEX_ATTENTION)", lambda q_, k_, bm: {"FORCE_USE_FLEX_ATTENTION": True},
         None, False, None),
    ]
    keep = [r for r in runs if r[1] is None or r[1](None, None, None) != shipped]
    return keep, [r[0] for r in runs if r not in keep]


def variants(d: Decode, report: dict, deadline: float, copy_gbs, save: Callable[[], None],
             recorder: Optional[CompiledOptions] = None) -> None:
    """The same layer under other settings, in priority order, while the budget lasts."""
    rows = report["timing"]["rows"]
    q, k, v = d.q, d.k[0], d.v[0]
    tol = TOL[d.s["dtype"]]
    expect = None
    try:  # every variant attends at the same positions: one SDPA reference over all rows serves them all
        Kc, Vc = d.contiguous_kv(d.m.plan(d.step()), 0)
        with torch.no_grad():
            expect = F.scaled_dot_product_attention(q, torch.cat([Kc, k], dim=2), torch.cat([Vc, v], dim=2),
                                                    enable_gqa=True)
        del Kc, Vc
        runs, repeats = variant_runs(d)
        for name in repeats:
            report.setdefault("skipped", []).append(f"variant {name}: the shipped kernel options")
            print(f"  (not run: its options are the shipped ones) {name}")
    except Exception as e:
        _section_error(report, "timing/variants setup", e)
        return
    for i, (name, options, full, drop, requests) in enumerate(runs):
        if time.monotonic() > deadline:
            report.setdefault("skipped", []).append(f"variant {name}: out of time budget")
            print(f"  (skipped, out of time budget) {name}")
            continue
        before = d.m.options
        try:
            torch._dynamo.reset()
            if full is not None:
                # A diagnostic sweep over one filled cache: its options are swapped for the run and
                # restored below (a cache's options are otherwise fixed when it is built).
                d.m._options = dataclasses.replace(before, full_blocks=full)
            st = d.step(requests)
            plan = d.m.plan(st)
            if drop and int(plan.full_kv_num_blocks.max()) > 0:
                raise RuntimeError("the plan lists full blocks; dropping them would change the result")
            n = len(st.segments)
            qq, kk, vv = q[:n], k[:n], v[:n]
            with kernel_options_as(options, drop) if options or drop else contextlib.nullcontext():
                f = d.layer_fn(0, tag=f"v{i}")
                with torch.no_grad():
                    out = f(plan, qq, kk, vv)
                ms = gpu_ms(lambda: f(plan, qq, kk, vv), d.device)
            if recorder is not None:
                recorder.report_new(report)
            extra = {}
            if expect is not None:
                rel = relative_error(out, expect[:n])
                extra = dict(rel_err_vs_sdpa=rel, ok=rel <= tol)
                if rel > tol:
                    report.setdefault("variant_failures", []).append(f"{name}: rel err {rel:.3g} > {tol:g}")
                    print(f"  variant {name} disagrees with SDPA: ||diff|| / ||SDPA|| {rel:.3g} (> {tol:g})")
            rows.append(_row(name, ms, d.read_bytes(n), copy_gbs, **extra))
        except Exception as e:
            _section_error(report, f"timing/variant {name}", e)
        finally:
            d.m._options = before
            save()


# ------------------------------------------------------------- plan at scale (CPU)


def plan_at_bench_shape(report: dict) -> None:
    """Host planning at the CUDA benchmark shape, on the meta device (nothing allocated), full blocks on."""
    s = bench_shape(True)
    cfg = BoundedKVConfig(num_layers=1, num_heads=s["kv_heads"], head_dim=s["head_dim"], rows_per_request=1,
                          max_source_len=0, retention=SinkWindow(s["sink"], s["window"]), max_slots=s["requests"],
                          max_step_tokens=1, max_sources=0, dtype=s["dtype"])
    m = BoundedKVManager(cfg, "meta", block_size=s["block"],
                         options=AttentionOptions.for_cache(cfg, "meta", full_blocks=True))
    rids = range(s["requests"])
    m.admit(BoundedKVStep(tuple(Segment(r, 1) for r in rids), {r: StreamPosition(0, 0) for r in rids}))
    m.commit(BoundedKVStep(tuple(Segment(r, 1) for r in rids), {r: StreamPosition(0, 20000 + r) for r in rids}))
    step = BoundedKVStep(tuple(Segment(r, 1) for r in rids), {r: StreamPosition(0, 20001 + r) for r in rids})
    ms = Timer(stmt="plan(step)", globals={"plan": m.plan, "step": step}).blocked_autorange(min_run_time=1.0).median
    report["plan_ms_at_cuda_shape_on_this_cpu"] = ms * 1e3
    print(f"  host plan at the CUDA bench shape (64 requests, window 4096, full blocks; meta device): {ms * 1e3:.2f} ms")


# -------------------------------------------------------------------- output


def _print_correctness_row(r: dict) -> None:
    status = "ok" if r.get("ok") else "FAIL"
    rel = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
    err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "-"
    full = f"  full blocks {r['full_blocks_planned']}" if "full_blocks_planned" in r else ""
    tail = f"  {r['error']}" if "error" in r else ""
    print(f"  {r['name']:<34} {r.get('dtype', ''):<9} {r.get('kernel_options', ''):<20} "
          f"steps {r.get('steps', '-'):>3}  rel err {rel:>9} (tol {r.get('tol', 0):g}, max abs {err})  "
          f"recompiles {r.get('recompiles', '-')}  compile {r.get('compile_s', float('nan')):.1f}s  "
          f"step {r.get('step_ms', float('nan')):.1f}ms{full}  {status}{tail}")


def _print_timing_row(r: dict) -> None:
    gbs = f"{r['gb_s']:8.1f}" if "gb_s" in r else " " * 8
    frac = f"{100 * r['copy_fraction']:6.1f}%" if "copy_fraction" in r else ""
    print(f"  {r['name']:<44} {r['ms']:9.4f} ms  {gbs} GB/s  {frac}")


def _section_error(report: dict, where: str, e: BaseException) -> None:
    msg = f"{where}: {type(e).__name__}: {_first_line(e)}"
    report.setdefault("errors", []).append(msg)
    print(f"  ERROR in {msg}")
    traceback.print_exc(limit=3)


def _device_info(device: torch.device) -> dict:
    info = dict(device=str(device), torch=torch.__version__)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=list(torch.cuda.get_device_capability(device)),
                    sm_count=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception:
            pass
    else:
        info.update(threads=torch.get_num_threads())
    return info


def save_report(path: Optional[str], report: dict) -> None:
    """Write `report` to `path` (if any) through a temporary file, so a cut-off run leaves a whole file."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    os.replace(tmp, path)


def _failures(report: dict) -> list:
    # As shipped is what counts: a failure fixed only by injected kernel options is still a failure.
    shipped = [r for r in report.get("correctness", []) if r.get("kernel_options") != "flex_kernel_options"]
    failed = [r["name"] + " " + str(r.get("dtype", "")) for r in shipped if not r.get("ok")]
    scale = report.get("timing", {}).get("flexkv_vs_sdpa")
    if scale is not None and not scale["ok"]:
        failed.append("flexkv vs SDPA at the bench shape")
    failed += [f"variant {v}" for v in report.get("variant_failures", [])]
    failed += [f"quantized: {r['name']}" for r in report.get("quantized", {}).get("rows", []) if r.get("ok") is False]
    failed += cuda_paged.failures(report)
    if report.get("context_lost"):
        failed.append(f"the CUDA context was lost at {report['context_lost']}: later checks did not run")
    return failed


def main(argv=None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a run cut off by a timeout still shows what it printed
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures to this file (rewritten after every section)")
    ap.add_argument("--cpu", action="store_true", help="run the CPU version even when CUDA is available")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the first timing after which optional variants are skipped "
                         "(default 240 on CUDA, 0 on CPU)")
    ap.add_argument("--skip-timing", action="store_true", help="correctness and recompiles only")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="leave out the correctness workloads whose name contains NAME (repeatable)")
    ap.add_argument("--skip-quantized", action="store_true", help="leave out section 5 (quantized slots)")
    ap.add_argument("--skip-paged", action="store_true", help="leave out section 6 (the vLLM plugin's paged path)")
    ap.add_argument("--paged-only", action="store_true", help="run section 6 alone")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start after which no further check or timing starts "
                         "(default 500 on CUDA, none on the CPU)")
    args = ap.parse_args(argv)

    start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA device found: ran the CPU version" if not args.cpu else "--cpu: ran the CPU version")
    torch.set_float32_matmul_precision("highest")  # fp32 checks compare against float64
    report: dict = dict(info=_device_info(device))
    print(f"device: {report['info']}")
    budget = args.budget if args.budget is not None else (240.0 if cuda else 0.0)
    if args.deadline is None and cuda:
        args.deadline = 500.0

    def save():
        report["failed"] = _failures(report)
        report["wall_s"] = time.monotonic() - start
        save_report(args.json, report)

    deadline = None if args.deadline is None else start + args.deadline
    if args.paged_only:
        cuda_paged.run(device, report, deadline)
        save()
        print(f"done in {report['wall_s']:.0f} s; failures: {report['failed'] or 'none'}")
        return 1 if report["failed"] else 0
    recorder = CompiledOptions()
    with recorder.recording():
        print("correctness against the dense reference (compiled; norm-relative error; recompiles counted after "
              "the first step); first pass, each workload in bf16 (or its only dtype):")
        try:
            correctness(device, report, save, recorder, first=True, deadline=deadline, skip=tuple(args.skip))
        except Exception as e:
            _section_error(report, "correctness", e)
            report.setdefault("correctness", []).append(dict(name="correctness section", ok=False))
        save()
        if not args.skip_paged and not report.get("context_lost") and (deadline is None or time.monotonic() < deadline):
            print("the vLLM plugin's paged path (flexkv.integrations.vllm.paged), torch alone:")
            try:
                cuda_paged.run(device, report, deadline)
            except Exception as e:
                _section_error(report, "paged", e)
            save()
        if not args.skip_timing and report.get("context_lost"):
            report.setdefault("skipped", []).append(f"timing: the CUDA context was lost at {report['context_lost']}")
            print(f"  (timing skipped: the CUDA context was lost at {report['context_lost']})")
        elif not args.skip_timing and deadline is not None and time.monotonic() > deadline:
            report.setdefault("skipped", []).append("timing: past the deadline")
            print("  (timing skipped, past the deadline)")
        elif not args.skip_timing:
            print(f"decode timing ({'CUDA events' if cuda else 'torch.utils.benchmark.Timer'}; "
                  f"GB/s = retained K+V bytes read / time; copy GB/s = bytes read + written / time; "
                  f"variants get {budget:.0f} s from here):")
            try:
                timing(device, report, budget, save, recorder, hard_deadline=deadline)
            except Exception as e:
                _section_error(report, "timing", e)
            save()
            if not cuda:
                try:
                    plan_at_bench_shape(report)
                except Exception as e:
                    _section_error(report, "plan at the CUDA shape", e)
        print("correctness, second pass (the other dtypes):")
        try:
            correctness(device, report, save, recorder, first=False, deadline=deadline, skip=tuple(args.skip))
        except Exception as e:
            _section_error(report, "correctness (second pass)", e)
        save()
        if not args.skip_quantized and not report.get("context_lost") and \
                (deadline is None or time.monotonic() < deadline):
            print("quantized slots: float8 cells against bf16 cells at the decode shape (one compiled layer):")
            try:
                quantized_decode(device, report, save, deadline)
            except Exception as e:
                _section_error(report, "quantized", e)
    save()
    failed = report["failed"]
    print(f"done in {report['wall_s']:.0f} s; correctness failures: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
