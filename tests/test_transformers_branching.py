"""generate() modes that branch or take tokens back, through a FlexKVCache, against the uncached model.

Beam search reorders streams (forks), assisted generation and prompt lookup
take back rejected draft tokens (rollback), and prompts that `generate()`
repeats are prefilled once and forked. The reference is the same model with
no cache, fed the whole history at every step under the masks each layer
should see (`hf_models.layer_masks`), run by transformers' own beam search
(its forward replaced by that whole-history forward) or greedy loop. The
families: Llama (full attention), Gemma 3 (sliding and full layers),
DeepSeek-V3 (latent attention, keys wider than values) and, for beam search,
Qwen3-Next (a recurrent layer, whose state is copied with the stream).
"""

from __future__ import annotations

import pytest
import torch

from hf_models import (
    CHUNK,
    SINK,
    WINDOW,
    layer_masks,
    logit_tolerance,
    make_model,
    prompts,
    reference_greedy,
    streaming_llm_attention,
)
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split

from flexkv import SinkWindow, SlotsExhausted
from flexkv.integrations.transformers import FlexKVCache

KW = dict(prefill_chunk=CHUNK, block_size=16, rope_positions="stream")  # the references: stream positions
N = 3 * WINDOW  # new tokens: every stream evicts


def whole_history(model):
    """`model.forward` replaced by the uncached reference: every call feeds the whole history under
    the per-layer masks (no padding in these tests); returns the original forward."""
    forward = model.forward

    def reference(input_ids=None, attention_mask=None, **kw):
        B, L = input_ids.shape
        for name in ("position_ids", "use_cache", "cache", "past_key_values"):
            kw.pop(name, None)
        return forward(input_ids=input_ids, attention_mask=layer_masks(model, L),
                       position_ids=torch.arange(L)[None].expand(B, L), use_cache=False, **kw)

    model.forward = reference
    return forward


def forward_shapes(model):
    """Record the `[rows, columns]` of every forward of `model`; returns (shapes, hook handle)."""
    shapes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None:
            shapes.append(tuple(ids.shape))

    return shapes, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v3", "qwen3_next"])
def test_beam_search_matches_the_uncached_model(family):
    model = make_model(family, seed=2)
    ids = torch.stack(prompts((13, 13), seed=3))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=N, do_sample=False, early_stopping=True,
                 output_scores=True, return_dict_in_generate=True)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=6, **KW)
    memory = cache.memory_bytes
    shapes, handle = forward_shapes(model)
    try:
        got = model.generate(ids, cache=cache, **beams)
    finally:
        handle.remove()
    # Each prompt prefilled once (all but its last token), then every beam decodes.
    assert shapes[0] == (2, 12) and shapes[1:] == [(6, 1)] * (len(shapes) - 1)
    assert sorted(cache.streams, key=str) == sorted([0, 1, 2, 3, 4, 5], key=str)
    assert cache.memory_bytes == memory
    forward = whole_history(model)
    try:
        want = model.generate(ids, use_cache=False, **beams)
    finally:
        model.forward = forward
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0,
                               atol=max(logit_tolerance(family, model.dtype), 1e-6))
    # The bound matters: the model's own full attention picks other beams.
    assert not torch.equal(model.generate(ids, num_beams=3, max_new_tokens=N, do_sample=False), got.sequences[::2])


def test_beam_search_with_in_cache_rotary_positions_matches_streaming_llm_by_its_definition():
    """`rope_positions="cache"`: a reordered beam carries its sink keys unrotated (they are rotated at
    their in-cache position every step), so beam search gives the sequences of transformers' own beam
    search over the whole history with StreamingLLM's attention written out (`streaming_llm_attention`)."""
    from transformers import AttentionInterface

    model = make_model("llama", seed=2)
    ids = torch.stack(prompts((13, 13), seed=3))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=N, do_sample=False, early_stopping=True,
                 output_scores=True, return_dict_in_generate=True)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=6, **{**KW, "rope_positions": "cache"})
    got = model.generate(ids, cache=cache, **beams)
    impl = model.config._attn_implementation
    AttentionInterface.register("streaming_llm_reference", streaming_llm_attention(model.model.rotary_emb.inv_freq,
                                                                                   rotate_all=False))
    model.set_attn_implementation("streaming_llm_reference")
    forward = whole_history(model)  # its 4-D masks are not read by the reference attention
    try:
        want = model.generate(ids, use_cache=False, **beams)
    finally:
        model.forward = forward
        model.set_attn_implementation(impl)
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-6)
    # In-cache positions matter here: stream positions pick other beams.
    stream = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=6, **KW), **beams)
    assert stream.sequences.tolist() != got.sequences.tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v3"])
@pytest.mark.parametrize("draft", ["assistant", "assistant-flexkv", "ideal", "prompt-lookup"])
def test_assisted_generation_and_prompt_lookup_match_greedy_decoding_of_the_uncached_model(family, draft):
    model = make_model(family, seed=2)
    p = prompts((13,), seed=3)[0]
    want, want_logits = reference_greedy(model, p, N)
    other = make_model(family, seed=7)
    how = {
        "assistant": dict(assistant_model=other),  # drafting with its own cache
        "assistant-flexkv": dict(assistant_model=other, assistant_cache=FlexKVCache(
            other, SinkWindow(SINK, WINDOW), max_streams=1, max_rollback=N, **KW)),
        # The model drafting for itself under the same bound: every draft is what it then verifies.
        "ideal": dict(assistant_model=model, assistant_cache=FlexKVCache(
            model, SinkWindow(SINK, WINDOW), max_streams=1, max_rollback=N, **KW)),
        "prompt-lookup": dict(prompt_lookup_num_tokens=3),
    }[draft]
    # The assistant drafts up to 20 tokens at first (more while every draft is accepted): room to take them back.
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, max_rollback=N, **KW)
    taken_back = []
    crop = cache.crop
    cache.crop = lambda n: (taken_back.append(-n), crop(n))[1]
    out = model.generate(p[None], cache=cache, max_new_tokens=N, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **how)
    assert out.sequences[0, len(p):].tolist() == want.tolist()
    # transformers hands assisted decoding's logits back in float32.
    torch.testing.assert_close(torch.stack(out.logits, 1)[0].double(), want_logits.double(), rtol=0, atol=1e-5)
    assert cache.stream_length(0) == len(p) + N - 1 and cache.get_seq_length() == len(p) + N - 1
    if "assistant_cache" in how:
        drafter = how["assistant_cache"]
        assert drafter.streams == (0,) and drafter.stream_length(0) > len(p)  # it drafted through flexkv
    if draft == "ideal":
        assert not any(taken_back)  # every drafted token accepted
    else:
        assert any(taken_back)  # drafts were rejected and taken back


def test_a_rollback_beyond_the_slot_is_refused_and_the_call_undone():
    """Drafts of 8 tokens verified in chunks of 4: taking back 8 needs `max_rollback=8`."""
    model = make_model("llama", seed=2)
    assistant = make_model("llama", seed=7)
    assistant.generation_config.num_assistant_tokens = 8
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # always draft all 8
    p = prompts((13,), seed=3)[0]
    kw = dict(max_streams=1, prefill_chunk=4, block_size=16, rope_positions="stream")  # the reference: stream positions
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
    with pytest.raises(ValueError, match=r"cannot take back \d tokens.*max_rollback"):
        model.generate(p[None], cache=cache, max_new_tokens=N, do_sample=False, assistant_model=assistant)
    assert cache.streams == () and cache.get_seq_length() == 0 and cache.selection is None
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_rollback=8, **kw)
    got = model.generate(p[None], cache=cache, max_new_tokens=N, do_sample=False, assistant_model=assistant)
    assert got[0, len(p):].tolist() == reference_greedy(model, p, N)[0].tolist()


def test_assisted_generation_is_refused_for_recurrent_layers_before_anything_runs():
    model = make_model("qwen3_next", seed=2)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, **KW)
    with pytest.raises(ValueError, match=r"assisted generation mode.*recurrent layers \[0\].*cannot be taken back"):
        model.generate(prompts((5,))[0][None], cache=cache, max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert cache.streams == () and model.config._attn_implementation != "flexkv"


def test_num_return_sequences_of_named_streams_forks_each_prompt_once():
    model = make_model("llama", seed=4)
    ps = prompts((9, 9), seed=5)
    ids = torch.stack(ps)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=6, **KW)
    torch.manual_seed(0)
    out = model.generate(ids, cache=cache.select(["x", "y"]), max_new_tokens=N, do_sample=True, top_k=0,
                         num_return_sequences=3, output_logits=True, return_dict_in_generate=True)
    assert cache.selection == ("x", ("x", 1), ("x", 2), "y", ("y", 1), ("y", 2))
    logits = torch.stack(out.logits, 1)
    with torch.no_grad():
        for row, sid in enumerate(cache.selection):
            seq = torch.cat([ps[row // 3], out.sequences[row, ids.shape[1]:]])
            assert cache.stream_length(sid) == len(seq) - 1
            L = len(seq) - 1
            want = model(input_ids=seq[None, :L], attention_mask=layer_masks(model, L),
                         position_ids=torch.arange(L)[None], use_cache=False).logits[0, len(ps[0]) - 1:]
            torch.testing.assert_close(logits[row].double(), want.double(), rtol=0, atol=1e-5)
    assert len({tuple(s.tolist()) for s in out.sequences[:3]}) == 3  # three samples of one prompt


def test_a_beam_search_refused_for_want_of_slots_changes_nothing():
    """Two streams of 13 tokens fill `max_streams=2`; 2 beams each need 2 more slots. The refusal comes
    before the prompts are prefilled: 11 prompt tokens per stream are more than a slot can take back
    (`prefill_chunk=8`), so a prefill before the refusal would leave both streams longer."""
    model = make_model("llama", seed=2)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, **KW)
    with torch.no_grad():
        model(input_ids=torch.stack(prompts((13, 13), seed=3)), cache=cache.select(["a", "b"]))
    before = {sid: cache.stream_length(sid) for sid in cache.streams}
    assert before == {"a": 13, "b": 13}
    ids = torch.stack(prompts((12, 12), seed=4))
    with pytest.raises(SlotsExhausted, match=r"2 stream copies need 2 free slots but 0 are free \(max_streams=2\)"):
        model.generate(ids, cache=cache.select(["a", "b"]), max_new_tokens=4, num_beams=2, do_sample=False)
    assert {sid: cache.stream_length(sid) for sid in cache.streams} == before
    assert cache.selection == ("a", "b") and cache.get_seq_length() == 0
    assert model.config._attn_implementation != "flexkv"
    # Unselected, the new streams the prefill would open count too: 1 prompt, 3 beams, 1 free slot.
    with pytest.raises(SlotsExhausted, match=r"2 stream copies and 1 new streams need 3 free slots but 1 are free"):
        model.generate(ids[:1], cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, **KW),
                       max_new_tokens=4, num_beams=3, do_sample=False)


def test_fork_reorder_and_rollback_of_streams_by_hand():
    """The cache's own names: a forked stream continues exactly as one fed the same tokens."""
    model = make_model("gemma3", seed=2)
    p = prompts((11,), seed=3)[0]
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=3, **KW)

    def feed(sids, tokens):
        with torch.no_grad():
            return model(input_ids=tokens, cache=cache.select(sids)).logits[:, -1]

    feed(["a"], p[None])
    cache.fork_stream("a", "b")
    tail = prompts((2 * WINDOW,), seed=9)[0]
    both = feed(["a", "b"], torch.stack([tail, tail]))
    torch.testing.assert_close(both[0], both[1], rtol=0, atol=0)
    seq = torch.cat([p, tail])
    with torch.no_grad():
        want = model(input_ids=seq[None], attention_mask=layer_masks(model, len(seq)),
                     position_ids=torch.arange(len(seq))[None], use_cache=False).logits[0, -1]
    torch.testing.assert_close(both[1], want, rtol=0, atol=1e-5)
    # Take back 3 tokens of b, feed 3 others: as if only those had followed.
    cache.rollback_stream("b", 3)
    other = prompts((3,), seed=11)[0]
    got = feed(["b"], other[None])[0]
    seq2 = torch.cat([seq[:-3], other])
    with torch.no_grad():
        want2 = model(input_ids=seq2[None], attention_mask=layer_masks(model, len(seq2)),
                      position_ids=torch.arange(len(seq2))[None], use_cache=False).logits[0, -1]
    torch.testing.assert_close(got, want2, rtol=0, atol=1e-5)
    # Beyond what the slot can take back: refused, nothing changed.
    before = cache.stream_length("b")
    with pytest.raises(ValueError, match="max_rollback"):
        cache.rollback_stream("b", CHUNK + 1)
    assert cache.stream_length("b") == before
    # a continues b's stream.
    cache.reorder_streams({"a": "b"})
    assert cache.stream_length("a") == before
    torch.testing.assert_close(feed(["a"], other[None])[0], feed(["b"], other[None])[0], rtol=0, atol=0)


def test_compiled_beam_search_reorders_without_recompiling_and_matches_eager():
    """Beam search (2 beams) with `model.forward` compiled: each step's reorder is a slot copy outside
    the graph and its plan a new table of the same shape, so once each forward shape has compiled
    nothing recompiles, and the beams and their scores are the eager run's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model("llama", dtype=torch.float32, seed=2)
    ids = torch.stack(prompts((9,), seed=3))
    beams = dict(num_beams=2, max_new_tokens=2 * WINDOW, do_sample=False, early_stopping=True, output_scores=True,
                 return_dict_in_generate=True)
    want = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, **KW), **beams)
    graphs = []
    forward = model.forward
    counters.clear()
    model.forward = torch.compile(forward, fullgraph=True, dynamic=False)
    shapes, pre = forward_shapes(model)
    post = model.register_forward_hook(lambda *_: graphs.append(counters["stats"]["unique_graphs"]))
    try:
        got = model.generate(ids, cache=FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, **KW), **beams)
    finally:
        pre.remove()
        post.remove()
        model.forward = forward
    print(f"\nforwards: {shapes}\ngraphs compiled after each: {graphs}")
    # The first forward is the one-token probe of the cache built after the compile: it runs eagerly.
    # Then a graph is compiled for the first forward of each input shape and for no other: the decode
    # steps (a reorder before each) reuse theirs.
    assert len(graphs) == len(shapes) and len(shapes) > 2 * WINDOW - 2 and shapes[0] == (1, 1) and graphs[0] == 0
    new_shape = [shape not in shapes[1:i] for i, shape in enumerate(shapes)][1:]
    assert [b - a for a, b in zip(graphs, graphs[1:])] == [int(n) for n in new_shape]
    assert shapes[-1] == (2, 1) and shapes.count((2, 1)) > 2 * WINDOW - 3
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-5)
