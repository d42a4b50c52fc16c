"""The Gluon decode-attention kernels against the reference (GPU only: Gluon has no interpreter mode): the FMA
kernel (kernel_gluon.py) and the tensor-core kernel (kernel_mma.py) on odd shapes into NaN-poisoned outputs,
with each of their knobs. Their launchers' host side (every kernel argument passed once, eligibility, defaults,
bad input), which runs on the CPU with a recorded launch, is in test_decode_attention_launch.py.
"""

# TRITON_INTERPRET is set on machines without a GPU by conftest.py, before any kernel module loads
import random

import pytest
import torch

from kivi_kernels.decode_attention import decode_attention, reference
from tests.decode_attention_cases import (
    DEVICE,
    TOL,
    Case,
    assert_close,
    check_against_reference,
    make_inputs,
    run,
)

# The Gluon FMA kernel (kernel_gluon.py): compiled only (Gluon has no interpreter), so these run on a GPU.
# MHA 2-bit D=128: odd lengths, empty rows, ring-only rows, more splits than blocks, G=16/64, R=64/192,
# pages of 256, fp32 / fp16 / bf16.
FMA_CASES = [
    Case((1000, 161, 0), 3, 3, 128, 2, 2, num_splits=2),
    Case((1000, 161, 0), 3, 3, 128, 2, 2, num_splits=2, extra=(("magic", False),)),  # version 12, fp32
    Case((700, 33, 300, 128, 129), 4, 4, 128, 2, 2, dtype=torch.float16, num_splits=3),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=16, dtype=torch.bfloat16, num_splits=3,
         extra=(("magic", False), ("cp_async", False))),
    Case((500, 150), 2, 2, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((333, 290), 1, 1, 128, 2, 2, group_size=16, residual=64, page_size=256, num_splits=7),
    Case((2000, 1), 2, 2, 128, 2, 2, dtype=torch.bfloat16, num_splits=40),
    Case((900, 65, 0), 2, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16, num_splits=3),
    Case((1000, 161, 0, 64, 65), 3, 3, 128, 2, 2, num_splits=3, block_n=64),
    Case((700, 33), 2, 2, 128, 2, 2, group_size=16, residual=64, dtype=torch.float16, block_n=64,
         extra=(("maxnreg", 128),)),
    Case((1000, 161, 0, 64, 65, 300), 3, 3, 128, 2, 2, num_splits=3, block_n=64, extra=(("cp_async", False),)),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=128, residual=128, dtype=torch.float16, page_size=256,
         num_splits=5, extra=(("cp_async", True),)),
    Case((900, 77, 5), 2, 2, 128, 2, 2, group_size=16, residual=192, dtype=torch.bfloat16,
         extra=(("cp_async", True),)),
    Case((1500, 1, 200), 2, 2, 128, 2, 2, block_n=128, num_splits=2, extra=(("cp_async", True), ("maxnreg", 168))),
    Case((333, 290), 1, 1, 128, 2, 2, group_size=16, residual=64, page_size=256, num_splits=7,
         extra=(("cp_async", False),)),
    # version 13's step (kernel_gluon_magic.py), both loops: odd lengths, empty and ring-only rows, splits,
    # G=16/64/128, R=64/192, long rows, fp32 / fp16 / bf16
    Case((1000, 161, 0, 64, 65, 300), 3, 3, 128, 2, 2, num_splits=3, extra=(("magic", True),)),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=128, residual=128, dtype=torch.float16, page_size=256,
         num_splits=5, extra=(("magic", True),)),
    Case((900, 77, 5), 2, 2, 128, 2, 2, group_size=16, residual=192, dtype=torch.bfloat16, extra=(("magic", True),)),
    Case((500, 150), 2, 2, 128, 2, 2, group_size=64, residual=64, dtype=torch.float16, num_splits=2,
         extra=(("magic", True), ("cp_async", False))),
    Case((20000, 3000), 1, 1, 128, 2, 2, dtype=torch.float32, num_splits=1, extra=(("magic", True),)),
]
# version 13 (the default) subtracts a magic offset after its sums (kernel_gluon_magic.py): ~1e-4 of a score and
# of an output against fp32 math, so its fp32 cases get this tolerance (version 12 keeps fp32's 2e-5)
MAGIC_FP32_TOL = 5e-4


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", FMA_CASES, ids=lambda c: c.id)
def test_fma_kernel_matches_reference(case: Case):
    from kivi_kernels.decode_attention.ops_fma import FMA_MAGIC

    magic = dict(case.extra).get("magic", FMA_MAGIC)  # the launcher's default when the case does not say
    tol = MAGIC_FP32_TOL if magic and case.dtype == torch.float32 else TOL[case.dtype]
    check_against_reference(case, tol, block_n=case.block_n, fma=True, **dict(case.extra))


# Version 14, the tensor-core kernel with register-built fragments (kernel_mma.py): 1 to 8 query heads per KV
# head, fp16 / bf16, odd lengths, empty and ring-only rows, splits, G=32/64, R=64/128/192, pages of 64/256.
MMA_CASES = [
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, num_splits=3),
    Case((700, 33, 129, 2000), 8, 1, 128, 2, 2, dtype=torch.float16, num_splits=5, page_size=256),
    Case((900, 77, 5), 6, 2, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((500, 150), 4, 4, 128, 2, 2, group_size=64, residual=64, dtype=torch.float16, num_splits=2),
    Case((333, 290, 96), 14, 2, 128, 2, 2, page_size=64, dtype=torch.bfloat16, num_splits=7),
    Case((2000, 1), 6, 2, 128, 2, 2, dtype=torch.float16, num_splits=40),
    Case((20000, 3000), 4, 1, 128, 2, 2, dtype=torch.bfloat16, num_splits=1),
    Case((1000, 161, 0), 8, 8, 128, 2, 2, dtype=torch.float16),
    # bf16 queries and ring with fp16 scales and zero points (KiviConfig.scale_dtype="float16")
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16,
         num_splits=3),
    Case((900, 77, 5), 4, 4, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16,
         scale_dtype=torch.float16),
]


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.id)
def test_mma_kernel_matches_reference(case: Case):
    check_against_reference(case, TOL[case.dtype], mma=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", [MMA_CASES[i] for i in (0, 1, 5)], ids=lambda c: c.id)
def test_mma_kernel_with_three_stages_matches_reference(case: Case):
    """num_stages=3: two packed blocks in flight (odd lengths, splits, pages of 256, QG 1 and 4)."""
    check_against_reference(case, TOL[case.dtype], mma=True, num_stages=3)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("value_copy", ["transposed", "sectors"])
@pytest.mark.parametrize("case", [MMA_CASES[i] for i in (0, 1, 5)], ids=lambda c: c.id)
def test_mma_kernel_with_each_value_copy_matches_reference(case: Case, value_copy: str):
    """Each way the value words reach shared memory: version 15's 4-byte transposed copies and version 20's
    16-byte pieces in global order (kernel_mma_stage.py)."""
    check_against_reference(case, TOL[case.dtype], mma=True, value_copy=value_copy)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("num_splits", [3, 126])
def test_split_calls_replayed_from_a_cuda_graph_match_the_reference(num_splits: int):
    """A split call captured in a CUDA graph, as the engine runs it: on sm_90 the merge is a programmatic
    dependent of the split kernel (common.merge_splits), a graph edge that must still order its reads after the
    kernel's writes. Replayed over fresh queries into a NaN-poisoned output; 126 splits leave some empty."""
    case = Case((3000, 161, 0, 700), 8, 2, 128, 2, 2, dtype=torch.bfloat16, num_splits=num_splits)
    q, cache, _ = make_inputs(case)
    out = torch.empty_like(q)
    run(decode_attention, case, q, cache, out=out, num_splits=num_splits, mma=True)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(decode_attention, case, q, cache, out=out, num_splits=num_splits, mma=True)
    seed = random.randrange(2**31)  # fresh each run, named on failure
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for replay in range(3):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE, dtype=q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        expected = run(reference.decode_attention, case, q, cache)
        assert_close(out, expected, TOL[case.dtype], f"{case.id}, replay {replay}, seed {seed}")


# The same kernel over 4-bit caches (BITS=4, kernel_mma_frag4.py): its own key and value fragments, the ring in
# the 4-bit channel order, the default value copy (16-byte pieces, version 24) and the transposed one
MMA4_CASES = [
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 4, 4, dtype=torch.bfloat16, num_splits=3),
    Case((700, 33, 129, 2000), 8, 1, 128, 4, 4, dtype=torch.float16, num_splits=5, page_size=256),
    Case((900, 77, 5), 6, 2, 128, 4, 4, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((333, 290, 96), 14, 2, 128, 4, 4, page_size=64, dtype=torch.float16, num_splits=7),
    Case((3000, 1), 4, 4, 128, 4, 4, dtype=torch.bfloat16, num_splits=1),
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 4, 4, dtype=torch.bfloat16, scale_dtype=torch.float16,
         num_splits=3),
]


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", MMA4_CASES, ids=lambda c: c.id)
def test_mma_kernel_over_4bit_caches_matches_reference(case: Case):
    check_against_reference(case, TOL[case.dtype], mma=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", [MMA4_CASES[i] for i in (0, 1, 3)], ids=lambda c: c.id)
def test_mma_kernel_over_4bit_caches_with_the_transposed_copy(case: Case):
    """Version 22's 4-byte copies of 4-bit value words, the fallback where a token's words are not in a row."""
    check_against_reference(case, TOL[case.dtype], mma=True, value_copy="transposed")


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", [MMA4_CASES[i] for i in (0, 1)], ids=lambda c: c.id)
def test_mma_kernel_over_4bit_caches_with_three_stages_and_a_whole_ring_split(case: Case):
    check_against_reference(case, TOL[case.dtype], mma=True, num_stages=3, ring_units=0)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("case", [MMA_CASES[i] for i in (0, 1, 4, 5, 6, 9)] + [MMA4_CASES[i] for i in (0, 1, 2)],
                         ids=lambda c: c.id)
def test_mma_kernel_with_two_blocks_a_step_matches_reference(case: Case, num_stages: int):
    """step_blocks=2 (versions 25-26): one online-softmax step over two 64-token blocks. Odd block counts (the
    last block the first of a masked half pair, whose second block may be the next split's or lie in a poisoned
    page), splits whose ranges end mid-pair, more splits than blocks, empty and ring-only rows, QG 1 to 8,
    G=32/64, fp16 scales, 4-bit caches, 2 and 3 pairs of stages."""
    check_against_reference(case, TOL[case.dtype], mma=True, step_blocks=2, num_stages=num_stages)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", [MMA_CASES[0], MMA4_CASES[0]], ids=lambda c: c.id)
def test_mma_kernel_with_two_blocks_a_step_and_the_transposed_copy(case: Case):
    """step_blocks=2 with the 4-byte transposed value copies (4 buffers a stage, indexed 4 stage + g)."""
    check_against_reference(case, TOL[case.dtype], mma=True, step_blocks=2, value_copy="transposed")


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("row_major", [True, False])
@pytest.mark.parametrize("kernel", ["mma", "fma"])
def test_gluon_kernels_in_both_program_orders_match_reference(monkeypatch, kernel: str, row_major: bool):
    """Grid (H, B, splits) and (B, H, splits) (common.ROW_MAJOR) in both Gluon kernels: B != H (a swapped row
    and head would read the wrong cache), rows of mixed lengths with one empty, a split call."""
    from kivi_kernels.decode_attention import common

    monkeypatch.setattr(common, "ROW_MAJOR", row_major)
    heads = (8, 2) if kernel == "mma" else (4, 4)
    case = Case((700, 0, 161, 1500, 64), *heads, 128, 2, 2, dtype=torch.bfloat16, num_splits=3)
    check_against_reference(case, TOL[case.dtype], **{kernel: True})


# Rows whose ring splits share out in 32-slot chunks: more splits than units (idle splits), ring-only splits,
# n_ring not a multiple of 32, and (G=64, L=705: the ring holds 65 tokens at slots [0, 65)) a split whose only
# chunk is fully masked
RING_CASES = [MMA_CASES[5],
              Case((705, 1000, 161, 90), 8, 2, 128, 2, 2, group_size=64, dtype=torch.bfloat16, num_splits=24),
              Case((4096, 300, 20), 8, 2, 128, 2, 2, dtype=torch.float16, num_splits=16)]


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("ring_units", [0, 1, 2, 3])
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: c.id)
def test_mma_kernel_with_each_ring_share_matches_reference(case: Case, ring_units: int):
    """Each weight of a ring chunk in the split share-out, 0 (the whole ring in one split) included."""
    check_against_reference(case, TOL[case.dtype], mma=True, ring_units=ring_units)


@pytest.mark.parametrize("mma", [None, True], ids=["default", "mma"])
def test_wide_groups_with_fp16_scales_stay_finite(mma):
    """A bf16 cache whose groups span up to ~1e5 (past fp16's range: some fp16 scales and zeros saturate at
    +-65,504): the launcher (its default path, and the tensor-core kernel on a GPU) agrees with the reference
    and stays finite. The table kernel dequantizes bf16 caches into bf16, so wide groups cannot overflow it."""
    if mma and DEVICE == "cpu":
        pytest.skip("Gluon kernels need a GPU (no interpreter mode)")
    case = Case((700, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16, spread=2e4)
    q, cache, _ = make_inputs(case)
    q = (q.float() * 1e-3).to(q.dtype)  # scores of a few units, not one-hot: the check compares whole rows
    assert cache["k_zero"][~cache["k_zero"].isnan()].abs().max() == 65504  # some group did saturate
    expected = run(reference.decode_attention, case, q, cache).float()
    got = run(decode_attention, case, q, cache, mma=mma).float()
    assert expected.isfinite().all() and got.isfinite().all()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
