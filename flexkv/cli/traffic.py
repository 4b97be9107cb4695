"""`Traffic`: seeded arrivals and departures over a workload's batch lanes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

from .workload import Workload

__all__ = ["Traffic", "Request"]


@dataclass
class Request:
    """One request of a run: its id, source, how much it will write, and where it stands."""

    rid: int
    source: int
    length: int
    written: int = 0
    final: bool = False  # its next step is the final chunk
    arrived: int = 0


class Traffic:
    """Seeded arrivals and departures over `workload.requests` batch lanes.

    Each model step is one regular step (T = `tokens`, every request in its
    regular phase writes `span`) and, when the workload has a final chunk and
    some request reached its length, one final step for those requests. Lanes
    without a request are padding segments, so every step of a kind has the
    same batch shape. `lanes` holds each lane's request (a request whose
    `final` is set writes its final chunk next); call `advance()` once a model
    step is committed; `departed` and `arrived` list what changed.
    """

    def __init__(self, workload: Workload, seed: Optional[int] = None):
        self.w = workload
        self.rng = random.Random(workload.seed if seed is None else seed)
        self.lanes: List[Optional[Request]] = [None] * workload.requests
        self.next_id = 0
        self.step_no = 0
        self.arrived: List[Request] = []
        self.departed: List[Request] = []
        self._fill(force=True)

    def _new(self) -> Request:
        w = self.w
        lo, hi = w.stream_len
        n = self.rng.randint(lo, hi)
        length = max(w.span, -(-n // w.span) * w.span)  # whole steps
        src = self.rng.randrange(w.sources) if w.source_len else 0
        r = Request(self.next_id, src, length, arrived=self.step_no)
        self.next_id += 1
        return r

    def _fill(self, force: bool = False) -> None:
        self.arrived = []
        for i, r in enumerate(self.lanes):
            if r is None and (force or self.rng.random() < self.w.arrival):
                self.lanes[i] = self._new()
                self.arrived.append(self.lanes[i])

    @property
    def active(self) -> List[Request]:
        return [r for r in self.lanes if r is not None]

    def advance(self) -> None:
        """Account the committed step(s): requests write, finish, leave; new ones arrive."""
        w = self.w
        self.departed = []
        for i, r in enumerate(self.lanes):
            if r is None:
                continue
            if r.final:
                r.written += w.final_span
                self.departed.append(r)
                self.lanes[i] = None
                continue
            r.written += w.span
            if r.written >= r.length:
                if w.final_tokens is not None:
                    r.final = True
                else:
                    self.departed.append(r)
                    self.lanes[i] = None
        self.step_no += 1
        self._fill()
