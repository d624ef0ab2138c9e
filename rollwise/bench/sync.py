"""Weight sync benchmark: SparseRL-Sync sparse payloads against full payloads, both sent to an
engine in another process (shared memory), after real RL steps, bf16 engine weights with fp32
AdamW master weights.

    rollwise bench sync                                  # tiny model and the ~0.5B model
    rollwise bench sync --models tiny --tiny-lrs 1e-6,1e-5,1e-4,1e-3
    rollwise bench sync --models 0.5b --lrs 1e-6,1e-5 --steps 2 --json
    rollwise bench sync --config smollm2 --lrs 1e-6,3e-6,1e-5 --steps 3 [key=value]

Per model and learning rate, from the same start (the fp32 master starts on the bf16 grid, as
when RL starts from a bf16 checkpoint), after every optimizer step the engine gets a sparse
payload, is compared bit for bit with the trainer (check mode), then gets a full payload of
the same weights: the two are measured side by side on the same weights and engine.

- tiny: the default tiny Qwen2 (rollwise's ModelConfig), real RL steps through rollwise's
  Trainer (GRPO advantages, PPO-clip, AdamW) on rollouts the engine process generates for the
  arith prompts; reward 1 for an even response length (a random model earns it half the time,
  so every step trains), or the task's exact answer with --init <warm-start model folder>.
- --config C: a run's own RL steps (`rollwise train`'s model, task, prompts, reward and
  trainer, at each --lrs with no warm-up or decay), its start weights put on the bf16 grid;
  the sync is measured on its trainer's weights after each step.
- 0.5b: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
  tied embeddings; vocab 151936, so 0.49B parameters), random init as Qwen2 initialises;
  each step is one real GRPO policy-gradient step (on-policy PPO-clip, whose gradient at ratio
  1 is the advantage-weighted log-likelihood) on --batch sequences of random 16-token prompts
  and 16-token responses, groups of 4 with binary rewards, fused AdamW.

Reported: density (share of bf16 elements whose stored value changed), bytes of each payload
(tensor bytes incl. padding, plus the compressed pickled metadata; every sparse coding is
encoded on the same weights, and the one --coding names is also sent and checked), wall
seconds of each push (encode, shared-memory hand-off, apply, checksum verify on both sides),
and whether the engine was bit-identical to the trainer after every sparse sync.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollwise import models
from rollwise.config import ModelConfig, TaskConfig, TrainConfig
from rollwise.engine import Request, SamplingParams
from rollwise.engine.process import EngineProcess
from rollwise.sync import ProcessTransport, WeightSync
from rollwise.sync.payload import pack_meta
from rollwise.sync.peer_formats import bits, codecs
from rollwise.tasks import load_task
from rollwise.training.trainer import Trainer
from rollwise.types import Group, Sample

PROMPT_LEN = RESPONSE_LEN = 16
LINK_BYTES_PER_S = 10e9 / 8
"""The modelled link of the `@10Gb/s` columns: measured push time plus bytes / 10 Gbit/s, for
an engine on another machine (the measured push moves bytes through shared memory)."""


class LeanTrainer:
    """The trainer interface weight sync needs (`weights()`, `version`) around a model that
    the benchmark steps itself."""

    def __init__(self, model):
        self.model, self.version = model, 0

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def to_bf16_grid(model) -> None:
    """fp32 master weights that a bf16 checkpoint would give: every value bf16-representable."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))


class PeerFormats:
    """The peers' delta formats (rollwise/sync/peer_formats.py) on the same weights: each
    encodes the change from the bf16 weights the engine held to the new ones, and decodes it
    onto the old ones in this process (nothing sent); bytes, seconds and exactness."""

    def __init__(self, weights):
        self.bits, self.codecs = bits, codecs()
        self.old = bits(weights)

    def measure(self, weights) -> dict:
        new = self.bits(weights)
        out = {}
        for name, (encode, decode) in self.codecs.items():
            t0 = time.perf_counter()
            payload, nbytes = encode(self.old, new)
            t1 = time.perf_counter()
            got = decode(self.old, payload)
            t2 = time.perf_counter()
            out[name] = {"bytes": nbytes, "encode_s": t1 - t0, "decode_s": t2 - t1,
                         "exact": all(torch.equal(got[k], new[k]) for k in new)}
        self.old = new
        return out


CODINGS = ("delta", "context", "pairs")  # sync.coding's choices


def measure(sparse, full, coders, check: bool, peers: PeerFormats | None = None) -> dict:
    """One sparse push (then the bit-for-bit check), one full push of the same weights, the
    same weights' sparse payload in every other coding (encoded and measured, not sent: the
    engine already holds those weights), and the peers' formats."""
    trainer = sparse.trainer
    peer = peers.measure(trainer.weights()) if peers else {}
    coded = {}
    for coding, sync in coders.items():
        meta, _ = sync.sender.encode(trainer.weights(), trainer.version, sync.transport.alloc,
                                     full=False)
        coded[coding] = meta.nbytes + len(pack_meta(meta))
    ms = sparse.push()
    sent, = set(CODINGS) - set(coders)
    coded[sent] = ms["sync/bytes"]
    exact = True
    if check:
        try:
            sparse.compare()
        except Exception:
            exact = False
    mf = full.push()
    return {"density": ms["sync/density"], "sparse_bytes": ms["sync/bytes"],
            "pairs_bytes": coded["pairs"], "coding_bytes": coded,
            "full_bytes": mf["sync/bytes"], "sparse_s": ms["sync/seconds"],
            "full_s": mf["sync/seconds"], "sparse_kind": ms["sync/sparse"],
            "dense_tensors": ms["sync/dense_tensors"], "exact": exact,
            "sparse_parts": {k: ms[f"sync/{k}_seconds"] for k in ("encode", "apply", "verify")},
            "full_parts": {k: mf[f"sync/{k}_seconds"] for k in ("encode", "apply", "verify")},
            "peers": peer}


def syncs(trainer, proc, coding: str):
    """The sent sparse sync, a full one, an encode-only one per other coding, the peers'."""
    transport = ProcessTransport(proc)
    sparse = WeightSync(trainer, transport, mode="sparse", coding=coding)
    full = WeightSync(trainer, transport, mode="full")
    coders = {c: WeightSync(trainer, transport, mode="sparse", coding=c)
              for c in CODINGS if c != coding}
    sparse.push()  # a new sender: full; the engine now holds the start weights
    for sync in coders.values():  # each mirror starts from the same weights
        sync.sender.encode(trainer.weights(), trainer.version, transport.alloc, full=True)
    return sparse, full, coders, PeerFormats(trainer.weights())


# --- tiny model: rollwise's Trainer on rollouts from the engine process --------------------------
def tiny_rows(args) -> list[dict]:
    if args.init:
        model0, tok = models.load_model(args.init)
    else:
        model0, tok = models.build(ModelConfig(), seed=args.seed)
    to_bf16_grid(model0)
    task = load_task(TaskConfig(train_size=2000, eval_size=10))
    rows = []
    proc = EngineProcess(model0, dtype=torch.bfloat16, seed=args.seed,
                         wire=args.wire)
    try:
        for lr in args.tiny_lrs:
            model = copy.deepcopy(model0)
            trainer = Trainer(model, TrainConfig(lr=lr, steps=10**6), pad_id=tok.pad_token_id,
                              seed=args.seed)
            sparse, full, coders, peers = syncs(trainer, proc, args.coding)
            for step in range(1, args.tiny_steps + 1):
                groups = rollouts(proc, tok, task, step, exact=bool(args.init), seed=args.seed)
                trainer.update(groups)
                rows.append({"model": "tiny", "params": models.num_params(model), "lr": lr,
                             "wire": args.wire, "coding": args.coding, "step": step,
                             **measure(sparse, full, coders, check=True, peers=peers)})
                log(args, rows[-1])
    finally:
        proc.close()
    return rows


def rollouts(engine, tok, task, step: int, exact: bool, seed: int, prompts: int = 16,
             group_size: int = 8):
    problems = task.train[(step - 1) * prompts:step * prompts]
    reqs = [Request(tok(p.prompt)["input_ids"],
                    SamplingParams(max_new_tokens=8, stop_ids=(tok.eos_token_id,),
                                   seed=seed * 10**6 + step * 1000 + i * group_size + j), i)
            for i, p in enumerate(problems) for j in range(group_size)]
    groups: dict[int, list] = {}
    for r, c in zip(reqs, engine.generate(reqs)):
        p = problems[r.id]
        s = Sample(prompt_id=p.id, prompt_ids=r.prompt_ids, response_ids=c.token_ids,
                   logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.token_ids))
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        got = task.extract_answer(text) if exact else None
        s.reward = float(got == p.answer) if exact else float(len(text) % 2 == 0)
        groups.setdefault(r.id, []).append(s)
    return [Group(problems[k].id, v, problems[k]) for k, v in groups.items()]


# --- a config's run: `rollwise train`'s own RL steps ------------------------------------------
def config_rows(args) -> list[dict]:
    """After each of a run's steps at each lr (from the same start each time: the config's
    model on the bf16 grid), every coding on its trainer's weights, the sent one checked."""
    from rollwise.config import load_config
    from rollwise.loop.run import Run, initial_model
    from rollwise.report.progress import Progress
    base = load_config(args.config, args.overrides)
    name = Path(args.config).stem
    with tempfile.TemporaryDirectory() as tmp:
        model0, tok = initial_model(base, load_task(base.task), Progress("quiet"))
        model0 = model0.float()
        to_bf16_grid(model0)
        models.save(model0, tok, f"{tmp}/start")
        proc = EngineProcess(model0, dtype=torch.bfloat16, seed=args.seed, wire=args.wire)
        rows = []
        try:
            for lr in args.lrs:
                cfg = load_config(args.config, [
                    *args.overrides, f"run.init={tmp}/start", f"train.lr={lr}",
                    "train.warmup_steps=0", "train.lr_end_factor=1.0", f"run.root={tmp}",
                    f"run.name=sync-{lr:g}", f"train.steps={args.steps}", f"run.seed={args.seed}",
                    "run.eval_every=1000000", "run.log=quiet", "run.report=false",
                    "run.tensorboard=false"])
                with Run(cfg, Progress("quiet")) as run:
                    sparse, full, coders, peers = syncs(run.trainer, proc, args.coding)
                    for step in range(1, args.steps + 1):
                        t = time.perf_counter()
                        run.step(step)
                        rows.append({"model": name, "params": models.num_params(model0),
                                     "lr": lr, "step": step, "wire": args.wire,
                                     "coding": args.coding, "train_s": time.perf_counter() - t,
                                     **measure(sparse, full, coders, check=True, peers=peers)})
                        log(args, rows[-1])
        finally:
            proc.close()
    return rows


# --- ~0.5B model: real policy-gradient steps on short sequences ---------------------------------
def large_model(vocab: int, seed: int):
    """Qwen2.5-0.5B's shape, initialised as Qwen2 does (normal(0, 0.02) matrices, zero biases,
    unit norms), without HF's slower per-module init."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=896, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                      tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # to_empty left garbage
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
    return model


def pg_step(model, opt, step: int, batch: int, vocab: int, seed: int) -> float:
    """One GRPO step: advantages (r - mean_g r) / std_g r (Shao et al. 2024, eq. 3, outcome
    supervision) on groups of 4; loss = -mean over response tokens of A * log p(token), which
    is PPO-clip's gradient at ratio 1 (on-policy)."""
    gen = torch.Generator().manual_seed(seed * 10**6 + step)
    ids = torch.randint(0, vocab, (batch, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    correct = torch.randint(1, 4, (batch // 4, 1), generator=gen)  # 1-3 of 4: mixed groups
    r = (torch.rand(batch // 4, 4, generator=gen).argsort(1) < correct).float()
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
    loss = -(adv[:, None] * logp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def large_rows(args) -> list[dict]:
    t0 = time.perf_counter()
    model = large_model(args.vocab, args.seed)
    to_bf16_grid(model)
    start = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}  # exact
    params = sum(p.numel() for p in model.parameters())
    log(args, f"0.5b: {params / 1e9:.3f}B parameters built in {time.perf_counter() - t0:.0f}s")
    trainer = LeanTrainer(model)
    proc = EngineProcess(model, dtype=torch.bfloat16, seed=args.seed, wire=args.wire)
    rows = []
    try:
        for lr in args.lrs:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(start[n])
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
            sparse, full, coders, peers = syncs(trainer, proc, args.coding)
            for step in range(1, args.steps + 1):
                t1 = time.perf_counter()
                pg_step(model, opt, step, args.batch, args.vocab, args.seed)
                trainer.version += 1
                train_s = time.perf_counter() - t1
                rows.append({"model": "0.5b", "params": params, "lr": lr, "step": step,
                             "wire": args.wire, "coding": args.coding,
                             "train_s": train_s,
                             **measure(sparse, full, coders, peers=peers,
                                       check=step == args.steps or args.check_all)})
                log(args, rows[-1])
            del opt, sparse, full, coders
    finally:
        proc.close()
    return rows


# --- report --------------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["model"], r["lr"]) for r in rows}, key=lambda k: (k[0] != "tiny", k[1]))
    for model, lr in keys:
        rs = [r for r in rows if r["model"] == model and r["lr"] == lr]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        out.append({"model": model, "params": rs[0]["params"], "lr": lr, "steps": len(rs),
                    "density_mean": statistics.fmean(r["density"] for r in rs),
                    "density_by_step": [r["density"] for r in rs],
                    "full_mb": med("full_bytes") / 2**20, "sparse_mb": med("sparse_bytes") / 2**20,
                    "bytes_ratio": med("full_bytes") / med("sparse_bytes"),
                    "pairs_mb": med("pairs_bytes") / 2**20,
                    "pairs_ratio": med("full_bytes") / med("pairs_bytes"), "wire": rs[0]["wire"],
                    **coding_summary(rs),
                    "coding": rs[0]["coding"],
                    "full_s": med("full_s"), "sparse_s": med("sparse_s"),
                    "speedup": med("full_s") / med("sparse_s"),
                    "full_link_s": med("full_s") + med("full_bytes") / LINK_BYTES_PER_S,
                    "sparse_link_s": med("sparse_s") + med("sparse_bytes") / LINK_BYTES_PER_S,
                    "bit_exact": all(r["exact"] for r in rs),
                    "sparse_parts": {k: statistics.median(r["sparse_parts"][k] for r in rs)
                                     for k in rs[0]["sparse_parts"]},
                    "full_parts": {k: statistics.median(r["full_parts"][k] for r in rs)
                                   for k in rs[0]["full_parts"]},
                    **peer_summary(rs)})
    return out


def ratio(full: float, part: float) -> float:
    return full / part if part else float("inf")  # a step that changed nothing sends nothing


def coding_summary(rs: list[dict]) -> dict:
    """Per coding: median bytes and ratio to full; the coding with the fewest at every step."""
    full = statistics.median(r["full_bytes"] for r in rs)
    coded = {c: statistics.median(r["coding_bytes"][c] for r in rs) for c in CODINGS}
    fewest = {min(CODINGS, key=lambda c: r["coding_bytes"][c]) for r in rs}
    return {"coding_mb": {c: b / 2**20 for c, b in coded.items()},
            "coding_ratio": {c: ratio(full, b) for c, b in coded.items()},
            "smallest_coding": fewest.pop() if len(fewest) == 1 else None}


def peer_summary(rs: list[dict]) -> dict:
    """Per peer format: median bytes, bytes ratio to full, codec seconds (encode + decode)
    and the same plus the modelled 10 Gbit/s link; rollwise's codec seconds (encode + apply)
    beside them; whether rollwise's payload is smaller than each at every step."""
    if not rs[0].get("peers"):
        return {}
    med = lambda xs: statistics.median(list(xs))  # noqa: E731
    ours_s = med(r["sparse_parts"]["encode"] + r["sparse_parts"]["apply"] for r in rs)
    ours_b = med(r["sparse_bytes"] for r in rs)
    peers = {}
    for name in rs[0]["peers"]:
        b = med(r["peers"][name]["bytes"] for r in rs)
        sec = med(r["peers"][name]["encode_s"] + r["peers"][name]["decode_s"] for r in rs)
        peers[name] = {"mb": b / 2**20, "bytes_ratio": ratio(med(r["full_bytes"] for r in rs), b),
                       "codec_s": sec, "link_s": sec + b / LINK_BYTES_PER_S,
                       "exact": all(r["peers"][name]["exact"] for r in rs),
                       "rollwise_smaller": all(r["sparse_bytes"] < r["peers"][name]["bytes"]
                                               for r in rs)}
    return {"peers": peers, "rollwise_codec_s": ours_s,
            "rollwise_link_s": ours_s + ours_b / LINK_BYTES_PER_S,
            "rollwise_fewest_bytes": all(v["rollwise_smaller"] for v in peers.values())}


def peer_table(summary: list[dict]) -> str:
    head = (f"{'model':6} {'lr':>7} {'format':>16} {'MB':>9} {'bytes x':>8} {'codec s':>8} "
            f"{'@10Gb s':>8} {'exact':>5} {'rollwise smaller':>16}")
    lines = [head, "-" * len(head)]
    for s in summary:
        if "peers" not in s:
            continue
        ours = "rollwise " + s["coding"]
        lines.append(f"{s['model']:6} {s['lr']:7.0e} {ours:>16} {s['sparse_mb']:9.3f} "
                     f"{s['bytes_ratio']:8.1f} {s['rollwise_codec_s']:8.3f} "
                     f"{s['rollwise_link_s']:8.3f} {'yes' if s['bit_exact'] else 'NO':>5} "
                     f"{'':>16}")
        for name, v in s["peers"].items():
            lines.append(f"{s['model']:6} {s['lr']:7.0e} {name:>16} {v['mb']:9.3f} "
                         f"{v['bytes_ratio']:8.1f} {v['codec_s']:8.3f} {v['link_s']:8.3f} "
                         f"{'yes' if v['exact'] else 'NO':>5} "
                         f"{'yes' if v['rollwise_smaller'] else 'NO':>16}")
    return "\n".join(lines)


def table(summary: list[dict]) -> str:
    head = (f"{'model':6} {'params':>8} {'wire':>6} {'lr':>7} {'steps':>5} {'density':>8} "
            f"{'full MB':>9} {'delta x':>7} {'context x':>9} {'pairs x':>7} {'sparse MB':>9} "
            f"{'bytes x':>8} {'full s':>7} "
            f"{'sparse s':>8} {'speedup':>7} {'full@10Gb':>9} {'sparse@10Gb':>11} {'exact':>5}")
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(f"{s['model']:6} {s['params'] / 1e6:7.1f}M {s['wire']:>6} {s['lr']:7.0e} "
                     f"{s['steps']:5d} {100 * s['density_mean']:7.3f}% {s['full_mb']:9.2f} "
                     f"{s['coding_ratio']['delta']:7.1f} {s['coding_ratio']['context']:9.1f} "
                     f"{s['pairs_ratio']:7.1f} {s['sparse_mb']:9.3f} "
                     f"{s['bytes_ratio']:8.1f} {s['full_s']:7.3f} {s['sparse_s']:8.3f} "
                     f"{s['speedup']:7.2f} {s['full_link_s']:9.3f} {s['sparse_link_s']:11.3f} "
                     f"{'yes' if s['bit_exact'] else 'NO':>5}")
    return "\n".join(lines)


def log(args, row) -> None:
    if not args.json:
        print(row if isinstance(row, str) else
              f"  {row['model']} lr={row['lr']:.0e} step {row['step']}: density "
              f"{100 * row['density']:.3f}%  bytes {row['full_bytes'] / row['sparse_bytes']:.1f}x "
              f"fewer  full {row['full_s']:.3f}s sparse {row['sparse_s']:.3f}s  "
              f"exact={row['exact']}", file=sys.stderr, flush=True)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma-separated: tiny, 0.5b (default: both; with "
                                     "--config: the config's run alone)")
    p.add_argument("--config", help="a run's config: sync after its own RL steps")
    p.add_argument("--lrs", type=floats, default=[1e-6, 3e-6, 1e-5],
                   help="for the 0.5b model and --config")
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps per lr, 0.5b model and --config")
    p.add_argument("--batch", type=int, default=8, help="sequences per 0.5b step (groups of 4)")
    p.add_argument("--vocab", type=int, default=151936, help="0.5b vocab (Qwen2.5: 151936)")
    p.add_argument("--check-all", action="store_true",
                   help="compare the 0.5b engine bit for bit after every step, not the last")
    p.add_argument("--tiny-lrs", type=floats, default=[1e-6, 3e-6, 1e-5, 1e-4, 1e-3])
    p.add_argument("--tiny-steps", type=int, default=5)
    p.add_argument("--init", help="tiny: start from this model folder (e.g. a warm start) and "
                                  "reward exact answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wire", choices=["shm", "socket"], default="shm",
                   help="how payload bytes reach the engine process: shared memory (no copy) or "
                        "its Unix socket (every byte copied, as over a network)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (1: the CPU is shared; OpenMP's barriers "
                        "stall when its threads cannot all run)")
    p.add_argument("--coding", choices=["delta", "context"], default="context",
                   help="the sparse payload's sync.coding")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="key=value for --config's run")
    args = p.parse_args(argv)
    names = (args.models or ("" if args.config else "tiny,0.5b")).split(",")
    if any(n not in ("tiny", "0.5b", "") for n in names):
        p.error(f"unknown model in --models {args.models!r}; use tiny and/or 0.5b")
    if args.overrides and not args.config:
        p.error("key=value overrides configure a run: give --config too")
    torch.set_num_threads(args.threads)  # the engine process takes the same
    t0 = time.perf_counter()
    rows = config_rows(args) if args.config else []
    for name in names:
        if name == "tiny":
            rows += tiny_rows(args)
        elif name == "0.5b":
            rows += large_rows(args)
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows,
                          "wall_seconds": time.perf_counter() - t0,
                          "threads": torch.get_num_threads()}, indent=1))
    else:
        print(table(summary))
        print(peer_table(summary))
        print(f"wall {time.perf_counter() - t0:.0f}s, torch threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
