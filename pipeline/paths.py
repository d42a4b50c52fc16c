"""Where the output may lie relative to the input: never over an input file, never where a rerun would read it
back as input. Checked before Ray starts (pipeline.run)."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from fsspec.utils import glob_translate

from pipeline.io import InputPlan


def check_output_apart(plan: InputPlan, output: str, out_fs: Any, out_root: str) -> None:
    """ValueError naming the clash when an output shard would be written over an input file (links resolved), or
    when a rerun, which is how a job resumes, would read the output's shards as input: under an input folder or a
    dataset's folder, or where the input's glob matches them (parts starting with `_` or `.` are never read)."""
    if plan.filesystem is None or not _same_store(plan.filesystem, out_fs):
        return
    targets = {s.name: _norm(out_fs, posixpath.join(out_root, f"{s.name}.parquet")) for s in plan.shards}
    for shard in plan.shards:
        if shard.path is not None and _norm(plan.filesystem, shard.path) == targets[shard.name]:
            raise ValueError(f"output {output!r} would write shard {shard.name!r} over input file {shard.path!r}: "
                             "give another --output")
    if plan.root is None:
        return
    root = _norm(plan.filesystem, plan.root) if plan.root else ""  # "": a glob with a wildcard in its first part
    pattern = re.compile(glob_translate(_norm(plan.filesystem, plan.pattern))) if plan.pattern else None
    if any(_read_back(root, pattern, target) for target in targets.values()):
        raise ValueError(f"output {output!r} lies inside input {plan.pattern or plan.root!r}: a rerun would read the "
                         "output's shards as input; give an --output outside it (or in a folder whose name starts "
                         "with _ or ., which the input's listing skips)")


def _read_back(root: str, pattern: re.Pattern | None, target: str) -> bool:
    """Whether the input's listing (pipeline.io._list_parquet) would take file `target`."""
    if root and not target.startswith(root.rstrip("/") + "/"):
        return False
    if any(part.startswith((".", "_")) for part in target[len(root):].strip("/").split("/")):
        return False
    return pattern is None or pattern.fullmatch(target) is not None


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def _same_store(fs: Any, other: Any) -> bool:
    return bool(_protocols(fs) & _protocols(other))


def _norm(fs: Any, path: str) -> str:
    """A comparable form of a path: local paths resolved (links, `..`), others without a trailing slash."""
    if "file" in _protocols(fs):
        return os.path.realpath(os.path.expanduser(path))
    return path.rstrip("/")
