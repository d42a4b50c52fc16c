"""Compile Triton kernels for the H200 (sm_90) without a GPU, from any test process.

    from tests.compile_util import compile_for_sm90
    info = compile_for_sm90(my_kernel, {"x_ptr": "*fp16", "n": "i32"}, {"BLOCK": 128}, num_warps=4)

Runs `triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))` in a
subprocess with TRITON_INTERPRET removed (the interpreter replaces @triton.jit functions in a process
where it is set, so the compile must happen elsewhere). The kernel is re-imported there by module and name.

signature: {arg name: type} in triton 3.9's format: "*fp16", "*bf16", "*fp32", "*i32" (pointers), "i32",
"i64", "fp32" (scalars). Arguments that are neither in `signature` nor in `constexprs` take their default
value as a constexpr when the kernel gives one, else they are "i32" (strides and sizes); constexpr arguments
are typed "constexpr" automatically. options may name `aligned` arguments (pointers, strides), compiled as
divisible by 16 as Triton's launcher specializes them. Constexpr values may be
ints, floats, bools, strings, None or triton.language dtypes (tl.float16 ...).
Returns per kernel a dict: name, num_warps, shared (bytes), cubin_bytes, ptx_lines, and `ptx` / `ttgir`
text when keep_asm=True. A failed compile raises RuntimeError with the compiler's message.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys
import importlib
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

specs = json.loads(sys.stdin.read())
results = []
for spec in specs:
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    constexprs = {}
    for key, val in spec["constexprs"].items():
        if isinstance(val, dict) and "tl_dtype" in val:
            val = getattr(tl, val["tl_dtype"])
        constexprs[key] = val
    if getattr(fn, "is_gluon", lambda: False)():  # Gluon kernels (triton.experimental.gluon)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = triton.compiler.ASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in spec["aligned"]}
    src = source(fn, spec["signature"], constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    info = dict(name=compiled.metadata.name, num_warps=compiled.metadata.num_warps,
                shared=compiled.metadata.shared, cubin_bytes=len(compiled.asm["cubin"]),
                ptx_lines=compiled.asm["ptx"].count("\n"))
    if spec["keep_asm"]:
        info.update(ptx=compiled.asm["ptx"], ttgir=compiled.asm["ttgir"])
    results.append(info)
print("@@RESULT@@" + json.dumps(results))
"""

_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i32": "int32",
                "i64": "int64", "i8": "int8", "i16": "int16", "u8": "uint8", "fp8e4nv": "float8e4nv"}


def _encode_constexpr(val):
    import triton.language as tl

    if isinstance(val, tl.dtype):
        return {"tl_dtype": _DTYPE_NAMES.get(str(val), str(val))}
    if isinstance(val, tl.constexpr):
        return _encode_constexpr(val.value)
    return val


def _jit_function_location(fn) -> tuple[str, str]:
    inner = getattr(fn, "fn", fn)  # JITFunction wraps the Python function
    return inner.__module__, inner.__name__


def _spec(fn, signature: dict, constexprs: dict, options: dict | None, keep_asm: bool) -> dict:
    module, name = _jit_function_location(fn)
    arg_names = list(getattr(fn, "arg_names", []))
    unknown = set(signature) - set(arg_names) | set(constexprs) - set(arg_names)
    if unknown:
        raise ValueError(f"{name}: no such arguments {sorted(unknown)}; arguments are {arg_names}")
    # constexpr parameters left out take their default value from the kernel's signature
    params = inspect.signature(getattr(fn, "fn", fn)).parameters
    constexprs = {**{a: p.default for a, p in params.items() if a not in constexprs and a not in signature
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    full = {a: "constexpr" if a in constexprs else signature.get(a, "i32") for a in arg_names}
    options = dict(options or {})
    aligned = list(options.pop("aligned", ()))  # arguments Triton would specialize as divisible by 16
    return dict(module=module, name=name, signature=full,
                constexprs={k: _encode_constexpr(v) for k, v in constexprs.items()},
                options=options, aligned=aligned, keep_asm=keep_asm)


def compile_for_sm90_many(specs, *, keep_asm: bool = False, timeout: float = 300.0) -> list[dict]:
    """Compile several kernels in one subprocess: specs = [(fn, signature, constexprs, options), ...]."""
    payload = [_spec(*s, keep_asm=keep_asm) if len(s) == 4 else _spec(*s, None, keep_asm) for s in specs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(payload), capture_output=True,
                          text=True, env=env, cwd=root, timeout=timeout)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT@@")]
    if proc.returncode != 0 or not marker:
        err = proc.stderr if len(proc.stderr) < 8000 else proc.stderr[:4000] + "\n...\n" + proc.stderr[-4000:]
        raise RuntimeError(f"sm_90 compile failed (rc {proc.returncode}):\n{err}")
    return json.loads(marker[-1][len("@@RESULT@@"):])


def compile_for_sm90(fn, signature: dict, constexprs: dict, *, keep_asm: bool = False, **options) -> dict:
    """Compile one @triton.jit kernel for sm_90; options are triton.compile options (num_warps, num_stages)."""
    return compile_for_sm90_many([(fn, signature, constexprs, options)], keep_asm=keep_asm)[0]
