"""Layer groups (`BoundedKVManager(config, groups=...)`) and learned sinks (`flexkv.cache.paths.sinks`), in the core.

A grouped cache must attend each layer exactly as a `ReferenceCache` of that
layer's own retention does, hold per group only what that group keeps, and
admit atomically across groups. Learned sinks are checked against softmax
over the attended scores plus one extra score with a zero value.
"""


from functools import partial

import pytest
import torch

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, LayerGroup, Segment, SinkWindow, SlotsExhausted, StreamPosition
from flexkv.cache.groups import GroupedPlan, layer_group_configs
from flexkv.model.reference import ReferenceCache
from single_thread import one_thread  # noqa: F401

H, HQ, D = 2, 4, 8


base_config = partial(small_config, num_layers=4, num_heads=H, head_dim=D, dtype=torch.float64, max_step_tokens=4)


GROUPS = (
    LayerGroup((0, 2), SinkWindow(0, 3), query_window=3, name="sliding"),
    LayerGroup((1, 3), SinkWindow(2, 6), query_window=6, name="full"),
)


def step(segs, written, tokens=None):
    return BoundedKVStep(tuple(Segment(r, s) for r, s in segs),
                         {r: StreamPosition(0, written[r]) for r, _ in segs if r is not None}, tokens=tokens)


def attend_against_references(groups):
    """Drive a grouped cache and one `ReferenceCache` per group (built from that group's own config)
    through prefill chunks and decode steps; every layer's output must match its group's reference."""
    cfg = base_config()
    m = BoundedKVManager(cfg, groups=groups, block_size=8)
    _, configs, _ = layer_group_configs(cfg, groups)
    refs = [ReferenceCache(c.replace(num_layers=1)) for c in configs]
    g = torch.Generator().manual_seed(0)
    written = {"a": 0, "b": 0}
    # Prefill chunks, then decode steps far past both windows; "b" joins late and a padding row rides along.
    schedule = [[("a", 4)], [("a", 4), (None, 0)], [("a", 3), ("b", 4)]] + [[("a", 1), ("b", 1)]] * 12
    for segs in schedule:
        st = step(segs, written, tokens=max(s for _, s in segs) or 1)
        m.admit(st)
        plan = m.plan(st)
        assert isinstance(plan, GroupedPlan) and len(plan) == 2
        N, T = len(segs), st.step_tokens
        for layer in range(cfg.num_layers):
            gi, li = m.group_of(layer)
            c = configs[gi]
            q = torch.randn(N, HQ, T, c.head_dim, generator=g, dtype=torch.float64)
            k = torch.randn(N, c.num_heads, T, c.head_dim, generator=g, dtype=torch.float64)
            v = torch.randn(N, c.num_heads, T, c.value_head_dim, generator=g, dtype=torch.float64)
            got = m.attend(layer, q, k, v, plan)
            assert got.shape == (N, HQ, T, c.value_head_dim)
            ref = refs[gi]
            # The reference keeps one layer per cache: feed it this layer's stream under a per-layer id.
            rst = BoundedKVStep(tuple(Segment(None if r is None else (r, layer), s) for r, s in segs),
                                {(r, layer): p for r, p in st.positions.items()}, tokens=T)
            want = ref.attend(0, q, k, v, rst)
            ref.commit(rst)
            for i, (r, s) in enumerate(segs):
                if r is not None:
                    torch.testing.assert_close(got[i, :, :s], want[i, :, :s], rtol=0, atol=1e-12)
        m.commit(st)
        for r, s in segs:
            if r is not None:
                written[r] += s
    assert m.written("a") == written["a"] and m.written("b") == written["b"]
    assert m.group_of(2) == (0, 1) and m.group_of(3) == (1, 1)
    return m


def test_each_layer_attends_as_its_groups_reference():
    attend_against_references(GROUPS)


def test_groups_with_their_own_head_sizes():
    """Sliding layers with 2 KV heads of 8, full layers with 1 KV head whose keys are 16 wide and
    values 12 (per-layer head sizes as in Gemma 4, key and value widths as in latent attention)."""
    wide = LayerGroup((1, 3), SinkWindow(2, 6), query_window=6, name="full", num_heads=1, head_dim=16, value_head_dim=12)
    m = attend_against_references((GROUPS[0], wide))
    report = m.memory_report()
    assert [(r["num_heads"], r["head_dim"], r["value_head_dim"]) for r in report] == [(H, D, D), (1, 16, 12)]
    cell = 8  # float64
    assert report[0]["slot_bytes"] == 2 * 7 * H * (D + D) * cell
    assert report[1]["slot_bytes"] == 2 * 12 * 1 * (16 + 12) * cell
    assert m.cache_groups[1].k_cache_0.shape[-1] == 16 and m.cache_groups[1].v_cache_0.shape[-1] == 12
    # A group that widens its keys and says nothing of values has values as wide as its keys.
    _, configs, _ = layer_group_configs(base_config(), (GROUPS[0], LayerGroup((1, 3), SinkWindow(2, 6), head_dim=16)))
    assert configs[1].value_head_dim == 16 and configs[0].value_head_dim == D
    # One all-layer source tensor cannot hold heads of different sizes.
    mixed = BoundedKVManager(base_config(max_source_len=3, max_sources=1), groups=(GROUPS[0], wide), block_size=8)
    keys = torch.zeros(4, 1, H, 3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"add_source: the groups hold heads of different sizes"):
        mixed.add_source(keys, keys)
    with pytest.raises(ValueError, match=r"LayerGroup.value_head_dim must be an int >= 1"):
        LayerGroup((0,), SinkWindow(1, 2), value_head_dim=0)


def test_memory_follows_each_groups_window():
    cfg = base_config()
    m = BoundedKVManager(cfg, groups=GROUPS, block_size=8)
    report = m.memory_report()
    assert [r["name"] for r in report] == ["sliding", "full"]
    assert [r["slot_cells"] for r in report] == [0 + 3 + 4, 2 + 6 + 4]  # sink + window + step headroom
    cell = 2 * H * D * 8  # one cell of one layer, keys and values, float64: 256 bytes
    # One stream: 2 sliding layers x 7 cells + 2 full layers x 12 cells.
    assert m.slot_bytes == (2 * 7 + 2 * 12) * cell == 9728
    # Every tensor: 3 slots of 7 cells + 4 scratch = 25 -> 32 (whole blocks of 8) per sliding layer;
    # 3 x 12 + 4 = 40 per full layer.
    assert m.memory_bytes == (2 * 32 + 2 * 40) * cell == 36864
    one = BoundedKVManager(cfg.replace(query_window=6), block_size=8)  # every layer keeping sink 2 + window 6
    assert one.slot_bytes == 4 * 12 * cell > m.slot_bytes


def test_repr_says_what_each_group_keeps():
    m = BoundedKVManager(base_config(), groups=GROUPS, block_size=8)
    assert "sliding: layers [0, 2] keep SinkWindow(sink=0, window=3" in repr(m)
    assert "full: layers [1, 3] keep SinkWindow(sink=2, window=6" in repr(m)


def test_attend_needs_a_grouped_plan():
    m = BoundedKVManager(base_config(), groups=GROUPS, block_size=8)
    x = torch.zeros(1, H, 1, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"attend needs this cache's GroupedPlan"):
        m.attend(0, x, x, x, plan=None)


def test_the_groups_share_one_slot_table():
    """The cache keeps every group's requests in its one table, and a group holds no lifecycle of its own:
    a refused admit changes nothing anywhere."""
    m = BoundedKVManager(base_config(max_slots=2), groups=GROUPS, block_size=8)
    assert all(not hasattr(g, name) for g in m.cache_groups for name in ("slots", "admit", "commit", "add_source"))
    m.admit(step([("a", 1)], {"a": 0}))
    m.commit(step([("a", 1)], {"a": 0}))
    assert m.requests == ("a",) and m.written("a") == 1
    m.admit(step([("x", 1)], {"x": 0}))
    assert m.requests == ("a", "x") and m.free_slots == 0
    before = m.slots.snapshot()
    with pytest.raises(SlotsExhausted):
        m.admit(step([("a", 1), ("b", 1)], {"a": 1, "b": 0}))
    assert m.slots.snapshot() == before
    with pytest.raises(ValueError, match=r"request 'a': written=0 but 1 tokens are committed"):
        m.admit(step([("a", 1)], {"a": 0}))
    assert m.slots.snapshot() == before


@pytest.mark.parametrize("groups, match", [
    (lambda: (LayerGroup((0, 1, 2), SinkWindow(1, 2)), LayerGroup((2, 3), SinkWindow(1, 2))),
     r"layer 2 is in groups 0 and 1"),
    (lambda: (LayerGroup((0, 1, 2), SinkWindow(1, 2)),), r"layers \[3\] are in no group"),
    (lambda: (LayerGroup((0, 1, 2, 3, 4), SinkWindow(1, 2)),), r"group 0 names layer 4, but config.num_layers=4"),
    (lambda: (LayerGroup((0, 1, 2), SinkWindow(1, 8)), LayerGroup((3,), SinkWindow(1, 2), 5)),
     r"group 1 \(layers \[3\]\): query_window=5 needs window >= 5"),
], ids=["twice", "missing", "out-of-range", "bad-group-config"])
def test_groups_that_do_not_cover_the_layers_once_are_named(groups, match):
    with pytest.raises(ValueError, match=match):
        BoundedKVManager(base_config(), groups=groups())


@pytest.mark.parametrize("args, match", [
    (((1, 1), SinkWindow(1, 2)), r"LayerGroup.layers must be distinct"),
    (((), SinkWindow(1, 2)), r"LayerGroup.layers is empty"),
    (((0,), 5), r"LayerGroup.retention must be a SinkWindow"),
], ids=["repeated", "empty", "retention"])
def test_a_bad_layer_group_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        LayerGroup(*args)


def test_sources_are_split_by_layer():
    cfg = base_config(max_source_len=3, max_sources=1)
    m = BoundedKVManager(cfg, groups=GROUPS, block_size=8)
    keys = torch.arange(4, dtype=torch.float64).view(4, 1, 1, 1, 1).expand(4, 1, H, 3, D).contiguous()
    assert m.add_source(keys, keys + 10) == 0
    for gi, g in enumerate(GROUPS):
        kc = m.cache_groups[gi].k_cache_1
        assert kc[0, 0, 0, 0].item() == g.layers[1]  # the group's second layer holds that model layer's source
    m.remove_source(0)
    assert m.sources == {}


def test_a_layer_is_found_by_group_of_and_its_config_by_layer_config():
    """`group_of` says where a model layer lives, `layer_config` its config (`layer_manager` is gone)."""
    m = BoundedKVManager(base_config(), groups=GROUPS, block_size=8)
    g, i = m.group_of(3)
    assert i == 1 and m.layer_config(3).retention == m.cache_groups[g].config.retention == SinkWindow(2, 6)
    assert not hasattr(m, "layer_manager") and not hasattr(BoundedKVManager(base_config(), block_size=8),
                                                           "layer_manager")


def test_what_one_group_owns_is_asked_of_a_group_when_there_are_several():
    """A one-group cache's store, layout, paths and path choice are its group's; with several groups the cache
    names where each lives instead of answering for one of them."""
    one = BoundedKVManager(base_config(), block_size=8)
    assert one.store is one.cache_groups[0].store and one.layout is one.cache_groups[0].layout
    assert one.k_cache_0 is one.cache_groups[0].k_cache_0 and one.path_for(1) == one.cache_groups[0].path_for(1)
    m = BoundedKVManager(base_config(), groups=GROUPS, block_size=8)
    for what in ("store", "layout", "paths"):
        with pytest.raises(ValueError, match=rf"BoundedKVManager.{what}: this cache has 2 layer groups.*"
                                             rf"cache.cache_groups\[g\].{what}"):
            getattr(m, what)
    with pytest.raises(ValueError, match=r"path_for: this cache has 2 layer groups"):
        m.path_for(1)
    with pytest.raises(AttributeError):
        m.k_cache_0


@pytest.mark.parametrize("name", ["GroupedKVManager", "build_cache"])
def test_the_former_ways_to_build_a_grouped_cache_say_how_to_build_it_now(name):
    import flexkv

    with pytest.raises(AttributeError, match=rf"flexkv.{name} is gone.*flexkv.BoundedKVManager\(config, device, "
                                             r"groups=groups\)"):
        getattr(flexkv, name)

