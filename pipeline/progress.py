"""The driver's progress lines: rows written (from the outputs as they come back) and, while calls run, the rows
the actors' engines finished and the tokens they generated (live, pushed by each actor to a LiveCounter)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger("kivi_ray")


class LiveCounter:
    """Totals that the actors add to as their engines work (a Ray actor made by the driver: `ray.remote`). An actor
    that restarts after a failure counts its lost call's tokens again: these are progress, not results."""

    def __init__(self) -> None:
        self.rows = self.tokens = 0

    def add(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens

    def totals(self) -> tuple[int, int]:
        return self.rows, self.tokens


class Progress:
    """Logs progress every `interval` seconds from a background thread. live() -> (rows, tokens) finished and
    generated inside the engines so far, or None; its failures only drop that part of the line."""

    def __init__(self, total: int, interval: float, live: Callable[[], tuple[int, int]] | None = None):
        self.total, self.interval, self.live = total, interval, live
        self.rows = self.tokens = 0
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kivi-ray-progress", daemon=True)

    def add(self, batch: pa.Table) -> None:
        self.rows += batch.num_rows
        self.tokens += pc.sum(batch["num_generated_tokens"]).as_py() or 0

    def line(self, live: bool = True) -> str:
        """The progress line; live=False: rows written only (the last line: restarts may have counted twice)."""
        elapsed = time.perf_counter() - self.start
        pct = 100.0 * self.rows / self.total if self.total else 100.0
        rows, tokens = self.rows, self.tokens
        live = self._live() if live else None
        if live is not None and live[1] > tokens:  # the engines are ahead of the rows written
            rows, tokens = live
        rate = tokens / elapsed if elapsed > 0 else 0.0
        text = f"progress: {self.rows}/{self.total} rows written ({pct:.1f}%), "
        if (rows, tokens) != (self.rows, self.tokens):
            text += f"{rows} rows finished in the engines, "
        return text + f"{tokens} tokens generated, {rate:.1f} output tokens/s, {elapsed:.0f} s elapsed"

    def _live(self) -> tuple[int, int] | None:
        if self.live is None:
            return None
        try:
            return self.live()
        except Exception as err:  # noqa: BLE001 - a progress line never stops the job
            log.debug("live progress unavailable: %r", err)
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            log.info("%s", self.line())

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        log.info("%s", self.line(live=False))
