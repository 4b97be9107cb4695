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
"""

from __future__ import annotations

import types
from typing import Any, Callable, Hashable, Optional

__all__ = ["step_key", "closure_difference"]

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
