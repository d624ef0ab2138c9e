"""The rollout store: every finished sample, token level, as a Parquet dataset in the run.

    rollouts/step-000001.parquet   one file per step (a second append to a step: -01, -02...);
                                   pyarrow, pandas, DuckDB and Hugging Face `datasets` read the
                                   folder as it is
    rollouts/_wal/step-000001.jsonl  write-ahead log of the steps since the last checkpoint
                                   (a JSON copy of their rows; dropped at each checkpoint)
    rollouts/_corrupt/             files that failed validation and could not be rebuilt

`append` writes the rows to the write-ahead log first (one JSON line per sample, then a commit
line with their count and CRC-32; fsynced), then the Parquet file (written aside with page
checksums, fsynced, renamed into place, directory fsynced), and only then returns, so the
trainer never sees a sample that is not on disk. Opening the store recovers from a crash at any
point: leftover partial files are removed, a step whose log is complete but whose Parquet file
is missing or unreadable (truncated, corrupt) is rebuilt from the log, a torn log (the crash hit
the log itself; its step never reached the trainer) is dropped, and an unreadable file with no
log is moved to _corrupt/ so the rest of the store stays readable. `store.recovery` says what
was done.

    store = RolloutStore("runs/default/rollouts")
    store.samples()                  # list[Sample], in step order
    store.read()                     # pyarrow.Table with the texts, timings and every column
"""

from __future__ import annotations

import io
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollwise.store.fsio import atomic_write, fsync_dir, write_durable
from rollwise.types import Sample

SCHEMA = pa.schema([
    ("uid", pa.string()), ("prompt_id", pa.string()), ("group_id", pa.string()),
    ("parent_uid", pa.string()), ("branch_point", pa.int32()), ("step", pa.int32()),
    ("status", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float64())),
    ("versions", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("entropies", pa.list_(pa.float64())), ("rewards", pa.string()), ("reward", pa.float64()),
    ("reward_info", pa.string()), ("prompt_text", pa.string()), ("response_text", pa.string()),
    ("meta", pa.string()), ("timings", pa.string()), ("weight", pa.float64()),
    ("root_uid", pa.string()), ("chosen", pa.list_(pa.int32())),
    ("off_policy", pa.list_(pa.int32())),
])
"""rewards, meta and timings are JSON objects (reward channels, task data, seconds)."""
# columns that files of older versions lack
OPTIONAL = {"timings", "weight", "root_uid", "chosen", "off_policy"}

FILE = re.compile(r"step-(\d{6,})(?:-(\d{2,}))?\.(parquet|jsonl)$")


def sample_row(s: Sample, prompt_text: str = "", response_text: str = "",
               timings: dict[str, float] | None = None) -> dict:
    return {**s.to_dict(), "rewards": json.dumps(s.rewards),
            "meta": json.dumps(s.meta, default=str), "prompt_text": prompt_text,
            "response_text": response_text, "timings": json.dumps(timings or {})}


def row_sample(row: dict) -> Sample:
    return Sample.from_dict({**row, "rewards": json.loads(row["rewards"]),
                             "meta": json.loads(row["meta"]),
                             "weight": 1.0 if row.get("weight") is None else row["weight"],
                             "chosen": row.get("chosen") or [],
                             "off_policy": row.get("off_policy") or []})


def step_of(path: Path) -> int:
    return int(FILE.match(path.name).group(1))


# ---------------------------------------------------------------- write-ahead log encoding

def encode_wal(rows: list[dict]) -> bytes:
    """One JSON line per row, then {"commit": n, "crc32": ...} over the row lines."""
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return body + (json.dumps({"commit": len(rows), "crc32": zlib.crc32(body)}) + "\n").encode()


def decode_wal(data: bytes) -> list[dict] | None:
    """The rows of a complete log segment; None when it is torn or damaged."""
    body, _, last = data.rstrip(b"\n").rpartition(b"\n")
    body = body + b"\n" if body else b""
    try:
        commit = json.loads(last)
        if commit.get("crc32") != zlib.crc32(body):
            return None
        rows = [json.loads(line) for line in body.splitlines()]
    except (ValueError, AttributeError):
        return None
    return rows if len(rows) == commit.get("commit") else None


def to_parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), buf, write_page_checksum=True)
    return buf.getvalue()


def check_file(path: Path, full: bool = True) -> str | None:
    """Why the Parquet file is unreadable, or None when it is fine. full: read every page and
    verify its checksum (else the footer only)."""
    try:
        meta = pq.read_metadata(path)
        if full:
            pq.read_table(path, page_checksum_verification=True)
    except Exception as e:  # pyarrow raises several types for damaged files
        return f"{type(e).__name__}: {e}"
    missing = set(SCHEMA.names) - set(meta.schema.to_arrow_schema().names) - OPTIONAL
    return f"missing columns {sorted(missing)}" if missing else None


def read_file(path: Path) -> pa.Table:
    """One file, conformed to SCHEMA (files from older versions lack the OPTIONAL columns)."""
    t = pq.read_table(path)
    for name in SCHEMA.names:
        if name not in t.column_names:
            t = t.append_column(name, pa.nulls(t.num_rows, SCHEMA.field(name).type))
    return t.select(SCHEMA.names).cast(SCHEMA)


@dataclass
class Recovery:
    """What opening the store repaired."""
    removed_partial: list[str] = field(default_factory=list)  # *.tmp of an interrupted write
    rebuilt: list[str] = field(default_factory=list)  # from the write-ahead log
    dropped_torn_log: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # unreadable, no log: in _corrupt/

    def __bool__(self) -> bool:
        return any((self.removed_partial, self.rebuilt, self.dropped_torn_log,
                    self.quarantined))

    def describe(self) -> str:
        parts = [f"{name.replace('_', ' ')}: {', '.join(v)}"
                 for name, v in vars(self).items() if v]
        return "rollout store recovered after a crash; " + "; ".join(parts)


class RolloutStore:
    def __init__(self, root: str | Path, log=None):
        self.root = Path(root)
        self.wal = self.root / "_wal"
        self.wal.mkdir(parents=True, exist_ok=True)
        self.recovery = self.recover()
        if self.recovery and log is not None:
            log(self.recovery.describe())

    # ----------------------------------------------------------------------------- writing
    def append(self, step: int, samples: list[Sample], prompt_texts: list[str],
               response_texts: list[str], timings: dict[str, float] | None = None) -> Path:
        """Durably add a step's samples (see the module docstring); returns the Parquet file."""
        rows = [sample_row(s, p, r, timings)
                for s, p, r in zip(samples, prompt_texts, response_texts, strict=True)]
        path = self._new_path(step)
        log = self.wal / path.with_suffix(".jsonl").name
        write_durable(log, encode_wal(rows), "wal", step)
        fsync_dir(self.wal)
        atomic_write(path, to_parquet(rows), "store", step)
        return path

    def _new_path(self, step: int) -> Path:
        path, k = self.root / f"step-{step:06d}.parquet", 0
        while path.exists() or path.with_suffix(".jsonl").exists():
            k += 1
            path = self.root / f"step-{step:06d}-{k:02d}.parquet"
        return path

    def checkpointed(self, step: int) -> None:
        """A checkpoint covers every step up to `step`: their log segments can go."""
        for log in self._logs():
            if step_of(log) <= step:
                log.unlink()
        fsync_dir(self.wal)

    def truncate(self, after_step: int) -> list[Path]:
        """Remove every step after `after_step` (a resume re-generates them); returns the
        Parquet files removed."""
        gone = [p for p in self.files() if step_of(p) > after_step]
        for p in gone + [log for log in self._logs() if step_of(log) > after_step]:
            p.unlink()
        fsync_dir(self.root), fsync_dir(self.wal)
        return gone

    # ---------------------------------------------------------------------------- recovery
    def recover(self) -> Recovery:
        rec = Recovery()
        for tmp in sorted(self.root.glob("*.tmp")) + sorted(self.wal.glob("*.tmp")):
            tmp.unlink()
            rec.removed_partial.append(tmp.name)
        for log in self._logs():
            path = self.root / log.with_suffix(".parquet").name
            rows = decode_wal(log.read_bytes())
            if rows is None:  # the crash hit the log: its step never reached the trainer
                log.unlink()
                rec.dropped_torn_log.append(log.name)
            elif not path.exists() or check_file(path) is not None:
                atomic_write(path, to_parquet(rows))
                rec.rebuilt.append(path.name)
        logged = {log.with_suffix(".parquet").name for log in self._logs()}
        for path in self.files():
            if path.name not in logged and check_file(path, full=False) is not None:
                self._quarantine(path)
                rec.quarantined.append(path.name)
        if rec:
            fsync_dir(self.root), fsync_dir(self.wal)
        return rec

    def _quarantine(self, path: Path) -> None:
        bad = self.root / "_corrupt"
        bad.mkdir(exist_ok=True)
        os.replace(path, bad / path.name)

    def verify(self) -> dict[str, str]:
        """Every file read in full with its page checksums: name -> problem (empty: all good)."""
        return {p.name: why for p in self.files() if (why := check_file(p)) is not None}

    # ----------------------------------------------------------------------------- reading
    def files(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*.parquet") if FILE.match(p.name))

    def _logs(self) -> list[Path]:
        return sorted(p for p in self.wal.glob("step-*.jsonl") if FILE.match(p.name))

    def steps(self) -> list[int]:
        return sorted({step_of(p) for p in self.files()})

    def read(self, steps: list[int] | None = None) -> pa.Table:
        files = [p for p in self.files() if steps is None or step_of(p) in steps]
        if not files:
            return SCHEMA.empty_table()
        return pa.concat_tables([read_file(p) for p in files])

    def samples(self, steps: list[int] | None = None) -> list[Sample]:
        return [row_sample(r) for r in self.read(steps).to_pylist()]
