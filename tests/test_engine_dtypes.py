"""A cache of another dtype than the model's (EngineConfig.cache_dtype): a float32 model over a bf16 cache, what
`--dtype auto` runs on a CPU without bf16 arithmetic (float32 matmuls, a bf16 run's cache bytes)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import kivi
import kivi_kernels
from kivi.storage import BatchMeta, QuantizedStorage
from pipeline.actors.engine import EngineConfig, LLMEngine
from tests.engine_cases import SMALL_KIVI, StubTokenizer, hf_greedy, requests


def test_float32_model_over_a_bf16_kivi_cache_matches_generate(tiny, monkeypatch):
    """Every completion equals generate() with a KiviCache kept in bf16 (keys and values rounded as they are
    stored), the pools are bf16 (ring) and fp16 (scales) while a chunked prompt's scratch stays float32, and the
    bytes counted are a bf16 model's."""
    assert next(tiny.parameters()).dtype == torch.float32
    from pipeline.actors.engine.kv_cache import EngineCache

    scratch_dtypes, set_chunk = [], EngineCache.set_chunk

    def spy(self, *args):
        set_chunk(self, *args)
        scratch_dtypes.append(self.scratch[0][0].dtype)

    monkeypatch.setattr(EngineCache, "set_chunk", spy)
    reqs = requests([5, 40, 17, 61, 26], [30, 12, 45, 8, 20], seed=4)
    config = EngineConfig(kivi=SMALL_KIVI, max_batch_size=3, cache_dtype="bfloat16", max_prefill_tokens=48)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    out = engine.generate(reqs)
    decided = 0
    for req, comp in zip(reqs, out, strict=True):
        cache = kivi.KiviCache(tiny.config, SMALL_KIVI, dtype=torch.bfloat16)
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, req.sampling.max_new_tokens, cache)
        assert comp.token_ids[: clear + 1] == expected[: clear + 1], f"{req.request_id} differs"
        assert cache.layers[0].tensors["k_res"].dtype == torch.bfloat16
        decided += clear
    assert decided > 0.8 * sum(r.sampling.max_new_tokens for r in reqs)
    pools = engine.cache.layers[0].tensors
    assert pools["k_res"].dtype == pools["v_res"].dtype == torch.bfloat16
    assert pools["k_scale"].dtype == pools["v_zero"].dtype == torch.float16
    assert scratch_dtypes and set(scratch_dtypes) == {torch.float32}  # the 61-token prompt went through in chunks
    bf16 = LLMEngine(copy.deepcopy(tiny).to(torch.bfloat16), StubTokenizer(),
                     EngineConfig(kivi=SMALL_KIVI, max_batch_size=3))
    bf16.generate(reqs)
    assert engine.stats()["kv_cache_bytes"] == bf16.stats()["kv_cache_bytes"] > 0
    assert engine.plan.num_slots == bf16.plan.num_slots and engine.plan.num_pages == bf16.plan.num_pages


def test_float32_model_over_a_bf16_plain_cache(tiny):
    """The full-precision baseline keeps bf16 pages under a float32 model: its tokens follow generate() with the
    model's own cache as long as the logits' margin is wider than bf16's rounding of the keys, and it holds half
    the bytes of a float32 cache."""
    reqs = requests([9, 33, 20], [16, 16, 16], seed=5)
    engines = {dtype: LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=None, page_size=16, cache_dtype=dtype))
               for dtype in ("bfloat16", None)}
    outs = {dtype: engine.generate(reqs) for dtype, engine in engines.items()}
    assert engines["bfloat16"].cache.layers[0].tensors["k_pages"].dtype == torch.bfloat16
    assert engines[None].cache.layers[0].tensors["k_pages"].dtype == torch.float32
    same = 0
    for req, comp in zip(reqs, outs["bfloat16"], strict=True):
        expected, clear = hf_greedy(tiny, req.prompt_token_ids, 16, DynamicCache(config=tiny.config))
        if clear:  # the first token comes from the prefill, which attends to the model's own float32 keys
            assert comp.token_ids[0] == expected[0], req.request_id
        same += comp.token_ids[:4] == expected[:4]
    assert same >= 2
    assert 2 * engines["bfloat16"].stats()["kv_cache_bytes"] == engines[None].stats()["kv_cache_bytes"] > 0
    # what the per-shard stats report as the dtypes that made the rows
    assert [(e.stats()["model_dtype"], e.stats()["cache_dtype"]) for e in engines.values()] == [
        ("float32", "bfloat16"), ("float32", "float32")]


def test_storage_rounds_to_the_ring_dtype_before_it_quantizes():
    """Storing float32 keys into a bf16 cache stores exactly what storing their bf16 rounding does (packed groups
    and ring), and decode attention with a float32 query over it returns float32."""
    storage = QuantizedStorage(SMALL_KIVI, kivi_kernels.get_ops("reference"))
    gen = torch.Generator().manual_seed(11)
    key, value = (torch.randn(2, 2, 70, 32, generator=gen) for _ in range(2))
    meta = BatchMeta(slots=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([70, 51], dtype=torch.int32),
                     block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))
    stored = []
    for k, v in ((key, value), (key.bfloat16(), value.bfloat16())):
        t = storage.allocate_pages(6, 2, 32, torch.bfloat16, "cpu")
        t.update(storage.allocate_slots(2, 2, 32, torch.bfloat16, "cpu"))
        storage.store_prefill(t, k, v, torch.zeros(2, dtype=torch.int32), meta.seq_lens, meta)
        stored.append(t)
    for name, tensor in stored[0].items():
        assert torch.equal(tensor, stored[1][name]), name
    q = torch.randn(2, 4, 32, generator=gen)
    out = storage.decode_attention(stored[0], q, meta, 32**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, storage.decode_attention(stored[0], q.bfloat16(), meta, 32**-0.5).float(),
                               atol=3e-2, rtol=3e-2)


def test_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="cache_dtype"):
        EngineConfig(cache_dtype="int8")
    assert EngineConfig().torch_cache_dtype(torch.float32) == torch.float32
    assert EngineConfig(cache_dtype="bfloat16").torch_cache_dtype(torch.float32) == torch.bfloat16
