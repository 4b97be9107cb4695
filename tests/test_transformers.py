"""flexkv inside transformers: generate() against the uncached model under the masks each layer should see.

Every family of `hf_models` runs greedy `generate()` through a `FlexKVCache`
on a left-padded batch for 4x the window, and must give, row by row, the
tokens the same model gives without any cache over the whole history under
the masks each layer should see (`hf_models.reference_greedy`), and logits
to the precision the model computes them in. Recurrent layers (linear
attention, Mamba, short convolutions) are run over the whole history by
the reference; flexkv keeps their state per stream.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import hf_models
from hf_models import (
    CHUNK,
    LENGTHS,
    NEW,
    SINK,
    SW,
    WINDOW,
    RecordBytes,
    held_bytes,
    layer_masks,
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
from transformers.generation.stopping_criteria import StoppingCriteriaList

import flexkv.integrations.transformers as fkt
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, SlotsExhausted, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.model_config import HYBRID_TYPES, LayerSpec, layer_windows


def own_cache(model):
    """The cache the model would build for itself (MiniMax insists on its own class)."""
    own = getattr(sys.modules[type(model).__module__], "MiniMaxCache", None)
    return own() if own is not None else DynamicCache(config=model.config)


# ------------------------------------------------------------------ generate

FAMILIES = (
    # attention only
    "mistral", "gemma2", "gemma3", "gemma3n", "gemma4", "gpt_oss", "qwen3", "smollm3",
    # multi-head latent attention (keys wider than values)
    "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3",
    # attention and recurrent layers
    "qwen3_next", "granitemoehybrid", "bamba", "jamba", "falcon_h1", "lfm2", "minimax", "kimi_linear",
)
#: Families whose every attention layer slides (no full-attention layer for a retention).
ALL_SLIDING = ("mistral",)
#: (KV heads, key width, value width) of each attention layer type where they are not the config's 2 x 8.
HEAD_SIZES = {
    "gemma4": {"sliding_attention": (2, 8, 8), "full_attention": (2, 16, 16)},
    **{f: {"full_attention": (4, 24, 16)} for f in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3",
                                                    "kimi_linear")},
}


@pytest.fixture(scope="module", params=FAMILIES)
def generated(request):
    family = request.param
    model = make_model(family)
    ps = prompts(LENGTHS)
    ids, mask = left_pad(ps)
    with torch.no_grad():
        plain_before = model(input_ids=ids, attention_mask=mask).logits
    # Mistral's every layer slides: it keeps the model's own window and takes no retention.
    retention = None if family in ALL_SLIDING else SinkWindow(SINK, WINDOW)
    # The reference is the model under per-layer masks at stream positions (in-cache ones: test_transformers_streams).
    cache = FlexKVCache(model, retention, max_streams=4, prefill_chunk=CHUNK, block_size=16, rope_positions="stream")
    rec = RecordBytes(cache)
    out = model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([rec]),
    )
    dyn = own_cache(model)
    rec_dyn = RecordBytes(dyn)
    full = model.generate(
        ids, attention_mask=mask, cache=dyn, max_new_tokens=NEW, do_sample=False,
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
    tol = logit_tolerance(g.family, g.model.dtype)
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
    windows = [w for w, s in zip(g.cache.layer_windows, g.cache.layer_specs) if s.attends]
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
    types_ = getattr(cfg, "layer_types", None) or (
        ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * 2)
    report = g.cache.memory_report()
    size = torch.empty((), dtype=g.model.dtype).element_size()
    seen, recurrent = [], []
    for group in report:
        if group["kind"] == "recurrent":
            recurrent.extend(group["layers"])
            assert all(types_[i] == group["name"] for i in group["layers"])
            continue
        for layer in group["layers"] + group["shared_by"]:
            assert group["name"] == HYBRID_TYPES.get(types_[layer], types_[layer])
            seen.append(layer)
        if group["name"] == "sliding_attention":
            assert group["retention"] == SinkWindow(0, SW - 1)  # the model's window, no sinks
        else:
            assert group["retention"] == SinkWindow(SINK, WINDOW)
        heads, dim, vdim = HEAD_SIZES.get(g.family, {}).get(group["name"], (2, 8, 8))
        assert (group["num_heads"], group["head_dim"], group["value_head_dim"]) == (heads, dim, vdim)
        keep = group["retention"]
        assert group["slot_cells"] == keep.sink + keep.window + CHUNK
        assert group["slot_bytes"] == len(group["layers"]) * heads * (dim + vdim) * size * group["slot_cells"]
    attention = [i for i, t in enumerate(types_) if t not in ("linear_attention", "conv")]
    assert sorted(seen) == attention
    assert sorted(recurrent) == [i for i, t in enumerate(types_) if t in ("linear_attention", "conv", "hybrid")]
    if g.family == "gemma3n":  # layers 2 and 3 attend layers 0 and 1's slots and hold none of their own
        assert [(r["layers"], r["shared_by"]) for r in report] == [((1,), (3,)), ((0,), (2,))]
    assert g.cache.stream_bytes == sum(r["slot_bytes"] for r in report)
    assert g.cache.memory_bytes == sum(r["memory_bytes"] for r in report)
    assert all(f"{r['name']} layers {list(r['layers'])}:" in repr(g.cache) for r in report)


def test_cache_memory_is_flat_while_dynamic_cache_grows(generated):
    g = generated
    # One stream on its own (the longest prompt), for the per-stream figure.
    one = own_cache(g.model)
    g.model.generate(g.prompts[-1][None], cache=one, max_new_tokens=NEW, do_sample=False)
    alone = held_bytes(one)
    print(f"\n[{g.family}] after {len(g.prompts[-1])} + {NEW} tokens ({NEW // WINDOW}x the window): one flexkv "
          f"stream {g.cache.stream_bytes} B, the model's own cache for one stream {alone} B; flexkv cache in all "
          f"{g.flex_bytes[-1]} B ({g.cache.manager.config.max_slots} slots), the model's own "
          f"{g.dyn_bytes[-1]} B ({len(g.prompts)} padded rows)")
    assert len(g.flex_bytes) == len(g.dyn_bytes) == NEW
    # Flat from the first decoded token on; after the prefill the manager also still holds the
    # prefill's last plans (tables of a few dozen ints) and, per layer group, the rows path's index
    # memos for the prefill's shape (`LayerStore.memos`, a few hundred ints), nothing more.
    assert len(set(g.flex_bytes[1:])) == 1
    assert abs(g.flex_bytes[0] - g.flex_bytes[1]) < 4096
    assert g.flex_bytes[1] >= g.cache.memory_bytes
    if any(w is None for w, s in zip(g.cache.layer_windows, g.cache.layer_specs) if s.attends):
        if g.family not in HEAD_SIZES or g.family == "gemma4":
            # (Latent attention is the exception: the model caches 24 latent numbers per token and
            # layer where flexkv keeps 4 heads of 24 + 16; docs/transformers.md has the figures.)
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
    m = BoundedKVManager(cfg, block_size=16,
                         options=AttentionOptions.for_cache(cfg, "cpu", pack_gqa=pack_gqa, path=path))
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
    # The same cache content on eager FlexAttention, which returns its log-sum-exp.
    flex = BoundedKVManager(cfg, block_size=16, options=AttentionOptions.for_cache(cfg, "cpu", path="flex"))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    compiled = torch.compile(lambda q, k, v, plan: m.attend(0, q, k, v, plan, sinks=sinks), fullgraph=True)
    torch.manual_seed(1)
    written = 0
    for T in (3, 1, 1):
        step = BoundedKVStep((Segment("a", T), Segment(None, 0)), {"a": StreamPosition(0, written)}, tokens=T)
        m.admit(step)
        flex.admit(step)
        plan = m.plan(step)
        q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)
        got = compiled(q, k, v, plan)
        want = flex.attend(0, q, k, v, flex.plan(step), sinks=sinks)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        m.commit(step)
        flex.commit(step)
        written += T
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
        m.attend(0, q, k, v, plan, sinks=torch.zeros(2))


def test_a_compiled_float64_decode_on_the_cpu_takes_the_rows_path():
    """torch's compiled CPU FlexAttention lowers float32/16/bf16 only ("torch.float, torch.float16 and
    torch.bfloat16 are supported in FlexAttention for CPU device"): a float64 cache (the transformers tests'
    dtype) decodes compiled on the rows path, equal to eager attention."""
    cfg = BoundedKVConfig(num_layers=1, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(2, 6), max_slots=2, dtype=torch.float64,
                          max_step_tokens=3)
    m = BoundedKVManager(cfg, block_size=16)
    assert m.path_for(1, compiled=True) == "rows"
    compiled = torch.compile(lambda q, k, v, plan: m.attend(0, q, k, v, plan), fullgraph=True, dynamic=False)
    torch.manual_seed(2)
    written = 0
    for T in (3, 1, 1, 1, 1, 1, 1):  # past the window: evicting
        step = BoundedKVStep((Segment("a", T), Segment(None, 0)), {"a": StreamPosition(0, written)}, tokens=T)
        m.admit(step)
        plan = m.plan(step)
        q, k, v = (torch.randn(2, n, T, 8, dtype=torch.float64) for n in (4, 2, 2))
        got = compiled(q, k, v, plan) if T == 1 else m.attend(0, q, k, v, plan)
        want = m.attend(0, q, k, v, plan)  # eager, rewrites the same cells
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        m.commit(step)
        written += T


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
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False)
        assert model.config._attn_implementation == impl
        with torch.no_grad():
            after = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True, msg=family)
        assert torch.equal(plain, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    fkt.disable(model)
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="did not plan"):  # no hooks: the cache refuses to be misused
        model(input_ids=ids, cache=cache)
    with pytest.raises(ValueError, match="ran in a forward no FlexKVCache planned"):
        model.set_attn_implementation("flexkv")
        model(input_ids=ids)


# ------------------------------------------------------------------- errors


def test_unsupported_transformers_release_fails_with_one_message(monkeypatch):
    # transformers swaps its module object in sys.modules on first attribute access: patch the live one.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"needs transformers>=5\.23,<5\.26.*found transformers 4\.57\.1"):
        fkt.registration.import_transformers()


@pytest.mark.parametrize("args, kw, match", [
    (((4, 8),), {}, "retention must be a flexkv.SinkWindow"),
    ((SinkWindow(2, 8, window_includes_step=True),), {}, "window_includes_step=True"),
    ((SinkWindow(2, 8),), dict(sliding_retention=8), "sliding_retention must be a flexkv.SinkWindow"),
    ((SinkWindow(2, 8),), dict(rope_positions="absolute"), "rope_positions must be one of"),
    ((SinkWindow(2, 8),), dict(prefill_chunk=0), "prefill_chunk must be an int >= 1"),
], ids=["retention", "includes-step", "sliding", "rope-positions", "prefill-chunk"])
def test_bad_arguments_are_named_and_leave_the_model_untouched(args, kw, match):
    model = make_model("llama", seed=11)
    with pytest.raises(ValueError, match=match):
        FlexKVCache(model, *args, **kw)
    assert getattr(model, "_flexkv_state", None) is None


def test_more_rows_than_free_slots_admits_nothing():
    model = make_model("llama", seed=11)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    with pytest.raises(SlotsExhausted, match=r"starts 3 new stream\(s\) but the cache holds max_streams=2 and 0 are "
                                            r"taken; cache.finish\(\) streams that ended"):
        model(input_ids=torch.ones(3, 4, dtype=torch.long), cache=cache)
    assert cache.streams == () and cache.selection is None


def test_finishing_an_unknown_stream_names_the_streams_held():
    model = make_model("llama", seed=11)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    model(input_ids=torch.ones(1, 4, dtype=torch.long), cache=cache.select(["a"]))
    with pytest.raises(ValueError, match=r"finish\(\): no stream 'b'; the cache holds \['a'\]"):
        cache.finish("b")
    assert cache.streams == ("a",)


@pytest.mark.parametrize("max_streams", [0, -1, "2", True])
def test_max_streams_must_be_a_positive_int(max_streams):
    model = make_model("llama", seed=11)
    with pytest.raises(ValueError, match=r"max_streams must be an int >= 1"):
        FlexKVCache(model, SinkWindow(2, 8), max_streams=max_streams)


def test_a_cache_recovers_through_the_hooks_installed_now():
    """disable(model) then enable(model) installs new hooks; a cache built before still plans through them."""
    from flexkv.integrations.transformers import disable, enable

    model = make_model("llama", seed=11)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    ids = torch.ones(1, 4, dtype=torch.long)
    disable(model)
    with pytest.raises(ValueError, match=r"hooks were removed \(disable\(model\)\); call .*enable\(model\)"):
        cache.prepare(ids)
    enable(model)
    with torch.no_grad():
        model(input_ids=ids, cache=cache.select(["a"]))
    assert cache.stream_length("a") == 4
    assert all(c._attn_implementation_internal != "flexkv" for c in model._flexkv_state.configs)


@pytest.mark.parametrize("call, match", [
    (lambda model, cache, ids: model(input_ids=ids, cache=cache.select(["x", "y"])),
     "3 batch rows but the cache's selection names 2"),
    (lambda model, cache, ids: model(input_ids=ids[:2], attention_mask=torch.ones(2, 1, 4, 4),
                                     cache=cache.select(["x", "y"])), "2-D padding attention_mask"),
    (lambda model, cache, ids: cache.select(["x", "x"]), "stream ids must be distinct"),
], ids=["rows", "mask", "ids"])
def test_forwards_the_cache_cannot_plan_are_refused(call, match):
    model = make_model("llama", seed=11)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    with pytest.raises(ValueError, match=match):
        call(model, cache, torch.ones(3, 4, dtype=torch.long))


def test_a_cache_handed_to_an_inner_forward_it_did_not_plan_is_refused():
    model = make_model("llama", seed=11)
    with pytest.raises(RuntimeError, match="did not plan"):
        model.model.forward(input_ids=torch.ones(2, 4, dtype=torch.long),
                            cache=FlexKVCache(model, SinkWindow(2, 8), block_size=16))


def test_cache_positions_need_a_rotary_model():
    with pytest.raises(ValueError, match=r"rope_positions=.cache. needs the model's rotary embedding"):
        FlexKVCache(make_model("gpt2"), SinkWindow(2, 4), rope_positions="cache")


@pytest.mark.parametrize("family", sorted(hf_models._refused_configs()))
def test_families_flexkv_cannot_serve_are_refused_at_construction_with_the_reason(family):
    cfg, cls, reason = hf_models._refused_configs()[family]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with pytest.raises(ValueError, match=reason):
        FlexKVCache(model, SinkWindow(SINK, WINDOW))
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks  # untouched


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
        FlexKVCache(model, None, sliding_retention=SinkWindow(4, 6))
    cache = FlexKVCache(model, None, sliding_retention=SinkWindow(2, 5), block_size=16)
    assert [r["retention"] for r in cache.memory_report()] == [SinkWindow(2, 5)]
    with pytest.raises(ValueError, match="layer 0 passes sliding_window=7 to its attention"):
        cache.check_layer(0, 7, None)


def test_a_layer_spec_names_its_value_width_value_head_dim():
    """DeepSeek-V3's keys are 24 wide and its values 16 (tests/hf_models.py): the spec says so as
    `value_head_dim`, the name of `BoundedKVConfig` (the old `v_head_dim` is gone)."""
    cache = FlexKVCache(make_model("deepseek_v3"), SinkWindow(SINK, WINDOW), block_size=16)
    spec = next(s for s in cache.layer_specs if s.attends)
    assert (spec.kv_heads, spec.head_dim, spec.value_head_dim) == (4, 24, 16)
    assert not hasattr(spec, "v_head_dim")
    with pytest.raises(TypeError, match="v_head_dim"):
        LayerSpec(0, "full_attention", True, False, None, 4, 24, v_head_dim=16, kv_source=0)
    assert dataclasses.replace(spec, value_head_dim=8).value_head_dim == 8


@pytest.mark.parametrize("family, args, kw, match", [
    ("mistral", (SinkWindow(4, 8),), {},
     r"every attention layer of MistralForCausalLM slides \(sliding_window=6\), so retention=SinkWindow\(sink=4, "
     r"window=8.*\) would be used nowhere: pass retention=None .* or .* sliding_retention=SinkWindow\(sink, window\), "
     r"window <= 5"),
    ("mistral", (SinkWindow(4, 8),), dict(sliding_retention=SinkWindow(2, 5)), r"so retention=.* would be used nowhere"),
    ("llama", (None,), {}, r"retention=None, but LlamaForCausalLM's layers \[0, 1\] are full-attention layers"),
    ("llama", (SinkWindow(4, 8),), dict(sliding_retention=SinkWindow(2, 5)),
     r"LlamaForCausalLM has no sliding-window layer, so sliding_retention=SinkWindow\(sink=2, window=5.*\) would be "
     r"used nowhere"),
], ids=["all-sliding", "all-sliding-with-sliding-retention", "none-with-full-layers", "sliding-retention-unused"])
def test_a_retention_no_layer_would_keep_is_refused(family, args, kw, match):
    model = make_model(family, seed=11)
    with pytest.raises(ValueError, match=match):
        FlexKVCache(model, *args, **kw)
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks
