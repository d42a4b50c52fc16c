"""The engine's parts alone: the config, the scheduler's row order and the block manager. The memory plan and the
build's retries: test_engine_memory.py; sampling parameters and the sampler: test_sampler.py."""

from __future__ import annotations

import math

import pytest
import torch

import kivi
from pipeline.actors.engine import Request, SamplingParams
from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.request import Sequence


@pytest.mark.parametrize("bad", [dict(mlp_chunk_tokens=0), dict(mlp_chunk_tokens=1.5), dict(max_prefill_tokens=0),
                                 dict(gpu_memory_utilization=1.5), dict(memory_limit_gib=-1),
                                 dict(growth_plan_share=0), dict(growth_plan_share=1.5),
                                 dict(growth_plan_share=True)])
def test_engine_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)
    assert EngineConfig(mlp_chunk_tokens=None).mlp_chunk_tokens is None


def test_decode_rows_go_longest_first_ties_in_arrival_order(monkeypatch):
    """Scheduler.decode_rows: running sequences by cached length (prompt plus output), longest first and stable;
    with LONGEST_FIRST off, arrival order. Rows arrive out of length order when a later request has a longer
    prompt than a running one has tokens (an actor's next shard)."""
    from pipeline.actors.engine import scheduler

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompts = torch.randint(1, 60, (9,), generator=gen).tolist()
    outputs = torch.randint(0, 30, (9,), generator=gen).tolist()
    blocks = BlockManager(num_slots=9, num_pages=9, pages_for=lambda n: -(-n // 16))
    sched = scheduler.Scheduler(blocks, prefill_tokens=64)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        seq = Sequence.start(i, Request(f"r{i}", list(range(1, p + 1)), SamplingParams(max_new_tokens=40)), 40)
        seq.output = list(range(o))
        sched.running.append(seq)
    lengths = [p + o for p, o in zip(prompts, outputs, strict=True)]
    rows = sched.decode_rows()
    assert [s.cached_len for s in rows] == sorted(lengths, reverse=True)
    assert [s.index for s in rows] == sorted(range(9), key=lambda i: -lengths[i])  # ties keep arrival order
    assert sched.running == sorted(sched.running, key=lambda s: s.index)  # the running list itself is left alone
    monkeypatch.setattr(scheduler, "LONGEST_FIRST", False)
    assert [s.index for s in sched.decode_rows()] == list(range(9))


def test_block_manager_never_hands_out_a_page_twice():
    blocks = BlockManager(num_slots=3, num_pages=10, pages_for=lambda n: -(-n // 8))
    seqs = [Sequence.start(i, Request(str(i), [1] * 10, SamplingParams(max_new_tokens=15)), 15) for i in range(4)]
    admitted = [s for s in seqs if blocks.can_admit(s) and not blocks.admit(s)]
    assert len(admitted) == 3  # 3 pages each: 10 pages, 3 slots
    held = [p for s in admitted for p in s.pages]
    assert len(held) == len(set(held)) == 9 and not blocks.can_admit(seqs[3])
    blocks.release(admitted[0])
    assert blocks.can_admit(seqs[3])


def test_warm_up_rows_use_the_next_free_slots_and_pages_and_keep_them_free():
    blocks = BlockManager(num_slots=3, num_pages=10, pages_for=lambda n: -(-n // 8))
    blocks.admit(Sequence.start(0, Request("0", [1] * 10, SamplingParams(max_new_tokens=14)), 14))  # 3 pages
    free = (list(blocks.free_slots), list(blocks.free_pages))
    lengths, slots, pages = blocks.warm_up_rows([20, 25])
    assert lengths == [20, 25] and [len(p) for p in pages] == [3, 4]  # ceil(n / 8) pages each
    assert (list(blocks.free_slots), list(blocks.free_pages)) == free  # nothing taken
    probe = Sequence.start(1, Request("1", [1] * 20, SamplingParams(max_new_tokens=1)), 0)
    blocks.admit(probe)  # admit() takes the same slot and pages next
    assert (probe.slot, probe.pages) == (slots[0], pages[0])
    assert slots[1] != slots[0] and not set(pages[1]) & set(pages[0])
    # as many as fit, in order: 4 pages left after the probe, so the 60-token prompt (8 pages) is dropped
    assert blocks.warm_up_rows([30, 60, 8])[0] == [30]
    blocks.admit(Sequence.start(2, Request("2", [1] * 8, SamplingParams(max_new_tokens=1)), 0))
    assert blocks.warm_up_rows([8]) == ([], [], [])  # no free slot


def test_warm_up_lengths_follow_the_cache_and_stay_in_the_budget():
    small = kivi.KiviConfig(group_size=16, residual_length=32, page_size=32, backend="reference")
    assert EngineConfig(kivi=small, warm_prefill=True).warm_up_lengths(4096, on_cuda=False) == [67, 64]
    assert EngineConfig(kivi=None, page_size=64).warm_up_lengths(4096, on_cuda=True) == [99, 128]  # default: on
    assert EngineConfig().warm_up_lengths(4096, on_cuda=False) == []  # default: off on a CPU
    assert EngineConfig(warm_prefill=False).warm_up_lengths(4096, on_cuda=True) == []
    assert EngineConfig(max_prefill_tokens=200).warm_up_lengths(4096, on_cuda=True) == [100, 100]
    assert EngineConfig().warm_up_lengths(50, on_cuda=True) == [49, 49]


def _running(sched, prompts: list[int], max_new: int | list[int], grows: bool = False) -> list[Sequence]:
    """Queue prompts of these lengths (each with max_new new tokens, or its own), admit them through next_prefill
    as the engine does, and start those admitted running."""
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    for i, (n, new) in enumerate(zip(prompts, news, strict=True)):
        seq = Sequence.start(i, Request(f"r{i}", [1] * n, SamplingParams(max_new_tokens=new)), new)
        seq.grows = grows
        sched.add(seq)
    batch = sched.next_prefill()
    sched.start_running(batch)
    return batch


def test_page_growth_admits_the_prefill_and_grows_the_oldest_first_preempting_the_newest(monkeypatch):
    """Scheduler over growing sequences: one is admitted with the pages of its prefill and GROWTH_LOOKAHEAD more
    tokens; reserve() tops up the oldest first and, when no page is free, takes the newest running sequence's slot
    and pages back and queues it first, with its output kept for the prefill that resumes it. (No finished row
    has set the share of new tokens a row uses yet: INITIAL_SHARE 0 admits by the prefill's pages alone.)"""
    from pipeline.actors.engine import scheduler
    from pipeline.actors.engine.scheduler import GROWTH_LOOKAHEAD, Scheduler

    monkeypatch.setattr(scheduler, "INITIAL_SHARE", 0.0)

    page = int(torch.randint(GROWTH_LOOKAHEAD, 2 * GROWTH_LOOKAHEAD + 1, ()))
    pages_for = lambda n: -(-n // page)  # noqa: E731
    prompt = int(torch.randint(page - GROWTH_LOOKAHEAD + 1, page, ()))  # admitted with 2 pages each
    first = pages_for(prompt + GROWTH_LOOKAHEAD)
    assert first == 2
    blocks = BlockManager(num_slots=3, num_pages=3 * first, pages_for=pages_for)
    sched = Scheduler(blocks, prefill_tokens=3 * prompt)
    a, b, c = _running(sched, [prompt] * 3, max_new=8 * page, grows=True)
    assert [len(s.pages) for s in (a, b, c)] == [first] * 3 and not blocks.free_pages
    assert sched.reserve() == ([], [])  # every row holds GROWTH_LOOKAHEAD tokens past its cached length
    a.output, b.output = [1] * (first * page - prompt), [1] * (first * page - prompt)  # at their pages' end
    grown, preempted = sched.reserve()
    assert grown == [a, b] and preempted == [c]  # c's pages went to a and b, the older ones
    assert all(blocks.holds(s, s.cached_len + GROWTH_LOOKAHEAD) for s in (a, b))
    assert c.slot == -1 and c.pages == [] and c.preemptions == 1 and list(sched.waiting) == [c]
    held = [p for s in (a, b) for p in s.pages] + blocks.free_pages
    assert sorted(held) == list(range(3 * first))  # no page lost or handed out twice
    # the newest running row is the one that must grow: it gives its own pages back
    b.output += [1] * page
    grown, preempted = sched.reserve()
    assert (grown, preempted) == ([], [b]) and sched.running == [a] and list(sched.waiting) == [b, c]
    # a resumed sequence's prefill holds its prompt and output: it is admitted with their pages
    sched.finish(a)
    blocks.release(a)
    assert sched.next_prefill() == [b]
    assert len(b.pages) == pages_for(b.cached_len + GROWTH_LOOKAHEAD) and b.output


def test_rows_that_hold_their_whole_length_are_never_preempted_and_leave_growing_rows_their_projection(monkeypatch):
    """A row that does not grow keeps its whole length's pages: when a growing row needs a page and none is free,
    the newest growing row gives its pages back (here the one that grows), never a newer row that does not grow. And
    such a row is admitted only where the growing rows' projected pages stay free."""
    from pipeline.actors.engine import scheduler
    from pipeline.actors.engine.scheduler import Scheduler

    monkeypatch.setattr(scheduler, "INITIAL_SHARE", 0.0)  # b is admitted with its prefill's pages alone
    pages_for = lambda n: -(-n // 8)  # noqa: E731
    blocks = BlockManager(num_slots=3, num_pages=7, pages_for=pages_for)
    sched = Scheduler(blocks, prefill_tokens=8)  # one prompt a prefill: admitted in this order
    grows = {"a": False, "b": True, "c": False}
    for i, name in enumerate("abc"):
        max_new = 40 if grows[name] else 9
        seq = Sequence.start(i, Request(name, [1] * 8, SamplingParams(max_new_tokens=max_new)), max_new)
        seq.grows = grows[name]
        sched.add(seq)
        sched.start_running(sched.next_prefill())
    a, b, c = sched.running
    assert [len(s.pages) for s in (a, b, c)] == [2, 3, 2] and not blocks.free_pages
    b.output = [1] * 16  # b must grow past its pages; c is the newest row, but holds its whole length
    assert sched.reserve() == ([], [b]) and sched.running == [a, c] and c.slot >= 0 and len(c.pages) == 2
    assert all(sched.reserve() == ([], []) for _ in range(3))  # and nothing else ever goes
    # with the share at 1 a growing row is projected to its whole length: a row that does not grow waits for it
    monkeypatch.setattr(scheduler, "INITIAL_SHARE", 1.0)
    blocks = BlockManager(num_slots=3, num_pages=7, pages_for=pages_for)
    sched = Scheduler(blocks, prefill_tokens=8)
    b = Sequence.start(0, Request("b", [1] * 8, SamplingParams(max_new_tokens=40)), 40)  # 47 tokens: 6 pages
    d = Sequence.start(1, Request("d", [1] * 8, SamplingParams(max_new_tokens=9)), 9)  # 16 tokens: 2 pages
    b.grows = True
    sched.add(b)
    sched.start_running(sched.next_prefill())  # alone: its prefill's 3 pages
    sched.add(d)
    assert len(b.pages) == 3 and len(blocks.free_pages) == 4 and sched.next_prefill() == []  # 2 + 3 to come > 4
    sched.shares.append(0.0)  # a growing row that finished at once: b is now projected to hold what it has
    assert sched.next_prefill() == [d] and len(d.pages) == 2


def test_a_lone_growing_row_is_admitted_whatever_its_projection():
    """With nothing in flight a growing row needs only the pages it takes at admission, though its whole length
    and the spare pages would not fit together: otherwise a request the cache holds would wait forever."""
    from pipeline.actors.engine.scheduler import Scheduler

    blocks = BlockManager(num_slots=1, num_pages=200, pages_for=lambda n: -(-n // 4))
    sched = Scheduler(blocks, prefill_tokens=1000)
    assert sched.spare_pages == 2
    seq = Sequence.start(0, Request("r", [1] * 10, SamplingParams(max_new_tokens=791)), 791)  # 800 tokens: 200 pages
    seq.grows = True
    sched.add(seq)
    assert blocks.fits_ever(seq) and sched.next_prefill() == [seq] and len(seq.pages) == 7  # ceil(26 / 4)


def test_a_resumed_prefill_that_runs_out_of_memory_halves_the_budget_from_what_it_ran():
    """shrink after a failed prefill of a preempted row (prompt + output): the budget falls to half of what that
    prefill ran, not of its prompt; the row starts again from its prompt."""
    from pipeline.actors.engine.scheduler import Scheduler

    blocks = BlockManager(num_slots=2, num_pages=50, pages_for=lambda n: -(-n // 8))
    sched = Scheduler(blocks, prefill_tokens=1000)
    seq = Sequence.start(0, Request("r", [1] * 10, SamplingParams(max_new_tokens=60)), 60)
    seq.output = [1] * int(torch.randint(20, 50, ()))
    sched.add(seq)
    batch = sched.next_prefill()
    ran = seq.cached_len
    seq.preemptions, seq.preempted_s, seq.t_preempted = 2, 1.5, 3.0  # from its run before: a rebuild was waiting
    sched.shrink(batch, prefill=True)
    assert sched.max_prefill_tokens == ran // 2 and sched.prefill_tokens == ran // 2 and seq.output == []
    assert (seq.preemptions, seq.preempted_s, seq.t_preempted) == (0, 0.0, None)  # they describe the output it lost


def test_block_manager_grows_only_with_free_pages():
    blocks = BlockManager(num_slots=2, num_pages=5, pages_for=lambda n: -(-n // 4))
    seq = Sequence.start(0, Request("0", [1] * 3, SamplingParams(max_new_tokens=30)), 30)
    blocks.admit(seq, tokens=3)
    assert seq.pages and len(seq.pages) == 1 and blocks.holds(seq, 4) and not blocks.holds(seq, 5)
    assert blocks.grow(seq, 20) and len(seq.pages) == 5 and not blocks.free_pages
    assert not blocks.grow(seq, 21) and len(seq.pages) == 5  # nothing taken when too few are free
    assert blocks.grow(seq, 7) and len(seq.pages) == 5  # holds it already


def test_growing_sequences_are_admitted_while_their_projected_pages_fit():
    """A growing sequence is admitted only while the pages that it and the growing ones in flight are projected to
    end with still fit: at first as if each reserved its whole length; once rows have finished, at the mean share
    of max_new_tokens they generated."""
    from pipeline.actors.engine.scheduler import Scheduler

    page, prompt, max_new = 8, 8, int(torch.randint(40, 80, ()))
    pages_for = lambda n: -(-n // page)  # noqa: E731
    whole = pages_for(prompt + max_new - 1)
    blocks = BlockManager(num_slots=64, num_pages=4 * whole + 2, pages_for=pages_for)  # 2: no room for a fifth
    sched = Scheduler(blocks, prefill_tokens=10**6)
    assert sched.spare_pages == 0 and sched.used_share == 1.0
    first = _running(sched, [prompt] * 8, max_new, grows=True)
    assert len(first) == 4  # whole lengths, though each took only its prefill's pages
    assert all(len(s.pages) == pages_for(prompt + 16) for s in first) and len(sched.waiting) == 4
    share = float(torch.empty(()).uniform_(0.1, 0.4))
    for seq in first[:2]:  # two rows stop early: their pages come back and the share falls
        seq.output = [1] * math.ceil(share * max_new)
        seq.finish_reason = "stop"
        sched.finish(seq)
        blocks.release(seq)
    assert sched.used_share == pytest.approx(math.ceil(share * max_new) / max_new)
    more = sched.next_prefill()
    # every growing row, running or new, is projected to end at this many pages (at least 16 tokens past its prompt)
    projected = pages_for(max(prompt + math.ceil(sched.used_share * max_new), prompt + 16))
    # the i-th new one fits while (2 running + i admitted + itself) x projected <= all pages: (3 + i) p <= 4w + 2
    assert len(more) == min(4, (4 * whole + 2) // projected - 2) and len(more) > 2  # more than came back
    seq = Sequence.start(99, Request("x", [1] * prompt, SamplingParams(max_new_tokens=max_new)), max_new)
    assert sched._fits(seq, []) == (len(blocks.free_pages) >= whole)  # a row that does not grow: its whole length


def test_reserve_never_preempts_a_row_that_holds_its_whole_length_nor_one_that_can_take_its_next_step():
    """reserve() when too few pages are free for an older row's lookahead: the row takes what its next step needs
    if that fits (here nothing more), and a newer row that already holds its whole length is never the victim."""
    from pipeline.actors.engine import scheduler
    from pipeline.actors.engine.scheduler import GROWTH_LOOKAHEAD, Scheduler

    page = int(torch.randint(4, GROWTH_LOOKAHEAD // 2 + 1, ()))
    pages_for = lambda n: -(-n // page)  # noqa: E731
    blocks = BlockManager(num_slots=2, num_pages=pages_for(page + GROWTH_LOOKAHEAD) + 2, pages_for=pages_for)
    sched = Scheduler(blocks, prefill_tokens=4 * page)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "INITIAL_SHARE", 0.0)
        old, new = _running(sched, [page, page], max_new=[8 * page, 2], grows=True)
    assert len(new.pages) == 2 and blocks.holds(new, new.total_len) and not blocks.free_pages
    old.output = [1] * int(torch.randint(GROWTH_LOOKAHEAD - page + 1, GROWTH_LOOKAHEAD, ()))  # room for a step
    assert blocks.holds(old, old.cached_len + 1) and not blocks.holds(old, old.cached_len + GROWTH_LOOKAHEAD)
    assert sched.reserve() == ([old], []) and new.preemptions == 0 and new.slot >= 0
    old.output += [1] * (len(old.pages) * page - old.cached_len)  # now its next step needs a page: none is free
    assert sched.reserve() == ([], [old]) and old.preemptions == 1 and new.preemptions == 0
