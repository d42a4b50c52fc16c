"""Where a job's output may lie, and what a rerun takes for a complete shard (checked before Ray starts): an output
that would write over an input file or lie where a rerun reads input is refused; a file that is not an output shard
is never taken for one; a shard resumes under any name of the same input data (another working directory's path,
a folder named as a glob) and not over changed data. No Ray, no weights."""

from __future__ import annotations

import json
import random
import shutil

import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.io import content_digest, plan_input
from pipeline.resume import row_settings, stamp
from pipeline.run import run
from tests.pipeline_cases import write


def job(tmp_path, tiny_model, input, output, **kw) -> JobConfig:
    return JobConfig(input=str(input), output=str(output), model=tiny_model, **kw)


def finished(job_config: JobConfig) -> None:
    """Write every shard of the job's input into its output, stamped as that job's run would have stamped it."""
    plan = plan_input(job_config)
    for shard in plan.shards:
        table = pq.read_table(shard.path).drop_columns(["prompt"]).append_column(
            "generated_text", [["done"] * shard.num_rows])
        data = {**shard.data, "sha256": content_digest(plan, shard)}
        table = stamp(table, {**row_settings(job_config, plan), "input_data": data})
        write(f"{job_config.output}/{shard.name}.parquet")  # makes the folder
        pq.write_table(table, f"{job_config.output}/{shard.name}.parquet")


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("where", ["same", "nested", "glob-matching", "file-collision", "glob-zero-folders",
                                   "linked-file"])
def test_an_output_in_the_input_is_refused_before_anything_is_written(tmp_path, tiny_model, where, overwrite):
    rows = random.randint(1, 5)
    write(str(tmp_path / "in/sub/two.parquet"), prompt=[f"p{i}" for i in range(rows)])
    before = (tmp_path / "in/sub/two.parquet").read_bytes()
    (tmp_path / "links").mkdir()
    (tmp_path / "links/two.parquet").symlink_to(tmp_path / "in/sub/two.parquet")
    input, output = {"same": ("in", "in"), "nested": ("in", "in/out"), "glob-matching": ("in/*/*.parquet", "in/x"),
                     "file-collision": ("in/sub/two.parquet", "in/sub"),
                     "glob-zero-folders": ("in/**/*.parquet", "in"),  # ** matches no folder too: in/sub__two.parquet
                     "linked-file": ("links/two.parquet", "in/sub")}[where]  # the output would replace the link's file
    with pytest.raises(ValueError, match="over input file|lies inside input"):
        run(job(tmp_path, tiny_model, tmp_path / input, tmp_path / output, overwrite=overwrite))
    assert (tmp_path / "in/sub/two.parquet").read_bytes() == before
    assert sorted(str(p.relative_to(tmp_path / "in")) for p in (tmp_path / "in").rglob("*")) == [
        "sub", "sub/two.parquet"]  # no _stats/ made either


@pytest.mark.parametrize("input, output", [("in/*.parquet", "in/out"), ("in/two.parquet", "in/out"),
                                           ("in", "other/in"), ("in", "in/_out"), ("in/**/*.parquet", "in/.out/x"),
                                           ("in", "in-out")])
def test_an_output_beside_the_input_is_fine(tmp_path, tiny_model, input, output):
    """A glob that does not reach the output's files, a lone file's own folder, a folder of the same name elsewhere,
    folders inside the input whose names start with _ or . (its listing skips them), a sibling sharing a prefix."""
    from pipeline.paths import check_output_apart
    from pipeline.sink import OutputStore

    write(str(tmp_path / "in/two.parquet"), prompt=["p"])
    cfg = job(tmp_path, tiny_model, tmp_path / input, tmp_path / output)
    store = OutputStore(cfg.output)
    check_output_apart(plan_input(cfg), cfg.output, store.fs, store.root)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_that_is_not_a_shard_is_never_taken_for_one(tmp_path, tiny_model, overwrite):
    write(str(tmp_path / "in/a.parquet"), prompt=["p"])
    write(str(tmp_path / "out/a.parquet"), prompt=["a user's table"])  # no generated_text: not an output shard
    with pytest.raises(ValueError, match="a.parquet, which is not a kivi-ray output shard"):
        run(job(tmp_path, tiny_model, tmp_path / "in", tmp_path / "out", overwrite=overwrite))
    assert pq.read_table(tmp_path / "out/a.parquet").column_names == ["prompt"]


def test_a_shard_resumes_wherever_its_input_lies_now_but_not_over_other_data(tmp_path, tiny_model):
    """As under `ray job submit`, where a relative input lies in a new temporary copy of the working directory each
    time: the shards' recorded data (rows, bytes, SHA-256) match, so the rerun has nothing to do; the same files
    named as a glob too. Another file of the same name, rows and size elsewhere is refused by its path; a file whose
    rows or size changed, by its data."""
    n = random.randint(2, 6)
    write(str(tmp_path / "run1/in/a.parquet"), prompt=[f"p{i}" for i in range(n)])
    write(str(tmp_path / "run1/in/b.parquet"), prompt=["q"])
    finished(job(tmp_path, tiny_model, tmp_path / "run1/in", tmp_path / "out"))
    shutil.copytree(tmp_path / "run1", tmp_path / "run2")
    for input in ("run2/in", "run2/in/*.parquet", "run1/in/*.parquet"):
        summary = run(job(tmp_path, tiny_model, tmp_path / input, tmp_path / "out"))
        assert (summary["shards_done"], summary["shards_skipped"]) == (0, 2), input
    write(str(tmp_path / "run3/in/a.parquet"), prompt=[f"P{i}" for i in range(n)])  # same names, rows and bytes
    write(str(tmp_path / "run3/in/b.parquet"), prompt=["q"])
    assert (tmp_path / "run3/in/a.parquet").stat().st_size == (tmp_path / "run1/in/a.parquet").stat().st_size
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input '.*run1/in' -> '.*run3/in'\)"):
        run(job(tmp_path, tiny_model, tmp_path / "run3/in", tmp_path / "out"))
    write(str(tmp_path / "run2/in/a.parquet"), prompt=[f"p{i}" for i in range(n + 1)])
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input .*; input_data \{'rows': "
                                         rf"{n}, "):
        run(job(tmp_path, tiny_model, tmp_path / "run2/in", tmp_path / "out"))
    shutil.copy(tmp_path / "run2/in/a.parquet", tmp_path / "run1/in/a.parquet")  # the recorded path, new data
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input_data \{'rows'"):
        run(job(tmp_path, tiny_model, tmp_path / "run1/in", tmp_path / "out"))


def test_a_file_rewritten_in_place_with_the_same_size_is_refused_but_a_touched_one_resumes(tmp_path, tiny_model,
                                                                                            monkeypatch):
    """At its recorded path, with its recorded rows and bytes: a file whose contents changed is refused, also when
    its modification time was put back; one only touched, or copied over by the same bytes, resumes, and is read
    whole once, not on every rerun (its SHA-256 kept in _stats/_digests.json with its new version); a shard
    recorded without a version (an earlier kivi-ray's) is not checked."""
    import os

    from pipeline import run as run_module

    hashed = []
    content_digest = run_module.content_digest
    monkeypatch.setattr(run_module, "content_digest", lambda plan, shard: hashed.append(shard.name) or content_digest(
        plan, shard))
    n = random.randint(2, 6)
    path = tmp_path / "in/a.parquet"
    write(str(path), prompt=[f"p{i}" for i in range(n)])
    cfg = job(tmp_path, tiny_model, tmp_path / "in", tmp_path / "out")
    finished(cfg)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same bytes, a new time
    for reads in (["a"], ["a"]):  # the first rerun reads the file; the second takes the kept SHA-256
        summary = run(cfg)
        assert (summary["shards_done"], summary["shards_skipped"]) == (0, 1) and hashed == reads
    kept = json.loads((tmp_path / "out/_stats/_digests.json").read_text())
    assert list(kept) == ["a"] and f"mtime {path.stat().st_mtime}" in kept["a"]["version"]
    touched = path.stat()
    write(str(path), prompt=[f"P{i}" for i in range(n)])  # edited in place: same rows and size
    assert path.stat().st_size == stat.st_size
    # its modification time put back as the rerun last saw it (cp -p, rsync -t, tar): the status-change time,
    # which no one can set, still tells the rewrite
    os.utime(path, ns=(touched.st_atime_ns, touched.st_mtime_ns))
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input_data 'the file as it was' -> "
                                         r"'the file rewritten in place since"):
        run(cfg)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))  # and with a new modification time
    with pytest.raises(ValueError, match=r"shard 'a' made with other settings \(input_data 'the file as it was' -> "
                                         r"'the file rewritten in place since"):
        run(cfg)
    table = pq.read_table(tmp_path / "out/a.parquet")  # as an earlier version recorded it: no version
    meta = dict(table.schema.metadata)
    key = next(k for k, v in meta.items() if b'"input_data"' in v)
    settings = json.loads(meta[key])
    del settings["input_data"]["version"]
    older = table.replace_schema_metadata({**meta, key: json.dumps(settings).encode()})
    pq.write_table(older, tmp_path / "out/a.parquet")
    assert run(cfg)["shards_skipped"] == 1


def test_a_path_with_glob_characters_that_exists_is_read_as_it_is(tmp_path, tiny_model):
    write(str(tmp_path / "runs[1]/a.parquet"), prompt=["p", "q"])
    for input in ("runs[1]", "runs[1]/a.parquet"):
        plan = plan_input(job(tmp_path, tiny_model, tmp_path / input, tmp_path / "out"))
        assert [(s.name, s.num_rows) for s in plan.shards] == [("a", 2)] and plan.pattern is None
    write(str(tmp_path / "runs1/b.parquet"), prompt=["p"])
    plan = plan_input(job(tmp_path, tiny_model, tmp_path / "runs[1]/*.parquet", tmp_path / "out"))  # a pattern still
    assert [s.name for s in plan.shards] == ["runs1__b"] and plan.pattern is not None


def test_a_shard_that_cannot_be_read_is_named_not_guessed(tmp_path, tiny_model):
    write(str(tmp_path / "in/a.parquet"), prompt=["p"])
    (tmp_path / "out/a.parquet").mkdir(parents=True)  # opening it fails with an OSError, as a store's error would
    with pytest.raises(ValueError, match=r"cannot read '.*out/a.parquet' to check it"):
        run(job(tmp_path, tiny_model, tmp_path / "in", tmp_path / "out"))


def test_a_glob_with_a_wildcard_in_its_first_part_is_checked_too(tmp_path, tiny_model):
    """Its listing's root is "" (nothing before the first wildcard): the output is still matched against it."""
    write(str(tmp_path / "in/a.parquet"), prompt=["p"])
    first, *rest = tmp_path.parts[1:]
    pattern = "/" + "/".join([first[:-1] + "*", *rest, "i*", "*.parquet"])  # e.g. /tm*/.../i*/*.parquet
    with pytest.raises(ValueError, match="lies inside input"):
        run(job(tmp_path, tiny_model, pattern, tmp_path / "in2"))  # a rerun's glob would read in2/a.parquet


def test_shards_recorded_with_the_first_form_of_input_data_are_still_checked():
    """320f1d1 recorded "<rows> rows, <bytes> bytes": the same facts resume, others are refused."""
    from pipeline.resume import check_resume

    rows, size = random.randint(1, 99), random.randint(100, 9999)
    settings = {"input": "/in", "max_new_tokens": 8}
    recorded = {"a": dict(settings, input_data=f"{rows} rows, {size} bytes")}
    check_resume(settings, recorded, "out", {"a": {"rows": rows, "bytes": size}})
    with pytest.raises(ValueError, match="input_data"):
        check_resume(settings, recorded, "out", {"a": {"rows": rows + 1, "bytes": size + 3}})
