"""A chat model built locally for tests (no downloads): a byte-level BPE tokenizer trained with
`tokenizers`, a ChatML chat template whose end-of-turn token (<|im_end|>) is not the eos token
(<|endoftext|>), and a small random Qwen2."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
CORPUS = ["What is 12 + 7? Put the final answer in \\boxed{}. The answer is \\boxed{19}.",
          "You are a helpful assistant. <answer>42</answer> system user assistant",
          "Compute 3 * 4 - 5 = 7. Think step by step: 3 * 4 = 12, 12 - 5 = 7.",
          "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 +-*/=().,:;?!"]


def chat_tokenizer(template: str = CHATML, specials=("<|endoftext|>", "<|im_start|>",
                                                     "<|im_end|>"),
                   eos: str = "<|endoftext|>", bos: str | None = None,
                   vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=specials[0],
                                   bos_token=bos, chat_template=template)


def build_chat_model(path: Path, seed: int = 0) -> Path:
    """Save the tokenizer and a random 2-layer Qwen2 to `path` (a Hugging Face folder)."""
    tok = chat_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def favour_token(model, token_id: int, bias: float = 5.0):
    """The model with a bias toward one token at every position (e.g. end-of-turn, so random
    responses end there): lm_head becomes a Linear with that bias, in memory only."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[token_id] = bias
    model.lm_head = biased
    return model
