"""bench_kernels' cache-store cases: quantize-and-pack at prefill and the residual flush at decode."""

from __future__ import annotations

import torch
from kernel_cases import DEV, DTYPE, G, finish, gen, guarded, n_sets, record, rel_l2, timed
from kivi_data import KIVI_POOLS, P, R, kivi_bytes, make_kivi_sets


# --------------------------------------------------------------------------------------------------- stores
def decode_store_bytes(B, H, D, bits, esize=2, flushed=None) -> int:
    """One appended token per row (read k/v, write their ring slots) after a flush, in `flushed` rows (default
    all), that reads G residual tokens and writes their codes, one key scale/zero row and G value scale/zero
    rows."""
    F = B if flushed is None else flushed
    token = 2 * 2 * B * H * D * esize
    group = 2 * F * H * G * D * esize + F * H * G * D * 2 * bits // 8
    scales = F * H * D * 2 * esize + F * H * G * (D // G) * 2 * esize
    return token + group + scales


SUFFIX = {"new": "", "v0": "_v0"}  # record names: quantize_pack, quantize_pack_v0, ...
# launch configurations --tune tries beside the default: (block_c, num_warps)
STORE_CANDIDATES = [(32, 1), (64, 1), (128, 1), (64, 2), (128, 2), (128, 4)]
# store_decode with one program per head's keys or values (loop_chunks; the default from
# kv_store.ops.STORE_LOOP_MIN_HEADS KV heads up) and with one per chunk, each forced: run beside the default in
# every store run, on the flush and the append cases (kernels-20261130-h200-stores-loop.json also had block_c=32 with 1
# and 2 warps: slower than the default block_c on every case)
LOOP_TUNINGS = [dict(loop_chunks=True), dict(loop_chunks=False)]


def store_ops(impl: str):
    """(store_prefill, store_decode) of our kernels ("new") or of the kernels before the channel-chunk rewrite
    ("v0": one 4-warp program per group; kept out of the tree, see bench_kernels --store-baseline)."""
    if impl == "v0":
        import store_ops_v0

        return store_ops_v0.store_prefill_v0, store_ops_v0.store_decode_v0
    from kivi_kernels.kv_store import ops as kv_ops

    return kv_ops.store_prefill, kv_ops.store_decode


def check_stores(rec: dict, pools: list, ref: list) -> None:
    """Codes exactly equal to the reference's (keys, values) and the residual ring's relative L2."""
    rec["check_codes_equal"] = bool(torch.equal(ref[0], pools[0]) and torch.equal(ref[3], pools[3]))
    rec["check_rel_l2"] = rel_l2(pools[6], ref[6])


def store_tunings(tune: bool) -> list[dict]:
    """The default launch ({}) and, with --tune, the explicit candidates."""
    return [{}] + ([dict(block_c=c, num_warps=w) for c, w in STORE_CANDIDATES] if tune else [])


def bench_store_prefill(B, T, H, D, bits, copy_gbps, tuning: dict | None = None, impl: str = "new") -> dict:
    from kivi_kernels.kv_store import reference as kv_ref

    nbytes = 2 * B * H * T * D * 2 + kivi_bytes(B, T, H, H, D, bits, bits) - 2 * B * H * D * 2
    tuning = tuning or {}
    rec = record("quantize_pack" + SUFFIX[impl], bits, B, T, H, H, D, copy_gbps, tuning=tuning)
    store_prefill, _ = store_ops(impl)

    def body(rec):
        k_sets = n_sets(nbytes, max_sets=16)
        data = make_kivi_sets(B, T, H, H, D, bits, bits, DTYPE, DEV, k_sets, seed=21)
        kv = torch.randn(2, k_sets, B, H, T, D, device=DEV, dtype=DTYPE, generator=gen(22))
        starts = torch.zeros(B, dtype=torch.int32, device=DEV)
        pools = [data["pools"][n] for n in KIVI_POOLS]
        ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)

        def one(i, pools=pools):
            s = data["sets"][i]
            store_prefill(kv[0, i], kv[1, i], starts, s["seq_lens"], s["slots"], s["block_table"], *pools, **ints,
                          **tuning)
        one(0)
        ref = [x.clone() for x in pools]
        s = data["sets"][0]
        kv_ref.store_prefill(kv[0, 0], kv[1, 0], starts, s["seq_lens"], s["slots"], s["block_table"], *ref, **ints)
        check_stores(rec, pools, ref)
        del ref
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    return guarded(rec, 20 * nbytes + 2**30, body)


FLUSHING = {"all": "residual_flush", "staggered": "residual_append", "none": "residual_append_only"}


def bench_store_flush(B, H, D, bits, copy_gbps, L=4096, tuning: dict | None = None, impl: str = "new",
                      flushing: str = "all") -> dict:
    """Every row flushes its oldest group (flushing="all": residual_flush); "staggered": only rows b % G == 0 do,
    as in an engine's step of rows of different lengths (residual_append: row b holds L + 1 - b % G tokens;
    bench_kernels gives it L=1,152, b's length, whose pools fit 16 sets where L=4,096's would not); "none": no
    row does, as at 31 of 32 steps of rows that started together (residual_append_only: every row holds L)."""
    from kivi_kernels.kv_store import reference as kv_ref

    if flushing not in FLUSHING:
        raise ValueError(f"flushing must be one of {list(FLUSHING)}, got {flushing!r}")
    seq = L + 1  # token L is appended; (L - R) % G == 0, so the oldest residual group is flushed first
    flushed = {"all": None, "staggered": -(-B // G), "none": 0}[flushing]
    nbytes = decode_store_bytes(B, H, D, bits, flushed=flushed)
    tuning = tuning or {}
    name = FLUSHING[flushing]
    rec = record(name + SUFFIX[impl], bits, B, seq, H, H, D, copy_gbps, tuning=tuning)
    _, store_decode = store_ops(impl)

    k_sets = n_sets(nbytes, max_sets=16)

    def body(rec):
        assert (seq - 1 - R) % G == 0
        data = make_kivi_sets(B, seq, H, H, D, bits, bits, DTYPE, DEV, k_sets, seed=23)
        kv = torch.randn(2, k_sets, B, H, D, device=DEV, dtype=DTYPE, generator=gen(24))
        pools = [data["pools"][n] for n in KIVI_POOLS]
        ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
        for s in data["sets"]:
            if flushing == "staggered":
                s["seq_lens"] = s["seq_lens"] - torch.arange(B, device=DEV, dtype=s["seq_lens"].dtype) % G
            elif flushing == "none":
                s["seq_lens"] = s["seq_lens"] - 1
        s = data["sets"][0]
        ref = [x.clone() for x in pools]
        store_decode(kv[0, 0], kv[1, 0], s["seq_lens"], s["slots"], s["block_table"], *pools, **ints, **tuning)
        kv_ref.store_decode(kv[0, 0], kv[1, 0], s["seq_lens"], s["slots"], s["block_table"], *ref, **ints)
        check_stores(rec, pools, ref)
        del ref

        def one(i):  # every call repeats the same work (the flushed group is re-read and rewritten)
            s = data["sets"][i]
            store_decode(kv[0, i], kv[1, i], s["seq_lens"], s["slots"], s["block_table"], *pools, **ints, **tuning)
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    # k_sets sets of pools and the reference's clone of them
    return guarded(rec, 2 * k_sets * kivi_bytes(B, seq, H, H, D, bits, bits) + 2**30, body)
