"""What a rerun into an existing output may keep, checked before Ray starts: each complete shard records the
settings that decided its rows, and a rerun with other settings, or over input data that changed, is refused with
one line naming them; the same settings spelled otherwise, the shipped sample and model named or left out, and
shards of earlier versions resume. No Ray, no weights."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.actors.actor import model_location
from pipeline.config import JobConfig, build
from pipeline.io import plan_input
from pipeline.resume import row_settings, stamp
from pipeline.run import run
from tests.pipeline_cases import write


def complete_output(tmp_path, job: JobConfig, name: str = "a") -> None:
    """An output holding shard `name` as `job` would have written it, and that run's summary."""
    table = stamp(pa.table({"id": [f"{name}-0"], "generated_text": ["done"]}), row_settings(job, plan_input(job)))
    (tmp_path / "out").mkdir(exist_ok=True)
    pq.write_table(table, tmp_path / f"out/{name}.parquet")
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


def test_resume_takes_kept_digests_for_files_unchanged_since_and_returns_the_ones_it_read(tmp_path):
    """A kept SHA-256 stands in for reading a file where its entry names this run's input and the file's version now;
    a file whose version moved on since (or an entry of another input) is read, and what was read comes back for
    keeping; a kept file that does not parse is ignored."""
    from pipeline.resume import check_resume
    from pipeline.sink import OutputStore

    rows, size = random.randint(1, 9), random.randint(100, 999)
    data = lambda version: {"rows": rows, "bytes": size, "version": version}
    now = {"input": "in2", "max_new_tokens": 4}
    recorded = {"moved": dict(now, input="in1", input_data=dict(data("v1"), sha256="s")),
                "touched": dict(now, input_data=dict(data("v1"), sha256="s"))}
    current = {"moved": data("v1"), "touched": data("v2")}
    calls = []
    digest = lambda name: calls.append(name) or "s"
    known = {"moved": {"input": "in2", "version": "v1", "sha256": "s"},
             "touched": {"input": "in2", "version": "v2", "sha256": "s"}}
    assert check_resume(now, recorded, "out", current, digest=digest, known=known) == {} and calls == []
    stale = dict(known, touched={"input": "in2", "version": "v1", "sha256": "s"},
                 moved={"input": "in0", "version": "v1", "sha256": "s"})
    got = check_resume(now, recorded, "out", current, digest=digest, known=stale)
    assert sorted(calls) == ["moved", "touched"]
    assert got == {"moved": {"input": "in2", "version": "v1", "sha256": "s"},
                   "touched": {"input": "in2", "version": "v2", "sha256": "s"}}
    with pytest.raises(ValueError, match=r"shard 'touched' .*the file rewritten in place"):  # a kept wrong digest
        check_resume(now, recorded, "out", current, digest=digest,
                     known=dict(known, touched={"input": "in2", "version": "v2", "sha256": "other"}))
    store = OutputStore(str(tmp_path / "out"))
    store.prepare()
    assert store.digests() == {}
    store.keep_digests({"x": 1}, got)
    assert store.digests() == {"x": 1, **got}
    (tmp_path / "out/_stats/_digests.json").write_text("{not json")
    assert store.digests() == {}
