"""Input side: find the input, cut it into shards, check its columns before any actor starts, read it.

A shard is the unit of output and of resume:
- Parquet input: one shard per input file, named after the file's path below the input root
  (`a/b.parquet` -> `a__b`), so names stay the same when files are added or the job reruns.
- A Hugging Face dataset saved to disk: blocks of `hf_shard_rows` rows, named `rows-<first>-<last>`.
Rows reach the driver in input order (Ray Data's preserve_order), so the driver knows each row's
shard and position by counting.
"""

from __future__ import annotations

import hashlib
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobConfig, template_fields

SAMPLE_PROMPTS = Path(__file__).parent / "data" / "sample_prompts.parquet"
OUTPUT_TYPES = {"generated_text": pa.string(), "num_input_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
                "finish_reason": pa.string(), "error": pa.string()}
OUTPUT_COLUMNS = tuple(OUTPUT_TYPES)
CONSUMED_COLUMNS = ("prompt", "messages", "sampling_params")  # read by the actor, not passed through
HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Shard:
    name: str  # output file stem: stable across reruns
    num_rows: int
    path: str | None = None  # the parquet file (a filesystem path), None for Hugging Face row blocks
    start: int = 0  # first row of a Hugging Face block
    # cheap facts of the rows, wherever they lie: the file's rows, bytes and version (ETag or modification time), or
    # the block's place in the dataset and the dataset's fingerprint (pipeline.resume.check_resume; with
    # content_digest for a file that moved or whose version changed)
    data: dict[str, Any] | None = None

    def default_id(self, row: int) -> str:
        """Id of row `row` of this shard when the input has no `id` column."""
        return str(self.start + row) if self.path is None else f"{self.name}-{row}"


@dataclass
class InputPlan:
    kind: str  # "parquet" or "hf"
    shards: list[Shard]
    schema: pa.Schema
    source: str  # how the actor builds prompts: "template", "messages" or "prompt"
    filesystem: Any = None  # fsspec filesystem of the parquet files
    hf_dataset: Any = None  # datasets.Dataset for kind == "hf"
    root: str | None = None  # a folder whose files the input takes (a folder, a glob's or a dataset's), else None
    pattern: str | None = None  # the glob, for a glob input

    @property
    def has_id(self) -> bool:
        return "id" in self.schema.names

    def passthrough(self) -> list[str]:
        return [c for c in self.schema.names if c not in CONSUMED_COLUMNS and c != "id"]

    def output_schema(self) -> pa.Schema:
        """Columns of an output shard: id, the passthrough columns as read, the generated columns."""
        id_type = self.schema.field("id").type if self.has_id else pa.string()
        return pa.schema([("id", id_type), *((c, self.schema.field(c).type) for c in self.passthrough()),
                          *OUTPUT_TYPES.items()])


def filesystem(url: str, endpoint_url: str | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a local path or an s3:// URL."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options(url, endpoint_url) or {}))
    return fs, path.rstrip("/") or path


def storage_options(url: str, endpoint_url: str | None) -> dict[str, Any] | None:
    """fsspec options for `url`: the endpoint of an S3-compatible store, if given."""
    if url.startswith(("s3://", "s3a://")) and endpoint_url:
        return {"client_kwargs": {"endpoint_url": endpoint_url}}
    return None


def plan_input(cfg: JobConfig) -> InputPlan:
    """Find and check the input; ValueError naming the problem, before Ray or any actor starts."""
    url = cfg.input or str(SAMPLE_PROMPTS)
    fs, path = filesystem(url, cfg.s3_endpoint_url)
    fs.invalidate_cache()  # fsspec shares a filesystem per process: a later job in it must not see old listings
    try:
        glob = _has_glob(path, fs)
        is_hf = not glob and fs.isdir(path) and any(fs.exists(f"{path}/{m}") for m in HF_MARKERS)
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, permissions: name the path
        raise ValueError(f"cannot read input {url!r}: {e}") from None
    if cfg.split is not None and not is_hf:
        raise ValueError(f"split={cfg.split!r} applies to a saved Hugging Face DatasetDict; input {url!r} is Parquet")
    plan = _plan_hf(url, cfg) if is_hf else _plan_parquet(fs, path, url, glob)
    plan.filesystem = fs
    if is_hf:
        plan.root = path
    plan.source = prompt_source(plan.schema.names, cfg, url)
    check_source_type(plan.schema, plan.source, url)
    return plan


def _type_is(t: pa.DataType, *checks: str) -> bool:
    """Whether any of pa.types' checks holds (the view types' checks came in pyarrow 16: absent ones are False)."""
    return any(getattr(pa.types, name, lambda _: False)(t) for name in checks)


def _is_text(t: pa.DataType) -> bool:
    return _type_is(t, "is_string", "is_large_string", "is_string_view", "is_null")


def _is_list(t: pa.DataType) -> bool:
    return _type_is(t, "is_list", "is_large_list", "is_fixed_size_list", "is_list_view", "is_large_list_view")


def check_source_type(schema: pa.Schema, source: str, url: str) -> None:
    """A 'prompt' column must hold text, a 'messages' column chat lists (or their JSON text): ValueError naming the
    column's type otherwise, before Ray starts, rather than an error on every row. A template's columns can be
    anything str.format takes."""
    if source not in ("prompt", "messages"):
        return
    dtype = shown = schema.field(source).type
    if pa.types.is_dictionary(dtype):  # e.g. a pandas Categorical: its values are what the rows hold
        dtype = dtype.value_type
    if source == "prompt" and not _is_text(dtype):
        raise ValueError(f"input {url!r}: column 'prompt' is {shown}, but prompts must be text (string); "
                         "cast it, or build the prompt from it with --prompt-template")
    if source == "messages" and not (_is_text(dtype) or _is_list(dtype)):
        raise ValueError(f"input {url!r}: column 'messages' is {shown}, but it must hold chat lists of "
                         "{role, content} (or their JSON text)")


def prompt_source(columns: list[str], cfg: JobConfig, url: str) -> str:
    """Which columns make the prompt; ValueError naming what is missing or colliding."""
    clash = sorted(set(columns) & set(OUTPUT_COLUMNS))
    if clash:
        raise ValueError(f"input {url!r} has columns {clash} that the output would overwrite: rename them")
    if cfg.prompt_template is not None:
        missing = [c for c in template_fields(cfg.prompt_template) if c not in columns]
        if missing:
            raise ValueError(f"prompt_template needs columns {missing} that input {url!r} lacks (has {columns})")
        return "template"
    for source in ("messages", "prompt"):
        if source in columns:
            return source
    raise ValueError(
        f"input {url!r} has no 'prompt' or 'messages' column (columns: {columns}); add one or pass --prompt-template"
    )


def _has_glob(path: str, fs: Any = None) -> bool:
    """Whether `path` is a pattern: it has a glob character and (given fs) names no existing file or folder, so
    that a path like `runs[1]/` is read as it is."""
    if not any(ch in path for ch in GLOB_CHARS):
        return False
    return fs is None or not fs.exists(path)


def _plan_parquet(fs: Any, path: str, url: str, glob: bool) -> InputPlan:
    files, root, one_file = _list_parquet(fs, path, url, glob)
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        metas = list(pool.map(lambda f: _footer(fs, f), files))
    schema = metas[0][0]
    for f, (s, _, _, _) in zip(files, metas, strict=True):
        if set(s.names) != set(schema.names):
            raise ValueError(f"input file {f!r} has columns {s.names}, but {files[0]!r} has {schema.names}")
        schema = _merge_types(schema, s, files[0], f)
    names = [_shard_name(f, root) for f in files]
    seen: dict[str, str] = {}
    for name, f in zip(names, files, strict=True):
        if name in seen:  # a/b.parquet and a__b.parquet: both outputs would be <out>/a__b.parquet
            raise ValueError(f"input files {seen[name]!r} and {f!r} both map to shard {name!r}; rename one")
        seen[name] = f
    shards = [Shard(n, rows, path=f, data={"rows": rows, "bytes": size, **({"version": version} if version else {})})
              for n, f, (_, rows, size, version) in zip(names, files, metas, strict=True)]
    return InputPlan("parquet", shards, schema, source="", filesystem=fs, root=None if one_file else root,
                     pattern=path if glob else None)


def _merge_types(merged: pa.Schema, other: pa.Schema, first_file: str, file: str) -> pa.Schema:
    """The files' column types merged as Ray Data merges its blocks (permissive promotion: int32 and int64,
    string and large_string, null and anything); ValueError naming the columns that cannot merge."""
    try:
        return pa.unify_schemas([merged, other], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        bad = [n for n in merged.names if not _types_merge(merged.field(n).type, other.field(n).type)]
        detail = ", ".join(f"{n!r} is {other.field(n).type} there but {merged.field(n).type}" for n in bad)
        raise ValueError(f"input file {file!r} has column types that differ from {first_file!r}: {detail}") from None


def _types_merge(a: pa.DataType, b: pa.DataType) -> bool:
    try:
        pa.unify_schemas([pa.schema([("c", a)]), pa.schema([("c", b)])], promote_options="permissive")
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return False


def _list_parquet(fs: Any, path: str, url: str, glob: bool) -> tuple[list[str], str, bool]:
    """Parquet files (sorted), the root their shard names are relative to, and whether the path named one file.
    glob: whether the path is a pattern (_has_glob)."""
    one_file = False
    if glob:
        files, root = fs.glob(path), path[: min(path.find(c) for c in GLOB_CHARS if c in path)]
        root = root.rsplit("/", 1)[0]
    elif fs.isdir(path):
        files, root = fs.find(path), path
    elif fs.isfile(path):
        files, root, one_file = [path], posixpath.dirname(path), True
    else:
        raise ValueError(f"input {url!r} not found")
    rel = lambda f: f[len(root) :].lstrip("/")
    files = sorted(
        f for f in files if f.endswith(".parquet") and not any(p.startswith((".", "_")) for p in rel(f).split("/"))
    )
    if not files:
        what = "matches no .parquet files" if glob else "holds no .parquet files"
        raise ValueError(f"input {url!r} {what}")
    return files, root, one_file


def _footer(fs: Any, file: str) -> tuple[pa.Schema, int, int, str | None]:
    """(schema, rows, bytes, version) of a parquet file; version: what changes whenever the file is rewritten (S3's
    ETag, else the modification time; None where the filesystem tells neither). A local file's version also holds
    its status-change time (st_ctime, which fsspec calls "created" there), which every write sets and no one can set
    back: a rewrite whose modification time was restored (cp -p, rsync -t, tar, os.utime) still changes it."""
    try:
        info = fs.info(file)
        with fs.open(file, "rb") as f:
            pf = pq.ParquetFile(f)
            schema, rows = pf.schema_arrow, pf.metadata.num_rows
    except Exception as e:  # noqa: BLE001 - any reader failure: name the file
        raise ValueError(f"cannot read parquet file {file!r}: {e}") from None
    # the first fact the filesystem fills in (s3fs gives an ETag of "" where the store has none)
    key = next((k for k in ("ETag", "etag", "mtime", "LastModified", "updated") if info.get(k)), None)
    version = key and f"{key} {info[key]}"
    if key == "mtime" and info.get("created") and info.get("ino") is not None:  # a local file (fsspec's "file")
        version += f" ctime {info['created']}"
    return schema, rows, info["size"], version


def _shard_name(file: str, root: str) -> str:
    rel = file[len(root) :].lstrip("/") if root and file.startswith(root) else posixpath.basename(file)
    return rel.removesuffix(".parquet").replace("/", "__")


def _plan_hf(url: str, cfg: JobConfig) -> InputPlan:
    import datasets

    try:
        ds = datasets.load_from_disk(url, storage_options=storage_options(url, cfg.s3_endpoint_url))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load Hugging Face dataset {url!r}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if cfg.split is None and len(splits) != 1:
            raise ValueError(f"dataset {url!r} has splits {splits}: pick one with --split")
        split = cfg.split or splits[0]
        if split not in ds:
            raise ValueError(f"dataset {url!r} has no split {split!r} (splits: {splits})")
        ds = ds[split]
    elif cfg.split:
        raise ValueError(f"split={cfg.split!r} applies to a saved Hugging Face DatasetDict; dataset {url!r} is a "
                         "single Dataset (drop --split)")
    n, size = len(ds), cfg.hf_shard_rows
    fingerprint = getattr(ds, "_fingerprint", None)  # saved in the dataset's state.json: the same on every load
    shards = [Shard(f"rows-{s:09d}-{min(s + size, n) - 1:09d}", min(size, n - s), start=s,
                    data={"rows": min(size, n - s), "first_row": s, "dataset": fingerprint} if fingerprint else None)
              for s in range(0, n, size)]
    return InputPlan("hf", shards, ds.data.schema, source="", hf_dataset=ds)


def content_digest(plan: InputPlan, shard: Shard) -> str | None:
    """SHA-256 of a Parquet shard's file (None for a dataset's block, whose fingerprint names its data)."""
    if shard.path is None:
        return None
    digest = hashlib.sha256()
    with plan.filesystem.open(shard.path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def read_dataset(plan: InputPlan, shards: list[Shard]):
    """A Ray dataset of the given shards' rows, in shard order (the driver relies on it)."""
    import ray.data

    if plan.kind == "parquet":
        return ray.data.read_parquet([s.path for s in shards], filesystem=plan.filesystem)
    indices = [i for s in shards for i in range(s.start, s.start + s.num_rows)]
    subset = plan.hf_dataset if len(indices) == len(plan.hf_dataset) else plan.hf_dataset.select(indices)
    return ray.data.from_huggingface(subset)
