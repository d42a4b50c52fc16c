"""kernel_sweep's plans: which decode-attention variants run on which shapes, one plan per question asked of
the GPU (the notes in benchmarks/results/kernel_notes.md say what each answered)."""

from __future__ import annotations

# the tensor-core kernel's A/B shapes (B, L, query heads, KV heads): MHA and GQA, batch 1 to 256, the engine's
# workload b
MMA_SHAPES = [(8, 4096, 32, 32), (64, 4096, 32, 32), (256, 4096, 32, 32), (128, 1152, 32, 32), (64, 32768, 32, 32),
              (1, 131072, 32, 32), (8, 4096, 32, 8), (64, 4096, 32, 8), (256, 4096, 32, 8), (8, 32768, 32, 8),
              (1, 131072, 32, 8)]
# ... and the engine's b and e widths (Llama-2-7B at 40 GiB)
MMA_ENGINE_SHAPES = MMA_SHAPES + [(106, 1152, 32, 32), (64, 2304, 32, 32)]


def plan(name: str):
    """[(shape, [variant, ...]), ...]; shape = (B, L, Hq, H), variant = (impl, bits, tuning)."""
    if name == "profile":
        grid = []
        for bn, nw, ns, lazy in [(128, 4, 3, False), (128, 4, 3, True), (128, 8, 3, True), (64, 4, 3, True),
                                 (64, 4, 2, True), (64, 4, 4, True), (64, 4, 3, False), (64, 8, 3, True),
                                 (32, 4, 3, True), (32, 2, 3, True), (32, 1, 3, True), (16, 1, 3, True)]:
            grid.append(("new", 2, dict(block_n=bn, num_warps=nw, num_stages=ns, lazy=lazy)))
        out = []
        for B, L in [(8, 4096), (64, 4096), (8, 32768)]:
            for Hq, H in [(32, 32), (32, 8)]:
                vs = [("v1", 2, {})] + grid
                vs += [("new", 2, dict(block_n=64, num_warps=4, num_stages=3, lazy=True, per_sm=p)) for p in (2, 8)]
                vs += [("v1", 4, {}), ("new", 4, dict(block_n=64, num_warps=4, num_stages=3, lazy=True))]
                out.append(((B, L, Hq, H), vs))
        long = [("v1", 2, {})] + [("new", 2, dict(block_n=bn, num_warps=nw, num_stages=3, lazy=True, num_splits=s))
                                  for bn, nw in [(64, 4), (128, 4)] for s in (16, 32, 64)]
        out.append(((1, 131072, 32, 32), long))
        out.append(((1, 131072, 32, 8), long))
        return out
    if name == "diag":
        grid = [("new", 2, dict(block_n=bn, num_warps=nw, num_stages=ns, lazy=True, key_vec=kv))
                for bn, nw in [(128, 4), (64, 4), (32, 2), (32, 1)] for ns in (2, 3) for kv in (1, 4)]
        grid += [("new", 2, dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=2)),
                 ("new", 2, dict(block_n=32, num_warps=1, num_stages=2, lazy=False, key_vec=1))]
        out = []
        for B, L, Hq, H in [(8, 4096, 32, 32), (64, 4096, 32, 32), (8, 4096, 32, 8), (64, 4096, 32, 8),
                            (8, 32768, 32, 8)]:
            vs = [("v1", 2, {})] + grid + [("v1", 4, {})]
            vs += [("new", 4, dict(block_n=bn, num_warps=nw, num_stages=2, lazy=True, key_vec=kv))
                   for bn, nw in [(128, 4), (64, 4), (32, 1)] for kv in (1, 4)]
            out.append(((B, L, Hq, H), vs))
        long = [("v1", 2, {})] + [("new", 2, dict(block_n=bn, num_warps=nw, num_stages=2, lazy=True, key_vec=kv,
                                                   num_splits=s))
                                  for bn, nw in [(64, 4), (32, 1)] for kv in (1, 4) for s in (16, 32, 64)]
        out.append(((1, 131072, 32, 32), long))
        out.append(((1, 131072, 32, 8), long))
        return out
    if name == "swap":  # the swapped-operand loop (kernel_swap.py) against the tensor-core table
        def vs(extra=()):
            return ([("new", 2, dict(swap_ab=False)), ("new", 2, dict(swap_ab=True))]
                    + [("new", 2, dict(swap_ab=True, per_sm=p)) for p in (4, 16)] + list(extra))
        out = [((B, L, Hq, H), vs()) for B, L, Hq, H in [(8, 4096, 32, 32), (64, 4096, 32, 32), (256, 4096, 32, 32),
                                                        (128, 1024, 32, 32), (64, 4096, 32, 8), (8, 32768, 32, 8)]]
        out.append(((1, 131072, 32, 32), [("new", 2, dict(swap_ab=False))]
                    + [("new", 2, dict(swap_ab=True, num_splits=s)) for s in (64, 132, 264)]))
        return out
    if name == "fma":  # the Gluon FMA kernel (kernel_gluon.py, one query head per KV head) against the table
        def vs():
            return [("new", 2, {})] + [("new", 2, dict(fma=True, block_n=bn, maxnreg=r, per_sm=p))
                                       for bn, r, p in [(128, None, 16), (64, None, 16), (64, 168, 24), (64, 128, 32),
                                                        (128, 168, 24)]]
        out = [((B, L, 32, 32), vs()) for B, L in [(8, 4096), (64, 4096), (128, 1024), (8, 32768)]]
        long = [("new", 2, {})] + [("new", 2, dict(fma=True, block_n=bn, maxnreg=r, num_splits=128))
                                   for bn, r in [(128, None), (64, None), (64, 168), (64, 128)]]
        out.append(((1, 131072, 32, 32), long))
        return out
    if name == "async":  # the FMA kernel with cp.async stages (its default) against the plain loop
        def vs():
            return ([("new", 2, dict(fma=True, cp_async=False, maxnreg=128, per_sm=32))]
                    + [("new", 2, dict(fma=True, cp_async=True, per_sm=p)) for p in (24, 48, 96)])
        out = [((B, L, 32, 32), vs()) for B, L in [(8, 4096), (64, 4096), (128, 1152), (256, 4096), (8, 32768)]]
        out.append(((1, 131072, 32, 32), [("new", 2, dict(fma=True, cp_async=False, maxnreg=128, num_splits=128))]
                    + [("new", 2, dict(fma=True, cp_async=True, num_splits=s)) for s in (128, 192)]))
        return out
    if name == "caps":  # register caps for the cp.async loop: 168 (12 warps/SM), 152 (13), 144 (14, the default now)
        def vs():
            return [("new", 2, dict(fma=True, maxnreg=r, per_sm=p)) for r, p in
                    [(168, 48), (152, 48), (152, 52), (144, 48), (144, 56)]]
        out = [((B, L, 32, 32), vs()) for B, L in [(8, 4096), (64, 4096), (128, 1152), (256, 4096), (8, 32768)]]
        out.append(((1, 131072, 32, 32), [("new", 2, dict(fma=True, maxnreg=r, num_splits=128))
                                          for r in (168, 152, 144)]))
        return out
    if name == "magic":  # version 13's step (one LOP3 per code, per-lane value partials) against version 12's
        def vs():
            return [("new", 2, dict(fma=True, magic=False)), ("new", 2, dict(fma=True, magic=True)),
                    ("new", 2, dict(fma=True, magic=True, maxnreg=168))]
        out = [((B, L, 32, 32), vs()) for B, L in [(8, 4096), (64, 4096), (128, 1152), (256, 4096), (8, 32768)]]
        out.append(((1, 131072, 32, 32), [("new", 2, dict(fma=True, magic=False, num_splits=128)),
                                          ("new", 2, dict(fma=True, magic=True, num_splits=128))]))
        return out
    if name == "small":  # small MHA calls: the tensor-core table (the default below FMA_MIN_WORK) against FMA
        return [((B, L, 32, 32), [("new", 2, {}), ("new", 2, dict(fma=True))])
                for B, L in [(1, 512), (1, 2048), (1, 4096), (1, 16384), (2, 4096), (4, 2048), (8, 512), (8, 1024),
                             (16, 512), (32, 512)]]
    if name == "mma":  # version 14, the tensor-core kernel (kernel_mma.py), against the table (GQA) and FMA (MHA)
        def gqa():
            return ([("new", 2, dict(mma=False)), ("new", 2, dict(mma=True))]
                    + [("new", 2, dict(mma=True, maxnreg=r)) for r in (208, 232)]
                    + [("new", 2, dict(mma=True, per_sm=p)) for p in (16, 32)])
        out = [((B, L, 32, 8), gqa()) for B, L in [(8, 4096), (64, 4096), (256, 4096), (8, 32768), (128, 1152)]]
        out += [((B, L, 32, 32), [("new", 2, dict(fma=True)), ("new", 2, dict(mma=True)),
                                  ("new", 2, dict(mma=True, per_sm=16))]) for B, L in [(64, 4096), (128, 1152)]]
        out.append(((1, 131072, 32, 8), [("new", 2, dict(mma=False))]
                    + [("new", 2, dict(mma=True, num_splits=s)) for s in (128, 192)]))
        return out
    if name == "fp16":  # version 15: fp16 scales fold in by packed HMUL2 (bf16 and fp16 data), against bf16
        both = [("new", 2, dict(mma=True, scale_dtype="bfloat16")), ("new", 2, dict(mma=True)),  # scales (fp32 math)
                ("new", 2, dict(mma=True, dtype="float16"))]
        return [((B, L, Hq, H), both) for B, L, Hq, H in [
            (8, 4096, 32, 32), (64, 4096, 32, 32), (256, 4096, 32, 32), (128, 1152, 32, 32), (1, 131072, 32, 32),
            (8, 4096, 32, 8), (64, 4096, 32, 8), (256, 4096, 32, 8), (8, 32768, 32, 8), (1, 131072, 32, 8)]]
    if name == "stages":  # the mma kernel's cp.async stages: 2 (one block in flight) against 3 (two)
        both = [("new", 2, dict(mma=True)), ("new", 2, dict(mma=True, num_stages=3))]
        return [(shape, both) for shape in MMA_SHAPES]
    if name == "copies":  # the mma kernel's value copies (kernel_mma_stage.py): transposed against sectors, on
        # MMA_SHAPES and b's widths. Plans natural, rows and sectors compared versions 17, 19 and 20's copies
        # before 17 and 19 were removed
        both = [("new", 2, dict(mma=True, value_copy=c)) for c in ("transposed", "sectors")]
        return [(shape, both) for shape in MMA_SHAPES + [(92, 1280, 32, 32), (141, 1152, 32, 32)]]
    if name == "waves":  # the mma kernel's split count: whole waves of 8 resident programs (the default) against
        # 16 programs per SM (the default before), on equal rows and on the engine's widths
        both = [("new", 2, dict(mma=True, per_sm=16)), ("new", 2, dict(mma=True))]
        return [((B, L, Hq, H), both) for B, L, Hq, H in [
            (8, 4096, 32, 32), (8, 32768, 32, 32), (64, 4096, 32, 8), (64, 32768, 32, 8), (8, 4096, 32, 8),
            (256, 4096, 32, 32), (1, 131072, 32, 8), (141, 1152, 32, 32), (92, 1280, 32, 32), (238, 330, 32, 32),
            (64, 4096, 32, 32)]]
    if name == "waves2":  # the rule's second form: unsplit from a wave of programs up (B=256 32/8: 2 -> 1)
        both = [("new", 2, dict(mma=True, per_sm=16)), ("new", 2, dict(mma=True))]
        return [((B, L, Hq, H), both) for B, L, Hq, H in [
            (256, 4096, 32, 8), (64, 32768, 32, 32), (141, 1152, 32, 32), (64, 4096, 32, 8)]]
    if name == "waves3":  # batch 1, 32 KV heads: the default's 66 splits (two waves) against 32 (one whole wave)
        both = [("new", 2, dict(mma=True)), ("new", 2, dict(mma=True, num_splits=32))]
        return [((1, 131072, 32, 32), both), ((1, 32768, 32, 32), both)]
    if name == "waves4":  # wave_splits' fewest fitting count (the default) against the counts it replaced
        return [((B, L, Hq, H), [("new", 2, dict(mma=True)), ("new", 2, dict(mma=True, num_splits=old))])
                for B, L, Hq, H, old in [(1, 131072, 32, 32, 66), (1, 32768, 32, 32, 66), (1, 131072, 32, 8, 128),
                                         (8, 32768, 32, 8, 33), (4, 4096, 32, 32, 16)]]
    if name == "ring":  # ring-heavy engine shapes (the full-precision residual is 40-100% of the bytes)
        mma = [("new", 2, dict(mma=True))]
        return [((B, L, 32, H), mma) for B, L, H in [
            (128, 128, 32), (128, 256, 32), (128, 640, 32), (128, 1152, 32), (238, 330, 32), (92, 1280, 32),
            (128, 128, 8), (128, 1152, 8)]]
    if name == "ringshare":  # the ring in 32-slot chunks over the splits (2 or 3 units a chunk) against the whole
        # ring in one split (0, version 20); at B=8, 32/8, L=4,096 also fewer splits, which balance better now
        vs = [("new", 2, dict(mma=True, ring_units=u)) for u in (0, 2, 3)]
        out = [(shape, vs) for shape in MMA_SHAPES + [(238, 330, 32, 32), (4, 4096, 32, 8), (8, 1152, 32, 8)]]
        out.append(((8, 4096, 32, 8), [("new", 2, dict(mma=True, ring_units=u, num_splits=s))
                                       for u in (2, 3) for s in (8, 11, 13)]))
        return out
    if name == "wide":  # above a wave of programs, with the ring shared out (version 21): 1, 2 and 3 splits on the
        # engine's widths (b: 141-150 rows of 1,152-1,280; e: 96 of 1,280-2,304; a: 256 of 330), where 4.3-4.5
        # waves of unsplit programs leave the last wave mostly idle (version 17b measured this with the whole ring
        # in one split, and lost)
        vs = [("new", 2, dict(mma=True, num_splits=s)) for s in (1, 2, 3)]
        return [((B, L, 32, 32), vs) for B, L in [(141, 1152), (150, 1152), (150, 1280), (96, 1280), (96, 2304),
                                                   (256, 330)]]
    if name == "mma4":  # 4-bit caches: the tensor-core kernel (BITS=4, kernel_mma_frag4.py) against the table
        # kernel that ran them before (mma=False), on MMA_SHAPES and the engine's b and e widths
        vs = [("new", 4, dict(mma=False)), ("new", 4, dict(mma=True))]
        return [(shape, vs) for shape in MMA_ENGINE_SHAPES]
    if name == "mma4-stages":  # 4-bit caches on the tensor-core kernel: two cp.async stages (the default) or three
        # (two 10 KiB blocks in flight; 30 KiB a program, 7 an SM), the split count as the launcher picks it
        # and, under a wave, three stages with the split count filling whole waves of 7
        from kernel_sweep import max_tokens_of

        from kivi_kernels.decode_attention.common import ONE_WARP_MAX_SPLITS, wave_splits

        out = []
        for B, L, Hq, H in MMA_ENGINE_SHAPES:
            vs = [("new", 4, dict(mma=True, num_stages=2)), ("new", 4, dict(mma=True, num_stages=3))]
            if B * H < 7 * 132:
                splits = wave_splits(B * H, max_tokens_of(L), 7 * 132, ONE_WARP_MAX_SPLITS)
                vs.append(("new", 4, dict(mma=True, num_stages=3, num_splits=splits)))
            out.append(((B, L, Hq, H), vs))
        return out
    if name == "mma4-sectors":  # 4-bit value words: version 22's 4-byte transposed copy against 16-byte pieces
        # as they lie (version 24, the 2-bit default's layout with a second chunk bit)
        vs = [("new", 4, dict(mma=True, value_copy="transposed")), ("new", 4, dict(mma=True, value_copy="sectors"))]
        return [(shape, vs + vs[:1]) for shape in MMA_ENGINE_SHAPES]
    if name in ("pairs", "pairs4"):  # one online-softmax step a 64-token block (the default) or two (versions
        # 25-26), the split count as the launcher picks it; A/B/A; pairs4 at 4 bits (40 KiB of stages, 5 an SM)
        bits = 4 if name == "pairs4" else 2
        vs = [("new", bits, dict(mma=True, step_blocks=1)), ("new", bits, dict(mma=True, step_blocks=2))]
        return [(shape, vs + vs[:1]) for shape in MMA_ENGINE_SHAPES]
    if name == "miss-splits":  # 2-bit: the shapes that miss issue 5's targets, at other split counts with one or
        # two blocks a step (version 26 made pairs cheaper, which may favour fewer, longer programs); the
        # launcher's default first and last
        tries = {(8, 4096, 32, 32): [(2, 2), (3, 2), (4, 2), (8, 1)], (8, 4096, 32, 8): [(8, 1), (8, 2), (4, 2)],
                 (64, 4096, 32, 8): [(1, 1), (1, 2), (2, 2), (3, 1)], (8, 32768, 32, 8): [(8, 2), (12, 2), (16, 2)],
                 (1, 131072, 32, 8): [(63, 2), (84, 2), (126, 2), (63, 1)], (1, 131072, 32, 32): [(16, 2), (24, 2)]}
        out = []
        for shape, knobs in tries.items():
            vs = [("new", 2, dict(mma=True, num_splits=s, step_blocks=sb)) for s, sb in knobs]
            out.append((shape, [("new", 2, dict(mma=True))] + vs + [("new", 2, dict(mma=True))]))
        return out
    if name == "fill-wave":  # one-wave split calls: the launcher's count (since this plan's first run, as many splits
        # as the wave holds) against the fewest fitting count it replaced (a program's share is ceil(units / splits):
        # 2,054 units in 126 splits is 17, in 132 is 16); the first run also had 130 and 132 explicitly
        tries = {(1, 131072, 32, 8): 126, (1, 32768, 32, 8): 126}
        return [(shape, [("new", bits, dict(mma=True)), ("new", bits, dict(mma=True, num_splits=old)),
                         ("new", bits, dict(mma=True))]) for shape, old in tries.items() for bits in (2, 4)]
    if name == "ring-regs":  # ring-heavy rows (all ring at L=128, a's 330, b's 1,152): ncu put the ring-only call at
        # 7.7 warps an SM (212 registers) with 0.17 eligible a scheduler, the paged bf16 kernel at 19.4; register caps
        # that fit more one-warp programs an SM, the default (255) first and last
        vs = [("new", 2, dict(mma=True))] + [("new", 2, dict(mma=True, maxnreg=r)) for r in (168, 128)]
        return [((B, L, 32, 32), vs + vs[:1]) for B, L in ((256, 128), (256, 330), (150, 1152))]
    if name == "mma4-lanes":  # the 4-bit default alone, to run from two trees in one call (the 4-bit value
        # copy's lane order, kernel_notes.md, version 24's last note)
        return [(shape, [("new", 4, dict(mma=True))]) for shape in MMA_ENGINE_SHAPES]
    raise SystemExit(f"unknown plan {name}")
