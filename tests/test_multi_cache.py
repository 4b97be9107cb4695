"""Several caches in one model step: `flexkv.model.multi_context.MultiStepContext` and `MultiCacheSession`.

Two caches of different shape (layers, heads, head size, retention, step
length), as a streaming encoder with a stack at 25 and one at 50 frames per
chunk keeps them. Outputs are checked against a dense reference per cache
(`flexkv.model.reference.ReferenceCache`) and against the same session over
the uncached twin; "changed nothing" is checked on both caches' slot tables,
the session's lanes, written counts and queue, and on a retried step's
outputs, equal to those of a session that never saw the failure.
"""

from dataclasses import replace

import pytest
import torch
from random_workload import check_close
from torch import nn

from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    Chunk,
    MultiCacheSession,
    MultiStepContext,
    Segment,
    SinkWindow,
    SlotsExhausted,
    StreamPosition,
    UncachedHistory,
)
from flexkv.model.attendance import AttendanceError
from flexkv.model.reference import ReferenceCache
from flexkv.model.step_context import StepContext
from flexkv.model.wrap import attention
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

SLOW = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=4, rows_per_request=1, max_source_len=0,
                       retention=SinkWindow(1, 5), max_slots=3, max_step_tokens=3, query_window=5,
                       dtype=torch.float64)
FAST = BoundedKVConfig(num_layers=3, num_heads=1, head_dim=6, rows_per_request=1, max_source_len=0,
                       retention=SinkWindow(2, 8), max_slots=3, max_step_tokens=6, query_window=8,
                       dtype=torch.float64)
CONFIGS = {"slow": SLOW, "fast": FAST}
TOKEN_SIZES = {"slow": (1, 2, 3), "fast": (2, 4, 6)}


def bounded():
    return {name: BoundedKVManager(c, block_size=8) for name, c in CONFIGS.items()}


def uncached():
    return {name: UncachedHistory(c) for name, c in CONFIGS.items()}


def session(caches=None, **kw):
    return MultiCacheSession(bounded() if caches is None else caches, compile=False, token_sizes=TOKEN_SIZES, **kw)


def qkv(x, layer):
    """A cache's feed `[B, T, 3, H, D]` -> layer `layer`'s q, k, v `[B, H, T, D]` (each layer its own keys)."""
    return tuple((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))


def stack(attn, x, name):
    """Cache `name`'s stack through its one-cache context `attn` on its feed: `[B, T, layers, H, D]`."""
    return torch.stack([attn(layer, *qkv(x, layer)).transpose(1, 2) for layer in range(CONFIGS[name].num_layers)],
                       dim=2)


def model(attn, x):
    """Each cache's stack on its own feed: name -> `[B, T_name, layers, H, D]`."""
    return {name: stack(attn[name], x[name], name) for name in CONFIGS}


def feeds(lengths, seed):
    """`{request: n}` -> each request feeding n slow tokens and 2n fast ones."""
    g = torch.Generator().manual_seed(seed)
    return {rid: {name: torch.randn(n * (2 if name == "fast" else 1), 3, c.num_heads, c.head_dim, generator=g,
                                    dtype=torch.float64) for name, c in CONFIGS.items()}
            for rid, n in lengths.items()}


def check_against_references(refs, res, fed, tolerance=1e-9):
    """Every layer of every cache of every request against the dense reference of that cache; commits it."""
    for name, c in CONFIGS.items():
        step = res.steps[name]
        B, T = len(step.segments), step.step_tokens
        x = torch.zeros(B, T, 3, c.num_heads, c.head_dim, dtype=torch.float64)
        for rid, lane in res.lanes.items():
            data = fed[rid][name]
            data = data.inputs if isinstance(data, Chunk) else data
            x[lane, :len(data)] = data
        for layer in range(c.num_layers):
            want = refs[name].attend(layer, *qkv(x, layer), step).transpose(1, 2)
            for rid, lane in res.lanes.items():
                check_close(res[rid][name][:, layer], want[lane, :res.tokens[rid][name]], tolerance,
                            f"cache {name!r}, layer {layer}, request {rid!r}")
        refs[name].commit(step)


def observed(s):
    """Everything a failed operation must leave as it was: the session's view and both slot tables."""
    return (s.requests, {r: (s.lane(r), s.written(r)) for r in s.requests}, s.waiting, s.free_lanes,
            {name: c.slots.snapshot() for name, c in s.caches.items()})


# The steps of a stream of requests joining and leaving, each cache with its own step length per request.
SCHEDULE = [{"a": 3, "b": 1}, {"a": 2, "b": 3, "c": 1}, {"b": 3, "c": 3}, {"a": 1, "c": 2},
            {"a": 3, "b": 3, "c": 3}, {"b": 2}, {"a": 3, "c": 1}, {"a": 2, "b": 3, "c": 3}]


def test_steps_of_different_lengths_in_each_cache_match_two_dense_references():
    s, twin = session(), session(uncached())
    refs = {name: ReferenceCache(c) for name, c in CONFIGS.items()}
    for i, lengths in enumerate(SCHEDULE):
        fed = feeds(lengths, i)
        res, want = s.step(fed, model), twin.step(fed, model)
        assert {n: res.steps[n].step_tokens for n in CONFIGS} == {
            "slow": max(lengths.values()), "fast": 2 * max(lengths.values())}
        check_against_references(refs, res, fed)
        for rid in lengths:  # the uncached twin: every key kept, the retention as a mask
            for name in CONFIGS:
                check_close(res[rid][name], want[rid][name], 1e-9, f"step {i}, cache {name!r}, request {rid!r}")
    # each cache counts its own tokens; the streams went far past both windows
    written = {rid: sum(step.get(rid, 0) for step in SCHEDULE) for rid in "abc"}
    assert {rid: s.written(rid) for rid in "abc"} == {rid: {"slow": n, "fast": 2 * n} for rid, n in written.items()}
    assert all(n > SLOW.retention.window + 1 for n in written.values())
    assert {name: c.written("a") for name, c in s.caches.items()} == s.written("a")


class TwoRateEncoder(nn.Module):
    """A streaming encoder written with its own conventions: a fast stack over 2n frames, pooled to n frames and
    added to the slow features, then a slow stack. Each block's attention core is built by the caller."""

    def __init__(self, fast_core, slow_core, width=6):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.fast = nn.ModuleList([nn.Linear(width, 3 * width).double() for _ in range(FAST.num_layers)])
        self.slow_in = nn.Linear(width, 2 * SLOW.head_dim).double()
        self.slow = nn.ModuleList([nn.Linear(2 * SLOW.head_dim, 3 * 2 * SLOW.head_dim).double()
                                   for _ in range(SLOW.num_layers)])
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5
        self.fast_cores = nn.ModuleList([fast_core(i) for i in range(FAST.num_layers)])
        self.slow_cores = nn.ModuleList([slow_core(i) for i in range(SLOW.num_layers)])

    @staticmethod
    def block(proj, core, x, heads):
        B, T, _ = x.shape
        q, k, v = proj(x).view(B, T, 3, heads, -1).unbind(2)
        out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + out.transpose(1, 2).reshape(B, T, -1)

    def forward(self, fast_frames, slow_frames):
        x = fast_frames
        for proj, core in zip(self.fast, self.fast_cores):
            x = self.block(proj, core, x, FAST.num_heads)
        pooled = x.unflatten(1, (-1, 2)).mean(2)  # 2n fast frames -> n slow frames
        y = self.slow_in(pooled) + slow_frames
        for proj, core in zip(self.slow, self.slow_cores):
            y = self.block(proj, core, y, SLOW.num_heads)
        return {"fast": x, "slow": y}


def encoder_run(caches):
    s = session(caches)
    enc = TwoRateEncoder(lambda i: attention(s.context["fast"], i), lambda i: attention(s.context["slow"], i))
    return s, enc


def encoder_feeds(lengths, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return {rid: {"fast": torch.randn(2 * n, 6, generator=g, dtype=torch.float64),
                  "slow": torch.randn(n, 2 * SLOW.head_dim, generator=g, dtype=torch.float64)}
            for rid, n in lengths.items()}


def test_a_model_routes_its_two_stacks_to_their_caches_exactly():
    """Attention modules built on `session.context[name]`: the bounded run equals the uncached twin's."""
    (s, enc), (twin, twin_enc) = encoder_run(bounded()), encoder_run(uncached())

    def step(attn, x, enc=enc):
        return enc(x["fast"], x["slow"])

    def twin_step(attn, x):
        return twin_enc(x["fast"], x["slow"])

    for i, lengths in enumerate(SCHEDULE):
        fed = encoder_feeds(lengths, i)
        res, want = s.step(fed, step), twin.step(fed, twin_step)
        for rid in lengths:
            for name in CONFIGS:
                assert res[rid][name].shape[0] == res.tokens[rid][name]
                check_close(res[rid][name], want[rid][name], 1e-9, f"step {i}, {name!r} stack, request {rid!r}")


class TorchTwoRateEncoder(nn.Module):
    """The same shape of encoder from torch's own `nn.TransformerEncoder` stacks (a model flexkv did not write:
    fused in-projections, `self_attn(x, x, x, attn_mask=...)`), fast stack, pairs pooled, slow stack. Run over a
    whole stream with `masks` it is the model without any cache."""

    def __init__(self, activation=None):
        super().__init__()
        torch.manual_seed(3)

        def stack(config, layers):
            width = config.num_heads * config.head_dim
            # SiLU by default: with relu, torch runs an inference layer with an even head count through a fused
            # kernel that never calls self_attn (see the test below)
            layer = nn.TransformerEncoderLayer(width, config.num_heads, 2 * width, dropout=0.0, batch_first=True,
                                               activation=activation or nn.SiLU())
            return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        self.fast = stack(FAST, FAST.num_layers)
        self.down = nn.Linear(FAST.num_heads * FAST.head_dim, SLOW.num_heads * SLOW.head_dim)
        self.slow = stack(SLOW, SLOW.num_layers)
        self.double().eval().requires_grad_(False)

    def forward(self, fast_frames, slow_frames, masks=(None, None)):
        x = self.fast(fast_frames, mask=masks[0])
        y = self.slow(self.down(x.unflatten(1, (-1, 2)).mean(2)) + slow_frames, mask=masks[1])
        return {"fast": x, "slow": y}


def mha_through_flexkv(module, attn, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                       average_attn_weights=True, is_causal=False):
    """`nn.MultiheadAttention.forward` (batch_first) with flexkv's core in place of its attention."""
    B, T, width = query.shape
    q, k, v = (t.view(B, T, module.num_heads, -1).transpose(1, 2)
               for t in nn.functional.linear(query, module.in_proj_weight, module.in_proj_bias).chunk(3, dim=-1))
    out = attn(q, k, v).transpose(1, 2).reshape(B, T, width)
    return module.out_proj(out), None


def retention_mask(config, n):
    """Contract section 2 (per-query window) over a whole stream of `n`, as an `attn_mask`: True = not attended."""
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    sink = config.retention.sink
    return ~((j <= p) & ((j >= p - config.query_window) | (j < sink)))


def test_torch_transformer_stacks_swapped_to_two_caches_equal_the_model_over_whole_streams():
    from flexkv import swap_attention

    s = session()
    enc = TorchTwoRateEncoder()
    swap_attention(enc.fast, s.context["fast"], nn.MultiheadAttention, mha_through_flexkv)
    swap_attention(enc.slow, s.context["slow"], nn.MultiheadAttention, mha_through_flexkv)
    plain = TorchTwoRateEncoder()  # the same weights, its own attention
    g = torch.Generator().manual_seed(5)
    fast_w, slow_w = enc.fast.layers[0].linear1.in_features, enc.slow.layers[0].linear1.in_features
    streams = {rid: {"fast": [], "slow": []} for rid in "abc"}
    outs = {rid: {"fast": [], "slow": []} for rid in "abc"}
    for lengths in SCHEDULE:
        fed = {rid: {"fast": torch.randn(2 * n, fast_w, generator=g, dtype=torch.float64),
                     "slow": torch.randn(n, slow_w, generator=g, dtype=torch.float64)} for rid, n in lengths.items()}
        res = s.step(fed, lambda attn, x: enc(x["fast"], x["slow"]))
        for rid in lengths:
            for name in CONFIGS:
                streams[rid][name].append(fed[rid][name])
                outs[rid][name].append(res[rid][name])
    for rid, stream in streams.items():
        fast, slow = torch.cat(stream["fast"]), torch.cat(stream["slow"])
        masks = (retention_mask(FAST, len(fast)), retention_mask(SLOW, len(slow)))
        want = plain(fast[None], slow[None], masks)
        assert len(slow) > SLOW.query_window + 3  # far past both windows
        for name in CONFIGS:
            check_close(torch.cat(outs[rid][name]), want[name][0], 1e-9, f"request {rid!r}, {name!r} stack")


def test_a_stack_whose_attention_torch_bypasses_is_refused_naming_its_cache():
    """With relu, torch's fused inference path runs the slow stack's layers (two heads) without calling the
    swapped `self_attn`: the step is refused, naming that cache and its modules, and neither cache changes."""
    from flexkv import swap_attention

    s = session()
    enc = TorchTwoRateEncoder(activation="relu")
    calls = []
    attn_module = enc.slow.layers[0].self_attn
    attn_module.forward = lambda *a, **k: (calls.append(1), nn.MultiheadAttention.forward(attn_module, *a, **k))[1]
    enc.slow.layers[0](torch.zeros(1, 2, 8, dtype=torch.float64))
    del attn_module.forward
    if calls:
        pytest.skip("this torch release calls self_attn on the encoder layer's inference path")
    swap_attention(enc.fast, s.context["fast"], nn.MultiheadAttention, mha_through_flexkv)
    swap_attention(enc.slow, s.context["slow"], nn.MultiheadAttention, mha_through_flexkv)
    before = observed(s)
    fed = {"a": {"fast": torch.randn(4, 6, dtype=torch.float64), "slow": torch.randn(2, 8, dtype=torch.float64)}}
    with pytest.raises(AttendanceError, match=r"\(cache 'slow'\).*layers.0.self_attn was never called"):
        s.step(fed, lambda attn, x: enc(x["fast"], x["slow"]))
    assert observed(s) == before


# ------------------------------------------------------------------ a failed step changes nothing


def failing_in_fast(error):
    """A model whose slow stack attends every layer, then the fast cache's attend fails (or the model raises)."""

    def fn(attn, x):
        for layer in range(SLOW.num_layers):
            attn["slow"](layer, *qkv(x["slow"], layer))
        attn["fast"](0, *qkv(x["fast"], 0))
        if error is None:  # bad input in the second cache: keys of the slow cache's head size
            q, k, v = qkv(x["slow"], 1)
            return attn["fast"](1, q, k, v)
        raise error("the model failed")

    return fn


@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt], ids=["bad-input", "error", "interrupt"])
def test_a_step_failing_in_the_second_cache_changes_neither_cache(error):
    s, clean = session(), session()
    for i, lengths in enumerate(SCHEDULE[:3]):
        fed = feeds(lengths, i)
        s.step(fed, model)
        clean.step(fed, model)
    s.finish("c")
    clean.finish("c")
    before = observed(s)
    fed = feeds({"a": 3, "b": 2, "d": 1}, 50)  # "d" is new: admitted in both caches by the step
    with pytest.raises(ValueError if error is None else error):
        s.step(fed, failing_in_fast(error))
    assert observed(s) == before
    assert "d" not in s.caches["slow"].requests and "d" not in s.caches["fast"].requests
    # the retried step is the step the session would have run without the failure
    got, want = s.step(fed, model), clean.step(fed, model)
    assert got.lanes == want.lanes
    for rid in fed:
        for name in CONFIGS:
            assert torch.equal(got[rid][name], want[rid][name]), (rid, name)
    assert observed(s) == observed(clean)


def test_a_layer_of_either_cache_never_attended_refuses_the_step_naming_the_cache():
    s = session()
    s.step(feeds({"a": 2}, 0), model)
    before = observed(s)

    def skips_a_fast_layer(attn, x):
        for layer in range(SLOW.num_layers):
            attn["slow"](layer, *qkv(x["slow"], layer))
        return [attn["fast"](layer, *qkv(x["fast"], layer)) for layer in (0, 2)]

    with pytest.raises(AttendanceError, match=r"cache 'fast'.*cache layers 1 \(of 3\) were never attended"):
        s.step(feeds({"a": 2, "b": 1}, 1), skips_a_fast_layer)
    assert observed(s) == before


def test_bad_feeds_are_refused_naming_the_cache_and_change_nothing():
    s = session()
    s.step(feeds({"a": 1}, 0), model)
    before = observed(s)
    fed = feeds({"a": 1, "b": 1}, 1)
    del fed["b"]["fast"]
    with pytest.raises(ValueError, match=r"one feed per cache, named \['slow', 'fast'\]"):
        s.step(fed, model)
    fed = feeds({"a": 1}, 2)
    fed["a"]["fast"] = torch.zeros(7, 3, 1, 6, dtype=torch.float64)  # more than the fast cache's 6 tokens
    with pytest.raises(ValueError, match=r"cache 'fast': request 'a' feeds 7 tokens"):
        s.step(fed, model)
    assert observed(s) == before


# ------------------------------------------------------------------ admission: every cache or none


def test_a_cache_without_a_free_slot_refuses_the_whole_admission_naming_it():
    """The step object over caches of their own: the fast cache is full, so a new request is admitted nowhere."""
    slow, fast = BoundedKVManager(SLOW, block_size=8), BoundedKVManager(replace(FAST, max_slots=1), block_size=8)
    multi = MultiStepContext({"slow": slow, "fast": fast})
    occupied = BoundedKVStep((Segment("x", 0),), {"x": StreamPosition(0, 0, 0)})
    with multi["fast"].stepping(occupied):  # another user of the fast cache holds its one slot
        for layer in range(FAST.num_layers):
            multi["fast"](layer, *(torch.zeros(1, 1, 1, 6, dtype=torch.float64),) * 3)
    before = (slow.slots.snapshot(), fast.slots.snapshot())
    steps = {name: BoundedKVStep((Segment("new", 1),), {"new": StreamPosition(0, 0, 0)}) for name in CONFIGS}
    with pytest.raises(SlotsExhausted, match="cache 'fast' has no free slot"):
        multi.begin(steps)
    assert (slow.slots.snapshot(), fast.slots.snapshot()) == before and slow.requests == ()
    with pytest.raises(ValueError, match=r"no step for \['fast'\]"):
        multi.begin({"slow": steps["slow"]})
    assert slow.slots.snapshot() == before[0]


def test_a_full_session_refuses_a_new_request_in_every_cache():
    s = session(when_full="refuse")
    s.step(feeds({"a": 1, "b": 1, "c": 1}, 0), model)
    before = observed(s)
    with pytest.raises(SlotsExhausted, match="lanes are free"):
        s.step(feeds({"a": 1, "d": 1}, 1), model)
    with pytest.raises(SlotsExhausted):
        s.start("d")
    assert observed(s) == before


def test_caches_with_different_slot_counts_are_refused():
    with pytest.raises(ValueError, match=r"same max_slots.*'fast': 2"):
        MultiCacheSession({"slow": SLOW, "fast": replace(FAST, max_slots=2)}, compile=False)
    one = BoundedKVManager(SLOW, block_size=8)
    with pytest.raises(ValueError, match="same cache object"):
        MultiStepContext({"a": one, "b": one})


# ------------------------------------------------------------------ lifecycle operations over every cache


def test_fork_reset_rollback_and_finish_apply_to_every_cache():
    s, refs = session(), {name: ReferenceCache(c) for name, c in CONFIGS.items()}
    for i in range(4):
        fed = feeds({"a": 3}, i)
        check_against_references(refs, s.step(fed, model), fed)
    s.fork("a", "b")
    for name, ref in refs.items():
        ref.fork("a", "b")
    assert s.written("b") == s.written("a") == {"slow": 12, "fast": 24}
    # Contract section 5: the fast ring (8 + 6 cells) holds entries 10.. intact, and a stream of 24 - m
    # tokens reads from 16 - m on, so m <= 6; the slow one (5 + 3 cells) allows 3.
    assert {name: c.rollback_limit("b") for name, c in s.caches.items()} == {"slow": 3, "fast": 6}
    before = observed(s)
    with pytest.raises(ValueError, match="cache 'fast'"):  # one cache refuses: neither changes
        s.rollback("b", {"slow": 1, "fast": 7})
    with pytest.raises(ValueError, match="every cache name"):
        s.rollback("b", {"slow": 1})
    assert observed(s) == before
    s.rollback("b", {"slow": 1, "fast": 2})
    for name, n in (("slow", 11), ("fast", 22)):
        refs[name].rollback("b", n)
    assert s.written("b") == {"slow": 11, "fast": 22}
    assert {name: c.written("b") for name, c in s.caches.items()} == s.written("b")
    fed = feeds({"a": 1, "b": 2}, 7)
    check_against_references(refs, s.step(fed, model), fed)
    s.reset("a")
    for ref in refs.values():
        ref.reset_request("a")
    assert s.written("a") == {"slow": 0, "fast": 0}
    fed = feeds({"a": 2, "b": 1}, 8)
    check_against_references(refs, s.step(fed, model), fed)
    s.finish("b")
    assert all("b" not in c.requests for c in s.caches.values()) and s.free_lanes == 2


def test_one_session_class_runs_one_cache_or_named_ones():
    """`StreamSession({name: cache})` builds the session over named caches, a `MultiCacheSession` (the shape
    chosen once, by class): the same steps, lifecycle and results; a one-cache session is its one-entry
    case inside."""
    from flexkv import StreamSession

    a, b = StreamSession(bounded(), compile=False, token_sizes=TOKEN_SIZES), session()
    assert type(a) is type(b) is MultiCacheSession and isinstance(a, StreamSession)
    assert type(StreamSession(SLOW, compile=False)) is StreamSession
    assert type(a.context) is type(b.context) and a.token_sizes == b.token_sizes == TOKEN_SIZES
    for s in (a, b):
        s.start("p", sources={"slow": (0, 0)})
        s.fork("p", "q")
    for i, lengths in enumerate(SCHEDULE[:5]):
        fed = feeds({**lengths, "p": 1, "q": 2}, i)
        ra, rb = a.step(fed, model), b.step(fed, model)
        assert type(ra) is type(rb) and ra.lanes == rb.lanes and ra.tokens == rb.tokens
        for rid in ra:
            for name in CONFIGS:
                assert torch.equal(ra[rid][name], rb[rid][name]), (i, rid, name)
    a.rollback("q", {"slow": 1, "fast": 0})
    b.rollback("q", {"slow": 1, "fast": 0})
    assert observed(a)[:4] == observed(b)[:4] and a.sources("q") == {"slow": (0, 0), "fast": (0, 0)}


def test_each_spelling_refuses_the_forms_of_the_other_naming_its_own():
    from flexkv import StreamSession

    one, named = StreamSession(SLOW, compile=False), session()
    before = observed(named)
    with pytest.raises(ValueError, match=r"start: sources= is for a session over named caches; .* source= and "):
        one.start("a", sources={"slow": (0, 0)})
    with pytest.raises(ValueError, match=r"MultiCacheSession.start: this session's caches are named \['slow', 'fast'\]"
                                         r"; declare a source per cache, sources=\{name: \(source, source_len\)\}"):
        named.start("a", source=1, source_len=2)
    k = torch.zeros(SLOW.num_layers, 1, SLOW.num_heads, 1, SLOW.head_dim, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"MultiCacheSession.add_source\(cache_name, keys, values\) takes 3 arguments "
                                        r"\(the caches are \['slow', 'fast'\]\), got 2"):
        named.add_source(k, k)
    with pytest.raises(TypeError, match=r"StreamSession.remove_source\(index\) takes 1 arguments, got 2"):
        one.remove_source("slow", 0)
    with pytest.raises(AttributeError, match=r"over named caches \['slow', 'fast'\] has no one cache; use caches"):
        named.cache
    with pytest.raises(ValueError, match=r"groups is for one cache"):
        StreamSession(CONFIGS, groups=[SinkWindow(1, 5)] * 2, compile=False)
    assert observed(named) == before and one.requests == () and one.cache.requests == ()
    one.start("a", source_len=0)
    assert one.sources("a") == (0, 0) and one.caches == {None: one.cache}


# ------------------------------------------------------------------ compiled (the default)


def test_the_compiled_step_over_two_caches_is_one_graph_and_equals_eager():
    """One bucket per cache, so one graph: requests join and leave, two of them reading a prompt in the fast
    cache (a request's source is an input of the graph, not a guard), each step equals the eager session's."""
    slow = SLOW.replace(num_layers=1, dtype=torch.float32)
    fast = FAST.replace(num_layers=1, dtype=torch.float32, max_source_len=4, max_sources=1)
    kw = dict(token_sizes={"slow": (2,), "fast": (4,)}, block_size=8)
    compiled = MultiCacheSession({"slow": slow, "fast": fast}, **kw)
    eager = MultiCacheSession({"slow": slow, "fast": fast}, compile=False, **kw)

    def fn(attn, x):
        return {name: attn[name](0, *(x[name][:, :, i].transpose(1, 2) for i in range(3))).transpose(1, 2)
                for name in ("slow", "fast")}

    g = torch.Generator().manual_seed(0)
    prompt = [torch.randn(1, 1, 1, 4, 6, generator=g) for _ in range(2)]
    for s in (compiled, eager):
        assert s.add_source("fast", *prompt) == 0
    graphs = None
    for i, rids in enumerate(["a", "ab", "b", "bc"]):
        if i in (1, 3):  # "b" reads the whole prompt, "c" its first half
            for s in (compiled, eager):
                s.start(rids[1], sources={"fast": (0, {1: 4, 3: 2}[i])})
        fed = {r: {"slow": torch.randn(1 + i % 2, 3, 2, 4, generator=g), "fast": torch.randn(4, 3, 1, 6, generator=g)}
               for r in rids}
        got, want = compiled.step(fed, fn), eager.step(fed, fn)
        for r in rids:
            for name in ("slow", "fast"):
                check_close(got[r][name], want[r][name], 1e-5, f"step {i}, cache {name!r}, request {r!r}")
        if rids == "ab":
            compiled.finish("a")
            eager.finish("a")
        count = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        graphs = count if graphs is None else graphs
        assert count == graphs, f"step {i} compiled again"
    assert compiled.written("b") == eager.written("b")
    assert got.steps["fast"].positions["c"] == StreamPosition(2, 0, 0)
    assert got.steps["slow"].positions["c"].source_len == 0


def test_a_model_state_is_carried_per_request_and_only_a_committed_step_changes_it():
    """`initial_state`: here the running sum of every fast frame a request fed (padding adds zeros), returned
    under a key that names no cache, so the result cuts it to the request's lane only."""
    s = session(initial_state=lambda: torch.zeros(3, FAST.num_heads, FAST.head_dim, dtype=torch.float64))

    def fn(attn, x, state):
        new = state + x["fast"].sum(1)
        return {**model(attn, x), "total": new}, new

    def failing(attn, x, state):
        fn(attn, x, state)
        raise KeyboardInterrupt

    sums = {}
    for i, lengths in enumerate(SCHEDULE[:4]):
        fed = feeds(lengths, i)
        if i == 2:
            states = {rid: s.state(rid).clone() for rid in s.requests}
            with pytest.raises(KeyboardInterrupt):
                s.step(fed, failing)
            assert all(torch.equal(s.state(rid), st) for rid, st in states.items())
        res = s.step(fed, fn)
        for rid in lengths:
            sums[rid] = sums.get(rid, 0) + fed[rid]["fast"].sum(0)
            assert res[rid]["total"].shape == (3, FAST.num_heads, FAST.head_dim)
            check_close(res[rid]["total"], sums[rid], 1e-12, f"step {i}, request {rid!r}")
            assert res[rid]["fast"].shape[0] == 2 * lengths[rid] and res[rid]["slow"].shape[0] == lengths[rid]
    with pytest.raises(ValueError, match="carries a model state"):
        s.rollback("a", {"slow": 1, "fast": 2})
    s.finish("c")
    s.fork("a", "d")
    assert torch.equal(s.state("d"), s.state("a")) and s.state("d") is not s.state("a")
    s.rollback("d", {"slow": 1, "fast": 2}, state=torch.ones(3, 1, 6, dtype=torch.float64))
    assert torch.equal(s.state("d"), torch.ones(3, 1, 6, dtype=torch.float64))
    s.reset("a")
    assert not s.state("a").any() and s.written("a") == {"slow": 0, "fast": 0}


def test_a_step_function_made_anew_with_other_closure_values_warns_that_it_compiles_again():
    import warnings as _warnings

    from flexkv import RecompileWarning

    s = MultiCacheSession({"slow": SLOW.replace(dtype=torch.float32), "fast": FAST.replace(dtype=torch.float32)},
                          token_sizes={"slow": (1,), "fast": (2,)}, block_size=8)

    def make(scale):
        def stopped(attn, x):  # stops the trace at once: nothing is compiled, the warning comes first
            raise RuntimeError(f"stopped {scale}")
        return stopped

    fed = {"a": {"slow": torch.randn(1, 3, 2, 4), "fast": torch.randn(2, 3, 1, 6)}}
    with _warnings.catch_warnings():
        _warnings.simplefilter("error", RecompileWarning)
        with pytest.raises(Exception, match="stopped 1"):
            s.step(fed, make(1))
        with pytest.raises(Exception, match="stopped 1"):
            s.step(fed, make(1))  # the same values: the same step, no warning
    with pytest.warns(RecompileWarning, match=r"'stopped'.*\(scale\), so the model step compiles again"):
        with pytest.raises(Exception, match="stopped 2"):
            s.step(fed, make(2))
    assert s.requests == () and all(c.requests == () for c in s.caches.values())


def test_a_multi_step_context_refuses_a_commit_that_skipped_a_layer_naming_the_cache():
    caches = {name: BoundedKVManager(c, block_size=8) for name, c in CONFIGS.items()}
    multi = MultiStepContext(caches)
    steps = {name: BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0, 0)}) for name in CONFIGS}
    x = {name: torch.randn(1, 1, 3, c.num_heads, c.head_dim, dtype=torch.float64) for name, c in CONFIGS.items()}
    with pytest.raises(AttendanceError, match=r"MultiStepContext.commit \(cache 'slow'\).*cache layers 1 \(of 2\)"):
        with multi.stepping(steps):
            multi["slow"](0, *qkv(x["slow"], 0))
            for layer in range(FAST.num_layers):
                multi["fast"](layer, *qkv(x["fast"], layer))
    assert all(c.requests == () for c in caches.values()) and multi.transaction.status == "aborted"
    with multi.stepping(steps):
        model(multi, x)
    assert {name: c.written("a") for name, c in caches.items()} == {"slow": 1, "fast": 1}


def test_one_context_class_steps_one_cache_or_several_named_ones():
    """`StepContext({name: cache})` is the step object over named caches, a `MultiStepContext` (the shape chosen
    once, by class): each name's one-cache context, driven through it, gives what that context gives stepped
    alone."""
    caches, alone = bounded(), bounded()
    named, one = StepContext(caches), {name: StepContext(c) for name, c in alone.items()}
    assert type(named) is MultiStepContext and isinstance(named, StepContext)
    assert all(type(c) is StepContext for c in one.values())
    assert isinstance(named["slow"], StepContext) and one["slow"][None] is one["slow"] and list(named) == ["slow", "fast"]
    x = feeds({"a": 2}, 0)["a"]
    x = {name: t.unsqueeze(0) for name, t in x.items()}
    for written in range(3):
        steps = {name: BoundedKVStep((Segment("a", len(x[name][0])),), {"a": StreamPosition(0, written * len(x[name][0]))})
                 for name in CONFIGS}
        with named.stepping(steps) as plans:
            got = model(named, x)
            assert set(plans) == set(CONFIGS) and named.plans == plans
        assert named.plans is None  # the step is over: no layer attends with its plans
        want = {}
        for name, ctx in one.items():
            with ctx.stepping(steps[name]):
                want[name] = stack(ctx, x[name], name)
        for name in CONFIGS:
            assert torch.equal(got[name], want[name]), name
    assert {n: c.written("a") for n, c in caches.items()} == {"slow": 6, "fast": 12}
    with pytest.raises(ValueError, match=r"MultiStepContext.attend: this context steps the caches \['slow', 'fast'\]; call "
                                         r"it on one of them, context\[name\].attend"):
        named(0, *qkv(x["slow"], 0))
    with pytest.raises(ValueError, match=r"context\[name\].attention"):
        attention(named, 0)


@pytest.mark.parametrize("caches", [1, 2])
def test_a_session_step_checks_attendance_once_per_cache_as_its_commit_check(caches, monkeypatch):
    """The attendance check runs once per step (per cache), inside the step transaction's commit, for every
    door: a session step, a hand-driven context, and a warm-up step."""
    from flexkv import StreamSession
    from flexkv.model.attendance import AttendanceRecord

    checks = []
    real = AttendanceRecord.check
    monkeypatch.setattr(AttendanceRecord, "check", lambda self, where, layers=None: (checks.append(where),
                                                                                       real(self, where, layers))[1])
    if caches == 1:
        s = StreamSession(BoundedKVManager(SLOW, block_size=8), compile=False, token_sizes=(1, 2, 3))
        fed = {"a": feeds({"a": 2}, 0)["a"]["slow"]}
        fn = lambda attn, x: stack(attn, x, "slow")  # noqa: E731
    else:
        s, fed, fn = session(), feeds({"a": 2}, 0), model
    s.step(fed, fn)
    assert checks == [f"{type(s).__name__}.step (B=3, T={({'slow': 2, 'fast': 4} if caches == 2 else 2)})"
                      + ("" if caches == 1 else f" (cache {name!r})") for name in list(CONFIGS)[:caches]]
    checks.clear()
    s.warmup(fn, fed["a"])
    assert len(checks) == caches * len(s.batch_sizes) * (3 if caches == 1 else 9) and "warm-up" in checks[0]


def test_an_operation_called_from_inside_the_model_is_refused_and_changes_nothing():
    s = session()
    s.step(feeds({"a": 1}, 0), model)
    before = observed(s)

    def reenters(attn, x):
        s.finish("a")

    with pytest.raises(RuntimeError, match=r"finish\(\) was called while step\(\) is running in the same thread"):
        s.step(feeds({"a": 1, "b": 1}, 1), reenters)
    assert observed(s) == before


def test_a_chunk_with_look_ahead_in_one_cache_writes_only_its_span_there():
    """The fast cache gets 2 look-ahead frames (`Chunk(..., span=2n - 2)`): attended, not written; the slow cache
    writes everything it is fed."""
    s, refs = session(), {name: ReferenceCache(c) for name, c in CONFIGS.items()}
    for i, lengths in enumerate(SCHEDULE[:5]):
        fed = feeds(lengths, i)
        for rid, n in lengths.items():
            fed[rid]["fast"] = Chunk(fed[rid]["fast"], span=2 * n - 2)
        res = s.step(fed, model)
        check_against_references(refs, res, fed)
        assert {rid: res.tokens[rid] for rid in lengths} == {rid: {"slow": n, "fast": 2 * n} for rid, n in
                                                           lengths.items()}
    written = {rid: sum(step.get(rid, 0) for step in SCHEDULE[:5]) for rid in "abc"}
    steps = {rid: sum(1 for step in SCHEDULE[:5] if rid in step) for rid in "abc"}
    assert {rid: s.written(rid) for rid in "abc"} == {
        rid: {"slow": n, "fast": 2 * n - 2 * steps[rid]} for rid, n in written.items()}


# ------------------------------------------------------------------ sources in one cache of several

# A decoder cache reading a voice prompt (a shared source, or a request's own), beside an encoder cache
# without sources: a streaming speech pipeline's flow-matching DiT and its conformer.
DIT = BoundedKVConfig(num_layers=2, num_heads=2, head_dim=4, rows_per_request=1, max_source_len=5, max_sources=3,
                      retention=SinkWindow(1, 4), max_slots=3, max_step_tokens=3, query_window=4,
                      dtype=torch.float64)
VOICED = {"slow": SLOW, "dit": DIT}


def voiced(make=None, **kw):
    make = make or (lambda c: BoundedKVManager(c, block_size=8))
    return MultiCacheSession({name: make(c) for name, c in VOICED.items()}, compile=False,
                             token_sizes={"slow": (1, 2, 3), "dit": (1, 2, 3)}, **kw)


def voiced_model(attn, x):
    return {name: torch.stack([attn[name](layer, *qkv(x[name], layer)).transpose(1, 2)
                               for layer in range(c.num_layers)], dim=2)
            for name, c in VOICED.items()}


def voiced_feeds(lengths, seed):
    g = torch.Generator().manual_seed(300 + seed)
    return {rid: {name: torch.randn(n, 3, c.num_heads, c.head_dim, generator=g, dtype=torch.float64)
                  for name, c in VOICED.items()} for rid, n in lengths.items()}


def prompt(length, seed):
    """A voice prompt for the DiT cache: keys and values `[layers, rows, heads, length, head_dim]`."""
    g = torch.Generator().manual_seed(400 + seed)
    shape = (DIT.num_layers, 1, DIT.num_heads, length, DIT.head_dim)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


class Voiced:
    """A voiced session, the same over the uncached twin and a dense reference per cache, changed together."""

    def __init__(self, **kw):
        self.s, self.twin = voiced(**kw), voiced(UncachedHistory, **kw)
        self.refs = {name: ReferenceCache(c) for name, c in VOICED.items()}

    def both(self, op, *args, **kw):
        got = getattr(self.s, op)(*args, **kw)
        assert getattr(self.twin, op)(*args, **kw) == got
        return got

    def add_source(self, length, seed):
        k, v = prompt(length, seed)
        index = self.both("add_source", "dit", k, v)
        self.refs["dit"].add_source(index, k, v)
        return index

    def add_private_source(self, rid, length, seed):
        k, v = prompt(length, seed)
        self.both("add_private_source", "dit", rid, k, v)
        self.refs["dit"].add_private_source(rid, k, v)

    def step(self, lengths, seed):
        fed = voiced_feeds(lengths, seed)
        res, want = self.s.step(fed, voiced_model), self.twin.step(fed, voiced_model)
        assert res.lanes == want.lanes
        for rid in res.lanes:
            for name in VOICED:
                check_close(res[rid][name], want[rid][name], 1e-9, f"step {seed}, cache {name!r}, request {rid!r}")
        if res.lanes:
            for name, c in VOICED.items():  # the dense reference of each cache, its sources read from the positions
                step = res.steps[name]
                x = torch.zeros(len(step.segments), step.step_tokens, 3, c.num_heads, c.head_dim, dtype=torch.float64)
                for rid, lane in res.lanes.items():
                    x[lane, :len(fed[rid][name])] = fed[rid][name]
                for layer in range(c.num_layers):
                    ref = self.refs[name].attend(layer, *qkv(x, layer), step).transpose(1, 2)
                    for rid, lane in res.lanes.items():
                        check_close(res[rid][name][:, layer], ref[lane, :res.tokens[rid][name]], 1e-9,
                                    f"step {seed}, cache {name!r}, layer {layer}, request {rid!r}")
                self.refs[name].commit(step)
        return res


def observed_with_sources(s):
    """`observed`, and every request's declarations (waiting ones too) and each cache's sources."""
    return (observed(s), {r: s.sources(r) for r in s.requests + s.waiting},
            {name: (c.sources, c.private_sources) for name, c in s.caches.items()})


def test_a_voice_prompt_in_one_cache_and_none_in_the_other_match_the_references_and_the_twin():
    """Shared and private prompts in the DiT cache, none in the encoder's; fork carries the prompt, reset moves
    a request to another, finish frees a private one; every step exact against both."""
    v = Voiced()
    voice = v.add_source(5, 0)
    v.add_private_source("c", 4, 1)
    assert v.both("start", "a", sources={"dit": (voice, 5)})
    assert v.both("start", "b", sources={"dit": (voice, 3)})  # reads the first 3 entries of the same prompt
    assert v.both("start", "c", sources={"dit": (-1, 4)})
    assert v.s.sources("a") == {"slow": (0, 0), "dit": (voice, 5)}
    for i, lengths in enumerate(SCHEDULE[:4]):
        res = v.step(lengths, i)
    assert res.steps["dit"].positions["a"].source_len == 5 and res.steps["slow"].positions["a"].source_len == 0
    assert {name: pos.source for name, pos in ((n, res.steps[n].positions["c"]) for n in VOICED)} == {
        "slow": 0, "dit": -1}
    v.both("finish", "c")  # frees its private place in the DiT cache (place 1), in both sessions
    for s in (v.s, v.twin):
        assert s.caches["dit"].private_sources == {} and "c" not in s.caches["dit"].requests
    v.refs["slow"].remove_request("c")
    v.refs["dit"].remove_request("c")
    v.both("fork", "a", "d")
    for ref in v.refs.values():
        ref.fork("a", "d")
    assert v.s.sources("d") == v.s.sources("a") == {"slow": (0, 0), "dit": (voice, 5)}
    other = v.add_source(4, 2)
    assert other == 1  # the private place is free again
    v.both("reset", "b", sources={"dit": (other, 4)})
    for ref in v.refs.values():
        ref.reset_request("b")
    assert v.s.sources("b") == {"slow": (0, 0), "dit": (other, 4)}
    for i, lengths in enumerate([{"a": 2, "b": 3, "d": 1}, {"b": 1, "d": 3}, {"a": 3, "b": 2, "d": 2},
                                 {"a": 1, "b": 3, "d": 3}], start=10):
        res = v.step(lengths, i)
    assert res.steps["dit"].positions["d"].source_len == 5 and res.steps["dit"].positions["b"].source == other
    assert all(n > DIT.retention.window + 1 for n in (v.s.written("d")["dit"], v.s.written("b")["dit"]))
    v.both("reset", "a")  # no sources named: every cache keeps its declaration
    assert v.s.sources("a") == {"slow": (0, 0), "dit": (voice, 5)}


def test_bad_source_declarations_are_refused_naming_the_value_and_change_nothing():
    s = voiced(when_full="queue")
    voice = s.add_source("dit", *prompt(4, 0))
    s.start("a", sources={"dit": (voice, 4)})
    s.step(voiced_feeds({"a": 2}, 0), voiced_model)
    s.start("b")
    s.start("c")
    assert not s.start("w", sources={"dit": (voice, 2)})  # waits, with its declaration
    before = observed_with_sources(s)
    refusals = [
        (lambda: s.start("x", sources={"decoder": (voice, 4)}),
         r"no cache 'decoder'; this session's caches are \['slow', 'dit'\]"),
        (lambda: s.start("x", sources={"dit": (7, 2)}), r"cache 'dit': request 'x': unknown source 7; registered "
                                                        r"sources: \[0\]"),
        (lambda: s.start("x", sources={"dit": (voice, 6)}), r"cache 'dit': .*source_len=6 is outside "
                                                            r"\[min_source_len=0, max_source_len=5\]"),
        (lambda: s.start("x", sources={"dit": (voice, 5)}), r"cache 'dit': .*source_len=5 is longer than source 0 "
                                                            r"\(4 entries\)"),
        (lambda: s.start("x", sources={"slow": (voice, 1)}), r"cache 'slow': .*max_source_len=0"),
        (lambda: s.start("x", sources={"dit": (-1, 2)}), r"cache 'dit': .*source=-1 declares a private source"),
        (lambda: s.start("x", sources={"dit": voice}), r"sources\['dit'\] must be a \(source, source_len\) pair"),
        (lambda: s.start("x", sources=[("dit", (voice, 2))]), r"sources must map a cache name"),
        (lambda: s.reset("a", sources={"dit": (voice, 6)}), r"cache 'dit': .*source_len=6"),
        (lambda: s.reset("w", sources={"dit": (3, 1)}), r"cache 'dit': request 'w': unknown source 3"),
        (lambda: s.reset("a", sources={"fast": (0, 0)}), r"no cache 'fast'"),
        (lambda: s.add_source("decoder", *prompt(2, 1)), r"add_source: no cache 'decoder'"),
        (lambda: s.add_source("slow", *prompt(2, 1)), r"add_source: cache 'slow'"),
        (lambda: s.remove_source("decoder", voice), r"remove_source: no cache 'decoder'"),
        (lambda: s.remove_source("dit", voice), r"source 0 of cache 'dit' is declared by waiting requests \['w'\]"),
        (lambda: s.remove_source("dit", 2), r"cache 'dit': remove_source: no source 2"),
        (lambda: s.add_private_source("decoder", "x", *prompt(2, 1)), r"no cache 'decoder'"),
        (lambda: s.add_private_source("dit", "a", *prompt(2, 1)), r"cache 'dit': .*'a' has started its stream"),
        (lambda: s.remove_private_source("dit", "x"), r"cache 'dit': .*'x' has no private source"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
        assert observed_with_sources(s) == before, message
    s.finish("a")  # source 0 is still declared by "w", which now runs on it
    assert s.sources("w") == {"slow": (0, 0), "dit": (voice, 2)} and "w" in s.requests
    with pytest.raises(ValueError, match=r"cache 'dit': remove_source: source 0 is still read by requests \['w'\]"):
        s.remove_source("dit", voice)


def test_waiting_requests_keep_their_declared_sources_until_they_run():
    """Lanes full: a request waits on the shared prompt and one on its private prompt; refused removals change
    nothing; as lanes free up each runs on what it declared (checked against the references)."""
    v = Voiced()
    voice = v.add_source(5, 0)
    for rid in "abc":
        assert v.both("start", rid)
    v.step({"a": 2, "b": 1, "c": 3}, 0)
    v.add_private_source("p", 3, 1)
    assert not v.both("start", "w", sources={"dit": (voice, 4)})
    assert not v.both("start", "p", sources={"dit": (-1, 3)})
    assert v.s.waiting == ("w", "p") and v.s.sources("p") == {"slow": (0, 0), "dit": (-1, 3)}
    before = observed_with_sources(v.s)
    with pytest.raises(ValueError, match=r"declared by waiting requests \['w'\]"):
        v.s.remove_source("dit", voice)
    with pytest.raises(ValueError, match=r"waiting request 'p' is declared on it in cache 'dit'"):
        v.s.remove_private_source("dit", "p")
    with pytest.raises(ValueError, match=r"already started"):
        v.s.start("w")
    assert observed_with_sources(v.s) == before
    for rid in "ab":
        v.both("finish", rid)
        for ref in v.refs.values():
            ref.remove_request(rid)
    assert v.s.requests == ("w", "p", "c") and v.s.waiting == ()
    assert v.s.caches["dit"].slots.snapshot() == v.twin.caches["dit"].slots.snapshot()
    for i, lengths in enumerate([{"w": 3, "p": 2, "c": 1}, {"w": 1, "p": 3}, {"w": 2, "p": 3, "c": 3}], start=1):
        res = v.step(lengths, i)
    assert (res.steps["dit"].positions["w"].source, res.steps["dit"].positions["w"].source_len) == (voice, 4)
    assert (res.steps["dit"].positions["p"].source, res.steps["dit"].positions["p"].source_len) == (-1, 3)
    # a waiting request given a private source and finished before it ran frees it
    v.add_private_source("q", 2, 2)
    assert not v.both("start", "q", sources={"dit": (-1, 2)})
    v.both("finish", "q")
    assert "q" not in v.s.caches["dit"].private_sources and v.s.waiting == ()
    # and so does one given a private source and never started
    v.add_private_source("r", 2, 3)
    v.both("finish", "r")
    assert v.s.caches["dit"].private_sources == {"p": 1}


def test_a_waiting_request_whose_source_was_removed_behind_the_session_waits_until_the_place_is_filled_again():
    s = voiced()
    voice = s.add_source("dit", *prompt(4, 0))
    for rid in "abc":
        s.start(rid)
    assert not s.start("w", sources={"dit": (voice, 4)})
    s.caches["dit"].remove_source(voice)  # the cache itself does not know who waits for it
    s.finish("a")
    assert s.waiting == ("w",) and s.free_lanes == 1  # the lane stays free: "w" cannot start
    before = observed_with_sources(s)
    with pytest.raises(ValueError, match=r"request 'w' waits for a lane but can no longer start: .*cache 'dit'.*"
                                         r"unknown source 0"):
        s.step(voiced_feeds({"w": 1, "b": 1}, 0), voiced_model)
    assert observed_with_sources(s) == before
    assert s.add_source("dit", *prompt(4, 1)) == voice  # the same place again: "w" takes the lane
    assert s.requests == ("w", "b", "c") and s.sources("w")["dit"] == (voice, 4)
    res = s.step(voiced_feeds({"w": 1}, 1), voiced_model)
    assert res.steps["dit"].positions["w"] == StreamPosition(4, 0, voice)


def test_a_new_request_with_a_private_source_must_be_started_on_it_before_a_step():
    s = voiced()
    s.add_private_source("dit", "p", *prompt(3, 0))
    before = observed_with_sources(s)
    with pytest.raises(ValueError, match=r"request 'p' has a private source in cache 'dit' but was never started: "
                                         r"start\('p', sources=\{'dit': \(-1, source_len\)\}\)"):
        s.step(voiced_feeds({"p": 1}, 0), voiced_model)
    assert observed_with_sources(s) == before
    s.start("p", sources={"dit": (-1, 3)})
    with pytest.raises(ValueError, match=r"fork: cache 'dit': fork_request: request 'p' reads its private source"):
        s.fork("p", "q")  # a private prompt belongs to its request alone
    assert s.requests == ("p",) and s.caches["slow"].requests == ("p",)


def test_quantized_caches_with_a_voice_prompt_step_as_their_uncached_twins():
    """An int8 encoder cache and a float8 DiT cache reading a shared voice prompt, in one session: every step,
    fork and rollback equals the same session over the uncached twins, which attend on what the cells read
    back, through both rings' wraps; each cache stores 8-bit cells."""
    configs = {"slow": replace(SLOW, slot_dtype=torch.int8, max_rollback=2),
               "dit": replace(DIT, slot_dtype=torch.float8_e4m3fn, max_rollback=2)}

    def make(kind):
        return MultiCacheSession({name: kind(c) for name, c in configs.items()}, compile=False,
                                 token_sizes={"slow": (1, 2, 3), "dit": (1, 2, 3)})

    s, twin = make(lambda c: BoundedKVManager(c, block_size=8)), make(UncachedHistory)
    assert {name: c.k_cache_0.dtype for name, c in s.caches.items()} == {"slow": torch.int8,
                                                                         "dit": torch.float8_e4m3fn}
    k, v = prompt(5, 0)
    assert s.add_source("dit", k, v) == twin.add_source("dit", k, v) == 0
    for x in (s, twin):
        x.start("a", sources={"dit": (0, 5)})
        x.start("b", sources={"dit": (0, 3)})
    for i, lengths in enumerate(SCHEDULE):
        if i == 4:
            for x in (s, twin):
                x.finish("c")
                x.fork("a", "d")
                x.rollback("b", {"slow": 2, "dit": 1})
        fed = voiced_feeds({**lengths, **({"d": 2} if i >= 4 else {})}, i)
        res, want = s.step(fed, voiced_model), twin.step(fed, voiced_model)
        for rid in res.lanes:
            for name in VOICED:
                check_close(res[rid][name], want[rid][name], 1e-9, f"step {i}, cache {name!r}, request {rid!r}")
    assert all(n > DIT.retention.window + 1 for n in s.written("a").values())
