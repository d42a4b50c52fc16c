"""Checks that stop a job before Ray starts, with one line naming the problem: column types that differ
between input files, --split on Parquet, a model whose config cannot load, values of the wrong type; Ctrl-C as one
line. What a rerun may keep is test_pipeline_resume.py. No Ray, no weights."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from jobs.generate import main
from pipeline.actors.actor import model_location
from pipeline.actors.engine import SamplingParams
from pipeline.config import JobConfig, build
from pipeline.io import plan_input
from tests.pipeline_cases import write


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


def test_a_write_that_fails_mid_run_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    import pipeline.run

    def disk_full(job):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline.run, "run", disk_full)
    assert main(["--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "resume" in err[0]


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """A folder left by an earlier run may exist and be read-only now: prepare() writes a file in the output and in
    _stats/ and removes it, so the job stops before Ray, not at its first shard; a writable output keeps no trace."""
    from pipeline.sink import OutputStore

    (tmp_path / "out/_stats").mkdir(parents=True)
    store = OutputStore(str(tmp_path / "out"))
    store.prepare()
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["_stats"]
    real_open = store.fs.open
    for folder in ("out", "_stats"):
        def read_only(path, mode="rb", *args, folder=folder, **kwargs):
            if "w" in mode and path.rsplit("/", 2)[-2] == folder:
                raise OSError(30, "Read-only file system")
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(store.fs, "open", read_only)
        with pytest.raises(ValueError, match=rf"cannot write to output .*{folder}\): \[Errno 30\] Read-only"):
            store.prepare()


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


@pytest.mark.parametrize("argv", [["--kv-bits", "3"], ["--max-new-tokens", "0"], ["--temperature", "-1"],
                                  ["--max-model-len", "1"]])
def test_bad_values_are_one_line(tmp_path, capsys, argv):
    assert main(["--output", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m jobs.generate: error:")
