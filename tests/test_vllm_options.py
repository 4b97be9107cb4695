"""The `flexkv` entry of vLLM's additional_config (flexkv.integrations.vllm.options): no vLLM needed."""

from types import SimpleNamespace

import pytest

from flexkv import SinkWindow
from flexkv.integrations.vllm.options import check_engine, refusals, retention_from


def engine(**over):
    cfg = dict(cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"), speculative_config=None,
               parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
               additional_config={"flexkv": {"sink": 4, "window": 1020}})
    cfg.update(over)
    return SimpleNamespace(**cfg)


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
    ({"sink": 4, "window": 8, "positions": "cache"}, "must be \"stream\", got 'cache'"),
])
def test_a_bad_entry_is_refused_naming_it(entry, match):
    with pytest.raises(ValueError, match=match):
        retention_from({"flexkv": entry})


def test_what_cannot_be_served_exactly_is_refused_with_every_reason():
    assert check_engine(engine()) == SinkWindow(4, 1020)
    assert check_engine(engine(additional_config={})) is None
    bad = engine(cache_config=SimpleNamespace(enable_prefix_caching=True, cache_dtype="fp8"),
                 speculative_config=object(),
                 parallel_config=SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))
    why = refusals(bad)
    assert len(why) == 4 and "prefix caching" in why[0] and "speculative" in why[1] and "fp8" in why[2]
    assert "decode_context_parallel_size=2" in why[3]
    with pytest.raises(ValueError, match=r"cannot serve SinkWindow\(sink=4, window=1020.* exactly in this engine"):
        check_engine(bad)
