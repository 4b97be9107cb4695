"""Random configs and random workloads through the public API, against the dense reference (eager).

Caches with quantized slots (`slot_dtype`) are drawn too: the reference then runs on what the
cache reads back for every key and value (`flexkv.cache.storage.quantized.round_trip`), and must agree
as closely as for an unquantized cache.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from random_workload import RandomWorkload, score_bias

from flexkv import BoundedKVConfig, BoundedKVManager, SinkWindow
from flexkv.cache.host.layout import cpu_kernel_block_exact
from flexkv.cache.paths.attention_options import AttentionOptions

TOL = 1e-4
#: Norm-relative agreement with the reference (on the dequantized cells for quantized slots).
REL_TOL = 1e-5


def soft_cap(score, b, h, q_pos, kv_pos):
    """Gemma-style logit soft-capping."""
    return 4.0 * torch.tanh(score / 4.0)


SCORE_MODS = {None: None, "stream": score_bias, "cache": score_bias, "softcap": soft_cap}


@st.composite
def configs(draw):
    max_source_len = draw(st.integers(0, 6))
    min_source_len = draw(st.integers(0, max_source_len))
    query_window = draw(st.one_of(st.none(), st.integers(0, 4)))
    reverse = False if query_window is not None else draw(st.booleans())
    includes = False if query_window is not None else draw(st.booleans())
    causal = False if query_window is not None or reverse else draw(st.booleans())
    floor = query_window or 0
    sink = draw(st.integers(0, 5))
    window = draw(st.integers(floor, 7))
    if draw(st.booleans()):
        retention = SinkWindow(sink, window, includes)
    else:
        # A policy that changes with the source length: sink longer or shorter than the source, windows down to 0.
        a, b = draw(st.integers(0, 4)), draw(st.integers(0, 3))

        def retention(length, a=a, b=b, floor=floor, includes=includes):
            return SinkWindow((a + length) % 5, max(floor, (b * length + a) % 8), includes)

    heads = draw(st.integers(1, 2))
    cfg = BoundedKVConfig(
        num_layers=draw(st.integers(1, 2)),
        num_heads=heads,
        head_dim=draw(st.sampled_from([4, 8])),
        value_head_dim=draw(st.sampled_from([None, None, 6])),  # values narrower or wider than keys too
        rows_per_request=draw(st.integers(1, 2)),
        max_source_len=max_source_len,
        retention=retention,
        max_slots=draw(st.integers(2, 4)),
        min_source_len=min_source_len,
        reverse_step_order=reverse,
        query_window=query_window,
        causal_step=causal,
        max_step_tokens=draw(st.integers(1, 4)),
        max_sources=draw(st.integers(1, 2)),
        slot_dtype=draw(st.sampled_from([None, torch.int8, torch.float8_e4m3fn])),
    )
    q_heads = heads * draw(st.sampled_from([1, 2]))
    return cfg, q_heads


@settings(max_examples=60)
@given(
    configs(),
    st.integers(0, 2**16),
    st.sampled_from([8, 16]),
    st.sampled_from([None, "stream", "cache", "softcap"]),
    st.sampled_from(["auto", "flex", "rows"]),
    st.sampled_from([3, 1]),
    st.booleans(),
)
def test_random_workloads_match_reference(cfg_q, seed, block_size, positions, path, segments, learned_sinks):
    """Every attention path agrees with the reference: FlexAttention, and the rows path both in place
    (the step uses most of the pool's slot rows) and gathered (one segment against up to 4 slots),
    with a score_mod on either position mode or soft-capping, and with learned sinks."""
    cfg, q_heads = cfg_q
    if path == "flex" and not cpu_kernel_block_exact(block_size):
        block_size = 16  # a forced flex path at a block the CPU kernel miscomputes is refused when built
    work = RandomWorkload(
        cfg,
        q_heads=q_heads,
        segments=segments,
        seed=seed,
        manager=BoundedKVManager(cfg, "cpu", block_size=block_size,
                                 options=AttentionOptions.for_cache(cfg, "cpu", path=path)),
        score_mod=SCORE_MODS[positions],
        positions="cache" if positions == "cache" else "stream",
        sinks=torch.linspace(-1.0, 1.5, q_heads) if learned_sinks else None,
        tolerance=TOL,
    )
    for _ in range(10):
        work.step()
    assert work.worst_relative < REL_TOL, f"relative error {work.worst_relative} for {cfg}"


@pytest.mark.parametrize("slot_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_long_streams_wrap_the_ring_many_times(slot_dtype):
    """Streams of ~80 steps through a window of 5: the ring wraps over and over, slots get reused
    (quantized slots too: a cell keeps the value of its one write however often the ring wraps)."""
    cfg = BoundedKVConfig(
        num_layers=1, num_heads=2, head_dim=8, rows_per_request=2, max_source_len=4,
        retention=lambda n: SinkWindow(2 + n % 3, 5), max_slots=3, max_step_tokens=3, max_sources=2,
        slot_dtype=slot_dtype,
    )
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=7, churn=0.05, tolerance=TOL)
    for _ in range(80):
        work.step()
    assert max(s[2] for s in work.state.values()) > 5 * cfg.window_capacity
    assert work.worst_relative < REL_TOL


def test_quantized_slots_store_8_bit_cells_that_differ_from_the_inputs():
    """The quantized cache really stores its cells in 8 bits: against the reference on the
    unquantized inputs it is off by about the quantization step, against the reference on the
    dequantized cells it agrees."""
    for slot_dtype, lo, hi in ((torch.int8, 1e-3, 5e-2), (torch.float8_e4m3fn, 5e-3, 2e-1)):
        cfg = BoundedKVConfig(num_layers=1, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=3,
                              retention=SinkWindow(2, 6), max_slots=2, max_step_tokens=2, slot_dtype=slot_dtype)
        work = RandomWorkload(cfg, q_heads=4, segments=2, seed=3, tolerance=TOL)
        assert work.manager.k_cache_0.dtype == slot_dtype and work.manager.v_cache_0.dtype == slot_dtype
        raw = RandomWorkload(cfg, q_heads=4, segments=2, seed=3)
        raw.stored = lambda x: x  # the reference on the unquantized keys and values
        for _ in range(12):
            work.step()
            raw.step()
        assert work.worst_relative < REL_TOL
        assert lo < raw.worst_relative < hi, (slot_dtype, raw.worst_relative)


def test_padding_rows_return_zeros_and_write_nothing():
    cfg = BoundedKVConfig(1, 1, 4, 1, 0, SinkWindow(1, 3), max_slots=2, max_step_tokens=2)
    work = RandomWorkload(cfg, segments=2, seed=3, churn=0.0, tolerance=TOL)
    work.slots = ["a", None]
    work.state["a"] = [0, 0, 0]
    work._churn = lambda: None  # keep segment 1 padding throughout
    outs = []
    work.attend_fn = lambda m, plan, qs, ks, vs: outs.append(m.attend(0, qs[0], ks[0], vs[0], plan)) or outs[-1:]
    for _ in range(4):
        work.step()
    assert all(torch.equal(o[1], torch.zeros_like(o[1])) for o in outs)
    assert all(o[0].abs().sum() > 0 for o in outs)
    # Nothing outside request a's slot row and the scratch cells was written.
    lay = work.manager.layout
    a = lay.slot_row(work.manager.slot_of("a"), 0)
    after = work.manager.k_cache_0
    untouched = torch.ones(lay.total_len, dtype=torch.bool)
    untouched[a:a + lay.slot_row_len] = False
    untouched[lay.scratch_base:lay.scratch_base + lay.step_tokens] = False
    assert torch.count_nonzero(after[0, :, untouched]) == 0


def test_a_workload_fails_at_the_first_step_past_its_tolerance_and_names_it():
    """A wrong value in one request's output of one layer fails that step, naming step, layer, request
    and element, rather than one largest error at the end of the run."""
    cfg = BoundedKVConfig(2, 1, 4, 1, 0, SinkWindow(1, 3), max_slots=2, max_step_tokens=1)
    work = RandomWorkload(cfg, segments=2, seed=3, churn=0.0, fixed_tokens=1, tolerance=TOL)
    work.slots = ["a", "b"]
    work.state.update(a=[0, 0, 0], b=[0, 0, 0])
    work._churn = lambda: None

    def attend(m, plan, qs, ks, vs):
        outs = [m.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(2)]
        if work.steps == 3:
            outs[1][1, 0, 0, 2] += 0.5  # request b's row, layer 1
        return outs

    work.attend_fn = attend
    for _ in range(3):
        work.step()
    with pytest.raises(AssertionError, match=r"^step 3 \(T=1\), layer 1, request 'b' \(segment 1, rows 1\.\.1\): "
                                             r"\|output - reference\| reaches 0\.5\d* > 0\.0001 \(first at index "
                                             r"\(0, 0, 0, 2\) of shape \(1, 1, 1, 4\)\)$"):
        work.step()
    assert work.steps == 3  # the failing step is the one named, and nothing after it ran
