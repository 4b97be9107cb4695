"""FlexKVCache's lifecycle inside transformers: streams across calls, failed and interrupted forwards,
refused decoding modes, positions, and the compiled decode step.

Every test checks against an uncached reference (`hf_models.reference_greedy`)
or a fresh cache running the same calls without the disturbance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_models import (
    CHUNK,
    SINK,
    WINDOW,
    FailOnce,
    eager_and_compiled_greedy,
    layer_masks,
    left_pad,
    make_model,
    prompts,
    reference_greedy,
    streaming_llm_attention,
)
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split

from flexkv import SinkWindow
from flexkv.integrations.transformers import FlexKVCache

KW = dict(max_streams=4, prefill_chunk=CHUNK, block_size=16, rope_positions="stream")  # references: stream positions
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def test_cache_positions_serve_a_chunked_prompt_past_the_window_by_streaminglls_definition(monkeypatch):
    """`rope_positions="cache"`: a prompt three windows long goes in as whole chunks of `prefill_chunk`
    (each query past the window reads the sinks at its own in-cache offset), and every logit of the prompt
    and of the tokens decoded after it is StreamingLLM's attention written out over the whole history."""
    from transformers import AttentionInterface

    from flexkv.integrations.transformers.cache_positions import CachePositions

    model = make_model("llama", seed=4)
    (ids,) = prompts((3 * (SINK + WINDOW),), seed=5)
    ids = ids[None]
    per_query = []
    original = CachePositions.attend_per_query

    def counted(self, *args, **kwargs):
        per_query.append(args[3].shape[2])  # (context, model layer, KV layer, q, ...)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CachePositions, "attend_per_query", counted)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **{**KW, "rope_positions": "cache"})
    history, got = ids, []
    with torch.no_grad():
        got.append(model(ids, cache=cache).logits[0])
        for _ in range(WINDOW):
            nxt = got[-1][-1].argmax().view(1, 1)
            history = torch.cat([history, nxt], dim=1)
            got.append(model(nxt, cache=cache).logits[0])
    assert per_query and max(per_query) == CHUNK  # whole chunks past the window, not one token at a time

    impl = model.config._attn_implementation
    AttentionInterface.register("streaming_llm_reference", streaming_llm_attention(model.model.rotary_emb.inv_freq,
                                                                                   rotate_all=False))
    model.set_attn_implementation("streaming_llm_reference")
    try:
        with torch.no_grad():
            L = history.shape[1]
            want = model(history, attention_mask=layer_masks(model, L), position_ids=torch.arange(L)[None],
                         use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(impl)
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=1e-4)


def test_cache_positions_batch_a_new_stream_beside_one_past_its_window_as_each_alone():
    """In-cache positions, batched: a stream's first chunk (its queries read only sinks once those are scored
    apart) beside a stream whose chunk evicts per query, in a slot a finished stream left, gives each row what
    that stream gives alone."""
    model = make_model("llama", seed=6)
    g = torch.Generator().manual_seed(7)
    chunks = {sid: [torch.randint(0, 90, (1, CHUNK), generator=g) for _ in range(6)] for sid in ("a", "b", "c")}
    kw = dict(rope_positions="cache", max_streams=2, prefill_chunk=CHUNK, block_size=16)
    batched = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
    got = {"b": [], "c": []}
    with torch.no_grad():
        for i in range(3):  # "a" then "b" run past the window together
            batched.select(["a", "b"])
            out = model(torch.cat([chunks["a"][i], chunks["b"][i]]), cache=batched).logits
            got["b"].append(out[1])
        batched.finish("a")
        for i in range(3):  # "c" starts in a's slot beside "b", which evicts per query
            out = model(torch.cat([chunks["c"][i], chunks["b"][3 + i]]), cache=batched.select(["c", "b"])).logits
            got["c"].append(out[0])
            got["b"].append(out[1])
        for sid, n in (("b", 6), ("c", 3)):
            alone = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
            want = [model(chunks[sid][i], cache=alone).logits[0] for i in range(n)]
            torch.testing.assert_close(torch.stack(got[sid]), torch.stack(want), rtol=0, atol=1e-10)


def test_the_default_positions_are_in_cache_ones_wherever_they_are_served():
    """`rope_positions=None`: StreamingLLM's in-cache positions for a rotary model, quantized slots included;
    stream positions, with the reason kept, for latent attention's partial rotary; asking for what is not
    served is refused with that reason, and the refused build leaves nothing behind."""
    llama = make_model("llama")
    assert FlexKVCache(llama, SinkWindow(SINK, WINDOW)).rope_positions == "cache"
    assert FlexKVCache(llama, SinkWindow(SINK, WINDOW), rope_positions="stream").rope_positions == "stream"
    int8 = FlexKVCache(llama, SinkWindow(SINK, WINDOW), slot_dtype=torch.int8)
    assert int8.rope_positions == "cache" and int8.stream_positions_reason is None
    # The sinks' unquantized copies are what in-cache positions add.
    assert int8.memory_bytes > FlexKVCache(llama, SinkWindow(SINK, WINDOW), slot_dtype=torch.int8,
                                           rope_positions="stream").memory_bytes
    mla = make_model("deepseek_v3")
    cache = FlexKVCache(mla, SinkWindow(SINK, WINDOW))
    assert cache.rope_positions == "stream" and "rotary over the whole head" in cache.stream_positions_reason
    with pytest.raises(ValueError, match="rotary over the whole head"):
        FlexKVCache(mla, SinkWindow(SINK, WINDOW), rope_positions="cache")


def test_stream_positions_past_the_trained_context_warn_once_with_the_fix():
    model = make_model("llama")  # max_position_embeddings=1024
    model.config.max_position_embeddings = 3 * WINDOW
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), rope_positions="stream", max_streams=1, prefill_chunk=CHUNK)
    ids = torch.randint(1, 90, (1, 3 * WINDOW))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, cache=cache)  # reaches the trained context, not past it
    with pytest.warns(RuntimeWarning, match=r"reaches position 25, past the model's trained context.*rope_positions='cache'"):
        model(ids[:, :1], cache=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids[:, :1], cache=cache)  # once per cache
    in_cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, prefill_chunk=CHUNK)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.cat([ids, ids], dim=1), cache=in_cache)  # in-cache positions never pass it


def test_cache_positions_leave_layers_without_rotary_alone():
    """SmolLM3 with `no_rope_layers=[1, 0]`: layer 1 has no rotary, so in-cache positions change nothing there."""
    from transformers import AttentionInterface

    model = make_model("smollm3", seed=12)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    ps = prompts((5, 22), seed=13)
    ids, mask = left_pad(ps)
    n = 3 * WINDOW
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), rope_positions="cache", max_streams=2, prefill_chunk=CHUNK,
                        block_size=16)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1)
    inv_freq = model.model.rotary_emb.inv_freq
    refs = {}
    for rotate_all in (False, True):
        AttentionInterface.register("streaming_llm_reference", streaming_llm_attention(inv_freq, rotate_all))
        model.set_attn_implementation("streaming_llm_reference")
        try:
            refs[rotate_all] = [reference_greedy(model, p, n) for p in ps]  # the 4-D masks are not read
        finally:
            model.set_attn_implementation("sdpa")
    for b, (want_tokens, want_logits) in enumerate(refs[False]):
        assert out.sequences[b, ids.shape[1]:].tolist() == want_tokens.tolist(), f"row {b}"
        torch.testing.assert_close(logits[b].double(), want_logits, rtol=0, atol=1e-5)
    # Re-rotating the layer without rotary would be another model.
    assert max((logits[b].double() - r[1]).abs().max().item() for b, r in enumerate(refs[True])) > 1e-2



def test_failed_forward_leaves_every_stream_where_it_was():
    model = make_model("qwen3", seed=5)
    impl = model.config._attn_implementation
    ids, mask = left_pad(prompts((6, 11), seed=6))
    kw = dict(max_streams=3, prefill_chunk=CHUNK, block_size=16)
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    want = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw), **gen)

    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
    fail = FailOnce(call=1)  # layer 1, during the prefill (after layer 0 attended and wrote)
    handle = model.model.layers[1].self_attn.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            model.generate(ids, cache=cache, **gen)
        assert cache.streams == () and cache.get_seq_length() == 0 and cache.selection is None
        assert model.config._attn_implementation == impl
        got = model.generate(ids, cache=cache, **gen)  # the same call again
        assert got.sequences.tolist() == want.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))

        # Continuing streams: a decode step fails after the new columns and one token were committed;
        # the whole call is undone, and the same call again gives what an undisturbed one gives.
        lengths = {sid: cache.stream_length(sid) for sid in (0, 1)}
        fail.seen, fail.call = 0, 3
        more = torch.cat([got.sequences, torch.tensor([[5], [7]])], dim=1)
        more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        columns = cache.get_seq_length()
        again = dict(attention_mask=more_mask, max_new_tokens=5, do_sample=False, output_logits=True,
                     return_dict_in_generate=True)
        with pytest.raises(RuntimeError, match="injected failure"):
            model.generate(more, cache=cache, **again)
        assert {sid: cache.stream_length(sid) for sid in (0, 1)} == lengths
        assert cache.get_seq_length() == columns and cache.selection == (0, 1)
        retried = model.generate(more, cache=cache, **again)
    finally:
        handle.remove()
    undisturbed = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
    model.generate(ids, cache=undisturbed, **gen)
    want = model.generate(more, cache=undisturbed, **again)
    assert retried.sequences.tolist() == want.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(retried.logits, want.logits))
    assert [cache.stream_length(s) for s in (0, 1)] == [undisturbed.stream_length(s) for s in (0, 1)]


def test_absolute_positions_past_the_limit_are_refused():
    model = make_model("gpt2", seed=2)  # n_positions = 16
    ids = prompts((10,), seed=3)[0][None]
    cache = FlexKVCache(model, SinkWindow(2, 4), max_streams=1, block_size=16)
    out = model.generate(ids, cache=cache, max_new_tokens=7, do_sample=False)  # feeds 16 tokens
    assert cache.stream_length(0) == 16
    with pytest.raises(ValueError, match=r"stream 0 would reach length 17 \(holds 16, this forward adds 1\).*"
                                         r"\(wpe\) stop at max_position_embeddings=16"):
        model.generate(out, cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.stream_length(0) == 16 and cache.get_seq_length() == 16


# ------------------------------------------------------------ streams across calls


def test_streams_continue_across_generate_calls():
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    n = 8
    history = {}
    # Call 1: three streams.
    first = dict(zip("abc", prompts((4, 11, 7), seed=5)))
    ids, mask = left_pad(list(first.values()))
    out = model.generate(ids, attention_mask=mask, cache=cache.select(list(first)),
                         max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(first):
        history[sid] = torch.cat([first[sid], out[i, ids.shape[1]:]])
    assert cache.stream_length("b") == len(history["b"]) - 1
    # Call 2: continue c and a (in another order, only their new tokens) and start d; the cache feeds
    # each continued stream the last token call 1 returned before its new tokens.
    msgs = dict(zip("cad", prompts((6, 2, 9), seed=6)))
    new = msgs
    ids, mask = left_pad(list(new.values()))
    cache.select(list(new))
    assert cache.get_seq_length() == 0
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(new):
        before = history[sid] if sid in history else torch.zeros(0, dtype=torch.long)
        want, _ = reference_greedy(model, torch.cat([before, msgs[sid]]), n)
        assert out[i, ids.shape[1]:].tolist() == want.tolist(), f"stream {sid}"
        history[sid] = torch.cat([before, msgs[sid], want])
    assert cache.stream_length("b") == len(first["b"]) + n - 1  # untouched by call 2
    assert set(cache.streams) == set("abcd")
    # Call 3, the usual transformers way: hand generate() its own output plus new tokens.
    more = prompts((3, 3, 3), seed=7)
    ids3 = torch.cat([out, torch.stack(more)], dim=1)
    mask3 = torch.cat([mask, torch.ones(3, n + 3, dtype=torch.long)], dim=1)
    out3 = model.generate(ids3, attention_mask=mask3, cache=cache, max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(new):
        want, _ = reference_greedy(model, torch.cat([history[sid], more[i]]), n)
        assert out3[i, ids3.shape[1]:].tolist() == want.tolist(), f"stream {sid}, call 3"


@pytest.mark.parametrize("form", ["new-tokens-only", "output-plus-new-tokens"])
def test_multi_turn_chat_matches_the_whole_history(form):
    """A chat of 5 turns per stream, two streams, each turn `generate()` of 6 tokens after a 3-token message,
    evicting from the second turn on: either `select()` and only the new message (the cache feeds the token
    the previous turn returned last), or the previous output plus the new message (transformers' way).
    Every turn's tokens equal the model's over the whole history the user saw."""
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **{**KW, "max_streams": 2})
    n, sids = 6, ["u", "v"]
    history = {sid: torch.zeros(0, dtype=torch.long) for sid in sids}
    out = mask = None
    for turn in range(5):
        msgs = prompts((3, 3) if form != "new-tokens-only" else (3 + turn % 2, 2), seed=20 + turn)
        if form == "new-tokens-only" or out is None:
            ids, m = left_pad(msgs)
            cache.select(sids)
        else:
            ids = torch.cat([out, torch.stack(msgs)], dim=1)
            m = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
        out = model.generate(ids, attention_mask=m, cache=cache, max_new_tokens=n, do_sample=False)
        assert out.shape == (2, ids.shape[1] + n)  # the caller's columns, whatever the cache fed
        mask = torch.cat([m, torch.ones(2, n, dtype=torch.long)], dim=1)
        for i, sid in enumerate(sids):
            want, _ = reference_greedy(model, torch.cat([history[sid], msgs[i]]), n)
            assert out[i, ids.shape[1]:].tolist() == want.tolist(), f"{form}, turn {turn}, stream {sid}"
            history[sid] = torch.cat([history[sid], msgs[i], want])
            assert cache.stream_length(sid) == len(history[sid]) - 1  # the last token is owed, not fed
    assert cache.get_seq_length() == out.shape[1] - 1


def test_a_forward_planned_by_hand_commits_when_told():
    model = make_model("llama", seed=4)
    ids = prompts((5,), seed=2)[0][None]
    hooked = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, block_size=16)
    bare = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, block_size=16)
    with torch.no_grad():
        want = model(input_ids=ids, cache=hooked).logits
        kw = bare.prepare(ids)
        assert bare.stream_length(0) == 0  # pending: nothing committed yet
        with pytest.raises(ValueError, match="while a planned forward is pending"):
            bare.prepare(ids)
        got = model.forward(input_ids=ids, cache=bare, **kw).logits
        bare.commit()
    assert torch.equal(got, want)
    assert bare.stream_length(0) == hooked.stream_length(0) == 5
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="no planned forward is pending"):
        bare.commit()


def test_a_rolled_back_forward_leaves_the_slot_table_as_it_was():
    """A forward planned for a known stream and a new one, then rolled back: the step transaction
    takes back the new stream's slot, and the selection and sequence length return."""
    model = make_model("llama", seed=4)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, block_size=16)
    with torch.no_grad():
        model(input_ids=prompts((3,), seed=1)[0][None], cache=cache.select(["a"]))
    before = cache.manager.slots.snapshot()
    cache.select(["a", "b"])
    selected = (cache.selection, cache.get_seq_length())
    cache.prepare(torch.stack(prompts((2, 2), seed=3)))
    assert cache.streams == ("a", "b")
    cache.rollback()
    assert cache.manager.slots.snapshot() == before and (cache.selection, cache.get_seq_length()) == selected



# ------------------------------------------------------------------ compile


@pytest.mark.parametrize("slot_dtype", [None, torch.int8])
def test_compiled_hybrid_decode_does_not_recompile_per_token(slot_dtype):
    """Gemma 3 (a sliding and a full layer, two groups of different slot sizes), float32, compiled decode,
    with full-precision and with quantized slots."""
    torch._dynamo.reset()
    model = make_model("gemma3", dtype=torch.float32, seed=4)
    kwargs = dict(max_streams=4, prefill_chunk=CHUNK, block_size=16, slot_dtype=slot_dtype)
    eager = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    compiled = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    ids, _ = left_pad(prompts((6, 6, 6), seed=8))
    steps = 2 * WINDOW  # past both the sliding window and sink + window
    want, got, graphs = eager_and_compiled_greedy(model, ids, None, eager, compiled, steps)
    print(f"\ngraphs compiled after each decode step: {graphs}")
    assert graphs == [1] * steps
    for a, b in zip(want, got):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)




def test_an_eager_forward_after_a_compiled_one_returns_every_hidden_state():
    """transformers keeps what a forward collects (`output_hidden_states=True`) in a global while the
    forward is compiled and clears it in a `finally` block, which a compiled frame through flexkv's
    attention drops on torch 2.13 (`TORCH_WORKAROUNDS["FINALLY_AFTER_HOP"]`): the cache clears it when
    the forward ends, so the next eager forward returns one hidden state per layer and the embeddings."""
    model = make_model("llama", dtype=torch.float32, seed=4)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    ids = prompts((5,), seed=3)[0][None]
    forward = model.forward
    with torch.no_grad():
        nxt = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
        model.forward = torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)
        try:
            nxt = model(input_ids=nxt, cache=cache).logits[:, -1:].argmax(-1)
        finally:
            model.forward = forward
        out = model(input_ids=nxt, cache=cache, output_hidden_states=True)
    assert out.hidden_states is not None and len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_eager_decode_plans_make_parts_when_read_and_a_compiled_forward_gets_them_made():
    """After an eager forward, the next forward's plans are for eager calls only (their table parts
    made when read, `BoundedKVManager.plan_eager`); the first forward of a cache, and any
    forward run by a compiled `model.forward`, gets plans whose parts are made before the graph. The
    greedy tokens are those of the whole-history reference either way."""
    from flexkv.integrations.transformers.plan import compiled_forward

    model = make_model("llama", dtype=torch.float32, seed=2)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append([p.parts_made for p in kwargs["flexkv_step"].plans]),  # one group
        with_kwargs=True)
    ids = prompts((5,), seed=3)[0][None]
    forward = model.forward
    try:
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=WINDOW, min_new_tokens=WINDOW, do_sample=False)
            assert seen[0] and all(seen[0]) and seen[1:] and not any(any(s) for s in seen[1:])
            assert not compiled_forward(model)
            model.forward = torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)
            assert compiled_forward(model)
            del seen[:]
            model(input_ids=out[:, -1:], cache=cache)
            assert seen and all(all(s) for s in seen)
    finally:
        model.forward = forward
        hook.remove()
    want, _ = reference_greedy(model, ids[0], WINDOW)
    assert torch.equal(out[0, ids.shape[1]:], want)


def test_the_attention_switch_sets_the_config_itself_and_restores_it():
    """Each planned forward switches the model's attention to flexkv and back; where the strict
    config's `__setattr__` would only store the value, the switch stores it in the config's dict.
    Inside the forward the model reads "flexkv", after it what it read before."""
    from flexkv.integrations.transformers.hooks import switch

    model = make_model("llama", dtype=torch.float32, seed=2)
    before = model.config._attn_implementation
    FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    state = model._flexkv_state
    assert [t is cfg.__dict__ for t, cfg in zip(state.targets, state.configs)] == [True] * len(state.configs)
    switch(state, on=True)
    assert all(cfg._attn_implementation == "flexkv" for cfg in state.configs)
    switch(state, on=False)
    assert all(cfg._attn_implementation == before for cfg in state.configs)


# ------------------------------------------------------ interrupted forwards


def test_ctrl_c_in_a_layer_during_generate_leaves_the_cache_usable():
    """A KeyboardInterrupt in layer 1 during the prefill: torch skips the forward hooks, but
    generate() undoes the forward on its way out; no manual call is needed."""
    model = make_model("qwen3", seed=5)
    impl = model.config._attn_implementation
    ids, mask = left_pad(prompts((6, 11), seed=6))
    gen = dict(attention_mask=mask, max_new_tokens=6, **GREEDY)
    want = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW), **gen)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    handle = model.model.layers[1].self_attn.register_forward_hook(FailOnce(1, KeyboardInterrupt()))
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, cache=cache, **gen)
    finally:
        handle.remove()
    assert cache.streams == () and cache.selection is None and cache.get_seq_length() == 0
    assert model.config._attn_implementation == impl
    with torch.no_grad():  # a forward without the cache is the model's own again
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits.nan_to_num(), plain.nan_to_num())
    got = model.generate(ids, cache=cache, **gen)  # the same call again
    assert got.sequences.tolist() == want.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_ctrl_c_in_a_hand_written_decode_loop_is_undone_by_the_next_forward():
    """A KeyboardInterrupt in a decode step of a loop of bare model calls (no generate() to unwind):
    the next forward of the model, with the cache or without it, undoes the interrupted step first."""
    model = make_model("qwen3", seed=7)
    ids, _ = left_pad(prompts((5, 5), seed=8))
    steps = 6

    def decode(cache, fail_at=None):
        out = []
        with torch.no_grad():
            tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
            for i in range(steps):
                if i == fail_at:
                    handle = model.model.layers[1].self_attn.register_forward_hook(FailOnce(1, KeyboardInterrupt()))
                    try:
                        with pytest.raises(KeyboardInterrupt):
                            model(input_ids=tok, cache=cache)
                    finally:
                        handle.remove()
                    lengths = [cache.stream_length(s) for s in (0, 1)]
                    # The interrupted forward is still pending (nothing ran its end) ...
                    assert cache.pending_forward is not None and model.config._attn_implementation == "flexkv"
                    # ... until the next forward: here one without the cache, which runs the model's own attention.
                    model(input_ids=ids)
                    assert cache.pending_forward is None and model.config._attn_implementation == "sdpa"
                    assert [cache.stream_length(s) for s in (0, 1)] == lengths
                logits = model(input_ids=tok, cache=cache).logits[:, -1]
                out.append(logits)
                tok = logits.argmax(-1, keepdim=True)
        return out

    want = decode(FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW))
    got = decode(FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW), fail_at=3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------- decoding modes


@pytest.mark.parametrize("mode", [
    dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    dict(penalty_alpha=0.6, top_k=4),
], ids=["group-beam", "contrastive"])
def test_decoding_modes_flexkv_does_not_serve_are_refused_before_the_prefill(mode):
    model = make_model("llama", seed=2)
    ids, mask = left_pad(prompts((4, 7), seed=3))
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    cache.select(["a", "b"])
    with pytest.raises(ValueError, match=r"FlexKVCache does not support generate\(\) in [a-z ]+ mode: transformers "
                                         r"runs it from hub code"):
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, **mode)
    # Nothing changed: no stream prefilled, the selection as it was.
    assert cache.streams == () and cache.selection == ("a", "b") and cache.get_seq_length() == 0
    assert model.config._attn_implementation == "sdpa"
    got = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
    for b, p in enumerate(prompts((4, 7), seed=3)):
        want, _ = reference_greedy(model, p, 4)
        assert got[b, ids.shape[1]:].tolist() == want.tolist()


def test_num_return_sequences_samples_each_prompt_as_that_many_streams():
    """`num_return_sequences=2` with sampling: transformers repeats each prompt, so prompt `b` becomes
    streams `2b` and `2b + 1`: stream `2b` is prefilled once and `2b + 1` forked from it, then each is
    sampled on its own; every returned logit is the model's over that stream's own history."""
    model = make_model("llama", seed=4)
    ps = prompts((5, 9), seed=5)
    ids, mask = left_pad(ps)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    torch.manual_seed(0)
    n = 2 * WINDOW
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=True, top_k=0,
                         num_return_sequences=2, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape[0] == 4 and cache.streams == (0, 2, 1, 3)  # 0 and 2 prefilled, 1 and 3 forked
    logits = torch.stack(out.logits, dim=1)
    for row in range(4):
        prompt = ps[row // 2]
        new = out.sequences[row, ids.shape[1]:]
        assert cache.stream_length(row) == len(prompt) + n - 1
        with torch.no_grad():  # the reference, teacher-forced along the sampled tokens
            for t in range(n):
                seq = torch.cat([prompt, new[:t]])
                L = len(seq)
                want = model(input_ids=seq[None], attention_mask=layer_masks(model, L),
                             position_ids=torch.arange(L)[None], use_cache=False).logits[0, -1]
                torch.testing.assert_close(logits[row, t].double(), want.double(), rtol=0, atol=1e-5)
    assert not torch.equal(out.sequences[0], out.sequences[1])  # two samples of one prompt, apart


def test_the_older_past_key_values_keyword_still_plans_the_forward():
    """transformers 5.24 deprecates `past_key_values=` for `cache=` (a FutureWarning); until it is
    removed, a FlexKVCache passed the old way serves the same forwards."""
    model = make_model("llama", seed=6)
    ids, mask = left_pad(prompts((3, 8), seed=7))
    new = model.generate(ids, attention_mask=mask, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW),
                         max_new_tokens=2 * WINDOW, do_sample=False)
    old_cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **KW)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        old = model.generate(ids, attention_mask=mask, past_key_values=old_cache, max_new_tokens=2 * WINDOW,
                             do_sample=False)
    assert torch.equal(old, new) and old_cache.stream_length(1) == 8 + 2 * WINDOW - 1


def test_finish_ends_a_stream_and_frees_its_slot():
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, prefill_chunk=CHUNK, block_size=16)
    ids, mask = left_pad(prompts((4, 6), seed=5))
    model.generate(ids, attention_mask=mask, cache=cache.select(["a", "b"]), max_new_tokens=2, do_sample=False)
    cache.finish("a")
    assert cache.streams == ("b",) and cache.stream_length("a") == 0
    cache.finish("b")
    assert cache.streams == () and cache.manager.free_slots == 2


def test_a_continued_stream_that_cannot_take_its_last_token_first_is_refused():
    """num_return_sequences repeats one prompt row for several streams, each owed a different token:
    refused before anything is fed, naming the streams."""
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, block_size=16)
    ids = prompts((4,), seed=5)[0][None]
    model.generate(ids.repeat(2, 1), cache=cache.select(["a", "b"]), max_new_tokens=3, do_sample=False)
    lengths = [cache.stream_length(s) for s in "ab"]
    with pytest.raises(ValueError, match=r"streams \['a', 'b'\] continue after a token generate\(\) returned and "
                                         r"never fed, but this call has 1 prompt rows for 2 streams"):
        model.generate(ids, cache=cache.select(["a", "b"]), max_new_tokens=3, do_sample=True, num_return_sequences=2)
    assert [cache.stream_length(s) for s in "ab"] == lengths and cache.get_seq_length() == 0


def test_a_chat_continued_with_only_new_ids_and_no_select_is_refused_naming_the_documented_forms():
    """After a `generate()` the selection was fed 10 columns; a 3-token message alone is no longer than that,
    and transformers feeds only the columns past `get_seq_length()`: refused before anything runs, naming
    `select()`. Both documented forms then continue the chat with the same tokens."""
    model = make_model("llama", seed=2)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **{**KW, "max_streams": 1})
    p, q = prompts((7, 3), seed=3)
    out = model.generate(p[None], cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.get_seq_length() == 10 and cache.selection == (0,)
    with pytest.raises(ValueError, match=r"generate\(\) was given 3 columns of input_ids, but streams \[0\] were fed "
                                         r"10 columns since the last select\(\).*call cache\.select\(\[0\]\) first"):
        model.generate(q[None], cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.stream_length(0) == 10 and cache.get_seq_length() == 10 and cache.selection == (0,)
    with pytest.raises(ValueError, match=r"at least one token per row, got input of shape \(1, 0\); the selected "
                                         r"streams were fed 10 columns since select\(\)"), torch.no_grad():
        model(input_ids=q[None, :0], cache=cache)  # what generate() would have fed
    want, _ = reference_greedy(model, torch.cat([out[0], q]), 4)
    got = model.generate(q[None], cache=cache.select([0]), max_new_tokens=4, do_sample=False)
    assert got[0, 3:].tolist() == want.tolist()
    other = FlexKVCache(model, SinkWindow(SINK, WINDOW), **{**KW, "max_streams": 1})
    model.generate(p[None], cache=other, max_new_tokens=4, do_sample=False)
    got = model.generate(torch.cat([out, q[None]], dim=1), cache=other, max_new_tokens=4, do_sample=False)
    assert got[0, out.shape[1] + 3:].tolist() == want.tolist()
