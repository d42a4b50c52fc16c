"""The engine's side of bench_engine (and profile_step, step_gap): an EngineConfig per system name, the
set-up done before the timed call, and a probe on the model runner's calls (what it was asked to do, and a
deadline)."""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager


class TimeUp(Exception):
    """Raised inside the engine's generate() when the run reaches its time limit."""


def step_costs(weights: int, kv: int, rows: int, cached: int, bandwidth: float,
               flops: tuple[float, float, float] | None) -> tuple[float, float, float]:
    """Seconds of one decode step of `rows` rows holding `cached` tokens in all, whose KV cache is `kv` bytes:
    (bytes bound: weights and cache at the copy bandwidth; FLOP bound: flops = (per row, per cached token,
    FLOP/s); floor: the weights' products bound by their bytes or FLOPs, plus attention bound by the cache's
    bytes, separate kernels whose times add). Without flops the last two are 0."""
    bound = (weights + kv) / bandwidth
    if not flops:
        return bound, 0.0, 0.0
    per_row, per_token, rate = flops
    compute = (per_row * rows + per_token * cached) / rate
    return bound, compute, max(weights / bandwidth, per_row * rows / rate) + kv / bandwidth


class RunnerProbe:
    """Counts what the engine's model runner is asked to do; raises TimeUp past the deadline."""

    def __init__(self, read_table: list[int], weight_bytes: int, bandwidth: float, deadline: float,
                 flops: tuple[float, float, float] | None = None) -> None:
        """flops: (per row, per cached token, FLOP/s) for compute_s, the steps' FLOPs at that rate."""
        self.read_table, self.weights, self.bandwidth, self.deadline = read_table, weight_bytes, bandwidth, deadline
        self.flops = flops
        self.prefill_rows = self.steps = self.rows = 0
        self.bound_s = self.compute_s = self.floor_s = 0.0

    def check(self) -> None:
        if time.perf_counter() > self.deadline:
            raise TimeUp

    def on_prefill(self, prompts) -> None:
        self.check()
        self.prefill_rows += len(prompts)

    def on_decode(self, positions) -> None:
        self.check()
        self.steps += 1
        self.rows += len(positions)
        kv = sum(self.read_table[p + 1] for p in positions)  # row b caches positions[b] + 1 tokens
        cached = sum(p + 1 for p in positions)
        bound, compute, floor = step_costs(self.weights, kv, len(positions), cached, self.bandwidth, self.flops)
        self.bound_s += bound
        self.compute_s += compute
        self.floor_s += floor


@contextmanager
def instrumented_runner(probe: RunnerProbe):
    """Wrap ModelRunner.prefill/decode/decode_next (class-level, restored on exit) to feed `probe` (on_prefill,
    on_decode before each call, decode_next reported as a decode of the last rows one position on;
    after_prefill and after_decode, if the probe has them, after each call returns)."""
    from pipeline.actors.engine import model_runner

    cls = model_runner.ModelRunner
    orig_prefill, orig_decode = cls.prefill, cls.decode
    orig_next = getattr(cls, "decode_next", None)
    last = {"positions": []}

    def prefill(self, *args, **kwargs):
        probe.on_prefill(args[0] if args else kwargs["prompts"])
        logits = orig_prefill(self, *args, **kwargs)
        if hasattr(probe, "after_prefill"):
            probe.after_prefill()
        return logits

    def stepped(positions, run):
        probe.on_decode(positions)
        last["positions"] = positions
        logits = run()
        if hasattr(probe, "after_decode"):
            probe.after_decode()
        return logits

    def decode(self, *args, **kwargs):
        positions = list(args[1] if len(args) > 1 else kwargs["positions"])
        return stepped(positions, lambda: orig_decode(self, *args, **kwargs))

    def decode_next(self, tokens):
        return stepped([p + 1 for p in last["positions"]], lambda: orig_next(self, tokens))

    cls.prefill, cls.decode = prefill, decode
    if orig_next is not None:
        cls.decode_next = decode_next
    try:
        yield probe
    finally:
        cls.prefill, cls.decode = orig_prefill, orig_decode
        if orig_next is not None:
            cls.decode_next = orig_next


def build_engine(engine, requests) -> bool:
    """Plan and allocate the cache and capture the graphs for exactly these requests, as the first
    generate() call would, so that the timed generate() holds no set-up. False if the engine's private
    _build is not there (then the set-up happens inside the timed call)."""
    if not hasattr(engine, "_build"):
        return False
    # the engine's own sequences (their growth too: a plan for whole lengths would be another engine's)
    engine._build([engine.sequence(index, request) for index, request in enumerate(requests)])
    return True


# "<system>/<variant>" runs the system with one engine setting changed, for an A/B inside one run
VARIANTS = {
    "unfused": dict(fused_layers=False),  # transformers' own RMSNorm and rotary ops
    "separate": dict(fused_projections=False),  # q, k, v, gate and up as separate products
    "sync": dict(decode_ahead=False),  # the host reads each step's tokens before launching the next
    "model-scales": dict(),  # KIVI scales and zeros in the model's dtype (KIVI_VARIANTS)
    "untuned": dict(tune_buckets=False),  # each bucket's steps run at the bucket's own width
    "grow": dict(page_growth=True),  # rows that may stop early take pages as they grow (the default since 2026-12-02)
    "grow-half": dict(growth_plan_share=0.5),  # growing rows' slots planned for half their new tokens
    "whole-length": dict(page_growth=False),  # ... every row reserves its whole length (--stop-early makes them)
    "prefill8k": dict(max_prefill_tokens=8192),  # half the default prefill forward: a smaller workspace, more slots
    "prefill4k": dict(max_prefill_tokens=4096),
    "chunk-store": dict(),  # the decode store with a program per chunk at every head count (KERNEL_VARIANTS)
    "whole-mlp": dict(mlp_chunk_tokens=None),  # a prefill's MLPs on all its tokens at once (a larger workspace)
    "page-slack": dict(),  # the plan charges half a page more a sequence, as before (KERNEL_VARIANTS)
    "pairs": dict(),  # decode attention two 64-token blocks an online-softmax step (version 25; KERNEL_VARIANTS)
    "single": dict(),  # ... one block a step on every call (before version 25; KERNEL_VARIANTS)
    "silu-mul": dict(fused_silu_mul=True),  # SwiGLU MLPs' act_fn(gate) * up as one kernel (kivi_kernels/silu_mul)
    "separate-act": dict(fused_silu_mul=False),  # ... as transformers' two ops (the default before 2026-11-30)
    "head-major": dict(),  # decode attention's grid (B, H, splits), as before 2026-12-01 (KERNEL_VARIANTS)
    "arrival": dict(),  # decode rows in arrival order, not longest first (KERNEL_VARIANTS)
    "no-ring-pass": dict(),  # the ring read inside the tensor-core kernel, as before version 27 (KERNEL_VARIANTS)
    "full-table": dict(),  # decode graphs over the whole block table only, as before 2026-12-01 (KERNEL_VARIANTS)
}
KIVI_VARIANTS = {"model-scales": dict(scale_dtype="model")}  # the KiviConfig side of a variant
# the kernel side of a variant: (module, constant, value) set while the system runs (kernel_variant)
KERNEL_VARIANTS = {"chunk-store": ("kivi_kernels.kv_store.ops", "STORE_LOOP_MIN_HEADS", None),
                   "page-slack": ("pipeline.actors.engine.memory", "PAGE_SLACK", 0.5),
                   "pairs": ("kivi_kernels.decode_attention.ops_mma", "MMA_STEP_BLOCKS", 2),
                   "single": ("kivi_kernels.decode_attention.ops_mma", "MMA_STEP_BLOCKS", 1),
                   "head-major": ("kivi_kernels.decode_attention.common", "ROW_MAJOR", False),
                   "arrival": ("pipeline.actors.engine.scheduler", "LONGEST_FIRST", False),
                   "no-ring-pass": ("kivi_kernels.decode_attention.ops_mma", "MMA_RING_PASS", False),
                   "full-table": ("pipeline.actors.engine.model_runner", "SHORT_TABLE_TOKENS", None)}


@contextmanager
def kernel_variant(system: str):
    """Set a kernel default for a system's run (its graphs are captured inside it), then put it back."""
    spec = KERNEL_VARIANTS.get(split_system(system)[1] or "")
    if spec is None:
        yield
        return
    module = importlib.import_module(spec[0])
    before = getattr(module, spec[1])
    setattr(module, spec[1], spec[2])
    try:
        yield
    finally:
        setattr(module, spec[1], before)


def split_system(system: str) -> tuple[str, str | None]:
    """("engine-kivi-2", "sync") for "engine-kivi-2/sync"; raises ValueError on an unknown variant."""
    name, _, variant = system.partition("/")
    if variant and (not name.startswith("engine") or variant not in VARIANTS):
        raise ValueError(f"system {system!r}: variants are engine-<cache>/{{{','.join(VARIANTS)}}}")
    return name, variant or None


def engine_config(system: str, kivi_kw: dict | None = None, **engine_kw):
    """EngineConfig of an engine system: engine-bf16 (plain cache) or engine-kivi-<bits>, optionally with a
    /<variant> suffix (VARIANTS), which wins over engine_kw."""
    from kivi import KiviConfig
    from pipeline.actors.engine import EngineConfig

    name, variant = split_system(system)
    bits = None if name == "engine-bf16" else int(name.rsplit("-", 1)[1])
    engine_kw.update(VARIANTS.get(variant, {}))
    kivi_kw = {**(kivi_kw or {}), **KIVI_VARIANTS.get(variant, {})}
    return EngineConfig(kivi=None if bits is None else KiviConfig(k_bits=bits, v_bits=bits, **kivi_kw), **engine_kw)
