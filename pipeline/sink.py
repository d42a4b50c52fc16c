"""Output side: per-shard Parquet files written whole (temp name, then rename), stats beside them.

Layout under the output root:
    <shard>.parquet            the shard's output rows, in input order
    _stats/<shard>.parquet     its stats rows (one per actor that worked on it)
    _stats/_summary.json       the last run's summary (named with "_" so that reading _stats/ as one Parquet
                               dataset skips it, as Arrow skips "_" and "." files)
    _stats/_digests.json       SHA-256s of input files that a rerun read to check a complete shard (a touched or
                               moved file), by shard, with the file's version and input path then
A shard is complete when `<shard>.parquet` exists: it appears only once fully written, and its
stats are written before it.
"""

from __future__ import annotations

import json
import logging
import posixpath
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import stats
from pipeline.io import OUTPUT_COLUMNS, InputPlan, Shard, content_digest, filesystem
from pipeline.resume import stamp

STATS_DIR = "_stats"
log = logging.getLogger(__name__)


class OutputStore:
    def __init__(self, url: str, endpoint_url: str | None = None):
        self.url = url
        self.fs, self.root = filesystem(url, endpoint_url)

    def prepare(self) -> None:
        """Make the output's folders and check that files can be written in both (a folder left by an earlier run
        may be read-only now): ValueError before any work, not a failed write after it."""
        try:
            self.fs.makedirs(posixpath.join(self.root, STATS_DIR), exist_ok=True)
        except Exception as e:  # noqa: BLE001 - permissions, missing bucket: name the output
            raise ValueError(f"cannot create output {self.url!r}: {e}") from None
        for folder in (self.root, posixpath.join(self.root, STATS_DIR)):
            probe = posixpath.join(folder, f".kivi-ray-write-check.{uuid.uuid4().hex}.tmp")
            try:
                with self.fs.open(probe, "wb") as f:
                    f.write(b"")
                self.fs.rm(probe)
            except Exception as e:  # noqa: BLE001 - a read-only folder or bucket: name it
                raise ValueError(f"cannot write to output {self.url!r} ({folder}): {e}") from None
        legacy = posixpath.join(self.root, STATS_DIR, "summary.json")  # an earlier version's summary, which kept
        try:  # pandas and Arrow from reading _stats/ as one table
            if self.fs.exists(legacy):
                self.fs.rm(legacy)
        except OSError as e:
            log.warning("could not remove %s (an earlier version's summary): %s", legacy, e)

    def completed(self) -> set[str]:
        """Names of shards whose output file exists (was renamed into place whole)."""
        self.fs.invalidate_cache()
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return set()
        return {n.removesuffix(".parquet") for n in names if n.endswith(".parquet")}

    def shard_path(self, name: str) -> str:
        return posixpath.join(self.root, f"{name}.parquet")

    def stats_path(self, name: str) -> str:
        return posixpath.join(self.root, STATS_DIR, f"{name}.parquet")

    def summary_path(self) -> str:
        return posixpath.join(self.root, STATS_DIR, "_summary.json")

    def digests_path(self) -> str:
        return posixpath.join(self.root, STATS_DIR, "_digests.json")

    def digests(self) -> dict[str, Any]:
        """The SHA-256s earlier runs kept (resume.check_resume's `known`); {} where none were, or the file is not a
        JSON object (it is only a cache: a bad one costs a file's reading, not the run)."""
        try:
            with self.fs.open(self.digests_path(), "r") as f:
                known = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring %s (%s): input files will be hashed again", self.digests_path(), e)
            return {}
        return known if isinstance(known, dict) else {}

    def keep_digests(self, known: dict[str, Any], computed: dict[str, Any]) -> None:
        """Add this run's SHA-256s to the kept ones (no write when there are none); a failed write is a warning (the
        next rerun reads those files again), not the run's end."""
        if not computed:
            return
        try:
            self.write_text(self.digests_path(), json.dumps({**known, **computed}, indent=1, sort_keys=True))
        except Exception as e:  # noqa: BLE001 - any store failure (S3's included): a cache, not the run
            log.warning("could not keep input files' SHA-256s in %s (%s): a rerun reads them again",
                        self.digests_path(), e)

    def write_table(self, path: str, table: pa.Table) -> None:
        """Write to a temp name in the same folder, then rename: readers never see a partial file."""
        tmp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
        with self.fs.open(tmp, "wb") as f:
            pq.write_table(table, f)
        self.fs.mv(tmp, path)

    def write_text(self, path: str, text: str) -> None:
        with self.fs.open(path, "w") as f:
            f.write(text)


class ShardAssembler:
    """Collects output batches (arriving in input order) into shards and writes each when it is whole."""

    def __init__(
        self,
        plan: InputPlan,
        shards: list[Shard],
        store: OutputStore,
        job_info: dict[str, Any],
        on_row_batch: Callable[[pa.Table], None] = lambda t: None,
        settings: dict[str, Any] | None = None,
    ):
        """settings: what decided the rows (pipeline.resume.row_settings), recorded in every shard written."""
        self.plan, self.store, self.job_info, self.on_row_batch = plan, store, job_info, on_row_batch
        self.settings = settings
        self.pending = list(shards)
        self.parts: list[pa.Table] = []
        self.rows_in_parts = 0
        self.stats_rows: list[dict[str, Any]] = []
        self.ttfts_ms: list[float] = []
        self.tpots_ms: list[float] = []
        self.shards_written = 0
        # each input file's SHA-256 (recorded in its shard), hashed in the background while the rows generate
        self._hashing = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kivi-ray-sha256")
        self._digests = {s.name: self._hashing.submit(content_digest, plan, s) for s in shards
                         if settings is not None and s.data}
        self._flush_complete()

    def add(self, batch: pa.Table) -> None:
        self.on_row_batch(batch)
        while batch.num_rows:
            if not self.pending:
                raise RuntimeError(f"{batch.num_rows} output rows beyond the last shard: rows were duplicated")
            take = min(batch.num_rows, self.pending[0].num_rows - self.rows_in_parts)
            self.parts.append(batch.slice(0, take))
            self.rows_in_parts += take
            batch = batch.slice(take)
            self._flush_complete()

    def close(self) -> None:
        """Stop hashing input files that no shard will need now (the job ended or failed)."""
        self._hashing.shutdown(wait=False, cancel_futures=True)

    def finish(self) -> None:
        self.close()
        if self.pending:
            raise RuntimeError(f"input ended with {len(self.pending)} shards incomplete: rows were lost")

    def _flush_complete(self) -> None:
        """Write every leading shard whose rows are all in (and empty shards)."""
        while self.pending and self.rows_in_parts == self.pending[0].num_rows:
            self._write(self.pending.pop(0))
            self.parts, self.rows_in_parts = [], 0

    def _write(self, shard: Shard) -> None:
        table = pa.concat_tables(self.parts, promote_options="permissive") if self.parts else None
        if table is None or table.num_rows == 0:
            table = self.plan.output_schema().empty_table()  # the same columns as every other shard
            rows: list[dict[str, Any]] = []
        else:
            rows = stats.shard_stats(shard.name, table, self.job_info)
            self.ttfts_ms += [t * 1e3 for t in table[stats.hidden("ttft_s")].to_pylist() if t is not None]
            self.tpots_ms += [t * 1e3 for t in table[stats.hidden("tpot_s")].to_pylist() if t is not None]
            table = self._output_table(shard, stats.strip_hidden(table))
        self.store.write_table(self.store.stats_path(shard.name), stats.stats_table(rows))
        if self.settings is not None:  # with the shard's own data, which resume compares (pipeline.resume)
            data = shard.data and {**shard.data, "sha256": self._digests[shard.name].result()}
            table = stamp(table, {**self.settings, "input_data": data})
        self.store.write_table(self.store.shard_path(shard.name), table)
        self.stats_rows += rows
        self.shards_written += 1

    def _output_table(self, shard: Shard, table: pa.Table) -> pa.Table:
        """Columns in order: id, passthrough, generated."""
        if self.plan.has_id:
            ids = table["id"]
        else:
            ids = pa.array([shard.default_id(i) for i in range(table.num_rows)], pa.string())
        order = [c for c in self.plan.passthrough() if c in table.column_names] + list(OUTPUT_COLUMNS)
        return pa.table([ids, *(table[c] for c in order)], names=["id", *order])
