"""`ray job submit` of jobs.generate to a local head that this test starts and stops.

The head gets its own ports and temp dir, so it never meets another Ray on the machine, and it is
stopped by signalling the `ray start --block` process this test started (not `ray stop`, which
would stop every Ray of the user).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    # no token auth for a loopback test cluster; stop at once on SIGTERM (no 30 s node drain)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="kr-head-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = {
        f"--{name}": str(free_port())
        for name in ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port")
    }
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        "--num-cpus",
        "2",
        "--dashboard-host",
        "127.0.0.1",
        "--include-dashboard",
        "true",
        "--temp-dir",
        temp_dir,
        *(x for kv in ports.items() for x in kv),
    ]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        _wait_for(url, head, tmp_path / "head.log")
        yield url, env
    finally:
        head.terminate()  # `ray start --block` drains and stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
        log.close()


def _wait_for(url: str, head: subprocess.Popen, log) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{open(log).read()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the Ray head's job server at {url} did not come up:\n{open(log).read()[-3000:]}")


def test_ray_job_submit_rag_example(ray_head, tmp_path):
    url, env = ray_head
    out = tmp_path / "rag-out"
    cmd = [
        RAY,
        "job",
        "submit",
        "--address",
        url,
        "--working-dir",
        ".",
        "--",
        "python",
        "-m",
        "jobs.generate",
        "--config",
        "examples/rag_job.yaml",
        "--output",
        str(out),
        "--max-new-tokens",
        "4",
        "--log-interval-s",
        "5",
    ]
    job = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    logs = job.stdout + job.stderr
    assert job.returncode == 0, logs[-5000:]
    assert "succeeded" in logs and "job summary" in logs and "progress:" in logs, logs[-5000:]
    table = pq.read_table(str(out / "rag_prompts.parquet"))
    assert table.num_rows == 6 and set(table["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert (out / "_stats" / "rag_prompts.parquet").exists() and (out / "_stats" / "_summary.json").exists()
