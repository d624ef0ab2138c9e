"""The chunked LM head (rollwise.training.head): log-probabilities, entropies and every
parameter's gradient equal the plain path through the full logits (fp32, 1e-6 relative), packed
and padded, on the tiny model and a chat model with an untied, biased head; the full logits
never exist; a model whose logits are not its head's output is caught and trained the plain
way."""

import copy

import pytest
import torch
import torch.nn.functional as F
from chat_model import build_chat_model, favour_token
from torch.utils._python_dispatch import TorchDispatchMode
from train_helpers import capture_grads, clone, make_groups, random_samples
from transformers import AutoModelForCausalLM

from rollwise.config import TrainConfig
from rollwise.training.head import fusable, head_logprobs
from rollwise.training.packing import pack, packed_token_logprobs
from rollwise.training.trainer import Trainer, token_logprobs
from rollwise.types import Batch

REL = 1e-6


def close(a: torch.Tensor, b: torch.Tensor, rel: float = REL) -> bool:
    scale = b.abs().max()
    return bool(scale > 0 and (a - b).abs().max() <= rel * scale)


def plain_head(hidden, weight, bias, target):
    lp = F.linear(hidden, weight, bias).float().log_softmax(-1)
    return lp.gather(-1, target[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("upstream", ["both", "logp", "entropy"])
def test_values_and_gradients_equal_the_full_logits(chunk, upstream):
    """Against autograd through the full logits: per-token values, and the gradients of the
    hidden states, the weight and the bias under random upstream weights on either output."""
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 23, 16, 50
    hidden = torch.randn(N, H, generator=g, dtype=torch.float32).requires_grad_(True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float32).requires_grad_(True)
    bias = torch.randn(V, generator=g, dtype=torch.float32).requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=g)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    grads = []
    for fn in (plain_head, lambda *a: head_logprobs(*a, chunk=chunk, entropy_grad=True)):
        lp, ent = fn(hidden, weight, bias, target)
        loss = ((lp * w_lp).sum() if upstream != "entropy" else 0) + \
               ((ent * w_ent).sum() if upstream != "logp" else 0)
        grads.append((lp.detach(), ent.detach(),
                      *torch.autograd.grad(loss, (hidden, weight, bias))))
    for got, want in zip(grads[1], grads[0]):
        assert close(got, want)


def test_under_autocast_the_backward_recomputes_the_forwards_logits():
    """fp32 weights with bf16 products (autocast, as the supervised warm start runs): the
    backward pass recomputes each chunk's logits under the forward's autocast, so the
    gradients are those of autograd through the same bf16 products."""
    g = torch.Generator().manual_seed(5)
    N, H, V = 40, 32, 300
    hidden = (3 * torch.randn(N, H, generator=g)).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=g)
    w_lp = torch.randn(N, generator=g)
    grads = []
    for fn in (plain_head, lambda *a: head_logprobs(*a, chunk=7)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = fn(hidden, weight, None, target)
        grads.append(torch.autograd.grad((lp * w_lp).sum(), (hidden, weight)))
    for got, want in zip(grads[1], grads[0]):
        assert close(got, want, rel=1e-2)


def test_the_entropy_is_detached_unless_asked():
    h = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    lp, ent = head_logprobs(h, w, None, torch.zeros(5, dtype=torch.long), chunk=2)
    assert lp.requires_grad and not ent.requires_grad


def random_batch(tok, seed: int, prompts: int = 5) -> Batch:
    samples = random_samples(seed, prompts, vocab=(3, min(len(tok), 400) - 1))
    return Batch.from_samples(samples, [0.0] * len(samples), tok.pad_token_id)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = build_chat_model(tmp_path_factory.mktemp("chat") / "model")
    from transformers import AutoTokenizer
    model = favour_token(AutoModelForCausalLM.from_pretrained(path), 5)  # a head with a bias
    return model.float(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("which", ["tiny", "chat"])
@pytest.mark.parametrize("packed", [False, True])
def test_model_logprobs_entropies_and_gradients_equal_the_full_logits(tiny, chat, which,
                                                                      packed):
    model, tok = tiny if which == "tiny" else chat
    assert fusable(model) is None
    batch = random_batch(tok, seed=3)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    mask = batch.loss_mask > 0
    out = []
    for chunk in (None, 5):
        m = copy.deepcopy(model)
        lp, ent = (packed_token_logprobs(m, batch, pack(batch, fill=True), True, chunk)
                   if packed else token_logprobs(m, batch, True, chunk))
        ((lp + 0.1 * ent) * weights * batch.loss_mask).sum().backward()
        out.append((lp[mask].detach(), ent[mask].detach(),
                    torch.cat([p.grad.flatten() for p in m.parameters()])))
    for got, want in zip(out[1], out[0]):  # the gradient against its largest entry
        assert close(got, want)


class LogitShapes(TorchDispatchMode):
    """The largest tensor with the vocabulary as its last dimension that any operation made
    (not views of its inputs: the head's transposed weight is no logits)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("packed", [False, True])
def test_the_full_logits_never_exist_in_the_forward_or_backward(chat, packed, monkeypatch):
    """Nothing of the vocabulary's width holds more rows than a chunk (4 tokens here) or the
    head gradient's product (8), though the batch has many more targets."""
    from rollwise.training import head
    monkeypatch.setattr(head, "WEIGHT_TOKENS", 8)
    model, tok = chat
    model = copy.deepcopy(model)
    V = model.config.vocab_size
    batch = random_batch(tok, seed=5, prompts=8)
    targets = int((batch.loss_mask > 0).sum())
    assert targets > 40
    for chunk, most in ((4, 8), (None, targets)):
        seen = LogitShapes(V)
        with seen:
            lp, ent = (packed_token_logprobs(model, batch, pack(batch, fill=True), True, chunk)
                       if packed else token_logprobs(model, batch, True, chunk))
            (lp.sum() + ent.sum()).backward()
        assert seen.largest <= most if chunk else seen.largest >= most  # rows of V logits


def steps_with_and_without_chunks(model, tok, groups, **settings):
    """Each optimizer step's gradient (flattened) of one update with train.chunked_logits off
    and on; the trainer chunks when asked."""
    out = []
    for chunked in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(chunked_logits=chunked, **settings),
                          pad_id=tok.pad_token_id, seed=2)
        assert (trainer._chunk is not None) is chunked
        seen = capture_grads(trainer)
        trainer.update(clone(groups))
        out.append([torch.cat([g.flatten() for g in step]) for step in seen])
    return out


def test_the_trainer_chunks_by_default_and_updates_as_the_full_logits_do(tiny):
    model, tok = tiny
    assert TrainConfig().chunked_logits
    groups = make_groups(model, tok, n_prompts=4, group_size=4, max_new_tokens=6, seed=11)
    full, chunked = steps_with_and_without_chunks(model, tok, groups, minibatches=2,
                                                  logit_chunk_tokens=7, entropy_coef=0.01)
    assert len(full) == len(chunked) == 2
    for a, b in zip(full, chunked):
        assert close(b, a, 1e-5)


def test_the_default_chunk_follows_the_vocabulary(tiny):
    trainer = Trainer(copy.deepcopy(tiny[0]), TrainConfig(), pad_id=0)
    assert trainer._chunk == (6 << 20) // tiny[0].config.vocab_size  # 24 MiB of fp32 logits


def test_a_lora_model_chunks_through_its_unwrapped_head(tiny):
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=4)
    full, chunked = steps_with_and_without_chunks(model, tok, groups, minibatches=1,
                                                  logit_chunk_tokens=3, lora={"rank": 4})
    assert close(chunked[0], full[0], 1e-5)


def test_a_model_whose_logits_are_not_its_heads_output_is_trained_on_full_logits(tiny):
    """Logits scaled after the head (as soft-capping models do) with nothing in the config to
    say so: the first update's check finds the chunked head disagrees, warns, and trains
    through the full logits."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=6, seed=3)
    scaled = copy.deepcopy(model)
    forward = scaled.forward

    def scaled_logits(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out
    scaled.forward = scaled_logits
    trainer = Trainer(scaled, TrainConfig(minibatches=1), pad_id=tok.pad_token_id)
    assert trainer._chunk is not None
    with pytest.warns(RuntimeWarning, match="train.chunked_logits: log-probabilities differ"):
        trainer.update(clone(groups))
    assert trainer._chunk is None and trainer._pack


def test_a_head_the_config_says_is_transformed_is_not_chunked(tiny):
    model = copy.deepcopy(tiny[0])
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in fusable(model)
    with pytest.warns(RuntimeWarning, match="transforms the logits after the head"):
        trainer = Trainer(model, TrainConfig(), pad_id=0)
    assert trainer._chunk is None
    assert Trainer(copy.deepcopy(tiny[0]), TrainConfig(chunked_logits=False),
                   pad_id=0)._chunk is None
