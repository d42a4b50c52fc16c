"""A pool of several actors on the CPUs: shards are split between actors, no row is lost or doubled,
and the per-shard stats name every actor that worked on a shard (scale-out without a multi-GPU machine)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_two_cpus():
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.delenv("RAY_ADDRESS", raising=False)
        # 2 logical CPUs, as on a 2-core laptop: two actors of one CPU each would hold both and the read
        # tasks would wait forever (the job hung so); the pool gives each actor half a CPU instead
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def test_two_actors_share_the_shards(ray_two_cpus, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    ids = []
    for shard in range(3):
        rows = [{"id": f"s{shard}-{i}", "prompt": f"Count to {i + shard} in words.", "shard_no": shard}
                for i in range(8)]
        ids += [r["id"] for r in rows]
        pq.write_table(pa.Table.from_pylist(rows), src / f"part{shard}.parquet")
    out = tmp_path / "out"
    argv = ["--input", str(src), "--output", str(out), "--actors", "2", "--batch-size", "2",
            "--max-new-tokens", "8", "--chat", "--log-interval-s", "2"]
    assert main(argv) == 0
    rows = []
    for shard in range(3):
        table = pq.read_table(out / f"part{shard}.parquet")
        assert table.column("shard_no").to_pylist() == [shard] * 8  # input order kept within a shard
        rows += table.to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every row exactly once
    assert all(r["finish_reason"] in ("stop", "length") and r["num_generated_tokens"] > 0 for r in rows)
    stats = [r for f in sorted((out / "_stats").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert sum(s["num_requests"] for s in stats) == len(ids)
    assert {s["shard"] for s in stats} == {"part0", "part1", "part2"}
    actors = {s["actor_id"] for s in stats}
    summary = json.loads((out / "_stats" / "_summary.json").read_text())
    print(f"{len(actors)} actors, summary {summary}")
    assert len(actors) == 2  # both actors of the pool did work
