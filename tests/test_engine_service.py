"""EngineService: several callers share one engine, their rows decoding together (on the CPU, tiny model)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams
from pipeline.actors.engine.service import EngineService
from tests.engine_cases import SMALL_KIVI, StubTokenizer, hf_greedy, requests


def start_together(service, lists):
    """Submit each list from its own thread at the same moment; returns their futures."""
    barrier, futures = threading.Barrier(len(lists)), [None] * len(lists)

    def go(i):
        barrier.wait()
        futures[i] = service.submit(lists[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return futures


def test_calls_share_the_engine_and_each_gets_its_own_rows(tiny, monkeypatch):  # noqa: F811
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    seen_together = []
    real_step = engine.step

    def step():
        seen_together.append(len(engine.active))
        real_step()

    monkeypatch.setattr(engine, "step", step)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = torch.randint(4, 40, (9,), generator=gen).tolist()
    new = torch.randint(2, 30, (9,), generator=gen).tolist()
    reqs = requests(lengths, new, seed=int(torch.randint(0, 2**31, ())))
    first, second = reqs[:5], reqs[5:]
    service = EngineService(engine)
    futures = start_together(service, [first, second])
    outs = [f.result(timeout=300) for f in futures]
    assert max(seen_together) == 2  # steps ran with both calls' rows in flight
    for sent, (completions, stats) in zip([first, second], outs, strict=True):
        assert [c.request_id for c in completions] == [r.request_id for r in sent]
        for req, comp in zip(sent, completions, strict=True):
            expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens,
                                        kivi.KiviCache(tiny.config, SMALL_KIVI))
            assert len(comp.token_ids) == len(expected)
            assert comp.token_ids[: clear + 1] == expected[: clear + 1], req.request_id
        assert stats["busy_s"] > 0 and stats["kv_cache_bytes"] > 0 and stats["kv_cache_bytes_bf16"] > 0


def test_a_failed_step_fails_the_calls_in_flight_not_the_service(tiny, monkeypatch):  # noqa: F811
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        real_step()

    monkeypatch.setattr(engine, "step", step)
    service = EngineService(engine)
    doomed = service.submit(requests([12, 7, 20], [25, 25, 25]))
    with pytest.raises(RuntimeError, match="device lost"):
        doomed.result(timeout=300)
    assert not engine.has_work() and engine.blocks.pages_in_use == 0  # everything it held came back
    completions, _ = service.submit(requests([9, 15], [4, 6], seed=1)).result(timeout=300)
    assert [len(c.token_ids) for c in completions] == [4, 6]


def test_a_call_with_nothing_valid_is_answered_at_once(tiny):  # noqa: F811
    service = EngineService(LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI)))
    completions, stats = service.submit([Request("e", [], SamplingParams())]).result(timeout=60)
    assert completions[0].finish_reason == "error" and completions[0].error == "empty prompt"
    assert stats["busy_s"] >= 0
    completions, _ = service.submit([]).result(timeout=60)
    assert completions == []


def test_new_calls_join_between_steps_launched_ahead(tiny, monkeypatch):  # noqa: F811
    """A short call arriving while one long row decodes (steps launched ahead of the host) is admitted at the
    next step and answered long before the long row ends."""
    from pipeline.actors.engine.model_runner import ModelRunner

    ahead, real_next = threading.Event(), ModelRunner.decode_next

    def decode_next(self, tokens):
        ahead.set()
        return real_next(self, tokens)

    monkeypatch.setattr(ModelRunner, "decode_next", decode_next)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    service = EngineService(engine)
    long = service.submit(requests([10], [400]))
    assert ahead.wait(timeout=60)  # the long row's steps are being launched ahead
    short = service.submit(requests([8], [3], seed=1))
    completions, _ = short.result(timeout=120)
    assert len(completions[0].token_ids) == 3
    assert not long.done()  # the long row is still decoding
    assert len(long.result(timeout=300)[0][0].token_ids) == 400


def test_a_cancelled_call_or_a_failed_prefill_leaves_the_service_working(tiny, monkeypatch):  # noqa: F811
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    service = EngineService(engine)
    gone = service.submit(requests([12, 30], [20, 20]))
    gone.cancel()  # the caller gave up: its answer has nowhere to go
    completions, _ = service.submit(requests([9], [4], seed=2)).result(timeout=300)
    assert len(completions[0].token_ids) == 4

    real_prefill, calls = engine.runner.prefill, []

    def prefill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kernel fault")
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    with pytest.raises(RuntimeError, match="kernel fault"):
        service.submit(requests([7, 9, 11], [5, 5, 5], seed=3)).result(timeout=300)
    assert len(engine.blocks.free_slots) == engine.blocks.num_slots  # the admitted rows gave their slots back
    assert engine.blocks.pages_in_use == 0
    completions, _ = service.submit(requests([7, 9], [5, 6], seed=4)).result(timeout=300)
    assert [len(c.token_ids) for c in completions] == [5, 6]


def test_the_reporter_counts_every_finished_row_and_generated_token(tiny):  # noqa: F811
    """Live progress: the reporter's deltas add up to the rows and tokens of the completions, whatever the
    interval; they are all in by the time the calls are answered (the last report runs first)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = torch.randint(4, 40, (7,), generator=gen).tolist()
    new = torch.randint(1, 20, (7,), generator=gen).tolist()
    reqs = requests(lengths, new, seed=int(torch.randint(0, 2**31, ())))
    bad = Request(request_id="too long", prompt_token_ids=[1] * 600, sampling=SamplingParams(max_new_tokens=3))
    for report_s in (0.0, 3600.0):  # every step; only when the engine runs out of work
        reports: list[tuple[int, int]] = []
        engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=3))
        service = EngineService(engine, reporter=lambda rows, tokens, out=reports: out.append((rows, tokens)),
                                report_s=report_s)
        futures = start_together(service, [reqs[:4], reqs[4:] + [bad]])
        completions = [c for f in futures for c in f.result(timeout=300)[0]]
        good = [c for c in completions if c.finish_reason != "error"]
        assert len(good) == len(reqs)
        assert sum(r for r, _ in reports) == len(good)
        assert sum(t for _, t in reports) == sum(len(c.token_ids) for c in good)
        assert all(r >= 0 and t >= 0 and (r or t) for r, t in reports)
        if report_s:
            assert len(reports) <= 2  # once per time the engine ran dry


def test_rows_queued_during_the_build_count_their_first_token_from_its_end(tiny, monkeypatch):
    """A second list that arrives while the first call's build runs waits for the build (reported as build_s),
    not for its own rows: its time to first token counts from the end of the build, and the build is in no
    call's busy time."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    slow_s, allocate, building, allocated_at = 1.0, engine._allocate, threading.Event(), []

    def slow_allocate(*args, **kwargs):
        building.set()
        time.sleep(slow_s)
        out = allocate(*args, **kwargs)
        allocated_at.append(time.perf_counter())
        return out

    monkeypatch.setattr(engine, "_allocate", slow_allocate)
    service = EngineService(engine)
    first = service.submit(requests([6, 11], [2, 2]))
    assert building.wait(timeout=60)
    second = service.submit(requests([9, 5], [2, 3], seed=1))
    completions, _ = second.result(timeout=300)
    t_end = time.perf_counter()
    _, first_stats = first.result(timeout=300)
    t_first = time.perf_counter()
    assert engine.stats()["build_s"] >= slow_s
    assert all(0 <= c.ttft_s <= t_end - allocated_at[-1] for c in completions)
    # The build is not the first call's time either (its rows' throughput would count it): only its share of
    # the steps after the build, and the few lines of add() outside it.
    assert 0 < first_stats["busy_s"] <= t_first - allocated_at[-1] + 0.05


def test_a_rebuild_inside_a_step_counts_in_build_s_not_in_the_calls_busy_time(tiny, monkeypatch):
    """A late long prompt's rebuild runs inside a step (LLMEngine._rebuild): its time is in the stats' build_s, and
    not in the busy time of the calls in flight, so that no call's throughput counts it twice."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_prefill_tokens=16, max_batch_size=4))
    slow_s, allocate, calls = 1.0, engine._allocate, []

    def slow_allocate(*args, **kwargs):
        calls.append(time.perf_counter())
        if len(calls) > 1:  # the rebuild
            time.sleep(slow_s)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(engine, "_allocate", slow_allocate)
    service = EngineService(engine)
    service.submit(requests([6, 11], [2, 2])).result(timeout=300)  # the first build: a short scratch (none)
    build_s = engine.stats()["build_s"]
    t0 = time.perf_counter()
    completions, stats = service.submit(requests([40, 9], [3, 3], seed=2)).result(timeout=300)
    wall = time.perf_counter() - t0
    assert [len(c.token_ids) for c in completions] == [3, 3] and stats["rebuilds"] == 1
    assert stats["build_s"] - build_s >= slow_s
    assert 0 < stats["busy_s"] <= wall - slow_s
