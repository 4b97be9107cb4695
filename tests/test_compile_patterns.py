"""The ways users compile attention through the cache, each with torch.compile's defaults (dynamic=None).

Each pattern runs warm-up steps, then steps with `error_on_recompile`: new
positions, rings wrapping, requests leaving and arriving. Outputs are
checked against the dense reference on every step, and the number of
graphs compiled is counted.
"""

import pytest
import torch
import torch._dynamo
from random_workload import RandomWorkload, check_close
from torch import nn
from torch._dynamo.utils import counters

from flexkv import BoundedKVConfig, BoundedKVManager, SinkWindow
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

LAYERS = 3
CFG = BoundedKVConfig(
    num_layers=LAYERS, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=0, max_sources=0,
    retention=SinkWindow(2, 9), max_slots=3, max_step_tokens=2,
)
TOL = 1e-4


def graphs():
    return counters["stats"]["unique_graphs"]


def run(attend, warm_steps, steps=14, seed=3):
    """Warm up, then run `steps` steps that may not compile anything; returns (graphs at warm-up, workload)."""
    torch._dynamo.reset()
    manager = BoundedKVManager(CFG, "cpu", block_size=16)
    work = RandomWorkload(CFG, q_heads=4, segments=3, seed=seed, manager=manager, fixed_tokens=2, churn=0.2,
                          attend=attend(manager), tolerance=TOL)
    before = graphs()
    for _ in range(warm_steps):
        work.step()
    warm = graphs() - before
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(steps):
            work.step()
    assert graphs() - before == warm
    # the run reached past the window and saw requests come and go
    assert max(r[2] for r in work.state.values()) > 9 or work.next_id > 3
    return warm, work


def test_compiled_attend_called_per_layer():
    """`attend = torch.compile(cache.attend, fullgraph=True)`, then `attend(layer, ...)` for each layer.

    Dynamo turns the layer argument into a symbolic int from the second layer
    on; the cache specialises it, so each layer gets one graph at warm-up.
    """

    def pattern(manager):
        attend = torch.compile(manager.attend, fullgraph=True)
        return lambda m, plan, qs, ks, vs: [attend(layer, qs[layer], ks[layer], vs[layer], plan)
                                            for layer in range(LAYERS)]

    warm, _ = run(pattern, warm_steps=1)
    assert warm == LAYERS


def test_compiled_whole_model():
    def pattern(manager):
        @torch.compile(fullgraph=True)
        def model(qs, ks, vs, plan):
            return [manager.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(LAYERS)]

        return lambda m, plan, qs, ks, vs: model(qs, ks, vs, plan)

    warm, _ = run(pattern, warm_steps=1)
    assert warm == 1


class Layer(nn.Module):
    """A model's attention layer holding its layer index."""

    def __init__(self, cache: BoundedKVManager, layer_idx: int):
        super().__init__()
        object.__setattr__(self, "cache", cache)
        self.layer_idx = layer_idx

    def forward(self, q, k, v, plan):
        return self.cache.attend(self.layer_idx, q, k, v, plan)


def test_compiled_layer_module_per_layer():
    """`torch.compile(layer)` for each layer module: the modules share one forward, each layer one graph."""

    def pattern(manager):
        layers = [torch.compile(Layer(manager, i), fullgraph=True) for i in range(LAYERS)]
        return lambda m, plan, qs, ks, vs: [layers[i](qs[i], ks[i], vs[i], plan) for i in range(LAYERS)]

    warm, _ = run(pattern, warm_steps=1)
    assert warm == LAYERS


def test_symbolic_layer_index_is_still_checked():
    """A layer index out of range is refused in a compiled attend too, once dynamo has made it symbolic.

    Under `fullgraph=True` dynamo reports the ValueError as its own `Unsupported` error carrying the message.
    """
    torch._dynamo.reset()
    manager = BoundedKVManager(CFG, "cpu", block_size=16)
    work = RandomWorkload(CFG, q_heads=4, segments=1, seed=1, manager=manager, fixed_tokens=2, churn=0.0)
    attend = torch.compile(manager.attend, fullgraph=True)
    step = work.make_step()
    manager.admit(step)
    plan = manager.plan(step)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16)
    for layer in range(2):
        attend(layer, q, k, k, plan)
    with pytest.raises(Exception, match=r"layer_idx must be an int in \[0, 3\), got an index outside that range"):
        attend(LAYERS, q, k, k, plan)


def test_elementwise_ops_right_after_attention_compile():
    """A compiled decode step whose model applies elementwise ops straight to `attend`'s output:
    a scale, a gate, a residual add and a classifier-free-guidance mix of the two rows of a
    request. Inductor's CPU FlexAttention kernel cannot take them as fused epilogues; the cache
    keeps them apart, and every output matches the reference with the same ops applied."""
    from flexkv import BoundedKVStep, Segment, StreamPosition
    from flexkv.model.reference import ReferenceCache

    cfg = CFG.replace(rows_per_request=2, max_step_tokens=1)
    manager = BoundedKVManager(cfg, "cpu", block_size=16)
    ref = ReferenceCache(cfg)

    def epilogues(o, x, gate):
        cond, uncond = o[0::2], o[1::2]
        return [o * 2, o * torch.sigmoid(gate), x + o, uncond + 1.5 * (cond - uncond)]

    @torch.compile(fullgraph=True)
    def step_fn(qs, ks, vs, x, gate, plan):
        return [epilogues(manager.attend(layer, qs[layer], ks[layer], vs[layer], plan), x, gate)
                for layer in range(LAYERS)]

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    written = 0
    for s in range(12):
        step = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, written)})
        manager.admit(step)
        plan = manager.plan(step)
        qs, ks, vs = ([torch.randn(4, h, 1, 16, generator=g) for _ in range(LAYERS)] for h in (4, 2, 2))
        x, gate = torch.randn(4, 4, 1, 16, generator=g), torch.randn(4, 4, 1, 16, generator=g)
        got = step_fn(qs, ks, vs, x, gate, plan)
        for layer in range(LAYERS):
            want = epilogues(ref.attend(layer, qs[layer], ks[layer], vs[layer], step), x.double(), gate.double())
            for e, (a, b) in enumerate(zip(got[layer], want)):  # request a's rows of each epilogue's output
                check_close(a[:2], b[:2], TOL, f"step {s}, layer {layer}, epilogue {e}, request 'a'")
        manager.commit(step)
        ref.commit(step)
        written += 1
    assert manager.written("a") == written and written > 2 + 9  # committed every step, past the window
