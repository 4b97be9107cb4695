"""When two step functions are the same one: the key a session compiles a model step under.

`session.step(feeds, lambda attn, x: model(x))` written in a loop makes a
new function object every step. Keyed on the object, every step would
compile the model again (seconds each, and no recompile warning: it is a
new function, not a failed guard). Two functions whose code, globals,
defaults and closure contents are the same objects (or equal plain values:
numbers, strings, None, tuples of them) compute the same thing, so
`step_key` gives them one key and the session one compiled step. A bound
method is keyed on its object and function (`runner.forward` read anew each
step is the same step). Any other callable is keyed on itself.

A function with the same code but other closure values (a loop variable
captured in the step) is another step; `closure_difference` says which
closure variable differs, for the warning the session gives when it compiles
such a function again.

`CompiledSteps` keeps a session's step functions, one per key: each the
model function behind a `bind` of the step's plans to the session's
context (inside the graph, so the plans are an input, not a guard), under
`torch.compile(fullgraph=True, dynamic=False)` with `compile=True`, with a
code object of its own, a warning when the same code compiles again with
other closure values, and a watch for recompiles after warm-up.

`Stages(f0, f1, ...)` is a step function in stages, each `f(attn, x)`
taking what the one before returned (the first, the step's inputs): one
graph per stage when compiled. A model whose layers are stages compiles
one layer at a time; where layers are alike, inductor's cache makes their
kernels once, where a whole-step graph lowers a FlexAttention kernel for
every layer whose call has a `score_mod` (docs/cli.md has the timings).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import types
import warnings
from typing import Any, Callable, Dict, Hashable, Optional

import torch

from ..compiling import RecompileWarning, fresh_function, watch_recompiles

__all__ = ["step_key", "closure_difference", "CompiledSteps", "Stages", "RECOMPILE_ADVICE"]


class Stages:
    """A step function in stages: `Stages(f0, f1, ...)` runs `x = f(attn, x)` for each stage in order,
    `x` first the step's inputs, and returns the last stage's result. A session with `compile=True`
    compiles each stage as a graph of its own (module docstring); without, it runs them as written.
    The stages are the step: the same stage functions again (a new `Stages` of them included) are the
    same compiled step. Sessions with a carried state (`initial_state`) take whole step functions only."""

    def __init__(self, *stages: Callable):
        if not stages or not all(callable(f) for f in stages):
            raise ValueError(f"Stages takes one or more callables f(attn, x), got {stages!r}")
        self.stages = stages

    def __call__(self, attn, inputs):
        for f in self.stages:
            inputs = f(attn, inputs)
        return inputs

    def __repr__(self):
        return f"Stages({len(self.stages)} stages)"

#: What a recompile after warm-up means and what to do, after the guard that failed.
RECOMPILE_ADVICE = (
    "The session compiles the model step once per (B, T) at warm-up; a later compile means the graph depends "
    "on a Python value that changed between steps, such as an int or flag kept on a module (a position offset "
    "or step counter of a model left in its own streaming or caching mode), a global, or the length of a "
    "Python list. Keep such values out of the step: switch the model's own cache and streaming state off "
    "(flexkv keeps the stream), take positions from the cache (attn.stream_positions()), and pass anything "
    "else that changes per step as a tensor input or buffer. TORCH_LOGS=recompiles logs every recompile."
)

_session_ids = itertools.count()
_SESSION_DIR = os.path.dirname(os.path.abspath(__file__))


def caller_stacklevel() -> int:
    """The `stacklevel` at which a warning raised by the function calling this one names the first
    frame outside `flexkv.session`: the user's call into the session."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _SESSION_DIR:
        frame, level = frame.f_back, level + 1
    return level

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _value(v: Any) -> Hashable:
    """A value's part of a key: plain immutable values by value, tuples of them element-wise, anything
    else by identity (the key's first function holds it alive, so the identity is not reused)."""
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if type(v) is tuple:
        return ("tuple",) + tuple(_value(x) for x in v)
    return ("id", id(v))


def _cells(fn: types.FunctionType) -> tuple:
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(_value(cell.cell_contents))
        except ValueError:  # an empty cell
            out.append(("empty",))
    return tuple(out)


def step_key(fn: Callable) -> Hashable:
    """The key two step functions that compute the same thing share (see the module docstring)."""
    if isinstance(fn, Stages):
        return ("stages", tuple(step_key(f) for f in fn.stages))
    if isinstance(fn, types.MethodType):
        return ("method", id(fn.__self__), step_key(fn.__func__))
    if isinstance(fn, types.FunctionType):
        kwdefaults = None if fn.__kwdefaults__ is None else tuple(sorted(fn.__kwdefaults__.items()))
        return ("function", fn.__code__, id(fn.__globals__), _value(fn.__defaults__),
                _value(tuple(v for _, v in kwdefaults or ())), tuple(k for k, _ in kwdefaults or ()), _cells(fn))
    return ("object", id(fn))


def closure_difference(fn: Callable, key: Hashable, other_key: Hashable) -> Optional[str]:
    """For two step keys of functions with `fn`'s code: which closure variables or defaults differ."""
    fn = getattr(fn, "__func__", fn)
    while key and key[0] == "method" and other_key and other_key[0] == "method":
        key, other_key = key[2], other_key[2]
    if not isinstance(fn, types.FunctionType) or key[0] != "function" or other_key[0] != "function":
        return None
    names = fn.__code__.co_freevars
    differ = [name for name, a, b in zip(names, key[-1], other_key[-1]) if a != b]
    if key[3:6] != other_key[3:6]:
        differ.append("its default arguments")
    return ", ".join(differ) or None


class CompiledSteps:
    """The step functions of one session (module docstring): `runner(fn)` and `watch(fn, what)`.

    `context`: the session's `flexkv.model.step_context.StepContext`; `compile`: compile the steps;
    `stateful`: the steps take and return the requests' carried state; `kind` names the session in
    warnings. `warm` holds the `(key, B, T)` buckets the session has warmed up.
    """

    def __init__(self, context, compile: bool, stateful: bool, kind: str):
        self.context = context
        self.compile = compile
        self.stateful = stateful
        self.kind = kind
        self.warm: set = set()
        self._prefix = f"s{next(_session_ids)}"
        # Keyed on step_key(fn): a new but identical function object (a lambda written in the step loop)
        # is the same step and reuses its compiled graphs.
        self._runners: Dict[Any, Callable] = {}
        self._codes: Dict[Any, Any] = {}  # key -> code object of its compiled step (for recompile reports)
        self._compiled_code: Dict[Any, Any] = {}  # a step function's code -> the key first compiled with it

    def runner(self, fn: Callable) -> Callable:
        """The (compiled) step of `fn`: `step(plans, inputs[, state])` binds the plans to the context
        inside the graph and calls `fn(context, inputs[, state])`; for `Stages`, each stage so, in turn."""
        key = step_key(fn)
        run = self._runners.get(key)
        if run is not None:
            return run
        if isinstance(fn, Stages):
            if self.stateful:
                raise ValueError(f"{self.kind}: a session with initial_state takes a whole step function "
                                 f"fn(attn, inputs, state), not Stages")
            runs = [self._bound(stage, False, f"{self._prefix}_{len(self._runners)}_{i}")
                    for i, stage in enumerate(fn.stages)]
            self._codes[key] = tuple(code for _, code in runs)

            def run(plans, inputs):
                for stage, _ in runs:
                    inputs = stage(plans, inputs)
                return inputs
        else:
            run, code = self._bound(fn, self.stateful, f"{self._prefix}_{len(self._runners)}")
            self._codes[key] = (code,) if code is not None else ()
            if self.compile:
                self._warn_if_compiled_before(fn, key)
        self._runners[key] = run
        return run

    def _bound(self, fn: Callable, stateful: bool, name: str) -> tuple:
        """`(step, code object or None)`: `fn` behind a bind of the plans to the context, compiled (with a
        code object of its own, `name`) when the session compiles."""
        context = self.context
        if not stateful:
            def session_step(plans, inputs):
                context.bind(plans)
                return fn(context, inputs)
        else:
            def session_step(plans, inputs, state):
                context.bind(plans)
                return fn(context, inputs, state)
        if not self.compile:
            return session_step, None
        # A code object of its own: compiled graphs are cached per code object, and another
        # session's (or another fn's) entries must not be walked or evicted by this one.
        fresh = fresh_function(session_step, name)
        return torch.compile(fresh, fullgraph=True, dynamic=False), fresh.__code__

    def _warn_if_compiled_before(self, fn: Callable, key) -> None:
        """Say so when a step function of the same code, with other closure values, compiles again (a
        lambda capturing a loop variable, made anew every step)."""
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None or self._compiled_code.setdefault(code, key) == key:
            return
        differ = closure_difference(fn, key, self._compiled_code[code])
        warnings.warn(
            f"{self.kind}.step: fn {getattr(code, 'co_name', fn)!r} ({code.co_filename}:"
            f"{code.co_firstlineno}) is a new function with the code of one compiled before but other values"
            f"{f' ({differ})' if differ else ''}, so the model step compiles again (seconds per compile, every "
            f"time such a function is made). Define the step function once, outside the step loop, and pass "
            f"what changes per step as an input (a tensor in the feed) or a buffer",
            RecompileWarning, stacklevel=caller_stacklevel(),
        )

    def watch(self, fn: Callable, what: str):
        """Around a compiled step of `fn`: a recompile after warm-up (of any of its stages) warns with the
        guard that failed (`what` names the step's bucket); nothing when not compiling."""
        if not self.compile:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for code in self._codes[step_key(fn)]:
            # The warning is raised in the watch's generator, three frames below the caller (the ExitStack's
            # exit, then contextlib's).
            stack.enter_context(watch_recompiles(code, f"{self.kind}.step: the compiled model step ({what})",
                                                 RECOMPILE_ADVICE, stacklevel=caller_stacklevel() + 2))
        return stack
