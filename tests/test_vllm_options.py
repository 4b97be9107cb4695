"""The `flexkv` entry of vLLM's additional_config (flexkv.integrations.vllm.options): no vLLM needed."""

from types import SimpleNamespace

import pytest

from flexkv import SinkWindow
from flexkv.integrations.vllm.options import (
    check_engine,
    positions_from,
    refusals,
    request_retention,
    retention_from,
    rope_table_len,
    serving_positions,
    startup_line,
)


def model(max_model_len=8192, max_position_embeddings=8192, **hf):
    hf.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 100000.0})
    return SimpleNamespace(max_model_len=max_model_len,
                           hf_text_config=SimpleNamespace(max_position_embeddings=max_position_embeddings, **hf))


def engine(**over):
    cfg = dict(cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"), speculative_config=None,
               parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
               additional_config={"flexkv": {"sink": 4, "window": 1020}}, model_config=model())
    cfg.update(over)
    return SimpleNamespace(**cfg)


def entry(**kw):
    return {"flexkv": {"sink": 4, "window": 1020, **kw}}


def test_the_entry_is_a_sink_window():
    assert retention_from({"flexkv": {"sink": 4, "window": 1020}}) == SinkWindow(4, 1020)
    assert retention_from({"flexkv": {"sink": 0, "window": 7, "positions": "stream"}}) == SinkWindow(0, 7)
    assert retention_from({}) is None and retention_from(None) is None and retention_from({"other": 1}) is None


@pytest.mark.parametrize("entry, match", [
    ([4, 1020], "must be a dict"),
    ({"sink": 4}, r"needs \['window'\]"),
    ({"sink": 4, "window": 8, "ring": 3}, r"unknown keys \['ring'\]"),
    ({"sink": 4.0, "window": 8}, r'\["sink"\] must be an int, got 4.0'),
    ({"sink": -1, "window": 8}, "SinkWindow.sink must be >= 0, got -1"),
    ({"sink": 4, "window": 0}, r'\["window"\] must be >= 1'),
    ({"sink": 4, "window": 8, "positions": "in-cache"}, r"must be one of \['cache', 'stream'\], got 'in-cache'"),
])
def test_a_bad_entry_is_refused_naming_it(entry, match):
    with pytest.raises(ValueError, match=match):
        retention_from({"flexkv": entry})


@pytest.mark.parametrize("where", ["engine", "request nested", "request flat"])
def test_a_recall_memory_is_refused_at_start_up_and_per_request_with_the_reason(where):
    """vLLM frees the blocks that leave the window and its backends read the window only: a memory asked of
    the plugin is refused by name, never served as sinks + window."""
    with pytest.raises(ValueError, match=r"\['memory', 'top_k'\].*Recall .* is not served in vLLM.*frees"):
        if where == "engine":
            retention_from(entry(memory=2048, top_k=4))
        elif where == "request nested":
            request_retention({"flexkv": {"sink": 4, "window": 64, "memory": 2048, "top_k": 4}}, SinkWindow(4, 1020))
        else:
            request_retention({"flexkv_memory": 2048, "flexkv_top_k": 4}, SinkWindow(4, 1020))


def test_what_cannot_be_served_exactly_is_refused_with_every_reason():
    assert check_engine(engine()) == SinkWindow(4, 1020)
    assert check_engine(engine(additional_config={})) is None
    bad = engine(cache_config=SimpleNamespace(enable_prefix_caching=True, cache_dtype="fp8"),
                 speculative_config=object(), kv_transfer_config=object(),
                 parallel_config=SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1,
                                                 pipeline_parallel_size=2, tensor_parallel_size=2))
    why = refusals(bad)
    assert len(why) == 5 and "speculative" in why[0] and "fp8" in why[1]  # prefix caching and TP are served
    assert "pipeline_parallel_size=2" in why[2] and "KV connector" in why[3]
    assert "decode_context_parallel_size=2" in why[4]
    with pytest.raises(ValueError, match=r"cannot serve SinkWindow\(sink=4, window=1020.* exactly in this engine"):
        check_engine(bad)


def test_positions_default_to_in_cache_ones_where_the_rope_type_is_served():
    assert positions_from(entry()) is None and positions_from(entry(positions="stream")) == "stream"
    assert serving_positions(engine()) == "cache"
    assert serving_positions(engine(additional_config=entry(positions="stream"))) == "stream"
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert serving_positions(engine(model_config=model(rope_parameters=llama3))) == "cache"
    # a rope type whose rows are not plain rotations (YaRN scales them), or no rotary at all: stream positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    assert serving_positions(engine(model_config=model(rope_parameters=yarn))) == "stream"
    assert serving_positions(engine(model_config=model(rope_parameters=None))) == "stream"
    with pytest.raises(ValueError, match=r"rope_type 'yarn'.*use \"positions\": \"stream\""):
        check_engine(engine(model_config=model(rope_parameters=yarn), additional_config=entry(positions="cache")))


def test_streams_past_a_rotary_table_flexkv_cannot_lengthen_are_refused():
    # plain rope: the plugin lengthens the table, so a longer max_model_len is served
    assert refusals(engine(model_config=model(max_model_len=65536))) == []
    assert rope_table_len(model(rope_parameters={"rope_type": "linear", "factor": 2.0}).hf_text_config) == 16384
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    (why,) = refusals(engine(model_config=model(max_model_len=65536, rope_parameters=dynamic)))
    assert "max_model_len=65536 is past the model's rotary table (8192 positions, rope_type 'dynamic')" in why
    assert "use max_model_len <= 8192" in why
    assert refusals(engine(model_config=model(max_model_len=8192, rope_parameters=dynamic))) == []
    (why,) = refusals(engine(model_config=model(max_model_len=4096, max_position_embeddings=1024,
                                                rope_parameters=None)))
    assert "1024 learned positions" in why


def test_the_startup_line_says_how_many_keys_a_query_reads():
    line = startup_line(SinkWindow(4, 1020), "cache", 65536)
    assert "each query reads at most 1025 keys" in line and "sliding_window=1021 plus 4 sinks" in line
    assert "positions 'cache'" in line and "vLLM's sliding-window kernel" in line
    cached = startup_line(SinkWindow(4, 1020), "cache", 65536, prefix_caching=True)
    assert "prefix caching on" in cached and "sliding-window kernel, the sinks copied into scratch blocks" in cached
    assert line.endswith("a request may keep less (SamplingParams extra_args {'flexkv': {'sink': ..., 'window': ...}})")
    refused = startup_line(SinkWindow(4, 1020), "cache", 65536, own_requests="in vLLM's CPU backend only so far")
    assert refused.endswith("a request's own retention is refused (served in vLLM's CPU backend only so far)")


def test_the_vllm_release_is_checked():
    from flexkv.integrations.vllm import check_vllm_version

    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    for version in ("0.33.0", "0.3.2", "0.320.0"):
        with pytest.raises(RuntimeError, match=f"supports vLLM 0.32.x; this environment has vLLM {version}"):
            check_vllm_version(version)


def test_a_request_narrows_the_engines_retention_and_leaves_out_what_it_keeps():
    engine = SinkWindow(4, 1020)
    assert request_retention(None, engine) is None and request_retention({"seed_note": 1}, engine) is None
    assert request_retention({"flexkv": {"sink": 2, "window": 252}}, engine) == SinkWindow(2, 252)
    assert request_retention({"flexkv": {"window": 252}}, engine) == SinkWindow(4, 252)
    assert request_retention({"flexkv_sink": 0, "other": 1}, engine) == SinkWindow(0, 1020)  # vllm_xargs, flat
    assert request_retention({"flexkv": {}}, engine) == engine
    # The whole prompt as sinks: known once the prompt is (None until then), within the engine's sinks.
    big = SinkWindow(512, 1020)
    assert request_retention({"flexkv": {"sink": "prompt", "window": 64}}, big) is None
    assert request_retention({"flexkv": {"sink": "prompt", "window": 64}}, big, prompt_len=300) == SinkWindow(300, 64)


@pytest.mark.parametrize("extra, match", [
    ({"flexkv": {"window": 2000}}, r"window must be an int in \[1, 1020\] .* got 2000; the engine serves at most "
                                   r"sink 4 \+ window 1020 .* start it with a wider one"),
    ({"flexkv": {"sink": 5}}, r'sink must be an int in \[0, 4\] or "prompt", got 5'),
    ({"flexkv": {"window": 0}}, r"window must be an int in \[1, 1020\]"),
    ({"flexkv": {"window": 8.0}}, r"window must be an int .* got 8.0"),
    ({"flexkv": {"sink": True}}, r"sink must be an int .* got True"),
    ({"flexkv": {"sink": "prompt"}}, r'sink "prompt" keeps the whole prompt, 9 tokens, as sinks, more than the '
                                     r"engine's sink 4"),
    ({"flexkv": {"windw": 8}}, r'extra_args\["flexkv"\] must be a dict with keys among \[\'sink\', \'window\'\]'),
    ({"flexkv": 8}, r'extra_args\["flexkv"\] must be a dict'),
    ({"flexkv_windw": 8, "FlexKV": 1}, r"extra_args \['FlexKV', 'flexkv_windw'\]: not a key flexkv reads"),
    ({"flexkv": {"sink": 1}, "flexkv_window": 8}, r'gives both "flexkv" and \[\'flexkv_window\'\]; give one'),
])
def test_a_request_retention_flexkv_cannot_serve_is_refused_naming_the_value(extra, match):
    with pytest.raises(ValueError, match=match):
        request_retention(extra, SinkWindow(4, 1020), prompt_len=9)


def test_an_engine_without_the_entry_refuses_a_request_retention():
    assert request_retention({"seed_note": 1}, None) is None
    with pytest.raises(ValueError, match=r"this engine serves no flexkv retention .* drop the key"):
        request_retention({"flexkv_window": 8}, None)


def test_a_request_retention_is_served_on_the_cpu_platforms_v1_runner_only():
    from flexkv.integrations.vllm.requests import own_retention_unserved

    cpu, cuda = SimpleNamespace(is_cpu=lambda: True), SimpleNamespace(is_cpu=lambda: False)
    assert own_retention_unserved(SimpleNamespace(use_v2_model_runner=False), cpu) == ""
    assert "CPU backend only" in own_retention_unserved(SimpleNamespace(use_v2_model_runner=False), cuda)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in own_retention_unserved(SimpleNamespace(use_v2_model_runner=True), cpu)
