"""Every flexkv cache speaks `flexkv.cache.protocol.StreamCache` exactly: the same members, and every
method with the protocol's parameters (names, order, kinds and defaults).

Annotations are not compared: each cache names its own plan type where the protocol says `Any`.
"""

import inspect

import pytest
import torch

from flexkv import BoundedKVConfig, SinkWindow
from flexkv.cache.groups import LayerGroup
from flexkv.cache.manager import BoundedKVManager
from flexkv.cache.protocol import PROTOCOL_MEMBERS, StreamCache, check_cache
from flexkv.model.uncached import UncachedHistory
from flexkv.serving.distributed import ShardedKVManager

CONFIG = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=4, rows_per_request=1, max_source_len=2,
                         retention=SinkWindow(1, 3), max_slots=2, dtype=torch.float32)
GROUPS = (LayerGroup((0,), SinkWindow(0, 2)), LayerGroup((1,), SinkWindow(1, 3)))

CACHES = {
    "BoundedKVManager": lambda: BoundedKVManager(CONFIG, block_size=8),
    "BoundedKVManager(groups)": lambda: BoundedKVManager(CONFIG, groups=GROUPS, block_size=8),
    "UncachedHistory": lambda: UncachedHistory(CONFIG, GROUPS),
    "ShardedKVManager": lambda: ShardedKVManager(CONFIG, rank=1, world_size=2, block_size=8),
    "ShardedKVManager(groups)": lambda: ShardedKVManager(CONFIG, groups=GROUPS, rank=1, world_size=2, block_size=8),
}

METHODS = [n for n in PROTOCOL_MEMBERS if inspect.isfunction(StreamCache.__dict__.get(n))]
PROPERTIES = [n for n in PROTOCOL_MEMBERS if isinstance(StreamCache.__dict__.get(n), property)]
ATTRIBUTES = [n for n in PROTOCOL_MEMBERS if n not in METHODS and n not in PROPERTIES]


def parameters(fn) -> list:
    """`(name, kind, default)` of each parameter after `self`."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def test_the_member_list_is_the_protocol_class_body():
    """PROTOCOL_MEMBERS is read from the class, so a member added there is checked everywhere."""
    declared = {n for n in vars(StreamCache) if not n.startswith("_")} | set(StreamCache.__annotations__)
    assert set(PROTOCOL_MEMBERS) == declared
    assert ATTRIBUTES == ["config", "compilable"]
    assert {"attend", "admit", "undo_admit", "slot_of", "layer_config"} <= set(METHODS)


@pytest.mark.parametrize("name", CACHES)
def test_each_cache_has_the_protocols_signatures(name):
    cache = CACHES[name]()
    cls = type(cache)
    assert isinstance(cache, StreamCache) and check_cache(cache, "test") is cache
    for member in METHODS:
        want, got = parameters(getattr(StreamCache, member)), parameters(getattr(cls, member))
        assert got == want, f"{name}.{member}{inspect.signature(getattr(cls, member))} differs from the protocol's"
    for member in PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, member), property), f"{name}.{member} is not a property"
    for member in ATTRIBUTES:
        assert hasattr(cache, member), f"{name} has no {member}"


def test_the_attend_modes_spell_out_every_keyword():
    """No `**kwargs`: a keyword a cache does not know is an error at the call, not swallowed; each mode is a
    method of its own with one result type (no mode flags)."""
    want = {
        "attend": ["scale", "score_mod", "positions", "sinks"],
        "attend_lse": ["scale", "score_mod", "positions", "sinks"],
        "attend_query_only": ["scale", "score_mod", "positions", "sinks"],
        "attend_joined": ["query_only", "scale", "sinks"],
    }
    for member, keywords in want.items():
        kinds = {p.kind for p in inspect.signature(getattr(StreamCache, member)).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds
        assert [n for n, kind, _ in parameters(getattr(StreamCache, member)) if kind == "KEYWORD_ONLY"] == keywords


def test_a_cache_missing_a_member_is_named():
    class Partial:
        config = CONFIG

    with pytest.raises(ValueError, match=r"StepContext: the cache must be a flexkv cache .* Partial lacks compilable, "
                                         r"layer_config, requests"):
        check_cache(Partial(), "StepContext")


@pytest.mark.parametrize("name", CACHES)
def test_position_is_the_one_record_of_where_a_stream_stands(name):
    """A request's position (source, source length, tokens written) is the cache's to answer: it
    follows admit, commit, rollback and reset, as the step's `positions` must repeat it."""
    from flexkv.step import BoundedKVStep, Segment, StreamPosition

    cache = CACHES[name]()
    shape = (CONFIG.num_layers, CONFIG.rows_per_request, CONFIG.num_heads, 2, CONFIG.head_dim)
    src = cache.add_source(torch.zeros(shape), torch.zeros(shape))
    with pytest.raises(ValueError, match="'a' is not admitted"):
        cache.position("a")
    start = BoundedKVStep((Segment("a", 0),), {"a": StreamPosition(2, 0, src)})
    cache.admit(start)
    cache.commit(start)
    assert cache.position("a") == StreamPosition(2, 0, src)
    step = BoundedKVStep((Segment("a", 1),), {"a": cache.position("a")}, tokens=1)
    cache.admit(step)
    cache.commit(step)  # commit alone advances the record (no attend needed for the table)
    assert cache.position("a") == StreamPosition(2, 1, src) and cache.written("a") == 1
    cache.reset_request("a")
    with pytest.raises(ValueError, match="was reset and has not declared its source yet"):
        cache.position("a")
