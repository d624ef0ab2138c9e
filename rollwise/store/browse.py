"""`rollwise rollouts RUN`: list, filter, print and export a run's stored rollouts.

    rollwise rollouts runs/default                          # the first 20 samples, one a line
    rollwise rollouts runs/default --step 5:9 --status truncated --min-reward 1
    rollwise rollouts runs/default --prompt "12+34" --tokens   # token ids, logprobs, versions
    rollwise rollouts runs/latr --step 3 --tree                # each group as its tree
    rollwise rollouts runs/default --export out.jsonl          # one JSON object per sample
    rollwise rollouts runs/default --export out_dir            # datasets.load_dataset(out_dir)
    rollwise rollouts runs/default --verify                    # read every page, check checksums
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollwise.config import ConfigError

JSON_COLUMNS = ("rewards", "meta", "timings")


def add_parser(sub) -> None:
    p = sub.add_parser("rollouts", help="list, filter, print and export a run's rollouts",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="run directory (or its rollouts/ folder)")
    p.add_argument("--step", help="one step N, or an inclusive range A:B (A: or :B open)")
    p.add_argument("--prompt", help="a prompt id, or text the prompt contains")
    p.add_argument("--min-reward", type=float, help="samples rewarded at least this")
    p.add_argument("--max-reward", type=float, help="samples rewarded at most this")
    p.add_argument("--status", help="completed, truncated, failed, aborted, paused")
    p.add_argument("--limit", type=int, default=20, help="samples printed (0: all)")
    p.add_argument("--tokens", action="store_true", help="print every token of each sample")
    p.add_argument("--tree", action="store_true", help="print each group as a tree (forked "
                   "samples under their parent, with branch point and chosen tokens)")
    p.add_argument("--export", metavar="PATH", help="write the selected samples: a .jsonl "
                   "file, or a folder of Parquet shards that datasets.load_dataset reads")
    p.add_argument("--verify", action="store_true", help="check every file in full")
    p.set_defaults(fn=main)


def open_store(run: str):
    path = Path(run)
    root = path if path.name == "rollouts" else path / "rollouts"
    if not root.is_dir():
        raise ConfigError(f"{run}: no rollouts/ folder; give a run directory, e.g. runs/default")
    from rollwise.store.rollouts import RolloutStore  # torch: only once a run is read
    return RolloutStore(root, log=lambda msg: print(msg, file=sys.stderr))


def step_range(text: str) -> tuple[int | None, int | None]:
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo else None
        b = (int(hi) if hi else None) if sep else a
    except ValueError:
        raise ConfigError(f"--step {text!r}: use N, A:B, A: or :B") from None
    return a, b


def select(table, step: str | None = None, prompt: str | None = None,
           min_reward: float | None = None, max_reward: float | None = None,
           status: str | None = None):
    """The rows of the pyarrow table that pass every given filter."""
    # pyarrow: only when rollouts are listed or exported
    import pyarrow as pa
    import pyarrow.compute as pc
    keep = pa.array([True] * table.num_rows)
    if step is not None:
        lo, hi = step_range(step)
        if lo is not None:
            keep = pc.and_(keep, pc.greater_equal(table["step"], lo))
        if hi is not None:
            keep = pc.and_(keep, pc.less_equal(table["step"], hi))
    if prompt is not None:
        keep = pc.and_(keep, pc.or_(pc.equal(table["prompt_id"], prompt),
                                    pc.match_substring(table["prompt_text"], prompt)))
    if min_reward is not None:
        keep = pc.and_(keep, pc.greater_equal(table["reward"], min_reward))
    if max_reward is not None:
        keep = pc.and_(keep, pc.less_equal(table["reward"], max_reward))
    if status is not None:
        keep = pc.and_(keep, pc.equal(table["status"], status))
    return table.filter(pc.fill_null(keep, False))


def plain_rows(table) -> list[dict]:
    """Rows with the JSON columns decoded (for JSONL)."""
    rows = table.to_pylist()
    for r in rows:
        for c in JSON_COLUMNS:
            r[c] = json.loads(r[c]) if r[c] else {}
    return rows


def export(table, path: str) -> Path:
    # pyarrow: only on export
    import pyarrow.parquet as pq
    out = Path(path)
    if out.suffix == ".jsonl":
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            for r in plain_rows(table):
                f.write(json.dumps(r) + "\n")
        return out
    (out / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "data" / "train-00000-of-00001.parquet")
    (out / "README.md").write_text(
        "Rollouts exported by `rollwise rollouts --export`: one row per sample with token ids, "
        "behaviour log-probabilities, policy versions, loss mask, rewards (JSON), status and "
        "lineage.\n\n    datasets.load_dataset(\"" + str(out) + "\", split=\"train\")\n")
    return out


def line(r: dict) -> str:
    text = (r["prompt_text"] + "|" + r["response_text"]).replace("\n", "\\n")
    return (f"{r['step']:>5} {r['prompt_id']:>10} {r['status']:<9} {r['reward']:6.2f} "
            f"{len(r['response_ids']):>4}  {text[:80]}")


def tree_order(rows: list[dict]) -> list[tuple[dict, int]]:
    """Rows group by group, each sample after its parent (depth first), with its depth. A
    sample whose parent is not among the rows (pruned, or filtered out) starts a tree."""
    out: list[tuple[dict, int]] = []
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    for members in groups.values():
        uids = {r["uid"] for r in members}
        kids: dict[str | None, list[dict]] = {}
        for r in members:
            kids.setdefault(r["parent_uid"] if r["parent_uid"] in uids else None, []).append(r)
        todo = [(r, 0) for r in reversed(kids.get(None, []))]
        while todo:
            r, d = todo.pop()
            out.append((r, d))
            todo += [(k, d + 1) for k in reversed(kids.get(r["uid"], []))]
    return out


def tree_line(r: dict, depth: int) -> str:
    """line(), indented under its parent, with where it branched and how many tokens of it
    the tree chose rather than sampled."""
    where = "" if r["branch_point"] is None else f"@{r['branch_point']} "
    chosen = f"chosen {len(r['chosen'])} " if r.get("chosen") else ""
    text = (r["prompt_text"] + "|" + r["response_text"]).replace("\n", "\\n")
    return (f"{r['step']:>5} {r['prompt_id']:>10} {r['status']:<9} {r['reward']:6.2f} "
            f"{len(r['response_ids']):>4}  {'  ' * depth}{'└ ' if depth else ''}{where}{chosen}"
            f"{text[:80]}")


def tokens(r: dict) -> str:
    cols = zip(r["response_ids"], r["logprobs"], r["versions"], r["loss_mask"])
    return "\n".join(f"      {t:>6} logp {lp:9.4f} v{v} mask {m}" for t, lp, v, m in cols)


def main(args) -> int:
    store = open_store(args.run)
    if args.verify:
        bad = store.verify()
        for name, why in bad.items():
            print(f"{name}: {why}")
        print(f"{len(store.files())} files checked, {len(bad)} damaged")
        return 1 if bad else 0
    table = store.read()
    sel = select(table, args.step, args.prompt, args.min_reward, args.max_reward, args.status)
    if args.export:
        print(f"wrote {sel.num_rows} samples to {export(sel, args.export)}")
        return 0
    rows = sel.slice(0, args.limit or sel.num_rows).to_pylist()
    print(" step     prompt status    reward  len  prompt|response")
    for r in (tree_order(rows) if args.tree else ((r, 0) for r in rows)):
        r, depth = r
        print(tree_line(r, depth) if args.tree else line(r))
        if args.tokens:
            print(tokens(r))
    print(f"{len(rows)} shown of {sel.num_rows} selected, {table.num_rows} stored in "
          f"{len(store.steps())} steps")
    return 0
