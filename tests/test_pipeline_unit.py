"""Pipeline plumbing without Ray or a model: config, input planning and checks, prompts, the actor's
rows and stats (with a fake engine), shard assembly, and the CLI failing early on bad input."""

from __future__ import annotations

import argparse
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import add_arguments, main
from pipeline import prompts, stats
from pipeline.actors.actor import GenerateActor
from pipeline.actors.engine import Completion, SamplingParams
from pipeline.config import JobConfig, build, load_yaml
from pipeline.io import plan_input
from pipeline.sink import OutputStore, ShardAssembler

# --- fakes: a whitespace tokenizer and an engine that echoes, for the row/stat plumbing only ---


class FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}


class FakeEngine:
    context = 50

    def __init__(self):
        self.seen = []

    def reset_stats(self):
        pass

    def stats(self):
        return {"max_allocated_mb": 12.5, "kv_cache_bytes": 100, "kv_cache_bytes_bf16": 400, "device_name": "fake"}

    def generate(self, requests):
        self.seen += requests
        out = []
        for r in requests:
            n = len(r.prompt_token_ids)
            if n > self.context:
                out.append(Completion(r.request_id, "", [], n, "error", error=f"prompt of {n} tokens > {self.context}"))
            else:
                k = r.sampling.max_new_tokens
                out.append(Completion(r.request_id, "ok " * k, [7] * k, n, "length", ttft_s=0.01, decode_s=0.02))
        return out


def fake_actor(source="prompt", **job):
    return GenerateActor({"output": "unused", **job}, source, loader=lambda cfg: (FakeEngine(), FakeTokenizer()))


def write(path, **columns):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


# --- config ---


def test_flags_override_file(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text('output: out/\nmax-new-tokens: 8\nkivi: false\nstop: ["\\n"]\n')
    job = build(load_yaml(f), {"max_new_tokens": 4})
    assert (job.output, job.max_new_tokens, job.kivi, job.stop) == ("out/", 4, False, ("\n",))
    assert job.kivi_config() is None
    assert not job.ignore_eos and not job.sampling_defaults().ignore_eos


def test_ignore_eos_from_file_flag_and_row(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("output: out/\nignore_eos: true\n")
    assert build(load_yaml(f), {}).sampling_defaults().ignore_eos
    assert not build(load_yaml(f), {"ignore_eos": False}).ignore_eos
    actor = fake_actor(ignore_eos=True)
    assert actor.sampling_defaults.ignore_eos
    batch = pa.table({"prompt": ["a b", "c d"], "sampling_params": [None, '{"ignore_eos": false}']})
    actor(batch)
    assert [r.sampling.ignore_eos for r in actor.engine.seen] == [True, False]
    with pytest.raises(ValueError, match="ignore_eos"):
        build({}, {"output": "o", "ignore_eos": "yes"})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert vars(parser.parse_args(["--output", "o", "--ignore-eos"]))["ignore_eos"] is True
    assert vars(parser.parse_args(["--no-ignore-eos"]))["ignore_eos"] is False


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"output": "o", "kv_bits": 3}, "kv_bits"),
        ({"output": "o", "group_size": 24}, "group_size"),
        ({"output": "o", "residual_length": 40}, "residual_length"),
        ({"output": "o", "kv_scale_dtype": "bfloat16"}, "kv_scale_dtype"),
        ({"output": "o", "temperature": -1.0}, "temperature"),
        ({"output": "o", "top_p": 0.0}, "top_p"),
        ({"output": "o", "batch_size": 0}, "batch_size"),
        ({"output": "o", "actors": 0}, "actors"),
        ({"output": "o", "gpus_per_actor": 0}, "gpus_per_actor"),
        ({"output": "o", "gpus_per_actor": 1.5}, "gpus_per_actor"),
        ({"output": "o", "max_new_tokens": "16"}, "max_new_tokens"),
        ({"output": "o", "prompt_template": "no fields"}, "prompt_template"),
        ({"output": "o", "gguf_file": "x.gguf"}, "gguf_file"),
        ({"output": "o", "colour": "red"}, "colour"),
        ({}, "output"),
    ],
)
def test_bad_settings_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        build({}, settings)


def test_bad_yaml_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")


# --- input planning ---


def test_folder_and_glob_shards(tmp_path):
    write(str(tmp_path / "in/a.parquet"), prompt=["x", "y"], topic=["t", "u"])
    write(str(tmp_path / "in/sub/b.parquet"), prompt=["z"], topic=["v"])
    write(str(tmp_path / "in/_skip/c.parquet"), prompt=["z"], topic=["v"])
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in")))
    assert [(s.name, s.num_rows) for s in plan.shards] == [("a", 2), ("sub__b", 1)]
    assert (plan.source, plan.has_id, plan.passthrough()) == ("prompt", False, ["topic"])
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in/sub/*.parquet")))
    assert [s.name for s in plan.shards] == ["b"]


def test_colliding_shard_names_fail_at_planning(tmp_path):
    write(str(tmp_path / "in/a/b.parquet"), prompt=["x"])
    write(str(tmp_path / "in/a__b.parquet"), prompt=["y"])
    with pytest.raises(ValueError, match="both map to shard 'a__b'"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "in")))


def test_model_checked_before_ray(tmp_path):
    """An unsupported architecture or a group size that does not divide head_dim fails at planning."""
    from transformers import GPT2Config, LlamaConfig

    from pipeline.run import check_model

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="gpt2"):
        check_model(JobConfig(output="o", model=str(tmp_path / "gpt2")))
    with pytest.raises(ValueError, match="head_dim=32"):
        check_model(JobConfig(output="o", model=str(tmp_path / "llama"), group_size=64, residual_length=128))
    check_model(JobConfig(output="o", model=str(tmp_path / "llama"), group_size=32))
    check_model(JobConfig(output="o", model=str(tmp_path / "gpt2"), kivi=False))  # the baseline runs anything


def test_hf_dataset_shards(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": list("abcde"), "n": list(range(5))}).save_to_disk(str(tmp_path / "hf"))
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "hf"), hf_shard_rows=2))
    assert plan.kind == "hf"
    assert [(s.name, s.num_rows, s.start) for s in plan.shards] == [
        ("rows-000000000-000000001", 2, 0),
        ("rows-000000002-000000003", 2, 2),
        ("rows-000000004-000000004", 1, 4),
    ]
    assert plan.shards[2].default_id(0) == "4"


@pytest.mark.parametrize(
    "columns, settings, message",
    [
        ({"text": ["x"]}, {}, "no 'prompt' or 'messages' column"),
        ({"question": ["x"]}, {"prompt_template": "{context} {question}"}, r"lacks|\['context'\]"),
        ({"prompt": ["x"], "generated_text": ["y"]}, {}, "overwrite"),
    ],
)
def test_bad_columns_fail_at_planning(tmp_path, columns, settings, message):
    path = write(str(tmp_path / "in.parquet"), **columns)
    with pytest.raises(ValueError, match=message):
        plan_input(JobConfig(output="o", input=path, **settings))


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "nope.parquet")))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read parquet file .*junk.parquet"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "junk.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .parquet files"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "empty")))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-new-tokens", "many"], "invalid int value"),
        (["--kv-bits", "3"], "kv_bits"),
        (["--input", "/nonexistent/x.parquet"], "not found"),
        (["--input", "NO_PROMPT"], "no 'prompt' or 'messages' column"),
        (["--input", "NO_PROMPT", "--prompt-template", "{question}"], "needs columns ['question']"),
        (["--model", "./no-such-model"], "model folder"),
    ],
)
def test_cli_fails_before_ray(tmp_path, capsys, argv, message):
    import ray

    no_prompt = write(str(tmp_path / "in.parquet"), text=["hello"])
    with pytest.raises(SystemExit) as e:
        code = main(["--output", str(tmp_path / "out"), *(no_prompt if a == "NO_PROMPT" else a for a in argv)])
        raise SystemExit(code)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


# --- prompts ---


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
    asm = ShardAssembler(plan, plan.shards, store, info)
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
    st = pq.read_table(store.stats_path("b")).to_pylist()
    assert len(st) == 1 and st[0]["shard"] == "b" and st[0]["num_requests"] == 1
    assert st[0]["total_input_tokens"] == 2 and st[0]["total_output_tokens"] == 2
    assert st[0]["kv_cache_bytes"] / st[0]["kv_cache_bytes_bf16"] == 0.25
    assert pq.read_table(store.stats_path("c")).num_rows == 0
    # the empty shard has every column, typed as in the others: reading the folder as one table keeps them all
    assert pq.read_table(store.shard_path("c")).schema == a.schema == plan.output_schema()
    assert pq.read_table(str(tmp_path / "out")).schema == a.schema
    summary = stats.summarize(asm.stats_rows, asm.ttfts_ms, 1.0, 0, shards_done=asm.shards_written)
    assert summary["num_requests"] == 4 and summary["shards_done"] == 3
    assert st[0]["actor_start_s"] == actor.start_s > 0 and st[0]["engine_build_s"] is None  # fake: no build
    assert summary["max_actor_start_s"] == actor.start_s and summary["max_engine_build_s"] is None
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
