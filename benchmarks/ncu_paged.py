"""The paged bf16 decode-attention kernel alone, for ncu: B rows of L tokens, 32 query heads over H KV heads,
called twice (profile the second: --launch-skip 1 --launch-count 1 -k regex:_paged_decode_kernel). The L2
comparison in kernel_device.sh (NCU_L2=1) runs it beside the 2-bit kernel at the same shape
(`kernel_sweep.py --ncu --ncu-mma B,L`).

    ncu --clock-control none -k regex:_paged_decode_kernel --launch-skip 1 --launch-count 1 \\
        python benchmarks/ncu_paged.py --shape 64,4096 --kv-heads 32

--cpu-smoke: a small shape under TRITON_INTERPRET=1, checked against the reference (no ncu).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from kivi_data import P, make_paged_sets  # noqa: E402

D, HQ = 128, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="64,4096", metavar="B,L")
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--cpu-smoke runs the Triton kernel under TRITON_INTERPRET=1")
    B, L = (2, 300) if args.cpu_smoke else (int(x) for x in args.shape.split(","))
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    from kivi_kernels.paged_attention import reference
    from kivi_kernels.paged_attention.ops import paged_decode_attention

    data = make_paged_sets(B, L, HQ, args.kv_heads, D, device, n_sets=1, seed=5)
    q, k_pages, v_pages, table, slots, seq_lens = (data["q"][0], data["k_pages"], data["v_pages"], data["table"],
                                                   data["slots"][0], data["seq_lens"])
    for _ in range(2):
        out = paged_decode_attention(q, k_pages, v_pages, table, slots, seq_lens, sm_scale=D**-0.5, page_size=P)
    rows = [0, B - 1]  # the fp32 reference on two rows: a whole large batch would take gigabytes
    ref = reference.paged_decode_attention(q[rows], k_pages, v_pages, table, slots[rows], seq_lens[rows],
                                           sm_scale=D**-0.5, page_size=P)
    err = float((out[rows].float() - ref.float()).norm() / ref.float().norm())
    print(f"paged_bf16 B={B} L={L} H={args.kv_heads}: rel L2 against the reference {err:.1e}")
    if err > 2e-2:
        sys.exit("paged kernel disagrees with the reference")


if __name__ == "__main__":
    main()
