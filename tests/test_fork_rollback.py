"""Fork, reorder and roll back a stream, against streams fed the same tokens from the start.

Every request's written tokens are kept on the side, in stream order. Before
each step a fresh dense reference (`ReferenceCache`) is loaded with exactly
those tokens, so a forked, reordered or rolled-back stream is compared with a
stream that was fed its tokens from the start, never with the cache's own
fork or rollback bookkeeping.
"""

import random
from functools import partial

import pytest
import torch
from random_workload import check_close

from configs import small_config
from flexkv import BoundedKVManager, Recall, SinkWindow
from flexkv.cache.groups import LayerGroup, layer_group_configs
from flexkv.cache.host.slots import SlotsExhausted
from flexkv.model.reference import ReferenceCache
from flexkv.model.uncached import UncachedHistory
from flexkv.step import BoundedKVStep, Segment, StreamPosition

H, D = 2, 8


make_config = partial(small_config, num_heads=H, head_dim=D, max_slots=6, dtype=torch.float64)


class Driver:
    """A cache (manager or grouped) and every request's tokens, stepped and checked against references.

    Each layer's output is checked as it is computed: past `tolerance` the step fails there, naming the
    step, the layer and the requests. `tolerance=None` (a negative control) only records `worst`."""

    def __init__(self, cache, config, groups=None, seed=0, source_len=0, tolerance=1e-9):
        self.cache, self.config, self.tolerance = cache, config, tolerance
        self.steps = 0
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        _, self.configs, self.route = layer_group_configs(config, groups)
        self.history = {}  # rid -> per model layer: (K [R, H, w, D], V)
        self.source_len = {}
        self.source = None
        if source_len:
            c = config
            keys = torch.randn(c.num_layers, c.rows_per_request, H, c.max_source_len, D, generator=self.gen,
                               dtype=torch.float64)
            values = torch.randn(keys.shape, generator=self.gen, dtype=torch.float64)
            self.source = (keys, values)
            assert cache.add_source(keys, values) == 0
        self.default_source_len = source_len
        self.worst = 0.0

    def empty(self):
        R = self.config.rows_per_request
        z = torch.zeros(R, H, 0, D, dtype=torch.float64)
        return [(z, z) for _ in range(self.config.num_layers)]

    def step(self, rids, T, spans):
        c, R = self.config, self.config.rows_per_request
        for rid in rids:
            if rid not in self.history:
                self.history[rid] = self.empty()
                self.source_len[rid] = self.default_source_len
        positions = {rid: StreamPosition(self.source_len[rid], self.history[rid][0][0].shape[2]) for rid in rids}
        step = BoundedKVStep(tuple(Segment(r, s) for r, s in zip(rids, spans)), positions, tokens=T)
        N = len(rids) * R
        qkv = [[torch.randn(N, H, T, D, generator=self.gen, dtype=torch.float64) for _ in range(3)]
               for _ in range(c.num_layers)]
        self.cache.admit(step)
        plan = self.cache.plan(step)
        # A fresh reference per group, loaded with every request's tokens: the stream "fed from the start".
        refs = []
        for g, gc in enumerate(self.configs):
            layers = [L for L, (gg, _) in enumerate(self.route) if gg == g]
            ref = ReferenceCache(gc)
            if self.source is not None:
                ref.add_source(0, self.source[0][layers], self.source[1][layers])
            for rid in rids:
                hist = self.history[rid]
                ref.load_stream(rid, [hist[L][0] for L in layers], [hist[L][1] for L in layers])
            refs.append(ref)
        for layer in range(c.num_layers):
            q, k, v = qkv[layer]
            got = self.cache.attend(layer, q, k, v, plan)
            g, local = self.route[layer]
            want = refs[g].attend(local, q, k, v, step)
            if self.tolerance is None:
                self.worst = max(self.worst, (got - want).abs().max().item())
            else:
                where = f"step {self.steps} (requests {list(rids)}, spans {list(spans)}), layer {layer}"
                self.worst = max(self.worst, check_close(got, want, self.tolerance, where))
        self.cache.commit(step)
        self.steps += 1
        for si, (rid, span) in enumerate(zip(rids, spans)):
            rows = slice(si * R, si * R + R)
            hist = self.history[rid]
            for layer in range(c.num_layers):
                _, k, v = qkv[layer]
                K, V = hist[layer]
                hist[layer] = (torch.cat([K, k[rows, :, :span]], 2), torch.cat([V, v[rows, :, :span]], 2))

    def fork(self, parent, child):
        self.cache.fork_request(parent, child)
        self.history[child] = list(self.history[parent])
        self.source_len[child] = self.source_len[parent]

    def reorder(self, mapping):
        self.cache.reorder_requests(mapping)
        before = {dst: (list(self.history[src]), self.source_len[src]) for dst, src in mapping.items()}
        for dst, (hist, L) in before.items():
            self.history[dst], self.source_len[dst] = hist, L

    def rollback(self, rid, n):
        self.cache.rollback_request(rid, n)
        w = self.history[rid][0][0].shape[2] - n
        self.history[rid] = [(K[:, :, :w], V[:, :, :w]) for K, V in self.history[rid]]

    def written(self, rid):
        return self.history[rid][0][0].shape[2]


def random_run(driver, steps=40, rollbacks=True):
    """Steps, forks, reorders and rollbacks at random; every step checked."""
    rng, c = driver.rng, driver.config
    live = ["r0", "r1"]
    made = 2
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 and len(driver.cache.requests) < c.max_slots and driver.cache.requests:
            parent = rng.choice([r for r in live if r in driver.cache.requests])
            child = f"r{made}"
            made += 1
            driver.fork(parent, child)
            live.append(child)
        elif op < 0.3 and len(driver.cache.requests) >= 2:
            held = list(driver.cache.requests)
            mapping = {dst: rng.choice(held) for dst in rng.sample(held, rng.randint(1, len(held)))}
            driver.reorder(mapping)
        elif op < 0.45 and rollbacks and driver.cache.requests:
            rid = rng.choice(list(driver.cache.requests))
            limit = driver.cache.rollback_limit(rid)
            driver.rollback(rid, rng.randint(0, limit))
        else:
            rids = rng.sample(live, rng.randint(1, min(len(live), 3)))
            T = rng.randint(1, c.max_step_tokens)
            spans = [T if c.query_window is not None or rng.random() < 0.7 else rng.randint(0, T) for _ in rids]
            driver.step(rids, T, spans)
    return driver


CONFIGS = {
    "sink-window": dict(),
    "per-query-window": dict(retention=SinkWindow(1, 5), query_window=5),
    "causal-step": dict(retention=SinkWindow.keys(6, 1), causal_step=True),
    "max-rollback": dict(retention=SinkWindow(1, 4), max_rollback=7, max_step_tokens=4),
    "two-rows": dict(rows_per_request=2),
    "source": dict(max_source_len=3, max_sources=1, min_source_len=3, retention=SinkWindow(4, 5)),
    # a memory whose block means (kept beside the ring) are forked, reordered and rolled back with it
    "recall": dict(retention=Recall(1, 3, 6, block=2, top_k=2)),
    "recall-per-query": dict(retention=Recall(1, 3, 4, block=2, top_k=1), query_window=3, max_rollback=5),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_forked_reordered_and_rolled_back_streams_attend_as_if_fed_from_the_start(name, seed):
    kw = dict(CONFIGS[name])
    cfg = make_config(**kw)
    d = Driver(BoundedKVManager(cfg), cfg, seed=seed, source_len=cfg.min_source_len)
    random_run(d, steps=40)
    assert d.worst < 1e-9


def test_grouped_cache_forks_and_rolls_back_every_group():
    cfg = make_config(num_layers=3, max_step_tokens=2, max_rollback=5)
    groups = (LayerGroup((0, 2), SinkWindow(1, 3)), LayerGroup((1,), SinkWindow(0, 7), query_window=7))
    d = Driver(BoundedKVManager(cfg, groups=groups), cfg, groups, seed=3)
    random_run(d, steps=40)
    assert d.worst < 1e-9


def test_a_recall_group_beside_a_window_group_forks_and_rolls_back():
    cfg = make_config(num_layers=3, max_step_tokens=2, max_rollback=5)
    groups = (LayerGroup((0, 2), Recall(1, 3, 4, block=2, top_k=1)), LayerGroup((1,), SinkWindow(0, 7), query_window=7))
    d = Driver(BoundedKVManager(cfg, groups=groups), cfg, groups, seed=4)
    random_run(d, steps=60)
    assert d.worst < 1e-9 and max(d.written(r) for r in d.cache.requests) > 1 + 3 + 4


def test_the_uncached_twin_forks_and_rolls_back_as_the_cache_does():
    cfg = make_config(max_rollback=4)
    d = Driver(UncachedHistory(cfg), cfg, seed=5)
    random_run(d, steps=40)
    assert d.worst < 1e-9


def test_speculative_loop_accepts_and_rejects_drafts_exactly():
    """Draft k tokens in one step, keep some, roll back the rest: as if only the kept ones were fed."""
    cfg = make_config(retention=SinkWindow(1, 4), max_step_tokens=5, max_rollback=5)
    d = Driver(BoundedKVManager(cfg), cfg, seed=9)
    d.step(["a"], 5, [5])
    for accepted in [0, 5, 2, 4, 1, 3, 0, 0, 5]:
        d.step(["a"], 5, [5])
        d.rollback("a", 5 - accepted)
        d.step(["a"], 1, [1])  # the verified token
    assert d.worst < 1e-9


# ---------------------------------------------------------------- refusals


def snapshot(cache):
    return cache.slots.snapshot()


def test_rollback_beyond_the_ring_is_refused_with_nothing_changed():
    cfg = make_config(retention=SinkWindow(1, 4), max_step_tokens=2)  # ring: 4 + 2 cells
    m = BoundedKVManager(cfg)
    d = Driver(m, cfg)
    for _ in range(6):
        d.step(["a"], 2, [2])
    assert m.rollback_limit("a") == 2
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"cannot take back 3 tokens.*at most 2.*max_rollback"):
        m.rollback_request("a", 3)
    assert snapshot(m) == before
    d.rollback("a", 2)
    assert m.rollback_limit("a") == 0  # the two cells of headroom are spent until the stream moves on
    with pytest.raises(ValueError, match="at most 0"):
        m.rollback_request("a", 1)
    d.step(["a"], 1, [1])
    assert d.worst < 1e-9
    # Back to the sinks alone is always exact: nothing of the ring is read again.
    d.rollback("a", d.written("a") - 1)
    d.step(["a"], 2, [2])
    assert d.worst < 1e-9


def test_the_refusal_is_needed_a_rollback_past_the_ring_reads_overwritten_cells():
    """Undo the check: taking back one token more than allowed attends overwritten cells."""
    cfg = make_config(retention=SinkWindow(0, 4), max_step_tokens=2)
    m = BoundedKVManager(cfg)
    d = Driver(m, cfg)
    for _ in range(6):
        d.step(["a"], 2, [2])
    limit = m.rollback_limit("a")
    d.tolerance = None  # from here on the outputs are expected to be wrong: record, do not fail
    m.slots._requests["a"].written -= limit + 1  # what an unchecked rollback would do
    w = d.written("a") - limit - 1
    d.history["a"] = [(K[:, :, :w], V[:, :, :w]) for K, V in d.history["a"]]
    d.step(["a"], 1, [1])
    assert d.worst > 1e-3


def test_max_rollback_widens_the_ring():
    base = make_config(retention=SinkWindow(1, 4), max_step_tokens=2)
    wide = base.replace(max_rollback=6)
    assert (base.ring_cells, wide.ring_cells) == (6, 10)
    m0, m1 = BoundedKVManager(base), BoundedKVManager(wide)
    assert (m0.layout.ring_len, m1.layout.ring_len) == (6, 10)
    assert m1.slot_bytes * 7 == m0.slot_bytes * 11  # sink 1 + ring 6 cells, then sink 1 + ring 10
    with pytest.raises(ValueError, match="max_rollback"):
        base.replace(max_rollback=-1)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.rollback_request("nobody", 1), "not admitted"),
    (lambda m: m.rollback_request("a", -1), "tokens must be an int >= 0"),
    (lambda m: m.rollback_request("a", 99), "has written 4 tokens"),
    (lambda m: m.fork_request("nobody", "x"), "not admitted"),
    (lambda m: m.fork_request("a", "b"), "already holds a slot"),
    (lambda m: m.fork_request("a", None), "reserved for padding"),
    (lambda m: m.reorder_requests({"a": "nobody"}), "not admitted"),
    (lambda m: m.reorder_requests({"nobody": "a"}), "not admitted"),
    (lambda m: m.reorder_requests(["a"]), "mapping must be"),
])
def test_bad_fork_reorder_rollback_raise_and_change_nothing(call, match):
    cfg = make_config(max_slots=3)
    m = BoundedKVManager(cfg)
    d = Driver(m, cfg)
    d.step(["a", "b"], 2, [2, 2])
    d.step(["a", "b"], 2, [2, 2])
    before = snapshot(m)
    k0 = m.k_cache_0.clone()
    with pytest.raises(ValueError, match=match):
        call(m)
    assert snapshot(m) == before
    assert torch.equal(m.k_cache_0, k0)


def test_fork_into_a_full_pool_raises_slots_exhausted_and_changes_nothing():
    cfg = make_config(max_slots=2)
    m = BoundedKVManager(cfg)
    d = Driver(m, cfg)
    d.step(["a", "b"], 1, [1, 1])
    before = snapshot(m)
    with pytest.raises(SlotsExhausted, match="no free slot"):
        m.fork_request("a", "c")
    assert snapshot(m) == before


def test_fork_of_a_stream_on_a_private_source_is_refused_with_the_reason():
    cfg = make_config(max_source_len=2, max_sources=2)
    m = BoundedKVManager(cfg)
    keys = torch.randn(2, 1, H, 2, D, dtype=torch.float64)
    m.add_private_source("a", keys, keys)
    m.admit(BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(2, 0, -1)}))
    before = snapshot(m)
    with pytest.raises(ValueError, match="private source.*add_source"):
        m.fork_request("a", "b")
    assert snapshot(m) == before


def test_a_failed_copy_leaves_no_child(monkeypatch):
    import flexkv.cache.storage.slot_copy as slot_copy_module

    cfg = make_config()
    m = BoundedKVManager(cfg)
    Driver(m, cfg).step(["a"], 2, [2])
    before = snapshot(m)

    def broken(buffers, pairs):
        raise KeyboardInterrupt

    monkeypatch.setattr(slot_copy_module, "copy_slots", broken)
    with pytest.raises(KeyboardInterrupt):
        m.fork_request("a", "b")
    assert snapshot(m) == before


def test_cache_mode_rotary_copies_its_unrotated_sinks():
    """`"cache"` rotary positions keep un-rotated sink keys per slot; a fork copies them too."""
    from flexkv.cache.positions.rotary import Rotary

    cfg = make_config(retention=SinkWindow(2, 3), num_layers=1)
    m = BoundedKVManager(cfg)
    rot = m.rotation(0, Rotary(D).double(), "cache")
    step = BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 0)})
    m.admit(step)
    plan = m.plan(step)
    q, k, v = (torch.randn(1, H, 2, D, dtype=torch.float64) for _ in range(3))
    q, k = rot(q, k, plan)
    m.attend(0, q, k, v, plan)
    m.commit(step)
    m.fork_request("a", "b")
    S, raw = cfg.sink_capacity, rot.raw_sink
    sa, sb = m.slot_of("a"), m.slot_of("b")
    assert torch.equal(raw[sa * S:(sa + 1) * S], raw[sb * S:(sb + 1) * S])
    assert raw[sa * S:(sa + 1) * S].abs().sum() > 0


# ---------------------------------------------------------------- the session


def session_config(**kw):
    from tests.session_models import LAYERS
    from tests.session_models import D as SD
    from tests.session_models import H as SH

    return small_config(**{"num_layers": LAYERS, "num_heads": SH, "head_dim": SD, "retention": SinkWindow(1, 4),
                           "query_window": 4, "max_rollback": 3, **kw})


def test_compiled_session_forks_and_rolls_back_without_recompiling():
    from torch._dynamo.utils import counters

    from flexkv import StreamSession
    from tests.session_models import check_step, feed, model

    cfg = session_config()
    torch._dynamo.reset()
    # The rows path compiled for every step size: what is checked here is that forks and rollbacks
    # between compiled steps are exact and compile nothing (the FlexAttention path reads the same cells).
    from flexkv.cache.paths.attention_options import AttentionOptions

    cache = BoundedKVManager(cfg, block_size=8, options=AttentionOptions.for_cache(cfg, "cpu", path="rows"))
    session = StreamSession(cache, token_sizes=(1, 3))
    ref = ReferenceCache(cfg.replace(dtype=torch.float64))
    session.warmup(model, feed(1, 0))
    graphs = counters["stats"]["unique_graphs"]
    worst = 0.0
    seed = 1

    def step(feeds):
        nonlocal worst
        res = session.step(feeds, model)
        worst = max(worst, check_step(ref, res, feeds, tolerance=1e-4))

    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in range(4):
            step({"a": feed(3, seed + s)})
        session.fork("a", "b")
        ref.fork("a", "b")
        for s in range(5):
            step({"a": feed(1, 20 + s), "b": feed(3, 40 + s)})
            session.rollback("b", 2)  # a speculative step: keep one of the three
            ref.rollback("b", session.written("b"))
        session.fork("b", "c")
        ref.fork("b", "c")
        step({"a": feed(1, 60), "b": feed(1, 61), "c": feed(1, 62)})
    assert counters["stats"]["unique_graphs"] == graphs
    assert session.written("b") == 12 + 5 + 1 and session.written("c") == 18
    assert worst < 1e-4


def test_session_fork_copies_the_model_state_and_rollback_needs_the_old_one():
    from flexkv import StreamSession
    from tests.session_models import feed, model

    def with_state(attn, x, state):
        return model(attn, x), state + x.shape[1]

    session = StreamSession(session_config(), compile=False, initial_state=lambda: torch.zeros(2))
    session.step({"a": feed(3, 1)}, with_state)
    session.fork("a", "b")
    assert torch.equal(session.state("b"), torch.full((2,), 3.0))
    session.step({"b": feed(1, 2)}, with_state)
    assert torch.equal(session.state("a"), torch.full((2,), 3.0))  # a copy, not shared
    assert torch.equal(session.state("b"), torch.full((2,), 4.0))
    before = (session.written("b"), session.state("b").tolist())
    with pytest.raises(ValueError, match=r"carries a model state.*state="):
        session.rollback("b", 1)
    with pytest.raises(ValueError, match="shaped like"):
        session.rollback("b", 1, state=torch.zeros(3))
    assert (session.written("b"), session.state("b").tolist()) == before
    session.rollback("b", 1, state=torch.full((2,), 3.0))
    assert session.written("b") == 3 and torch.equal(session.state("b"), torch.full((2,), 3.0))


def test_session_fork_without_a_free_lane_is_refused():
    from flexkv import StreamSession
    from tests.session_models import feed, model

    session = StreamSession(session_config(max_slots=2), compile=False)
    session.step({"a": feed(1, 1), "b": feed(1, 2)}, model)
    with pytest.raises(SlotsExhausted, match="cannot wait"):
        session.fork("a", "c")
    assert session.requests == ("a", "b") and session.cache.free_slots == 0
