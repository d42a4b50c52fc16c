"""Progress lines: rows written, and the engines' live rows and tokens while calls are in flight."""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa
import pytest
import torch

from pipeline.actors.actor import StreamingGenerateActor
from pipeline.actors.engine import EngineConfig, LLMEngine
from pipeline.progress import LiveCounter, Progress
from tests.engine_cases import SMALL_KIVI, StubTokenizer
from tests.pipeline_cases import FakeTokenizer


def written(tokens: list[int]) -> pa.Table:
    return pa.table({"num_generated_tokens": pa.array(tokens, pa.int64())})


def test_progress_line_shows_the_engines_when_they_are_ahead():
    live = {"now": (0, 0)}
    progress = Progress(total=10, interval=3600, live=lambda: live["now"])
    progress.add(written([3, 4]))
    line = progress.line()
    assert "2/10 rows written (20.0%)" in line and "7 tokens generated" in line and "engines" not in line
    live["now"] = (6, 40)  # the engines finished rows whose call has not come back yet
    line = progress.line()
    assert "2/10 rows written" in line and "6 rows finished in the engines, 40 tokens generated" in line
    assert "engines" not in progress.line(live=False) and "7 tokens" in progress.line(live=False)


def test_progress_line_survives_a_live_source_that_fails(caplog):
    def broken():
        raise TimeoutError("counter actor unreachable")

    progress = Progress(total=4, interval=3600, live=broken)
    progress.add(written([5]))
    with caplog.at_level(logging.DEBUG, logger="kivi_ray"):
        line = progress.line()
    assert "1/4 rows written" in line and "5 tokens generated" in line
    assert "live progress unavailable" in caplog.text


class Handle:
    """What the actor sees of a Ray actor handle of LiveCounter: handle.add.remote(rows, tokens)."""

    def __init__(self):
        self.counter = LiveCounter()
        self.add = self

    def remote(self, rows, tokens):
        self.counter.add(rows, tokens)


@pytest.mark.parametrize("interval", [0.01, 3600.0])
def test_streaming_actor_reports_its_engine_to_the_counter(tiny, interval):  # noqa: F811
    """The actor passes its engine's finished rows and generated tokens to the driver's counter: by the time a
    call returns, the counter holds exactly that call's rows and tokens."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    words = torch.randint(1, 9, (6, 12), generator=gen).tolist()  # FakeTokenizer: a word's length is its id
    new = torch.randint(1, 12, (6,), generator=gen).tolist()
    rows = [{"prompt": " ".join("x" * (w % 9 + 1) for w in ws), "sampling_params": {"max_new_tokens": n}}
            for ws, n in zip(words, new, strict=True)]

    def loader(job):
        engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
        return engine, FakeTokenizer()

    handle = Handle()
    actor = StreamingGenerateActor({"output": "unused", "log_interval_s": interval}, "prompt", loader=loader,
                                   progress=handle)

    async def call(batch):
        return [out async for out in actor(batch)]

    (out,) = asyncio.run(call(pa.Table.from_pylist(rows)))
    assert out["error"].to_pylist() == [None] * len(rows)
    assert handle.counter.totals() == (len(rows), sum(out["num_generated_tokens"].to_pylist()))
