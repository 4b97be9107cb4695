"""Config validation, derived sizes, and the engine seams (specs, resources, deployment YAML)."""

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVManager, SinkWindow
from flexkv.serving import BoundedKVResource, BoundedKVSpec, EngineResourceInfo, load_deployment


def make(**kw):
    base = dict(num_layers=2, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
                retention=SinkWindow(4, 16))
    base.update(kw)
    return BoundedKVConfig(**base)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_slots=0), r"max_slots must be >= 1, got 0"),
        (dict(num_layers=0), r"num_layers must be >= 1, got 0"),
        (dict(head_dim=2.0), r"head_dim must be an int >= 1, got 2.0"),
        (dict(max_source_len=4, min_source_len=5), r"min_source_len must be in \[0, max_source_len=4\], got 5"),
        (dict(min_source_len=-1), r"min_source_len must be >= 0, got -1"),
        (dict(max_step_tokens=0), r"max_step_tokens must be >= 1, got 0"),
        (dict(max_source_len=3, max_sources=0), r"max_sources must be >= 1 when max_source_len > 0"),
        (dict(dtype=torch.int32), r"dtype must be one of"),
        (dict(retention=lambda n: (4, 16)), r"for source_len=0 it gave \(4, 16\)"),
        (dict(query_window=8, reverse_step_order=True), r"query_window needs stream order"),
        (dict(query_window=17), r"query_window=17 needs window >= 17 for every source length, but source_len=0"),
        (dict(query_window=4, retention=SinkWindow(0, 8, True)), r"cannot be combined with window_includes_step"),
        (dict(query_window=-1), r"query_window must be >= 0, got -1"),
        (dict(causal_step=True, reverse_step_order=True), r"causal_step=True needs stream order"),
        (dict(causal_step=True, query_window=8), r"causal_step=True is a per-step window .* query_window=8"),
        (dict(causal_step=1), r"causal_step must be a bool, got 1"),
    ],
)
def test_invalid_configs_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(sink=-1, window=3), r"SinkWindow.sink must be >= 0, got -1"),
    (dict(sink=1, window=-3), r"SinkWindow.window must be >= 0, got -3"),
    (dict(sink=1, window=3, window_includes_step=1), r"window_includes_step must be a bool"),
])
def test_invalid_policies(kw, match):
    with pytest.raises(ValueError, match=match):
        SinkWindow(**kw)


@pytest.mark.parametrize("context", [0, -2, 3.0, True])
def test_keys_refuses_a_context_that_is_not_a_positive_int(context):
    with pytest.raises(ValueError, match=r"SinkWindow.keys: context must be an int >= 1"):
        SinkWindow.keys(context)


def test_keys_counts_the_query_among_the_context():
    """`SinkWindow.keys(C)`: a decode query attends C keys, itself included; the literal
    `SinkWindow(0, C)` would attend C + 1 (the definition in `flexkv.model.reference`)."""
    from flexkv.model.reference import attended_indices

    C = 5
    for written in range(0, 12):
        for policy, want in ((SinkWindow.keys(C), C), (SinkWindow(0, C), C + 1), (SinkWindow(0, C - 1), C)):
            sets = attended_indices(make(retention=policy), 0, written, 1, 1)
            assert len(sets[0]) == min(want, written + 1)
    assert SinkWindow.keys(C, sink=2) == SinkWindow(2, C, window_includes_step=True)


def test_keys_with_causal_step_is_a_ring_of_context_entries():
    """Chunks of T written tokens under `SinkWindow.keys(C)` and `causal_step=True`: query t attends
    the last C entries before the chunk's end that are not after it (a ring cache of C entries)."""
    from flexkv.model.reference import attended_indices

    C, T = 6, 3
    cfg = make(retention=SinkWindow.keys(C), causal_step=True, max_step_tokens=T)
    for written in range(0, 15):
        end = written + T  # one past the chunk's last stream index
        for t, got in enumerate(attended_indices(cfg, 0, written, T, T)):
            assert got == [j for j in range(max(0, end - C), written + t + 1)]


def test_callable_policy_checked_for_every_length():
    with pytest.raises(ValueError, match=r"SinkWindow.window must be >= 0, got -1"):
        make(max_source_len=5, retention=lambda n: SinkWindow(1, 3 - n))


def test_derived_sizes_over_source_lengths():
    # L in 2..5: sink 6 - L .. ; windows 10 + L.
    c = make(max_source_len=5, min_source_len=2, retention=lambda n: SinkWindow(6, 10 + n))
    assert c.retention_for(2) == SinkWindow(6, 12)
    assert c.sink_capacity == 4  # 6 - 2, the shortest source
    assert c.window_capacity == 15
    assert c.max_retained == 21
    assert c.slot_tokens == 19
    with pytest.raises(ValueError, match=r"source_len must be an int in \[min_source_len=2, max_source_len=5\], got 1"):
        c.retention_for(1)


def test_value_head_dim_resolves_to_the_key_width_and_follows_it_through_replace():
    same = make()
    assert same.value_head_dim == 8 and same == make(value_head_dim=8)  # None and 8 describe one cache
    assert same.replace(head_dim=16).value_head_dim == 16  # given no value width: values as wide as keys
    narrow = make(value_head_dim=4)
    assert narrow.value_head_dim == 4 and narrow.replace(head_dim=16).value_head_dim == 4  # given: kept
    assert same.replace(value_head_dim=6).replace(head_dim=32).value_head_dim == 6
    with pytest.raises(ValueError, match=r"value_head_dim must be >= 1, got 0 \(or None for the same width as "
                                         r"head_dim\)"):
        make(value_head_dim=0)


def test_sink_inside_the_source_needs_no_sink_capacity():
    c = make(max_source_len=8, min_source_len=4, retention=SinkWindow(4, 6))
    assert c.sink_capacity == 0 and c.slot_tokens == 6


def test_window_start():
    p = SinkWindow(2, 5)
    assert p.window_start(20, 1) == 15
    assert p.window_start(3, 1) == 2  # never below the sink
    q = SinkWindow(2, 5, window_includes_step=True)
    assert q.window_start(20, 3) == 18
    assert q.window_start(20, 7) == 20  # window <= 0: nothing but the sinks


def test_spec_yaml_overrides_and_resource_build():
    spec = BoundedKVSpec("kv", ("attn0", "attn1"), make(dtype=None))
    tuned = spec.apply_yaml_overrides(max_slots=5)
    assert tuned.config.max_slots == 5 and spec.config.max_slots == 32
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'max_slot' in the YAML block for resource 'kv'"):
        spec.apply_yaml_overrides(max_slot=5)
    with pytest.raises(ValueError, match=r"max_slots must be >= 1, got 0"):
        spec.apply_yaml_overrides(max_slots=0)
    m = BoundedKVResource().build(tuned, EngineResourceInfo("cpu", torch.float16))
    assert isinstance(m, BoundedKVManager)
    assert m.config.dtype == torch.float16 and m.k_cache_0.dtype == torch.float16
    assert m.config.max_slots == 5
    with pytest.raises(ValueError, match=r"config.dtype is None"):
        BoundedKVManager(make(dtype=None))


def test_deployment_yaml(tmp_path):
    specs = [BoundedKVSpec("chat", (), make()), BoundedKVSpec("tts", (), make())]
    path = tmp_path / "deploy.yaml"
    path.write_text("resources:\n  tts:\n    max_slots: 3\n")
    out = load_deployment(path, specs)
    assert [s.config.max_slots for s in out] == [32, 3]
    with pytest.raises(ValueError, match=r"unknown resource 'asr'; declared resources: 'chat', 'tts'"):
        load_deployment("resources:\n  asr:\n    max_slots: 3\n", specs)
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'window' in the YAML block for resource 'chat'"):
        load_deployment("resources:\n  chat:\n    window: 3\n", specs)
    with pytest.raises(ValueError, match=r"unknown top-level key"):
        load_deployment("resource:\n  chat: {}\n", specs)
    with pytest.raises(ValueError, match=r"not valid YAML"):
        load_deployment("resources: [\n", specs)


def test_shipped_deployment_example_loads():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    specs = [BoundedKVSpec("chat_kv", (), make()), BoundedKVSpec("tts_kv", (), make())]
    out = load_deployment(root / "configs" / "deployment.yaml", specs)
    assert [s.config.max_slots for s in out] == [64, 8]


def test_sink_window_is_a_named_tuple():
    pol = SinkWindow(4, 16)
    sink, window, includes = pol
    assert (sink, window, includes) == (4, 16, False) and pol[1] == 16 and pol._fields[:2] == ("sink", "window")
    wider = pol._replace(window=32)
    assert isinstance(wider, SinkWindow) and wider == (4, 32, False) and pol.window == 16
    assert wider.window_start(100, 1) == 68 and SinkWindow._make((1, 2, True)).window_includes_step


@pytest.mark.parametrize("make, match", [
    (lambda: SinkWindow(4, 16)._replace(sink=-1), r"SinkWindow.sink must be >= 0, got -1"),
    (lambda: SinkWindow(4, 16)._replace(window=2.5), r"SinkWindow.window must be an int >= 0, got 2.5"),
    (lambda: SinkWindow._make((1, 2, "yes")), r"SinkWindow.window_includes_step must be a bool, got 'yes'"),
])
def test_sink_window_replace_and_make_validate(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_stream_position_is_a_named_tuple():
    from flexkv import StreamPosition

    pos = StreamPosition(3, 5)
    source_len, written, source = pos
    assert (source_len, written, source) == (3, 5, 0) and pos.length == 8 and pos[1] == 5
    later = pos._replace(written=9)
    assert isinstance(later, StreamPosition) and later.length == 12 and pos.written == 5


def test_a_ring_of_keys_fed_chunks_attended_whole_is_refused_with_the_fix():
    """`SinkWindow.keys(C)` records that it is a ring; chunks under it need causal_step (or a per-query
    window). The literal spelling of chunks attended whole is still allowed."""
    C = 8
    ring = SinkWindow.keys(C, sink=1)
    assert ring.ring_keys == C and SinkWindow(1, C, window_includes_step=True).ring_keys is None
    assert ring == SinkWindow(1, C, window_includes_step=True) and repr(ring) == "SinkWindow.keys(8, sink=1)"
    with pytest.raises(ValueError, match=r"SinkWindow.keys\(8, sink=1\) .* is a ring of 8 keys.*causal_step=True.*"
                                         r"query_window=7 with SinkWindow\(1, 7\).*SinkWindow\(1, 8, "
                                         r"window_includes_step=True\)"):
        make(retention=ring, max_step_tokens=4)
    with pytest.raises(ValueError, match="is a ring of 8 keys"):
        make(retention=lambda L: SinkWindow.keys(C, sink=L), max_source_len=2, max_step_tokens=4)
    make(retention=ring, max_step_tokens=4, causal_step=True)
    make(retention=ring, max_step_tokens=1)  # decode: a ring of C keys is exactly this
    make(retention=SinkWindow(1, C, window_includes_step=True), max_step_tokens=4)
