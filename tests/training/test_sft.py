"""The supervised warm start (rollwise.training.sft): it says where it is from its first step,
and its cache is keyed by the examples the run's generator writes."""

from rollwise import models
from rollwise.config import load_config
from rollwise.tasks import load_task
from rollwise.training import sft

TINY = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=32", "task.train_size=40",
        "task.eval_size=8", "sft.batch_size=4"]


def test_the_warm_start_reports_its_first_step_and_then_at_least_every_few_seconds(monkeypatch):
    cfg = load_config(None, TINY + ["sft.steps=5", "sft.eval_every=100"])
    task = load_task(cfg.task)
    lines: list[str] = []
    sft.train_sft(*models.build(cfg.model), task, cfg, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == ["sft step 1/5", "sft step 5/5"]
    monkeypatch.setattr(sft, "PROGRESS_EVERY_S", 0.0)
    lines.clear()
    sft.train_sft(*models.build(cfg.model), task, cfg, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == [f"sft step {i}/5" for i in range(1, 6)]


def test_the_cache_key_follows_the_examples(tmp_path):
    cfg = load_config(None, TINY + [f"run.root={tmp_path}"])
    task = load_task(cfg.task)
    tok = models.build_tokenizer(cfg.model)
    examples = sft.examples_for(cfg, task, tok)
    assert sft.warm_start_path(cfg, task) == sft.cache_path(cfg, examples)
    assert sft.cache_path(cfg, examples[:-1]) != sft.cache_path(cfg, examples)


def test_task_settings_that_change_no_example_keep_the_warm_start(tmp_path):
    worked = TINY + [f"run.root={tmp_path}", "task.name=worked", "task.worked.terms=[2, 4]"]
    cfg, other = (load_config(None, worked + [f"task.worked.credit={c}"])
                  for c in ("all", "prefix"))
    tok = models.build_tokenizer(cfg.model)
    examples = sft.examples_for(cfg, load_task(cfg.task), tok)
    assert sft.examples_for(other, load_task(other.task), tok) == examples
    assert sft.warm_start_path(other, load_task(other.task)) == sft.cache_path(cfg, examples)
    longer = load_config(None, worked + ["task.worked.terms=[2, 5]"])
    assert sft.warm_start_path(longer, load_task(longer.task)) != sft.cache_path(cfg, examples)


def chat_config(tmp_path, *extra):
    from chat_model import build_chat_model
    path = build_chat_model(tmp_path / "chat")
    return load_config(None, [f"model.path={path}", "model.dtype=float32", "task.name=worked",
                              "task.worked.terms=[2, 4]", "task.worked.max_digits=1",
                              "task.train_size=24", "task.eval_size=4", "sft.batch_size=6",
                              "sft.noise=0", f"run.root={tmp_path}", *extra])


def test_a_chat_models_examples_are_rendered_as_the_run_renders_its_prompts(tmp_path):
    from rollwise.tasks.prompts import Prompter
    cfg = chat_config(tmp_path)
    task = load_task(cfg.task)
    tok = models.build_tokenizer(cfg.model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end != tok.eos_token_id  # the test model's end of turn is not its eos
    prompter = Prompter.for_task(cfg.task, tok, task)
    for (ids, plen), p in zip(sft.examples_for(cfg, task, tok), task.train):
        assert ids[:plen] == prompter.encode(p.prompt)
        assert ids[-1] == end
        assert tok.decode(ids[plen:-1]) == p.solution


def test_backward_in_parts_gives_the_gradient_of_one_padded_pass(tmp_path, monkeypatch):
    import torch
    trims = []
    monkeypatch.setattr(sft, "release_freed_memory", lambda: trims.append(1))
    cfg = chat_config(tmp_path)
    task = load_task(cfg.task)
    model, tok = models.load_model(cfg.model.path, "float32")
    batch = sft.examples_for(cfg, task, tok)[:7]
    assert len({len(ids) for ids, _ in batch}) > 2  # lengths differ: parts are cut
    ids, attn, labels = sft.collate(batch, tok.pad_token_id)
    model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    budget = 2 * max(len(x) for x, _ in batch)  # two examples a part at most
    sft.backward_in_parts(model, batch, tok.pad_token_id, budget, torch.float32, trim=True)
    assert len(trims) == 4  # before each part: 7 examples, two a part at most
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[n], rtol=1e-5, atol=1e-7, msg=n)


def test_from_path_warm_starts_the_model_at_model_path_and_caches_it(tmp_path):
    from types import SimpleNamespace

    import torch

    from rollwise.loop.run import Inputs, initial_model, model_source
    cfg = chat_config(tmp_path, "sft.steps=2", "sft.from_path=true", "sft.lr=1e-2")
    task = load_task(cfg.task)
    lines: list[str] = []
    tuned, _ = sft.warm_start(cfg, task, log=lines.append)
    assert "2 SFT steps" in lines[0]
    path = sft.warm_start_path(cfg, task)
    assert (path / "config.json").exists()
    base, _ = models.load_model(cfg.model.path, "float32")
    assert any(not torch.equal(a, b) for a, b in zip(tuned.parameters(), base.parameters()))
    lines.clear()
    again, _ = initial_model(cfg, task, SimpleNamespace(log=lines.append, phase=lambda *a: None))
    assert lines == [f"warm start: cached at {path}"]
    assert all(torch.equal(a, b) for a, b in zip(tuned.parameters(), again.parameters()))
    assert model_source(cfg, task, Inputs()) == str(path.resolve())
    plain = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"from_path": False})})
    assert model_source(plain, task, Inputs()) == str((tmp_path / "chat").resolve())


def test_from_path_without_its_own_learning_rate_is_refused_before_any_work():
    import pytest

    from rollwise.config import ConfigError
    with pytest.raises(ConfigError, match="set sft.lr"):
        load_config(None, ["sft.from_path=true"])
    assert load_config(None, ["sft.from_path=true", "sft.lr=5e-5"]).sft.lr == 5e-5


def _grads_of_parts(model, batch, pad_id, budget, dtype):
    model.zero_grad()
    sft.backward_in_parts(model, batch, pad_id, budget, dtype)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_chunked_head_and_checkpointing_under_bf16_products_keep_the_gradient(tmp_path):
    """Autocast bf16 over float32 weights, with activation checkpointing: the parts' gradient
    through the chunked head equals one through the full logits (the model's head wrapped so
    it cannot be fused) within bf16's rounding, and the full logits are never formed."""
    import torch

    from rollwise.training.head import fusable
    from rollwise.training.trainer import enable_checkpointing
    cfg = chat_config(tmp_path)
    model, tok = models.load_model(cfg.model.path, "float32")
    enable_checkpointing(model)
    model.train()
    batch = sft.examples_for(cfg, load_task(cfg.task), tok)[:7]
    budget = 2 * max(len(x) for x, _ in batch)
    assert fusable(model) is None
    shapes = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: shapes.append(o.shape))
    chunked = _grads_of_parts(model, batch, tok.pad_token_id, budget, torch.bfloat16)
    assert shapes and all(s[-1] == 1 for s in shapes)  # the placeholder, not (.., vocab)
    hook.remove()

    class Wrapped(torch.nn.Module):  # the same head, not a plain Linear: the full logits
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)
    model.set_output_embeddings(Wrapped(head))
    assert fusable(model) is not None
    full = _grads_of_parts(model, batch, tok.pad_token_id, budget, torch.bfloat16)
    for n, g in chunked.items():
        ref = full[n.replace("lm_head.", "lm_head.inner.")] if n not in full else full[n]
        assert (g - ref).norm() <= 2e-2 * ref.norm() + 1e-8, n
