"""bench_engine's report: the derived fields of a record, a table row per record, the summary's compact records
and the speedups the issue's targets are stated in."""

from __future__ import annotations

import torch
from engine_probe import split_system
from engine_setup import peak_gib


def fmt_num(x, spec: str) -> str:
    width = int(spec.split(".")[0].rstrip("df") or 0)
    return "-".rjust(width) if x is None else format(x, spec)


TABLE_HEAD = (f"{'model':10} {'wl':2} {'cap':>3} {'system':26} {'tok/s':>8} {'flight':>6} {'ms/step':>8} "
              f"{'bound':>7} {'x':>5} {'peakGiB':>7} {'done':>9} {'wall':>6}  status")


def table_row(r: dict) -> str:
    done = f"{r.get('num_prompts_done', '-')}/{r.get('num_prompts', '-')}"
    return (f"{r['model']:10} {r['workload']:2} {r['cap_gib']:>3g} {r['system']:26} "
            f"{fmt_num(r.get('output_tokens_per_s'), '8.1f')} {fmt_num(r.get('max_in_flight'), '6d')} "
            f"{fmt_num(r.get('ms_per_decode_step'), '8.2f')} {fmt_num(r.get('decode_bound_ms'), '7.2f')} "
            f"{fmt_num(r.get('step_over_bound'), '5.2f')} {fmt_num(r.get('peak_allocated_gib'), '7.2f')} "
            f"{done:>9} {fmt_num(r.get('wall_s'), '6.1f')}  {r['status'][:70]}")


SUMMARY_KEYS = ("system", "model", "workload", "cap_gib", "status", "output_tokens_per_s", "max_in_flight",
                "peak_allocated_gib", "ms_per_decode_step", "decode_bound_ms", "num_prompts_done", "num_prompts",
                "wall_s")


def speedups(records: list[dict]) -> dict:
    """engine-kivi-2 tokens/s over hf-bf16 and engine-bf16, per model/workload/cap (the issue's targets)."""
    rate = {(r["model"], r["workload"], r["cap_gib"], r["system"]): r.get("output_tokens_per_s") for r in records}
    out = {}
    for (model, wl, cap, system), kivi2 in rate.items():
        if split_system(system)[0] != "engine-kivi-2" or not kivi2:
            continue
        name = system.replace("engine-kivi-2", "kivi2").replace("/", "+")  # keys are "/"-separated
        for peer in ("hf-bf16", "engine-bf16", "engine-kivi-2"):
            if peer != system and rate.get((model, wl, cap, peer)):
                out[f"{model}/{wl}/{cap:g}/{name}_over_{peer}"] = round(kivi2 / rate[(model, wl, cap, peer)], 2)
    return out


def compact(r: dict) -> dict:
    out = {k: r.get(k) for k in SUMMARY_KEYS}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def finish_record(rec: dict, n: int, device: torch.device) -> dict:
    """Derived fields shared by hf and engine records."""
    wall, steps, bound_steps = rec["wall_s"], rec["decode_steps"], rec["bound_steps"]
    rec["output_tokens_per_s"] = rec["output_tokens"] / wall if wall > 0 else None
    rec["ms_per_decode_step"] = 1e3 * rec["decode_s"] / steps if steps else None
    rec["decode_bound_ms"] = 1e3 * rec["decode_bound_s"] / bound_steps if bound_steps else None
    rec["decode_compute_bound_ms"] = 1e3 * rec["decode_compute_s"] / bound_steps if bound_steps else None
    rec["decode_floor_ms"] = 1e3 * rec["decode_floor_s"] / bound_steps if bound_steps else None
    if rec["ms_per_decode_step"] and rec["decode_bound_ms"]:
        rec["step_over_bound"] = rec["ms_per_decode_step"] / rec["decode_bound_ms"]
    if rec["ms_per_decode_step"] and rec.get("weights_read_ms"):  # issue 3: within 2x of it at batch 8
        rec["step_over_weights"] = rec["ms_per_decode_step"] / rec["weights_read_ms"]
    rec["mean_decode_batch"] = rec["decode_rows"] / bound_steps if bound_steps else None
    pk = peak_gib(device)
    rec["peak_allocated_gib"] = max(x for x in (pk, rec.get("build_peak_gib")) if x is not None) if pk else None
    if rec["num_prompts_done"] < n:
        rec["status"] = f"partial: {rec['num_prompts_done']}/{n} prompts done in the time limit"
    else:
        rec["status"] = "ok"
    if rec.get("request_errors"):
        rec["status"] += f"; {rec['request_errors']} request errors"
    if rec.get("wrong_length_completions"):
        rec["status"] += f"; {rec['wrong_length_completions']} completions of the wrong length"
    return rec
