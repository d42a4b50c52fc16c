"""The engine's memory plan and its build: how the budget splits into slots and pages, a build short of its
measured workspace, out-of-memory retries and what a failed build gives back. The other parts: test_engine_parts.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.memory import mean_pages, plan_cache, plan_for


def test_memory_plan_splits_budget_into_slots_and_pages():
    plan = plan_cache(limit_bytes=10_000, used_bytes=2_000, workspace_bytes=1_000, page_bytes=100, slot_bytes=300,
                      pages_per_seq=4, max_batch=100, min_pages=2, max_pages_per_slot=8)
    budget = 10_000 - 2_000 - 1_000 - 10_000 // 50  # a 2% margin is kept on a GPU
    assert plan.budget_bytes == budget
    assert plan.num_slots == budget // 700 and plan.num_pages == (budget - plan.num_slots * 300) // 100
    with pytest.raises(ValueError, match="does not fit"):
        plan_cache(limit_bytes=1_000, used_bytes=900, workspace_bytes=0, page_bytes=100, slot_bytes=50,
                   pages_per_seq=4, max_batch=8, min_pages=5, max_pages_per_slot=8)
    # slots for the mean length would leave fewer pages than the longest sequence needs: fewer slots, not an error
    tight = plan_cache(limit_bytes=10_000, used_bytes=0, workspace_bytes=0, page_bytes=100, slot_bytes=300,
                       pages_per_seq=1, max_batch=100, min_pages=40, max_pages_per_slot=40)
    assert (tight.num_slots, tight.num_pages) == (20, 40)
    half = plan_cache(limit_bytes=10_000, used_bytes=2_000, workspace_bytes=1_000, page_bytes=100, slot_bytes=300,
                      pages_per_seq=4, max_batch=100, min_pages=2, max_pages_per_slot=8, budget_scale=0.5)
    assert half.budget_bytes == budget // 2 and half.num_slots == (budget // 2) // 700
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="budget_scale"):
            plan_cache(limit_bytes=10_000, used_bytes=0, workspace_bytes=0, page_bytes=100, slot_bytes=300,
                       pages_per_seq=4, max_batch=100, min_pages=2, max_pages_per_slot=8, budget_scale=bad)


def test_mean_pages_counts_each_sequence_in_whole_pages(monkeypatch):
    """The slot plan's pages per sequence: each length rounded up on its own (equal lengths: exactly their pages;
    mixed: more than the mean length's pages), with PAGE_SLACK on top."""
    from pipeline.actors.engine import memory

    page = int(torch.randint(8, 40, ()))
    pages_for = lambda n: -(-n // page)
    full = int(torch.randint(2, 9, ()))
    assert mean_pages([full * page] * 5, pages_for) == full  # no half page for rounding that never happens
    lens = [page + 1, 2 * page + 1]  # 2 and 3 pages, mean length 1.5 pages + 1 token: 2 pages
    assert mean_pages(lens, pages_for) == 2.5 > pages_for(sum(lens) // 2)
    monkeypatch.setattr(memory, "PAGE_SLACK", 0.5)
    assert mean_pages([full * page], pages_for) == full + 0.5
    with pytest.raises(ValueError, match="at least one"):
        mean_pages([], pages_for)


def test_engine_plan_gives_equal_lengths_exactly_their_slots(tiny):
    """plan_for on the CPU (the whole cpu_cache_gib for the cache), KIVI ring slots and pages alike: requests of
    one length get budget // (slot + their pages) slots, and every slot can hold a whole request."""
    import kivi_kernels
    from kivi import KiviConfig
    from kivi.models import kv_shape
    from kivi.storage import QuantizedStorage

    kivi = KiviConfig(residual_length=32, group_size=32, page_size=32)
    storage = QuantizedStorage(kivi, kivi_kernels.get_ops("reference"))
    config = EngineConfig(cpu_cache_gib=float(torch.randint(2, 9, ())) / 2**10, max_batch_size=10_000)
    length = int(torch.randint(33, 400, ()))
    plan = plan_for(tiny, storage, config, [length] * 7, max_model_len=512)
    layers, heads, dim = kv_shape(tiny.config)
    dtype = next(tiny.parameters()).dtype
    pages = storage.pages_for(length)
    per_seq = (storage.slot_bytes(heads, dim, dtype) + pages * storage.page_bytes(heads, dim, dtype)) * layers
    assert plan.num_slots == int(config.cpu_cache_gib * 2**30) // per_seq > 1
    assert plan.num_pages >= plan.num_slots * pages


def test_build_short_of_its_workspace_gives_up_the_deficit(caplog):
    """A build that leaves less than the measured workspace free once its graphs are captured: check_headroom
    says by how much, build_shrinking builds again with that much (times HEADROOM_PAD) less cache budget, and the
    last attempt keeps its build with a warning instead of failing."""
    from dataclasses import replace

    from pipeline.actors.engine.memory import (
        BUILD_ATTEMPTS,
        BUILD_SHRINK,
        HEADROOM_FLOOR_SHARE,
        HEADROOM_PAD,
        CachePlan,
        HeadroomShortfall,
        build_shrinking,
        check_headroom,
    )

    gib = 2**30
    limit, workspace = int(torch.randint(20, 80, ())) * gib, int(torch.randint(1, 3, ())) * gib
    budget = limit - 2 * workspace
    deficit = int(torch.randint(int(HEADROOM_FLOOR_SHARE / HEADROOM_PAD * budget) + 1, 2**30, ()))  # past the floor
    plan = CachePlan(num_slots=8, num_pages=64, budget_bytes=budget, workspace_bytes=workspace, limit_bytes=limit)
    check_headroom(plan, limit - workspace)  # exactly the workspace left free
    with pytest.raises(HeadroomShortfall) as short:
        check_headroom(plan, limit - workspace + deficit)
    assert short.value.deficit_bytes == deficit and short.value.budget_bytes == budget
    check_headroom(plan, limit - workspace + deficit, strict=False)
    assert "less than the prefill workspace" in caplog.text
    scratch = int(torch.randint(1, 2**28, ()))  # a chunked prompt's scratch is kept free beside the workspace
    check_headroom(replace(plan, scratch_bytes=scratch), limit - workspace - scratch)
    with pytest.raises(HeadroomShortfall) as short:
        check_headroom(replace(plan, scratch_bytes=scratch), limit - workspace)
    assert short.value.deficit_bytes == scratch
    check_headroom(replace(plan, limit_bytes=0), 10 * limit)  # no limit given: nothing to check
    check_headroom(plan, None)  # off a GPU (reserved_bytes is None): nothing to check

    calls, released = [], []

    def build(scale, final):
        calls.append((scale, final))
        if len(calls) == 1:
            raise HeadroomShortfall(deficit, budget)

    build_shrinking(build, released.append)
    assert calls == [(1.0, False), (pytest.approx(1 - HEADROOM_PAD * deficit / budget), False)]
    assert released == [True]
    calls.clear(), released.clear()
    deficit = int(budget * float(torch.empty(()).uniform_(0, HEADROOM_FLOOR_SHARE / HEADROOM_PAD)))  # a small one
    build_shrinking(build, released.append)
    assert calls == [(1.0, False), (pytest.approx(1 - HEADROOM_FLOOR_SHARE), False)] and released == [True]

    calls.clear(), released.clear()

    def always_short(scale, final):
        calls.append(final)
        if not final:
            raise HeadroomShortfall(deficit, budget)

    build_shrinking(always_short, released.append)
    assert calls == [False] * (BUILD_ATTEMPTS - 1) + [True] and released == [True] * (BUILD_ATTEMPTS - 1)

    calls.clear(), released.clear()  # a shortfall past the whole budget halves it; an out-of-memory error: 0.85

    def huge_then_oom(scale, final):
        calls.append(scale)
        if len(calls) == 1:
            raise HeadroomShortfall(10 * budget, budget)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated")

    build_shrinking(huge_then_oom, released.append)
    assert calls == [1.0, 0.5, pytest.approx(0.5 * BUILD_SHRINK)] and released == [True, True]


def test_engine_short_of_its_workspace_builds_again_with_less_cache(tiny, monkeypatch):
    """A build whose reserved memory leaves less than the workspace under the limit (as a GPU build whose graph
    pool outgrew the plan's margin): the engine drops it, builds again with 1.1x the deficit less cache budget,
    counts one retry, and completes the requests as an engine that never fell short."""
    from pipeline.actors.engine import LLMEngine, build
    from pipeline.actors.engine.memory import HEADROOM_PAD
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    reqs = requests([9, 23, 14], [6, 11, 4], seed=int(torch.randint(0, 1000, ())))
    config = EngineConfig(kivi=SMALL_KIVI, cpu_cache_gib=float(torch.randint(1, 4, ())) / 2**10)
    clean = LLMEngine(tiny, StubTokenizer(), config)
    expected = [c.token_ids for c in clean.generate(reqs)]
    limit, budget = clean.plan.limit_bytes, clean.plan.budget_bytes  # a CPU plan: its limit is the cache budget
    deficit = int(budget * float(torch.empty(()).uniform_(0.05, 0.3)))
    seen = []
    monkeypatch.setattr(build, "reserved_bytes", lambda device: seen.append(device) or (
        limit + deficit if len(seen) == 1 else 0))
    engine = LLMEngine(tiny, StubTokenizer(), config)
    assert [c.token_ids for c in engine.generate(reqs)] == expected
    assert len(seen) == 2 and engine.stats()["oom_retries"] == 1
    assert engine.plan.budget_bytes == int(budget * (1 - HEADROOM_PAD * deficit / budget))
    assert engine.plan.num_slots <= clean.plan.num_slots


def _failing_cache(monkeypatch, fails) -> list:
    """Patch the engine's EngineCache so that construction number n (from 1) raises a CUDA out-of-memory error
    where fails(n); returns the list of what each construction was asked for (slots, pages)."""
    from pipeline.actors.engine import build

    real, asked = build.EngineCache, []

    def cache(*args, **kwargs):
        asked.append((kwargs["num_slots"], kwargs["num_pages"]))
        if fails(len(asked)):
            raise torch.OutOfMemoryError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "EngineCache", cache)
    return asked


def test_build_out_of_memory_retries_with_a_smaller_budget(tiny, monkeypatch):
    """Out of memory while the cache is allocated: the build runs again on BUILD_SHRINK of the budget, the
    requests complete as on an engine that never failed, and the stats count the retry."""
    from pipeline.actors.engine import LLMEngine
    from pipeline.actors.engine.memory import BUILD_SHRINK
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    reqs = requests([9, 23, 14], [6, 11, 4], seed=int(torch.randint(0, 1000, ())))
    # 1-3 MiB: ~29-90 slots, so that the budget, not max_batch_size or the pages a slot could use, decides the plan
    config = EngineConfig(kivi=SMALL_KIVI, cpu_cache_gib=float(torch.randint(1, 4, ())) / 2**10)
    clean = LLMEngine(tiny, StubTokenizer(), config)
    expected = [c.token_ids for c in clean.generate(reqs)]
    asked = _failing_cache(monkeypatch, lambda n: n == 1)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    assert [c.token_ids for c in engine.generate(reqs)] == expected
    assert engine.stats()["oom_retries"] == 1 and len(asked) == 2
    assert engine.plan.budget_bytes == int(clean.plan.budget_bytes * BUILD_SHRINK)
    assert asked[0] == (clean.plan.num_slots, clean.plan.num_pages) and asked[1][0] < asked[0][0]


def test_build_that_keeps_running_out_of_memory_raises_and_builds_later(tiny, monkeypatch):
    """BUILD_ATTEMPTS failures in a row: the call gets the out-of-memory error, nothing is left half built, and
    the next call, once memory is there, builds and completes."""
    from pipeline.actors.engine import LLMEngine
    from pipeline.actors.engine.memory import BUILD_ATTEMPTS
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    reqs = requests([12, 5], [7, 9], seed=int(torch.randint(0, 1000, ())))
    expected = [c.token_ids for c in LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI)).generate(reqs)]
    asked = _failing_cache(monkeypatch, lambda n: n <= BUILD_ATTEMPTS)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    with pytest.raises(torch.OutOfMemoryError, match="simulated.*building the KV cache"):
        engine.generate(reqs)
    assert len(asked) == BUILD_ATTEMPTS and engine.runner is None and not engine.active and not engine.has_work()
    assert [c.token_ids for c in engine.generate(reqs)] == expected
    assert len(asked) == BUILD_ATTEMPTS + 1 and engine.stats()["oom_retries"] == BUILD_ATTEMPTS - 1


def test_failed_build_frees_its_cache_before_the_retry_plans(tiny, monkeypatch):
    """Out of memory after the cache was allocated (capturing the graphs): the failed cache is gone before the
    retry measures what is allocated, else the retry's budget would lose a whole cache, not 15%."""
    import weakref

    from pipeline.actors.engine import LLMEngine, build
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    real_runner, real_plan, failed, alive_at_plan = build.ModelRunner, build.plan_for, [], []

    def runner(model, cache, *args, **kwargs):
        if not failed:
            failed.append(weakref.ref(cache))
            raise torch.OutOfMemoryError("simulated capture")
        return real_runner(model, cache, *args, **kwargs)

    def plan_for(*args, **kwargs):
        alive_at_plan.append([ref() is not None for ref in failed])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(build, "ModelRunner", runner)
    monkeypatch.setattr(build, "plan_for", plan_for)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    out = engine.generate(requests([10, 4], [5, 6], seed=int(torch.randint(0, 1000, ()))))
    assert [len(c.token_ids) for c in out] == [5, 6] and engine.stats()["oom_retries"] == 1
    assert alive_at_plan == [[], [False]]
