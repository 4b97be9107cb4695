"""Which cache layers a step attended: checked before the step commits.

A step commits the tokens it wrote to every cache layer at once. If a
declared layer was never attended (an attention module whose swapped method
the model never calls, a branch that skipped it) or attended twice (a module
called again in the same step), the cache would commit a step that is
silently wrong: a layer whose entries were never written, or overwritten.
`AttendanceRecord` counts each layer's attend calls in a step, and `check`
refuses the step, before anything is committed, with what happened and how
to fix it.

Compiled steps: the counts are plain Python ints kept in a list that the
record owns. Under `torch.compile` the increments are traced as Python side
effects, which torch replays after every run of the compiled graph, so a
compiled step counts exactly like an eager one, and a graph that does not
attend every layer once is refused the first time it runs (at warm-up, on
padding steps that change nothing) and on every later run. The record is
zeroed in place at the start of each step, so the values a trace reads are
the same every step and never make the graph compile again.

Whoever gives layers their calls (`flexkv.swap_attention`) registers an
`explain` callable to say, in an error, which module and which call a layer
belongs to.
"""

from __future__ import annotations

import weakref
from typing import Iterable, List, Optional, Sequence

__all__ = ["AttendanceError", "AttendanceRecord", "layer_ranges", "explain_calls"]


class AttendanceError(ValueError):
    """A step did not attend every declared cache layer exactly once; nothing was committed."""


def layer_ranges(layers: Iterable[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `"0-2, 5, 7-8"`."""
    out: List[str] = []
    run: List[int] = []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


class AttendanceRecord:
    """Counts of attend calls per declared layer in the current step.

    `start()` zeroes the counts (the step begins), `attended(layer)` counts
    one call (inside the model, eager or traced), and `check(where)` raises
    `AttendanceError` unless every layer of `layers` (default: all
    `num_layers`) was attended exactly once. Registered explainers
    (`add_explainer`) add, to the error, which module call each layer is and
    what the model called; they may also hold per-step counters of their own,
    zeroed by `start()` through their `start` method.
    """

    def __init__(self, num_layers: int, what: str = "cache layer"):
        self.num_layers = int(num_layers)
        self.what = what
        #: attend calls per layer in the current step (zeroed in place: a compiled graph reads it)
        self.counts: List[int] = [0] * self.num_layers
        #: the calls each layer owes the current step: one per chunk the step was planned in
        self.calls = 1
        #: calls counted by the parts of the step that ended (`settle`)
        self.settled: List[int] = [0] * self.num_layers
        self._explainers: "weakref.WeakSet" = weakref.WeakSet()

    def start(self, calls: int = 1) -> None:
        """A step begins: every count (and every explainer's own counters) back to zero, in place; each
        layer owes the step `calls` attend calls (a step planned as `calls` chunks attends each once)."""
        self.counts[:] = [0] * self.num_layers
        self.settled[:] = [0] * self.num_layers
        self.calls = int(calls)
        for e in list(self._explainers):
            e.start()

    def attended(self, layer: int) -> None:
        """Count one attend call of `layer` (called by the attention core, eager or traced)."""
        self.counts[layer] += 1

    def settle(self) -> None:
        """A part of the step ended (one of its chunks, run by a model forward of its own): its calls join
        the step's and the counts start from zero again, so every part's graph reads the same values."""
        for i, c in enumerate(self.counts):
            self.settled[i] += c
        self.counts[:] = [0] * self.num_layers

    def add_explainer(self, explainer) -> None:
        """Register an object with `start()` and `explain(missing, twice) -> list of str`."""
        self._explainers.add(explainer)

    def remove_explainer(self, explainer) -> None:
        self._explainers.discard(explainer)

    def problems(self, layers: Optional[Sequence[int]] = None) -> Optional[str]:
        """What is wrong with the step's attendance (None: every layer attended once per chunk)."""
        expected = range(self.num_layers) if layers is None else layers
        counts = [c + s for c, s in zip(self.counts, self.settled)]
        missing = [i for i in expected if counts[i] == 0]
        twice = [i for i in expected if counts[i] not in (0, self.calls)]
        extra = []
        for e in list(self._explainers):
            extra.extend(e.explain(missing, twice))
        if not missing and not twice and not extra:
            return None
        parts = []
        if missing:
            parts.append(f"{self.what}s {layer_ranges(missing)} (of {len(expected)}) were never attended")
        if twice:
            owed = "" if self.calls == 1 else f" for the step's {self.calls} chunks"
            parts.append(", ".join(f"{self.what} {i} was attended {counts[i]} times{owed}" for i in twice))
        return "; ".join(parts + extra)

    def check(self, where: str, layers: Optional[Sequence[int]] = None) -> None:
        """Raise `AttendanceError` unless every layer of `layers` was attended exactly once (per chunk) this step."""
        problem = self.problems(layers)
        if problem is None:
            return
        raise AttendanceError(
            f"{where}: the step must attend every declared {self.what} exactly once, but {problem}. "
            f"Nothing was committed: a layer never attended would keep a hole where the step's tokens belong, "
            f"one attended twice would be overwritten. Each attention call of the model must go through its own "
            f"{self.what}: build the cache with one layer per attention call of a step"
        )


def explain_calls(name: str, calls: int, expected: int, methods: Sequence[str]) -> Optional[str]:
    """One module's calls in a step against what it was declared for (None when they agree)."""
    if calls == expected:
        return None
    how = " or ".join(f".{m}()" for m in methods)
    if calls == 0:
        return (f"{name} was never called through {how} (does the model call another method of it? name every "
                f"method it uses in swap_attention(..., methods=(...)))")
    return (f"{name} was called {calls} time{'s' if calls != 1 else ''} through {how} in one step, but it was "
            f"declared for calls_per_step={expected}; give swap_attention calls_per_step={calls} for it (the k-th "
            f"call of a module in a step is its own cache layer) and build the cache with the layers that needs")

