"""flexkv inside transformers: generate() against a whole-history sink + window reference.

The reference runs the same model without any cache: every step feeds the
whole history with an explicit 4-D mask in which the token at position `p`
sees `j <= p` with `j < sink` or `j >= p - window`. Models are small,
randomly initialised (wide init so that attention changes the argmax) and run
in float64, so greedy tokens must agree exactly and logits to float32 rounding.
"""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

# An optional extra: without it (`pip install -e '.[test]'`) this module is skipped, not an error.
transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')"
)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList  # noqa: E402

import flexkv.integrations.transformers as fkt  # noqa: E402
from flexkv import SinkWindow  # noqa: E402
from flexkv.integrations.transformers import FlexKVCache  # noqa: E402

SINK, WINDOW = 3, 8
VOCAB = 97
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def make_model(family: str, dtype=torch.float64, seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = model_cls(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def left_pad(seqs):
    """`[B, T]` ids and mask, each sequence right-aligned (zeros are padding)."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return ids, mask


def reference_greedy(model, history, new_tokens, sink=SINK, window=WINDOW):
    """Greedy decoding with no cache: the whole history under an explicit sink + window mask each step."""
    seq = history.clone()
    logits = []
    with torch.no_grad():
        for _ in range(new_tokens):
            L = len(seq)
            i = torch.arange(L)
            allowed = (i[None, :] <= i[:, None]) & ((i[None, :] < sink) | (i[None, :] >= i[:, None] - window))
            mask = torch.zeros(L, L, dtype=model.dtype).masked_fill(~allowed, float("-inf"))[None, None]
            out = model(input_ids=seq[None], attention_mask=mask, position_ids=i[None], use_cache=False)
            last = out.logits[0, -1]
            logits.append(last)
            seq = torch.cat([seq, last.argmax()[None]])
    return seq[len(history):], torch.stack(logits)


def held_bytes(obj) -> int:
    """Bytes of every tensor storage reachable from `obj` through attributes and containers."""
    seen_obj, seen_storage, total = set(), set(), 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen_obj or isinstance(o, (type, types.ModuleType, types.FunctionType, str, bytes)):
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen_storage:
                seen_storage.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return total


class RecordBytes(StoppingCriteria):
    """Records the bytes a cache holds after every generated token; never stops generation."""

    def __init__(self, cache):
        self.cache = cache
        self.series = []

    def __call__(self, input_ids, scores, **kwargs):
        self.series.append(held_bytes(self.cache))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


# ------------------------------------------------------------------ generate

LENGTHS = (5, 13, 22)  # the longest prompt is prefilled in 3 chunks of 8, evicting inside the prompt
NEW = 4 * WINDOW + 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def generated(request):
    family = request.param
    model = make_model(family)
    ps = prompts(LENGTHS)
    ids, mask = left_pad(ps)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=4, prefill_chunk=8, block_size=16)
    rec = RecordBytes(cache)
    out = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([rec]),
    )
    dyn = DynamicCache(config=model.config)
    rec_dyn = RecordBytes(dyn)
    full = model.generate(
        ids, attention_mask=mask, past_key_values=dyn, max_new_tokens=NEW, do_sample=False,
        stopping_criteria=StoppingCriteriaList([rec_dyn]),
    )
    return types.SimpleNamespace(
        family=family, model=model, prompts=ps, width=ids.shape[1], out=out, cache=cache,
        flex_bytes=rec.series, dyn_bytes=rec_dyn.series, full=full,
    )


def test_generate_matches_whole_history_sink_window_reference(generated):
    g = generated
    logits = torch.stack(g.out.logits, dim=1)  # [B, NEW, V]
    for b, p in enumerate(g.prompts):
        want_tokens, want_logits = reference_greedy(g.model, p, NEW)
        got_tokens = g.out.sequences[b, g.width:]
        assert got_tokens.tolist() == want_tokens.tolist(), f"{g.family} row {b} (prompt {len(p)})"
        torch.testing.assert_close(logits[b].double(), want_logits, rtol=1e-6, atol=1e-6)  # generate keeps fp32 logits
        assert g.cache.stream_length(b) == len(p) + NEW - 1  # the last token is returned, not fed
    # The window matters: full attention over the same prompts generates something else.
    assert not torch.equal(g.full[:, g.width:], g.out.sequences[:, g.width:])


def test_cache_memory_is_flat_while_dynamic_cache_grows(generated):
    g = generated
    print(f"\n[{g.family}] bytes held after each token, flexkv:  {g.flex_bytes}")
    print(f"[{g.family}] bytes held after each token, DynamicCache: {g.dyn_bytes}")
    assert len(g.flex_bytes) == len(g.dyn_bytes) == NEW
    # Flat from the first decoded token on; after the prefill the manager also still holds the
    # prefill's last plan (a table of a few dozen ints), nothing more.
    assert len(set(g.flex_bytes[1:])) == 1
    assert abs(g.flex_bytes[0] - g.flex_bytes[1]) < 1024
    assert g.flex_bytes[1] >= g.cache.memory_bytes
    assert all(b > a for a, b in zip(g.dyn_bytes, g.dyn_bytes[1:]))
    assert g.dyn_bytes[-1] > g.dyn_bytes[0]


# ------------------------------------------------------- StreamingLLM cache positions


def rotate(x, positions, inv_freq):
    """Rotate `x [..., D]` at float64 angles `positions [...] * inv_freq` (half-split layout)."""
    freqs = positions.double()[..., None] * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * emb.sin()


def cache_positions_attention(inv_freq, sink=SINK, window=WINDOW):
    """StreamingLLM by its definition, over a whole uncached history of one row.

    Undo the model's rotation (its own float32 angles at positions 0..L-1),
    then for each query `p` rotate every attended key and the query at its
    rank in the attended set (its in-cache position) and softmax over that set.
    """

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _, Hq, L, D = query.shape
        group = Hq // key.shape[1]
        pos = torch.arange(L)
        freqs = pos.float()[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(query.dtype), emb.sin().to(query.dtype)
        half = D // 2
        unrot = lambda x: x * cos - torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin  # noqa: E731
        q = unrot(query[0])  # [Hq, L, D]
        k = unrot(key[0]).repeat_interleave(group, 0)
        v = value[0].repeat_interleave(group, 0)
        p, j = pos[:, None], pos[None, :]
        attended = (j <= p) & ((j < sink) | (j >= p - window))
        evicted = (p - window - sink).clamp_min(0)  # entries between the sinks and the window
        rank = torch.where(j < sink, j, j - evicted)  # in-cache position of key j for query p
        keys = rotate(k[:, None, :, :], rank[None], inv_freq)  # [Hq, L(query), L(key), D]
        queries = rotate(q, (pos - evicted[:, 0])[None], inv_freq)  # [Hq, L, D]
        scores = torch.einsum("hpd,hpjd->hpj", queries, keys) * scaling
        scores = scores.masked_fill(~attended, float("-inf"))
        out = torch.einsum("hpj,hjd->hpd", torch.softmax(scores, -1), v)
        return out.transpose(0, 1)[None].contiguous(), None

    return attention


def test_cache_positions_match_streaming_llm_definition():
    from transformers import AttentionInterface

    model = make_model("llama", seed=12)
    ps = prompts(LENGTHS, seed=13)
    ids, mask = left_pad(ps)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), positions="cache", max_streams=4, prefill_chunk=8,
                        block_size=16)
    assert cache.memory_bytes > cache.manager.memory_bytes  # the un-rotated sink copies
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    t1 = time.perf_counter()
    AttentionInterface.register("streaming_llm_reference", cache_positions_attention(model.model.rotary_emb.inv_freq))
    model.set_attn_implementation("streaming_llm_reference")
    try:
        refs = [reference_greedy(model, p, NEW) for p in ps]  # the 4-D mask is ignored by this attention
    finally:
        model.set_attn_implementation("flexkv")
    t2 = time.perf_counter()
    stream = [reference_greedy(model, p, NEW)[0] for p in ps]
    print(f"\ngenerate {t1 - t0:.1f}s, reference {t2 - t1:.1f}s, stream reference {time.perf_counter() - t2:.1f}s")
    logits = torch.stack(out.logits, dim=1)
    for b, (want_tokens, want_logits) in enumerate(refs):
        assert out.sequences[b, ids.shape[1]:].tolist() == want_tokens.tolist(), f"row {b}"
        torch.testing.assert_close(logits[b].double(), want_logits, rtol=1e-5, atol=1e-5)
    # Cache positions are not stream positions: once sinks drift away the two differ.
    assert any(s.tolist() != r[0].tolist() for s, r in zip(stream, refs))


# ------------------------------------------------------------ streams across calls


def test_streams_continue_across_generate_calls():
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=4, prefill_chunk=8, block_size=16)
    n = 10
    history = {}
    # Call 1: three streams.
    first = dict(zip("abc", prompts((4, 11, 7), seed=5)))
    ids, mask = left_pad(list(first.values()))
    out = model.generate(ids, attention_mask=mask, past_key_values=cache.select(list(first)),
                         max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(first):
        history[sid] = torch.cat([first[sid], out[i, ids.shape[1]:]])
    assert cache.stream_length("b") == len(history["b"]) - 1
    # Call 2: continue c and a (in another order, with the last generated token fed back) and start d.
    msgs = dict(zip("cad", prompts((6, 2, 9), seed=6)))
    new = {sid: (torch.cat([history[sid][-1:], msgs[sid]]) if sid in history else msgs[sid]) for sid in msgs}
    ids, mask = left_pad(list(new.values()))
    cache.select(list(new))
    assert cache.get_seq_length() == 0
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False)
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
    out3 = model.generate(ids3, attention_mask=mask3, past_key_values=cache, max_new_tokens=n, do_sample=False)
    for i, sid in enumerate(new):
        want, _ = reference_greedy(model, torch.cat([history[sid], more[i]]), n)
        assert out3[i, ids3.shape[1]:].tolist() == want.tolist(), f"stream {sid}, call 3"


# ------------------------------------------------------------------ compile


def test_compiled_decode_does_not_recompile_per_token():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model("llama", dtype=torch.float32, seed=4)
    kwargs = dict(max_streams=4, prefill_chunk=8, block_size=16)
    eager = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    compiled = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    ids, _ = left_pad(prompts((6, 6, 6), seed=8))
    steps = 3 * WINDOW
    with torch.no_grad():
        want = [model(input_ids=ids, past_key_values=eager).logits[:, -1]]
        for _ in range(steps):
            want.append(model(input_ids=want[-1].argmax(-1, keepdim=True), past_key_values=eager).logits[:, -1])
        got = [model(input_ids=ids, past_key_values=compiled).logits[:, -1]]
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        graphs = []
        for _ in range(steps):
            got.append(model(input_ids=got[-1].argmax(-1, keepdim=True), past_key_values=compiled).logits[:, -1])
            graphs.append(counters["stats"]["unique_graphs"])
    print(f"\ngraphs compiled after each decode step: {graphs}")
    assert graphs[0] >= 1 and len(set(graphs)) == 1
    for a, b in zip(want, got):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


# ------------------------------------------------------------------- errors


def test_model_without_flexkv_cache_falls_back_to_sdpa():
    model = make_model("qwen2", seed=9)
    ids, mask = left_pad(prompts((4, 9), seed=10))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, block_size=16)  # enables the model
    assert model.config._attn_implementation == "flexkv"
    again = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, again)
    fkt.disable(model)
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_transformers_release_fails_with_one_message(monkeypatch):
    # transformers swaps its module object in sys.modules on first attribute access: patch the live one.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"needs transformers>=5\.23,<5\.25.*found transformers 4\.57\.1"):
        fkt._import_transformers()


def test_bad_arguments_are_named():
    model = make_model("llama", seed=11)
    with pytest.raises(ValueError, match="retention must be a flexkv.SinkWindow"):
        FlexKVCache(model, (4, 8))
    with pytest.raises(ValueError, match="window_includes_step=True"):
        FlexKVCache(model, SinkWindow(2, 8, window_includes_step=True))
    with pytest.raises(ValueError, match="positions must be one of"):
        FlexKVCache(model, SinkWindow(2, 8), positions="absolute")
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        FlexKVCache(model, SinkWindow(2, 8), prefill_chunk=0)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    ids = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(Exception, match="only 2 of max_slots=2 are free"):
        model(input_ids=ids, past_key_values=cache)
    assert cache.streams == ()  # nothing admitted
    cache.select(["x", "y"])
    with pytest.raises(ValueError, match="3 batch rows but the cache's selection names 2"):
        model(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="2-D padding attention_mask"):
        model(input_ids=ids[:2], attention_mask=torch.ones(2, 1, 4, 4), past_key_values=cache)
    with pytest.raises(ValueError, match="stream ids must be distinct"):
        cache.select(["x", "x"])
    with pytest.raises(ValueError, match="beam search"):
        beams = FlexKVCache(model, SinkWindow(2, 8), max_streams=4, block_size=16)
        model.generate(ids[:2], past_key_values=beams, num_beams=2, max_new_tokens=3)
    with pytest.raises(RuntimeError, match="did not plan"):
        model.model.forward(input_ids=ids[:2], past_key_values=FlexKVCache(model, SinkWindow(2, 8), block_size=16))


def test_window_wider_than_model_sliding_window_is_refused():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
    )
    model = transformers.MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="more than the model's sliding_window=16; use window <= 15"):
        FlexKVCache(model, SinkWindow(4, 16))
    FlexKVCache(model, SinkWindow(4, 15), block_size=16)
