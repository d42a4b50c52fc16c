"""End to end on one local Ray (2 CPUs) with the real SmolLM2-135M-Instruct, a few prompts, few tokens.

One Ray instance and one moto S3 server serve the whole module; each test is one job run.
"""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from pipeline.stats import STATS_SCHEMA

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT_COLUMNS = ["generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "error"]
PASSAGE = (
    "The history of the bicycle begins in the early nineteenth century with the draisine, a two-wheeled "
    "machine pushed along by the rider's feet. Pedals attached to the front wheel came in the 1860s, and "
    "the tall penny-farthing followed. The safety bicycle, with a chain drive and two wheels of equal "
    "size, made cycling practical for many people by the 1890s. "
)
LONG = PASSAGE * 6  # about 400 tokens: most of it lands in the 2-bit store when R = 32
BUCKET = "kivi-ray-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def ray_local(s3_endpoint):
    """Local Ray for the module. AWS variables are set first: workers inherit them when Ray starts."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "RAY_AUTH_MODE": "disabled",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def run(*argv: str) -> None:
    assert main([*argv, "--log-interval-s", "2"]) == 0


def read(path) -> pa.Table:
    return pq.read_table(str(path))


def chat_row(i, content, topic="t", sampling=None):
    return {
        "id": i,
        "messages": None if content is None else [{"role": "user", "content": c} for c in content],
        "topic": topic,
        "meta": {"n": i},
        "sampling_params": sampling,
    }


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("topic", pa.string()),
            ("meta", pa.struct([("n", pa.int64())])),
            ("sampling_params", pa.struct([("max_new_tokens", pa.int64())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))


@pytest.fixture(scope="module")
def chat_job(ray_local, tmp_path_factory):
    """A folder of three files (shards): good chat rows, bad rows, long prompts."""
    root = tmp_path_factory.mktemp("chat")
    write_rows(
        root / "in/a.parquet",
        [
            chat_row(0, ["What is the capital of France?"], "geo"),
            chat_row(1, ["Name a primary colour."], "art", sampling={"max_new_tokens": 1}),
            chat_row(2, ["Say hello."], "misc"),
        ],
    )
    write_rows(
        root / "in/b.parquet",
        [
            chat_row(3, None),  # null messages
            chat_row(4, []),  # empty chat
            chat_row(5, ["word " * 9000]),  # longer than the model's 8192-token context
            chat_row(6, ["Count to three."]),
        ],
    )
    write_rows(root / "in/sub/c.parquet", [chat_row(7, [LONG + "Summarize."]), chat_row(8, [LONG + "Who?"])])
    flags = "--max-new-tokens 4 --residual-length 32 --batch-size 4 --dtype bfloat16".split()
    argv = ["--input", str(root / "in"), "--output", str(root / "out"), *flags]
    run(*argv)
    return root, argv


def test_chat_rows_errors_and_passthrough(chat_job, caplog):
    root, _ = chat_job
    out = root / "out"
    tables = {name: read(out / f"{name}.parquet") for name in ("a", "b", "sub__c")}
    for table in tables.values():
        assert table.column_names == ["id", "topic", "meta", *OUTPUT_COLUMNS]
    a, b = tables["a"].to_pylist(), tables["b"].to_pylist()
    assert [r["id"] for r in a] == [0, 1, 2] and [r["meta"] for r in a] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [r["topic"] for r in a] == ["geo", "art", "misc"]
    for r in a + [b[3]] + tables["sub__c"].to_pylist():
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None, r
        assert r["generated_text"] and 1 <= r["num_generated_tokens"] <= 4 and r["num_input_tokens"] > 5
    assert a[1]["num_generated_tokens"] == 1  # the row's own sampling_params
    assert [r["id"] for r in b] == [3, 4, 5, 6]
    assert [r["finish_reason"] for r in b[:3]] == ["error"] * 3
    assert "null" in b[0]["error"] and "empty" in b[1]["error"] and b[2]["error"]
    assert b[2]["num_input_tokens"] > 8192


def test_stats_per_shard_and_kv_ratio(chat_job):
    root, _ = chat_job
    expected = {"a": (3, 0), "b": (4, 3), "sub__c": (2, 0)}
    for shard, (requests, failed) in expected.items():
        st = read(root / "out/_stats" / f"{shard}.parquet")
        assert st.schema.names == STATS_SCHEMA.names
        rows = st.to_pylist()
        assert rows and {r["shard"] for r in rows} == {shard}
        assert sum(r["num_requests"] for r in rows) == requests
        assert sum(r["num_failed"] for r in rows) == failed
        for r in rows:
            assert r["kv_bits"] == 2 and r["residual_length"] == 32 and r["device_name"]
            assert r["model_dtype"] == r["cache_dtype"] == "bfloat16"  # the job's --dtype bfloat16
            assert r["elapsed_time_s"] > 0 and r["max_allocated_mb"] > 0 and "-pid-" in r["actor_id"]  # a Ray actor
            assert r["engine_oom_retries"] == 0 and r["engine_rebuilds"] == 0  # the real engine's counts
    long_rows = read(root / "out/_stats/sub__c.parquet").to_pylist()
    for r in long_rows:
        assert r["mean_ttft_ms"] > 0 and r["output_tokens_per_second"] > 0
        assert 0 < r["mean_tpot_ms"] < r["elapsed_time_s"] * 1e3
        assert 0 < r["kv_cache_bytes"] / r["kv_cache_bytes_bf16"] < 0.5, r
    summary = json.loads((root / "out/_stats/_summary.json").read_text())["summary"]
    assert summary["num_requests"] == 9 and summary["num_failed"] == 3 and summary["shards_done"] == 3
    assert 0 < summary["mean_tpot_ms"] < summary["wall_time_s"] * 1e3
    every = pq.read_table(str(root / "out/_stats"))  # the folder reads as one table: the summary is skipped
    assert sum(every["num_requests"].to_pylist()) == 9 and len(set(every["shard"].to_pylist())) == 3


def test_resume_after_partial_run(chat_job):
    """A crash after shards b and c: a's output is missing and a temp file lies around."""
    root, argv = chat_job
    out = root / "out"
    mtimes = {n: os.stat(out / f"{n}.parquet").st_mtime_ns for n in ("b", "sub__c")}
    os.remove(out / "a.parquet")
    (out / ".a.parquet.deadbeef.tmp").write_bytes(b"half a file")
    run(*argv)
    summary = json.loads((out / "_stats/_summary.json").read_text())["summary"]
    assert (summary["shards_done"], summary["shards_skipped"], summary["num_requests"]) == (1, 2, 3)
    assert read(out / "a.parquet")["id"].to_pylist() == [0, 1, 2]
    assert {n: os.stat(out / f"{n}.parquet").st_mtime_ns for n in ("b", "sub__c")} == mtimes


def test_no_kivi_baseline_and_overwrite(chat_job):
    root, _ = chat_job
    out = root / "out-bf16"
    flags = "--max-new-tokens 2 --no-kivi --dtype bfloat16".split()
    argv = ["--input", str(root / "in/sub/*.parquet"), "--output", str(out), *flags]
    run(*argv)
    (st,) = read(out / "_stats/c.parquet").to_pylist()
    assert st["kv_bits"] == 16 and st["group_size"] is None
    assert st["kv_cache_bytes"] > 0 and st["kv_cache_bytes"] == st["kv_cache_bytes_bf16"]
    before = os.stat(out / "c.parquet").st_mtime_ns
    summary = (out / "_stats/_summary.json").read_text()
    assert main([*argv, "--temperature", "0.5"]) == 2  # other sampling: resuming would mix two jobs' rows
    run(*argv)  # nothing to do: the output and its summary stay as they are
    assert os.stat(out / "c.parquet").st_mtime_ns == before
    assert (out / "_stats/_summary.json").read_text() == summary
    run(*argv, "--overwrite")
    assert os.stat(out / "c.parquet").st_mtime_ns != before


def test_rag_template_from_config_file(ray_local, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)  # the example config names its input relative to the repo
    caplog.set_level(logging.INFO, logger="kivi_ray")
    run("--config", "examples/rag_job.yaml", "--output", str(tmp_path / "rag"), "--max-new-tokens", "6")
    source = read(os.path.join(REPO, "examples/rag_prompts.parquet"))
    out = read(tmp_path / "rag/rag_prompts.parquet")
    assert out.column_names == ["id", "context", "question", "source", *OUTPUT_COLUMNS]
    assert out["id"].to_pylist() == source["id"].to_pylist()
    assert out["source"].to_pylist() == source["source"].to_pylist()
    assert set(out["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert max(out["num_generated_tokens"].to_pylist()) <= 6  # the flag overrides the file's 48
    assert any("progress:" in r.getMessage() and "tokens/s" in r.getMessage() for r in caplog.records)


def test_hf_dataset_input(ray_local, tmp_path):
    import datasets

    prompts = ["Write one word about the sea.", "", "Name a fruit."]
    datasets.Dataset.from_dict({"prompt": prompts, "lang": ["en"] * 3}).save_to_disk(str(tmp_path / "hf"))
    run(
        "--input",
        str(tmp_path / "hf"),
        "--output",
        str(tmp_path / "out"),
        "--chat",
        "--hf-shard-rows",
        "2",
        "--max-new-tokens",
        "3",
    )
    first = read(tmp_path / "out/rows-000000000-000000001.parquet").to_pylist()
    last = read(tmp_path / "out/rows-000000002-000000002.parquet").to_pylist()
    assert [r["id"] for r in first + last] == ["0", "1", "2"]
    assert [r["finish_reason"] == "error" for r in first + last] == [False, True, False]
    assert first[0]["lang"] == "en" and "empty" in first[1]["error"]


def test_s3_input_and_output(ray_local, s3_endpoint):
    import boto3
    import s3fs

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    for name, rows in {"p0": ["Say yes.", "Say no."], "p1": ["Name a colour."]}.items():
        with fs.open(f"{BUCKET}/in/{name}.parquet", "wb") as f:
            pq.write_table(pa.table({"prompt": rows, "k": [name] * len(rows)}), f)
    argv = ["--input", f"s3://{BUCKET}/in/", "--output", f"s3://{BUCKET}/out", "--s3-endpoint-url", s3_endpoint,
            "--chat", "--max-new-tokens", "3"]
    with fs.open(f"{BUCKET}/out/_stats/summary.json", "w") as f:  # an earlier version's summary: removed
        f.write("{}")
    run(*argv)
    fs.invalidate_cache()
    files = sorted(p.rsplit("/", 1)[1] for p in fs.find(f"{BUCKET}/out"))
    assert files == ["_summary.json", "p0.parquet", "p0.parquet", "p1.parquet", "p1.parquet"]
    with fs.open(f"{BUCKET}/out/p0.parquet", "rb") as f:
        p0 = pq.read_table(f).to_pylist()
    assert [r["id"] for r in p0] == ["p0-0", "p0-1"] and {r["k"] for r in p0} == {"p0"}
    assert all(r["finish_reason"] in ("stop", "length") and r["generated_text"] for r in p0)
    # a rerun reads the shards' settings back from the store: the same ones resume (nothing to do), others are
    # refused
    run(*argv)
    assert main([*argv, "--max-new-tokens", "4"]) == 2


def test_default_job_of_the_quick_start(ray_local, tmp_path):
    """The README's first command (no --input, no --model): the shipped samples through SmolLM2, whose long
    read-and-answer prompts leave most of their cache in the 2-bit store."""
    run("--output", str(tmp_path / "out"), "--max-new-tokens", "4")
    out = read(tmp_path / "out/sample_prompts.parquet")
    source = read(os.path.join(REPO, "pipeline/data/sample_prompts.parquet"))
    assert out.column_names == ["id", "category", *OUTPUT_COLUMNS]
    assert out["id"].to_pylist() == source["id"].to_pylist() and out.num_rows == 36
    rows = out.to_pylist()
    assert all(r["finish_reason"] in ("stop", "length") and r["error"] is None for r in rows)
    assert all(r["generated_text"] or r["num_generated_tokens"] <= 1 for r in rows)
    assert {r["category"] for r in rows if r["num_input_tokens"] > 256} == {"read"}
    summary = json.loads((tmp_path / "out/_stats/_summary.json").read_text())["summary"]
    assert summary["num_requests"] == 36 and summary["num_failed"] == 0
    assert 0.5 < summary["kv_cache_ratio"] < 0.95  # the long prompts' cache is mostly packed
