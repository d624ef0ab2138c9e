import sys, time
from rollwise.report.memory import resident_bytes, high_water_bytes
from rollwise.devices import release_freed_memory
G = 2**30
def r(tag): release_freed_memory(); print(f"{tag:34s} rss {resident_bytes()/G:.2f} (trimmed) hwm {high_water_bytes()/G:.2f}", flush=True)
import torch
torch.set_num_threads(1)
from rollwise import models
from rollwise.config import load_config, TrainConfig
import rollwise.training.trainer as TT
if "nokeep" in sys.argv[3:]:
    TT.keep_freed_memory = lambda: False
    sys.argv.remove("nokeep")
Trainer = TT.Trainer
from rollwise.bench.gpu import synthetic_groups
cfg = load_config("smollm2", sys.argv[3:])
m, tok = models.load_model(cfg.model.path, cfg.model.dtype, for_training=True)
r("model")
t = Trainer(m, cfg.train.model_copy(update={"max_tokens_per_microbatch": int(sys.argv[1]) if sys.argv[1] != "none" else None}), pad_id=tok.pad_token_id)
r("trainer")
groups = synthetic_groups(16, 8, 70, int(sys.argv[2]), m.config.vocab_size)
print("tokens", sum(len(s.prompt_ids)+len(s.response_ids) for g in groups for s in g.samples))
for i in range(2):
    t.update(groups); r(f"after update {i}")
