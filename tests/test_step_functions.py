"""A step function written anew in the step loop is the same step: the session compiles it once.

`session.step(feeds, lambda attn, x: model(attn, x))` in a loop makes a new
function object every step; the session recognises it by its code and what
its closure holds. A function of the same code that captures another value
is another step: it compiles again, and the session says so.
"""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from configs import small_config
from flexkv import BoundedKVManager, RecompileWarning, StreamSession
from flexkv.session.step_functions import step_key
from session_models import LAYERS, D, H, feed, model
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)


def session():
    cfg = small_config(num_layers=LAYERS, num_heads=H, head_dim=D, max_slots=2, max_step_tokens=1)
    return StreamSession(BoundedKVManager(cfg, block_size=8), token_sizes=(1,))


def test_a_lambda_written_in_the_loop_compiles_once_and_warns_nothing():
    s = session()
    eager = StreamSession(BoundedKVManager(s.config, block_size=8), compile=False, token_sizes=(1,))
    want = [eager.step({"a": feed(1, i)}, model)["a"] for i in range(4)]
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for i in range(4):
            got = s.step({"a": feed(1, i)}, lambda attn, x: model(attn, x))["a"]
            torch.testing.assert_close(got, want[i], rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_function_capturing_another_value_each_step_warns_that_it_compiles_again():
    s = session()
    with pytest.warns(RecompileWarning, match=r"a new function with the code of one compiled before but other "
                                              r"values \(scale\), so the model step compiles again"):
        for i in range(2):
            scale = 1.0 + i
            s.step({"a": feed(1, i)}, lambda attn, x: model(attn, x * scale))


def test_step_keys():
    class Runner:
        def forward(self, attn, x):
            return x

    r = Runner()
    assert step_key(r.forward) == step_key(r.forward) and step_key(r.forward) != step_key(Runner().forward)
    make = lambda v: (lambda attn, x: v)  # noqa: E731
    obj = object()
    assert step_key(make(obj)) == step_key(make(obj)) and step_key(make(obj)) != step_key(make(object()))
    assert step_key(make(3)) == step_key(make(3)) and step_key(make(3)) != step_key(make(4))
