"""Launcher of version 14, the tensor-core decode-attention kernel with register-built fragments
(kernel_mma.py): 2-bit or 4-bit caches (the same for keys and values), 1 to 8 query heads per KV head,
head_dim 128, fp16 or bf16, on a GPU.

ops.decode_attention calls launch_mma by default where mma_eligible holds and the call is large enough
(ops_fma.FMA_MIN_WORK); fp32 caches keep the FMA kernel. kernel_notes.md (version 14) has the measurements.
"""

from __future__ import annotations

import torch

from . import common as C
from .ops_fma import cp_async_aligned
from .ops_ring import launch_ring_partial

try:  # Gluon (Triton's explicit-layout dialect) ships with triton >= 3.5; it has no interpreter mode
    from .kernel_mma import _decode_attention_mma_kernel
except ImportError:  # pragma: no cover - older triton
    _decode_attention_mma_kernel = None

_OP = "decode_attention"
# kernels-20261129-h200-sweep-mma5.json (version 14d, ring loads vectorized; bf16): 32/8 heads 2.3-2.7x the
# tensor-core table (B=64, L=4,096: 108 vs 253 us; B=256: 363 vs 887; B=8, L=32,768: 101 vs 309; B=128, L=1,152:
# 74 vs 135; B=1, L=131,072: 56 vs 116), and on 32/32 heads 1.14-1.19x the FMA kernel (B=64, L=4,096: 356 vs 405;
# B=128, L=1,152: 222 vs 265); uncapped registers were as fast as caps of 208 or 232 and faster than 168
MMA_MAXNREG = 255  # register cap per thread of the one-warp programs (255: no spills, 8 per SM)
MMA_PER_SM = 16  # programs per SM the split count aimed for before MMA_RESIDENT (16 was 0-3% faster than 24, 32)
# programs an SM holds (208-220 registers: 2 warps per scheduler, ncu's "block limit registers"); the split
# count fills whole waves of them (common.wave_splits). None: aim at MMA_PER_SM programs per SM instead.
MMA_RESIDENT: int | None = 8
MMA_STAGES = 2  # cp.async stages of the packed loop (3, two blocks in flight, was 0-5% slower: -sweep-stages.json)
# how the value words reach shared memory (kernel_mma_stage.py): "transposed" (version 15, 4-byte copies; the
# fallback where a token's words are not contiguous) or "sectors" (version 20, 16-byte copies as they lie, each
# token's 32-byte sectors kept together; at 4 bits since version 24: 1.46-1.84x the transposed copy there,
# kernels-20261130-h200-sweep-mma4-sectors.json). Versions 17 and 19 ("halves", "rows") were removed once 20 was
# measured: 0.96-1.00x of 19's time on 20 of 21 rows over 16 shapes (kernels-20261130-h200-sweep-sectors*.json)
VALUE_COPIES = {"transposed": 0, "sectors": 1}
MMA_VALUE_COPY = "sectors"
# work units of a 32-slot chunk of the full-precision ring when splits share out a row (a packed 64-token block
# is one): 16 KiB of bf16 against a block's 6 KiB of codes, scales and zeros. The chunks go to whichever split
# holds their first unit; 0 gives the whole ring to one split (version 20 and before), which at B=8, L=4,096,
# 32/8 heads (16 splits of 5 units) read 2 blocks and the whole ring (8 units) while 3 splits sat idle
MMA_RING_UNITS = 2
# 64-token blocks per online-softmax step (version 25, kernel_mma_loop._packed_loop_pairs): 2 shares a step's
# fixed work (the sums' rescale, the cross-lane max and sum, the wait) by 128 tokens, 9% fewer instructions a
# block in the 2-bit loop's SASS (1,095 -> 991 at QG 1, sm_90, triton 3.6) at the same registers, with twice the
# stages' shared memory (at 2 stages and G=32: 24 KiB a program at 2 bits, 40 at 4, where 5 programs fit an SM
# and the split count, which assumes 8, is not adjusted) and 1.4x the kernel's code (an odd count ends on a
# masked half pair, version 26). Measured (kernels-20261130-h200-sweep-halfpair-*.json, -v25.json,
# split-probe-20261130-h200-pairs*.json): 1-8% faster on long programs (unsplit calls of 16 blocks a row and
# more, splits of 64 and more), within +-1.5% on splits of 31-32 blocks, slower on short ones (6% on unsplit
# rows of 6 blocks; 2-4% on splits of 15-17 blocks, 21% on 5, whose one-wave grids pay the larger code's cold
# start and the deeper prologue), so by default (None) 2 exactly on the long ones (mma_step_blocks). At 4 bits it
# is 18-58% slower on every shape (kernels-20261130-h200-sweep-pairs4.json: 5 programs an SM instead of 8), so 1.
MMA_STEP_BLOCKS: int | None = None
# packed blocks a program may read at least for step_blocks 2, (unsplit, split): of the block table's capacity
# (the launcher's max_tokens, which sets the split count too; the rows' own lengths are on the GPU)
MMA_PAIRS_MIN_BLOCKS = (16, 64)
# version 27: the full-precision ring read by programs of its own (kernel_ring.py) on a side stream, beside the
# tensor-core kernel over the packed blocks, as one more split of the merge: the one-warp programs' 212 registers
# (8 an SM) held the ring at 0.85 of copy where the paged bf16 kernel reads the same bytes at 1.02, and the side
# programs fill the room those programs leave (kernel_notes.md, version 27). By default (mma_ring_pass) on 2-bit
# calls of one to two waves of programs, which the launcher would otherwise split in two and which then run unsplit:
# B=64, L=4,096, 32/32 heads 287 -> 260 us, a GQA mix of 200 rows 156 -> 145-147. From two waves up it was 4-6%
# faster on ring-only rows and rows of 4,096 tokens, 2% on b's, even on a's and 1% slower on d's, and the engine's
# step on a, b and d was 0-0.8% slower (engine-20261201-h200-ring-pass-abd.json); under a wave (split calls) it lost
# 2-30%; at 4 bits, whose kernel reads its ring at 0.90 of copy, it was 3% slower on a's and ring-only rows
MMA_RING_PASS = True
MMA_RING_PASS_BITS = (2,)
MMA_DEFAULT = True  # the launcher's default for eligible 16-bit calls of at least FMA_MIN_WORK pairs (MHA and GQA)


def mma_eligible(q: torch.Tensor, pages: tuple[torch.Tensor, ...], k_res: torch.Tensor, k_bits: int,
                 v_bits: int, group_size: int, residual_length: int, page_size: int, qg: int) -> bool:
    """Whether kernel_mma.py can run this call: compiled (not the interpreter), 2-bit or 4-bit keys and values
    (the same for both), 1 to 8
    query heads per KV head, head_dim 128, pages of whole 64-token steps, groups of 32 or 64 tokens (at 128 the
    2-byte value-scale rows did not compile into cp.async pieces), one 16-bit dtype for the query and the ring
    (the scales in it or in fp16), and page tensors (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero) that
    cp.async can copy in 16-byte pieces."""
    k_scale = pages[1]
    return (_decode_attention_mma_kernel is not None and not C.interpreting() and q.is_cuda
            and k_bits == v_bits and k_bits in (2, 4) and 1 <= qg <= 8 and q.shape[-1] == 128 and page_size % 64 == 0
            and group_size in (32, 64) and residual_length % 32 == 0
            and q.dtype in (torch.float16, torch.bfloat16) and k_res.dtype == q.dtype
            and k_scale.dtype in (q.dtype, torch.float16)
            and cp_async_aligned(*pages[:4]) and all(_blocks_aligned(t) for t in pages[4:]))


def _blocks_aligned(t: torch.Tensor) -> bool:
    """Value scales or zeros [pages, H, P, D / G] whose 64-token blocks cp.async copies in 16-byte pieces:
    16-byte aligned data, outer strides that are multiples of 16 elements, contiguous rows."""
    return (t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
            and t.stride(2) == t.shape[3] and t.stride(3) == 1)


def check_value_copy(value_copy: str | None) -> None:
    """A clear error for a value_copy that is not None or one of VALUE_COPIES, on every path of the call."""
    if value_copy is not None and value_copy not in VALUE_COPIES:
        raise ValueError(f"{_OP}: value_copy must be one of {sorted(VALUE_COPIES)}, got {value_copy!r}")


def check_step_blocks(step_blocks: int | None) -> None:
    """A clear error for a step_blocks that is not None, 1 or 2, on every path of the call."""
    if step_blocks is not None:
        C.check_int(_OP, "step_blocks", step_blocks, (1, 2))


def mma_resident(maxnreg: int) -> int | None:
    """Programs an SM holds at this register cap for the whole-wave split count (MMA_RESIDENT above 168 registers:
    2 warps per scheduler), or None below it, where the count aims at MMA_PER_SM programs per SM."""
    return MMA_RESIDENT if maxnreg > 168 else None


def mma_step_blocks(bits: int, num_splits: int, max_tokens: int, residual_length: int) -> int:
    """The default blocks a step: MMA_STEP_BLOCKS when set, else 2 for 2-bit caches where a program may read at
    least MMA_PAIRS_MIN_BLOCKS packed blocks (max_tokens, the block table's capacity, over the splits; unsplit or
    split), 1 otherwise. In the engine the capacity follows max_model_len, so short rows of a long-capacity
    table take two blocks a step too (as they did in engine-20261130-h200-v25.json)."""
    if MMA_STEP_BLOCKS is not None:
        return MMA_STEP_BLOCKS
    blocks_per_program = max(max_tokens - residual_length, 0) // 64 / num_splits
    return 2 if bits == 2 and blocks_per_program >= MMA_PAIRS_MIN_BLOCKS[num_splits > 1] else 1


def mma_ring_pass(bits: int, rows: int, num_splits: int | None, maxnreg: int, device: torch.device) -> bool:
    """The default ring_pass: MMA_RING_PASS for MMA_RING_PASS_BITS caches where no split count is given and the
    call's rows (batch x KV heads) fill a wave of the kernel's programs but fewer than MMA_PER_SM programs an SM,
    where the launcher would split them in two (common.choose_num_splits): the call then runs unsplit beside the
    ring pass."""
    sms = C.num_sms(device)
    wave = (mma_resident(maxnreg) or MMA_PER_SM) * sms
    return (MMA_RING_PASS and bits in MMA_RING_PASS_BITS and num_splits is None
            and wave <= rows < MMA_PER_SM * sms)


def launch_mma(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens,
               out, sm_scale, group_size, residual_length, page_size, num_splits, max_tokens,
               maxnreg=None, stages=None, value_copy=None, ring_units=None, step_blocks=None,
               ring_pass=None) -> torch.Tensor:
    """The tensor-core kernel: grid common.decode_grid of one-warp programs, then the split merge. stages:
    cp.async stages of its packed loop (MMA_STAGES by default; 3 keeps two blocks in flight, 18 KiB of shared
    memory a program instead of 12 at 2 bits, 30 instead of 20 at 4, where 7 programs then fit an SM's 228 KiB
    and the split count, which assumes 8, is not adjusted; with step_blocks 2, stages pairs of stages).
    value_copy: how value words reach shared memory, one of VALUE_COPIES (MMA_VALUE_COPY by default;
    "transposed" where a token's 4 * bits words are not contiguous).
    ring_units: the work units of a 32-slot ring chunk in the split count's share-out (MMA_RING_UNITS by default;
    0: the whole ring to one split). step_blocks: 64-token blocks per online-softmax step, 1 or 2
    (mma_step_blocks by default; 2 takes 2 stages of each kind a step). ring_pass: the ring read by programs of
    its own on a side stream (ops_ring), a split of its own in the merge (mma_ring_pass by default; the call is
    then unsplit unless num_splits says otherwise)."""
    batch, q_heads, _ = q.shape
    kv_heads = k_codes.shape[1]
    maxnreg = MMA_MAXNREG if maxnreg is None else maxnreg
    stages = MMA_STAGES if stages is None else stages
    check_value_copy(value_copy)
    value_copy = MMA_VALUE_COPY if value_copy is None else value_copy
    bits = 32 * k_codes.shape[2] // page_size  # k_codes [pages, H, page_size * bits / 32, D]
    if bits not in (2, 4) or v_codes.shape[3] * 32 != bits * q.shape[2]:
        raise ValueError(f"{_OP}: launch_mma takes 2-bit or 4-bit keys and values alike; k_codes "
                         f"{list(k_codes.shape)} (page_size {page_size}) and v_codes {list(v_codes.shape)} are not")
    if v_codes.stride(2) != 4 * bits:  # the 16-byte copies: a block's words in a row
        value_copy = "transposed"
    C.check_int(_OP, "num_stages", stages, (2, 3))
    ring_units = MMA_RING_UNITS if ring_units is None else ring_units
    if not isinstance(ring_units, int) or not 0 <= ring_units <= 8:
        raise ValueError(f"{_OP}: ring_units must be an int in [0, 8], got {ring_units!r}")
    check_ring_pass(ring_pass)
    if ring_pass is None:
        ring_pass = mma_ring_pass(bits, batch * kv_heads, num_splits, maxnreg, q.device)
    if ring_pass and num_splits is None:
        num_splits = 1
    num_splits = C.one_warp_launch(_OP, maxnreg, num_splits, batch * kv_heads, max_tokens, q.device, MMA_PER_SM,
                                   resident=mma_resident(maxnreg))
    if step_blocks is None:
        step_blocks = mma_step_blocks(bits, num_splits, max_tokens, residual_length)
    check_step_blocks(step_blocks)  # a given value, or MMA_STEP_BLOCKS when set
    caches = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens)
    meta = dict(QG=q_heads // kv_heads, GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size, STAGES=stages,
                V_COPY=VALUE_COPIES[value_copy], RING_UNITS=ring_units, BITS=bits, STEP_BLOCKS=step_blocks,
                num_warps=1, maxnreg=maxnreg)
    if ring_pass:
        return _launch_with_ring_pass(q, caches, out, sm_scale, group_size, residual_length, num_splits, **meta)
    return C.launch_kivi(_decode_attention_mma_kernel, q, caches, out, sm_scale, num_splits, RING_PASS=False,
                         PDL=num_splits > 1 and C.programmatic_launch(q.device), **meta)


def check_ring_pass(ring_pass: bool | None) -> None:
    """A clear error for a ring_pass that is not None, True or False, on every path of the call."""
    if ring_pass is not None and not isinstance(ring_pass, bool):
        raise ValueError(f"{_OP}: ring_pass must be None, True or False, got {ring_pass!r}")


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _launch_with_ring_pass(q, caches, out, sm_scale, group_size, residual_length, num_splits, **meta):
    """The kernel over the packed blocks alone (RING_PASS) in num_splits splits of a workspace of num_splits + 1,
    the ring pass (ops_ring) into the last split on a side stream launched after it, then the split merge once
    both are done. The side stream waits only for what came before the call, so its programs take the SM room that
    the kernel's 212-register programs leave (a CUDA graph captured over the call keeps the fork and the join)."""
    batch, q_heads, head_dim = q.shape
    ws_o = torch.empty((batch, q_heads, num_splits + 1, head_dim), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((batch, q_heads, num_splits + 1), dtype=torch.float32, device=q.device)
    if q.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[q.device] = torch.cuda.Stream(q.device)
    side = _SIDE_STREAMS[q.device]
    main = torch.cuda.current_stream(q.device)
    start = main.record_event()

    k_res, v_res, _, slots, seq_lens = caches[6:]

    def ring_pass_then_join():
        side.wait_event(start)
        with torch.cuda.stream(side):
            launch_ring_partial(q, k_res, v_res, slots, seq_lens, ws_o[:, :, num_splits], ws_lse[:, :, num_splits],
                                sm_scale, group_size, residual_length)
        main.wait_stream(side)

    return C.launch_kivi(_decode_attention_mma_kernel, q, caches, out, sm_scale, num_splits, workspace=(ws_o, ws_lse),
                         before_merge=ring_pass_then_join, RING_PASS=True, PDL=False, **meta)
