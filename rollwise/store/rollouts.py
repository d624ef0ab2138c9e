"""The rollout store: every finished sample, token level, one Parquet file per step.

Each step's file is written aside, fsynced and renamed into place before the trainer sees the
samples, so a crash leaves either the whole step or nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollwise.types import Sample, Status

SCHEMA = pa.schema([
    ("uid", pa.string()), ("prompt_id", pa.string()), ("group_id", pa.string()),
    ("parent_uid", pa.string()), ("branch_point", pa.int32()), ("step", pa.int32()),
    ("status", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float64())),
    ("versions", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("entropies", pa.list_(pa.float64())), ("rewards", pa.string()), ("reward", pa.float64()),
    ("reward_info", pa.string()), ("prompt_text", pa.string()), ("response_text", pa.string()),
    ("meta", pa.string()),
])


def sample_row(s: Sample, prompt_text: str = "", response_text: str = "") -> dict:
    return {"uid": s.uid, "prompt_id": s.prompt_id, "group_id": s.group_id,
            "parent_uid": s.parent_uid, "branch_point": s.branch_point, "step": s.step,
            "status": s.status.value, "prompt_ids": s.prompt_ids,
            "response_ids": s.response_ids, "logprobs": s.logprobs, "versions": s.versions,
            "loss_mask": s.loss_mask, "entropies": s.entropies,
            "rewards": json.dumps(s.rewards), "reward": s.reward, "reward_info": s.reward_info,
            "prompt_text": prompt_text, "response_text": response_text,
            "meta": json.dumps(s.meta, default=str)}


def row_sample(row: dict) -> Sample:
    return Sample(prompt_id=row["prompt_id"], prompt_ids=list(row["prompt_ids"]),
                  response_ids=list(row["response_ids"]), logprobs=list(row["logprobs"]),
                  versions=list(row["versions"]), loss_mask=list(row["loss_mask"]),
                  entropies=list(row["entropies"]), status=Status(row["status"]),
                  rewards=json.loads(row["rewards"]), reward=row["reward"],
                  reward_info=row["reward_info"], uid=row["uid"], group_id=row["group_id"],
                  parent_uid=row["parent_uid"], branch_point=row["branch_point"],
                  step=row["step"], meta=json.loads(row["meta"]))


class RolloutStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, samples: list[Sample], prompt_texts: list[str],
               response_texts: list[str]) -> Path:
        rows = [sample_row(s, p, r) for s, p, r in zip(samples, prompt_texts, response_texts)]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        path = self.root / f"step-{step:06d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def read(self) -> pa.Table:
        files = sorted(self.root.glob("step-*.parquet"))
        if not files:
            return SCHEMA.empty_table()
        return pa.concat_tables([pq.read_table(f, schema=SCHEMA) for f in files])

    def samples(self) -> list[Sample]:
        return [row_sample(r) for r in self.read().to_pylist()]
