"""`ray job submit` of jobs.generate to a local head that this test starts and stops.

The head gets its own ports and temp dir, so it never meets another Ray on the machine, and it is
stopped by signalling the `ray start --block` process this test started (not `ray stop`, which
would stop every Ray of the user).
"""

from __future__ import annotations

import os
import shutil
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


def submit(url: str, env: dict, working_dir, *args: str) -> str:
    """`ray job submit` of jobs.generate with this working directory; its output, after asserting it succeeded."""
    cmd = [RAY, "job", "submit", "--address", url, "--working-dir", ".", "--", "python", "-m", "jobs.generate", *args]
    job = subprocess.run(cmd, cwd=working_dir, env=env, capture_output=True, text=True, timeout=540)
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-5000:]
    return logs


def test_ray_job_submit_rag_example_and_resubmit(ray_head, tmp_path):
    """The README's submission of examples/rag_job.yaml (its input a relative path), then the same submission after
    a file changed in the working directory: Ray ships it as a new temporary copy, so the input's path differs, but
    its data do not, and the rerun resumes (nothing to do) instead of refusing the output."""
    url, env = ray_head
    work, out = tmp_path / "work", tmp_path / "rag-out"
    (work / "examples").mkdir(parents=True)
    for name in ("rag_job.yaml", "rag_prompts.parquet"):
        shutil.copy(os.path.join(REPO, "examples", name), work / "examples" / name)
    args = ("--config", "examples/rag_job.yaml", "--output", str(out), "--max-new-tokens", "4", "--log-interval-s", "5")
    logs = submit(url, env, work, *args)
    assert "job summary" in logs and "progress:" in logs, logs[-5000:]
    table = pq.read_table(str(out / "rag_prompts.parquet"))
    assert table.num_rows == 6 and set(table["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert (out / "_stats" / "rag_prompts.parquet").exists() and (out / "_stats" / "_summary.json").exists()
    (work / "notes.txt").write_text("a change to the working directory\n")
    logs = submit(url, env, work, *args)
    assert "nothing to do" in logs, logs[-5000:]
    assert pq.read_table(str(out / "rag_prompts.parquet")).equals(table)
