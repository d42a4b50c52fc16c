"""Where the output may lie relative to the input: never over an input file, never where a rerun would read it
back as input. Checked before Ray starts (pipeline.run)."""

from __future__ import annotations

import fnmatch
import os
import posixpath
from typing import Any

from pipeline.io import InputPlan


def check_output_apart(plan: InputPlan, output: str, out_fs: Any, out_root: str) -> None:
    """ValueError naming the clash when an output shard would be written over an input file, or when the output
    lies inside the input (a folder, a dataset folder, or where the input's glob would match the output's shards):
    a rerun, which is how a job resumes, would take the outputs for input."""
    if plan.filesystem is None or not _same_store(plan.filesystem, out_fs):
        return
    out = _norm(out_fs, out_root)
    targets = {s.name: posixpath.join(out, f"{s.name}.parquet") for s in plan.shards}
    for shard in plan.shards:
        if shard.path is not None and _norm(plan.filesystem, shard.path) == targets[shard.name]:
            raise ValueError(f"output {output!r} would write shard {shard.name!r} over input file {shard.path!r}: "
                             "give another --output")
    if plan.root is None:
        return
    root = _norm(plan.filesystem, plan.root)
    if plan.pattern is not None:
        pattern = _norm(plan.filesystem, plan.pattern)
        inside = any(_glob_matches(pattern, t) for t in targets.values())
    else:
        inside = out == root or out.startswith(root.rstrip("/") + "/")
    if inside:
        raise ValueError(f"output {output!r} lies inside input {plan.pattern or plan.root!r}: a rerun would read the "
                         "output's shards as input; give an --output outside it")


def _same_store(fs: Any, other: Any) -> bool:
    protocol = lambda f: {f.protocol} if isinstance(f.protocol, str) else set(f.protocol)  # noqa: E731
    return bool(protocol(fs) & protocol(other))


def _norm(fs: Any, path: str) -> str:
    """A comparable form of a path: local paths resolved (symlinks, `..`), others without a trailing slash."""
    if "file" in ({fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)):
        return os.path.realpath(os.path.expanduser(path))
    return path.rstrip("/")


def _glob_matches(pattern: str, path: str) -> bool:
    """Whether fsspec's glob `pattern` would match `path`: `*`, `?` and `[...]` within one path segment, `**`
    across segments."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    parts, names = pattern.split("/"), path.split("/")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts, strict=True))
