"""A compiled session step that recompiles after warm-up says which guard failed and what to do.

The model here keeps a Python counter on a module, as a model left in its own
streaming mode keeps its position offset: dynamo guards on its value, so
every step compiles again. The session warns at the first such recompile and,
when torch.compile gives up (`recompile_limit`), raises `RecompileError` with
the failing guard instead of dynamo's bare `FailOnRecompileLimitHit`; the
failed step changes nothing.
"""

import pytest
import torch
import torch._dynamo
from torch import nn

from configs import small_config
from flexkv import StreamSession
from flexkv.compiling import RecompileError, RecompileWarning
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)


class OwnStreamingMode(nn.Module):
    """Attention whose projection adds a position offset it counts itself (an int attribute)."""

    def __init__(self):
        super().__init__()
        self.offset = 0
        self.qkv = nn.Linear(8, 48)

    def forward(self, attn, x):
        self.offset += 1
        B, T, _ = x.shape
        q, k, v = (self.qkv(x) + self.offset).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return attn(0, q, k, v).transpose(1, 2).reshape(B, T, 16)


def test_a_recompile_after_warm_up_names_the_guard_and_the_limit_raises_with_it():
    cfg = small_config(num_layers=1, max_slots=2, max_step_tokens=1)
    model = OwnStreamingMode().requires_grad_(False)
    session = StreamSession(cfg, block_size=8)
    x = torch.randn(1, 8)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        session.warmup(model, x)  # compiles with offset 0 -> 1
        with pytest.warns(RecompileWarning) as caught:
            session.step({"a": x}, model)
        message = str(next(w.message for w in caught if issubclass(w.category, RecompileWarning)))
        assert "the compiled model step (B=2, T=1) recompiled after warm-up" in message
        assert ".offset == 0" in message  # the guard (the value the warm-up graph was built for)
        assert "self.offset += 1" in message  # and where
        assert "switch the model's own cache and streaming state off" in message
        with pytest.raises(RecompileError, match=r"(?s)gave up \(torch._dynamo.config.recompile_limit=2\)"
                                                 r".*\.offset == 1.*attn.stream_positions\(\)") as err:
            session.step({"a": x}, model)
    assert isinstance(err.value.__cause__, torch._dynamo.exc.FailOnRecompileLimitHit)
    assert session.written("a") == 1  # the failed step committed nothing
