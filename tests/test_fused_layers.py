"""RMSNorm and rotary kernels against their references and transformers' own ops, and the FusedLayers patch
(its SiLU-and-multiply part: test_silu_mul.py).

Kernels run under the Triton interpreter on a CPU (fp16 and fp32 only: the interpreter's bf16 arithmetic is
wrong) and compiled on a GPU (bf16 too). Launcher outputs are poisoned: torch.empty/empty_like return NaN
tensors while a kernel runs, so an element the kernel does not write fails the comparison.
"""

import pytest
import torch

from kivi_kernels.rms_norm import ops as norm_ops
from kivi_kernels.rms_norm import reference as norm_ref
from kivi_kernels.rotary import ops as rope_ops
from kivi_kernels.rotary import reference as rope_ref
from tests.compile_util import compile_for_sm90_many
from tests.model_cases import DEVICE, tiny_lm

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _hf_rms_norm(x, weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 100), (2, 4096), (1, 1, 1, 24)])
def test_rms_norm_matches_reference_and_transformers(dtype, shape, poisoned):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=g).to(DEVICE, dtype)
    eps = 1e-6
    out = norm_ops.rms_norm(x, weight, eps)
    ref = norm_ref.rms_norm(x, weight, eps)
    hf = _hf_rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == hf.dtype == ref.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(ref.float(), hf.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_rms_norm_fp32_weight_on_a_strided_half_input(poisoned):
    """A non-contiguous input (a column slice) and an fp32 weight: the output is fp32, as torch promotes."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 2, 64, generator=g).to(DEVICE, torch.float16)
    x = base[:, 1]  # strided rows
    weight = torch.rand(64, generator=g).to(DEVICE)
    out = norm_ops.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _hf_rms_norm(x, weight, 1e-5), rtol=2e-3, atol=2e-3)


def _hf_rotary(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hk,T,D", [(2, 6, 2, 7, 64), (3, 4, 4, 1, 128), (1, 3, 1, 5, 16)])
def test_rotary_matches_reference_and_transformers(dtype, B, Hq, Hk, T, D, poisoned):
    g = torch.Generator().manual_seed(B * 1000 + Hq * 100 + T * 10 + D)
    # q and k as transformers makes them: [B, T, H, D] projections viewed as [B, H, T, D]
    q = torch.randn(B, T, Hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, T, Hk, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    angles = torch.rand(B, T, D // 2, generator=g) * 40
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    q_out, k_out = rope_ops.apply_rotary(q, k, cos, sin)
    q_ref, k_ref = rope_ref.apply_rotary(q, k, cos, sin)
    q_hf, k_hf = _hf_rotary(q, k, cos, sin)
    for out, ref, hf in ((q_out, q_ref, q_hf), (k_out, k_ref, k_hf)):
        assert out.shape == hf.shape and out.dtype == dtype and not out.isnan().any()
        # the same roundings as transformers' three ops (no fused multiply-add): equal to the last bit
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(ref, hf, rtol=0, atol=0)
    assert q_out.stride() == q.stride()  # laid out as the input, as transformers' elementwise ops keep it


def test_rotary_and_rms_norm_refuse_bad_input():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        norm_ops.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        norm_ops.rms_norm(x.to(torch.int32), torch.ones(8, device=DEVICE), 1e-6)
    q = torch.randn(1, 2, 3, 6, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rope_ops.apply_rotary(q, q, torch.ones(1, 3, 6, device=DEVICE), torch.ones(1, 3, 6, device=DEVICE))
    with pytest.raises(ValueError, match="cos must be"):
        rope_ops.apply_rotary(q, q, torch.ones(1, 2, 6, device=DEVICE), torch.ones(1, 3, 6, device=DEVICE))
    with pytest.raises(TypeError, match="like q"):
        rope_ops.apply_rotary(q, q.half(), torch.ones(1, 3, 6, device=DEVICE), torch.ones(1, 3, 6, device=DEVICE))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fused_layers_keep_the_model_output_and_restore_it(model_type, backend):
    import kivi_kernels
    from kivi.fused import FusedLayers

    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    model = tiny_lm(model_type, dtype)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits.float()
        fused = FusedLayers(model, kivi_kernels.get_ops(backend))
        with fused:
            calls = {"rope": 0}
            rotary = fused.modeling.apply_rotary_pos_emb
            fused.modeling.apply_rotary_pos_emb = lambda *a, **k: calls.__setitem__("rope", calls["rope"] + 1) \
                or rotary(*a, **k)
            inside = model(ids).logits.float()
            fused.modeling.apply_rotary_pos_emb = rotary
        after = model(ids).logits.float()
    assert calls["rope"] == 2  # one per layer: the model looks the function up in its module at call time
    assert all("forward" not in vars(m) for m in fused.norms) and fused.norms
    assert fused.modeling.apply_rotary_pos_emb is fused.original_rotary
    torch.testing.assert_close(inside, before, rtol=TOL[dtype] * 5, atol=TOL[dtype] * 5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_fused_layers_fall_through_and_refuse_unknown_models():
    import kivi_kernels
    from kivi.fused import FusedLayers

    model = tiny_lm("llama", torch.float32)
    fused = FusedLayers(model, kivi_kernels.get_ops("reference"))
    with fused:
        q = torch.randn(1, 4, 3, 16, device=DEVICE)
        cos, sin = torch.randn(1, 3, 16, device=DEVICE), torch.randn(1, 3, 16, device=DEVICE)
        # unsqueeze_dim=2 means q is [B, T, H, D]: not the kernel's form, transformers' function runs
        q_t = q.transpose(1, 2)
        got = fused.modeling.apply_rotary_pos_emb(q_t, q_t, cos, sin, unsqueeze_dim=2)
        want = fused.original_rotary(q_t, q_t, cos, sin, unsqueeze_dim=2)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    # an instance forward that was there before (accelerate's hooks set one) is put back, not deleted
    norm = fused.norms[0]
    hooked = norm.forward  # a bound method of the class's forward, as a hook's wrapper would hold
    norm.forward = hooked
    with fused:
        assert norm.forward is not hooked
    assert vars(norm)["forward"] is hooked
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        FusedLayers(model, kivi_kernels.get_ops("reference"))


def test_fused_kernels_compile_for_h200():
    from kivi_kernels.rms_norm.kernel import rms_norm_kernel
    from kivi_kernels.rotary.kernel import rotary_kernel

    norm_sig = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
    rope_sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr")}
    results = compile_for_sm90_many([
        (rms_norm_kernel, norm_sig, {"BLOCK_M": 1, "BLOCK_N": 4096}, {"num_warps": 8}),
        (rms_norm_kernel, dict(norm_sig, weight_ptr="*fp32", out_ptr="*fp32"), {"BLOCK_M": 16, "BLOCK_N": 128},
         {"num_warps": 4}),
        (rotary_kernel, rope_sig, {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8}, {"num_warps": 8}),
    ])
    assert [r["cubin_bytes"] > 0 for r in results] == [True] * 3


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_projections_one_matmul_for_qkv_and_gate_up(model_type, monkeypatch):
    import kivi_kernels
    from kivi.fused import FusedLayers

    model = tiny_lm(model_type, torch.float32)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    params_before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        before = model(ids).logits
        fused = FusedLayers(model, kivi_kernels.get_ops("reference"), projections=True)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        # the weights are now slices of one tensor per group (no extra memory)
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
        assert sum(p.numel() for p in model.parameters()) == params_before
        calls = {"n": 0}
        linear = torch.nn.functional.linear

        def counted(*args, **kwargs):
            calls["n"] += 1
            return linear(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "linear", counted)
        with fused:
            inside = model(ids).logits
        per_forward = calls["n"]
        calls["n"] = 0
        after = model(ids).logits
    layers = model.config.num_hidden_layers
    assert per_forward == 4 * layers + 1  # qkv, o, gate+up, down per layer; lm_head
    assert calls["n"] == 7 * layers + 1  # unpatched again: seven products per layer
    torch.testing.assert_close(inside, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # the views hold the same values
    # a second FusedLayers (another engine on this model) reuses the fused weights instead of copying them
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    again = FusedLayers(model, kivi_kernels.get_ops("reference"), projections=True)
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    # a forward that stops between a group's products leaves no activations behind once the context closes
    with again, torch.no_grad():
        attn.q_proj(torch.randn(1, 3, model.config.hidden_size, device=DEVICE))
        assert any(again.stashes)
    assert not any(again.stashes)


def test_fused_layers_enter_is_all_or_nothing(monkeypatch):
    import kivi_kernels
    from kivi.fused import FusedLayers

    model = tiny_lm("llama", torch.float32)
    fused = FusedLayers(model, kivi_kernels.get_ops("reference"))
    monkeypatch.setattr(fused, "_rotary", lambda original: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        with fused:
            pass
    assert fused.depth == 0 and all("forward" not in vars(m) for m in fused.norms)
    assert fused.modeling.apply_rotary_pos_emb is fused.original_rotary


@pytest.mark.parametrize("projections", [False, True])
def test_mlp_chunks_keep_the_output_and_bound_each_call(projections, monkeypatch):
    """chunk_mlps: a forward over more tokens than the chunk runs each MLP on at most that many tokens at a time
    and gives the unchunked logits; a call within the chunk runs whole; on exit the MLPs run whole again."""
    import kivi_kernels
    from kivi.fused import FusedLayers

    model = tiny_lm("llama", torch.float32)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(int(torch.randint(99, ())))).to(DEVICE)
    mlp = model.model.layers[1].mlp
    rows, down = [], mlp.down_proj.forward
    monkeypatch.setattr(mlp.down_proj, "forward", lambda x: rows.append(x.numel() // x.shape[-1]) or down(x))
    with torch.no_grad():
        before = model(ids).logits
        fused = FusedLayers(model, kivi_kernels.get_ops("reference"), projections=projections, mlp_chunk_tokens=5)
        rows.clear()
        with fused:
            inside = model(ids).logits
            model(ids[:1, :4])
        assert "forward" not in vars(mlp)
        after = model(ids).logits
    assert rows == [5, 5, 5, 5, 2, 4, 22]  # 22 tokens in chunks of 5, then 4 whole; unpatched: 22 at once
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="mlp_chunk_tokens"):
            FusedLayers(model, kivi_kernels.get_ops("reference"), mlp_chunk_tokens=bad)
