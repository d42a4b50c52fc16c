"""store_prefill / store_decode launch options and checks: every tuning (channel chunks, warps, the decode
store's loop over a head's chunks) against the reference through a flush, clear errors for bad tuning and bad
tensors, the CPU without the interpreter, and an H200 compile check that needs no GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kivi_kernels.kv_store import ops
from tests.kv_store_cases import BACKENDS, DEVICE, POOLS, SPEC, assert_same, cfg_of, make_batch, make_pools, seeded

# D, G, block_c, num_warps, loop_chunks: chunks of keys and values per program (D = 96: the last chunk is partly
# past D), and the decode store's loop over a head's chunks in one program
TUNINGS = [(96, 32, None, 1, False), (96, 32, 32, 2, False), (64, 16, 16, 1, False), (128, 32, 128, 4, False),
           (96, 32, 32, 1, True), (96, 32, None, 1, True), (64, 16, 16, 2, True), (128, 32, None, 1, True)]


@pytest.mark.parametrize("tuning", TUNINGS, ids=[f"D{t[0]}-G{t[1]}-c{t[2]}-w{t[3]}" + ("-loop" if t[4] else "")
                                                 for t in TUNINGS])
def test_triton_tuning_matches_reference(request, tuning):
    """Every channel-chunk width and warp count stores what the reference stores: a prefill, then decode
    appends through a flush (the prefill leaves a full ring behind)."""
    D, G, block_c, num_warps, loop_chunks = tuning
    cfg, dtype = cfg_of(2, 4, G=G, R=2 * G, P=2 * G), torch.float16
    B, H, N, lengths = 2, 2, 16, [3 * G + 5, 2 * G + 4]
    key, value, starts, lens, slots, bt = make_batch(seeded(request), B, H, 4 * G, D, lengths, dtype, num_pages=N)
    got, want = make_pools(N, B + 2, H, D, cfg, dtype), make_pools(N, B + 2, H, D, cfg, dtype)
    first = torch.tensor([2 * G + 1, 2 * G], dtype=torch.int32, device=DEVICE)  # row 1 flushes at its first append
    ops.store_prefill(key, value, starts, first, slots, bt, *(got[n] for n in POOLS), **cfg, block_c=block_c,
                      num_warps=num_warps)
    SPEC.store_prefill(key, value, starts, first, slots, bt, *(want[n] for n in POOLS), **cfg)
    rows = torch.arange(B, device=DEVICE)
    for step in range(4):
        pos = first + step
        seq_lens = torch.where(pos < lens, pos + 1, 0).int()
        at = (starts + pos).clamp(max=key.shape[2] - 1)
        ops.store_decode(key[rows, :, at], value[rows, :, at], seq_lens, slots, bt, *(got[n] for n in POOLS), **cfg,
                         block_c=block_c, num_warps=num_warps, loop_chunks=loop_chunks)
        SPEC.store_decode(key[rows, :, at], value[rows, :, at], seq_lens, slots, bt, *(want[n] for n in POOLS), **cfg)
    assert_same(got, want)


@pytest.mark.parametrize("heads", [1, 8, 16, 32])
def test_decode_store_loops_over_chunks_from_the_head_threshold(monkeypatch, heads):
    """The default decode store: one program per head's keys or values (grid z = 2) from STORE_LOOP_MIN_HEADS KV
    heads up, one per chunk below it; None turns the loop off; an explicit loop_chunks wins."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kw: grids.append((grid, kw["LOOP_CHUNKS"]))

    monkeypatch.setattr(ops, "store_decode_kernel", Recorder())
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, heads, 64, cfg, dtype)
    key = torch.zeros(1, heads, 64, dtype=dtype, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    store = lambda **kw: ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, **kw)
    store()
    looped = heads >= ops.STORE_LOOP_MIN_HEADS
    chunks = ops._launch_config(key, cfg["group_size"], None, None)["NC"]
    assert grids[-1] == ((1, heads, 2 if looped else 2 * chunks), looped)
    store(loop_chunks=not looped)
    assert grids[-1][1] is (not looped)
    monkeypatch.setattr(ops, "STORE_LOOP_MIN_HEADS", None)
    store()
    assert grids[-1] == ((1, heads, 2 * chunks), False)


def test_bad_tuning_is_a_clear_error():
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(1, 2, 64, dtype=dtype, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_c=48"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, block_c=48)
    with pytest.raises(ValueError, match="block_c=16 must be .* multiple of group_size=32"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, block_c=16)
    with pytest.raises(ValueError, match="num_warps"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, num_warps=3)


def test_validation_errors_name_the_tensor():
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(2, 2, 40, 64, dtype=dtype, device=DEVICE)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    args = [key, key.clone(), i32(0, 0), i32(40, 3), i32(0, 1), bt, *(pools[n] for n in POOLS)]
    for mod in BACKENDS.values():
        bad = list(args)
        bad[4] = i32(0, 1).long()
        with pytest.raises(TypeError, match="slots"):
            mod.store_prefill(*bad, **cfg)
        bad = list(args)
        bad[9] = pools["v_codes"][..., :-1]
        with pytest.raises(ValueError, match=r"v_codes must have shape \(8, 2, 64, 8\), got \(8, 2, 64, 7\)"):
            mod.store_prefill(*bad, **cfg)
        with pytest.raises(ValueError, match="group_size"):
            mod.store_prefill(*args, **{**cfg, "group_size": 24})
        with pytest.raises(ValueError, match=r"key must be \[B, H, D\]"):
            mod.store_decode(key, key, i32(1, 1), i32(0, 1), bt, *(pools[n] for n in POOLS), **cfg)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only check")
def test_triton_on_cpu_without_interpreter_points_to_reference(monkeypatch):
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(1, 2, 64, dtype=dtype)
    one = torch.ones(1, dtype=torch.int32)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="reference backend"):
        ops.store_decode(key, key, one, one, torch.zeros(3, 4, dtype=torch.int32), *(pools[n] for n in POOLS),
                         **cfg)


_COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from kivi_kernels.kv_store import kernel
INT_PTRS = {"starts_ptr", "lengths_ptr", "slots_ptr", "seq_lens_ptr", "block_table_ptr", "k_codes_ptr",
            "v_codes_ptr"}
out = []
for fn in (kernel.store_prefill_kernel, kernel.store_decode_kernel):
    for dtype, consts in json.loads(sys.argv[1]):
        data, scales = (dtype.split("/") * 2)[:2]  # "bf16/fp16": bf16 keys and ring, fp16 scales and zeros
        ptr_ty = lambda n: "*i32" if n in INT_PTRS else "*" + (scales if "scale" in n or "zero" in n else data)
        sig = {p.name: "constexpr" if p.is_constexpr else ptr_ty(p.name) if p.name.endswith("_ptr") else "i32"
               for p in fn.params}
        consts = {k: v for k, v in consts.items() if k in sig}  # LOOP_CHUNKS, BLOCK_D: the decode kernel's only
        src = triton.compiler.ASTSource(fn, sig, consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        out.append(dict(name=fn.__name__, dtype=dtype, cubin=len(k.asm["cubin"]),
                        ops=sorted(set(re.findall(r"\b(fma\.rn\.f32|div\.(?:rn|full|approx)\.f32|bar\.sync)", ptx)))))
print(json.dumps(out))
"""


def test_kernels_compile_for_h200(tmp_path):
    """Compile both kernels for sm_90 with the real JIT (a subprocess without TRITON_INTERPRET): no GPU
    needed. The PTX must use IEEE division and no fused multiply-add, or codes could differ from the
    reference, and the decode kernel must keep its barrier between the flush and the overwrite."""
    configs = [("fp16", dict(K_BITS=2, V_BITS=4, GROUP=32, RESIDUAL=128, PAGE=64, BLOCK_C=64, NC=1)),
               ("bf16", dict(K_BITS=4, V_BITS=2, GROUP=16, RESIDUAL=32, PAGE=48, BLOCK_C=64, NC=2)),
               ("bf16/fp16", dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, BLOCK_C=64, NC=2)),
               ("bf16/fp16", dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, BLOCK_C=32, NC=4,
                                  LOOP_CHUNKS=True, BLOCK_D=128))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real every time
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(configs)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for r in results:
        assert r["cubin"] > 0
        assert "div.rn.f32" in r["ops"] and "fma.rn.f32" not in r["ops"], r
        assert not any(o.startswith(("div.full", "div.approx")) for o in r["ops"]), r
        if r["name"] == "store_decode_kernel":
            assert "bar.sync" in r["ops"], r
