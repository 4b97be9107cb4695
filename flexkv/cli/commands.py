"""The `flexkv` command: `flexkv run [CONFIG]` and `flexkv show [CONFIG]`.

`run` drives a streaming workload through the compiled cache and prints a
report (`--json` for JSON, `--plot` for a PNG of memory and step time).
`show` prints which stream entries each query of one step attends and where
each lives. CONFIG is a workload YAML file (see `configs/`); without one,
both use the built-in workload `flexkv.cli.workload.BUILTIN`.

Bad arguments or a bad file give one line on stderr and exit status 2;
set FLEXKV_DEBUG=1 to see a traceback for unexpected errors instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import List, Optional

__all__ = ["main", "format_report", "plot_report"]

EXIT_USAGE = 2
EXIT_FAILED = 1


class UsageError(Exception):
    """A bad argument, file or value: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _nonneg_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _parser() -> _Parser:
    p = _Parser(prog="flexkv", description="A bounded sink + window KV cache for streaming attention.")
    sub = p.add_subparsers(dest="command", metavar="{run,show}", parser_class=_Parser)

    r = sub.add_parser("run", help="run a streaming workload through the compiled cache and report",
                       description="Run a streaming workload end to end through the compiled cache: seeded "
                                   "arrivals and departures, streams far past the window. Prints progress on "
                                   "stderr and a report at the end.")
    r.add_argument("config", nargs="?", help="workload YAML file (default: the built-in workload)")
    r.add_argument("--size", default="small", help="which size of the file to run (default: small)")
    r.add_argument("--steps", type=_pos_int, help="model steps to run (default: the file's)")
    r.add_argument("--seed", type=_nonneg_int, help="seed for traffic, weights and inputs (default: the file's)")
    r.add_argument("--compile", choices=("layer", "graph"), help="one compiled function per layer, or the whole "
                   "step as one graph (default: the file's)")
    r.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    r.add_argument("--threads", type=_pos_int, help="torch intra-op threads (default: torch's)")
    r.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE ('-' for stdout)")
    r.add_argument("--plot", metavar="FILE.png", help="draw memory and step time over the run (needs matplotlib)")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.add_argument("--model", metavar="ID_OR_PATH", help="stream the workload through this trained language model "
                   "(hub id, transformers folder or GGUF file; needs the transformers extra, and the real extra "
                   "for GGUF) and report its perplexity too")

    s = sub.add_parser("show", help="print what each query of one step attends and where it lives",
                       description="Print, for one request at one position, which stream entries each query of "
                                   "the step attends and where each lives: source, sink region, ring cell, or "
                                   "the step's own token.")
    s.add_argument("config", nargs="?", help="workload YAML file (default: the built-in workload)")
    s.add_argument("--size", default="small", help="which size of the file to use (default: small)")
    s.add_argument("--source-len", type=_nonneg_int, help="source entries the stream starts with "
                   "(default: the workload's)")
    s.add_argument("--written", type=_nonneg_int, help="tokens the request has written before the step "
                   "(default: enough to wrap the ring once)")
    s.add_argument("--span", type=_nonneg_int, help="tokens the step writes (default: the workload's)")
    s.add_argument("--T", dest="tokens", type=_pos_int, help="tokens the step carries (default: the workload's)")
    s.add_argument("--slot", type=_nonneg_int, default=0, help="slot the request holds (default: 0)")
    s.add_argument("--source", type=_nonneg_int, default=0, help="source index the stream starts with (default: 0)")
    s.add_argument("--block-size", type=_pos_int, help="FlexAttention KV block size (default: the workload's)")
    s.add_argument("--png", metavar="FILE.png", help="also draw the picture into a PNG (needs matplotlib)")
    return p


def _workload(args):
    from .workload import BUILTIN, load_workload

    if args.config is None:
        if args.size not in ("small",):
            raise UsageError(f"the built-in workload has one size, 'small'; got --size {args.size}")
        return BUILTIN, "built-in"
    if not os.path.exists(args.config):
        raise UsageError(f"no such config file: {args.config} (the shipped workloads are in configs/)")
    return load_workload(args.config, args.size), args.size


# ----------------------------------------------------------------- report


def _unbounded_line(m: dict, held: str) -> str:
    """The report's second memory line: what an unbounded cache would hold by the end, against the
    `held` ("slots" or "streams") in use."""
    ratio = m["unbounded_bytes_end"] / m["slots_in_use_bytes_end"] if m["slots_in_use_bytes_end"] else float("nan")
    return (f"             unbounded cache by the end: {_bytes(m['unbounded_bytes_end'])} "
            f"(peak {_bytes(m['unbounded_bytes_peak'])}) vs {_bytes(m['slots_in_use_bytes_end'])} "
            f"in the {held} in use ({ratio:.1f}x)")


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _dur(s: float) -> str:
    if s >= 60:
        return f"{int(s // 60)}m {s % 60:.0f}s"
    return f"{s:.1f} s"


def _finite(x):
    """The report with NaN/inf (e.g. a percentile of no steps) as null, so the JSON is standard."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def format_report(rep: dict, title: str) -> str:
    """The text report `flexkv run` prints (see docs/cli.md for what each line means)."""
    m = rep["memory"]
    st, pl = rep["step_ms"], rep["plan_ms"]
    ref = rep["reference"]
    req = rep["requests"]
    lines = [title, f"  {rep['summary']}"]
    calls = f" ({rep['calls']} compiled calls)" if rep["calls"] != rep["steps"] else ""
    lines.append(f"steps        {rep['steps']} model steps{calls}, {rep['tokens']} tokens written, "
                 f"{rep['tokens_per_s']:.0f} tokens/s")
    lines.append(f"step time    p50 {st['p50']:.2f} ms, p95 {st['p95']:.2f} ms, mean {st['mean']:.2f} ms "
                 f"({rep['threads']} threads, {rep['device']})")
    lines.append(f"compile      {rep['compile_s']:.1f} s for {rep['graphs_compiled']} graph(s) "
                 f"({rep['compile_mode']} mode); recompiles after warm-up: {rep['recompiles_after_warmup']}")
    lines.append(f"planning     {pl['p50']:.3f} ms per step on the host (p50), "
                 f"{100 * pl['fraction_of_step']:.1f}% of the step")
    lines.append(f"memory       slots {m['max_slots']} x {_bytes(m['slot_bytes'])} = {_bytes(m['slots_bytes'])}, "
                 f"{'flat' if m['flat'] else 'NOT flat'} over the run; cache total {_bytes(m['memory_bytes'])} "
                 f"(+ sources {_bytes(m['sources_bytes'])}, scratch and block padding {_bytes(m['other_bytes'])})")
    lines.append(_unbounded_line(m, "slots"))
    proc = rep.get("process") or {}
    if proc.get("rss_start_bytes") is not None and proc.get("rss_end_bytes") is not None:
        per = proc["rss_growth_per_1000_requests_bytes"]
        lines.append(f"process      resident {_bytes(proc['rss_start_bytes'])} after warm-up, "
                     f"{_bytes(proc['rss_end_bytes'])} at the end"
                     + (f" ({_bytes(per)} per 1,000 finished requests)" if per is not None else ""))
    wrapped = req["longest_stream"] > req["sink"] + req["window"]
    lines.append(f"requests     {req['arrived']} arrived, {req['finished']} finished; longest stream "
                 f"{req['longest_stream']} entries (sink {req['sink']} + window {req['window']}"
                 f"{': rings wrapped' if wrapped else ': rings did not wrap'})")
    if ref["checks"]:
        where = ", ".join(f"#{c['request']}@{c['stream_len']}" for c in ref["checks"])
        ok = "ok" if ref["max_abs_error"] < 1e-4 else "TOO LARGE"
        lines.append(f"reference    max |error| {ref['max_abs_error']:.2e} vs float64 over {len(ref['checks'])} "
                     f"checked steps (request@stream length: {where}): {ok}")
    else:
        lines.append("reference    no step checked (no tracked request reached a check point)")
    lines.append(f"wall time    {_dur(rep['wall_s'])}")
    return "\n".join(lines)


def plot_report(rep: dict, path: str, title: str) -> None:
    """Memory (bounded vs unbounded) and step time over the run, as a PNG. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'flexkv[plot]'") from None
    series = rep["series"]
    steps = [p["step"] for p in series]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(steps, [p["unbounded_bytes"] / 1e6 for p in series], label="unbounded cache (keeps every entry)")
    a.plot(steps, [p["bounded_bytes"] / 1e6 for p in series], label="flexkv: whole cache (allocated once)")
    a.plot(steps, [p["slots_in_use_bytes"] / 1e6 for p in series], label="flexkv: slots in use", linestyle="--")
    a.set_ylabel("MB")
    a.legend(fontsize=8)
    a.set_title(title)
    b.plot(steps, [p["step_ms"] for p in series], linewidth=0.6)
    b.set_ylabel("step time (ms)")
    b.set_xlabel("model step")
    top = sorted(p["step_ms"] for p in series)
    if top:
        b.set_ylim(0, top[min(len(top) - 1, int(0.99 * len(top)))] * 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- commands


def _cmd_run(args) -> int:
    import torch

    from .runner import fixed_mmap_threshold, run_workload

    w, size = _workload(args)
    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed), ("compile", args.compile))
               if v is not None}
    if changes:
        w = w.replace(**changes)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a torch device (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available in this torch build/machine")
    # This process is flexkv's own: keep glibc from growing its heaps with every step's fresh tensors
    # (docs/cli.md, "process"), so a long run's resident memory stays where the warm-up left it.
    fixed_mmap_threshold()
    if args.model is not None:
        return _cmd_run_model(args, w, size, device)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'flexkv[plot]'") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    title = f"flexkv run: {w.name} ({size})"
    to_stdout_json = args.json == "-"
    tty = sys.stderr.isatty()

    def progress(p):
        if args.quiet:
            return
        line = (f"[{p['step']}/{p['steps']}] active {p['active']:>3}  step p50 {p['p50_ms']:.2f} ms  "
                f"plan {p['plan_ms']:.3f} ms  memory {_bytes(p['bounded_bytes'])} "
                f"(unbounded {_bytes(p['unbounded_bytes'])})  {_dur(p['elapsed_s'])}")
        if tty:
            sys.stderr.write("\r" + line + "\033[K" + ("\n" if p["step"] == p["steps"] else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    if not args.quiet:
        sys.stderr.write(f"{title}: {w.summary()}\ncompiling and warming up ({w.compile} mode)...\n")
        sys.stderr.flush()
    rep = run_workload(w, device=device, progress=progress)
    rep["size"] = size
    if args.json:
        text = json.dumps(_finite(rep), indent=1)
        if to_stdout_json:
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if not to_stdout_json:
        print(format_report(rep, title))
    if args.plot:
        plot_report(rep, args.plot, title)
        if not to_stdout_json:
            print(f"plot         {args.plot}")
    return 0


def format_model_report(rep: dict, title: str) -> str:
    """The text report of `flexkv run --model` (docs/cli.md): the built-in run's lines plus perplexity."""
    m, st, req, ppl, ref = rep["memory"], rep["step_ms"], rep["requests"], rep["perplexity"], rep["reference"]
    lines = [title, f"  {rep['model']}: {rep['layers']} layers, {rep['kv_heads']}x{rep['head_dim']} KV heads; "
                    f"sink {req['sink']}, window {req['window']}"
                    + (f", {req['slot_dtype']} slots" if req["slot_dtype"] != "none" else "")]
    lines.append(f"steps        {rep['steps']} model steps ({rep['calls']} forwards), {rep['tokens']} tokens written, "
                 f"{rep['tokens_per_s']:.0f} tokens/s")
    lines.append(f"step time    p50 {st['p50']:.2f} ms, p95 {st['p95']:.2f} ms, mean {st['mean']:.2f} ms "
                 f"({rep['threads']} threads, {rep['device']}, eager)")
    lines.append(f"memory       {m['max_slots']} streams x {_bytes(m['stream_bytes'])}, cache total "
                 f"{_bytes(m['memory_bytes'])}, {'flat' if m['flat'] else 'NOT flat'} over the run")
    lines.append(_unbounded_line(m, "streams"))
    wrapped = req["longest_stream"] > req["sink"] + req["window"]
    lines.append(f"requests     {req['arrived']} arrived, {req['finished']} finished; longest stream "
                 f"{req['longest_stream']} tokens (sink {req['sink']} + window {req['window']}"
                 f"{': evicting' if wrapped else ': nothing evicted'})")
    past = (f"{ppl['past_first_eviction']:.3f} over the {ppl['tokens_past_first_eviction']} past each stream's first "
            f"eviction" if ppl["tokens_past_first_eviction"] else "no token came past an eviction")
    lines.append(f"perplexity   {ppl['all']:.3f} over {ppl['tokens']} predicted tokens; {past}")
    if ref["steps"]:
        ok = "ok" if ref["max_abs_error"] < 1e-3 else "TOO LARGE"
        lines.append(f"reference    max |logit difference| {ref['max_abs_error']:.2e} vs the model's own cache over "
                     f"request #{ref['request']}'s first {ref['steps']} steps (its whole stream in the window): {ok}")
    else:
        lines.append("reference    no step checked (no request ran)")
    lines.append(f"wall time    {_dur(rep['wall_s'])}")
    return "\n".join(lines)


def _cmd_run_model(args, w, size, device) -> int:
    from .real_model import check_streamable, run_model

    if args.compile is not None:
        raise UsageError(f"--compile {args.compile} with --model: a trained model runs eagerly here; drop --compile")
    if args.plot:
        raise UsageError("--plot with --model: the plot draws the built-in run's series; drop --plot "
                         "(python -m benchmarks.streaming_perplexity --plot draws a model's perplexity)")
    check_streamable(w)  # before the model loads
    try:
        from ..integrations.transformers.pretrained import load_pretrained
    except ImportError as error:
        raise UsageError(f"--model needs transformers ({error}): pip install 'flexkv[transformers]'") from None
    title = f"flexkv run --model {args.model}: {w.name} ({size})"
    if not args.quiet:
        sys.stderr.write(f"{title}: loading the model...\n")
    model, tokenizer = load_pretrained(args.model)
    tty = sys.stderr.isatty()

    def progress(p):
        if args.quiet:
            return
        line = (f"[{p['step']}/{p['steps']}] active {p['active']:>3}  step p50 {p['p50_ms']:.2f} ms  "
                f"memory {_bytes(p['bounded_bytes'])} (unbounded {_bytes(p['unbounded_bytes'])})  "
                f"{_dur(p['elapsed_s'])}")
        sys.stderr.write(("\r" + line + "\033[K" + ("\n" if p["step"] == p["steps"] else "")) if tty else line + "\n")
        sys.stderr.flush()

    rep = run_model(w, model, tokenizer, device=device, progress=progress)
    rep["size"] = size
    if args.json:
        text = json.dumps(_finite(rep), indent=1)
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(format_model_report(rep, title))
    return 0


def _cmd_show(args) -> int:
    from .show import describe_step, render_png, render_text

    w, size = _workload(args)
    cfg = w.config()
    source_len = w.source_len if args.source_len is None else args.source_len
    span = w.span if args.span is None else args.span
    tokens = args.tokens if args.tokens is not None else max(w.step_tokens, span, 1)
    written = args.written
    if written is None:  # far enough that the ring has wrapped
        written = cfg.sink_capacity + cfg.window_capacity + cfg.max_step_tokens + max(span, 1)
    pic = describe_step(cfg, source_len, written, span, tokens, slot=args.slot, source=args.source,
                        block_size=args.block_size or w.block_size)
    title = f"flexkv show: {w.name} ({size})"
    print(render_text(pic, title))
    if args.png:
        try:
            render_png(pic, args.png, title)
        except ImportError as e:
            raise UsageError(f"--png: {e}") from None
        print(f"picture: {args.png}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the `flexkv` console script; returns the exit status."""
    from .workload import WorkloadError

    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("flexkv: missing command: use 'flexkv run [CONFIG]' or 'flexkv show [CONFIG]' "
                             "(see flexkv --help)")
        return _cmd_run(args) if args.command == "run" else _cmd_show(args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except (WorkloadError, ValueError) as e:
        if os.environ.get("FLEXKV_DEBUG"):
            raise
        print(f"flexkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flexkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except Exception as e:  # one line, never a traceback, unless asked for
        if os.environ.get("FLEXKV_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"flexkv: failed: {type(e).__name__}: {msg} (set FLEXKV_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
