"""The rows path with its CPU fast paths on and off (`AttentionOptions.cpu_fast_paths`).

Off, the rows path runs the plain reference (`row_attention.attend_rows`); on, it goes through
`flexkv.cache.cpu.cpu_fast_rows`. Both are checked against the dense float64 reference
(`flexkv.model.reference`, driven by `random_workload.RandomWorkload`), eagerly and compiled, and
the switch is checked to really bypass the fast paths: none of their functions or custom ops runs,
no scratch is allocated, no memo is kept.
"""

import pytest
import torch
import torch._dynamo
from random_workload import RandomWorkload, score_bias

from flexkv import BoundedKVConfig, BoundedKVManager, SinkWindow
from flexkv.cache.cpu import cpu_fast_rows, gathered_rows, quantized_rows
from flexkv.cache.cpu.fast_rows_path import FastRowsPath
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.paths.rows_path import RowsPath
from single_thread import one_thread  # noqa: F401

TOL = 1e-4
REL_TOL = 1e-5


def _config(slot_dtype=None, sources=False, tokens=3, layers=2):
    return BoundedKVConfig(
        num_layers=layers, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=5 if sources else 0,
        retention=lambda n: SinkWindow(1 + n % 3, 6), max_slots=3, max_step_tokens=tokens,
        max_sources=1 if sources else 0, slot_dtype=slot_dtype,
    )


def _manager(cfg, fast: bool, path: str = "rows") -> BoundedKVManager:
    return BoundedKVManager(cfg, "cpu", block_size=16,
                            options=AttentionOptions.for_cache(cfg, "cpu", path=path, cpu_fast_paths=fast))


def _count(monkeypatch, module, name, calls):
    fn = getattr(module, name)

    def counted(*a, **k):
        calls.append(name)
        return fn(*a, **k)

    monkeypatch.setattr(module, name, counted)


def test_the_switch_is_an_option_on_by_default_and_checked():
    cfg = _config()
    assert AttentionOptions.for_cache(cfg, "cpu").cpu_fast_paths is True
    assert AttentionOptions().cpu_fast_paths is True
    with pytest.raises(ValueError, match="cpu_fast_paths must be a bool, got 'no'"):
        AttentionOptions(cpu_fast_paths="no")


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("slot_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("sources", [False, True])
@pytest.mark.parametrize("extras", ["plain", "score_mod", "sinks"])
def test_eager_rows_path_matches_the_reference_with_the_fast_paths_on_and_off(fast, slot_dtype, sources, extras):
    """Eager random workloads (churn, padding rows, ring wraps, GQA; in place without sources, gathered
    with them; one token or a chunk; a score_mod or learned sinks) on the rows path, either way."""
    cfg = _config(slot_dtype, sources)
    q_heads = 4
    work = RandomWorkload(cfg, q_heads=q_heads, segments=3, seed=5 + bool(sources), manager=_manager(cfg, fast),
                          score_mod=score_bias if extras == "score_mod" else None,
                          sinks=torch.linspace(-1.0, 1.5, q_heads) if extras == "sinks" else None,
                          churn=0.1, tolerance=TOL)
    for _ in range(25):
        work.step()
    assert work.worst_relative < REL_TOL


def _compiled(cfg, fast: bool, tokens: int, seed: int, q_heads: int = 4):
    manager = _manager(cfg, fast, path="auto")

    def model_step(qs, ks, vs, plan):
        return [manager.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(cfg.num_layers)]

    step = torch.compile(model_step, fullgraph=True)
    return RandomWorkload(cfg, q_heads=q_heads, segments=3, seed=seed, manager=manager, fixed_tokens=tokens,
                          attend=lambda m, plan, qs, ks, vs: step(qs, ks, vs, plan), churn=0.1, tolerance=TOL)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("slot_dtype, sources, tokens", [(torch.int8, False, 1), (None, True, 2)])
def test_compiled_rows_path_matches_the_reference_with_the_fast_paths_on_and_off(fast, slot_dtype, sources, tokens):
    """Compiled on the CPU's default path (rows for quantized slots and chunks): a quantized decode read
    in place and an unquantized chunk gathered beside a source, against the reference, without
    recompiling, with the fast paths on and off."""
    torch._dynamo.reset()
    cfg = _config(slot_dtype, sources, tokens=tokens, layers=1)
    work = _compiled(cfg, fast, tokens, seed=3)
    assert work.manager.path_for(tokens) == "rows"
    work.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(14):
            work.step()
    assert work.worst_relative < REL_TOL


def test_a_compiled_chunk_with_a_score_mod_reads_its_cells_stream_indices_from_the_plan(monkeypatch):
    """A chunk on the CPU rows path carries each gathered cell's stream index in the geometry made with its
    plan (`with_stream_index`): a compiled step's `score_mod` reads it there instead of forming it from the
    cells in every layer (forming it while tracing fails the fullgraph compile here), and the step still
    matches the reference, one graph throughout."""
    from flexkv.cache.positions import masks

    real = masks.stream_index

    def not_in_the_graph(*args):
        if torch.compiler.is_compiling():
            raise AssertionError("stream_index formed inside the compiled step")
        return real(*args)

    monkeypatch.setattr(masks, "stream_index", not_in_the_graph)
    torch._dynamo.reset()
    cfg = _config(None, False, tokens=3)
    manager = _manager(cfg, True, path="auto")

    def model_step(qs, ks, vs, plan):
        return [manager.attend(layer, qs[layer], ks[layer], vs[layer], plan, score_mod=score_bias)
                for layer in range(cfg.num_layers)]

    step = torch.compile(model_step, fullgraph=True)
    work = RandomWorkload(cfg, q_heads=4, segments=3, seed=7, manager=manager, fixed_tokens=3, score_mod=score_bias,
                          attend=lambda m, plan, qs, ks, vs: step(qs, ks, vs, plan), churn=0.1, tolerance=TOL)
    assert manager.path_for(3) == "rows"
    work.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(14):
            work.step()
    assert work.worst_relative < REL_TOL


FAST_FUNCTIONS = [(cpu_fast_rows, "attend"), (cpu_fast_rows, "geometry"), (cpu_fast_rows, "one_token_in_place"),
                  (cpu_fast_rows, "slot_pool"), (quantized_rows, "grouped_attention"),
                  (quantized_rows, "reduced_decode"), (quantized_rows, "widened_group"),
                  (quantized_rows, "dequantized_group"), (gathered_rows, "gathered_attention"),
                  (cpu_fast_rows, "gathered_attention"), (cpu_fast_rows, "gather_kv")]


@pytest.mark.parametrize("slot_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("sources", [False, True])
def test_with_the_switch_off_no_fast_path_runs_and_nothing_is_kept(monkeypatch, slot_dtype, sources):
    """Off: none of the fast paths' functions is called (each is counted), the cache allocates no
    rows scratch and keeps no memo. On, the same workload calls them (so the count can fail)."""
    calls = {True: [], False: []}
    for fast in (False, True):
        for module, name in FAST_FUNCTIONS:
            _count(monkeypatch, module, name, calls[fast])
        cfg = _config(slot_dtype, sources)
        m = _manager(cfg, fast)
        work = RandomWorkload(cfg, q_heads=4, segments=3, seed=2, manager=m, churn=0.1, tolerance=TOL)
        for _ in range(12):
            work.step()
        assert work.worst_relative < REL_TOL
        if not fast:
            assert m.store.scratch.get("rows") is None
            assert m.store.memos == {}
        monkeypatch.undo()
    assert calls[False] == []
    assert "attend" in calls[True] and "geometry" in calls[True]


def test_the_switch_chooses_the_rows_path_class_once():
    """`cpu_fast_paths` picks the rows path's class when the cache is built: the plain `RowsPath` (which
    adds nothing to a plan) off, `FastRowsPath` on; every call of the cache then goes to that one."""
    cfg = _config(None, False)
    assert type(_manager(cfg, False).paths.rows) is RowsPath
    assert type(_manager(cfg, True).paths.rows) is FastRowsPath


@pytest.mark.parametrize("slot_dtype, sources, tokens", [(torch.int8, False, 3), (None, True, 2)])
def test_a_compiled_step_with_the_switch_off_holds_none_of_the_fast_paths_ops(slot_dtype, sources, tokens):
    """The graph of a compiled step (fast paths off) holds no flexkv custom op; with them on, the
    same step holds one (the grouped dequantize of a chunk's 6 queries per row and head, or the
    gather of rows beside a source)."""
    ops = {}
    for fast in (False, True):
        cfg = _config(slot_dtype, sources, tokens=tokens, layers=1)
        m = _manager(cfg, fast)
        work = RandomWorkload(cfg, q_heads=4, segments=3, seed=1, manager=m, fixed_tokens=tokens, churn=0.0)
        work.step()
        plan = work.plan
        graphs = []
        q, k, v = (torch.randn(plan.rows, h, tokens, 16) for h in (4, 2, 2))
        with torch.no_grad():
            torch.compile(lambda q, k, v, plan: m.attend(0, q, k, v, plan), fullgraph=True,
                          backend=lambda gm, _: (graphs.append(gm), gm.forward)[1])(q, k, v, plan)
        ops[fast] = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("flexkv" in t for t in ops[False]), ops[False]
    assert any("flexkv" in t for t in ops[True]), ops[True]


def test_each_cache_owns_its_one_token_memos():
    """The host-built one-token geometry's memos live in the cache's store, not in the process: a
    second cache of the same config starts with none and never sees the first one's."""
    cfg = _config(tokens=1, layers=1)
    a, b = _manager(cfg, True, path="auto"), _manager(cfg, True, path="auto")
    work = RandomWorkload(cfg, q_heads=2, segments=3, seed=4, manager=a, fixed_tokens=1, churn=0.0, tolerance=TOL)
    for _ in range(4):
        work.step()
    assert a.store.memos.get("last_one_token")
    assert b.store.memos == {}
    assert a.store.memos is not b.store.memos
