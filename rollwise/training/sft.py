"""Supervised warm start on the task's worked solutions, with noise so RL has work to do.

`rollwise sft` runs it on its own; `rollwise train` runs it first when no initial model is
given and caches the result under <run.root>/.cache/sft-<hash of the settings and examples>.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rollwise import models
from rollwise.config import Config
from rollwise.devices import release_freed_memory
from rollwise.stages.generate import build_generator
from rollwise.tasks import Task
from rollwise.training.head import captured_head, chunk_tokens, fusable
from rollwise.training.trainer import enable_checkpointing

PROGRESS_EVERY_S = 10.0  # a line at least this often, whatever sft.eval_every says


def cache_path(cfg: Config, examples: list[tuple]) -> Path:
    """Where the warm start of these settings and examples is kept: the examples are the key's
    task part, so whatever writes them (the task, a generator's environment) invalidates it,
    and task settings that change no example (the reward, the held-out set) keep it."""
    digest = hashlib.sha256(json.dumps(examples).encode()).hexdigest()
    parts = {"model": cfg.model.model_dump(), "sft": cfg.sft.model_dump(),
             "seed": cfg.run.seed, "examples": digest}
    key = json.dumps(parts, sort_keys=True)
    return Path(cfg.run.root) / ".cache" / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def examples_for(cfg: Config, task: Task, tokenizer) -> list[tuple]:
    """The warm start's examples, as the run's generation strategy writes them (an agent
    strategy: the teacher's transcripts with the environment's turns; default: the task's
    worked solutions)."""
    return build_generator(cfg, tokenizer).warm_start_examples(cfg, task, tokenizer)


def collate(examples, pad_id: int):
    """Examples are (ids, prompt length) or (ids, prompt length, loss mask over the response:
    an episode's environment tokens are not trained)."""
    T = max(len(ex[0]) for ex in examples)
    ids = torch.full((len(examples), T), pad_id)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    labels = torch.full((len(examples), T), -100)
    for i, (seq, plen, *mask) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        labels[i, plen:len(seq)] = ids[i, plen:len(seq)]  # loss on the response only
        if mask:
            labels[i, plen:len(seq)][torch.tensor(mask[0]) == 0] = -100
    return ids, attn, labels


def backward_in_parts(model, batch, pad_id: int, budget: int, dtype: torch.dtype,
                      trim: bool = False):
    """Backpropagate the batch's mean token loss a micro-batch at a time: examples sorted by
    length and cut at `budget` padded tokens (a long tail padded to its longest would double
    the work), matrix products in `dtype` over the float32 weights (autocast). trim: give the
    allocator's free pages back before each part (train.trim_microbatches). Returns the loss
    (a detached scalar)."""
    batch = sorted(batch, key=lambda ex: len(ex[0]))
    parts, part = [], []
    for ex in batch:
        if part and (len(part) + 1) * len(ex[0]) > budget:
            parts.append(part)
            part = []
        part.append(ex)
    parts.append(part)
    collated = [collate(p, pad_id) for p in parts]
    trained = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in collated)
    total = 0.0
    for ids, attn, labels in collated:
        if trim:
            release_freed_memory()
        with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = summed_token_loss(model, ids, attn, labels) / max(trained, 1)
        loss.backward()
        total += loss.item()
    return torch.tensor(total)


def on_cpu(model) -> bool:
    return next(model.parameters()).device.type == "cpu"


def summed_token_loss(model, ids, attn, labels) -> torch.Tensor:
    """-sum log p(label) over the labelled positions. Through the chunked head where the
    model's head allows it: a 4,096-token micro-batch of a 49k vocabulary would otherwise hold
    its fp32 logits, their log-softmax and its gradient, 0.8 GB each."""
    at = labels[:, 1:] != -100
    if fusable(model) is None:
        chunk = chunk_tokens(model.config.vocab_size, device=ids.device.type)
        with captured_head(model, lambda h: h[:, :-1][at.to(h.device)], labels[:, 1:][at],
                           chunk) as got:
            model(input_ids=ids, attention_mask=attn)
        return -got["out"][0].sum()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    return F.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


def train_sft(model, tokenizer, task: Task, cfg: Config, log=print, eval_fn=None,
              examples: list[tuple] | None = None):
    """Train in place for cfg.sft.steps; eval_fn(model) -> metrics dict, every eval_every."""
    c = cfg.sft
    examples = examples if examples is not None else examples_for(cfg, task, tokenizer)
    rng = random.Random(cfg.run.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=0.01)
    warm = max(1, c.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / max(c.steps, 1)))
    model.train()
    if c.from_path and cfg.train.gradient_checkpointing:  # as the RL trainer runs it
        enable_checkpointing(model)
    t0 = said = time.time()
    for step in range(1, c.steps + 1):
        batch = rng.sample(examples, min(c.batch_size, len(examples)))
        opt.zero_grad(set_to_none=True)
        if c.from_path:
            loss = backward_in_parts(model, batch, tokenizer.pad_token_id, c.microbatch_tokens,
                                     models.DTYPES[cfg.model.dtype],
                                     trim=cfg.train.trim_microbatches and on_cpu(model))
        else:  # the built-in model's warm start: one pass, as its cached starts were made
            ids, attn, labels = collate(batch, tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        evaluating = step % c.eval_every == 0 or step == c.steps
        if evaluating or step == 1 or time.time() - said >= PROGRESS_EVERY_S:
            msg = f"sft step {step}/{c.steps} loss {loss.item():.3f} {time.time() - t0:.0f}s"
            if evaluating and eval_fn is not None:
                m = eval_fn(model)
                msg += " " + " ".join(f"{k.split('/', 1)[1]}={v:.2f}" for k, v in m.items())
                model.train()
            log(msg)
            said = time.time()
    model.eval()
    return model


def warm_start_path(cfg: Config, task: Task) -> Path:
    """The folder `warm_start(cfg, task)` saves to (and reads back)."""
    return cache_path(cfg, examples_for(cfg, task, models.build_tokenizer(cfg.model)))


def warm_start(cfg: Config, task: Task, log=print, eval_fn=None):
    """The cached warm-start model and tokenizer, training it if it is not cached yet."""
    examples = examples_for(cfg, task, models.build_tokenizer(cfg.model))
    path = cache_path(cfg, examples)
    if (path / "config.json").exists():
        log(f"warm start: cached at {path}")
        return models.load_model(path, cfg.model.dtype, for_training=True)
    # a pretrained model is tuned in float32 (AdamW's small steps survive) and saved so: the
    # run then loads it in model.dtype with float32 masters, as it loads model.path
    model, tok = (models.load_model(cfg.model.path, "float32") if cfg.sft.from_path
                  else models.build(cfg.model, seed=cfg.run.seed))
    log(f"warm start: {models.num_params(model) / 1e6:.2f}M-parameter model, "
        f"{cfg.sft.steps} SFT steps on {len(examples)} examples (cached afterwards at {path})")
    train_sft(model, tok, task, cfg, log=log, eval_fn=eval_fn, examples=examples)
    path.parent.mkdir(parents=True, exist_ok=True)
    models.save(model, tok, path)
    if not cfg.sft.from_path:
        return model, tok
    del model  # the float32 model, its optimizer and activations: their pages go back
    gc.collect()
    release_freed_memory()
    return models.load_model(path, cfg.model.dtype, for_training=True)
