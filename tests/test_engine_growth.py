"""The engine's page growth (EngineConfig.page_growth): which rows grow, how the plan sizes their slots, and
preemption in a cache too small for every row's whole length (CPU, against transformers' own generate)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams, build, scheduler
from pipeline.actors.engine.kv_cache import engine_storage
from pipeline.actors.engine.memory import CachePlan
from tests.engine_cases import SMALL_KIVI, StubTokenizer, hf_greedy, requests


def _short_of_pages(kc, monkeypatch) -> tuple[list[Request], EngineConfig, CachePlan]:
    """Five requests that may stop early (a stop string the stub tokenizer never writes) and run to length, and a
    plan of 4 slots with pages for the longest whole length and 3 more: rows must give pages back. Admission by
    the prefill's pages alone until a row has finished (INITIAL_SHARE 0)."""
    reqs = requests(torch.randint(30, 60, (5,)).tolist(), torch.randint(40, 70, (5,)).tolist(),
                    seed=int(torch.randint(0, 1000, ())), stop=("@",))
    monkeypatch.setattr(scheduler, "INITIAL_SHARE", 0.0)
    config = EngineConfig(kivi=kc, max_batch_size=4, page_size=16, page_growth=True)
    pages_for = engine_storage(config, torch.device("cpu")).pages_for
    whole = max(pages_for(len(r.prompt_token_ids) + r.sampling.max_new_tokens) for r in reqs)
    plan = CachePlan(num_slots=4, num_pages=whole + 3, budget_bytes=0, workspace_bytes=0)
    monkeypatch.setattr(build, "plan_for", lambda *args, **kwargs: plan)
    return reqs, config, plan


@pytest.mark.parametrize("cache_kind", ["kivi", "bf16"])
def test_preempted_sequences_resume_from_prompt_and_output(tiny, cache_kind, monkeypatch):
    """Page growth in a cache too small for every sequence's whole length: the newest sequences give their pages
    back (preemptions) and resume from a prefill of prompt + output. Up to its first preemption a row equals
    generate() on its prompt; after it, generate() on the prompt and the output so far (a fresh cache of those
    tokens is what the resumed row attends to). No row is lost, cut or doubled, and the stats count it. (Rows grow
    where they may stop early: here a stop string the stub tokenizer never writes. INITIAL_SHARE 0: admitted by
    their prefill's pages alone until a row has finished.)"""
    kc = SMALL_KIVI if cache_kind == "kivi" else None
    reqs, config, plan = _short_of_pages(kc, monkeypatch)
    points, preempt = {}, scheduler.Scheduler.preempt

    def spy(self, seq):
        points.setdefault(seq.request.request_id, []).append(len(seq.output))
        preempt(self, seq)

    monkeypatch.setattr(scheduler.Scheduler, "preempt", spy)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    out = engine.generate(reqs)
    assert points and engine.stats()["preemptions"] == sum(map(len, points.values())) > 0
    prompts = {r.request_id: len(r.prompt_token_ids) for r in reqs}
    again = sum(prompts[rid] + k for rid, ks in points.items() for k in ks)  # each resume prefills prompt + output
    assert engine.stats()["recomputed_tokens"] == again
    assert engine.stats()["prefill_tokens"] == sum(prompts.values()) + again
    decided = 0
    for req, comp in zip(reqs, out, strict=True):
        n = req.sampling.max_new_tokens
        assert comp.request_id == req.request_id and comp.finish_reason == "length" and len(comp.token_ids) == n
        assert comp.preemptions == len(points.get(req.request_id, []))
        cuts = [0, *points.get(req.request_id, []), n]
        for start, end in zip(cuts, cuts[1:], strict=False):  # each stretch from its own prefill
            cache = kivi.KiviCache(tiny.config, kc) if kc else DynamicCache(config=tiny.config)
            expected, clear = hf_greedy(tiny, req.prompt_token_ids + comp.token_ids[:start], n - start, cache)
            upto = min(end - start, clear + 1)
            assert comp.token_ids[start: start + upto] == expected[:upto], f"{req.request_id} differs at {start}"
            decided += upto
            if upto < end - start:
                break  # a near-tie: what follows may differ by rounding
    assert decided > 0.6 * sum(r.sampling.max_new_tokens for r in reqs)
    assert engine.blocks.pages_in_use == 0 and len(engine.blocks.free_slots) == plan.num_slots


def test_time_per_token_leaves_out_the_time_a_row_spent_preempted(tiny, monkeypatch):
    """A clock that jumps 1,000 s at every preemption: a row's decode_s and preempted_s together span its first to
    last token (jumps counted by rounding), preempted_s holds at least its own preemptions' jumps (it waits through
    them), and a row never preempted has none; so decode_s, behind the shards' time per output token, leaves out a
    preempted row's wait."""
    reqs, config, _ = _short_of_pages(None, monkeypatch)
    jumps, real_clock, preempt = [0], time.perf_counter, scheduler.Scheduler.preempt

    def preempt_and_jump(self, seq):
        preempt(self, seq)  # stamps the row's preemption, then the clock jumps
        jumps[0] += 1

    monkeypatch.setattr(scheduler.Scheduler, "preempt", preempt_and_jump)
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + 1000.0 * jumps[0])
    engine = LLMEngine(tiny, StubTokenizer(), config)
    last_jump = {}
    subs = [engine.add([r], on_done=lambda sub, rid=r.request_id: last_jump.setdefault(rid, jumps[0])) for r in reqs]
    while engine.has_work():
        engine.step()
    assert jumps[0] > 0 and len(last_jump) == len(reqs)
    for req, sub in zip(reqs, subs, strict=True):
        (comp,) = sub.results
        assert len(comp.token_ids) == req.sampling.max_new_tokens
        first_jump = round(comp.ttft_s / 1000)  # every row arrived before the first jump
        span = last_jump[req.request_id] - first_jump
        assert round(comp.decode_s / 1000) + round(comp.preempted_s / 1000) == span, req.request_id
        assert round(comp.preempted_s / 1000) >= comp.preemptions
        assert comp.preempted_s == 0 if comp.preemptions == 0 else comp.preempted_s > 0
    assert sum(sub.results[0].preemptions for sub in subs) == jumps[0]


def test_rows_grow_where_they_may_stop_early(tiny):
    """With page_growth a row takes pages as it grows where it may stop early: the model has an EOS
    that the row does not ignore, or the row has a stop string. Rows that run to max_new_tokens (ignore_eos, or no
    EOS at all) reserve their whole length, as every row does with page_growth off (on is the default)."""
    from pipeline.actors.engine.request import Sequence

    seen, start = [], Sequence.start

    def spy(*args, **kwargs):
        seen.append(start(*args, **kwargs))
        return seen[-1]

    def grows(config, eos: set, **sampling) -> list[bool]:
        engine = LLMEngine(tiny, StubTokenizer(), config)
        engine.eos_ids = eos  # ids the model never writes (its vocabulary is smaller): rows still run to length
        seen.clear()
        engine.generate([Request("r", list(range(1, 9)), SamplingParams(max_new_tokens=4, **sampling))])
        return [s.grows for s in seen]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sequence, "start", staticmethod(spy))
        on = EngineConfig(page_growth=True)
        assert grows(on, {10**6}) == [True]
        assert grows(on, {10**6}, ignore_eos=True) == [False]
        assert grows(on, set()) == [False]
        assert grows(on, set(), stop=("@",)) == [True]
        assert EngineConfig().page_growth is True and grows(EngineConfig(), {10**6}) == [True]
        assert grows(EngineConfig(page_growth=False), {10**6}, stop=("@",)) == [False]


@pytest.mark.parametrize("cache_kind", ["kivi", "full"])
def test_memory_plan_sizes_growing_rows_by_the_cache_kind(tiny, cache_kind, monkeypatch):
    """The plan's lengths (build.allocate_parts' total_lens): growing rows' slots at their prompt + half their new
    tokens over the full-precision cache (a slot costs only its pages), at their whole length over KIVI (a slot
    holds a ring of R tokens) unless growth_plan_share says otherwise; rows that cannot stop early, and every row
    with page_growth off, at their whole length."""
    from pipeline.actors.engine import build

    seen, allocate = [], build.allocate_parts

    def spy(model, config, total_lens, *args, **kwargs):
        seen.append(list(total_lens))
        return allocate(model, config, total_lens, *args, **kwargs)

    monkeypatch.setattr(build, "allocate_parts", spy)
    prompts, new = torch.randint(5, 40, (3,)).tolist(), torch.randint(8, 30, (3,)).tolist()

    def plan(ignore_eos=False, **config) -> list[int]:
        engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI if cache_kind == "kivi" else None,
                                                               max_batch_size=4, **config))
        engine.eos_ids = {10**6}  # an EOS the model never writes: rows may stop early, and run to length
        seen.clear()
        out = engine.generate([Request(f"r{i}", list(range(1, p + 1)),
                                       SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))
                               for i, (p, n) in enumerate(zip(prompts, new, strict=True))])
        assert [len(c.token_ids) for c in out] == new
        return sorted(seen[0])

    whole = sorted(p + n - 1 for p, n in zip(prompts, new, strict=True))
    half = sorted(p + (n - 1) // 2 for p, n in zip(prompts, new, strict=True))
    assert plan() == (whole if cache_kind == "kivi" else half)
    assert plan(growth_plan_share=0.5) == half
    assert plan(growth_plan_share=1.0) == whole
    assert plan(ignore_eos=True) == whole and plan(page_growth=False) == whole
