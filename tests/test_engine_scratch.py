"""A prefill in chunks keeps its tokens' full-precision keys and values in a scratch (EngineCache.set_chunk): what the
memory plan sets aside for it, and where it cannot. The rest of the plan: test_engine_memory.py."""

from __future__ import annotations

import pytest
import torch

from kivi.models import kv_shape
from pipeline.actors.engine import LLMEngine
from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.memory import plan_cache
from tests.engine_cases import StubTokenizer, requests


def patch_prefill(monkeypatch, fails) -> tuple[list, list]:
    """Every ModelRunner's prefill (a rebuild's runner too) records (its first prompt's length, chunk_tokens) in
    `calls`, and raises a CUDA out-of-memory error where fails(prompts, chunk_tokens, failures so far) is true,
    recording the rows it had in `failures`. Returns (calls, failures)."""
    from pipeline.actors.engine.model_runner import ModelRunner

    real, calls, failures = ModelRunner.prefill, [], []

    def prefill(self, prompts, slots, chunk_tokens=None):
        calls.append((len(prompts[0]), chunk_tokens))
        if fails(prompts, chunk_tokens, failures):
            failures.append(len(prompts))
            raise torch.OutOfMemoryError("simulated prefill")
        return real(self, prompts, slots, chunk_tokens)

    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    return calls, failures


def test_memory_plan_sets_a_chunked_prompts_scratch_aside():
    """plan_cache takes the scratch off the budget like the weights; scratch_bytes counts keys and values of every
    layer for the longest prompt past max_prefill_tokens, and nothing when no prompt goes through in chunks."""
    from pipeline.actors.engine.memory import scratch_bytes

    args = dict(limit_bytes=100_000, used_bytes=2_000, workspace_bytes=1_000, page_bytes=100, slot_bytes=300,
                pages_per_seq=4, max_batch=1_000, min_pages=2, max_pages_per_slot=8)
    scratch = int(torch.randint(700, 50_000, ()))  # a slot and its pages' worth or more
    plain, aside = plan_cache(**args), plan_cache(**args, scratch=scratch)
    assert plain.budget_bytes - aside.budget_bytes == scratch and aside.scratch_bytes == scratch
    assert aside.num_slots == aside.budget_bytes // 700 < plain.num_slots
    with pytest.raises(ValueError, match="does not fit"):
        plan_cache(**{**args, "limit_bytes": 5_000}, scratch=2_000)
    lens = torch.randint(10, 200, (6,)).tolist()
    budget = int(torch.randint(5, 250, ()))
    expected = 2 * 3 * 2 * max([n for n in lens if n > budget], default=0) * 8 * 2  # K and V, 3 layers, bf16
    assert scratch_bytes(lens, budget, layers=3, kv_heads=2, head_dim=8, dtype=torch.bfloat16) == expected
    assert scratch_bytes(lens, max(lens), layers=3, kv_heads=2, head_dim=8, dtype=torch.float32) == 0


def test_engine_plan_holds_the_scratch_its_longest_chunked_prompt_allocates(tiny, monkeypatch):
    """On the CPU (cpu_cache_gib for the cache and the scratch): a prompt past max_prefill_tokens among the
    requests the plan is made for takes exactly what its prefill's scratch then allocates off the cache's budget;
    without it the plan has the whole limit."""
    from pipeline.actors.engine.kv_cache import EngineCache

    allocated, set_chunk = [], EngineCache.set_chunk

    def spy(self, *args):
        fresh = not self.scratch
        set_chunk(self, *args)
        if fresh:
            allocated.append(sum(k.nbytes + v.nbytes for k, v in self.scratch))

    monkeypatch.setattr(EngineCache, "set_chunk", spy)
    config = EngineConfig(max_prefill_tokens=32, cpu_cache_gib=1 / 64, max_batch_size=4)
    long = int(torch.randint(40, 90, ()))
    engine = LLMEngine(tiny, StubTokenizer(), config)
    out = engine.generate(requests([long, 20, 33], [3, 3, 3], seed=int(torch.randint(0, 1000, ()))))
    assert [len(c.token_ids) for c in out] == [3, 3, 3]
    assert allocated and engine.plan.scratch_bytes == max(allocated) > 0  # the longest chunked prompt's
    assert engine.plan.budget_bytes == int(config.cpu_cache_gib * 2**30) - engine.plan.scratch_bytes
    short = LLMEngine(tiny, StubTokenizer(), config)
    short.generate(requests([20, 30], [3, 3]))
    assert short.plan.scratch_bytes == 0 and short.plan.budget_bytes == int(config.cpu_cache_gib * 2**30)


def test_a_scratch_the_cache_leaves_no_room_for_is_not_planned_and_fails_alone(tiny, caplog):
    """Where the cache would not fit beside a long prompt's scratch, the plan leaves the scratch out with a
    warning instead of failing the build (every row finishes here: on the CPU nothing enforces the limit; on a GPU
    the long prompt may then fail alone). A growing row (it may stop early, so it may be preempted and rebuilt)
    counts its whole length as its prefill."""
    from pipeline.actors.engine.request import Sequence

    config = EngineConfig(kivi=None, max_prefill_tokens=64, cpu_cache_gib=0.9 / 1024, max_batch_size=4)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    out = engine.generate(requests([500, 20, 30], [3, 3, 3]))
    assert [c.finish_reason for c in out] == ["length"] * 3
    assert engine.plan.scratch_bytes == 0 and "no room beside the cache" in caplog.text
    seqs, start = [], Sequence.start

    def spy(*args, **kwargs):
        seqs.append(start(*args, **kwargs))
        return seqs[-1]

    grows = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=None, max_prefill_tokens=64, max_batch_size=4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sequence, "start", staticmethod(spy))
        grows.generate(requests([40, 20], [50, 3], stop=("@",)))  # 40 + 49 past 64: its rebuild would chunk
    layers, heads, dim = kv_shape(tiny.config)
    assert all(s.grows for s in seqs) and grows.plan.scratch_bytes == 2 * layers * heads * 89 * dim * 4  # fp32


def test_a_longer_chunked_prompt_after_the_build_waits_for_the_rows_in_flight_then_a_rebuild(tiny, monkeypatch):
    """A prompt past max_prefill_tokens that arrives after the build, with a scratch larger than the build set
    aside, holds the queue until the rows in flight are done; the engine then builds its cache again for it and the
    requests behind it (its scratch aside; time to first token still counts from the first build's end), and every
    row gives generate()'s tokens. A prompt of that length arriving later needs no further build."""
    import weakref

    import kivi
    from pipeline.actors.engine import build
    from tests.engine_cases import SMALL_KIVI, hf_greedy

    config = EngineConfig(kivi=SMALL_KIVI, max_prefill_tokens=16, page_size=16, max_batch_size=3,
                          cpu_cache_gib=1 / 256)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    seed = int(torch.randint(0, 1000, ()))
    first = requests([30, 9, 12], [12, 20, 6], seed=seed)
    sub = engine.add(first)
    engine.step()  # the first prefill: rows in flight
    planned, ready_at, build_s = engine.plan.scratch_bytes, engine.ready_at, engine.build_s
    long_len = int(torch.randint(60, 120, ()))
    late = [r.__class__(f"late{i}", r.prompt_token_ids, r.sampling)
            for i, r in enumerate(requests([long_len, 7], [10, 5], seed=seed + 1))]
    rebuilt_with, old_cache, alive_at_plan, asked = [], weakref.ref(engine.cache), [], []
    rebuild, real_plan, real_parts = LLMEngine._rebuild, build.plan_for, build.allocate_parts

    def spy(self):
        rebuilt_with.append((len(self.scheduler.running), sub.pending))
        rebuild(self)

    def plan_for(*args, **kwargs):  # the old cache must be gone when the new plan measures what is allocated
        alive_at_plan.append(old_cache() is not None)
        return real_plan(*args, **kwargs)

    def parts(model, config, total_lens, *args, prefill_lens, **kwargs):
        asked.append((list(total_lens), list(prefill_lens)))
        return real_parts(model, config, total_lens, *args, prefill_lens=prefill_lens, **kwargs)

    monkeypatch.setattr(LLMEngine, "_rebuild", spy)
    monkeypatch.setattr(build, "plan_for", plan_for)
    monkeypatch.setattr(build, "allocate_parts", parts)
    sub_late = engine.add(late)
    for _ in range(1_000):  # a bound: a rebuild that dropped rows in flight would leave them pending
        if not (sub.pending or sub_late.pending):
            break
        engine.step()
    assert rebuilt_with == [(0, 0)]  # once, after every row in flight (the whole first submission) was done
    assert alive_at_plan == [False]
    # slots and pages for the first requests' mix (not the long prompt alone), the long prompt's scratch aside too
    assert asked == [([41, 28, 17], [30, 9, 12, long_len, 7])]
    layers, heads, dim = kv_shape(tiny.config)
    assert planned == 2 * layers * heads * 30 * dim * 4 < engine.plan.scratch_bytes  # fp32: 4 bytes
    assert engine.plan.scratch_bytes == 2 * layers * heads * long_len * dim * 4
    assert engine.stats()["rebuilds"] == 1 and engine.build_s > build_s and engine.ready_at == ready_at
    for req, comp in zip(first + late, sub.results + sub_late.results, strict=True):
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens,
                                    kivi.KiviCache(tiny.config, SMALL_KIVI))
        assert comp.error is None and comp.token_ids[: clear + 1] == expected[: clear + 1], req.request_id
    again = engine.generate(requests([long_len, 20], [3, 3], seed=seed + 2))
    assert [c.finish_reason for c in again] == ["length"] * 2 and engine.stats()["rebuilds"] == 1


def test_no_rebuild_for_a_scratch_no_larger_than_one_the_plan_had_no_room_for(tiny):
    """The plan had no room for its first requests' long prompt's scratch (planned without it): a later, shorter
    chunked prompt is no reason to build again (the plan would have no room for the scratch it asked for), and
    neither is one of the same length."""
    config = EngineConfig(kivi=None, max_prefill_tokens=64, cpu_cache_gib=0.9 / 1024, max_batch_size=4)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    engine.generate(requests([500, 20], [3, 3]))
    assert engine.plan.scratch_bytes == 0
    for n in (100, 500):
        out = engine.generate(requests([n, 20], [3, 3], seed=n))
        assert [c.finish_reason for c in out] == ["length"] * 2 and engine.stats()["rebuilds"] == 0


def test_a_failed_rebuild_builds_the_cache_as_it_was_and_loses_no_row(tiny, monkeypatch):
    """Out of memory in the rebuild for late long prompts: the engine builds the cache it had (its plan's lengths)
    and every row, the long ones among them, still runs: no call in flight fails, and the second long prompt is no
    reason to try another rebuild."""
    from pipeline.actors.engine import build

    config = EngineConfig(kivi=None, max_prefill_tokens=16, page_size=16, max_batch_size=3, cpu_cache_gib=1 / 256)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    sub = engine.add(requests([30, 9], [8, 6], seed=3))
    engine.step()
    first, real = engine.plan, build.allocate_parts

    def parts(*args, prefill_lens, **kwargs):
        if max(prefill_lens) >= 90:
            raise torch.OutOfMemoryError("simulated rebuild")
        return real(*args, prefill_lens=prefill_lens, **kwargs)

    monkeypatch.setattr(build, "allocate_parts", parts)
    late = engine.add([r.__class__(f"late{i}", r.prompt_token_ids, r.sampling)
                       for i, r in enumerate(requests([90, 95], [5, 4], seed=4))])
    for _ in range(1_000):
        if not (sub.pending or late.pending):
            break
        engine.step()
    assert [len(c.token_ids) for c in sub.results + late.results] == [8, 6, 5, 4]
    assert engine.stats()["rebuilds"] == 1 and engine.plan == first  # the cache as it was


def test_a_prompt_chunked_because_an_oom_lowered_the_prefill_budget_gets_its_scratch(tiny, monkeypatch):
    """A batch prefill that ran out of memory lowers the prefill budget under max_prefill_tokens, and a later prompt
    between the two then goes through in chunks, with a scratch the plan (made at max_prefill_tokens) never counted:
    it waits for the rows in flight, and the engine builds again with its scratch aside, keeping the lowered
    budget. Every row gives generate()'s tokens."""
    from transformers import DynamicCache

    from tests.engine_cases import hf_greedy

    config = EngineConfig(kivi=None, max_prefill_tokens=64, page_size=16, max_batch_size=4, cpu_cache_gib=1 / 256)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    _, failed = patch_prefill(monkeypatch, lambda prompts, _, failures: len(prompts) > 1 and not failures)
    seed = int(torch.randint(0, 1000, ()))
    first = requests([20, 20, 18], [8, 6, 7], seed=seed)
    sub = engine.add(first)
    engine.step()  # out of memory: a budget of half the 60 padded tokens from now on
    assert failed == [3] and engine.scheduler.max_prefill_tokens == 30 and engine.plan.scratch_bytes == 0
    engine.step()
    mid = int(torch.randint(31, 65, ()))  # past the lowered budget, within max_prefill_tokens
    late = [r.__class__("late", r.prompt_token_ids, r.sampling) for r in requests([mid], [5], seed=seed + 1)]
    sub_late = engine.add(late)
    for _ in range(1_000):
        if not (sub.pending or sub_late.pending):
            break
        engine.step()
    layers, heads, dim = kv_shape(tiny.config)
    assert engine.stats()["rebuilds"] == 1 and engine.plan.scratch_bytes == 2 * layers * heads * mid * dim * 4
    assert engine.scheduler.max_prefill_tokens == 30  # what the error taught the scheduler outlives the rebuild
    engine.reset_stats()  # the counts since the engine started (the per-shard stats') outlive a reset
    counts = engine.stats()
    assert (counts["oom_retries"], counts["rebuilds"], counts["oom_retries_total"], counts["rebuilds_total"]) == (
        0, 0, 1, 1)
    for req, comp in zip(first + late, sub.results + sub_late.results, strict=True):
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens,
                                    DynamicCache(config=tiny.config))
        assert comp.error is None and comp.token_ids[: clear + 1] == expected[: clear + 1], req.request_id


def test_a_decode_oom_halves_the_prefill_budget_but_chunks_no_prompt_within_max_prefill_tokens(tiny, monkeypatch):
    """A decode step out of memory requeues its rows with a halved prefill budget (smaller batches), while
    max_prefill_tokens stays: a prompt between the two still goes whole, so it needs no scratch and no rebuild."""
    from transformers import DynamicCache

    from pipeline.actors.engine.model_runner import ModelRunner
    from tests.engine_cases import hf_greedy

    config = EngineConfig(kivi=None, max_prefill_tokens=64, page_size=16, max_batch_size=4, cpu_cache_gib=1 / 256)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    prefill, decode, chunks, failed = ModelRunner.prefill, ModelRunner.decode, [], []

    def spy_prefill(self, prompts, slots, chunk_tokens=None):
        chunks.append((len(prompts[0]), chunk_tokens, engine.scheduler.prefill_tokens))
        return prefill(self, prompts, slots, chunk_tokens)

    def spy_decode(self, *args, **kwargs):
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("simulated decode step")
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prefill", spy_prefill)
    monkeypatch.setattr(ModelRunner, "decode", spy_decode)
    long = int(torch.randint(33, 65, ()))  # past half of the 2 x long padded tokens that ran out, within 64
    reqs = requests([long, 30], [6, 5], seed=int(torch.randint(0, 1000, ())))
    out = engine.generate(reqs)
    assert failed and engine.stats()["oom_retries"] == 1 and engine.stats()["rebuilds"] == 0
    assert (long, None, 32) in chunks  # prefilled again whole after the error, with a budget of half the 64 tokens
    assert all(chunk is None for _, chunk, _ in chunks) and engine.plan.scratch_bytes == 0
    for req, comp in zip(reqs, out, strict=True):
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens,
                                    DynamicCache(config=tiny.config))
        assert comp.error is None and comp.token_ids[: clear + 1] == expected[: clear + 1], req.request_id


def test_a_lone_prompt_whose_whole_prefill_runs_out_of_memory_goes_in_chunks_next(tiny, monkeypatch):
    """A lone prompt within max_prefill_tokens that runs out of memory whole goes in chunks next (of half its
    length, past a max_prefill_tokens lowered to that), with its scratch aside, and gives generate()'s tokens; a
    one-token prompt, which has no chunks to try, becomes an error row that names no chunks."""
    from transformers import DynamicCache

    from tests.engine_cases import hf_greedy

    config = EngineConfig(kivi=None, max_prefill_tokens=64, page_size=16, max_batch_size=4, cpu_cache_gib=1 / 256)
    # the first prefill once, a one-token prompt every time
    seen, _ = patch_prefill(monkeypatch, lambda prompts, _, failures: len(prompts[0]) == 1 or not failures)
    n = int(torch.randint(3, 65, ()))
    reqs = requests([n], [5], seed=int(torch.randint(0, 1000, ())))
    engine = LLMEngine(tiny, StubTokenizer(), config)
    out = engine.generate(reqs)
    assert seen[:2] == [(n, None), (n, n // 2)] and engine.scheduler.max_prefill_tokens == n // 2
    layers, heads, dim = kv_shape(tiny.config)
    assert engine.stats()["rebuilds"] == 1 and engine.plan.scratch_bytes == 2 * layers * heads * n * dim * 4
    expected, clear = hf_greedy(tiny, reqs[0].prompt_token_ids, 5, DynamicCache(config=tiny.config))
    assert out[0].error is None and out[0].token_ids[: clear + 1] == expected[: clear + 1]
    engine = LLMEngine(tiny, StubTokenizer(), config)
    sub = engine.add(requests([1, 9], [3, 3], seed=5))
    for _ in range(100):  # a bound: retried for ever, the one-token row would stay pending
        if not sub.pending:
            break
        engine.step()
    one, other = sub.results
    assert one.finish_reason == "error" and "out of memory" in one.error and "chunks" not in one.error
    assert other.error is None and len(other.token_ids) == 3


def test_a_chunk_out_of_memory_halves_the_chunks_and_keeps_where_prompts_go_in_chunks(tiny, monkeypatch):
    """A lone prompt past max_prefill_tokens that runs out of memory in a chunk is retried in chunks half as long;
    max_prefill_tokens, the length past which prompts go in chunks, stays (a whole prefill of that size did not
    fail), so a later prompt within it goes whole."""
    from pipeline.actors.engine import llm_engine

    monkeypatch.setattr(llm_engine, "MIN_CHUNK_TOKENS", 8)
    seen, _ = patch_prefill(monkeypatch, lambda _, chunk_tokens, __: chunk_tokens == 64)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=None, max_prefill_tokens=64, max_batch_size=4))
    long = int(torch.randint(65, 128, ()))  # under twice max_prefill_tokens
    out = engine.generate(requests([long], [4], seed=long))
    assert out[0].error is None and seen == [(long, 64), (long, 32)] and engine.scheduler.max_prefill_tokens == 64
    short = int(torch.randint(long // 2 + 1, 65, ()))
    assert engine.generate(requests([short], [3], seed=short))[0].error is None and seen[-1] == (short, None)
