"""The generation engine: continuous batching against transformers' own generate (CPU), and its GPU paths
(decode ahead, fused projections). The engine's parts alone are in test_engine_parts.py; shared pieces in
engine_cases.py."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams
from tests.engine_cases import SMALL_KIVI, StubTokenizer, gpu_fp32_tokens, gpu_llama, hf_greedy, requests


@pytest.mark.parametrize("cache_kind", ["kivi", "bf16"])
def test_continuous_batching_matches_generate(tiny, cache_kind):
    """More requests than slots, ragged lengths: every completion equals generate() run alone with the
    same cache semantics (KiviCache for KIVI, the default cache for the full-precision engine)."""
    reqs = requests([5, 40, 17, 33, 61, 9, 26], [30, 12, 45, 20, 8, 50, 3])
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI if cache_kind == "kivi" else None,
                                                           max_batch_size=3, page_size=16))
    out = engine.generate(reqs)
    assert [c.request_id for c in out] == [r.request_id for r in reqs]
    decided = 0
    for req, comp in zip(reqs, out, strict=True):
        cache = kivi.KiviCache(tiny.config, SMALL_KIVI) if cache_kind == "kivi" else DynamicCache(config=tiny.config)
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens, cache)
        assert len(comp.token_ids) == len(expected)
        assert comp.token_ids[: clear + 1] == expected[: clear + 1], f"{req.request_id} differs"
        decided += clear
        assert comp.finish_reason == "length" and comp.num_input_tokens == len(req.prompt_token_ids)
        assert comp.ttft_s is not None and comp.ttft_s >= 0
    assert decided > 0.8 * sum(r.sampling.max_new_tokens for r in reqs)  # near-ties are rare
    stats = engine.stats()
    assert stats["max_in_flight"] == 3 and stats["decode_steps"] > 0
    assert stats["prefill_tokens"] == sum(len(r.prompt_token_ids) for r in reqs) and stats["prefill_s"] > 0
    assert stats["build_s"] > 0  # the cache plan and allocation, done in the first generate call
    assert 0 < stats["kv_cache_bytes"] and 0 < stats["kv_cache_bytes_bf16"]
    assert engine.blocks.pages_in_use == 0 and len(engine.blocks.free_slots) == engine.plan.num_slots


@pytest.mark.parametrize("cache_kind", ["kivi", "bf16"])
def test_chunked_prefill_matches_generate(tiny, cache_kind, monkeypatch):
    """Prompts longer than the prefill budget go through in chunks and give generate()'s tokens."""
    from pipeline.actors.engine.kv_cache import EngineCache

    chunks, set_chunk = [], EngineCache.set_chunk
    monkeypatch.setattr(EngineCache, "set_chunk", lambda self, *a: chunks.append(a[1:3]) or set_chunk(self, *a))
    reqs = requests([75, 41], [20, 20], seed=9)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI if cache_kind == "kivi" else None,
                                                           max_prefill_tokens=16, page_size=16))
    for req, comp in zip(reqs, engine.generate(reqs), strict=True):
        cache = kivi.KiviCache(tiny.config, SMALL_KIVI) if cache_kind == "kivi" else DynamicCache(config=tiny.config)
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, 20, cache)
        assert clear > 5 and comp.token_ids[: clear + 1] == expected[: clear + 1]
    assert chunks[:5] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 75)]  # the chunked path really ran
    assert not engine.cache.scratch  # and gave its scratch back


def test_prefill_batches_group_prompts_of_similar_length(tiny, monkeypatch):
    """Prefill batches are padded to their longest prompt: long and short prompts arriving interleaved must not
    share batches (no row is padded past twice its length, and the total waste is at most the spread of each
    group's lengths per row)."""
    from pipeline.actors.engine.model_runner import ModelRunner

    padded, widths_seen = [], []
    real = ModelRunner.prefill

    def spy(self, prompts, slots, chunk_tokens=None):
        widths = [len(p) for p in prompts]
        assert 2 * min(widths) >= max(widths), widths  # no row padded past twice its length
        widths_seen.append(max(widths))
        padded.append(max(widths) * len(prompts))
        return real(self, prompts, slots, chunk_tokens)

    monkeypatch.setattr(ModelRunner, "prefill", spy)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    long = torch.randint(100, 121, (6,), generator=gen).tolist()
    short = torch.randint(3, 11, (18,), generator=gen).tolist()
    lengths = [n for i in range(6) for n in (long[i], *short[3 * i : 3 * i + 3])]  # long, short, short, short, ...
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=8, max_prefill_tokens=256))
    out = engine.generate(requests(lengths, [2] * len(lengths)))
    assert all(len(c.token_ids) == 2 for c in out)
    assert sum(padded) <= sum(lengths) + 20 * len(long) + 7 * len(short), (padded, lengths)
    assert widths_seen == sorted(widths_seen, reverse=True)  # longest prompts first


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    prompt = list(range(10, 30))
    alone = engine.generate([Request("a", prompt, params)])[0].token_ids
    crowd = requests([15, 40, 22], [25, 25, 25], seed=5)
    mixed = engine.generate(crowd[:2] + [Request("a", prompt, params)] + crowd[2:])[2].token_ids
    other_seed = engine.generate([Request("a", prompt, SamplingParams(**{**params.__dict__, "seed": 99}))])[0]
    greedy_k1 = engine.generate([Request("g", prompt, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1))])
    assert alone == mixed
    synchronous = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4, decode_ahead=False))
    assert synchronous.generate([Request("a", prompt, params)])[0].token_ids == alone  # steps run ahead or not
    assert other_seed.token_ids != alone
    assert greedy_k1[0].token_ids == engine.generate([Request("g", prompt, SamplingParams(max_new_tokens=20))])[
        0].token_ids


def test_time_to_first_token_leaves_out_the_engine_build(tiny, monkeypatch):
    """The first call's one-time build (reported as build_s) is not counted in its rows' time to first token."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=2, page_size=16))
    slow_s, allocate = 0.5, engine._allocate

    def slow_allocate(*args, **kwargs):
        time.sleep(slow_s)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(engine, "_allocate", slow_allocate)
    t0 = time.perf_counter()
    out = engine.generate(requests([7, 19, 4], [2, 3, 2]))
    wall_s = time.perf_counter() - t0
    assert engine.stats()["build_s"] >= slow_s
    assert all(0 <= c.ttft_s < wall_s - slow_s for c in out)


@pytest.mark.parametrize("cache_kind", ["kivi", "bf16"])
def test_warm_up_prefill_leaves_no_trace(tiny, cache_kind, monkeypatch):
    """EngineConfig.warm_prefill runs dummy prompts through the prefill path in the build (so that a GPU compiles
    its kernels there): in slots and pages that real rows then reuse, uncounted, changing no token."""
    from pipeline.actors.engine.model_runner import ModelRunner

    warmed, warm = [], ModelRunner.warm_prefill
    monkeypatch.setattr(ModelRunner, "warm_prefill", lambda self, *rows: warmed.append(rows) or warm(self, *rows))
    reqs = requests([70, 12, 45, 90, 33, 64], [20, 30, 12, 25, 18, 9], seed=3)
    cache = SMALL_KIVI if cache_kind == "kivi" else None
    outs = []
    for on in (False, True):
        engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=cache, max_batch_size=2, page_size=16,
                                                               warm_prefill=on))
        outs.append([c.token_ids for c in engine.generate(reqs)])
        assert engine.stats()["prefill_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
        assert engine.blocks.pages_in_use == 0
    assert outs[1] == outs[0]
    ring, group = (SMALL_KIVI.residual_length, SMALL_KIVI.group_size) if cache else (16, 16)
    assert [rows[0] for rows in warmed] == [[], [ring + 2 * group + 3, 2 * ring]]  # off, then on: two slots' worth
    assert warmed[1][1] == [0, 1]  # the slots the first rows then take


def test_bad_requests_become_error_rows(tiny):
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_model_len=64))
    reqs = [Request("empty", []), Request("long", list(range(70))), Request("ok", list(range(1, 11)),
                                                                            SamplingParams(max_new_tokens=100))]
    out = engine.generate(reqs)
    assert [c.finish_reason for c in out] == ["error", "error", "length"]
    assert "empty" in out[0].error and "64" in out[1].error
    assert len(out[2].token_ids) == 64 - 10  # capped by the context, not by max_new_tokens


def test_malformed_prompts_are_error_rows_and_a_failed_call_leaves_the_engine_clean(tiny, monkeypatch):
    """Token ids outside the vocabulary, a text prompt, non-integer ids: error rows beside the good ones. A call that
    raises (here its prefill) leaves nothing in flight: the next call runs as on a fresh engine."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    good = requests([9, 14], [5, 3], seed=int(torch.randint(0, 1000, ())))
    bad = [Request("neg", [5, -1, 7]), Request("big", [3, tiny.config.vocab_size]), Request("text", "hello"),
           Request("float", [5.0, 6.5])]
    expected = [c.token_ids for c in LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI)).generate(good)]
    out = engine.generate([good[0], *bad, good[1]])
    assert [c.finish_reason for c in out] == ["length", "error", "error", "error", "error", "length"]
    assert "-1" in out[1].error and str(tiny.config.vocab_size) in out[2].error and "list" in out[3].error
    assert [out[0].token_ids, out[-1].token_ids] == expected
    runner_prefill = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(good)
    assert not engine.active and not engine.has_work()
    monkeypatch.setattr(engine.runner, "prefill", runner_prefill)
    assert [c.token_ids for c in engine.generate(good)] == expected


def test_stop_strings_and_eos(tiny):
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    base = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=30))])[0]
    stop = base.text[10:12]
    first = base.text.find(stop)
    cut = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=30, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[:first]
    first_char = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=30,
                                                                                   stop=(base.text[0],)))])[0]
    assert first_char.finish_reason == "stop" and first_char.text == ""
    # a stop first completed far past the tail window that is decoded each step (4 * 2 + 8 tokens)
    late = next(base.text[i:i + 2] for i in range(27, 0, -1) if base.text.find(base.text[i:i + 2]) >= 20)
    cut_late = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=30,
                                                                                 stop=(late,)))])[0]
    assert cut_late.finish_reason == "stop" and cut_late.text == base.text[:base.text.find(late)]
    engine.eos_ids = {base.token_ids[4]}
    eos = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=30))])[0]
    k = base.token_ids.index(base.token_ids[4])
    assert eos.finish_reason == "stop" and eos.token_ids == base.token_ids[:k]


def test_stop_string_check_decodes_a_tail_not_the_whole_output(tiny):
    """Checking stop strings decodes a bounded tail each step, not the whole output (quadratic in length);
    only the final text is decoded whole."""
    lengths = []

    class CountingTokenizer(StubTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    engine = LLMEngine(tiny, CountingTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    out = engine.generate([Request("x", list(range(5, 25)), SamplingParams(max_new_tokens=60, stop=("\n",)))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 60  # "\n" never decodes from the stub
    window = 4 * 1 + 8
    assert lengths[-1] == 60 and max(lengths[:-1]) <= window


def test_ignore_eos_runs_to_max_new_tokens(tiny, monkeypatch):
    """The model's own EOS (generation_config) forced to be its first greedy token: a request stops
    there at once, unless it asks for ignore_eos, which gives every token of max_new_tokens."""
    prompt = list(range(5, 25))
    base = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI)).generate(
        [Request("x", prompt, SamplingParams(max_new_tokens=30))])[0]
    monkeypatch.setattr(tiny.generation_config, "eos_token_id", base.token_ids[0])
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    assert engine.eos_ids == {base.token_ids[0]}
    stopped, ignored = engine.generate([Request("s", prompt, SamplingParams(max_new_tokens=30)),
                                        Request("i", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))])
    assert stopped.finish_reason == "stop" and stopped.token_ids == []
    assert ignored.finish_reason == "length" and ignored.token_ids == base.token_ids


def run_with_failing_prefill(engine, monkeypatch, reqs, fails) -> list:
    """Generate reqs once normally, then again with prefill raising OOM where fails(prompts, call) is true
    (call counts from 1); asserts the second run's tokens equal the first's. Returns the prompts of each
    prefill tried."""
    expected = [c.token_ids for c in engine.generate(reqs)]
    real_prefill, tried = engine.runner.prefill, []

    def prefill(prompts, slots, chunk_tokens=None):
        tried.append(prompts)
        if fails(prompts, len(tried)):
            raise torch.OutOfMemoryError("simulated")
        return real_prefill(prompts, slots, chunk_tokens)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine.reset_stats()
    out = engine.generate(reqs)
    assert [c.token_ids for c in out] == expected
    return tried


def test_out_of_memory_in_prefill_requeues_the_work(tiny, monkeypatch):
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=4))
    reqs = requests([22, 30, 17, 19], [10, 10, 10, 10])  # within 2x of each other: one prefill batch
    tried = run_with_failing_prefill(engine, monkeypatch, reqs, fails=lambda prompts, call: call == 1)
    calls = [len(p) for p in tried]
    assert engine.stats()["oom_retries"] == 1 and calls[0] == 4 and max(calls[1:]) < 4


def test_prefill_that_keeps_failing_at_a_size_is_not_retried_at_it(tiny, monkeypatch):
    """Memory that fits 50 padded prefill tokens, not more: after the first OOM the budget never regrows to
    a size that failed (before, each success doubled it back into the same OOM)."""
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=8))
    reqs = requests([12] * 24, [3] * 24, seed=5)
    padded_of = lambda prompts: max(map(len, prompts)) * len(prompts)  # noqa: E731
    tried = run_with_failing_prefill(engine, monkeypatch, reqs, fails=lambda prompts, call: padded_of(prompts) > 50)
    padded = [padded_of(p) for p in tried]
    assert engine.stats()["oom_retries"] == 1 and padded[0] == 96 and max(padded[1:]) <= 48


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the Triton kernels on a CPU model under the "
                    "interpreter; on a GPU the engine's GPU tests below run them compiled (not counted)")
def test_engine_opens_the_fused_layers_around_its_forwards(tiny, monkeypatch):
    """The engine's forwards run inside FusedLayers (on a GPU by default; forced here with the Triton kernels
    under the interpreter): the kernels are called in prefill and decode, completions still equal generate()
    with the same cache, and the model is unpatched again between and after calls."""
    import kernels
    from kivi.fused import FusedLayers
    from pipeline.actors.engine import build

    class CountingOps:
        def __init__(self, ops):
            self.ops, self.calls = ops, {"rms_norm": 0, "apply_rotary": 0}

        def __getattr__(self, name):
            fn = getattr(self.ops, name)

            def counted(*args, **kwargs):
                self.calls[name] += 1
                return fn(*args, **kwargs)

            return counted

    ops = CountingOps(kernels.get_ops("triton"))
    monkeypatch.setattr(build, "fused_layers", lambda model, config, device: FusedLayers(model, ops))
    reqs = requests([7, 30, 12], [9, 4, 12], seed=5)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=2))
    out = engine.generate(reqs)
    layers = tiny.config.num_hidden_layers
    assert ops.calls["apply_rotary"] >= layers * (engine.stats()["decode_steps"] + 2)  # 2+ prefills, each step
    assert ops.calls["rms_norm"] == ops.calls["apply_rotary"] // layers * (2 * layers + 1)
    assert all("forward" not in vars(m) for m in tiny.modules())
    for req, comp in zip(reqs, out, strict=True):
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens,
                                    kivi.KiviCache(tiny.config, SMALL_KIVI))
        assert comp.token_ids[: clear + 1] == expected[: clear + 1], f"{req.request_id} differs"


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
