"""flexkv's retention in vLLM's FlexAttention metadata (the CUDA path), run on CPU tensors: a paged cache with
freed (null) blocks, a decoding request and a chunked prefill, against the CPU backend's attention, in both
position modes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadata, physical_to_logical_mapping  # noqa: E402

from flexkv.integrations.vllm.backend import sink_window_attention  # noqa: E402
from flexkv.integrations.vllm.flex_backend import FlexKVFlexAttentionBuilder, cache_position_score_mod, sink_scores  # noqa: E402
from flexkv.integrations.vllm.retention_mask import apply_retention  # noqa: E402
from flexkv.integrations.vllm.spec import SinkWindowSpec  # noqa: E402

BS, H, G, D, SINK, WINDOW, BLOCKS = 16, 2, 2, 8, 4, 20, 12


@pytest.fixture
def paged():
    """Request 0 decodes its token 99: blocks 1-3 (entries 16-63) lie wholly between its sinks and its
    window and were given back (null block 0 in their place, filled with garbage that must not be read).
    Request 1 prefills entries 40-47 in one chunk and holds every block."""
    g = torch.Generator().manual_seed(0)
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0, :7] = torch.tensor([5, 0, 0, 0, 2, 9, 7])
    table[1, :3] = torch.tensor([3, 11, 6])
    k = torch.randn(BLOCKS, H, BS, D, generator=g)
    v = torch.randn(BLOCKS, H, BS, D, generator=g)
    k[0], v[0] = 1e4, 1e4  # the null block
    seq_lens = torch.tensor([100, 48], dtype=torch.int32)
    query_start = torch.tensor([0, 1, 9], dtype=torch.int32)
    q = torch.randn(9, H * G, D, generator=g)
    return table, k, v, seq_lens, query_start, q


def metadata(table, seq_lens, query_start, sliding_window=None):
    n = int(query_start[-1])
    query_lens = query_start[1:] - query_start[:-1]
    return FlexAttentionMetadata(
        causal=True, num_actual_tokens=n, max_query_len=int(query_lens.max()), query_start_loc=query_start.long(),
        query_start_loc_cpu=query_start.long(), max_seq_len=int(seq_lens.max()), seq_lens=seq_lens.long(),
        block_table=table, slot_mapping=torch.zeros(n, dtype=torch.long), total_cache_tokens=BLOCKS * BS,
        block_size=BS, max_possible_sequence_length=table.shape[1] * BS, num_reqs=2,
        physical_to_logical=physical_to_logical_mapping(table, seq_lens, BS, BLOCKS),
        decode_offset=(seq_lens - query_lens).long(), num_blocks_per_seq=(seq_lens + BS - 1) // BS,
        persistent_kv_indices=torch.full((n, BLOCKS + 1), -1, dtype=torch.int32),
        persistent_kv_num_blocks=torch.zeros(n, dtype=torch.int32),
        persistent_doc_ids=torch.zeros(n, dtype=torch.long), q_block_size=1, kv_block_size=BS,
        sliding_window=sliding_window)


def attends_as_the_cpu_backend(paged, md) -> None:
    """FlexAttention over `md`'s block mask (the paged cache flattened as vLLM's FlexAttention backend reads it)
    gives what the CPU backend's attention gives."""
    table, k, v, seq_lens, query_start, q = paged
    flat_k = k.permute(0, 2, 1, 3).reshape(1, BLOCKS * BS, H, D).transpose(1, 2)
    flat_v = v.permute(0, 2, 1, 3).reshape(1, BLOCKS * BS, H, D).transpose(1, 2)
    got = flex_attention(q.transpose(0, 1)[None], flat_k, flat_v, block_mask=md.block_mask, scale=D ** -0.5,
                         enable_gqa=True)[0].transpose(0, 1)
    want = torch.empty_like(q)
    sink_window_attention(q, k, v, table, query_start, seq_lens, SINK, WINDOW, D ** -0.5, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vllm_window", [None, WINDOW + 1])
def test_flex_attention_over_the_block_table_attends_what_the_cpu_backend_attends(paged, vllm_window):
    """`vllm_window`: the metadata as vLLM's builder makes it, without a window, and with the spec's
    `sliding_window` (what it passes when it captures full CUDA graphs, its default on CUDA)."""
    table, k, v, seq_lens, query_start, q = paged
    md = apply_retention(metadata(table, seq_lens, query_start, vllm_window), SINK, WINDOW)
    attends_as_the_cpu_backend(paged, md)


def test_the_block_mask_never_lists_a_freed_block(paged):
    table, _, _, seq_lens, query_start, _ = paged
    md = apply_retention(metadata(table, seq_lens, query_start), SINK, WINDOW)
    n = int(md.block_mask.kv_num_blocks[0, 0, 0])
    listed = set(md.block_mask.kv_indices[0, 0, 0, :n].tolist())  # request 0's decoding query
    assert listed == {5, 2, 9, 7}  # its sink block and the blocks its window reaches, not the null block 0


def rotary_table(positions: int, dim: int) -> torch.Tensor:
    """A rotary table as vLLM keeps one: `[positions, dim]`, the cosines then the sines of position x frequency."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), -1).float()


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_in_cache_positions_score_the_sinks_as_the_cpu_backend_turns_them(paged, neox, compiled):
    """`positions="cache"` on the FlexAttention path: every query reads its sink keys `e` positions closer than
    their stream index (request 0's decoding query has evicted 75 entries, request 1's prefill chunk 16 to 23,
    one count per query), through the score_mod over the paged block mask; the CPU backend turns the sink keys
    themselves. Equal, eager and traced by torch.compile as vLLM calls FlexAttention (backend "aot_eager":
    inductor's CPU FlexAttention template refuses the block mask of vLLM's direct build, whose KV size is the
    pool's, and on CUDA the kernel is Triton's)."""
    table, k, v, seq_lens, query_start, q = paged
    md = apply_retention(metadata(table, seq_lens, query_start), SINK, WINDOW)
    cos_sin = rotary_table(128, D)
    flat_k = k.permute(0, 2, 1, 3).reshape(1, BLOCKS * BS, H, D).transpose(1, 2)
    flat_v = v.permute(0, 2, 1, 3).reshape(1, BLOCKS * BS, H, D).transpose(1, 2)
    scores = sink_scores(q, flat_k[0].transpose(0, 1), md, SINK, WINDOW, D ** -0.5, cos_sin, neox)
    assert scores.shape == (9, H * G, SINK)
    attend = torch.compile(flex_attention, fullgraph=True, backend="aot_eager") if compiled else flex_attention
    got = attend(q.transpose(0, 1)[None], flat_k, flat_v, cache_position_score_mod(md, scores, SINK),
                 block_mask=md.block_mask, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    want = torch.empty_like(q)
    sink_window_attention(q, k, v, table, query_start, seq_lens, SINK, WINDOW, D ** -0.5, want,
                          rotary=(cos_sin, neox))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stream = torch.empty_like(q)
    sink_window_attention(q, k, v, table, query_start, seq_lens, SINK, WINDOW, D ** -0.5, stream)
    assert (stream - want).abs().max() > 1e-2  # the two modes differ here: the check can fail


def builder():
    """flexkv's FlexAttention metadata builder for a sink + window layer, over a configuration that says only what
    vLLM's builder reads (the paged fixture's shapes; no CUDA graphs)."""
    from types import SimpleNamespace

    model = SimpleNamespace(max_model_len=8 * BS, rswa_window=None, get_num_attention_heads=lambda _: H * G,
                            get_num_kv_heads=lambda _: H, get_head_size=lambda: D)
    config = SimpleNamespace(
        model_config=model, parallel_config=None, cache_config=SimpleNamespace(num_gpu_blocks=BLOCKS),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        attention_config=SimpleNamespace(flex_attn_q_block_size=None, flex_attn_kv_block_size=None,
                                         flex_attn_block_m=None, flex_attn_block_n=None),
        compilation_config=SimpleNamespace(cudagraph_mode=None))
    spec = SinkWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32,
                          sliding_window=WINDOW + 1, sink=SINK)
    return FlexKVFlexAttentionBuilder(spec, ["layer"], config, torch.device("cpu"))


def test_the_builder_makes_the_retentions_block_mask_once(paged, monkeypatch):
    """vLLM's build makes its block mask before anyone reads the metadata (for CUDA graph capture); flexkv's
    builder has the retention on the metadata by then, so that one block mask is the retention's: one build
    per step, not vLLM's causal one and then the retention's. Its attention is the CPU backend's."""
    table, k, v, seq_lens, query_start, q = paged
    built = []
    own = FlexAttentionMetadata._build_block_mask_direct

    def counted(self):
        built.append(self.logical_mask_mod)
        return own(self)

    monkeypatch.setattr(FlexAttentionMetadata, "_build_block_mask_direct", counted)
    n = int(query_start[-1])
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens, num_reqs=2,
        num_actual_tokens=n, max_query_len=8, max_seq_len=int(seq_lens.max()), block_table_tensor=table,
        slot_mapping=torch.zeros(n, dtype=torch.long))
    md = builder().build(0, common)
    assert len(built) == 1 and md.flexkv_retention == (SINK, WINDOW) and md.sliding_window is None
    attends_as_the_cpu_backend(paged, md)
    # Outside flexkv's builder, vLLM's metadata is made as vLLM makes it.
    plain = metadata(table, seq_lens, query_start)
    assert "flexkv_retention" not in plain.__dict__ and plain.logical_mask_mod is not md.logical_mask_mod


@pytest.mark.parametrize("positions", [None, "stream"])
def test_the_flexattention_layer_finds_its_rotary_table_once_the_model_is_loaded(tmp_path, monkeypatch, positions):
    """A full-attention layer of an engine with the `flexkv` entry serves in-cache positions by default on the
    FlexAttention backend too, and finds the model's rotary table (covering `max_model_len`) when vLLM calls
    `process_weights_after_loading`, before any CUDA graph capture could run its forward; with stream positions
    it needs none."""
    import transformers
    import vllm.model_executor.layers.rotary_embedding as rotary
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from flexkv.integrations.vllm.flex_backend import FlexKVFlexAttentionImpl

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    entry = {"sink": SINK, "window": WINDOW} | ({"positions": positions} if positions else {})
    config = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                        enforce_eager=True, additional_config={"flexkv": entry}).create_engine_config()
    monkeypatch.setattr(rotary, "_ROPE_DICT", {})  # this model's rope alone, not those of engines built before
    with set_current_vllm_config(config):
        impl = FlexKVFlexAttentionImpl(2, 32, 32 ** -0.5, 1, None, None, "auto")
        rotary.get_rope(32, max_position=512, is_neox_style=True, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0})
        assert impl.positions == (positions or "cache") and impl._rotary is None
        impl.process_weights_after_loading(torch.float32)
    if positions == "stream":
        assert impl._rotary is None
    else:
        table, neox = impl._rotary
        assert table.shape == (512, 32) and neox


def test_the_paged_module_plans_the_blocks_vllms_direct_build_lists(paged):
    """`flexkv.integrations.vllm.paged` (what the GPU check runs with torch alone) and vLLM's own metadata with
    the retention: the same physical-to-logical map, and per query block the same set of KV blocks."""
    from flexkv.integrations.vllm.paged import PagedBatch, physical_to_logical, retention_block_mask

    table, _, _, seq_lens, query_start, _ = paged
    md = apply_retention(metadata(table, seq_lens, query_start), SINK, WINDOW)
    batch = PagedBatch(table, seq_lens.long(), query_start.long(), md.doc_ids.long(), BS, BLOCKS)
    assert torch.equal(physical_to_logical(batch), md.physical_to_logical)
    ours = retention_block_mask(batch, SINK, WINDOW, q_block=1)  # the fixture's metadata has query blocks of 1
    for g in range(md.block_mask.kv_num_blocks.shape[-1]):
        n, m = int(md.block_mask.kv_num_blocks[0, 0, g]), int(ours.kv_num_blocks[0, 0, g])
        assert set(md.block_mask.kv_indices[0, 0, g, :n].tolist()) == set(ours.kv_indices[0, 0, g, :m].tolist()), g
