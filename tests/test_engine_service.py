"""EngineService: several callers share one engine, their rows decoding together (on the CPU, tiny model)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import SMALL_KIVI, StubTokenizer, hf_greedy, requests, tiny  # noqa: F401  (tiny: a fixture)

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams
from pipeline.actors.engine.service import EngineService


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
