"""A step must attend every declared cache layer exactly once, or it commits nothing.

Checked through each front door (a `StreamSession` eager and compiled, a
`StepContext` driven by hand, `swap_attention`), on the two ways a port goes
silently wrong: a swap of a method the model never calls, and a module the
model calls several times per step (solver steps, a weight-tied loop), whose
k-th call is its own cache layer (`calls_per_step`).
"""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    Segment,
    SinkWindow,
    StepContext,
    StreamPosition,
    StreamSession,
    swap_attention,
)
from flexkv.model.attendance import AttendanceError
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

DIM, HEADS, T = 16, 2, 4


class ChunkAttention(nn.Module):
    """An attention module of a streaming model whose blocks call `forward_chunk` (its own streaming entry),
    never `forward`; both attend the whole chunk (no history of their own here)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def split(self, x):
        B, L, _ = x.shape
        return self.qkv(x).view(B, L, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)

    def merge(self, o):
        return self.out(o.transpose(1, 2).flatten(2))

    def forward(self, x):
        return self.merge(F.scaled_dot_product_attention(*self.split(x)))

    def forward_chunk(self, x):  # its own code path (a streaming entry does not go through forward)
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ChunkAttention()

    def forward(self, x):
        return x + self.attn.forward_chunk(x)


class Estimator(nn.Module):
    """Two blocks; `loops` times over both per step (a solver step each, weights shared)."""

    def __init__(self, loops=1):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.loops = loops

    def forward(self, x):
        for _ in range(self.loops):
            for blk in self.blocks:
                x = blk(x)
        return x


def flexkv_attention(self, attn, x):
    return self.merge(attn(*self.split(x)))


def config(layers, window=64):
    return BoundedKVConfig(num_layers=layers, num_heads=HEADS, head_dim=DIM // HEADS, rows_per_request=1,
                           max_source_len=0, max_sources=0, retention=SinkWindow(0, window), max_slots=2,
                           max_step_tokens=T)


def model(loops=1):
    torch.manual_seed(0)
    return Estimator(loops).eval().requires_grad_(False)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_swap_of_a_method_the_model_never_calls_is_refused_and_commits_nothing(compiled):
    m = model()
    session = StreamSession(config(2), compile=compiled, token_sizes=(T,), block_size=16)
    swap_attention(m, session.context, ChunkAttention, flexkv_attention)  # replaces forward only
    fn = lambda attn, x: m(x)  # noqa: E731
    with pytest.raises(AttendanceError, match=r"cache layers 0-1 \(of 2\) were never attended.*blocks\.0\.attn was "
                                              r"never called through \.forward\(\).*methods=") as err:
        session.step({"a": torch.randn(T, DIM)}, fn)
    if compiled:
        assert "warm-up" in str(err.value)  # refused on padding steps, before any request's step ran
    assert session.requests == () and session.cache.requests == ()  # the step started nothing


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_naming_the_method_the_model_calls_attends_through_flexkv(compiled):
    m = model()
    x = torch.randn(T, DIM)
    want = m(x.unsqueeze(0))[0]  # the first chunk of a stream attends itself only
    session = StreamSession(config(2), compile=compiled, token_sizes=(T,), block_size=16)
    swap = swap_attention(m, session.context, ChunkAttention, flexkv_attention, methods=("forward_chunk",))
    assert "forward" not in m.blocks[0].attn.__dict__ and "forward_chunk" in m.blocks[0].attn.__dict__
    fn = lambda attn, x: m(x)  # noqa: E731
    got = session.step({"a": x}, fn)["a"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert session.written("a") == T
    swap.restore()
    assert "forward_chunk" not in m.blocks[0].attn.__dict__


class OwnLoopCaches:
    """The looped estimator's own streaming: every (loop, block) call keeps its own history of keys and
    values (no eviction within the test), a chunk attends that history and itself."""

    def __init__(self, m):
        self.m = m
        self.kv = {}

    def __call__(self, x):  # x [1, T, DIM]
        counter = {}

        def attend(self_attn, x):
            call = counter.get(id(self_attn), 0)
            counter[id(self_attn)] = call + 1
            q, k, v = self_attn.split(x)
            key = (id(self_attn), call)
            if key in self.kv:
                k, v = torch.cat([self.kv[key][0], k], 2), torch.cat([self.kv[key][1], v], 2)
            self.kv[key] = (k, v)
            return self_attn.merge(F.scaled_dot_product_attention(q, k, v))

        for blk in self.m.blocks:
            blk.attn.__dict__["forward_chunk"] = lambda x, a=blk.attn: attend(a, x)
        try:
            return self.m(x)
        finally:
            for blk in self.m.blocks:
                del blk.attn.__dict__["forward_chunk"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_module_called_several_times_per_step_gets_a_cache_layer_per_call(compiled):
    m = model(loops=3)
    own = OwnLoopCaches(m)
    chunks = [torch.randn(T, DIM, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want = [own(c.unsqueeze(0))[0] for c in chunks]
    session = StreamSession(config(6), compile=compiled, token_sizes=(T,), block_size=16)
    swap = swap_attention(m, session.context, ChunkAttention, flexkv_attention, methods="forward_chunk",
                          calls_per_step=3)
    # call-major: loop 0 attends layers 0 (block 0) and 1 (block 1), loop 1 layers 2 and 3, ...
    assert swap.layers == ((0, 2, 4), (1, 3, 5)) and swap.layers_of(m.blocks[1].attn) == (1, 3, 5)
    fn = lambda attn, x: m(x)  # noqa: E731
    before = counters["stats"]["unique_graphs"]
    for c, w in zip(chunks, want):
        torch.testing.assert_close(session.step({"a": c}, fn)["a"], w, rtol=0, atol=1e-4)
    if compiled:
        assert counters["stats"]["unique_graphs"] - before == 1  # the call counts never recompile the step
    assert session.written("a") == 4 * T


def test_calls_that_do_not_match_the_declaration_are_refused_naming_the_calls():
    m = model(loops=3)
    with pytest.raises(ValueError, match=r"2 modules match .* 2 attention calls per step, but the cache has num_layers=6.*"
                                         r"pass calls_per_step=3"):
        swap_attention(m, StreamSession(config(6), compile=False).context, ChunkAttention, flexkv_attention,
                       methods="forward_chunk")
    session = StreamSession(config(4), compile=False, token_sizes=(T,))
    swap_attention(m, session.context, ChunkAttention, flexkv_attention, methods="forward_chunk", calls_per_step=2)
    with pytest.raises(AttendanceError, match=r"blocks\.0\.attn was called 3 times through \.forward_chunk\(\) in "
                                              r"one step, but it was declared for calls_per_step=2"):
        session.step({"a": torch.randn(T, DIM)}, lambda attn, x: m(x))
    assert session.requests == ()
    m.loops = 2
    session.step({"a": torch.randn(T, DIM)}, lambda attn, x: m(x))
    assert session.written("a") == T


def test_per_module_counts_and_their_layers():
    m = model(loops=1)
    session = StreamSession(config(3), compile=False, token_sizes=(T,))
    swap = swap_attention(m, session.context, ChunkAttention, flexkv_attention, methods="forward_chunk",
                          calls_per_step=[2, 1])
    assert swap.layers == ((0, 2), (1,))
    with pytest.raises(AttendanceError, match=r"blocks\.0\.attn was called 1 time .* calls_per_step=2"):
        session.step({"a": torch.randn(T, DIM)}, lambda attn, x: m(x))


def test_a_hand_driven_step_context_refuses_a_layer_attended_twice_or_never():
    cache = BoundedKVManager(config(2), block_size=16)
    ctx = StepContext(cache)
    q = torch.randn(1, HEADS, T, DIM // HEADS)
    for layers, match in (([0, 0], r"cache layer 0 was attended 2 times"), ([0], r"cache layers 1 \(of 2\) were "
                                                                               r"never attended")):
        ctx.begin(BoundedKVStep((Segment("a", T),), {"a": StreamPosition(0, 0)}, tokens=T))
        for layer in layers:
            ctx.attend(layer, q, q, q)
        with pytest.raises(AttendanceError, match=match):
            ctx.commit()
        assert cache.requests == ()  # nothing committed, and the step's admission taken back
    ctx.begin(BoundedKVStep((Segment("a", T),), {"a": StreamPosition(0, 0)}, tokens=T))
    ctx.attend(0, q, q, q)
    ctx.attend(1, q, q, q)
    ctx.commit()
    assert cache.written("a") == T


def test_a_step_in_chunks_attends_every_layer_once_per_chunk_and_matches_one_step():
    """`begin((chunk, chunk))`: one transaction, a plan per chunk; each layer attends each chunk once through
    the context (`plan=`), the commit writes both chunks, and the outputs are one two-chunk-long step's.
    A layer that misses a chunk commits nothing."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, HEADS, 2 * T, DIM // HEADS) for _ in range(3))

    def chunk(i):
        return BoundedKVStep((Segment("a", T),), {"a": StreamPosition(0, i * T)}, tokens=T)

    causal = config(2, window=5).replace(causal_step=True)  # a chunk's queries read the chunk up to themselves
    whole_cache = BoundedKVManager(causal.replace(max_step_tokens=2 * T), block_size=16)
    whole = StepContext(whole_cache)
    whole.begin(BoundedKVStep((Segment("a", 2 * T),), {"a": StreamPosition(0, 0)}, tokens=2 * T))
    want = [whole.attend(layer, q, k, v) for layer in range(2)]
    whole.commit()

    cache = BoundedKVManager(causal, block_size=16)
    ctx = StepContext(cache)
    plans = ctx.begin((chunk(0), chunk(1)))
    assert isinstance(plans, tuple) and len(plans) == 2
    with pytest.raises(ValueError, match=r"the step was begun in 2 chunks; pass each chunk's plan"):
        ctx.attend(0, q[:, :, :T], k[:, :, :T], v[:, :, :T])
    ctx.attend(0, q[:, :, :T], k[:, :, :T], v[:, :, :T], plan=plans[0])
    ctx.attend(1, q[:, :, :T], k[:, :, :T], v[:, :, :T], plan=plans[0])
    ctx.attend(0, q[:, :, T:], k[:, :, T:], v[:, :, T:], plan=plans[1])
    with pytest.raises(AttendanceError, match=r"cache layer 1 was attended 1 times for the step's 2 chunks"):
        ctx.commit()
    assert cache.requests == ()

    plans = ctx.begin([chunk(0), chunk(1)])
    got = [torch.cat([ctx.attend(layer, q[:, :, s], k[:, :, s], v[:, :, s], plan=p)
                      for s, p in ((slice(0, T), plans[0]), (slice(T, 2 * T), plans[1]))], dim=2)
           for layer in range(2)]
    ctx.commit()
    assert cache.written("a") == 2 * T == whole_cache.written("a")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_model_layers_mapped_onto_cache_layers_are_counted_as_model_layers():
    """`StepContext(cache, layers=...)`: model layers 0 and 2 read cache layers 0 and 1, model layer 1 attends
    none (a recurrent layer); attend takes model layers, and the check names the one that was skipped."""
    cache = BoundedKVManager(config(2), block_size=16)
    ctx = StepContext(cache, layers=(0, None, 1))
    q = torch.randn(1, HEADS, T, DIM // HEADS)
    step = BoundedKVStep((Segment("a", T),), {"a": StreamPosition(0, 0)}, tokens=T)
    ctx.begin(step)
    with pytest.raises(ValueError, match=r"model layer 1 attends no cache layer .*only layers 0, 2 attend"):
        ctx.attend(1, q, q, q)
    ctx.attend(0, q, q, q)
    with pytest.raises(AttendanceError, match=r"attention layers 2 \(of 2\) were never attended"):
        ctx.commit()
    ctx.begin(step)
    ctx.attend(0, q, q, q)
    ctx.attend(2, q, q, q)
    ctx.commit()
    assert cache.written("a") == T
    with pytest.raises(ValueError, match=r"no model layer attends cache layers 1"):
        StepContext(cache, layers=(0, 0))
    with pytest.raises(ValueError, match=r"layers\[1\]=2 is no cache layer; the cache has layers 0..1"):
        StepContext(cache, layers=(0, 2))


def test_a_transformers_forward_that_skips_an_attention_layer_commits_nothing():
    """FlexKVCache: a layer whose attention never reached flexkv (here: replaced by hand) fails the forward
    and leaves every stream where it was; the same generate() afterwards is the cache's usual one."""
    hf_models = pytest.importorskip("hf_models")
    from flexkv.integrations.transformers import FlexKVCache

    model = hf_models.make_model("qwen3", seed=5)
    ids, mask = hf_models.left_pad(hf_models.prompts((6, 11), seed=6))
    kw = dict(max_streams=3, prefill_chunk=hf_models.CHUNK, block_size=16)
    gen = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    window = SinkWindow(hf_models.SINK, hf_models.WINDOW)
    want = model.generate(ids, cache=FlexKVCache(model, window, **kw), **gen)
    cache = FlexKVCache(model, window, **kw)
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    try:
        with pytest.raises(AttendanceError, match=r"FlexKVCache.commit: .*attention layers 1 \(of 2\) were never "
                                                  r"attended"):
            model.generate(ids, cache=cache, **gen)
    finally:
        del attn.forward
    assert cache.streams == () and cache.get_seq_length() == 0
    assert model.generate(ids, cache=cache, **gen).tolist() == want.tolist()
