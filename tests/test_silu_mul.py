"""The SiLU-and-multiply kernel (kivi_kernels/silu_mul) against its reference and transformers' `act_fn(gate) * up`,
and FusedLayers' silu_mul patch of SwiGLU MLPs.

The kernel runs under the Triton interpreter on a CPU (fp16 and fp32: the interpreter's bf16 arithmetic is wrong)
and compiled on a GPU (bf16 too). Outputs are poisoned: torch.empty returns NaN tensors while a kernel runs, so an
element the kernel does not write fails the comparison.
"""

import pytest
import torch

from kivi_kernels.silu_mul import ops, reference
from tests.compile_util import compile_for_sm90_many
from tests.model_cases import DEVICE, tiny_lm

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# 16-bit outputs: silu(gate) is rounded to the dtype before the product, as transformers rounds act_fn's output;
# exp's last fp32 bit may differ between Triton and torch, which moves ~0.01% of outputs by an ulp. A kernel that
# skipped that rounding differs in ~26% of them.
EXACT_FRACTION = 0.995


def _check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    if dtype != torch.float32:
        assert (out == want).float().mean().item() >= EXACT_FRACTION


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 200), (2, 2 * 2100), (1, 1, 1, 2), (4, 2 * 1376)])
def test_silu_mul_matches_reference_and_transformers(dtype, shape, poisoned):
    """Odd widths, a width past one tile, partial row tiles: the kernel against the reference, and the reference
    against transformers' act_fn(gate) * up on the two halves."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    gate_up = (torch.randn(shape, generator=g) * 4).to(DEVICE, dtype)
    out, ref = ops.silu_mul(gate_up), reference.silu_mul(gate_up)
    gate, up = gate_up.split(shape[-1] // 2, dim=-1)
    assert out.is_contiguous() and out.shape == (*shape[:-1], shape[-1] // 2)
    _check(out, ref, dtype)
    _check(ref, ACT2FN["silu"](gate) * up, dtype)


def test_silu_mul_reads_strided_rows_and_refuses_bad_input(poisoned):
    """Rows further apart than their width (a column slice of a wider tensor) are read in place; odd widths,
    integer dtypes and non-tensors are refused with the reason."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n = int(torch.randint(1, 300, (), generator=g))
    base = (torch.randn(6, 2 * n + 7, generator=g) * 4).to(DEVICE, torch.float16)
    gate_up = base[:, 3:3 + 2 * n]  # stride (2 n + 7, 1)
    _check(ops.silu_mul(gate_up), reference.silu_mul(gate_up.contiguous()), torch.float16)
    with pytest.raises(ValueError, match="2 N"):
        ops.silu_mul(torch.randn(4, 7, device=DEVICE))
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        ops.silu_mul(torch.ones(4, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.silu_mul([1.0, 2.0])


def test_silu_mul_compiles_for_h200():
    from kivi_kernels.silu_mul.kernel import silu_mul_kernel

    results = compile_for_sm90_many([
        (silu_mul_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"}, {"BLOCK_M": 1, "BLOCK_N": 1024},
         {"num_warps": 4, "aligned": ("gate_up_ptr", "out_ptr", "n_cols", "stride_gate_up_row")}),
        (silu_mul_kernel, {"gate_up_ptr": "*fp32", "out_ptr": "*fp32"}, {"BLOCK_M": 1, "BLOCK_N": 64},
         {"num_warps": 4}),
    ])
    assert [r["cubin_bytes"] > 0 for r in results] == [True] * 2


@pytest.mark.parametrize("case", ["silu", "silu-off", "gelu", "hooked"])
def test_fused_layers_run_swiglu_mlps_through_silu_mul(case):
    """FusedLayers(projections=True, silu_mul=True): each SwiGLU MLP calls silu_mul once per forward on the fused
    gate/up product (per chunk with mlp_chunk_tokens) and keeps the model's output. silu_mul=False, an MLP whose
    act_fn is not SiLU, and an MLP with a forward of its own (accelerate's hooks) keep transformers' path."""
    import kivi_kernels
    from kivi.fused import FusedLayers

    model = tiny_lm(hidden_act="gelu" if case == "gelu" else "silu")
    if case == "hooked":
        for layer in model.model.layers:
            layer.mlp.forward = layer.mlp.forward  # an instance forward, as a hook's wrapper sets one
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(int(torch.randint(99, ())))).to(DEVICE)
    ops_ref, calls = kivi_kernels.get_ops("reference"), []
    silu_mul = ops_ref.silu_mul
    ops_ref.silu_mul = lambda gate_up: calls.append(tuple(gate_up.shape)) or silu_mul(gate_up)
    with torch.no_grad():
        before = model(ids).logits
        for chunk in (None, 5):
            with FusedLayers(model, ops_ref, projections=True, mlp_chunk_tokens=chunk, silu_mul=case != "silu-off"):
                inside = model(ids).logits
            torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    width, layers = 2 * model.config.intermediate_size, model.config.num_hidden_layers
    if case == "silu":  # whole forwards: [2, 9, 2 I] a layer; in chunks of 5 tokens: 4 chunks a layer
        assert calls == [(2, 9, width)] * layers + [(5, width), (5, width), (5, width), (3, width)] * layers
    else:
        assert calls == []
