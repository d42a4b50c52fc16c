"""Pipeline plumbing without Ray or a model: prompts, the actor's rows and stats (with a fake engine), shard
assembly, and the CPU actor pool. Configuration and input planning are in test_pipeline_config.py."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import prompts, stats
from pipeline.actors.actor import GenerateActor, cpu_dtype_hint, cpu_has_native_bf16, resolve_dtypes
from pipeline.actors.engine import SamplingParams
from pipeline.config import JobConfig
from pipeline.io import plan_input
from pipeline.sink import OutputStore, ShardAssembler
from tests.pipeline_cases import FakeEngine, FakeTokenizer, fake_actor, write

# --- prompts ---


def test_cpu_dtype_hint_only_for_bf16_on_a_cpu_without_bf16(tmp_path):
    """The actor warns when a bfloat16 model runs on a CPU without bf16 hardware (4x slower matmuls than fp32 on
    the CI machine's AVX-512 Xeon), and only then: not on a GPU, not in another dtype, not where unknown."""
    assert "--dtype auto" in cpu_dtype_hint("bfloat16", False, False)
    for dtype, cuda, native in [("bfloat16", True, False), ("bfloat16", False, True), ("bfloat16", False, None),
                                ("float32", False, False), ("float16", False, False)]:
        assert cpu_dtype_hint(dtype, cuda, native) is None
    cases = {"flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile": True, "flags : fpu amx_bf16": True,
             "Features\t: fp asimd bf16 i8mm": True, "flags\t\t: fpu avx2 avx512f avx512_vnni": False,
             "Features\t: fp asimd sve": False}
    for text, native in cases.items():
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\n{text}\n")
        assert cpu_has_native_bf16(str(tmp_path / "cpuinfo")) is native, text
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is None


def test_auto_dtype_is_float32_over_a_bf16_cache_only_on_a_cpu_without_bf16():
    """--dtype auto: bfloat16 on a GPU, on a CPU with bf16 arithmetic and where the flags are unknown; float32 over a
    bf16 cache on a CPU known to lack it; a dtype given is kept, with the model's own cache."""
    assert resolve_dtypes("auto", False, False) == ("float32", "bfloat16")
    for cuda, native in [(True, None), (True, False), (False, True), (False, None)]:
        assert resolve_dtypes("auto", cuda, native) == ("bfloat16", None)
    for dtype in ("float32", "float16", "bfloat16"):
        assert resolve_dtypes(dtype, False, False) == (dtype, None)
    assert cpu_dtype_hint(*resolve_dtypes("auto", False, False)[:1], False, False) is None  # auto needs no hint


def test_time_per_output_token_counts_the_tokens_decode_steps_made():
    """A row's time per token: decode_s over its tokens after the first, less the one each rebuild after a
    preemption made (its time is not in decode_s); None where no decode step made a token."""
    from pipeline.actors.actor import _time_per_output_token
    from pipeline.actors.engine.request import Completion

    n, preempted, decode_s = random.randint(5, 40), random.randint(1, 3), random.uniform(0.5, 2.0)
    row = Completion("r", "", list(range(n)), 3, "length", decode_s=decode_s)
    assert _time_per_output_token(row) == pytest.approx(decode_s / (n - 1))
    row.preemptions = preempted
    assert _time_per_output_token(row) == pytest.approx(decode_s / (n - 1 - preempted))
    row.preemptions = n - 1  # every token after the first from a rebuild
    assert _time_per_output_token(row) is None
    assert _time_per_output_token(Completion("r", "", [7], 3, "length", decode_s=0.0)) is None
    assert _time_per_output_token(None) is None


def test_prompt_sources():
    tok = FakeTokenizer()
    assert prompts.prompt_text({"prompt": "hi"}, "prompt", None, tok, chat=False) == "hi"
    assert prompts.prompt_text({"prompt": "hi"}, "prompt", None, tok, chat=True) == "<user> hi <assistant>"
    msgs = json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert prompts.prompt_text({"messages": msgs}, "messages", None, tok, False).startswith("<system> be brief")
    row = {"context": "Paris is in France.", "question": "Where is Paris?"}
    text = prompts.prompt_text(row, "template", "Context: {context}\nQ: {question}", tok, False)
    assert text == "Context: Paris is in France.\nQ: Where is Paris?"


@pytest.mark.parametrize(
    "row, source, message",
    [
        ({"prompt": None}, "prompt", "null"),
        ({"prompt": "  "}, "prompt", "empty"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": None}, "messages", "null"),
        ({"messages": [{"role": "user"}]}, "messages", "content"),
        ({"messages": "[oops"}, "messages", "JSON"),
        ({"context": None, "question": "q"}, "template", "null"),
    ],
)
def test_bad_prompts(row, source, message):
    with pytest.raises(ValueError, match=message):
        prompts.prompt_text(row, source, "{context} {question}", FakeTokenizer(), False)


def test_row_sampling_overrides():
    defaults = SamplingParams(max_new_tokens=8, temperature=0.5)
    assert prompts.sampling({}, defaults) == defaults
    got = prompts.sampling({"sampling_params": {"max_new_tokens": 2, "top_k": None, "stop": ["."]}}, defaults)
    assert (got.max_new_tokens, got.temperature, got.top_k, got.stop) == (2, 0.5, 0, (".",))
    assert prompts.sampling({"sampling_params": '{"seed": 3}'}, defaults).seed == 3
    for bad in ({"temperature": -2}, {"bogus": 1}, "[1]"):
        with pytest.raises(ValueError):
            prompts.sampling({"sampling_params": bad}, defaults)


# --- the actor, with the fake engine ---


def test_actor_rows_and_errors():
    actor = fake_actor(max_new_tokens=3)
    batch = pa.table(
        {
            "id": [10, 11, 12, 13, 14],
            "prompt": ["a b c", None, "", "w " * 60, "d e"],
            "sampling_params": [None, None, None, None, {"max_new_tokens": 1}],
            "meta": [{"k": i} for i in range(5)],
        }
    )
    out = actor(batch)
    assert out.num_rows == 5
    assert "prompt" not in out.column_names and "sampling_params" not in out.column_names
    assert out["meta"].to_pylist() == [{"k": i} for i in range(5)]
    assert out["finish_reason"].to_pylist() == ["length", "error", "error", "error", "length"]
    assert out["num_generated_tokens"].to_pylist() == [3, 0, 0, 0, 1]
    assert out["num_input_tokens"].to_pylist() == [3, 0, 0, 60, 2]
    errors = out["error"].to_pylist()
    assert errors[0] is None and "null" in errors[1] and "empty" in errors[2] and "60 tokens" in errors[3]
    assert out["generated_text"].to_pylist()[1] is None
    assert set(out[stats.hidden("device_name")].to_pylist()) == {"fake"}
    shard = stats.shard_stats("s", out, {"kv_bits": 2, "group_size": 32, "residual_length": 128, "model": "m"})
    assert shard[0]["num_failed"] == 3 and shard[0]["total_input_tokens"] == 3 + 2  # refused prompts ran no tokens


def _with_hidden(table: pa.Table, name: str, values: list) -> pa.Table:
    i = table.schema.get_field_index(stats.hidden(name))
    return table.set_column(i, stats.hidden(name), pa.array(values, table.schema.field(i).type))


def test_shard_stats_take_both_cache_sizes_from_one_call():
    """Rows of one actor from two calls: the shard's peak is the call with the larger cache, with that call's bf16
    size (the maxima taken apart would pair the sizes of two moments)."""
    out = fake_actor()(pa.table({"prompt": ["a b", "c"]}))  # each row stands for one call here
    small, big = sorted(random.sample(range(1, 10**6), 2))
    out = _with_hidden(out, "kv_cache_bytes", [small, big])
    out = _with_hidden(out, "kv_cache_bytes_bf16", [4 * big, 2 * big])
    row = stats.shard_stats("s", out, {"model": "m"})[0]
    assert (row["kv_cache_bytes"], row["kv_cache_bytes_bf16"]) == (big, 2 * big)


def test_shard_stats_and_summary_count_the_preempted_rows():
    """num_preempted: rows preempted once or more (each row's count is a hidden column from its completion)."""
    n = random.randint(3, 8)
    out = fake_actor()(pa.table({"prompt": ["a b"] * n}))
    assert out[stats.hidden("preemptions")].to_pylist() == [0] * n  # the fake engine's completions: none
    counts = [random.randint(0, 2) for _ in range(n)]
    row = stats.shard_stats("s", _with_hidden(out, "preemptions", counts), {"model": "m"})[0]
    assert row["num_preempted"] == sum(c > 0 for c in counts)
    assert stats.stats_table([row]).column("num_preempted").to_pylist() == [row["num_preempted"]]
    assert stats.summarize([row, dict(row, shard="t")], [], 1.0, 0)["num_preempted"] == 2 * row["num_preempted"]


def test_shard_stats_and_summary_report_each_engines_oom_retries_and_rebuilds():
    """engine_oom_retries / engine_rebuilds: counts since an actor's engine started, so a shard reports the latest
    (largest) of its rows' and the job each actor's latest, summed over actors."""
    n = random.randint(4, 9)
    out = fake_actor()(pa.table({"prompt": ["a b"] * n}))
    assert out[stats.hidden("engine_oom_retries")].to_pylist() == [0] * n  # what the fake engine reports
    actors = [random.choice("xy") for _ in range(n - 2)] + ["x", "y"]
    ooms, rebuilds = ([random.randint(0, 5) for _ in range(n)] for _ in range(2))
    for name, values in (("actor_id", actors), ("engine_oom_retries", ooms), ("engine_rebuilds", rebuilds)):
        out = _with_hidden(out, name, values)
    rows = stats.shard_stats("s", out, {"model": "m"})
    for row in rows:
        mine = [i for i, a in enumerate(actors) if a == row["actor_id"]]
        assert row["engine_oom_retries"] == max(ooms[i] for i in mine)
        assert row["engine_rebuilds"] == max(rebuilds[i] for i in mine)
    later = [dict(r, shard="t", engine_oom_retries=r["engine_oom_retries"] + 1) for r in rows]  # counts only grow
    summary = stats.summarize(rows + later, [], 1.0, 0)
    assert summary["engine_oom_retries"] == sum(r["engine_oom_retries"] for r in later)
    assert summary["engine_rebuilds"] == sum(r["engine_rebuilds"] for r in rows)
    assert [r["model_dtype"] for r in rows] == ["float32"] * len(rows) and summary["model_dtypes"] == ["float32"]
    assert stats.stats_table(rows).column("engine_rebuilds").to_pylist() == [r["engine_rebuilds"] for r in rows]


def test_actor_reports_its_start_and_the_engines_build_time(tmp_path):
    """Issue 4 needs how long each actor took to start: the loader's time (model load, engine object)
    and the engine's one-time build, carried per row to the per-shard stats."""
    import time

    def slow_loader(cfg):
        time.sleep(0.05)
        engine = FakeEngine()
        engine.stats = lambda: {**FakeEngine.stats(engine), "build_s": 1.5}
        return engine, FakeTokenizer()

    actor = GenerateActor({"output": "unused"}, "prompt", loader=slow_loader)
    assert actor.start_s >= 0.05
    out = actor(pa.table({"prompt": ["a b", "c"]}))
    rows = stats.shard_stats("s", out, {"kv_bits": 2, "group_size": 32, "residual_length": 128, "model": "m"})
    assert len(rows) == 1 and rows[0]["actor_start_s"] == actor.start_s and rows[0]["engine_build_s"] == 1.5
    assert stats.stats_table(rows).column("engine_build_s").to_pylist() == [1.5]
    summary = stats.summarize(rows, [], 2.0, 0)
    assert summary["max_actor_start_s"] == actor.start_s and summary["max_engine_build_s"] == 1.5


def test_actor_template_and_chat():
    actor = fake_actor("template", prompt_template="C: {context} Q: {question}", chat=True)
    batch = pa.table({"context": ["x"], "question": ["why"], "extra": [1]})
    out = actor(batch)
    assert out.column_names[:3] == ["context", "question", "extra"]
    assert out["finish_reason"].to_pylist() == ["length"]


# --- shards: assembly, ids, stats, resume ---


def test_assembler_splits_shards_and_writes_stats(tmp_path):
    write(str(tmp_path / "in/a.parquet"), prompt=["p1", "p2", "p3"], topic=["x", "y", "z"])
    write(str(tmp_path / "in/b.parquet"), prompt=["p4 p4"], topic=["w"])
    write(str(tmp_path / "in/c.parquet"), prompt=pa.array([], pa.string()), topic=pa.array([], pa.string()))
    job = JobConfig(output=str(tmp_path / "out"), input=str(tmp_path / "in"))
    plan = plan_input(job)
    store = OutputStore(job.output)
    store.prepare()
    actor = fake_actor(max_new_tokens=2)
    info = {"kv_bits": 2, "group_size": 32, "residual_length": 128, "model": "fake"}
    asm = ShardAssembler(plan, plan.shards, store, info, settings={"max_new_tokens": 2})
    rows = pa.concat_tables([pq.read_table(s.path) for s in plan.shards if s.num_rows])
    asm.add(actor(rows.slice(0, 2)))  # batches cross shard boundaries
    assert store.completed() == set()  # shard a is not whole yet
    asm.add(actor(rows.slice(2, 2)))
    asm.finish()
    assert store.completed() == {"a", "b", "c"}
    a = pq.read_table(store.shard_path("a"))
    assert a.column_names == [
        "id",
        "topic",
        "generated_text",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "error",
    ]
    assert a["id"].to_pylist() == ["a-0", "a-1", "a-2"] and a["topic"].to_pylist() == ["x", "y", "z"]
    for name in "abc":  # each shard records its own input file's rows, bytes, version (its modification and
        # status-change times here) and SHA-256 (hashed in the background)
        recorded = json.loads(pq.read_schema(store.shard_path(name)).metadata[b"kivi_ray.settings"])["input_data"]
        data = (tmp_path / f"in/{name}.parquet").read_bytes()
        assert recorded == {"rows": pq.read_metadata(str(tmp_path / f"in/{name}.parquet")).num_rows,
                            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "version": "mtime {0.st_mtime} ctime {0.st_ctime}".format(
                                (tmp_path / f"in/{name}.parquet").stat())}
    st = pq.read_table(store.stats_path("b")).to_pylist()
    assert len(st) == 1 and st[0]["shard"] == "b" and st[0]["num_requests"] == 1
    assert st[0]["total_input_tokens"] == 2 and st[0]["total_output_tokens"] == 2
    assert st[0]["kv_cache_bytes"] / st[0]["kv_cache_bytes_bf16"] == 0.25
    assert pq.read_table(store.stats_path("c")).num_rows == 0
    # the empty shard has every column, typed as in the others: reading the folder as one table keeps them all
    assert pq.read_table(store.shard_path("c")).schema == a.schema == plan.output_schema()
    assert pq.read_table(str(tmp_path / "out")).schema == a.schema
    summary = stats.summarize(asm.stats_rows, asm.ttfts_ms, 1.0, 0, shards_done=asm.shards_written,
                              tpots_ms=asm.tpots_ms)
    assert summary["num_requests"] == 4 and summary["shards_done"] == 3
    assert len(asm.tpots_ms) == 4 and summary["mean_tpot_ms"] == pytest.approx(sum(asm.tpots_ms) / 4)
    assert st[0]["actor_start_s"] == actor.start_s > 0 and st[0]["engine_build_s"] is None  # fake: no build
    assert summary["max_actor_start_s"] == actor.start_s and summary["max_engine_build_s"] is None
    (tmp_path / "out/_stats/summary.json").write_text("{}")  # an earlier version's summary, beside the stats
    store.prepare()
    store.write_text(store.summary_path(), stats.summary_json(summary, job.to_dict()))
    assert sorted(os.listdir(tmp_path / "out/_stats")) == ["_summary.json", "a.parquet", "b.parquet", "c.parquet"]
    assert pq.read_table(str(tmp_path / "out/_stats")).num_rows == 2  # one stats row for each shard with rows
    (tmp_path / "out" / ".a.parquet.123.tmp").write_bytes(b"partial")  # a crashed write never counts
    os.remove(store.shard_path("b"))
    assert store.completed() == {"a", "c"}


@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("actors", [1, 2, 3, 8])
def test_cpu_actor_pool_leaves_a_cpu_for_read_and_write_tasks(cpus, actors):
    """A CPU-only pool whose actors took every CPU would wait forever for its read tasks (seen: --actors 2
    on a 2-core machine hung): each actor reserves one CPU, or an equal share of all but one."""
    from pipeline.run import cpu_share

    share = cpu_share(cpus, actors)
    assert 0 <= share <= 1
    assert cpus - actors * share >= 1 - 1e-9  # a whole CPU stays free for a read or write task
    if actors <= cpus - 1:
        assert share == 1.0  # room for a whole CPU each: nothing changes
    else:
        assert share == pytest.approx((cpus - 1) / actors)  # else an equal share of the rest
