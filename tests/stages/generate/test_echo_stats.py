"""`rollwise bench echo_stats`: the statistics it reports for a sampled response are ECHO's
(tree_rules.echo_push) over the model's own next-token distributions, recomputed here by one
full forward pass of the prompt and the response."""

import torch

from rollwise import models
from rollwise.bench import echo_stats
from rollwise.config import load_config
from rollwise.stages.generate.tree_rules import top5_confidence, topk_entropy
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.eval_size=4",
         "generate.max_new_tokens=12"]


def test_sampled_statistics_match_a_full_forward_pass():
    cfg = load_config(None, SMALL)
    task = load_task(cfg.task)
    model, tok = models.build(cfg.model)
    model.eval()
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    torch.manual_seed(0)
    traces = echo_stats.sample_traces(model, tok, prompter, task.eval[:3], cfg.generate.echo, 12)
    torch.manual_seed(0)  # the same draws again, to get the sampled tokens
    for p, (trace, alts) in zip(task.eval[:3], traces):
        ids = torch.tensor([prompter.ids(p)])
        gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=12,
                             eos_token_id=prompter.stop_ids, pad_token_id=tok.pad_token_id)
        n = len(trace.H)
        assert gen.shape[1] - ids.shape[1] == n
        with torch.no_grad():
            logp = torch.log_softmax(model(gen).logits[0].float(), -1)
        for i in range(n):
            top = logp[ids.shape[1] - 1 + i].topk(10).values.tolist()
            assert abs(trace.H[i] - topk_entropy(top)) < 1e-4
            assert abs(trace.C[i] - top5_confidence(top)) < 1e-4
            assert abs(alts[i][0] - torch.tensor(top[1]).exp().item()) < 1e-5


def test_echo_stats_prints_its_tables(tmp_path, capsys):
    cfg = load_config(None, SMALL)
    model, tok = models.build(cfg.model)
    models.save(model, tok, tmp_path / "m")
    assert echo_stats.main(["--model", str(tmp_path / "m"), "--config", "", "--prompts", "2",
                            "--high", "0", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "| H |" in out and "| Cg |" in out and "where H >= 0" in out
