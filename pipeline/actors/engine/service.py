"""One engine fed by several callers at once: a thread owns the engine (and its device), callers submit request
lists and get futures.

The engine admits a new list between its steps, behind the sequences already in flight (a run of decode
steps launched ahead ends when a list arrives), so a caller's last rows never decode alone while the next
caller waits: the batch stays wide across calls. Each step's time is split among the lists in flight by
their rows in the batch, so per-call times add up to the engine's busy time. The engine's one-time build (cache
plan, allocation, graph capture, in the first list's add) is not a call's time: the engine reports it as
build_s, with any rebuild's for a later long prompt (inside a step).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from pipeline.actors.engine.request import Request, Submission

log = logging.getLogger(__name__)


class EngineService:
    """submit(requests) -> Future of (completions in request order, the engine's stats with this call's cache
    peaks and its share of the engine's time, `busy_s`). reporter(rows, tokens), if given, gets the rows the
    engine finished and the tokens it generated since its last call, at most every `report_s` seconds while
    the engine works (between steps, and between the decode steps of a run) and once more when it runs out of
    work (live progress; the rows come back later)."""

    def __init__(self, engine, reporter: Callable[[int, int], None] | None = None, report_s: float = 5.0) -> None:
        self.engine = engine
        self.reporter, self.report_s = reporter, report_s
        self.reported = (0, 0, time.perf_counter())  # rows, tokens, when
        self.inbox: queue.Queue[tuple[list[Request], Future, float]] = queue.Queue()
        self.in_flight: dict[int, Future] = {}  # id(submission) -> its caller's future
        self.finished: list[tuple[Submission, Future]] = []  # done inside a step, answered after it
        self.dead: BaseException | None = None
        engine.interrupt = self._interrupt
        self.thread = threading.Thread(target=self._run, name="kivi-ray-engine", daemon=True)
        self.thread.start()

    def submit(self, requests: list[Request]) -> Future:
        if self.dead is not None:
            raise RuntimeError(f"the engine thread stopped: {self.dead!r}")
        future: Future = Future()
        self.inbox.put((requests, future, time.perf_counter()))
        return future

    def _run(self) -> None:
        try:
            while True:
                self._take(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._step()
                self._report(force=not self.engine.has_work())  # before the answers: counted when they arrive
                self._answer()
        except BaseException as err:  # the loop itself broke: nobody may wait forever on it
            log.exception("engine thread stopped")
            self.dead = err
            self._fail(list(self.in_flight.values()) + [f for _, f, _ in _drain(self.inbox)], err)

    def _step(self) -> None:
        rows = Counter(id(seq.submission) for seq in self.engine.scheduler.running)
        subs, t0, built_before = list(self.engine.active), time.perf_counter(), self.engine.build_s or 0.0
        try:
            self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the calls in flight, keep serving the next ones
            log.exception("engine step failed: failing %d calls in flight", len(self.engine.active))
            self._answer()  # calls that finished before the failure keep their results
            self.engine.abort()
            self._fail(list(self.in_flight.values()), err)
            self.in_flight = {}
            return
        # a rebuild inside the step (LLMEngine._rebuild) counts once, in the stats' engine_build_s
        elapsed = max(0.0, time.perf_counter() - t0 - ((self.engine.build_s or 0.0) - built_before))
        total = sum(rows.values())
        for sub in subs:  # by rows in the batch; evenly when nothing was decoding yet (a first prefill)
            sub.busy_s += elapsed * (rows[id(sub)] / total if total else 1 / len(subs))

    def _interrupt(self) -> bool:
        """Polled by the engine between the decode steps of a run: reports progress on the way (a run can last
        many seconds), and ends the run when a list is waiting."""
        self._report(force=False)
        return not self.inbox.empty()

    def _report(self, force: bool) -> None:
        rows, tokens, when = self.reported
        now = time.perf_counter()
        new = (self.engine.finished_rows - rows, self.engine.generated_tokens - tokens)
        if self.reporter is None or not any(new) or (not force and now - when < self.report_s):
            return
        self.reported = (self.engine.finished_rows, self.engine.generated_tokens, now)
        try:
            self.reporter(*new)
        except Exception:  # noqa: BLE001 - progress is best effort; generation goes on
            log.warning("progress report failed", exc_info=True)

    def _take(self, block: bool) -> None:
        """Hand every waiting list to the engine (waiting for one when it has nothing to do)."""
        try:
            first = self.inbox.get(block=block)
        except queue.Empty:
            return
        for requests, future, t_submit in [first, *_drain(self.inbox)]:
            t0, built_before = time.perf_counter(), self.engine.build_s
            try:
                sub = self.engine.add(requests, on_done=lambda s, f=future: self.finished.append((s, f)),
                                      t_start=t_submit)
                spent = time.perf_counter() - t0
                if built_before is None and self.engine.build_s is not None:  # this call built the engine
                    spent = max(0.0, spent - self.engine.build_s)  # reported once, as the stats' engine_build_s
                sub.busy_s += spent
                self.in_flight[id(sub)] = future
            except Exception as err:  # noqa: BLE001 - a bad list fails its own call only
                self._fail([future], err)

    def _answer(self) -> None:
        finished, self.finished = self.finished, []
        for sub, future in finished:
            self.in_flight.pop(id(sub), None)
            stats = {**self.engine.stats(), **sub.peaks, "busy_s": sub.busy_s}
            with contextlib.suppress(InvalidStateError):  # the caller gave up (cancelled) meanwhile
                future.set_result((sub.results, stats))

    @staticmethod
    def _fail(futures: list[Future], err: BaseException) -> None:
        for future in futures:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(err)


def _drain(inbox: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items
