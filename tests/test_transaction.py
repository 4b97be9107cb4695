"""The step transaction (`flexkv.cache.host.transaction.StepTransaction`): each undo on its own, and through
the doors that use it.

"Changed nothing" is checked on the cache's slot table itself (`slots.snapshot()`: every request, slot,
written count, source binding, free slot and source place), over each cache. The session's door is
covered by tests/test_session_lifecycle.py (failing and interrupted model functions) and the
transformers door by tests/test_transformers_streams.py (interrupted forwards); here the StepContext
door, which had no undo of its own before.
"""

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.groups import LayerGroup
from flexkv.cache.host.transaction import StepTransaction
from flexkv.cache.manager import BoundedKVManager
from flexkv.model.step_context import StepContext
from flexkv.model.uncached import UncachedHistory
from flexkv.model.wrap import attention
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

H, D, LAYERS = 2, 4, 2
CONFIG = BoundedKVConfig(num_layers=LAYERS, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=3,
                         retention=SinkWindow(1, 3), max_slots=3, max_step_tokens=2, max_sources=2,
                         dtype=torch.float32)
GROUPS = (LayerGroup((0,), SinkWindow(0, 2)), LayerGroup((1,), SinkWindow(1, 3)))
CACHES = {
    "bounded": lambda: BoundedKVManager(CONFIG, block_size=8),
    "grouped": lambda: BoundedKVManager(CONFIG, groups=GROUPS, block_size=8),
    "uncached": lambda: UncachedHistory(CONFIG, GROUPS),
}


@pytest.fixture(params=list(CACHES))
def cache(request):
    """A cache holding request "a" with 1 committed token (on no source) and source 0 of 3 entries."""
    c = CACHES[request.param]()
    keys = torch.randn(LAYERS, 1, H, 3, D)
    assert c.add_source(keys, keys) == 0
    first = step(a=(1, 0, 0, 0))
    c.admit(first)
    plan = c.plan(first)
    for layer in range(LAYERS):  # the twin keeps what each layer attended
        c.attend(layer, *qkv(), plan)
    c.commit(first)
    return c


def step(tokens=None, **requests):
    """A step of `request id=(span, source_len, written, source)`."""
    segments = tuple(Segment(rid, span) for rid, (span, *_) in requests.items())
    positions = {rid: StreamPosition(L, w, src) for rid, (_, L, w, src) in requests.items()}
    return BoundedKVStep(segments, positions, tokens=tokens)


def test_commit_commits_every_planned_step_in_order(cache):
    txn = StepTransaction(cache)
    txn.begin(step(a=(2, 0, 1, 0), b=(2, 2, 0, 0)))
    txn.plan(step(a=(1, 0, 3, 0), b=(1, 2, 2, 0)))  # a second chunk of the same streams
    txn.commit()
    assert txn.status == "committed"
    assert (cache.written("a"), cache.written("b")) == (4, 3)


def test_abort_takes_back_the_requests_it_admitted(cache):
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 0, 1, 0), b=(1, 2, 0, 0)))
    assert cache.requests == ("a", "b") and cache.free_slots == 1
    assert txn.abort() is True
    assert cache.slots.snapshot() == before and cache.requests == ("a",) and cache.free_slots == 2


def test_abort_unbinds_a_stream_it_started(cache):
    cache.reset_request("a")  # keeps its slot; its next admit binds the source it declares
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 2, 0, 0)))
    assert txn.abort()
    assert cache.slots.snapshot() == before
    StepTransaction(cache).begin(step(a=(1, 0, 0, 0)))  # unbound again: it may start on no source


def test_abort_keeps_a_private_source_given_before_the_step(cache):
    keys = torch.randn(LAYERS, 1, H, 2, D)
    place = cache.add_private_source("p", keys, keys)
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    txn.begin(step(p=(1, 2, 0, -1)))
    txn.abort()
    assert cache.slots.snapshot() == before and cache.private_sources == {"p": place}


def test_an_interrupt_inside_the_with_block_aborts(cache):
    before = cache.slots.snapshot()
    with pytest.raises(KeyboardInterrupt):
        with StepTransaction(cache) as txn:
            txn.begin(step(a=(1, 0, 1, 0), b=(1, 0, 0, 0)))
            raise KeyboardInterrupt
    assert txn.status == "aborted" and cache.slots.snapshot() == before


def test_the_with_block_commits_when_it_ends(cache):
    with StepTransaction(cache) as txn:
        txn.begin(step(a=(1, 0, 1, 0)))
    assert txn.status == "committed" and cache.written("a") == 2


def test_a_failing_commit_check_commits_nothing_and_aborts(cache):
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 0, 1, 0), b=(1, 0, 0, 0)))
    seen = []

    def check(t):
        seen.append(t.steps)
        raise ValueError("layer 1 was not attended")

    txn.add_commit_check(check)
    with pytest.raises(ValueError, match="layer 1 was not attended"):
        txn.commit()
    assert seen == [[step(a=(1, 0, 1, 0), b=(1, 0, 0, 0))]]
    assert txn.status == "aborted" and cache.slots.snapshot() == before and cache.written("a") == 1


def test_a_plan_that_fails_takes_its_admit_back():
    class FailingPlan(BoundedKVManager):
        def plan(self, step):
            raise RuntimeError("planning failed")

    cache = FailingPlan(CONFIG, block_size=8)
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    with pytest.raises(RuntimeError, match="planning failed"):
        txn.begin(step(a=(1, 0, 0, 0)))
    assert txn.status == "aborted" and cache.slots.snapshot() == before


def test_a_refused_admit_changes_nothing_and_leaves_the_step_open(cache):
    before = cache.slots.snapshot()
    txn = StepTransaction(cache)
    with pytest.raises(ValueError, match=r"request 'a': written=0 but 1 tokens are committed"):
        txn.begin(step(a=(1, 0, 0, 0)))
    assert cache.slots.snapshot() == before and txn.is_open  # admit is atomic: nothing to undo


def test_undos_run_last_first_and_every_one_runs(cache):
    txn = StepTransaction(cache)
    order = []
    txn.add_undo(lambda: order.append(1))
    txn.add_undo(lambda: (order.append(2), 1 / 0))
    txn.add_undo(lambda: order.append(3))
    with pytest.raises(ZeroDivisionError):
        txn.abort()
    assert order == [3, 2, 1] and txn.status == "aborted"


def test_a_closed_step_takes_no_more_calls(cache):
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 0, 1, 0)))
    txn.commit()
    after = cache.slots.snapshot()
    assert txn.abort() is False  # a door's `except` may call it: a committed step stays committed
    for call in (lambda: txn.commit(), lambda: txn.admit(step(b=(1, 0, 0, 0))), lambda: txn.plan(step())):
        with pytest.raises(ValueError, match=r"StepTransaction\.\w+: this step is already committed"):
            call()
    assert cache.slots.snapshot() == after


def test_one_step_over_two_caches_commits_both_or_neither(cache):
    """A second cache joins the step with `cache=`: its admission is undone with the first's, and
    `commit` runs every check before it commits either cache."""
    other = BoundedKVManager(CONFIG, block_size=8)
    before, other_before = cache.slots.snapshot(), other.slots.snapshot()
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 0, 1, 0), b=(1, 0, 0, 0)))
    txn.begin(step(b=(2, 0, 0, 0)), other)
    assert txn.caches == [cache, other] and other.requests == ("b",)
    txn.add_commit_check(lambda t: (_ for _ in ()).throw(ValueError("the second cache's layer 0 was not attended")))
    with pytest.raises(ValueError, match="second cache"):
        txn.commit()
    assert (cache.slots.snapshot(), other.slots.snapshot()) == (before, other_before)
    txn = StepTransaction(cache)
    txn.begin(step(a=(1, 0, 1, 0)))
    txn.begin(step(b=(2, 0, 0, 0)), other)
    txn.commit()
    assert (cache.written("a"), other.written("b"), other.requests) == (2, 2, ("b",))


# ------------------------------------------------------------- the StepContext door


def qkv(n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, 1, D, generator=g), torch.randn(n, H, 1, D, generator=g), torch.randn(n, H, 1, D, generator=g)


def test_a_context_step_that_raises_mid_forward_changes_nothing(cache):
    """Layer 0 attends, then the model raises: the new request "b" is gone and "a" is where it was."""
    ctx = StepContext(cache)
    layers = [attention(ctx, i) for i in range(LAYERS)]
    before = cache.slots.snapshot()
    for error in (RuntimeError("the model failed"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with ctx.stepping(step(a=(1, 0, 1, 0), b=(1, 2, 0, 0))):
                layers[0](*qkv(2))
                raise error
        assert ctx.transaction.status == "aborted" and cache.slots.snapshot() == before
    with ctx.stepping(step(a=(1, 0, 1, 0))):  # and the next step runs as if nothing happened
        for layer in layers:
            layer(*qkv())
    assert cache.written("a") == 2 and cache.requests == ("a",)


def test_a_context_begin_while_a_step_is_open_is_refused(cache):
    ctx = StepContext(cache)
    ctx.begin(step(a=(1, 0, 1, 0), b=(1, 0, 0, 0)))
    with pytest.raises(ValueError, match=r"StepContext.begin: the step begun last is still open"):
        ctx.begin(step(a=(1, 0, 1, 0)))
    assert ctx.abort() is True and ctx.abort() is False
    assert cache.requests == ("a",)
    ctx.begin(step(a=(1, 0, 1, 0)))
    for layer in range(LAYERS):  # a step commits only once every layer attended
        ctx.attend(layer, *qkv())
    ctx.commit()
    assert cache.written("a") == 2


class ProtocolOnly:
    """A cache with the protocol's methods only (none of flexkv's extras such as `plan_eager`)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "plan_eager":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_an_eager_step_takes_plan_eager_where_the_cache_has_it_and_plan_where_not():
    eager = step(a=(1, 0, 0, 0))  # a new request's first token
    own = BoundedKVManager(CONFIG, block_size=8)
    txn = StepTransaction(own)
    assert not txn.begin(eager, eager_only=True).parts_made  # flexkv's cache: the plan eager calls read
    txn.abort()
    other = ProtocolOnly(BoundedKVManager(CONFIG, block_size=8))
    txn = StepTransaction(other)
    plan = txn.begin(eager, eager_only=True)  # a cache without plan_eager is planned with plan
    assert plan.parts_made
    txn.abort()
