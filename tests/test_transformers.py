"""flexkv inside transformers: generate() against the uncached model under the masks each layer should see.

The reference runs the same model without any cache: every step feeds the
whole history with explicit per-layer masks. A full-attention layer gets
flexkv's sink + window mask (the token at position `p` sees `j <= p` with
`j < sink` or `j >= p - window`); a sliding-window layer gets the model's
own sliding-window mask, built by transformers. Models are small, randomly
initialised (wide init so that attention changes the argmax) and run in
float64 (gpt-oss, whose experts need float32, in float32), so greedy tokens
must agree exactly and logits to the precision `generate()` keeps them in.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

# An optional extra: without it (`pip install -e '.[test]'`) this module is skipped, not an error.
transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')"
)

from single_thread import one_thread  # noqa: E402,F401
from transformers import DynamicCache  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

import flexkv.integrations.transformers as fkt  # noqa: E402
from flexkv.integrations.transformers.model_config import layer_windows  # noqa: E402
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition  # noqa: E402
from flexkv.integrations.transformers import FlexKVCache  # noqa: E402

SINK, WINDOW = 4, 8
SW = 6  # the models' own sliding window (transformers counts the token itself)
CHUNK = 8
VOCAB = 97
NEW = 4 * WINDOW
LENGTHS = (5, 13, 22)  # the longest prompt is prefilled in 3 chunks of 8, evicting inside the prompt


def _common(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, initializer_range=0.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    base.update(kw)
    return base


def _configs():
    t = transformers
    return {
        # family: (config, model class, dtype)
        "llama": (t.LlamaConfig(**_common()), t.LlamaForCausalLM, torch.float64),
        "mistral": (t.MistralConfig(**_common(sliding_window=SW)), t.MistralForCausalLM, torch.float64),
        "gemma2": (
            t.Gemma2Config(**_common(sliding_window=SW, query_pre_attn_scalar=8, attn_logit_softcapping=1.5)),
            t.Gemma2ForCausalLM, torch.float64,
        ),
        "gemma3": (
            t.Gemma3TextConfig(**_common(sliding_window=SW, query_pre_attn_scalar=8, tie_word_embeddings=False,
                                         layer_types=["sliding_attention", "full_attention"])),
            t.Gemma3ForCausalLM, torch.float64,
        ),
        "gpt_oss": (
            t.GptOssConfig(**_common(sliding_window=SW, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32, max_position_embeddings=131072, initializer_range=0.3)),
            t.GptOssForCausalLM, torch.float32,
        ),
        "qwen3": (t.Qwen3Config(**_common()), t.Qwen3ForCausalLM, torch.float64),
        "smollm3": (t.SmolLM3Config(**_common(no_rope_layers=[1, 0])), t.SmolLM3ForCausalLM, torch.float64),
        "gpt2": (
            t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16, initializer_range=0.5,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0),
            t.GPT2LMHeadModel, torch.float64,
        ),
    }


def make_model(family: str, dtype=None, seed: int = 0):
    cfg, cls, default = _configs()[family]
    torch.manual_seed(seed)
    model = cls(cfg).eval().to(dtype or default)
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


def sink_window_mask(L: int, dtype, sink=SINK, window=WINDOW) -> torch.Tensor:
    """Additive `[1, 1, L, L]` mask: position `p` sees `j <= p` with `j < sink` or `j >= p - window`."""
    i = torch.arange(L)
    allowed = (i[None, :] <= i[:, None]) & ((i[None, :] < sink) | (i[None, :] >= i[:, None] - window))
    return torch.zeros(L, L, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]


def layer_masks(model, L: int, sink=SINK, window=WINDOW):
    """What each layer should see over a whole uncached history of `L` tokens.

    Full-attention layers: the sink + window mask. Sliding-window layers: the
    model's own mask (transformers builds it). A model without `layer_types`
    whose every layer slides (Mistral) gets None: its own masks throughout.
    """
    cfg = model.config
    full = sink_window_mask(L, model.dtype, sink, window)
    types_ = getattr(cfg, "layer_types", None)
    if types_ is None:
        return None if getattr(cfg, "sliding_window", None) else full
    masks = {"full_attention": full}
    if "sliding_attention" in types_:
        masks["sliding_attention"] = create_sliding_window_causal_mask(
            config=cfg, inputs_embeds=torch.empty(1, L, 0, dtype=model.dtype), attention_mask=None, cache=None,
            position_ids=torch.arange(L)[None], allow_is_causal_skip=False,
        )
    return masks


def reference_greedy(model, history, new_tokens, sink=SINK, window=WINDOW):
    """Greedy decoding with no cache: the whole history under the per-layer masks at every step."""
    seq = history.clone()
    logits = []
    with torch.no_grad():
        for _ in range(new_tokens):
            L = len(seq)
            out = model(input_ids=seq[None], attention_mask=layer_masks(model, L, sink, window),
                        position_ids=torch.arange(L)[None], use_cache=False)
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


def kv_dims(model):
    c = model.config
    return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.empty((), dtype=model.dtype).element_size()


# ------------------------------------------------------------------ generate

FAMILIES = ("mistral", "gemma2", "gemma3", "gpt_oss", "qwen3", "smollm3")


@pytest.fixture(scope="module", params=FAMILIES)
def generated(request):
    family = request.param
    model = make_model(family)
    ps = prompts(LENGTHS)
    ids, mask = left_pad(ps)
    with torch.no_grad():
        plain_before = model(input_ids=ids, attention_mask=mask).logits
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=4, prefill_chunk=CHUNK, block_size=16)
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
    with torch.no_grad():
        plain_after = model(input_ids=ids, attention_mask=mask).logits
    return types.SimpleNamespace(
        family=family, model=model, prompts=ps, width=ids.shape[1], out=out, cache=cache,
        flex_bytes=rec.series, dyn_bytes=rec_dyn.series, full=full, plain=(plain_before, plain_after),
    )


def test_generate_matches_the_model_under_its_per_layer_masks(generated):
    g = generated
    tol = 1e-4 if g.model.dtype == torch.float32 else 1e-5
    logits = torch.stack(g.out.logits, dim=1)  # [B, NEW, V]
    worst = 0.0
    for b, p in enumerate(g.prompts):
        want_tokens, want_logits = reference_greedy(g.model, p, NEW)
        got_tokens = g.out.sequences[b, g.width:]
        assert got_tokens.tolist() == want_tokens.tolist(), f"{g.family} row {b} (prompt {len(p)})"
        torch.testing.assert_close(logits[b].double(), want_logits.double(), rtol=0, atol=tol)
        worst = max(worst, (logits[b].double() - want_logits.double()).abs().max().item())
        assert g.cache.stream_length(b) == len(p) + NEW - 1  # the last token is returned, not fed
    print(f"\n[{g.family}] {NEW} greedy tokens x {len(g.prompts)} rows equal; largest logit difference {worst:.1e}")
    windows = g.cache.layer_windows
    if all(w is not None for w in windows):
        # Every layer slides (Mistral): the cache keeps exactly what the model attends, so its
        # generate() is the model's own.
        assert torch.equal(g.full[:, g.width:], g.out.sequences[:, g.width:])
    else:
        # The sink + window of the full-attention layers matters.
        assert not torch.equal(g.full[:, g.width:], g.out.sequences[:, g.width:])
    # A forward without the cache computes what the model computed before the cache existed.
    torch.testing.assert_close(*g.plain, rtol=0, atol=0, equal_nan=True)  # padded rows hold NaN in eager


def test_each_layer_group_keeps_its_own_window(generated):
    g = generated
    cfg = g.model.config
    types_ = getattr(cfg, "layer_types", None) or ["sliding_attention" if cfg.sliding_window else "full_attention"] * 2
    report = g.cache.memory_report()
    seen = []
    for group in report:
        for layer in group["layers"]:
            assert group["name"] == types_[layer]
            seen.append(layer)
        if group["name"] == "sliding_attention":
            assert group["retention"] == SinkWindow(0, SW - 1)  # the model's window, no sinks
        else:
            assert group["retention"] == SinkWindow(SINK, WINDOW)
        keep = group["retention"]
        assert group["slot_cells"] == keep.sink + keep.window + CHUNK
        layers, heads, dim, size = kv_dims(g.model)
        assert group["slot_bytes"] == 2 * len(group["layers"]) * heads * dim * size * group["slot_cells"]
    assert sorted(seen) == list(range(cfg.num_hidden_layers))
    assert g.cache.stream_bytes == sum(r["slot_bytes"] for r in report)
    assert all(f"{r['name']} layers {list(r['layers'])}: {r['retention']}" in repr(g.cache) for r in report)


def test_cache_memory_is_flat_while_dynamic_cache_grows(generated):
    g = generated
    # One stream on its own (the longest prompt), for the per-stream figure.
    one = DynamicCache(config=g.model.config)
    g.model.generate(g.prompts[-1][None], past_key_values=one, max_new_tokens=NEW, do_sample=False)
    alone = held_bytes(one)
    print(f"\n[{g.family}] after {len(g.prompts[-1])} + {NEW} tokens ({NEW // WINDOW}x the window): one flexkv "
          f"stream {g.cache.stream_bytes} B, DynamicCache for one stream {alone} B; flexkv cache in all "
          f"{g.flex_bytes[-1]} B ({g.cache.manager.config.max_slots} slots), DynamicCache {g.dyn_bytes[-1]} B "
          f"({len(g.prompts)} padded rows)")
    assert len(g.flex_bytes) == len(g.dyn_bytes) == NEW
    # Flat from the first decoded token on; after the prefill the manager also still holds the
    # prefill's last plans (tables of a few dozen ints), nothing more.
    assert len(set(g.flex_bytes[1:])) == 1
    assert abs(g.flex_bytes[0] - g.flex_bytes[1]) < 2048
    assert g.flex_bytes[1] >= g.cache.memory_bytes
    if any(w is None for w in g.cache.layer_windows):
        assert g.cache.stream_bytes < alone
        # (A sliding DynamicCache layer trims what the prefill wrote after the first token.)
        assert all(b > a for a, b in zip(g.dyn_bytes[1:], g.dyn_bytes[2:]))


def test_soft_capping_changes_what_gemma2_computes():
    """The Gemma 2 test above only shows something if the cap is active: without it the logits move."""
    model = make_model("gemma2")
    ids = prompts((12,))[0][None]
    mask = layer_masks(model, 12)
    with torch.no_grad():
        capped = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert (capped - uncapped).abs().max() > 1e-2


# ------------------------------------------------------------ learned sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("path", ["flex", "rows"])
def test_learned_sinks_match_gpt_oss_eager_attention(dtype, pack_gqa, path):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    Hq, H, D, T = 4, 2, 8, 6
    cfg = BoundedKVConfig(num_layers=1, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(2, 16), max_slots=2, dtype=dtype, query_window=16,
                          max_step_tokens=T)
    m = BoundedKVManager(cfg, block_size=16)
    m.pack_gqa = pack_gqa
    m.attention_path = path
    step = BoundedKVStep(segments=(Segment("a", T), Segment(None, 0), Segment("b", 4)),
                         positions={"a": StreamPosition(0, 0), "b": StreamPosition(0, 0)}, tokens=T)
    m.admit(step)
    plan = m.plan(step)
    q = torch.randn(3, Hq, T, D, dtype=dtype) * 3
    k = torch.randn(3, H, T, D, dtype=dtype) * 3
    v = torch.randn(3, H, T, D, dtype=dtype)
    sinks = torch.randn(Hq, dtype=torch.float32) * 2  # any float dtype
    out = m.attend(0, q, k, v, plan, scale=D ** -0.5, sinks=sinks)
    plain = m.attend(0, q, k, v, plan, scale=D ** -0.5)
    module = types.SimpleNamespace(num_key_value_groups=Hq // H, sinks=sinks.to(dtype), training=False)
    causal = torch.zeros(T, T, dtype=dtype).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref, _ = eager_attention_forward(module, q, k, v, causal[None, None], scaling=D ** -0.5)
    ref = ref.transpose(1, 2)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=tol)
    torch.testing.assert_close(out[2, :, :4], ref[2, :, :4], rtol=0, atol=tol)  # 4 real tokens of row b
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # padding row
    assert (plain - out).abs().max() > 0.1  # the sinks matter


def test_learned_sinks_compiled_on_cpu_match_eager_flex_attention():
    """Compiled on the CPU (where FlexAttention's kernel returns no log-sum-exp), sinks take the rows
    path and still equal eager FlexAttention's rescaled output, decode and chunk alike."""
    cfg = BoundedKVConfig(num_layers=1, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(1, 6), max_slots=2, max_step_tokens=3)
    m = BoundedKVManager(cfg, block_size=16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    compiled = torch.compile(lambda q, k, v, plan: m.attend(0, q, k, v, plan, sinks=sinks), fullgraph=True)
    torch.manual_seed(1)
    written = 0
    for T in (3, 1, 1):
        step = BoundedKVStep((Segment("a", T), Segment(None, 0)), {"a": StreamPosition(0, written)}, tokens=T)
        m.admit(step)
        plan = m.plan(step)
        q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)
        got = compiled(q, k, v, plan)
        m.attention_path = "flex"
        want = m.attend(0, q, k, v, plan, sinks=sinks)  # eager FlexAttention with its log-sum-exp
        m.attention_path = "auto"
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        m.commit(step)
        written += T
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
        m.attend(0, q, k, v, plan, sinks=torch.zeros(2))


# ------------------------------------------------------- silent changes


def test_forward_without_flexkv_cache_is_the_models_own():
    """Building (or failing to build) a cache leaves every other forward exactly as the model ran it."""
    ids, mask = left_pad(prompts((4, 9), seed=10))
    for family in ("gpt_oss", "gemma2"):
        model = make_model(family, seed=9)
        impl = model.config._attn_implementation
        with torch.no_grad():
            before = model(input_ids=ids, attention_mask=mask).logits
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        with pytest.raises(ValueError, match="more than the model's sliding_window=6"):
            FlexKVCache(model, SinkWindow(SINK, WINDOW), sliding_retention=SinkWindow(1, 6))
        assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks  # untouched
        cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=2, block_size=16)
        assert model.config._attn_implementation == impl
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert model.config._attn_implementation == impl
        with torch.no_grad():
            after = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True, msg=family)
        assert torch.equal(plain, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    fkt.disable(model)
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="did not plan"):  # no hooks: the cache refuses to be misused
        model(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="ran in a forward no FlexKVCache planned"):
        model.set_attn_implementation("flexkv")
        model(input_ids=ids)


def _rotate(x, positions, inv_freq):
    """Rotate `x [..., D]` at float64 angles `positions [...] * inv_freq` (half-split layout)."""
    freqs = positions.double()[..., None] * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * emb.sin()


def streaming_llm_attention(inv_freq, rotate_all: bool, sink=SINK, window=WINDOW):
    """StreamingLLM by its definition, over a whole uncached history of one row.

    In a rotary layer: undo the model's rotation (its own float32 angles at
    positions 0..L-1), then for each query `p` rotate every attended key and
    the query at its rank in the attended set (its in-cache position) and
    softmax over that set. A layer that uses no rotary (`module.use_rope`
    false) attends the same set unrotated, unless `rotate_all`.
    """

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _, Hq, L, D = query.shape
        group = Hq // key.shape[1]
        pos = torch.arange(L)
        p, j = pos[:, None], pos[None, :]
        attended = (j <= p) & ((j < sink) | (j >= p - window))
        q = query[0]
        k = key[0].repeat_interleave(group, 0)
        v = value[0].repeat_interleave(group, 0)
        if getattr(module, "use_rope", True) or rotate_all:
            if getattr(module, "use_rope", True):
                freqs = pos.float()[:, None] * inv_freq.float()
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos().to(query.dtype), emb.sin().to(query.dtype)
                half = D // 2
                unrot = lambda x: x * cos - torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin  # noqa: E731
                q, k = unrot(q), unrot(k)
            evicted = (p - window - sink).clamp_min(0)  # entries between the sinks and the window
            rank = torch.where(j < sink, j, j - evicted)  # in-cache position of key j for query p
            keys = _rotate(k[:, None, :, :], rank[None], inv_freq)  # [Hq, L(query), L(key), D]
            queries = _rotate(q, (pos - evicted[:, 0])[None], inv_freq)  # [Hq, L, D]
            scores = torch.einsum("hpd,hpjd->hpj", queries, keys) * scaling
        else:
            scores = torch.einsum("hpd,hjd->hpj", q, k) * scaling
        scores = scores.masked_fill(~attended, float("-inf"))
        out = torch.einsum("hpj,hjd->hpd", torch.softmax(scores, -1), v)
        return out.transpose(0, 1)[None].contiguous(), None

    return attention


def test_cache_positions_leave_layers_without_rotary_alone():
    """SmolLM3 with `no_rope_layers=[1, 0]`: layer 1 has no rotary, so in-cache positions change nothing there."""
    from transformers import AttentionInterface

    model = make_model("smollm3", seed=12)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    ps = prompts((5, 22), seed=13)
    ids, mask = left_pad(ps)
    n = 3 * WINDOW
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), positions="cache", max_streams=2, prefill_chunk=CHUNK,
                        block_size=16)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False,
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


class _FailOnce:
    """Forward hook that raises in the chosen call of a module (1-based), once."""

    def __init__(self, call: int):
        self.call = call
        self.seen = 0

    def __call__(self, module, args, output):
        self.seen += 1
        if self.seen == self.call:
            raise RuntimeError("injected failure")


def test_failed_forward_leaves_every_stream_where_it_was():
    model = make_model("qwen3", seed=5)
    impl = model.config._attn_implementation
    ids, mask = left_pad(prompts((6, 11), seed=6))
    kw = dict(max_streams=3, prefill_chunk=CHUNK, block_size=16)
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    want = model.generate(ids, past_key_values=FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw), **gen)

    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kw)
    fail = _FailOnce(call=1)  # layer 1, during the prefill (after layer 0 attended and wrote)
    handle = model.model.layers[1].self_attn.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            model.generate(ids, past_key_values=cache, **gen)
        assert cache.streams == () and cache.get_seq_length() == 0 and cache.selection is None
        assert model.config._attn_implementation == impl
        got = model.generate(ids, past_key_values=cache, **gen)  # the same call again
        assert got.sequences.tolist() == want.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))

        # Continuing streams: a decode step fails; only that step is undone.
        lengths = {sid: cache.stream_length(sid) for sid in (0, 1)}
        fail.seen, fail.call = 0, 3
        more = torch.cat([got.sequences, torch.tensor([[5], [7]])], dim=1)
        more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        columns = cache.get_seq_length()
        with pytest.raises(RuntimeError, match="injected failure"):
            model.generate(more, attention_mask=more_mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        # The two forwards that returned (the new columns, then one token) are kept.
        assert cache.stream_length(0) == lengths[0] + (more.shape[1] - columns) + 1
        assert cache.stream_length(1) == lengths[1] + (more.shape[1] - columns) + 1
        assert cache.get_seq_length() == more.shape[1] + 1
    finally:
        handle.remove()


def test_absolute_positions_past_the_limit_are_refused():
    model = make_model("gpt2", seed=2)  # n_positions = 16
    ids = prompts((10,), seed=3)[0][None]
    cache = FlexKVCache(model, SinkWindow(2, 4), max_streams=1, block_size=16)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=7, do_sample=False)  # feeds 16 tokens
    assert cache.stream_length(0) == 16
    with pytest.raises(ValueError, match=r"stream 0 would reach length 17 \(holds 16, this forward adds 1\).*"
                                         r"\(wpe\) stop at max_position_embeddings=16"):
        model.generate(out, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.stream_length(0) == 16 and cache.get_seq_length() == 16


# ------------------------------------------------------------ streams across calls


def test_streams_continue_across_generate_calls():
    model = make_model("llama", seed=3)
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=4, prefill_chunk=CHUNK, block_size=16)
    n = 8
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


def test_a_forward_planned_by_hand_commits_when_told():
    model = make_model("llama", seed=4)
    ids = prompts((5,), seed=2)[0][None]
    hooked = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, block_size=16)
    bare = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1, block_size=16)
    with torch.no_grad():
        want = model(input_ids=ids, past_key_values=hooked).logits
        kw = bare.prepare(ids)
        assert bare.stream_length(0) == 0  # pending: nothing committed yet
        with pytest.raises(ValueError, match="while a planned forward is pending"):
            bare.prepare(ids)
        got = model.forward(input_ids=ids, past_key_values=bare, **kw).logits
        bare.commit()
    assert torch.equal(got, want)
    assert bare.stream_length(0) == hooked.stream_length(0) == 5
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="no planned forward is pending"):
        bare.commit()


# ------------------------------------------------------------------ compile


def test_compiled_hybrid_decode_does_not_recompile_per_token():
    """Gemma 3 (a sliding and a full layer, two groups of different slot sizes), float32, compiled decode."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model("gemma3", dtype=torch.float32, seed=4)
    kwargs = dict(max_streams=4, prefill_chunk=CHUNK, block_size=16)
    eager = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    compiled = FlexKVCache(model, SinkWindow(SINK, WINDOW), **kwargs)
    ids, _ = left_pad(prompts((6, 6, 6), seed=8))
    steps = 2 * WINDOW  # past both the sliding window and sink + window
    with torch.no_grad():
        want = [model(input_ids=ids, past_key_values=eager).logits[:, -1]]
        for _ in range(steps):
            want.append(model(input_ids=want[-1].argmax(-1, keepdim=True), past_key_values=eager).logits[:, -1])
        got = [model(input_ids=ids, past_key_values=compiled).logits[:, -1]]
        forward = model.forward
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        graphs = []
        try:
            for _ in range(steps):
                got.append(model(input_ids=got[-1].argmax(-1, keepdim=True), past_key_values=compiled).logits[:, -1])
                graphs.append(counters["stats"]["unique_graphs"])
        finally:
            model.forward = forward
    print(f"\ngraphs compiled after each decode step: {graphs}")
    assert graphs[0] >= 1 and len(set(graphs)) == 1
    for a, b in zip(want, got):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


# ------------------------------------------------------------------- errors


def test_unsupported_transformers_release_fails_with_one_message(monkeypatch):
    # transformers swaps its module object in sys.modules on first attribute access: patch the live one.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"needs transformers>=5\.23,<5\.25.*found transformers 4\.57\.1"):
        fkt.registration.import_transformers()


def test_bad_arguments_are_named():
    model = make_model("llama", seed=11)
    with pytest.raises(ValueError, match="retention must be a flexkv.SinkWindow"):
        FlexKVCache(model, (4, 8))
    with pytest.raises(ValueError, match="window_includes_step=True"):
        FlexKVCache(model, SinkWindow(2, 8, window_includes_step=True))
    with pytest.raises(ValueError, match="sliding_retention must be a flexkv.SinkWindow"):
        FlexKVCache(model, SinkWindow(2, 8), sliding_retention=8)
    with pytest.raises(ValueError, match="positions must be one of"):
        FlexKVCache(model, SinkWindow(2, 8), positions="absolute")
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        FlexKVCache(model, SinkWindow(2, 8), prefill_chunk=0)
    assert getattr(model, "_flexkv_state", None) is None  # no refused build touched the model
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    ids = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(Exception, match="only 2 of max_slots=2 are free"):
        model(input_ids=ids, past_key_values=cache)
    assert cache.streams == () and cache.selection is None  # nothing admitted
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
    with pytest.raises(ValueError, match=r"positions='cache' needs the model's rotary embedding"):
        FlexKVCache(make_model("gpt2"), SinkWindow(2, 4), positions="cache")


def test_model_layer_types_are_read_or_refused():
    cfg = types.SimpleNamespace(sliding_window=6, layer_types=["sliding_attention", "full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer 2 is of type 'chunked_attention'"):
        layer_windows(cfg, 3)
    assert layer_windows(types.SimpleNamespace(sliding_window=6), 2) == [6, 6]
    assert layer_windows(types.SimpleNamespace(sliding_window=None), 2) == [None, None]
    assert layer_windows(types.SimpleNamespace(sliding_window=6, use_sliding_window=False), 2) == [None, None]
    cfg = types.SimpleNamespace(sliding_window=None, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="layer 0 is a sliding_attention layer but config.sliding_window=None"):
        layer_windows(cfg, 1)
    model = make_model("mistral")
    with pytest.raises(ValueError, match="more than the model's sliding_window=6; use window <= 5"):
        FlexKVCache(model, SinkWindow(4, 8), sliding_retention=SinkWindow(4, 6))
    cache = FlexKVCache(model, SinkWindow(4, 8), sliding_retention=SinkWindow(2, 5), block_size=16)
    assert [r["retention"] for r in cache.memory_report()] == [SinkWindow(2, 5)]
    with pytest.raises(ValueError, match="layer 0 passes sliding_window=7 to its attention"):
        cache._check_layer(0, 7, None)
