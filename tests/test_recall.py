"""`Recall`: sinks, a window and a fixed memory of what left the window, its top-k blocks attended per step.

Checked against a hand-worked step, against the dense float64 reference (which selects blocks by the
rule written in `Recall`'s docstring, from whole streams, sharing no code with the cache) over random
workloads that fill, wrap and reset memories (eager, compiled with no recompiles, quantized,
in-cache rotary positions), for its footprint, and for the calls it refuses.
"""

from __future__ import annotations

import pytest
import torch
from random_workload import RandomWorkload, score_bias

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Recall, Rotary, Segment, SinkWindow, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions

#: 2 sinks, a window of 6, a memory of 4 blocks of 2, 2 of them attended
RECALL = Recall(2, 6, 8, block=2, top_k=2)


# ------------------------------------------------------------------ the retention itself


def test_recall_is_a_sink_window_with_a_memory():
    r = Recall(4, 252, 2048)
    assert (r.sink, r.window, r.memory, r.block, r.top_k) == (4, 252, 2048, 64, 4)
    assert isinstance(r, SinkWindow) and not r.window_includes_step and r.window_part == SinkWindow(4, 252)
    assert r != SinkWindow(4, 252) and r._replace(top_k=2) == Recall(4, 252, 2048, 64, 2)
    assert r.memory_blocks == 32 and "memory=2048" in repr(r)


@pytest.mark.parametrize("args, names", [
    ((4, 16, 100, 64), "memory must be a whole number of blocks"),
    ((4, 16, 32, 64), "Recall.memory must be >= 64"),
    ((4, 16, 128, 64, 3), "top_k must be at most memory // block = 2"),
    ((4, 16, 128, 64, 0), "Recall.top_k must be >= 1"),
    ((-1, 16, 128), "Recall.sink must be >= 0"),
    ((4, 16, 128, 0), "Recall.block must be >= 1"),
])
def test_bad_recall_values_are_refused_by_name(args, names):
    with pytest.raises(ValueError, match=names):
        Recall(*args)


def test_the_memory_is_part_of_every_slot_and_known_at_admission():
    plain = BoundedKVManager(small_config(retention=SinkWindow(2, 6)), "cpu")
    recall = BoundedKVManager(small_config(retention=RECALL), "cpu")
    c = recall.config
    # The memory's 4 whole blocks of 2, and the 1 entry of the block leaving the window.
    assert c.recall == RECALL and c.memory_capacity == 8 + 1 and c.ring_cells == 6 + 9 + 3
    cell = 2 * 2 * 8 * 4  # keys and values, 2 heads of 8 float32 per cell
    means = (18 // 2 + 1) * 2 * 8 * 4  # a float32 mean key per block the ring of 18 can hold, per head
    assert recall.slot_bytes - plain.slot_bytes == c.num_layers * (9 * cell + means)
    group = recall.cache_groups[0]  # the means of every slot row and of the row padding writes into
    assert recall.memory_bytes == group.store.memory_bytes + c.num_layers * (c.max_slots + 1) * means


def test_configs_recall_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="max_source_len=0"):
        small_config(retention=RECALL, max_source_len=4, max_sources=1)
    with pytest.raises(ValueError, match="not a callable"):
        small_config(retention=lambda n: RECALL if n else SinkWindow(2, 6), max_source_len=1, max_sources=1)
    with pytest.raises(ValueError, match="stream order"):
        small_config(retention=RECALL, reverse_step_order=True)


# ------------------------------------------------------------------ a hand-worked step


def _feed(manager, rid, keys, values):
    """Write `keys`/`values` `[1, H, n, D]` into request `rid`, one token per step, every layer alike."""
    n = keys.shape[2]
    for i in range(n):
        step = BoundedKVStep((Segment(rid, 1),), {rid: StreamPosition(0, i)}, tokens=1)
        manager.admit(step)
        plan = manager.plan(step)
        for layer in range(manager.config.num_layers):
            q = torch.zeros(1, 1, 1, keys.shape[3], dtype=torch.float64)
            manager.attend(layer, q, keys[:, :, i:i + 1], values[:, :, i:i + 1], plan)
        manager.commit(step)


def test_a_decode_query_attends_its_sinks_window_and_the_blocks_whose_mean_key_scores_highest():
    """One head of width 2, sink 1, window 2, a memory of 3 blocks of 2, top 1. After 9 entries the
    query (the 10th token, stream index 9) reads sinks [0], window [7, 8], itself, and from memory
    [1, 7) the block whose mean key scores highest: blocks {1,2}, {3,4}, {5,6} have mean keys
    (0, 1), (2, 0), (0, -1); the query (1, 0) picks {3,4}. Values are one-hot per entry, so the output
    is the softmax weight of each attended entry, worked out here by hand."""
    cfg = small_config(num_layers=1, num_heads=1, head_dim=2, retention=Recall(1, 2, 6, block=2, top_k=1),
                       max_slots=1, max_step_tokens=1, dtype=torch.float64)
    manager = BoundedKVManager(cfg, "cpu")
    keys = torch.tensor([[0, 0], [0, 1], [0, 1], [2, 1], [2, -1], [0, -1], [0, -1], [1, 1], [1, -1]],
                        dtype=torch.float64).view(1, 1, 9, 2)
    values = torch.zeros(1, 1, 9, 2, dtype=torch.float64)
    # Value width 2 carries (entry index, 1): the output's second number is 1, the first the mean index.
    values[..., 0] = torch.arange(9, dtype=torch.float64)
    values[..., 1] = 1.0
    _feed(manager, "a", keys, values)
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 9)}, tokens=1)
    manager.admit(step)
    plan = manager.plan(step)
    q = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    k_new = torch.tensor([3.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    v_new = torch.tensor([9.0, 1.0], dtype=torch.float64).view(1, 1, 1, 2)
    out = manager.attend(0, q, k_new, v_new, plan, scale=1.0)
    attended = {0: 0.0, 3: 2.0, 4: 2.0, 7: 1.0, 8: 1.0, 9: 3.0}  # entry -> q . k
    weights = {j: torch.exp(torch.tensor(s, dtype=torch.float64)) for j, s in attended.items()}
    total = sum(weights.values())
    want = sum(w * j for j, w in weights.items()) / total
    assert out[0, 0, 0, 1].item() == pytest.approx(1.0)
    assert out[0, 0, 0, 0].item() == pytest.approx(want.item(), rel=1e-12)
    # The same stream under SinkWindow(1, 2) alone reads no memory: a different answer.
    no_memory = {j: w for j, w in weights.items() if j in (0, 7, 8, 9)}
    assert abs(want - sum(w * j for j, w in no_memory.items()) / sum(no_memory.values())) > 0.3


# ------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("query_window, causal_step, tokens", [
    (None, False, 1), (None, False, 3), (None, True, 3), (6, False, 1), (6, False, 3),
])
def test_random_workloads_equal_the_reference(query_window, causal_step, tokens):
    """Requests join, reset and leave, spans vary (look-ahead and read-only steps), memories fill and
    their oldest blocks leave; every output equals the reference's, GQA of 2 query heads per KV head."""
    cfg = small_config(retention=RECALL, query_window=query_window, causal_step=causal_step,
                       max_step_tokens=tokens, dtype=torch.float64)
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=tokens, tolerance=1e-9, churn=0.1)
    for _ in range(60):
        work.step()
    longest = max(s[2] for s in work.state.values())
    assert longest > 2 + 6 + 8 + 3  # some stream's memory filled and moved on


def test_score_mod_learned_sinks_and_in_cache_score_positions_equal_the_reference():
    cfg = small_config(retention=RECALL, query_window=6, dtype=torch.float32)
    sinks = torch.tensor([0.3, -0.2, 0.1, 0.5])
    for positions in ("stream", "cache"):
        work = RandomWorkload(cfg, q_heads=4, segments=3, seed=2, tolerance=2e-5, score_mod=score_bias,
                              positions=positions, sinks=sinks)
        for _ in range(40):
            work.step()


def test_int8_slots_hold_the_memory_and_equal_the_reference_over_what_they_read_back():
    cfg = small_config(retention=RECALL, query_window=6, slot_dtype=torch.int8)
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=3, tolerance=2e-5)
    for _ in range(40):
        work.step()


@pytest.mark.parametrize("mode, layout", [("stream", "half"), ("cache", "half"), ("cache", "interleaved")])
def test_rotary_positions_equal_the_reference(mode, layout):
    """Keys rotated by `SinkRotation`: under ``"cache"`` positions each memory entry is read at the
    position just before the step's first window entry (the reference rotates raw keys there; the cache
    turns them by table rows, either pair layout), under ``"stream"`` at its stream index."""
    cfg = small_config(retention=RECALL, head_dim=8, dtype=torch.float64, max_step_tokens=1)
    manager = BoundedKVManager(cfg, "cpu")
    rotary = Rotary(8, layout=layout)
    rotations = [manager.rotation(layer, rotary, mode) for layer in range(cfg.num_layers)]

    def attend(m, plan, qs, ks, vs):
        outs = []
        for layer in range(cfg.num_layers):
            q, k = rotations[layer](qs[layer], ks[layer], plan)
            outs.append(m.attend(layer, q, k, vs[layer], plan))
        return outs

    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=4, manager=manager, attend=attend, churn=0.1)
    ref_attend = work.ref.attend
    work.ref.attend = lambda *a, **kw: ref_attend(*a, rotary=rotary, rope_positions=mode, **kw)
    work.tolerance = 1e-9
    for _ in range(50):
        work.step()


def test_compiled_steps_equal_the_reference_without_recompiling_as_memories_fill():
    """One graph for a two-layer step under the default path (one token: FlexAttention, the memory copied next
    to the window, its region's blocks listed with the plan's; two: the rows path): memories fill, wrap and
    reset, and no step after the first compiles again."""
    for tokens in (1, 2):
        cfg = small_config(retention=RECALL, query_window=6, max_step_tokens=tokens)
        _compiled_workload_equals_the_reference(BoundedKVManager(cfg, "cpu", block_size=16), tokens, seed=5, steps=60)


def _compiled_workload_equals_the_reference(manager, tokens: int, seed: int, steps: int) -> None:
    """A two-layer step compiled as one graph over a random workload of `tokens`-token steps: every output equals
    the reference's, no step after the first compiles again, and some memory fills and moves on."""
    from torch._dynamo.utils import counters

    cfg = manager.config

    def model_step(qs, ks, vs, plan):
        return [manager.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(cfg.num_layers)]

    compiled = torch.compile(model_step, fullgraph=True)
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=seed, manager=manager, fixed_tokens=tokens, churn=0.03,
                          attend=lambda m, plan, qs, ks, vs: compiled(qs, ks, vs, plan), tolerance=1e-4)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    work.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(steps):
            work.step()
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert max(s[2] for s in work.state.values()) > 2 + 6 + 8 + 3


@pytest.mark.parametrize("query_window, tokens, pack_gqa, rows", [
    (None, 1, True, 1), (None, 3, False, 2), (6, 1, False, 1), (6, 3, True, 2),
])
def test_the_flex_path_reads_the_chosen_memory_in_its_one_call(query_window, tokens, pack_gqa, rows):
    """FlexAttention (eager: it evaluates the mask on every cell) with the chosen entries copied into the
    row's region: random workloads equal the reference, GQA packed into the query axis or not, one or two
    rows per request (each its own region)."""
    cfg = small_config(retention=RECALL, query_window=query_window, max_step_tokens=tokens, dtype=torch.float64,
                       rows_per_request=rows)
    options = AttentionOptions.for_cache(cfg, "cpu", path="flex", pack_gqa=pack_gqa)
    manager = BoundedKVManager(cfg, "cpu", options=options, block_size=4)
    assert manager.layout.recall_rows == cfg.max_slots * rows + 1
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=6 + tokens, manager=manager, tolerance=1e-9, churn=0.05)
    for _ in range(60):
        work.step()
    assert max(s[2] for s in work.state.values()) > 2 + 6 + 8 + 3


@pytest.mark.parametrize("query_window, tokens", [(None, 1), (6, 3)])
def test_the_region_path_under_cuda_options_equals_the_reference(query_window, tokens):
    """CUDA's default options (every step planned with full blocks, GQA not packed, no shared region) through
    eager FlexAttention on the CPU: the mask with full blocks planned beside it. (Eager FlexAttention evaluates
    the mask on every cell, so the block lists, the region's included, are checked by the compiled tests.)"""
    cfg = small_config(retention=RECALL, query_window=query_window, max_step_tokens=tokens, dtype=torch.float64)
    options = AttentionOptions.for_cache(cfg, "cuda", path="flex")
    assert options.full_blocks and not options.pack_gqa
    manager = BoundedKVManager(cfg, "cpu", options=options, block_size=2)
    manager.paths.full_blocks_at = lambda rows, tokens: True  # as CUDA plans a batch larger than its SMs
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=12, manager=manager, tolerance=1e-9, churn=0.05)
    full = 0
    for _ in range(50):
        work.step()
        full += sum(len(work.plan.blocks(i, full=True)) for i in range(work.plan.rows))
    assert full > 0 and max(s[2] for s in work.state.values()) > 2 + 6 + 8 + 3


@pytest.mark.parametrize("tokens", [1, 3])
def test_int8_slots_through_flexattention_copy_their_memory_dequantized(tokens):
    """Quantized slots on the FlexAttention path: the layer is dequantized into its scratch copy and the chosen
    entries, dequantized and turned, go into the copy's region; equal to the reference over what they read back."""
    cfg = small_config(retention=RECALL, query_window=6, slot_dtype=torch.int8, max_step_tokens=tokens)
    manager = BoundedKVManager(cfg, "cpu", options=AttentionOptions.for_cache(cfg, "cpu", path="flex"), block_size=4)
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=3, manager=manager, tolerance=2e-5, churn=0.05)
    for _ in range(60):
        work.step()
    assert max(s[2] for s in work.state.values()) > 2 + 6 + 8 + 3


def test_the_region_is_allocated_only_where_flexattention_reads_a_memory():
    """The region is counted in `memory_bytes` (whole KV blocks per slot row and one for padding rows) and
    exists only where some step can take FlexAttention; the rows path alone needs none."""
    cfg = small_config(retention=RECALL, max_step_tokens=3)
    sizes = {}
    for path in ("flex", "rows"):
        m = BoundedKVManager(cfg, "cpu", options=AttentionOptions.for_cache(cfg, "cpu", path=path), block_size=4)
        sizes[path] = (m.memory_bytes, m.layout)
    flex, rows = sizes["flex"][1], sizes["rows"][1]
    assert rows.recall_rows == 0 and flex.recall_rows == cfg.max_slots + 1
    assert flex.recall_row_len == 12  # top_k + 1 blocks of 2 and 3 step tokens: 9 cells, in blocks of 4
    cell = cfg.head_dim * cfg.dtype.itemsize * cfg.num_heads * 2 * cfg.num_layers  # keys and values
    grown = (flex.total_len - rows.total_len) * cell
    assert sizes["flex"][0] - sizes["rows"][0] == grown >= flex.recall_rows * flex.recall_row_len * cell
    # A cache whose steps never pad (as transformers' FlexKVCache builds) keeps no region for padding rows.
    unpadded = BoundedKVManager(cfg.replace(padding_segments=False), "cpu", block_size=4,
                                options=AttentionOptions.for_cache(cfg, "cpu", path="flex"))
    assert unpadded.layout.recall_rows == cfg.max_slots


# ------------------------------------------------------------------ what it refuses


def test_calls_the_memory_does_not_serve_are_refused_before_anything_is_written():
    cfg = small_config(retention=RECALL, max_step_tokens=1)
    manager = BoundedKVManager(cfg, "cpu")
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)}, tokens=1)
    manager.admit(step)
    plan = manager.plan(step)
    q, k, v = (torch.randn(1, 2, 1, 8) for _ in range(3))
    before = [b.tensor.clone() for b in manager.slot_buffers()]
    with pytest.raises(ValueError, match="query_only queries are not served under Recall"):
        manager.attend_query_only(0, q, k, v, plan, torch.randn(1, 2, 2, 8))
    assert all(torch.equal(a, b.tensor) for a, b in zip(before, manager.slot_buffers()))


def test_a_forced_flex_path_compiled_on_the_cpu_serves_the_memory_and_refuses_a_log_sum_exp_by_name():
    """Compiled on the CPU, FlexAttention reads the chosen memory in its one call (the kernel returns no
    log-sum-exp, which the region does not need): equal to the reference, one graph as memories fill. A
    call that asks for the log-sum-exp is refused by name there, before the step writes."""
    for tokens in (1, 2):  # two: a chunk under a per-query window, each query marking its own region entries
        cfg = small_config(retention=RECALL, query_window=6, max_step_tokens=tokens)
        flex = AttentionOptions.for_cache(cfg, "cpu", path="flex")
        _compiled_workload_equals_the_reference(BoundedKVManager(cfg, "cpu", options=flex, block_size=16), tokens,
                                                seed=8, steps=40)

    manager = BoundedKVManager(cfg, "cpu", options=AttentionOptions.for_cache(cfg, "cpu", path="flex"), block_size=16)
    step = BoundedKVStep((Segment("z", 1),), {"z": StreamPosition(0, 0)}, tokens=1)
    manager.admit(step)
    plan = manager.plan(step)
    q, k, v = (torch.randn(1, 2, 1, 8) for _ in range(3))
    before = [b.tensor.clone() for b in manager.slot_buffers()]
    with pytest.raises(Exception, match=r"path='flex' compiled on the CPU for a call that needs a log-sum-exp"):
        torch.compile(lambda q, k, v, plan: manager.attend_lse(0, q, k, v, plan), fullgraph=True)(q, k, v, plan)
    assert all(torch.equal(a, b.tensor) for a, b in zip(before, manager.slot_buffers()))
