"""`Selection`, the one owner of a FlexKVCache's batch rows: its docstring's worked example, step by step,
and the same facts read back through the cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from flexkv import SinkWindow  # noqa: E402
from flexkv.integrations.transformers import FlexKVCache  # noqa: E402
from flexkv.integrations.transformers.selection import Selection  # noqa: E402
from hf_models import make_model, prompts  # noqa: E402


def test_the_worked_example():
    s = Selection()
    assert s.rows(2) == (0, 1)
    s.select(("a", "b"))
    assert s.save() == (("a", "b"), 0)
    s.advance(("a", "b"), 5)
    s.take_back(2)
    saved = s.save()
    assert saved == (("a", "b"), 3)
    s.advance(("a", "b"), 1)
    s.restore(saved)
    assert (s.streams, s.columns) == (("a", "b"), 3)


def test_more_columns_than_were_fed_cannot_be_taken_back():
    s = Selection()
    s.advance((0,), 2)
    with pytest.raises(ValueError, match=r"take_back\(3\): only 2 columns"):
        s.take_back(3)
    assert s.columns == 2


def test_a_fed_stream_owes_nothing():
    s = Selection()
    s.owe("a", 7)
    s.owe("b", torch.tensor(9))
    s.fed("a")
    assert s.owed == {"b": 9}


def test_the_cache_reads_its_selection_and_length_from_the_one_object():
    model = make_model("llama", seed=4)
    cache = FlexKVCache(model, SinkWindow(2, 8), max_streams=2, block_size=16)
    with torch.no_grad():
        model(input_ids=torch.stack(prompts((3, 3), seed=1)), cache=cache.select(["x", "y"]))
    assert cache.selection == cache.selected.streams == ("x", "y")
    assert cache.get_seq_length() == cache.selected.columns == 3
    cache.reset()
    assert (cache.selected.streams, cache.selected.columns) == (None, 0)
