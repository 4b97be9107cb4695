"""Tiny transformers models and the uncached reference the transformers tests compare against (test helper).

Every family is built from its config with random weights (nothing is
downloaded): 2 layers, hidden 32, 4 query heads, float64 unless a family's
kernels need float32, wide init so that attention changes the argmax. The
reference runs the same model without any cache: every step feeds the whole
history of one stream with explicit per-layer masks. A full-attention layer
gets flexkv's sink + window mask (the token at position `p` sees `j <= p`
with `j < sink` or `j >= p - window`); a sliding-window layer gets the
model's own sliding-window mask, built by transformers; a recurrent layer
runs over the whole history exactly as the model runs it.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')"
)

from transformers.generation.stopping_criteria import StoppingCriteria  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

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
    return {k: v for k, v in base.items() if v is not DROP}


DROP = object()  # a `_common` key the family's config must not be given


def _mla(**kw):
    """Multi-head latent attention: keys 16 + 8 (rotary) wide, values 16, latents of 16."""
    return _common(head_dim=DROP, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, **kw)


_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)


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
        # Sliding layers with 2 KV heads of 8, the full layer with 2 KV heads of 16.
        "gemma4": (
            t.Gemma4TextConfig(**_common(sliding_window=SW, layer_types=["sliding_attention", "full_attention"],
                                         global_head_dim=16, vocab_size_per_layer_input=VOCAB,
                                         hidden_size_per_layer_input=8, initializer_range=0.1)),
            t.Gemma4ForCausalLM, torch.float64,
        ),
        # Layers 2 and 3 attend the keys and values of layers 0 and 1 (kv_sharing_modes "reuse").
        "gemma3n": (
            t.Gemma3nTextConfig(**_common(num_hidden_layers=4, sliding_window=SW, num_kv_shared_layers=2,
                                          layer_types=["sliding_attention", "full_attention"] * 2,
                                          vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                                          laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                                          initializer_range=0.1)),
            t.Gemma3nForCausalLM, torch.float64,
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
        # Multi-head latent attention.
        "deepseek_v3": (
            t.DeepseekV3Config(**_mla(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1)),
            t.DeepseekV3ForCausalLM, torch.float64,
        ),
        "deepseek_v2": (
            t.DeepseekV2Config(**_mla(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, first_k_dense_replace=1)),
            t.DeepseekV2ForCausalLM, torch.float64,
        ),
        "glm4_moe_lite": (
            t.Glm4MoeLiteConfig(**_mla(q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=16, mlp_layer_types=["dense", "sparse"])),
            t.Glm4MoeLiteForCausalLM, torch.float64,
        ),
        "minicpm3": (t.MiniCPM3Config(**_mla(q_lora_rank=None)), t.MiniCPM3ForCausalLM, torch.float64),
        # Hybrid recurrent families: layer 0 recurrent, layer 1 attention (Falcon-H1: both in each layer).
        "qwen3_next": (
            t.Qwen3NextConfig(**_common(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                        mlp_only_layers=[0])),
            t.Qwen3NextForCausalLM, torch.float64,
        ),
        "granitemoehybrid": (
            t.GraniteMoeHybridConfig(**_common(layer_types=["mamba", "attention"], num_local_experts=4,
                                               num_experts_per_tok=2, shared_intermediate_size=32, **_MAMBA)),
            t.GraniteMoeHybridForCausalLM, torch.float64,
        ),
        "bamba": (t.BambaConfig(**_common(attn_layer_indices=[1], **_MAMBA)), t.BambaForCausalLM, torch.float64),
        "jamba": (
            t.JambaConfig(**_common(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                    expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8,
                                    mamba_d_conv=4, mamba_expand=2)),
            t.JambaForCausalLM, torch.float64,
        ),
        "falcon_h1": (
            t.FalconH1Config(**_common(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                                       mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8)),
            t.FalconH1ForCausalLM, torch.float64,
        ),
        "lfm2": (t.Lfm2Config(**_common(full_attn_idxs=[1], conv_L_cache=3)), t.Lfm2ForCausalLM, torch.float64),
        "minimax": (
            t.MiniMaxConfig(**_common(layer_types=["linear_attention", "full_attention"], num_local_experts=2,
                                      num_experts_per_tok=1, block_size=8)),
            t.MiniMaxForCausalLM, torch.float64,
        ),
        "kimi_linear": (
            t.KimiLinearConfig(**_mla(q_lora_rank=None, layer_types=["linear_attention", "full_attention"],
                                      linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)),
            t.KimiLinearForCausalLM, torch.float64,
        ),
    }


def _refused_configs():
    """Families flexkv refuses at construction, each for its own reason."""
    t = transformers
    return {
        "llama4": (t.Llama4TextConfig(**_common(attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1,
                                               intermediate_size_mlp=64, no_rope_layers=[1, 1])),
                   t.Llama4ForCausalLM, "layer 0 is of type 'chunked_attention': it attends within fixed chunks"),
        "deepseek_v32": (t.DeepseekV32Config(**_mla(q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                                                    topk_group=1, index_n_heads=2, index_head_dim=8, index_topk=4)),
                         t.DeepseekV32ForCausalLM, "layer 0 is of type 'indexed_attention': a learned indexer picks"),
        "zamba2": (t.Zamba2Config(**_common(head_dim=DROP, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
                                            mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
                                            attention_head_dim=8, num_mem_blocks=1, chunk_size=8)),
                   t.Zamba2ForCausalLM, r"layers \[1\] share one attention module \(Zamba2Attention, layer_idx=-1\) "
                                        r"that is handed the layer index as an argument"),
        "mamba2": (t.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                  state_size=8, expand=2, n_groups=1, chunk_size=8, pad_token_id=0),
                   t.Mamba2ForCausalLM, r"has no attention layer \(layer types \['linear_attention'\]\)"),
    }


#: Families whose recurrent layers run in float32 inside a float64 model (their state and their
#: chunked and per-token forms round differently): logits agree to this, tokens exactly.
FLOAT32_INSIDE = {"qwen3_next": 1e-3, "granitemoehybrid": 1e-3, "bamba": 1e-3, "falcon_h1": 1e-3,
                  "kimi_linear": 1e-3, "jamba": 1e-4, "minimax": 1e-4}


def logit_tolerance(family: str, dtype) -> float:
    if family in FLOAT32_INSIDE:
        return FLOAT32_INSIDE[family]
    return 1e-4 if dtype == torch.float32 else 1e-5


def make_model(family: str, dtype=None, seed: int = 0):
    cfg, cls, default = _configs()[family]
    torch.manual_seed(seed)
    model = cls(cfg).eval().to(dtype or default)
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")  # the grouped-matmul experts take no float64
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
    model's own mask (transformers builds it). Recurrent layers: no mask (no
    padding). A model without `layer_types` whose every layer slides
    (Mistral) gets None: its own masks throughout.
    """
    cfg = model.config
    full = sink_window_mask(L, model.dtype, sink, window)
    types_ = getattr(cfg, "layer_types", None)
    if types_ is None:
        return None if getattr(cfg, "sliding_window", None) else full
    masks = {"full_attention": full, "linear_attention": None, "conv": None}
    if getattr(cfg, "sliding_window", None):
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
        outs = [row_attention(module, query[b:b + 1], key[b:b + 1], value[b:b + 1], scaling)
                for b in range(query.shape[0])]
        return torch.cat(outs, 0), None

    def row_attention(module, query, key, value, scaling):
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
        return out.transpose(0, 1)[None].contiguous()

    return attention


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


class FailOnce:
    """Forward hook that raises `error` in the chosen call of a module (1-based), once."""

    def __init__(self, call: int, error=RuntimeError("injected failure")):
        self.call = call
        self.error = error
        self.seen = 0

    def __call__(self, module, args, output):
        self.seen += 1
        if self.seen == self.call:
            raise self.error


def eager_and_compiled_greedy(model, ids, mask, eager, compiled, steps: int):
    """Greedy decode of `steps` tokens after the prompt, once eagerly over `eager` and once with
    `model.forward` compiled over `compiled` (the prompt itself runs eagerly in both).

    Returns `(want, got, graphs)`: each forward's last-position logits, eager and compiled, and the
    count of graphs compiled since the decode began, after each compiled decode step (1 throughout when
    the first compiled step is the only one that compiles).
    """
    from torch._dynamo.utils import counters

    with torch.no_grad():
        want = [model(input_ids=ids, attention_mask=mask, cache=eager).logits[:, -1]]
        for _ in range(steps):
            want.append(model(input_ids=want[-1].argmax(-1, keepdim=True), cache=eager).logits[:, -1])
        got = [model(input_ids=ids, attention_mask=mask, cache=compiled).logits[:, -1]]
        forward = model.forward
        counters.clear()  # the count below is this compile's alone
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        graphs = []
        try:
            for _ in range(steps):
                got.append(model(input_ids=got[-1].argmax(-1, keepdim=True), cache=compiled).logits[:, -1])
                graphs.append(counters["stats"]["unique_graphs"])
        finally:
            model.forward = forward
    return want, got, graphs

