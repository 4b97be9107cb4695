"""Every decoder-only family transformers ships: FlexKVCache either serves it or refuses it when it is built.

`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` lists every causal LM class transformers
ships. Each family is built tiny from its config (`tests/hf_models.py`'s
config where it has one, else the config class's defaults with the shared
small sizes it declares) with random weights; families whose tiny model
cannot run its own `generate()` here (vision towers, configs that need
sizes we do not guess, encoder-decoders, more than 3M parameters) are
skipped and counted. For the rest, `FlexKVCache(model, ...)` either raises a
`ValueError` and leaves the model untouched, or builds, and then greedy
`generate()` runs and gives the model's own tokens (the prompt and the new
tokens fit inside the sink + window, so nothing is evicted and flexkv must
attend exactly what the model's own cache does).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import hf_models
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from flexkv import SinkWindow
from flexkv.integrations.transformers import FlexKVCache

pytestmark = pytest.mark.families

_SMALL = dict(vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
              num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              pad_token_id=0, bos_token_id=None, eos_token_id=None)
_MAX_PARAMS = 3_000_000
PROMPT, NEW = 5, 3


def _tiny(family: str, class_name: str):
    """A tiny model of `family` whose own greedy `generate()` runs, or None (with why)."""
    cls = getattr(transformers, class_name, None)
    if cls is None:
        return None, "class not importable"
    known = hf_models._configs()
    if family in known:
        cfg = known[family][0]
    else:
        config_cls = CONFIG_MAPPING[family]
        names = {f.name for f in dataclasses.fields(config_cls)} | set(getattr(config_cls, "attribute_map", {}))
        cfg = config_cls(**{k: v for k, v in _SMALL.items() if k in names})
    if getattr(cfg, "is_encoder_decoder", False):
        return None, "encoder-decoder"
    with torch.device("meta"):
        params = sum(p.numel() for p in cls(cfg).parameters())
    if params > _MAX_PARAMS:
        return None, f"{params} parameters"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, None


def test_every_causal_lm_family_is_served_or_refused_when_the_cache_is_built():
    served, refused, skipped, wrong = [], [], {}, []
    transformers.logging.set_verbosity_error()
    ids = torch.randint(1, hf_models.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
            try:
                model, why = _tiny(family, class_name)
                if model is not None:
                    with torch.no_grad():
                        own = model.generate(ids, max_new_tokens=NEW, do_sample=False)
            except Exception as exc:  # the tiny config does not build or run here: not a flexkv matter
                model, why = None, f"{type(exc).__name__}"
            if model is None:
                skipped[family] = why
                continue
            try:
                try:
                    cache = FlexKVCache(model, SinkWindow(4, 64), max_streams=1, prefill_chunk=8)
                except ValueError as exc:
                    if "would be used nowhere" not in str(exc):
                        raise
                    cache = FlexKVCache(model, None, max_streams=1, prefill_chunk=8)  # every layer slides
            except ValueError as exc:
                # Refused with a reason, the model as it was.
                assert len(str(exc)) > 40, (family, str(exc))
                assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks, family
                refused.append(family)
                continue
            try:
                with torch.no_grad():
                    got = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
            except Exception as exc:
                wrong.append(f"{family}: built, then generate() raised {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if not torch.equal(got, own):
                wrong.append(f"{family}: built, generate() gave {got[0, PROMPT:].tolist()}, the model's own "
                             f"{own[0, PROMPT:].tolist()}")
            served.append(family)
    print(f"\n{len(served)} families served, {len(refused)} refused when built, {len(skipped)} skipped here "
          f"(tiny config not constructible): refused {refused}")
    assert not wrong, "\n".join(wrong)
    assert "stablelm" in refused and "nemotron" in refused  # their layers drop the forward's keywords
    assert {"llama", "mistral", "gemma2", "qwen3", "gpt2", "bamba", "minimax"} <= set(served)
    assert len(served) >= 60


def test_a_model_whose_layers_drop_the_plan_is_refused_with_the_reason():
    """StableLM routes attention through transformers' interface but its decoder layer calls the attention
    without the forward's keywords: refused when the cache is built, naming that, the model untouched."""
    cfg = transformers.StableLmConfig(**{k: v for k, v in _SMALL.items() if k != "head_dim"})
    model = transformers.StableLmForCausalLM(cfg).eval()
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"StableLmForCausalLM routes attention through transformers' attention "
                                         r"interface, but its layers do not hand the forward's keyword arguments "
                                         r"down to it \(.*_supports_attention_backend=False\).*StableLmAttention, "
                                         r"layer 0"):
        FlexKVCache(model, SinkWindow(4, 8))
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks
    assert model.config._attn_implementation == impl


def test_a_model_that_attends_twice_per_layer_is_refused():
    """DiffLlama attends two value sets over the same keys in each layer; flexkv would write its cell twice."""
    cfg = transformers.DiffLlamaConfig(**_SMALL)
    model = transformers.DiffLlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"DiffLlamaForCausalLM's layers \[0, 1\] call their attention more than "
                                         r"once per forward \(layer 0: 2 calls"):
        FlexKVCache(model, SinkWindow(4, 8))
    assert getattr(model, "_flexkv_state", None) is None and not model._forward_pre_hooks
