"""Quantized slots (`BoundedKVConfig(slot_dtype=...)`, `flexkv.cache.storage.quantized`): what is refused,
what a cell stores, and what the memory accounting counts. Attention against the reference runs in
tests/test_properties.py, tests/test_front_doors.py and tests/test_compiled.py."""

import pytest
import torch
from random_workload import RandomWorkload

from configs import small_config
from flexkv import BoundedKVConfig, BoundedKVManager, LayerGroup, Recall, SinkWindow
from flexkv.cache.positions.rotary import Rotary
from flexkv.cache.storage import quantized
from flexkv.cli.workload import WorkloadError, parse_workload
from flexkv.model.uncached import UncachedHistory


def config(**kw):
    base = dict(num_layers=2, num_heads=8, head_dim=128, rows_per_request=1, max_source_len=0, max_sources=0,
                retention=SinkWindow(4, 1020), max_slots=4, dtype=torch.bfloat16)
    base.update(kw)
    return BoundedKVConfig(**base)


@pytest.mark.parametrize("bad", [torch.uint8, torch.float8_e5m2, torch.float16, "int8"])
def test_a_slot_dtype_no_path_reads_is_refused_naming_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"slot_dtype must be one of torch.int8, torch.float8_e4m3fn .* or None"):
        config(slot_dtype=bad)


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_streams_memory_at_the_same_window_is_at_most_055_of_bfloat16(slot_dtype):
    full, small = BoundedKVManager(config(), "cpu"), BoundedKVManager(config(slot_dtype=slot_dtype), "cpu")
    assert small.slot_bytes <= 0.55 * full.slot_bytes
    # Cells of one byte plus a float32 scale per cell and head, for keys and values.
    cells = small.layout.slot_cells() * 2 * 8 * 2
    assert small.slot_bytes == cells * (128 + 4)
    # memory_bytes counts every buffer the cache holds, scales included, and the fixed float32
    # buffer the eager rows path dequantizes a group of rows into (one slot row here, whose
    # float32 keys and values outweigh the 4 MiB a group aims at), float8 cells with half as much
    # again for the int16 bits they are widened through.
    held = sum(b.numel() * b.element_size() for b in small.buffers() if b.dtype in (slot_dtype, torch.float32))
    staging = 128 if slot_dtype == torch.float8_e4m3fn else 0
    scratch = small.layout.slot_row_len * 8 * (128 + 128 + staging) * 4
    assert small.memory_bytes == held + scratch
    assert small.memory_bytes - scratch <= 0.55 * full.memory_bytes
    # Off the CPU ("meta" plans as CUDA) FlexAttention reads a dequantized copy of one layer: counted too;
    # the rows path there is the plain one (the CPU fast paths run on the CPU only), with no group buffer.
    cuda_like = BoundedKVManager(config(slot_dtype=slot_dtype), "meta")
    one_layer = full.memory_bytes // 2
    assert cuda_like.memory_bytes == small.memory_bytes - scratch + one_layer


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_small_quantized_cache_gets_a_scratch_no_larger_than_its_rows(slot_dtype):
    """The rows path's dequantize buffer holds at most every batch row a step can hold: a tiny cache
    (2 slots of 1 + 7 cells, 2 heads of 8) used to get the fixed 4 MiB group, 100x its own cells."""
    tiny = config(num_heads=2, head_dim=8, retention=SinkWindow(1, 7), max_slots=2, slot_dtype=slot_dtype)
    small = BoundedKVManager(tiny, "cpu")
    held = sum(b.numel() * b.element_size() for b in small.buffers() if b.dtype in (slot_dtype, torch.float32))
    staging = 8 if slot_dtype == torch.float8_e4m3fn else 0
    every_row = 2 * small.layout.slot_row_len * 2 * (8 + 8 + staging) * 4  # slots x cells x heads x width x 4 B
    assert small.memory_bytes == held + every_row
    assert small.memory_bytes < 4 * (held + small.layout.slot_row_len * 2 * 2 * 16 * 2)  # within 4x bf16 slots


def test_memory_report_counts_scales_per_group():
    groups = (LayerGroup((0,), SinkWindow(0, 64), name="local"), LayerGroup((1,), SinkWindow(4, 1020), name="global"))
    g = BoundedKVManager(config(slot_dtype=torch.int8), "meta", groups=groups)
    for report, m in zip(g.memory_report(), g.cache_groups):
        assert report["slot_bytes"] == m.slot_bytes == m.layout.slot_cells() * 2 * 8 * (128 + 4)
        assert report["slot_dtype"] == torch.int8
    assert g.slot_bytes == sum(m.slot_bytes for m in g.cache_groups)


def test_quantize_keeps_each_vectors_largest_entry_and_bounds_the_error():
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 3, 5).view(1, 5, 1)
    x[0, 0, 7] = 1e4  # an outlier: its own vector's scale takes it
    for sd, rel in ((torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 2 ** -4)):
        cells, scale = quantized.quantize(x, sd)
        assert cells.dtype == sd and scale.shape == (3, 5, 1) and scale.dtype == torch.float32
        back = quantized.dequantize(cells, scale, x.dtype)
        top = x.abs().amax(-1, keepdim=True)
        assert torch.all((back - x).abs() <= rel * top * 1.001 + 1e-30)
        torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)
    zero = torch.zeros(2, 8)
    assert torch.equal(quantized.round_trip(zero, torch.int8), zero)


def test_the_cache_stores_what_quantize_gives_for_a_written_token():
    cfg = config(num_layers=1, num_heads=2, head_dim=16, retention=SinkWindow(1, 4), dtype=torch.float32,
                 slot_dtype=torch.int8, max_slots=2)
    from flexkv import BoundedKVStep, Segment, StreamPosition

    m = BoundedKVManager(cfg, block_size=8)
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)})
    m.admit(step)
    plan = m.plan(step)
    k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    m.attend(0, torch.randn(1, 2, 1, 16), k, v, plan)
    cell = int(plan.write_index.view(-1)[0])
    want, scale = quantized.quantize(k[0, :, 0], torch.int8)
    assert torch.equal(m.k_cache_0[0, :, cell], want) and torch.equal(m.k_scale_0[0, :, cell], scale)


@pytest.mark.parametrize("slot_dtype, rotated_inputs, retention", [
    (torch.int8, False, SinkWindow(2, 6)), (torch.int8, True, SinkWindow(2, 6)),
    (torch.float8_e4m3fn, False, SinkWindow(2, 6)), (torch.int8, True, Recall(2, 6, 8, block=2, top_k=2))])
def test_in_cache_rotary_positions_over_quantized_slots_equal_the_reference_reading_cells_back(slot_dtype,
                                                                                               rotated_inputs,
                                                                                               retention):
    """In-cache positions rewrite every sink cell at each step from the sink's unquantized copy (one
    quantization per write, no error carried over): the reference quantizes each key as the cache holds it
    (rotated at its stream index; a sink at the distance its in-cache position gives) and reads it back.
    A `Recall` memory reads its quantized cells and turns them to where memory is read."""
    cfg = small_config(retention=retention, head_dim=8, dtype=torch.float64, max_step_tokens=2,
                       slot_dtype=slot_dtype)
    manager = BoundedKVManager(cfg, "cpu")
    rotary = Rotary(8)
    rotations = [manager.rotation(layer, rotary, "cache", rotated_inputs=rotated_inputs)
                 for layer in range(cfg.num_layers)]

    def attend(m, plan, qs, ks, vs):
        outs = []
        for layer in range(cfg.num_layers):
            q, k = qs[layer], ks[layer]
            if rotated_inputs:  # a model that rotates its own q, k at their stream indices
                pos = manager.stream_positions(plan)
                q, k = rotary.rotate(q, pos), rotary.rotate(k, pos)
            q, k = rotations[layer](q, k, plan)
            outs.append(m.attend(layer, q, k, vs[layer], plan))
        return outs

    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=7, manager=manager, attend=attend, churn=0.1)
    work.stored = lambda x: x  # the reference reads cells back itself, after the rotation (`stored=`)
    ref_attend = work.ref.attend
    work.ref.attend = lambda *a, **kw: ref_attend(*a, rotary=rotary, rope_positions="cache",
                                                  stored=lambda x: quantized.round_trip(x, slot_dtype), **kw)
    work.tolerance = 1e-9
    for _ in range(40):
        work.step()


def test_the_workload_key_sets_the_slot_dtype_and_a_bad_one_names_the_choices():
    base = dict(name="w", layers=1, kv_heads=2, head_dim=8, window=8, stream_len=[4, 8])
    assert parse_workload(dict(base, slot_dtype="int8")).config().slot_dtype == torch.int8
    assert parse_workload(dict(base, slot_dtype="fp8")).config().slot_dtype == torch.float8_e4m3fn
    assert parse_workload(base).config().slot_dtype is None
    with pytest.raises(WorkloadError, match=r"slot_dtype: got 'int4'; expected one of none, int8, float8_e4m3fn, fp8"):
        parse_workload(dict(base, slot_dtype="int4"))


def test_the_shipped_streaming_llm_config_has_an_int8_size_equal_to_small_but_for_the_slots():
    from pathlib import Path

    from flexkv.cli.workload import load_workload

    path = str(Path(__file__).resolve().parents[1] / "configs" / "streaming-llm.yaml")
    small, int8 = load_workload(path, "small"), load_workload(path, "int8")
    assert small.config().slot_dtype is None and int8.config().slot_dtype == torch.int8
    assert int8.replace(slot_dtype="none") == small


def test_flexkv_run_with_quantized_slots_matches_the_reference_on_the_dequantized_cells(tmp_path):
    """`flexkv run` on the tiny CLI workload with fp8 slots: sources, sinks past the source, GQA, two
    rows, reverse order and a relative bias, checked after the ring wrapped."""
    import json
    from pathlib import Path

    from flexkv.cli import main

    text = (Path(__file__).resolve().parent / "data" / "tiny-run.yaml").read_text() + "slot_dtype: fp8\n"
    cfg, out = tmp_path / "w.yaml", tmp_path / "r.json"
    cfg.write_text(text)
    assert main(["run", str(cfg), "--quiet", "--threads", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    checks = rep["reference"]["checks"]
    assert len(checks) == 4 and all(c["max_abs_error"] < 1e-4 for c in checks)
    assert any(c["written"] > 15 for c in checks)  # past the ring's 15 cells


def test_tensor_parallel_shards_of_a_quantized_cache_gather_to_the_whole_cache():
    """Head-sharded caches (`ShardedKVManager`, 2 ranks in one process) with int8 slots: scales are per
    cell and head, so each rank stores exactly its heads' cells of the unsharded quantized cache, and
    the gathered heads equal its output (itself checked against the reference on the dequantized cells)."""
    from random_workload import RandomWorkload

    from flexkv.serving.distributed import ShardedKVManager

    cfg = BoundedKVConfig(num_layers=2, num_heads=4, head_dim=8, rows_per_request=2, max_source_len=0,
                          max_sources=0, retention=SinkWindow(2, 6), max_slots=3, max_step_tokens=2,
                          slot_dtype=torch.int8)
    shards = [ShardedKVManager(cfg, rank=r, world_size=2, num_query_heads=8, block_size=8) for r in range(2)]
    assert all(s.k_cache_0.dtype == torch.int8 and s.config.num_heads == 2 for s in shards)
    work = RandomWorkload(cfg, q_heads=8, segments=3, seed=5, churn=0.1)
    m = work.manager
    for name in ("admit", "commit", "remove_request", "reset_request"):
        whole = getattr(m, name)
        setattr(m, name, lambda x, whole=whole, name=name: ([getattr(s, name)(x) for s in shards], whole(x))[1])
    plans = {}
    whole_plan = m.plan
    m.plan = lambda step: (plans.update(shards=[s.plan(step) for s in shards]), whole_plan(step))[1]
    worst = 0.0

    def attend(mgr, plan, qs, ks, vs):
        outs = [mgr.attend(l, qs[l], ks[l], vs[l], plan) for l in range(cfg.num_layers)]
        for l in range(cfg.num_layers):
            parts = [s.attend(l, qs[l][:, 4 * r:4 * r + 4], ks[l][:, 2 * r:2 * r + 2], vs[l][:, 2 * r:2 * r + 2],
                              plans["shards"][r]) for r, s in enumerate(shards)]
            nonlocal worst
            worst = max(worst, float((torch.cat(parts, dim=1) - outs[l]).abs().max()))
        return outs

    work.attend_fn = attend
    for _ in range(16):
        work.step()
    assert worst == 0.0
    assert work.worst_relative < 1e-5
    assert sum(s.slot_bytes for s in shards) == m.slot_bytes


def test_flexkv_cache_generates_with_quantized_slots_close_to_unquantized():
    """`FlexKVCache(model, ..., slot_dtype=torch.int8)` on a transformers family: every group stores
    int8 cells, a stream holds about half the bytes (plus scales), and greedy generate() over a
    stream 4x the window stays close to the unquantized cache (figures per family: docs/benchmarks.md)."""
    from flexkv.integrations.transformers import FlexKVCache
    from hf_models import CHUNK, LENGTHS, NEW, SINK, WINDOW, left_pad, make_model, prompts

    model = make_model("gemma2")
    ids, mask = left_pad(prompts(LENGTHS))
    outs, caches = [], []
    for sd in (None, torch.int8):
        cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=3, prefill_chunk=CHUNK, block_size=16,
                            slot_dtype=sd, rope_positions="stream")  # quantized slots take stream positions
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        outs.append(out)
        caches.append(cache)
    assert all(m.k_cache_0.dtype == torch.int8 for m in caches[1].manager.cache_groups)
    assert caches[1].manager.slot_bytes < caches[0].manager.slot_bytes
    first = torch.stack(outs[0].logits, 1)[:, :4], torch.stack(outs[1].logits, 1)[:, :4]
    assert 0 < float((first[0] - first[1]).abs().max()) < 0.05 * float(first[0].abs().max())


class _Recording:
    """A cache whose `attend` outputs are kept (everything else passes through)."""

    def __init__(self, cache):
        self._cache, self.outputs = cache, []

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def attend(self, *args, **kw):
        out = self._cache.attend(*args, **kw)
        self.outputs.append(out)
        return out


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn])
def test_forked_reordered_and_rolled_back_quantized_streams_attend_as_the_quantized_twin(slot_dtype):
    """Fork and reorder copy a slot's quantized cells with their scales: the cache's outputs through
    random steps, forks, reorders and rollbacks are the uncached twin's (which attends on what the
    cells read back), step for step."""
    from test_fork_rollback import Driver, make_config, random_run

    cfg = make_config(max_rollback=4, slot_dtype=slot_dtype)
    runs = []
    for cache in (BoundedKVManager(cfg), UncachedHistory(cfg)):
        d = Driver(_Recording(cache), cfg, seed=3, tolerance=None)  # compared with each other below, not with floats
        random_run(d, steps=40)
        runs.append(d.cache.outputs)
    assert len(runs[0]) == len(runs[1]) > 40
    for i, (got, want) in enumerate(zip(*runs)):
        assert (got - want).abs().max().item() < 1e-6, f"attend call {i}"


def test_float8_cells_are_widened_through_their_bits_exactly():
    """The CPU reads float8 cells through their bits (`quantized._float8_bits_to_float16`, the
    numbers times 2**-8, the scale times 2**8): every finite e4m3 value, subnormals and both zeros
    included, times scales small and large (the largest a finite float32 vector can get: max / 448),
    gives exactly `cells.to(float32) * scale`; int8 cells likewise."""
    f8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    big = torch.finfo(torch.float32).max / 448
    scale = torch.tensor([1.0, 3.7e-3, 2.0 ** -40, 2.0 ** 100, big, 2.0 ** -149]).view(6, 1, 1)
    cells = f8.view(1, 64, 4).expand(6, 64, 4).contiguous()
    want = cells.to(torch.float32) * scale
    got = quantized.dequantize(cells, scale, torch.float32)
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 6 * 254 and torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))  # -0 stays -0
    # The unscaled widening: exactly the cells over its factor.
    widened, factor = quantized.widen_into(torch.empty(256), f8)
    assert factor == 2.0 ** 8 and torch.equal(widened[finite[0].flatten()] * factor, f8.float()[finite[0].flatten()])
    i8 = torch.arange(-128, 128, dtype=torch.int8).view(1, 64, 4).expand(6, 64, 4).contiguous()
    assert torch.equal(quantized.dequantize(i8, scale, torch.float32), i8.to(torch.float32) * scale)
    assert torch.equal(quantized.dequantize(cells, scale, torch.bfloat16)[finite], want.bfloat16()[finite])


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("sources", [False, True])
@pytest.mark.parametrize("fused_queries", [8, 0])
def test_the_eager_rows_path_dequantizes_a_group_of_rows_at_a_time_exactly(monkeypatch, slot_dtype, sources,
                                                                           fused_queries):
    """Eagerly the rows path dequantizes into one small buffer, a group of batch rows at a time
    (`quantized_rows.DEQUANTIZE_GROUP_BYTES`): with the budget at one row, every row is its own
    group, in place (no sources, every slot in the step) and gathered (sources), with a score_mod
    and learned sinks (the explicit softmax and its log-sum-exp) and without; exact against the
    reference on the dequantized cells; scales on the scores (the decode default) and on the
    cells (`fused_queries=0`: the dequantize before SDPA that longer query blocks take)."""
    from random_workload import RandomWorkload, score_bias

    from flexkv.cache.cpu import quantized_rows

    monkeypatch.setattr(quantized_rows, "DEQUANTIZE_GROUP_BYTES", 1)
    monkeypatch.setattr(quantized_rows, "FUSED_SCALES_MAX_QUERIES", fused_queries)
    calls = []
    for name in ("dequantized_group", "widened_group"):  # every group's keys and values pass one of them
        fn = getattr(quantized_rows, name)
        monkeypatch.setattr(quantized_rows, name, lambda s, o, c, *a, fn=fn: (calls.append(c.shape[0]), fn(s, o, c, *a))[1])
    cfg = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=8, rows_per_request=1,
                          max_source_len=12 if sources else 0, max_sources=2 if sources else 0,
                          retention=SinkWindow(2, 6), max_slots=3, max_step_tokens=2, slot_dtype=slot_dtype)
    for kw in (dict(), dict(score_mod=score_bias, sinks=torch.randn(4))):
        calls.clear()
        work = RandomWorkload(cfg, q_heads=4, segments=3, seed=3, churn=0.1, tolerance=1e-5, **kw)
        for _ in range(12):
            work.step()
        assert work.manager.store.scratch["rows"].numel() < 3 * 2 * 9 * 16  # not the pool: one row of the widest kind
        assert calls and max(calls) == 1  # each group one batch row
        assert work.worst_relative < 1e-5


def _widening_flex_call(real):
    """`flex_call` as CUDA's compiled kernels run it on float8 cells: widened to the queries' dtype
    as they are read (the CPU's eager FlexAttention takes no mixed dtypes); counts the calls that
    got cells as stored."""
    def call(q, k, v, *args, **kwargs):
        call.cells.append((k.dtype, v.dtype))
        return real(q, k.to(q.dtype), v.to(q.dtype), *args, **kwargs)
    call.cells = []
    return call


@pytest.mark.parametrize("keys, values", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("q_heads", [2, 4])
def test_float8_cells_read_as_stored_by_the_kernel_match_the_reference(monkeypatch, keys, values, q_heads):
    """`AttentionOptions(quantized_keys_in_kernel=..., quantized_values_in_kernel=...)`: FlexAttention
    reads key cells with their scales in `score_mod`, value cells with their scales as a log in
    `score_mod` and a second call for the plain log-sum-exp (`quantized.value_scaled_attention`).
    With a kernel that widens cells as CUDA's does, the outputs and log-sum-exps equal the
    reference on the dequantized cells through ring wraps, sources, GQA, a score_mod and learned
    sinks, and each in-kernel tensor reaches the kernel as float8."""
    from random_workload import RandomWorkload, score_bias

    from flexkv.cache.paths import flex_path, float8_path
    from flexkv.cache.paths.attention_options import AttentionOptions

    monkeypatch.setattr(quantized, "CELLS_IN_KERNEL", {"cpu": "eager"})
    call = _widening_flex_call(float8_path.flex_call)
    for module in (flex_path, float8_path):
        monkeypatch.setattr(module, "flex_call", call)
    cfg = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=12,
                          max_sources=2, retention=SinkWindow(2, 6), max_slots=3, max_step_tokens=2,
                          slot_dtype=torch.float8_e4m3fn, dtype=torch.float32)
    options = AttentionOptions.for_cache(cfg, "cpu", path="flex", quantized_keys_in_kernel=keys,
                                         quantized_values_in_kernel=values)
    f8 = torch.float8_e4m3fn
    for kw in (dict(), dict(score_mod=score_bias, sinks=torch.randn(q_heads))):
        call.cells.clear()
        manager = BoundedKVManager(cfg, "cpu", block_size=16, options=options)
        work = RandomWorkload(cfg, manager=manager, q_heads=q_heads, segments=3, seed=5, churn=0.1, tolerance=1e-5,
                              **kw)
        for _ in range(14):
            work.step()
        assert work.worst_relative < 1e-5
        # Two calls per layer when values are read as stored, the second over the zero cell.
        kinds = set(call.cells)
        want_v = f8 if values else torch.float32
        assert (f8 if keys else torch.float32, want_v) in kinds
        assert len(call.cells) == 14 * 2 * (2 if values else 1)
        if values:
            assert (f8 if keys else torch.float32, f8) in kinds and manager.store.scratch["lse_values"] is not None


def test_compiled_float8_keys_read_as_stored_match_the_reference_with_no_recompile(monkeypatch):
    """Compiled, keys read as stored (the CUDA option; the CPU's compiled kernel returns no
    log-sum-exp, so values read as stored are checked eagerly above): the key scale traced into the
    step's `score_mod` agrees with the reference on the dequantized cells, with no recompile."""
    from random_workload import RandomWorkload

    from flexkv.cache.paths import flex_path, float8_path
    from flexkv.cache.paths.attention_options import AttentionOptions

    monkeypatch.setattr(quantized, "CELLS_IN_KERNEL", {"cpu": "compiled"})
    real = float8_path.flex_call
    for module in (flex_path, float8_path):
        monkeypatch.setattr(module, "flex_call", lambda q, k, v, *a, **kw: real(q, k.to(q.dtype), v, *a, **kw))
    cfg = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=12,
                          max_sources=2, retention=SinkWindow(2, 6), max_slots=3, max_step_tokens=1,
                          slot_dtype=torch.float8_e4m3fn, dtype=torch.float32)
    options = AttentionOptions.for_cache(cfg, "cpu", path="flex", quantized_keys_in_kernel=True)
    manager = BoundedKVManager(cfg, "cpu", block_size=16, options=options)
    manager.store.scratch["flex_keys"].fill_(float("nan"))  # the dequantized keys' copy (eager steps' path="flex"): unused

    def model_step(qs, ks, vs, plan):
        return [manager.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(cfg.num_layers)]

    compiled = torch.compile(model_step, fullgraph=True)
    work = RandomWorkload(cfg, manager=manager, q_heads=4, segments=3, seed=5, churn=0.1, fixed_tokens=1,
                          attend=lambda m, plan, qs, ks, vs: compiled(qs, ks, vs, plan), tolerance=1e-5)
    torch._dynamo.reset()
    work.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(9):
            work.step()
    assert work.worst_relative < 1e-5
    assert manager.store.scratch["flex_keys"].isnan().all() and not manager.store.scratch["flex_values"].isnan().any()


def test_value_scaled_attention_gives_zeros_and_minus_infinity_where_a_query_reads_nothing():
    """A query whose keys are all masked: zeros and a log-sum-exp of -inf, not NaN, and the other
    queries' rows equal softmax attention over the dequantized values."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 4, 16, generator=g), torch.randn(1, 2, 32, 16, generator=g)
    cells, scale = quantized.quantize(torch.randn(1, 2, 32, 16, generator=g) * 3, torch.float8_e4m3fn)
    mask = create_block_mask(lambda b, h, qi, kv: (qi > 0) & (kv <= qi * 8), 1, 1, 4, 32, device="cpu",
                             BLOCK_SIZE=16)

    def call(values, mod):
        out, aux = flex_attention(q, k, values.to(q.dtype), score_mod=mod, block_mask=mask,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse

    out, lse = quantized.value_scaled_attention(call, cells, scale, 1, None, quantized.lse_values(cells.dtype, "cpu"))
    v = quantized.dequantize(cells, scale, torch.float32)
    allowed = torch.tensor([[(qi > 0) and kv <= qi * 8 for kv in range(32)] for qi in range(4)])
    scores = (q @ k.transpose(-1, -2) / 4).masked_fill(~allowed, float("-inf"))
    want = torch.softmax(scores[:, :, 1:], -1) @ v
    assert torch.equal(out[:, :, 0], torch.zeros(1, 2, 16)) and torch.isneginf(lse[:, :, 0]).all()
    torch.testing.assert_close(out[:, :, 1:], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[:, :, 1:], torch.logsumexp(scores[:, :, 1:], -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keys, values", [(True, False), (False, True), (True, True)])
def test_a_cache_whose_kernel_reads_cells_as_stored_allocates_no_dequantized_copy_of_them(monkeypatch, keys, values):
    """Under path="auto" (eager steps take the rows path), a float8 cache whose compiled kernel reads its key
    (value) cells as stored keeps no dequantized copy of them: `memory_bytes` is less by exactly that copy,
    and a cache reading values so holds the zero cell of its second call. "meta" stands for a device
    whose kernels read float8 cells (`quantized.CELLS_IN_KERNEL`)."""
    from flexkv.cache.paths.attention_options import AttentionOptions

    monkeypatch.setattr(quantized, "CELLS_IN_KERNEL", {"meta": "compiled"})
    cfg = config(slot_dtype=torch.float8_e4m3fn)
    copy = cfg.num_heads * BoundedKVManager(cfg, "meta").layout.total_len * cfg.head_dim * 2  # bfloat16, one layer
    base = BoundedKVManager(cfg, "meta")
    opts = AttentionOptions.for_cache(cfg, "meta", quantized_keys_in_kernel=keys, quantized_values_in_kernel=values)
    reads = BoundedKVManager(cfg, "meta", options=opts)
    zero_cell = quantized.LSE_VALUE_WIDTH if values else 0  # float8: a byte each
    assert base.memory_bytes - reads.memory_bytes == copy * (keys + values) - zero_cell
    assert (reads.store.scratch["flex_keys"] is None) == keys and (reads.store.scratch["flex_values"] is None) == values
    forced = BoundedKVManager(cfg, "meta", options=AttentionOptions.for_cache(
        cfg, "meta", path="flex", quantized_keys_in_kernel=keys, quantized_values_in_kernel=values))
    assert forced.store.scratch["flex_keys"] is not None and forced.store.scratch["flex_values"] is not None  # eager flex steps read the copies
