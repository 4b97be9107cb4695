"""Recurrent layers (linear attention, Mamba, short convolutions) inside a FlexKVCache.

Their state is per stream like the attention layers' keys and values: it
follows `select()` across calls, starts exactly under left padding, is
committed only when a forward returns, and is read by a compiled decode
step without recompiling. Every output is checked against the model run
without a cache over each stream's whole history (`hf_models.reference_greedy`).
"""

from __future__ import annotations

import sys

import pytest
import torch

import hf_models
from hf_models import (
    CHUNK,
    LENGTHS,
    SINK,
    WINDOW,
    FailOnce,
    eager_and_compiled_greedy,
    left_pad,
    logit_tolerance,
    make_model,
    prompts,
    reference_greedy,
)
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split
from transformers import DynamicCache

from flexkv import SinkWindow
from flexkv.integrations.transformers import FlexKVCache

KW = dict(max_streams=4, prefill_chunk=CHUNK, block_size=16, rope_positions="stream")  # references: stream positions


RECURRENT = ("qwen3_next", "granitemoehybrid", "bamba", "jamba", "falcon_h1", "lfm2", "minimax", "kimi_linear")


def states(cache) -> dict:
    """A copy of every recurrent state buffer of the cache."""
    return {key: buf.clone() for key, buf in cache._recurrent.buffers.items()}


def same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", RECURRENT)
def test_each_stream_keeps_the_models_own_recurrent_state(family):
    """What a slot keeps in a recurrent layer is what the model's own cache keeps for one stream: the
    same states, shapes and dtypes, in buffers of max_streams rows that memory_report() counts."""
    model = make_model(family)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    own_class = getattr(sys.modules[type(model).__module__], "MiniMaxCache", None)
    one = own_class() if own_class is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompts((5,))[0][None], cache=one, use_cache=True)
    rows = [r for r in cache.memory_report() if r["kind"] == "recurrent"]
    assert rows and sorted(i for r in rows for i in r["layers"]) == sorted(cache._recurrent.layers)
    for row in rows:
        for layer in row["layers"]:
            if own_class is not None:  # MiniMax keeps one matrix per lightning layer
                t = one.linear_cache[layer]
                want = {("recurrent", 0): (tuple(t.shape[1:]), t.dtype)}
            else:
                entry = one.layers[layer]
                want = {(kind, i): (tuple(t.shape[1:]), t.dtype)
                        for kind, store in (("conv", entry.conv_states), ("recurrent", entry.recurrent_states))
                        for i, t in store.items() if t is not None}
            assert {(kind, i): (shape, dtype) for kind, i, shape, dtype in row["states"]} == want, f"layer {layer}"
        one_stream = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                         for _, _, shape, dtype in row["states"]) * len(row["layers"])
        assert row["slot_bytes"] == one_stream and row["memory_bytes"] == one_stream * KW["max_streams"]
    if own_class is not None:
        assert isinstance(cache, own_class)  # MiniMax's forward takes no other cache class


# The last layer of each model attends; the first keeps a recurrent state (Falcon-H1: both, in every layer).
@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1", "minimax"])
def test_recurrent_streams_continue_across_calls(family):
    """Three streams, then two of them continued and a new one started (left-padded) in one call,
    then all three continued the usual transformers way: every stream matches its whole history."""
    model = make_model(family, seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    tol = logit_tolerance(family, model.dtype)
    n = 8
    history = {}
    first = dict(zip("abc", prompts((4, 11, 7), seed=5)))
    ids, mask = left_pad(list(first.values()))
    out = model.generate(ids, attention_mask=mask, cache=cache.select(list(first)), max_new_tokens=n,
                         do_sample=False)
    for i, sid in enumerate(first):
        history[sid] = torch.cat([first[sid], out[i, ids.shape[1]:]])
    # Call 2: continue c and a with 3 new tokens each (the cache feeds the last token call 1 returned
    # first) and start d with 2 (left-padded: new streams may be padded before their first token).
    msgs = dict(zip("cad", prompts((3, 3, 2), seed=6)))
    new = msgs
    ids, mask = left_pad(list(new.values()))
    cache.select(list(new))
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1)
    for i, sid in enumerate(new):
        before = history[sid] if sid in history else torch.zeros(0, dtype=torch.long)
        want, want_logits = reference_greedy(model, torch.cat([before, msgs[sid]]), n)
        assert out.sequences[i, ids.shape[1]:].tolist() == want.tolist(), f"{family} stream {sid}"
        torch.testing.assert_close(logits[i].double(), want_logits.double(), rtol=0, atol=tol)
        history[sid] = torch.cat([before, msgs[sid], want])
    assert cache.stream_length("b") == len(first["b"]) + n - 1  # untouched by call 2
    # Call 3, the usual transformers way: hand generate() its own output plus new tokens.
    more = prompts((2, 2, 2), seed=7)
    ids3 = torch.cat([out.sequences, torch.stack(more)], dim=1)
    mask3 = torch.cat([mask, torch.ones(3, n + 2, dtype=torch.long)], dim=1)
    out3 = model.generate(ids3, attention_mask=mask3, cache=cache, max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(new):
        want, _ = reference_greedy(model, torch.cat([history[sid], more[i]]), n)
        assert out3[i, ids3.shape[1]:].tolist() == want.tolist(), f"{family} stream {sid}, call 3"


def test_padding_where_a_recurrence_would_see_it_is_refused_before_anything_changes():
    """A recurrent layer updates its state on every column, padding included: padding is exact only
    before the first token of a new stream. A continuing stream with padding, or a new stream padded
    after its tokens, is refused, and the cache is left as it was."""
    model = make_model("bamba", seed=4)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    ids, mask = left_pad(prompts((3, 6), seed=8))
    model.generate(ids, attention_mask=mask, cache=cache.select(["a", "b"]), max_new_tokens=4, do_sample=False)
    before = (states(cache), cache.streams, [cache.stream_length(s) for s in "ab"])
    cache.select(["a", "b"])
    ids, mask = left_pad(prompts((2, 5), seed=9))  # "a" continues behind 3 padding columns
    with pytest.raises(ValueError, match=r"stream 'a': this forward has 3 padding column\(s\) for it and its "
                                         r"padding continues a stream that holds 6 tokens; the recurrent layers \[0\]"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
    assert same_states(states(cache), before[0]) and cache.streams == before[1]
    assert [cache.stream_length(s) for s in "ab"] == before[2] and cache.get_seq_length() == 0
    cache.select(["c", "d"])
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"stream 'c': .* comes after its tokens"), torch.no_grad():
        model(input_ids=ids[:, :3], attention_mask=right, cache=cache)
    assert cache.streams == ("a", "b") and same_states(states(cache), before[0])


def test_a_failed_or_interrupted_forward_leaves_recurrent_state_as_it_was():
    """A forward that fails in the attention layer, after the recurrent layer staged its new state,
    commits nothing: the states, lengths and the retried decode equal an undisturbed run's."""
    model = make_model("qwen3_next", seed=5)
    ids, mask = left_pad(prompts((5, 9), seed=10))
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    want = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW), **gen)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    attn = model.model.layers[1].self_attn
    for error in (RuntimeError("injected failure"), KeyboardInterrupt()):
        # During the prefill: the streams are new, and are dropped again.
        handle = attn.register_forward_hook(FailOnce(1, error))
        try:
            with pytest.raises(type(error)):
                model.generate(ids, cache=cache, **gen)
        finally:
            handle.remove()
        assert cache.streams == () and cache.get_seq_length() == 0
    got = model.generate(ids, cache=cache, **gen)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    # During a decode step of streams that hold state: only that step is undone.
    committed = states(cache)
    lengths = [cache.stream_length(s) for s in (0, 1)]
    tok = got.sequences[:, -1:]
    handle = attn.register_forward_hook(FailOnce(1))
    try:
        with pytest.raises(RuntimeError, match="injected failure"), torch.no_grad():
            model(input_ids=tok, cache=cache)
    finally:
        handle.remove()
    assert same_states(states(cache), committed)
    assert [cache.stream_length(s) for s in (0, 1)] == lengths
    with torch.no_grad():
        model(input_ids=tok, cache=cache)  # the retried step advances the states
    assert not same_states(states(cache), committed)


def test_compiled_decode_of_a_recurrent_model_does_not_recompile():
    """Bamba (a Mamba-2 layer and an attention layer), float32: the compiled decode step reads and
    updates the streams' conv and SSM states in place of the gathered rows, one graph for every token."""
    torch._dynamo.reset()
    model = make_model("bamba", dtype=torch.float32, seed=4)
    eager = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    compiled = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    ids, mask = left_pad(prompts((3, 6, 6), seed=8))
    steps = 2 * WINDOW
    want, got, graphs = eager_and_compiled_greedy(model, ids, mask, eager, compiled, steps)
    print(f"\ngraphs compiled after each decode step: {graphs}")
    assert graphs == [1] * steps
    for a, b in zip(want, got):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    for key, buf in eager._recurrent.buffers.items():
        torch.testing.assert_close(compiled._recurrent.buffers[key], buf, rtol=0, atol=1e-4)


def test_jamba_streams_continue_one_token_per_forward():
    """Jamba's Mamba scan starts a multi-token forward from an empty state whatever the cache holds
    (its own cache too), so flexkv refuses to continue a stream with several tokens at once; prompts
    of any length and one-token steps are exact."""
    model = make_model("jamba", seed=6)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    prompt = prompts((7,), seed=11)[0]
    out = model.generate(prompt[None], cache=cache, max_new_tokens=4, do_sample=False)
    held = states(cache)
    with pytest.raises(ValueError, match=r"streams \[0\] continue with 3 tokens in one forward, but Jamba's Mamba "
                                         r"layers start a multi-token forward from an empty state"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache)
    assert same_states(states(cache), held) and cache.stream_length(0) == 7 + 3
    held_tokens = out[0, :-1]  # the last generated token is returned, not fed
    with torch.no_grad():
        for tok in (5, 6, 7):
            last = model(input_ids=torch.tensor([[tok]]), cache=cache).logits[0, -1]
    _, want = reference_greedy(model, torch.cat([held_tokens, torch.tensor([5, 6, 7])]), 1)
    torch.testing.assert_close(last.double(), want[0].double(), rtol=0, atol=logit_tolerance("jamba", model.dtype))


def test_a_model_without_attention_layers_is_refused_with_that_reason():
    cfg, cls, _ = hf_models._configs()["granitemoehybrid"]
    cfg.layer_types = ["linear_attention", "linear_attention"]  # a pure Mamba-2 stack, as Granite 4 allows
    model = cls(cfg).eval()
    with pytest.raises(ValueError, match=r"has no attention layer .* its own cache already keeps a fixed-size "
                                         r"state per stream"):
        FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    assert getattr(model, "_flexkv_state", None) is None


def test_minimax_left_padding_stays_out_of_the_lightning_state_with_flexkv_only():
    """MiniMax's own cache lets left padding into its lightning-attention state (a padded row's greedy
    tokens differ from the same prompt run alone); through flexkv each row equals its prompt run alone."""
    model = make_model("minimax")
    ps = prompts(LENGTHS)
    ids, mask = left_pad(ps)
    W, n = ids.shape[1], 16
    own_class = getattr(sys.modules[type(model).__module__], "MiniMaxCache")
    own = model.generate(ids, attention_mask=mask, cache=own_class(), max_new_tokens=n, do_sample=False)[:, W:]
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    flex = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False)[:, W:]
    own_differs = []
    for b, p in enumerate(ps):
        alone = model.generate(p[None], cache=own_class(), max_new_tokens=n, do_sample=False)[0, len(p):]
        own_differs.append(not torch.equal(own[b], alone))
        one = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
        assert torch.equal(flex[b], model.generate(p[None], cache=one, max_new_tokens=n, do_sample=False)[0, len(p):])
    assert own_differs == [len(p) < W for p in ps]  # exactly the padded rows
