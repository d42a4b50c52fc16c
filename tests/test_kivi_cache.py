"""KiviCache as a drop-in transformers cache, on tiny random Llama, Mistral, Qwen2 and Qwen3 models.

The strongest check: KIVI logits equal those of a full-precision cache whose older tokens are
replaced by their quantize-dequantize round trip (a simulation built on kivi_kernels/packing.py), so
the cache implements exactly KIVI's placement of groups, residual and flushes. KIVI's distance
from full precision is then only what that round trip explains. Also the "kivi" attention function's prefill
paths: a chunk's bottom-right causal attention against a masked reference, and masked prefill kept off cuDNN.
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama import LlamaConfig
from transformers.models.mistral import MistralConfig
from transformers.models.qwen2 import Qwen2Config
from transformers.models.qwen3 import Qwen3Config

import kivi
from kivi_kernels.packing import dequantize_keys, dequantize_values, quantize_keys, quantize_values

warnings.filterwarnings("ignore", category=FutureWarning)

SMALL = dict(vocab_size=97, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=6, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None)
CONFIGS = {
    "llama-gqa3": lambda: LlamaConfig(num_key_value_heads=2, head_dim=32, **SMALL),
    "mistral-gqa2": lambda: MistralConfig(num_key_value_heads=3, head_dim=32, sliding_window=None, **SMALL),
    "qwen2-mha": lambda: Qwen2Config(num_key_value_heads=6, **{**SMALL, "hidden_size": 192}),
    "qwen3-gqa6": lambda: Qwen3Config(num_key_value_heads=1, head_dim=64, **SMALL),
}
# small R and G so a few dozen tokens cross several flushes
SMALL_KIVI = dict(group_size=16, residual_length=32, page_size=32, backend="reference")


def make_model(name: str, dtype=torch.float32, attn="kivi"):
    torch.manual_seed(zlib.crc32(name.encode()))  # fresh random weights per model, the same every run
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=attn, dtype=dtype)
    return model.eval()


class FakeQuantCache(DynamicCache):
    """Full-precision cache that shows attention KIVI's view: at decode, tokens [0, nq) quantized."""

    def __init__(self, config, kivi_config: kivi.KiviConfig):
        super().__init__(config=config)
        self.kc = kivi_config

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[2] != 1:  # prefill attends in full precision
            return keys, values
        kc, nq = self.kc, self.kc.quantized_length(keys.shape[2])
        k_hat = dequantize_keys(*quantize_keys(keys[:, :, :nq], kc.k_bits, kc.group_size), kc.k_bits, kc.group_size)
        v_hat = dequantize_values(*quantize_values(values[:, :, :nq], kc.v_bits, kc.group_size),
                                  kc.v_bits, kc.group_size)
        return (torch.cat([k_hat.to(keys.dtype), keys[:, :, nq:]], 2),
                torch.cat([v_hat.to(values.dtype), values[:, :, nq:]], 2))


def cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def teacher_forced_logits(model, cache, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ids[:, :prompt_len], then feed the rest one token at a time: logits [B, steps, V]."""
    kw = {cache_kwarg(model): cache, "use_cache": True}
    out = [model(input_ids=ids[:, :prompt_len], **kw).logits[:, -1]]
    for t in range(prompt_len, ids.shape[1]):
        out.append(model(input_ids=ids[:, t : t + 1], **kw).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bits", [(2, 2), (4, 2)], ids=["k2v2", "k4v2"])
def test_logits_match_quantization_simulation(name, bits):
    model = make_model(name)
    kc = kivi.KiviConfig(k_bits=bits[0], v_bits=bits[1], **SMALL_KIVI)
    ids = torch.randint(0, 97, (2, 90))
    with torch.no_grad():
        got = teacher_forced_logits(model, kivi.KiviCache(model.config, kc), ids, prompt_len=45)
        sim = teacher_forced_logits(model, FakeQuantCache(model.config, kc), ids, prompt_len=45)
        full = teacher_forced_logits(model, DynamicCache(config=model.config), ids, prompt_len=45)
    sim_err = (got - sim).abs().max().item()
    quant_err = (full - sim).abs().max().item()
    print(f"{name} k{bits[0]}v{bits[1]}: |kivi - simulation| {sim_err:.2e}, |full - simulation| {quant_err:.2e}")
    assert sim_err < 1e-4  # fp32 rounding only
    assert quant_err > 100 * sim_err  # quantization really happened and is what separates us from full precision


@pytest.mark.parametrize("name", ["llama-gqa3", "qwen3-gqa6"])
def test_short_prompts_equal_full_precision_generate(name):
    """Below R nothing is quantized: greedy and seeded sampling equal the default cache exactly."""
    model = make_model(name)
    ids = torch.randint(1, 97, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    for sample in (False, True):
        outs = []
        for cache in (kivi.KiviCache(model.config, kivi.KiviConfig(backend="reference")),
                      DynamicCache(config=model.config)):
            torch.manual_seed(7)
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=sample,
                                       top_k=20, pad_token_id=0, **{cache_kwarg(model): cache}))
        assert torch.equal(outs[0], outs[1])


def test_left_padding_never_enters_a_group():
    """A row of a left-padded batch gives the same logits as the same sequence alone."""
    model = make_model("llama-gqa3")
    kc = kivi.KiviConfig(**SMALL_KIVI)
    lengths = [70, 53, 38]
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, width - len(s):] = s
        mask[row, width - len(s):] = 1
    kw = dict(max_new_tokens=25, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cache = kivi.KiviCache(model.config, kc)
        batched = model.generate(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache}, **kw)
        assert cache.lengths == [n + 24 for n in lengths]
        for row, s in enumerate(seqs):
            alone = model.generate(input_ids=s[None], **{cache_kwarg(model): kivi.KiviCache(model.config, kc)}, **kw)
            diff = max((a[row] - b[0]).abs().max().item() for a, b in zip(batched.logits, alone.logits, strict=True))
            assert diff < 1e-4, f"row {row}: logits differ by {diff}"


def test_masked_prefill_runs_with_cudnn_attention_off(monkeypatch):
    """A left-padded batch's prefill hands SDPA a mask, which PyTorch sends to cuDNN attention on an H200, where
    each new shape builds a plan (kivi.attention): every masked call runs with cuDNN attention off, unmasked
    calls keep PyTorch's choice, and the switch is back on afterwards."""
    model = make_model("llama-gqa3")
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    width = int(torch.randint(40, 90, (), generator=g))
    ids = torch.randint(1, 97, (2, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, : int(torch.randint(1, width - 10, (), generator=g))] = 0
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): kivi.KiviCache(
            model.config, kivi.KiviConfig(**SMALL_KIVI))}, **kw)
        model.generate(input_ids=ids[:1], **{cache_kwarg(model): kivi.KiviCache(
            model.config, kivi.KiviConfig(**SMALL_KIVI))}, **kw)
    assert sorted(set(calls)) == [(False, True), (True, False)]
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (9, 3, 64)])
def test_chunk_attention_matches_a_masked_reference(heads):
    """A chunk's queries (the prefix's last T positions) against its whole prefix: the bottom-right causal
    attention equals SDPA with the mask written out and the keys repeated per query head; bad shapes are
    refused."""
    from kivi.attention import chunk_attention
    from tests.model_cases import DEVICE

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    hq, h, d = heads
    t = int(torch.randint(1, 40, (), generator=g))
    s = t + int(torch.randint(0, 90, (), generator=g))
    dtype, tol = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)
    q, k, v = (torch.randn(1, n, m, d, generator=g).to(DEVICE, dtype) for n, m in ((hq, t), (h, s), (h, s)))
    mask = torch.ones(t, s, dtype=torch.bool, device=DEVICE).tril(s - t)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(hq // h, 1), v.float().repeat_interleave(hq // h, 1),
        attn_mask=mask, scale=0.125).transpose(1, 2)
    got = chunk_attention(q, k, v, 0.125)
    assert got.shape == (1, t, hq, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="keys cover its queries"):
        chunk_attention(q, k[:, :, : t - 1], v[:, :, : t - 1], 0.125)


def test_reset_cache_serves_a_new_generate_call():
    model = make_model("llama-gqa3")
    cache = kivi.KiviCache(model.config, kivi.KiviConfig(**SMALL_KIVI))
    ids = torch.randint(1, 97, (2, 40))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    first = model.generate(input_ids=ids, **{cache_kwarg(model): cache}, **kw)
    more = torch.cat([first, torch.randint(1, 97, (2, 3))], 1)  # a second turn of several new tokens
    with pytest.raises(NotImplementedError, match="new cache"):
        model.generate(input_ids=more, attention_mask=torch.ones_like(more), max_new_tokens=2,
                       **{cache_kwarg(model): cache})
    cache.reset()
    assert cache.nbytes() == 0 and cache.lengths == []
    again = model.generate(input_ids=ids, **{cache_kwarg(model): cache}, **kw)
    assert torch.equal(first, again)


def test_triton_backend_matches_reference_in_model():
    """The whole model on the Triton kernels (interpreter on a CPU) against the reference kernels."""
    model = make_model("llama-gqa3")
    ids = torch.randint(0, 97, (2, 48))
    logits = []
    for backend in ("triton", "reference"):
        kc = kivi.KiviConfig(**{**SMALL_KIVI, "backend": backend})
        with torch.no_grad():
            logits.append(teacher_forced_logits(model, kivi.KiviCache(model.config, kc), ids, prompt_len=30))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


def test_cache_is_under_22_percent_of_bf16_at_4096_tokens():
    model = make_model("llama-gqa3", dtype=torch.bfloat16)
    cache = kivi.KiviCache(model.config, kivi.KiviConfig(backend="reference"))
    ids = torch.randint(0, 97, (1, 4095))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        model(input_ids=ids[:, :1], use_cache=True, **{cache_kwarg(model): cache})  # one decode step: 4096
    assert cache.lengths == [4096]
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.tensors.values())
    assert held == cache.nbytes()
    ratio = cache.nbytes() / cache.nbytes_bf16()
    print(f"4096 tokens: {cache.nbytes()} bytes, {ratio:.3f} of bf16")
    assert ratio <= 0.22
    layer = cache.layers[0].tensors
    assert layer["k_codes"].dtype == torch.int32 and layer["k_codes"].shape[0] == 31  # 3968 tokens / 128


@pytest.mark.parametrize("bad", [dict(k_bits=3), dict(v_bits=8), dict(group_size=24), dict(group_size=48),
                                 dict(residual_length=100),
                                 dict(page_size=48), dict(backend="cuda"), dict(scale_dtype="bfloat16")])
def test_config_rejects_bad_values(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        kivi.KiviConfig(**bad)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", ["float16", "model"])
def test_scales_are_stored_in_the_configured_dtype(model_dtype, scale_dtype):
    """16-bit models keep scales and zero points in fp16 by default ("model": their own dtype); fp32 models in
    fp32 either way. The ring stays in the model's dtype, and the byte count follows the tensors."""
    from kivi.storage import QuantizedStorage

    cfg = kivi.KiviConfig(scale_dtype=scale_dtype)
    storage = QuantizedStorage(cfg, ops=None)
    pages = storage.allocate_pages(3, 2, 64, model_dtype, "cpu")
    want = torch.float16 if scale_dtype == "float16" and model_dtype != torch.float32 else model_dtype
    assert {pages[n].dtype for n in ("k_scale", "k_zero", "v_scale", "v_zero")} == {want}
    assert storage.allocate_slots(1, 2, 64, model_dtype, "cpu")["k_res"].dtype == model_dtype
    assert storage.page_bytes(2, 64, model_dtype) * 3 == sum(t.numel() * t.element_size() for t in pages.values())
    # per head: key and value codes (2 bits each), four scale/zero tensors of p * 64 / g elements
    p, g, item = cfg.page_size, cfg.group_size, want.itemsize
    assert storage.page_bytes(2, 64, model_dtype) == 2 * (2 * p * 64 * 2 // 8 + 4 * (p * 64 // g) * item)


def test_unsupported_models_raise_naming_the_type():
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(ValueError, match="gpt2"):
        kivi.KiviCache(GPT2Config(n_layer=1))
    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        kivi.KiviCache(sliding)
    with pytest.raises(ValueError, match="mistral.*sliding_window=4096"):
        kivi.KiviCache(MistralConfig(num_hidden_layers=2, sliding_window=4096))


def test_head_dim_must_split_into_groups():
    model = make_model("llama-gqa3")
    cache = kivi.KiviCache(model.config, kivi.KiviConfig(group_size=64, residual_length=64, page_size=64,
                                                         backend="reference"))
    with pytest.raises(ValueError, match="head_dim=32"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True, **{cache_kwarg(model): cache})
