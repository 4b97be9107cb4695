"""The pass-key benchmark's logic (benchmarks/retrieval.py) on a tiny random model: no trained model needed.

What counts as found, which cache each `--caches` name builds, and the
benchmark's one stream per trial (every question and answer taken back
before the filler goes on) answering each distance as a fresh stream would,
for every cache, inside the window and past it.
tests/test_real_model_benchmarks.py runs the benchmark itself on SmolLM2.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import make_model, prompts
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split
from transformers import DynamicCache

from benchmarks.retrieval import CACHES, KVPRESS, Trial, _feed, ask, found, make_cache
from flexkv import Recall, SinkWindow


def test_retrieval_counts_the_key_only_as_a_whole_number():
    assert found("73914", " 73914.\n")
    assert found("73914", "The pass key is 73914, as I said")
    assert not found("73914", " 739140")  # part of a longer number
    assert not found("73914", " 7391")  # cut short by the answer's length
    assert not found("73914", " 7 3 9 1 4")
    assert not found("73914", " a mathematical formula that is used to determine")


@pytest.fixture
def tiny():
    return make_model("llama", torch.float32)


#: the caches flexkv and transformers build (kvpress's need kvpress, installed beside them by hand)
OWN = [name for name in CACHES if name not in KVPRESS]


def test_retrieval_builds_the_cache_each_name_says(tiny):
    built = {name: make_cache(tiny, name, 2, 8, 8) for name in OWN}
    assert type(built["dynamic"]) is DynamicCache
    for name in ("cache", "stream", "window", "int8"):
        cache = built[name]
        assert cache.retention == (SinkWindow(0, 8) if name == "window" else SinkWindow(2, 8)), name
        assert cache.manager.config.slot_dtype == (torch.int8 if name == "int8" else None), name
    # FlexKVCache's default, quantized slots included
    assert built["cache"].rope_positions == built["window"].rope_positions == built["int8"].rope_positions == "cache"
    assert built["stream"].rope_positions == "stream"
    assert built["recall-2k"].retention == Recall(2, 8, 2048, 64, 4)
    assert built["recall-16k"].retention == Recall(2, 8, 16384, 64, 4)
    with pytest.raises(ValueError, match="no cache 'int4'"):
        make_cache(tiny, "int4", 2, 8, 8)


class _Digits:
    """A tokenizer stand-in: token t decodes as ' t'."""

    @staticmethod
    def decode(tokens):
        return "".join(f" {t}" for t in tokens)


def test_retrieval_asks_every_distance_on_one_stream_as_a_fresh_stream_would(tiny):
    """`ask` answers each N on one stream, taking every question and answer back before the next N; each answer
    must be the one a fresh stream of the key, N filler tokens and the question gets, inside the window and past it,
    for every cache."""
    head, filler, question = (p.tolist() for p in prompts((7, 30, 3)))
    trial = Trial("1000", head, filler, question)  # a key the tiny model's 97 tokens never decode to
    distances = (2, 5, 13, 30)  # key sentence end to question: inside SinkWindow(2, 8) up to 5, then past it
    for name in OWN:
        answers = ask(tiny, _Digits, make_cache(tiny, name, 2, 8, 8), trial, distances, answer=4, chunk=8)
        assert list(answers) == list(distances)
        for i, n in enumerate(distances):
            # Fed in the forwards `ask` made, without the questions taken back: a Recall cache's chunk
            # chooses its memory blocks together, so its answer may depend on where the forwards split.
            cache = make_cache(tiny, name, 2, 8, 8)
            _feed(tiny, cache, head, 8)
            for a, b in zip((0,) + distances[:i], distances[:i + 1]):
                _feed(tiny, cache, filler[a:b], 8)
            logits, tokens = _feed(tiny, cache, question, 8), []
            with torch.no_grad():
                for _ in range(4):
                    tokens.append(int(logits.argmax()))
                    logits = tiny(torch.tensor([tokens[-1:]]), cache=cache, use_cache=True).logits[0, -1]
            assert answers[n] == _Digits.decode(tokens), (name, n)
