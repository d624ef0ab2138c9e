import pytest
import torch

from rollwise import models
from rollwise.config import ModelConfig

torch.set_num_threads(1)  # the suite shares a 2-core machine; keep numbers deterministic


@pytest.fixture(scope="session")
def tiny():
    """A small random Qwen2 model and the character tokenizer."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64)
    return models.build(cfg, seed=0)
