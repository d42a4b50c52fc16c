"""The generation engine: continuous batching against transformers' own generate (CPU), prefill paths, requests
and stops. Decode runs, out-of-memory recovery and the GPU paths are in test_engine_decode.py; page growth and
preemption in test_engine_growth.py; the engine's parts alone in test_engine_parts.py and test_engine_memory.py;
shared pieces in engine_cases.py."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams
from tests.engine_cases import SMALL_KIVI, StubTokenizer, hf_greedy, requests


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
    """Prompts longer than the prefill budget go through in chunks and give generate()'s tokens; a prompt's
    full-precision scratch holds its own length, and transformers builds no mask tensor for a chunk (its attention
    applies the causal mask over the prefix itself)."""
    from transformers import AttentionInterface

    from pipeline.actors.engine.kv_cache import EngineCache

    chunks, set_chunk = [], EngineCache.set_chunk

    def spy_chunk(self, *args):
        set_chunk(self, *args)
        chunks.append((*args[1:3], self.scratch[0][0].shape[2]))  # (start, end, scratch positions)

    monkeypatch.setattr(EngineCache, "set_chunk", spy_chunk)
    attend, chunk_masks = AttentionInterface._global_mapping["kivi"], []

    def spy(module, query, key, value, attention_mask, **kwargs):
        if getattr(key, "kivi_step", (None, None))[1] == "chunk":
            chunk_masks.append(attention_mask)
        return attend(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "kivi", spy)
    reqs = requests([75, 41], [20, 20], seed=9)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI if cache_kind == "kivi" else None,
                                                           max_prefill_tokens=16, page_size=16))
    for req, comp in zip(reqs, engine.generate(reqs), strict=True):
        cache = kivi.KiviCache(tiny.config, SMALL_KIVI) if cache_kind == "kivi" else DynamicCache(config=tiny.config)
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, 20, cache)
        assert clear > 5 and comp.token_ids[: clear + 1] == expected[: clear + 1]
    # the chunked path really ran, each prompt's scratch sized to the prompt
    assert chunks == [(0, 16, 75), (16, 32, 75), (32, 48, 75), (48, 64, 75), (64, 75, 75),
                      (0, 16, 41), (16, 32, 41), (32, 41, 41)]
    assert chunk_masks and all(m is None for m in chunk_masks)  # no [T, S] mask built for a chunk
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
           Request("float", [5.0, 6.5]), Request("long", [5] * engine.max_model_len)]
    expected = [c.token_ids for c in LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI)).generate(good)]
    out = engine.generate([good[0], *bad, good[1]])
    assert [c.finish_reason for c in out] == ["length", "error", "error", "error", "error", "error", "length"]
    assert "-1" in out[1].error and str(tiny.config.vocab_size) in out[2].error and "list" in out[3].error
    assert f"leaves no room to generate within max_model_len={engine.max_model_len}" in out[5].error
    assert [out[0].token_ids, out[-1].token_ids] == expected
    runner_prefill = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(good)
    assert not engine.active and not engine.has_work()
    monkeypatch.setattr(engine.runner, "prefill", runner_prefill)
    assert [c.token_ids for c in engine.generate(good)] == expected


def test_prompt_ids_as_arrays_run_as_their_lists(tiny):
    """A 1-D NumPy array or torch tensor of integer ids runs as its list; float arrays and 2-D ones are error rows."""
    import numpy as np

    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI))
    ids = requests([int(torch.randint(5, 20, ()))], [4], seed=int(torch.randint(0, 1000, ())))[0].prompt_token_ids
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    arrays = [Request("list", ids, greedy), Request("numpy", np.array(ids, dtype=np.int32), greedy),
              Request("torch", torch.tensor(ids), greedy), Request("float", np.array(ids, dtype=np.float32), greedy),
              Request("2d", np.array([ids]), greedy)]
    out = engine.generate(arrays)
    assert [c.finish_reason for c in out] == ["length"] * 3 + ["error"] * 2
    assert out[1].token_ids == out[2].token_ids == out[0].token_ids and len(out[0].token_ids) == 4
    assert "ndarray" in out[3].error and "ndarray" in out[4].error


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the Triton kernels on a CPU model under the "
                    "interpreter; on a GPU test_engine_decode.py's GPU tests run them compiled (not counted)")
def test_engine_opens_the_fused_layers_around_its_forwards(tiny, monkeypatch):
    """The engine's forwards run inside FusedLayers (on a GPU by default; forced here with the Triton kernels
    under the interpreter): the kernels are called in prefill and decode, completions still equal generate()
    with the same cache, and the model is unpatched again between and after calls."""
    import kivi_kernels
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

    ops = CountingOps(kivi_kernels.get_ops("triton"))
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
