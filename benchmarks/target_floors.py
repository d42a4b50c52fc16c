"""What issue 3's engine targets would need of KIVI's decode step, from recorded H200 runs (CPU only, no GPU).

For each workload with an engine-bf16 and an engine-kivi-N record in the given bench_engine files, a per-request
model of the two engines: a request costs prompt_len prefilled tokens at c_p each and new_tokens decode steps
shared by the rows in flight,

    ms per request = prompt_len * c_p + new_tokens * step_ms / rows,

so that the throughput ratio is the bf16 cost over the KIVI cost. c_p is each record's own effective prefill cost
(its time outside decode steps over the prompt tokens of its output, output_tokens / new_tokens prompts), so the
model gives back each record's measured ratio exactly (a check: `model_ratio` beside `measured_ratio`); or the
matmul floor for both engines (2 x the linear layers' parameters per token at the run's measured matmul rate, no
attention FLOPs), which only raises the ratio, since both engines pay the same prefill per request.

From it, per workload:
- `ratio_kivi_at_floor` / `ratio_all_at_floor`: the ratio with KIVI's step at its decode floor (bench_engine's
  decode_floor_ms: the weights at max(bytes, FLOPs) plus the cache's bytes at copy bandwidth), with the measured
  prefill, or with both engines' prefill at the matmul floor as well; engine-bf16 stays as measured;
- `kivi_step_needed_ms` (and `_prefill_at_floor`): the KIVI step that the target ratio needs, over the floor, the
  bytes bound and the `component_floor_ms`: the step's matmuls as cuBLAS runs them at that width in CUDA graphs
  (probe_linear.py's record, the fastest width at or above the rows, either weight layout) plus the cache's bytes at
  copy bandwidth, with no other kernel and no gap. A needed step under the component floor means the target needs
  matmuls faster than cuBLAS and attention above copy bandwidth at once;
- with a profile_step.py record of the same system at the same rows (`--profiles`): `profile_floor_ms`, the
  step's kernels as profiled (matmuls, stores, norms, SiLU, sampling) with attention replaced by the cache's bytes
  at copy bandwidth, and no gaps between kernels.

    python benchmarks/target_floors.py --out target-floors.json

Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from common import finish  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE_RUNS = ("engine-20261202-h200-80s-a-silu.json", "engine-20261202-h200-80s-b-silu.json",
               "engine-20261202-h200-s36-be.json")
LINEAR_RUN = "linear-20261130-h200-graphs.json"
PROFILE_RUNS = ("profile-step-20261201-h200-a.json", "profile-step-20261130-h200-b150.json")
TARGETS = {"a": 2.0, "b": 2.0, "d": 2.0, "e": 3.5, "c": 1.0}  # issue 3: KIVI-2 over engine-bf16, Llama-2-7B, 40 GiB


def linear_params(model: dict) -> int:
    """Parameters of a Llama-shaped model's linear layers (q, k, v, o, gate, up, down; no embedding or head)."""
    hidden, layers, inter = model["hidden_size"], model["num_hidden_layers"], model["intermediate_size"]
    kv = hidden * model["num_key_value_heads"] // model["num_attention_heads"]
    return layers * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)


def matmul_ms_at(rows: float, linear: list[dict]) -> float | None:
    """The step's matmuls (32 layers and the head) at the fastest recorded width >= rows, either layout."""
    widths = [r for r in linear if r["rows"] >= rows]
    return min(min(r["step_matmul_ms"], r["step_matmul_t_ms"]) for r in widths) if widths else None


def profiled_ms(system: str, rows: float, profiles: list[dict]) -> dict | None:
    """profile_step's kernel groups (ms a step) of `system` at `rows` in flight (within 2%), or None."""
    for run in profiles:
        for prof in run["systems"]:
            same_rows = abs(prof["mean_batch"] - rows) <= 0.02 * rows
            if prof["system"] == system and prof.get("phase") == "decode" and same_rows:
                return dict(prof["groups_ms_per_step"], source=run["source"])
    return None


def request_ms(prompt_len: int, new_tokens: int, c_p_ms: float, step_ms: float, rows: float) -> float:
    """ms of engine time per request: its prefill plus its share of the decode steps."""
    return prompt_len * c_p_ms + new_tokens * step_ms / rows


def effective_prefill_ms(rec: dict) -> float:
    """ms per prompt token outside decode steps (prefill, admission, host work), over the prompts of the output."""
    prompts = rec["output_tokens"] / rec["new_tokens"]
    return (rec["wall_s"] - rec["decode_s"]) * 1e3 / (prompts * rec["prompt_len"])


def workload_record(kivi: dict, bf16: dict, header: dict, linear: list[dict], profiles: list[dict]) -> dict:
    """The model's numbers for one workload (see the module docstring)."""
    p, n = kivi["prompt_len"], kivi["new_tokens"]
    model = header["models"][kivi["model"]]
    c_floor = 2 * linear_params(model) / (header["matmul_tflops"] * 1e12) * 1e3
    c_k, c_b = effective_prefill_ms(kivi), effective_prefill_ms(bf16)
    rows_k, rows_b = kivi["mean_decode_batch"], bf16["mean_decode_batch"]
    step_k, step_b = kivi["ms_per_decode_step"], bf16["ms_per_decode_step"]
    floor_k, bound_k = kivi["decode_floor_ms"], kivi["decode_bound_ms"]
    cost_b, cost_b_floor = request_ms(p, n, c_b, step_b, rows_b), request_ms(p, n, c_floor, step_b, rows_b)
    target = TARGETS.get(kivi["workload"])
    matmul = matmul_ms_at(rows_k, linear)
    attention_bytes = bound_k - kivi["weights_read_ms"]
    component = matmul + attention_bytes if matmul is not None else None
    groups = profiled_ms(kivi["system"], rows_k, profiles)
    profile_floor = None
    if groups is not None:
        kernels = sum(v for k, v in groups.items() if k != "source" and not k.startswith("attention"))
        profile_floor = kernels + attention_bytes

    def needed(c_k_ms: float, c_b_cost: float) -> float:  # the KIVI step whose request cost meets the target
        return (c_b_cost / target - p * c_k_ms) * rows_k / n

    rec = dict(workload=kivi["workload"], model=kivi["model"], cap_gib=kivi["cap_gib"], system=kivi["system"],
               target_ratio=target, measured_ratio=kivi["output_tokens_per_s"] / bf16["output_tokens_per_s"],
               model_ratio=cost_b / request_ms(p, n, c_k, step_k, rows_k),
               kivi_rows=rows_k, bf16_rows=rows_b, kivi_step_ms=step_k, bf16_step_ms=step_b,
               kivi_floor_ms=floor_k, kivi_bound_ms=bound_k, kivi_step_over_floor=step_k / floor_k,
               kivi_prefill_us_per_token=1e3 * c_k, bf16_prefill_us_per_token=1e3 * c_b,
               prefill_floor_us_per_token=1e3 * c_floor,
               ratio_kivi_at_floor=cost_b / request_ms(p, n, c_k, floor_k, rows_k),
               ratio_all_at_floor=cost_b_floor / request_ms(p, n, c_floor, floor_k, rows_k),
               matmul_ms_cublas=matmul, attention_bytes_ms=attention_bytes, component_floor_ms=component,
               profile_floor_ms=profile_floor, profile_source=groups and groups["source"],
               profile_matmul_ms=groups and groups.get("matmul"))
    if target is not None:
        for suffix, step in (("", needed(c_k, cost_b)), ("_prefill_at_floor", needed(c_floor, cost_b_floor))):
            rec[f"kivi_step_needed_ms{suffix}"] = step
            rec[f"needed_over_floor{suffix}"] = step / floor_k
            rec[f"needed_over_bound{suffix}"] = step / bound_k
            rec[f"needed_over_component_floor{suffix}"] = step / component if component else None
            rec[f"needed_over_profile_floor{suffix}"] = step / profile_floor if profile_floor else None
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}


def records_of(path: Path, linear: list[dict], profiles: list[dict]) -> list[dict]:
    """One record per (workload, cap, KIVI system) of a bench_engine file that has engine-bf16 beside it."""
    run = json.loads(path.read_text())
    recs = [r for r in run["records"] if r.get("ms_per_decode_step") and r.get("output_tokens")]
    bf16 = {(r["model"], r["workload"], r["cap_gib"]): r for r in recs if r["system"] == "engine-bf16"}
    out = []
    for r in recs:
        peer = bf16.get((r["model"], r["workload"], r["cap_gib"]))
        if r["system"].startswith("engine-kivi") and peer is not None:
            out.append(dict(workload_record(r, peer, run["header"], linear, profiles), source=path.name,
                            copy_gbps=run["header"]["copy_bandwidth_gbs"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="*", default=[str(RESULTS / f) for f in ENGINE_RUNS],
                   help="bench_engine result files")
    p.add_argument("--linear", default=str(RESULTS / LINEAR_RUN), help="probe_linear.py result file")
    p.add_argument("--profiles", nargs="*", default=[str(RESULTS / f) for f in PROFILE_RUNS],
                   help="profile_step.py result files (decode phase)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    linear = json.loads(Path(args.linear).read_text())["records"]
    profiles = [dict(json.loads(Path(f).read_text()), source=Path(f).name) for f in args.profiles]
    records = [rec for path in args.runs for rec in records_of(Path(path), linear, profiles)]
    for rec in records:
        print(f"{rec['workload']} {rec['system']:14s} measured {rec['measured_ratio']:.2f}x (model "
              f"{rec['model_ratio']:.2f}x), KIVI step at floor {rec['ratio_kivi_at_floor']:.2f}x, all at floor "
              f"{rec['ratio_all_at_floor']:.2f}x; target {rec['target_ratio']}x needs a step of "
              f"{rec.get('kivi_step_needed_ms', float('nan')):.2f} ms against {rec['kivi_step_ms']:.2f} "
              f"(component floor {rec['component_floor_ms']:.2f}, profile floor {rec['profile_floor_ms'] or 0:.2f})",
              file=sys.stderr)
    finish(args.out, {"linear_source": Path(args.linear).name, "targets": TARGETS, "records": records})


if __name__ == "__main__":
    main()
