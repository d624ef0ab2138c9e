"""The rollout store: every field round-trips, crashes at any point of a write are repaired on
open (write-ahead log), damaged files are detected, and `rollwise rollouts` lists, filters
and exports."""

import json
import math
import os

import pyarrow.parquet as pq
import pytest

from rollwise.cli import main
from rollwise.store.rollouts import RolloutStore, decode_wal, encode_wal, sample_row
from rollwise.types import Sample, Status


def make_sample(i: int, step: int = 1, **kw) -> Sample:
    n = 1 + i % 4
    base = dict(prompt_id=f"p{i % 3}", prompt_ids=[1, 2, 3 + i], response_ids=list(range(n)),
                logprobs=[-0.1 * (k + 1) / 3 for k in range(n)], versions=[step - 1] * n,
                loss_mask=[1] * (n - 1) + [0], entropies=[math.pi / (k + 1) for k in range(n)],
                status=list(Status)[i % len(Status)], rewards={"exact": float(i % 2), "fmt": 0.5},
                reward=float(i % 2) + 1e-17, reward_info=f"answer {i}",
                group_id=f"{step}:p{i % 3}", parent_uid=None if i % 2 else f"parent{i}",
                branch_point=None if i % 2 else i, step=step,
                meta={"tier": "add2", "answer": str(i), "nested": {"a": [1, 2.5]}})
    base.update(kw)
    return Sample(**base)


def append(store, step, samples, timings=None):
    return store.append(step, samples, [f"prompt {s.prompt_id}" for s in samples],
                        [f"response {s.uid}" for s in samples], timings)


def test_every_field_round_trips_bit_for_bit(tmp_path):
    store = RolloutStore(tmp_path)
    samples = [make_sample(i) for i in range(7)]
    append(store, 1, samples, {"step_gen_seconds": 0.25})
    back = RolloutStore(tmp_path).samples()
    assert back == samples  # dataclass equality: every field, floats exactly
    rows = RolloutStore(tmp_path).read().to_pylist()
    for s, r in zip(samples, rows):
        assert r == {**sample_row(s, f"prompt {s.prompt_id}", f"response {s.uid}",
                                  {"step_gen_seconds": 0.25})}
        assert json.loads(r["timings"]) == {"step_gen_seconds": 0.25}


def test_steps_are_separate_files_and_a_second_append_to_a_step_gets_its_own(tmp_path):
    store = RolloutStore(tmp_path)
    append(store, 1, [make_sample(0)])
    append(store, 2, [make_sample(1, step=2)])
    append(store, 2, [make_sample(2, step=2)])
    assert [p.name for p in store.files()] == ["step-000001.parquet", "step-000002-01.parquet",
                                               "step-000002.parquet"]
    assert store.steps() == [1, 2] and len(store.samples(steps=[2])) == 2
    assert pq.read_table(tmp_path).num_rows == 3  # the folder is a plain Parquet dataset


def test_write_ahead_log_encoding_rejects_torn_or_altered_segments():
    rows = [sample_row(make_sample(i)) for i in range(3)]
    data = encode_wal(rows)
    assert decode_wal(data) == json.loads(json.dumps(rows))
    assert decode_wal(encode_wal([])) == []
    for cut in (1, len(data) // 2, len(data) - 2):
        assert decode_wal(data[:cut]) is None
    altered = data.replace(b'"p0"', b'"p9"', 1)
    assert altered != data and decode_wal(altered) is None


def test_truncated_parquet_is_detected_and_rebuilt_from_the_log(tmp_path):
    store = RolloutStore(tmp_path)
    samples = [make_sample(i) for i in range(5)]
    path = append(store, 1, samples)
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 3])  # a crash's leftovers
    with pytest.raises(Exception):
        pq.read_table(path)
    logged = []
    reopened = RolloutStore(tmp_path, log=logged.append)
    assert reopened.recovery.rebuilt == [path.name] and "recovered" in logged[0]
    assert reopened.samples() == samples and reopened.verify() == {}


def test_crash_between_log_and_parquet_rolls_forward(tmp_path):
    store = RolloutStore(tmp_path)
    samples = [make_sample(i, step=3) for i in range(4)]
    path = append(store, 3, samples)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(path.read_bytes()[:100])  # the rename never happened
    path.unlink()
    rec = RolloutStore(tmp_path).recovery
    assert rec.removed_partial == [tmp.name] and rec.rebuilt == [path.name]
    assert RolloutStore(tmp_path).samples() == samples


def test_torn_log_is_dropped_and_its_step_is_absent(tmp_path):
    store = RolloutStore(tmp_path)
    append(store, 1, [make_sample(0)])
    log = tmp_path / "_wal" / "step-000002.jsonl"
    log.write_bytes(encode_wal([sample_row(make_sample(1, step=2))])[:-20])
    reopened = RolloutStore(tmp_path)
    assert reopened.recovery.dropped_torn_log == [log.name] and not log.exists()
    assert reopened.steps() == [1]


def test_damaged_file_without_a_log_is_quarantined_and_the_rest_stays_readable(tmp_path):
    store = RolloutStore(tmp_path)
    keep = append(store, 1, [make_sample(0)])
    bad = append(store, 2, [make_sample(1, step=2)])
    store.checkpointed(2)  # the logs are gone once a checkpoint covers the steps
    assert not list((tmp_path / "_wal").iterdir())
    bad.write_bytes(bad.read_bytes()[:-30])
    reopened = RolloutStore(tmp_path)
    assert reopened.recovery.quarantined == [bad.name]
    assert (tmp_path / "_corrupt" / bad.name).exists() and reopened.files() == [keep]
    assert [s.step for s in reopened.samples()] == [1]


def test_verify_finds_a_flipped_byte_that_the_footer_check_misses(tmp_path):
    store = RolloutStore(tmp_path)
    path = append(store, 1, [make_sample(i) for i in range(40)])
    data = bytearray(path.read_bytes())
    first_page = 4 + 40  # inside the first column chunk's data
    data[first_page] ^= 0xFF
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).num_rows == 40  # the footer is intact
    assert path.name in store.verify()


def test_truncate_removes_later_steps_and_their_logs(tmp_path):
    store = RolloutStore(tmp_path)
    for step in (1, 2, 3):
        append(store, step, [make_sample(step, step=step)])
    gone = store.truncate(1)
    assert [p.name for p in gone] == ["step-000002.parquet", "step-000003.parquet"]
    assert store.steps() == [1]
    assert [p.name for p in (tmp_path / "_wal").iterdir()] == ["step-000001.jsonl"]


@pytest.fixture
def run_dir(tmp_path):
    store = RolloutStore(tmp_path / "run" / "rollouts")
    for step in (1, 2, 3):
        append(store, step, [make_sample(i, step=step) for i in range(6)])
    return tmp_path / "run"


def test_rollouts_command_lists_and_filters(run_dir, capsys):
    assert main(["rollouts", str(run_dir), "--step", "2:3", "--status", "truncated",
                 "--min-reward", "1", "--limit", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    expected = [s for step in (2, 3) for s in (make_sample(i, step=step) for i in range(6))
                if s.status == Status.TRUNCATED and s.reward >= 1]
    rows = out[1:-1]
    assert len(rows) == len(expected) > 0 and all("truncated" in r for r in rows)
    assert out[-1].startswith(f"{len(expected)} shown of {len(expected)} selected, 18 stored")
    assert main(["rollouts", str(run_dir), "--prompt", "prompt p1", "--tokens",
                 "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert " p1 " in out and "logp" in out and "mask" in out


def test_rollouts_export_jsonl_and_a_datasets_folder(run_dir, tmp_path, capsys):
    assert main(["rollouts", str(run_dir), "--step", "1", "--export",
                 str(tmp_path / "out.jsonl")]) == 0
    rows = [json.loads(x) for x in open(tmp_path / "out.jsonl")]
    assert len(rows) == 6 and rows[0]["rewards"] == {"exact": 0.0, "fmt": 0.5}
    assert rows[0]["meta"]["nested"] == {"a": [1, 2.5]}
    assert main(["rollouts", str(run_dir), "--export", str(tmp_path / "hf")]) == 0
    datasets = pytest.importorskip("datasets")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    ds = datasets.load_dataset(str(tmp_path / "hf"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 18 and ds[0]["response_ids"] == make_sample(0).response_ids


def test_rollouts_command_reports_a_missing_store(tmp_path, capsys):
    assert main(["rollouts", str(tmp_path / "nope")]) == 2
    assert "no rollouts/ folder" in capsys.readouterr().err
