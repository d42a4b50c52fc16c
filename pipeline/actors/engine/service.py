"""One engine fed by several callers at once: a thread owns the engine (and its device), callers submit request
lists and get futures.

The engine admits a new list between its steps, behind the sequences already in flight, so a caller's last
rows never decode alone while the next caller waits: the batch stays wide across calls. Each step's time is
split evenly among the lists in flight during it, so per-call times add up to the engine's busy time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from pipeline.actors.engine.request import Request, Submission

log = logging.getLogger(__name__)


class EngineService:
    """submit(requests) -> Future of (completions in request order, the engine's stats with this call's cache
    peaks and its share of the engine's time, `busy_s`)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.Queue[tuple[list[Request], Future]] = queue.Queue()
        self.in_flight: dict[int, Future] = {}  # id(submission) -> its caller's future
        self.finished: list[tuple[Submission, Future]] = []  # done inside the current step, answered after it
        self.thread = threading.Thread(target=self._run, name="kivi-ray-engine", daemon=True)
        self.thread.start()

    def submit(self, requests: list[Request]) -> Future:
        future: Future = Future()
        self.inbox.put((requests, future))
        return future

    def _run(self) -> None:
        while True:
            self._take(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
            self._answer()

    def _step(self) -> None:
        subs, t0 = list(self.engine.active), time.perf_counter()
        try:
            self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the calls in flight, keep serving the next ones
            log.exception("engine step failed: failing %d calls in flight", len(self.in_flight))
            self.engine.abort()
            for future in self.in_flight.values():
                future.set_exception(err)
            self.in_flight, self.finished = {}, []
            return
        share = (time.perf_counter() - t0) / max(1, len(subs))
        for sub in subs:
            sub.busy_s += share

    def _take(self, block: bool) -> None:
        """Hand every waiting list to the engine (waiting for one when it has nothing to do)."""
        try:
            item = self.inbox.get(block=block)
        except queue.Empty:
            return
        while item is not None:
            requests, future = item
            t0 = time.perf_counter()
            try:
                sub = self.engine.add(requests, on_done=lambda s, f=future: self.finished.append((s, f)))
                sub.busy_s += time.perf_counter() - t0  # the first call's cache plan and graph capture
                self.in_flight[id(sub)] = future
            except Exception as err:  # noqa: BLE001 - a bad list fails its own call only
                future.set_exception(err)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None

    def _answer(self) -> None:
        finished, self.finished = self.finished, []
        for sub, future in finished:
            self.in_flight.pop(id(sub), None)
            future.set_result((sub.results, {**self.engine.stats(), **sub.peaks, "busy_s": sub.busy_s}))
