"""Private sources (`StreamPosition.source=-1`): a prefix of one request's own, in a source place.

Layout used below: 3 source places of up to 6 entries, 2 rows per request
(CFG), `SinkWindow(3, 5)`, 2 KV heads with 2-way GQA, steps of up to 3 tokens.
"""

import random

import pytest
import torch
from random_workload import check_close

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, SinkWindow, SourcesExhausted, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.model.reference import ReferenceCache

H, HQ, D, R = 2, 4, 8, 2


@pytest.fixture
def config():
    return small_config(rows_per_request=R, max_source_len=6, max_sources=3, retention=SinkWindow(3, 5))


@pytest.fixture
def manager(config):
    return BoundedKVManager(config, block_size=8)


def prefix(config, length, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (config.num_layers, R, H, length, D)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def start(m, rid, source_len, source):
    m.admit(BoundedKVStep((Segment(rid, 0),), {rid: StreamPosition(source_len, 0, source)}))


@pytest.mark.parametrize("path", ["flex", "rows"])
def test_private_prefixes_match_the_reference(config, path):
    """Two requests with prefixes of their own and one reading a shared source, 12 random steps."""
    manager = BoundedKVManager(config, block_size=8, options=AttentionOptions.for_cache(config, "cpu", path=path))
    ref = ReferenceCache(config)
    shared = prefix(config, 4, 0)
    ref.add_source(manager.add_source(*shared), *shared)
    streams = {"a": (5, -1), "b": (2, -1), "c": (4, 0)}
    for seed, (rid, (length, source)) in enumerate(streams.items(), start=1):
        if source == -1:
            keys, values = prefix(config, length + seed % 2, seed)  # a prefix may be longer than what is read
            manager.add_private_source(rid, keys, values)
            ref.add_private_source(rid, keys, values)
        start(manager, rid, length, source)
    rng = random.Random(0)
    written = dict.fromkeys(streams, 0)
    for s in range(12):
        T = rng.randint(1, 3)
        segs = tuple(Segment(rid, rng.randint(0, T)) for rid in streams)
        step = BoundedKVStep(segs, {rid: StreamPosition(streams[rid][0], written[rid], streams[rid][1])
                                    for rid in streams}, tokens=T)
        manager.admit(step)
        plan = manager.plan(step)
        for layer in range(config.num_layers):
            q, k, v = torch.randn(3 * R, HQ, T, D), torch.randn(3 * R, H, T, D), torch.randn(3 * R, H, T, D)
            got = manager.attend(layer, q, k, v, plan)
            want = ref.attend(layer, q, k, v, step)
            for i, rid in enumerate(streams):
                check_close(got[i * R:(i + 1) * R], want[i * R:(i + 1) * R], 1e-5,
                            f"step {s} (T={T}), layer {layer}, request {rid!r}")
        manager.commit(step)
        ref.commit(step)
        for seg in segs:
            written[seg.request_id] += seg.span
    assert min(written.values()) > config.window_capacity  # streams ran past their windows


def test_a_private_source_takes_a_source_place_until_the_request_is_removed(config, manager):
    manager.add_source(*prefix(config, 4, 0))
    manager.add_private_source("a", *prefix(config, 3, 1))
    index = manager.add_private_source("b", *prefix(config, 3, 2))
    assert manager.private_sources == {"a": 1, "b": 2} and set(manager.sources) == {0}
    with pytest.raises(SourcesExhausted, match="2 by private sources"):
        manager.add_source(*prefix(config, 2, 3))
    start(manager, "b", 3, -1)
    manager.remove_request("b")
    assert manager.private_sources == {"a": 1}
    assert manager.add_source(*prefix(config, 2, 3)) == index  # the place is free again


def test_reset_keeps_the_private_source_for_the_restarted_stream(config, manager):
    manager.add_private_source("a", *prefix(config, 4, 1))
    start(manager, "a", 4, -1)
    manager.commit(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(4, 0, -1)}, tokens=2))
    manager.reset_request("a")
    assert manager.private_sources == {"a": 0}
    start(manager, "a", 3, -1)  # reads a shorter part of the same prefix
    with pytest.raises(ValueError, match="is reading it"):
        manager.remove_private_source("a")
    manager.reset_request("a")
    manager.remove_private_source("a")
    assert manager.private_sources == {} and manager.sources == {}


def test_source_minus_one_without_a_private_source_is_refused_and_changes_nothing(config, manager):
    manager.add_private_source("b", *prefix(config, 2, 1))
    before = (manager.free_slots, manager.requests)
    step = BoundedKVStep((Segment("b", 1), Segment("a", 1)),
                         {"b": StreamPosition(2, 0, -1), "a": StreamPosition(3, 0, -1)})
    with pytest.raises(ValueError, match=r"request 'a': source=-1 .* add_private_source\('a'"):
        manager.admit(step)
    assert (manager.free_slots, manager.requests) == before


def test_a_private_source_for_the_padding_id_is_refused_and_takes_no_place(config, manager):
    with pytest.raises(ValueError, match=r"add_private_source: request_id None is reserved for padding"):
        manager.add_private_source(None, *prefix(config, 2, 1))
    assert manager.private_sources == {} and manager.slots.next_place() == 0


def test_bad_private_declarations_name_the_value(config, manager):
    index = manager.add_private_source("a", *prefix(config, 2, 1))
    with pytest.raises(ValueError, match="source_len=4 is longer than its private source \\(2 entries\\)"):
        start(manager, "a", 4, -1)
    with pytest.raises(ValueError, match=f"source {index} is request 'a'.s private source"):
        start(manager, "x", 2, index)
    with pytest.raises(ValueError, match=f"remove_source: source {index} is request 'a'.s private source"):
        manager.remove_source(index)
    with pytest.raises(ValueError, match="already has private source"):
        manager.add_private_source("a", *prefix(config, 2, 2))
    with pytest.raises(ValueError, match="source must be a registered source index >= 0, or -1"):
        start(manager, "y", 0, -2)
    start(manager, "a", 2, -1)
    manager.remove_request("a")
    start(manager, "z", 0, 0)
    with pytest.raises(ValueError, match="has started its stream"):
        manager.add_private_source("z", *prefix(config, 2, 3))
