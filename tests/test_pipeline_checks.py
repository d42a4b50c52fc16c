"""Checks that stop a job before Ray starts, with one line naming the problem: column types that differ
between input files, --split on Parquet, a model whose config cannot load, a rerun into an output made
with other settings (recorded in each shard); and a rerun with nothing to do leaving the output as it is. No Ray,
no weights."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from pipeline.actors.actor import model_location
from pipeline.actors.engine import SamplingParams
from pipeline.config import JobConfig, build
from pipeline.io import plan_input
from pipeline.resume import row_settings, stamp
from pipeline.run import run


def write_table(path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path))


def write(path, **columns) -> None:
    write_table(path, pa.table(columns))


def test_column_types_must_merge_across_files(tmp_path):
    n = random.randint(1, 5)
    write(tmp_path / "in/a.parquet", prompt=["p"] * n, x=pa.array(range(n), pa.int64()))
    write(tmp_path / "in/b.parquet", prompt=["q"], x=pa.array(["seven"]))
    with pytest.raises(ValueError, match=r"b\.parquet.*'x' is string there but int64"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "in")))
    # types that Ray Data merges (an all-null column, wider integers, large strings) are fine, merged as it does
    write(tmp_path / "in/b.parquet", prompt=pa.array(["q"], pa.large_string()), x=pa.array([None], pa.null()))
    write(tmp_path / "in/c.parquet", prompt=["r"], x=pa.array([7], pa.int32()))
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in")))
    assert [s.num_rows for s in plan.shards] == [n, 1, 1]
    assert plan.schema.field("x").type == pa.int64() and plan.schema.field("prompt").type == pa.large_string()
    # checked against what the files before it merged to, not only the first file
    write(tmp_path / "in/a.parquet", prompt=["p"] * n, x=pa.array([None] * n, pa.null()))
    write(tmp_path / "in/d.parquet", prompt=["s"], x=pa.array(["eight"]))
    with pytest.raises(ValueError, match=r"d\.parquet.*'x' is string there but int"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "in")))


@pytest.mark.parametrize("column, values, refused_as", [
    ("prompt", pa.array([3, 1, 4]), "int64"),
    ("prompt", pa.array([0.5, 2.0, None]), "double"),
    ("prompt", pa.array([["a"], ["b"], ["c"]]), "list<"),
    ("prompt", pa.array(["a", None, "c"], pa.large_string()), None),
    ("prompt", pa.array([None, None, None], pa.null()), None),
    ("prompt", pa.array(["a", "b", "a"]).dictionary_encode(), None),  # a pandas Categorical
    ("prompt", pa.array([1, 2, 1]).dictionary_encode(), "int64"),  # Parquet keeps ints plain
    ("messages", pa.array([1, 2, 3]), "int64"),
    ("messages", pa.array(['[{"role": "user", "content": "hi"}]'] * 3), None),
    ("messages", pa.array([[{"role": "user", "content": "hi"}]] * 3), None),
    ("messages", pa.array([[{"role": "user", "content": "hi"}]] * 3, pa.list_(pa.struct(
        [("role", pa.string()), ("content", pa.string())]), 1)), None),  # fixed-size list
])
def test_prompt_column_type_is_checked_before_ray(tmp_path, column, values, refused_as):
    write(tmp_path / "in/a.parquet", **{column: values}, x=pa.array(random.sample(range(100), 3)))
    cfg = JobConfig(output="o", input=str(tmp_path / "in"))
    if refused_as is None:
        assert plan_input(cfg).source == column
    else:
        with pytest.raises(ValueError, match=f"column '{column}' is {refused_as}.*must"):
            plan_input(cfg)
    # a template may read any column type: the check is for the column that is the prompt itself
    if column == "prompt":
        templated = JobConfig(output="o", input=str(tmp_path / "in"), prompt_template="Q{x}")
        assert plan_input(templated).source == "template"


def test_split_is_for_a_dataset_dict(tmp_path):
    write(tmp_path / "a.parquet", prompt=["p"])
    with pytest.raises(ValueError, match="split='train' applies to a saved Hugging Face DatasetDict"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "a.parquet"), split="train"))


def test_split_is_refused_on_a_single_saved_dataset(tmp_path):
    """A folder from Dataset.save_to_disk has no splits: --split there is a bad flag, not something to ignore
    (and record in the shards, where a rerun without it would then be refused)."""
    datasets = pytest.importorskip("datasets")
    n = random.randint(1, 9)
    datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(n)]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"split='train' applies to a saved Hugging Face DatasetDict; .* single "
                                         r"Dataset \(drop --split\)"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "ds"), split="train"))
    assert sum(s.num_rows for s in plan_input(JobConfig(output="o", input=str(tmp_path / "ds"))).shards) == n


def test_gguf_file_as_model():
    assert model_location(JobConfig(output="o", model="/m/x/SmolLM2.Q4_1.gguf")) == ("/m/x", "SmolLM2.Q4_1.gguf")
    assert model_location(JobConfig(output="o", model="x.gguf")) == (".", "x.gguf")
    assert model_location(JobConfig(output="o", model="/m/x", gguf_file="y.gguf")) == ("/m/x", "y.gguf")


def test_model_without_a_config_fails_before_ray(tmp_path, capsys):
    (tmp_path / "not-a-model").mkdir()
    code = main(["--output", str(tmp_path / "out"), "--model", str(tmp_path / "not-a-model"), "--no-kivi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load the config of model" in err[0]


def complete_output(tmp_path, job: JobConfig, name: str = "a") -> None:
    """An output holding shard `name` as `job` would have written it, and that run's summary."""
    table = stamp(pa.table({"id": [f"{name}-0"], "generated_text": ["done"]}), row_settings(job, plan_input(job)))
    write_table(tmp_path / f"out/{name}.parquet", table)
    (tmp_path / "out/_stats").mkdir(exist_ok=True)
    (tmp_path / "out/_stats/_summary.json").write_text('{"summary": "of the run that made it"}')


@pytest.mark.parametrize("change", [
    {"max_new_tokens": 3}, {"temperature": 0.7}, {"stop": ["\n"]}, {"kv_bits": 4}, {"kivi": False}, {"seed": 1},
    {"dtype": "float32"}, {"kv_scale_dtype": "model"},
])
def test_resume_with_other_settings_is_refused(tmp_path, tiny_model, change):
    write(tmp_path / "in/a.parquet", prompt=["p"])
    base = dict(output=str(tmp_path / "out"), input=str(tmp_path / "in"), model=tiny_model)
    complete_output(tmp_path, JobConfig(**base))
    key = next(iter(change))
    with pytest.raises(ValueError, match=rf"shard 'a' made with other settings \({key} "):
        run(build({}, {**base, **change}))
    # settings that do not decide rows may change, and the same settings may be spelled differently
    run(build({}, {**base, "batch_size": 7, "actors": 3, "input": str(tmp_path / "in") + "/", "dtype": "bfloat16"}))


def test_a_run_that_does_not_redo_a_shard_must_match_it(tmp_path, tiny_model):
    """Shard names need not overlap: another input into the same output, or an --overwrite run that stopped
    half way (shard a redone with the new settings, b still the old job's), is refused all the same."""
    write(tmp_path / "in1/a.parquet", prompt=["p"])
    write(tmp_path / "in2/b.parquet", prompt=["q"])
    old = JobConfig(output=str(tmp_path / "out"), input=str(tmp_path / "in1"), model=tiny_model)
    complete_output(tmp_path, old)
    other_input = dict(output=str(tmp_path / "out"), input=str(tmp_path / "in2"), model=tiny_model)
    for overwrite in (False, True):  # --overwrite redoes in2's shards only: a is kept, so it is refused, and the
        # message must not offer --overwrite as the way out
        with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input .*not a shard of this "
                                             r"input, so --overwrite keeps it too") as info:
            run(JobConfig(**other_input, overwrite=overwrite))
        assert "--overwrite to redo" not in str(info.value)

    write(tmp_path / "in1/b.parquet", prompt=["q"])
    complete_output(tmp_path, old, name="b")
    new = JobConfig(output=str(tmp_path / "out"), input=str(tmp_path / "in1"), model=tiny_model, max_new_tokens=9)
    complete_output(tmp_path, new, name="a")  # what an interrupted --overwrite run leaves
    with pytest.raises(ValueError, match=r"shard 'b' made with other settings \(max_new_tokens 64 -> 9.*"
                                         r"--overwrite to redo every shard of this input"):
        run(new)


def test_another_inputs_shard_is_reported_before_this_inputs():
    """When kept shards of this input and of another both differ, the error names the other input's (whose
    remedy is not --overwrite), whatever the names' order; with only this input's, it offers --overwrite."""
    from pipeline.resume import check_resume

    now = {"input": "in2", "max_new_tokens": random.randint(1, 50)}
    recorded = {"a": dict(now, max_new_tokens=now["max_new_tokens"] + 1), "m": None, "z": dict(now, input="in1")}
    with pytest.raises(ValueError, match=r"shard 'z' .*not a shard of this input.*remove z\.parquet and "
                                         r"_stats/z\.parquet"):
        check_resume(now, recorded, "out", dict.fromkeys(["a", "m"]))
    with pytest.raises(ValueError, match=r"shard 'a' .*--overwrite to redo every shard of this input"):
        check_resume(now, recorded, "out", dict.fromkeys(["a", "m", "z"]))
    check_resume(now, {"a": dict(now), "m": None}, "out", {"a": None})
    with pytest.raises(ValueError, match=r"input <sample prompts> -> 'in2'; model <SmolLM2-135M-Instruct> -> 'm'"):
        check_resume(dict(now, model="m"), {"a": dict(now, input=None, model=None)}, "out", {"a": None})


def test_resume_hashes_only_files_whose_path_or_version_changed_each_once():
    """check_resume reads a file whole (digest) only where its rows and bytes match and its input path or version
    changed, each such file once (hashed up front, several at a time), and decides on what the hashes say."""
    import threading

    from pipeline.resume import check_resume

    rows, size = random.randint(1, 9), random.randint(100, 999)
    data = lambda version, sha="s": {"rows": rows, "bytes": size, "version": version, "sha256": sha}
    now = {"input": "in2", "max_new_tokens": 4}
    recorded = {"moved": dict(now, input="in1", input_data=data("v1")), "touched": dict(now, input_data=data("v1")),
                "same": dict(now, input_data=data("v1")), "grown": dict(now, input="in1", input_data=data("v1")),
                "old": dict(now, input_data={"rows": rows, "bytes": size, "sha256": "s"})}
    current = {"moved": data("v1"), "touched": data("v2"), "same": data("v1"), "grown": dict(data("v1"), rows=rows + 1),
               "old": data("v9")}
    calls, lock = [], threading.Lock()

    def digest(name, sha="s"):
        with lock:
            calls.append((name, threading.current_thread() is threading.main_thread()))
        return sha

    current = {k: {key: v for key, v in d.items() if key != "sha256"} for k, d in current.items()}
    with pytest.raises(ValueError, match=r"shard 'grown' .*input_data \{'rows': "):
        check_resume(now, recorded, "out", current, digest=digest)
    assert sorted(calls) == [("moved", False), ("touched", False)]  # in worker threads
    calls.clear()
    with pytest.raises(ValueError, match=r"shard 'touched' .*the file rewritten in place"):
        check_resume(now, {k: recorded[k] for k in ("moved", "touched")}, "out", current,
                     digest=lambda name: digest(name, "new" if name == "touched" else "s"))
    assert sorted(name for name, _ in calls) == ["moved", "touched"]


def test_shards_from_before_kv_scale_dtype_count_as_model_scales():
    """Shards written before kv_scale_dtype was recorded were made with scales in the model's dtype: a run with
    fp16 scales (the default now) must not mix its rows with theirs; "model" matches them, as does any run
    over a shard made without the KIVI cache."""
    from pipeline.resume import check_resume

    old = {"kivi": True, "kv_bits": 2, "max_new_tokens": 8}
    now = dict(old, kv_scale_dtype="float16")
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(kv_scale_dtype 'model' -> 'float16'"):
        check_resume(now, {"a": old}, "out", {"a": None})
    check_resume(dict(now, kv_scale_dtype="model"), {"a": old}, "out", {"a": None})
    check_resume(dict(now, kivi=False, kv_scale_dtype=None), {"a": dict(old, kivi=False)}, "out", {"a": None})


def test_rerun_with_nothing_to_do_keeps_the_summary(tmp_path, tiny_model):
    write(tmp_path / "in/a.parquet", prompt=["p"])
    job = JobConfig(output=str(tmp_path / "out"), input=str(tmp_path / "in"), model=tiny_model)
    complete_output(tmp_path, job)
    summary = run(job)
    assert (summary["shards_done"], summary["shards_skipped"], summary["num_requests"]) == (0, 1, 0)
    assert json.loads((tmp_path / "out/_stats/_summary.json").read_text()) == {"summary": "of the run that made it"}


def test_shards_without_recorded_settings_resume_unchecked(tmp_path, tiny_model):
    write(tmp_path / "in/a.parquet", prompt=["p"])
    write(tmp_path / "out/a.parquet", id=["a-0"], generated_text=["done"])  # an older version's shard
    (tmp_path / "out/notes.parquet").write_bytes(b"not parquet at all")  # a user's file beside the shards
    run(JobConfig(output=str(tmp_path / "out"), input=str(tmp_path / "in"), model=tiny_model, max_new_tokens=5))


def test_model_spellings_record_the_same_settings(tmp_path):
    write(tmp_path / "in/a.parquet", prompt=["p"])
    (tmp_path / "m").mkdir()
    (tmp_path / "m/x.gguf").write_bytes(b"")
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in")))
    as_path = row_settings(JobConfig(output="o", model=str(tmp_path / "m/x.gguf")), plan)
    as_pair = row_settings(JobConfig(output="o", model=str(tmp_path / "m") + "/", gguf_file="x.gguf"), plan)
    assert as_path["model"] == as_pair["model"] == str(tmp_path / "m") and as_path == as_pair


def test_naming_the_shipped_sample_and_model_records_the_defaults(tmp_path):
    """The shipped sample and model, named (directly or through links), record what leaving them out records, and a
    shard recorded with their paths (as earlier versions did) resumes; a link under another name is another input:
    its shard has another name."""
    from pipeline.io import SAMPLE_PROMPTS
    from pipeline.resume import check_resume

    folder, name = model_location(JobConfig(output="o"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / SAMPLE_PROMPTS.name).symlink_to(SAMPLE_PROMPTS)
    (tmp_path / "link.parquet").symlink_to(SAMPLE_PROMPTS)
    default = JobConfig(output="o")
    plan = plan_input(default)
    named = [JobConfig(output="o", input=str(SAMPLE_PROMPTS), model=folder, gguf_file=name),
             JobConfig(output="o", input=str(tmp_path / "dir" / SAMPLE_PROMPTS.name), model=f"{folder}/{name}")]
    for job in named:
        assert row_settings(job, plan_input(job)) == row_settings(default, plan)
    linked = JobConfig(output="o", input=str(tmp_path / "link.parquet"))
    assert row_settings(linked, plan_input(linked))["input"] == str(tmp_path / "link.parquet")
    recorded = dict(row_settings(default, plan), input=str(SAMPLE_PROMPTS), model=folder, gguf_file=name)
    check_resume(row_settings(default, plan), {"sample_prompts": recorded}, "o", {"sample_prompts": None})


@pytest.mark.parametrize("bad", [{"seed": True}, {"max_new_tokens": True}, {"top_k": False}, {"temperature": "0.5"},
                                 {"top_p": True}])
def test_sampling_params_reject_booleans_and_strings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams.from_dict(bad)
    if next(iter(bad)) in ("temperature", "top_p"):  # a type error reads as one, not as a range error
        with pytest.raises(ValueError, match="must be a (finite )?number"):
            SamplingParams.from_dict(bad)


def test_config_type_errors_read_plainly():
    with pytest.raises(ValueError, match="max_new_tokens must be an integer, got 'four'"):
        build({"max_new_tokens": "four"}, {"output": "o"})
    with pytest.raises(ValueError, match="kivi must be true or false, got 'no'"):
        build({"kivi": "no"}, {"output": "o"})


@pytest.mark.parametrize("name, value, kind", [
    ("input", 5, "a string"), ("model", 3, "a string"), ("prompt_template", 12, "a string"), ("output", 7, "a string"),
    ("seed", "7", "an integer"), ("batch_size", 2.5, "an integer"), ("stop", 5, "a string or a list of strings"),
    ("stop", {"a": 1}, "a string or a list of strings"), ("stop", ["ok", 3], "a string or a list of strings"),
])
def test_yaml_values_of_the_wrong_type_are_errors(name, value, kind):
    """Fields whose default is None (or that have none) are typed by their annotation; `stop` must hold strings."""
    with pytest.raises(ValueError, match=f"{name} must be {kind}, got "):
        build({name: value}, {} if name == "output" else {"output": "o"})


def test_an_empty_yaml_stop_means_no_stop_strings():
    assert build({"stop": None}, {"output": "o"}).stop == ()


def test_a_rows_stop_string_is_one_stop():
    stop = "".join(random.choices("abc \n", k=random.randint(2, 6)))
    assert SamplingParams.from_dict({"stop": stop}).stop == (stop,)
    assert SamplingParams.from_dict({"stop": [stop, "x"]}).stop == (stop, "x")
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        SamplingParams.from_dict({"stop": 5})


def test_a_plain_caches_bits_are_the_models():
    from pipeline.run import job_info

    assert job_info(JobConfig(output="o", kivi=False, dtype="float32"))["kv_bits"] == 32
    assert job_info(JobConfig(output="o", kivi=False))["kv_bits"] == 16
    assert job_info(JobConfig(output="o", kv_bits=4))["kv_bits"] == 4


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    import pipeline.run

    def interrupted(job):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.run, "run", interrupted)
    assert main(["--output", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and "resume" in err[0]


@pytest.mark.parametrize("total", [1, 7, 32, 1000, 5000, 100_000])
@pytest.mark.parametrize("pool", [1, 2, 8])
@pytest.mark.parametrize("width", [4, 256])
def test_rows_per_call_keeps_the_engine_wide_and_the_pool_busy(total, pool, width):
    from pipeline.run import CALLS_PER_ACTOR, rows_per_call

    rows = rows_per_call(total, pool, width)
    assert 1 <= rows <= width  # a bounded call: resume, progress and the driver's memory stay fine-grained
    calls, slots = -(-total // rows), pool * CALLS_PER_ACTOR
    assert calls >= min(slots, total)  # every call slot of the pool gets a call, whichever actor is ready first
    assert rows >= min(width, total // slots)  # and each call as many rows as that allows, to keep the engine fed


@pytest.mark.parametrize("argv", [["--kv-bits", "3"], ["--max-new-tokens", "0"], ["--temperature", "-1"]])
def test_bad_values_are_one_line(tmp_path, capsys, argv):
    assert main(["--output", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m jobs.generate: error:")
