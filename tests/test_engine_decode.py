"""The generation engine's decode runs (decode ahead, row order, runs cut short), its recovery from out-of-memory
errors in prefill, and its GPU paths (decode ahead against synchronous steps, warm-up prefill, fused projections).
Continuous batching against generate() is in test_engine.py; shared pieces in engine_cases.py."""

from __future__ import annotations

import pytest
import torch

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams
from tests.engine_cases import SMALL_KIVI, StubTokenizer, gpu_fp32_tokens, gpu_llama, requests


def run_with_failing_prefill(engine, monkeypatch, reqs, fails, same_tokens: bool = True) -> tuple[list, list]:
    """Generate reqs once normally, then again with prefill raising OOM where fails(prompts, call, chunk_tokens)
    is true (call counts from 1); asserts the second run's tokens equal the first's (same_tokens). Returns the
    prompts and the chunk budget of each prefill tried."""
    expected = [c.token_ids for c in engine.generate(reqs)]
    real_prefill, tried, chunks = engine.runner.prefill, [], []

    def prefill(prompts, slots, chunk_tokens=None):
        tried.append(prompts)
        chunks.append(chunk_tokens)
        if fails(prompts, len(tried), chunk_tokens):
            raise torch.OutOfMemoryError("simulated")
        return real_prefill(prompts, slots, chunk_tokens)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine.reset_stats()
    out = engine.generate(reqs)
    if same_tokens:
        assert [c.token_ids for c in out] == expected
    return tried, chunks, out


def test_out_of_memory_in_prefill_requeues_the_work(tiny, monkeypatch):
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    reqs = requests([22, 30, 17, 19], [10, 10, 10, 10])  # within 2x of each other: one prefill batch
    tried, _, _ = run_with_failing_prefill(engine, monkeypatch, reqs, fails=lambda prompts, call, _: call == 1)
    calls = [len(p) for p in tried]
    assert engine.stats()["oom_retries"] == 1 and calls[0] == 4 and max(calls[1:]) < 4


def test_prefill_that_keeps_failing_at_a_size_is_not_retried_at_it(tiny, monkeypatch):
    """Memory that fits 50 padded prefill tokens, not more: after the first OOM the budget never regrows to
    a size that failed (before, each success doubled it back into the same OOM)."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=8))
    reqs = requests([12] * 24, [3] * 24, seed=5)
    padded_of = lambda prompts: max(map(len, prompts)) * len(prompts)  # noqa: E731
    tried, _, _ = run_with_failing_prefill(engine, monkeypatch, reqs,
                                           fails=lambda prompts, call, _: padded_of(prompts) > 50)
    padded = [padded_of(p) for p in tried]
    assert engine.stats()["oom_retries"] == 1 and padded[0] == 96 and max(padded[1:]) <= 48


def test_a_long_prompt_out_of_memory_in_chunks_retries_in_smaller_chunks(tiny, monkeypatch):
    """A lone prompt past the prefill budget whose chunks run out of memory is retried in chunks half as long
    (its scratch stays, the chunks' activations shrink) and gives the same tokens; one that fails at every chunk
    size down to MIN_CHUNK_TOKENS becomes an error row naming that size, and the prompts after it still run."""
    from pipeline.actors.engine import llm_engine

    monkeypatch.setattr(llm_engine, "MIN_CHUNK_TOKENS", 8)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_prefill_tokens=64))
    reqs = requests([150], [6], seed=3)
    _, chunks, _ = run_with_failing_prefill(engine, monkeypatch, reqs, fails=lambda p, call, chunk: chunk > 16)
    assert chunks == [64, 32, 16] and engine.stats()["oom_retries"] == 2

    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_prefill_tokens=64))
    reqs = requests([150, 20], [6, 6], seed=4)
    _, chunks, out = run_with_failing_prefill(engine, monkeypatch, reqs, same_tokens=False,
                                              fails=lambda p, call, chunk: len(p[0]) == 150)
    assert chunks[:4] == [64, 32, 16, 8] and "in chunks of 8 tokens" in out[0].error
    assert out[1].error is None and len(out[1].token_ids) == 6


def test_decode_ahead_drops_the_extra_token_of_rows_that_stop(tiny, monkeypatch):
    """Greedy steps run one ahead of the host (decode_next from the device's tokens). Rows that hit EOS
    mid-batch run one step too many: that token is dropped, the other rows and the requests admitted after
    them are unchanged, and every completion is its EOS-free run cut at its first EOS."""
    reqs = requests([9, 31, 14, 22, 5, 40], [25, 18, 30, 12, 28, 20], seed=11)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=3))
    base = [c.token_ids for c in engine.generate(reqs)]
    eos = next(t for t in base[2][3:] if t in base[0][2:] and t not in base[1])  # stops rows 0 and 2 early
    ahead = {"calls": 0}
    decode_next = engine.runner.decode_next

    def counted(tokens):
        ahead["calls"] += 1
        runner, n = engine.runner, tokens.shape[0]
        positions, lengths = runner.positions[:n, 0].clone(), runner.seq_lens[:n].clone()
        logits = decode_next(tokens)  # the same rows, one position on, fed the tokens it was given
        assert torch.equal(runner.positions[:n, 0], positions + 1) and torch.equal(runner.seq_lens[:n], lengths + 1)
        assert torch.equal(runner.input_ids[:n, 0], tokens)
        return logits

    monkeypatch.setattr(engine.runner, "decode_next", counted)
    engine.eos_ids = {eos}
    engine.reset_stats()
    out = engine.generate(reqs)
    for tokens, comp in zip(base, out, strict=True):
        expected = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert comp.token_ids == expected
        assert comp.finish_reason == ("stop" if eos in tokens else "length")
    steps = engine.stats()["decode_steps"]
    assert ahead["calls"] > steps // 2  # most steps were launched ahead of the host
    synchronous = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=3, decode_ahead=False))
    synchronous.eos_ids = {eos}
    assert [c.token_ids for c in synchronous.generate(reqs)] == [c.token_ids for c in out]
    assert engine.blocks.pages_in_use == 0 and len(engine.blocks.free_slots) == engine.plan.num_slots


def test_decode_steps_take_the_longest_rows_first(tiny, monkeypatch):
    """Rows that arrive out of length order (a later submission with a longer prompt than the running rows hold)
    reach the runner longest first (scheduler.LONGEST_FIRST: the kernels' last wave then gets the short rows), in
    arrival order with it off, and the tokens are the same either way."""
    from pipeline.actors.engine import scheduler

    def run(longest_first: bool) -> tuple[list[list[int]], list[list[int]]]:
        monkeypatch.setattr(scheduler, "LONGEST_FIRST", longest_first)
        engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
        early = engine.add(requests([5, 9, 7], [6, 30, 25], seed=4))  # builds the runner
        decode, orders = engine.runner.decode, []

        def recording(tokens, positions, slots):
            orders.append(list(positions))
            return decode(tokens, positions, slots)

        monkeypatch.setattr(engine.runner, "decode", recording)
        engine.step()  # prefill of the three
        engine.step()  # decode steps until the 6-token row ends
        late = engine.add(requests([40, 33], [12, 10], seed=5))  # longer than the running rows
        while early.pending or late.pending:
            engine.step()
        return orders, [c.token_ids for c in early.results + late.results]

    sorted_orders, sorted_tokens = run(True)
    arrival_orders, arrival_tokens = run(False)
    assert all(o == sorted(o, reverse=True) for o in sorted_orders), sorted_orders
    assert any(o != sorted(o, reverse=True) for o in arrival_orders), arrival_orders  # the rows did arrive unsorted
    assert max(len(o) for o in sorted_orders) >= 3 and sorted_tokens == arrival_tokens


def test_a_decode_run_cut_short_still_counts_its_steps(tiny, monkeypatch):
    """An exception in the middle of a run of decode steps (a benchmark's time limit, a fault) leaves the steps
    that ran, and the batch width, in the stats (before, they were added only when the run ended)."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=3))
    reqs = requests([9, 31, 14], [25, 18, 30], seed=3)
    engine.generate(reqs[:1])  # builds the runner
    decode_next, calls = engine.runner.decode_next, []

    class Stop(Exception):
        pass

    def limited(tokens):
        calls.append(tokens.shape[0])
        if len(calls) > 5:
            raise Stop
        return decode_next(tokens)

    monkeypatch.setattr(engine.runner, "decode_next", limited)
    engine.reset_stats()
    with pytest.raises(Stop):
        engine.generate(reqs)
    stats = engine.stats()
    assert stats["decode_steps"] == 5 and stats["max_in_flight"] == 3 and stats["decode_s"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs, pinned copies, async steps")
@pytest.mark.parametrize("cache_kind", ["kivi", "bf16"])
def test_decode_ahead_on_a_gpu_matches_synchronous_steps(cache_kind):
    """On a GPU the ahead steps really overlap the host (non-blocking copies, graph replays fed from the
    device): the tokens must equal synchronous steps' for every request, greedy and sampled, EOS mid-batch
    included."""
    model = gpu_llama(torch.bfloat16, kv_heads=4, seed=7)
    cache = kivi.KiviConfig(backend="triton") if cache_kind == "kivi" else None
    reqs = requests([150, 400, 33, 260, 90, 520, 70, 310], [60, 25, 80, 40, 70, 30, 90, 50], seed=2)
    for i in (1, 4, 6):  # some rows sampled (seeded): their steps run ahead too
        reqs[i] = Request(reqs[i].request_id, reqs[i].prompt_token_ids,
                          SamplingParams(max_new_tokens=reqs[i].sampling.max_new_tokens, temperature=0.8, seed=i))
    outs = {}
    for ahead in (False, True):
        engine = LLMEngine(model, StubTokenizer(), EngineConfig(kivi=cache, max_batch_size=4, decode_ahead=ahead,
                                                               memory_limit_gib=4.0))
        base = [c.token_ids for c in engine.generate(reqs)]
        engine.eos_ids = {base[0][20]}
        outs[ahead] = (base, [(c.token_ids, c.finish_reason) for c in engine.generate(reqs)])
    assert outs[True] == outs[False]
    assert any(reason == "stop" for _, reason in outs[True][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: compiled kernels, CUDA graphs")
def test_warm_up_prefill_on_a_gpu_keeps_the_tokens():
    """On a GPU the warm-up is on by default: the same tokens as without it, for both caches (bf16 weights and
    the Triton kernels: deterministic, so exactly equal)."""
    model = gpu_llama(torch.bfloat16, kv_heads=2, seed=5)
    reqs = requests([150, 400, 33, 260, 90], [60, 25, 80, 40, 70], seed=6)
    for cache in (kivi.KiviConfig(backend="triton"), None):
        outs = [[c.token_ids for c in LLMEngine(model, StubTokenizer(), EngineConfig(
            kivi=cache, max_batch_size=3, memory_limit_gib=4.0, warm_prefill=on)).generate(reqs)]
            for on in (False, None)]
        assert outs[1] == outs[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fused layers run on CUDA only")
def test_fused_projections_on_a_gpu_keep_the_tokens():
    """EngineConfig.fused_projections (one matmul for q/k/v and for gate/up, captured in the CUDA graphs): an
    fp32 model gives the same greedy tokens as with separate products (fp32 rounding differences only; the
    full-precision cache, since a 2-bit cache turns such differences into different codes at group edges)."""
    reqs = requests([150, 300, 40, 220], [40, 25, 60, 30], seed=4)
    outs = []
    for fused in (False, True):
        tokens, engine = gpu_fp32_tokens(reqs, max_batch_size=4, fused_projections=fused)
        outs.append(tokens)
        q_proj = engine.model.model.layers[0].self_attn.q_proj
        assert hasattr(q_proj, "_kivi_fused") == fused  # one product, or three
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs, block tables grown between runs")
def test_page_growth_on_a_gpu_preempts_and_keeps_the_tokens(monkeypatch):
    """EngineConfig.page_growth under CUDA graphs and steps launched ahead, in a cache of too few pages for every
    row's whole length: rows are preempted and resumed, and an fp32 model over the full-precision cache gives the
    greedy tokens of the run that reserves whole lengths (a resumed row's prefill stores what its decode steps
    stored, up to fp32 rounding). Over the 2-bit cache every row still ends at its length, and no page leaks."""
    from pipeline.actors.engine import build, scheduler
    from pipeline.actors.engine.memory import CachePlan

    # prompts a little under a 128-token page, new tokens that cross into the next: each row needs a page more than
    # it was admitted with (KIVI's ring of 128 holds the first page's worth), and the cache holds 2 more than one row
    # (rows grow where they may stop early: here a stop string the stub tokenizer never writes; INITIAL_SHARE 0:
    # admitted by their prefill's pages alone until a row has finished)
    reqs = requests(torch.randint(90, 112, (5,)).tolist(), torch.randint(50, 80, (5,)).tolist(),
                    seed=int(torch.randint(0, 1000, ())), stop=("@",))
    monkeypatch.setattr(scheduler, "INITIAL_SHARE", 0.0)
    expected, _ = gpu_fp32_tokens(reqs, max_batch_size=4)
    plan_for = build.plan_for

    def few_pages(model, storage, config, *args, **kwargs):
        plan = plan_for(model, storage, config, *args, **kwargs)  # the real plan's workspace, for the graphs
        most = max(storage.pages_for(len(r.prompt_token_ids) + r.sampling.max_new_tokens) for r in reqs)
        return CachePlan(num_slots=4, num_pages=most + 2, budget_bytes=plan.budget_bytes,
                         workspace_bytes=plan.workspace_bytes)

    monkeypatch.setattr(build, "plan_for", few_pages)
    tokens, engine = gpu_fp32_tokens(reqs, max_batch_size=4, page_growth=True)
    assert engine.stats()["preemptions"] > 0 and tokens == expected
    model = gpu_llama(torch.bfloat16, kv_heads=2, seed=3)
    config = EngineConfig(kivi=kivi.KiviConfig(backend="triton"), max_batch_size=4, memory_limit_gib=4.0,
                          page_growth=True)
    engine = LLMEngine(model, StubTokenizer(), config)
    out = engine.generate(reqs)
    assert [len(c.token_ids) for c in out] == [r.sampling.max_new_tokens for r in reqs]
    assert engine.stats()["preemptions"] > 0 and sum(c.preemptions for c in out) == engine.stats()["preemptions"]
    assert engine.blocks.pages_in_use == 0 and len(engine.blocks.free_slots) == 4


def test_out_of_memory_in_decode_restarts_the_rows_and_counts_their_tokens_once(tiny, monkeypatch):
    """A decode step that runs out of memory requeues every running row from scratch, at most half as many in
    flight: the tokens are the same as without the error, and the live progress counter (generated_tokens, what
    the actor's progress lines report) counts each kept token once, not the dropped ones as well."""
    # decode_ahead off: every step is a runner.decode call
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4, decode_ahead=False))
    reqs = requests(torch.randint(10, 30, (4,)).tolist(), torch.randint(6, 12, (4,)).tolist(),
                    seed=int(torch.randint(0, 1000, ())))
    expected = [c.token_ids for c in engine.generate(reqs)]
    real_decode, calls = engine.runner.decode, []
    fail_at = int(torch.randint(2, 5, ()))

    def decode(*args, **kwargs):
        calls.append(len(args[0]))
        if len(calls) == fail_at:
            raise torch.OutOfMemoryError("simulated")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "decode", decode)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    before = engine.generated_tokens
    out = engine.generate(reqs)
    assert [c.token_ids for c in out] == expected and engine.stats()["oom_retries"] == 1
    assert engine.generated_tokens - before == sum(len(t) for t in expected)
    assert max(calls[fail_at:]) <= 2  # half the rows in flight after the error


def test_an_interrupted_prefill_gives_its_slots_back_and_the_engine_goes_on(tiny):
    """A KeyboardInterrupt (not an Exception) inside a prefill: generate() re-raises it, no slot or page stays
    taken, and the next call runs every request. A step that finds waiting rows with none running and no room
    (cache bookkeeping lost) raises instead of spinning."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=None, max_batch_size=2, page_size=16))
    reqs = requests(torch.randint(20, 40, (2,)).tolist(), [6, 6], seed=int(torch.randint(0, 1000, ())))
    expected = [c.token_ids for c in engine.generate(reqs)]
    real_prefill = engine.runner.prefill

    def interrupted(*args, **kwargs):
        engine.runner.prefill = real_prefill
        raise KeyboardInterrupt

    engine.runner.prefill = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.generate(reqs)
    assert engine.blocks.pages_in_use == 0 and len(engine.blocks.free_slots) == engine.blocks.num_slots
    assert [c.token_ids for c in engine.generate(reqs)] == expected
    engine.blocks.free_pages.clear()  # as if every page had leaked
    engine.add(reqs[:1])
    with pytest.raises(RuntimeError, match="bookkeeping"):
        engine.step()
