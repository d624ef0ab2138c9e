"""Peak RSS of smollm2-long's warm start: N SFT steps of the preset from model.path, float32
weights and AdamW, products in model.dtype, as `rollwise train` runs them."""
import sys, time, torch
from rollwise import models
from rollwise.config import load_config
from rollwise.report.memory import high_water_bytes, resident_bytes
from rollwise.tasks import load_task
from rollwise.training import sft
G = 2**30
cfg = load_config("smollm2-long", [f"sft.steps={sys.argv[1]}", *sys.argv[2:]])
torch.set_num_threads(cfg.run.threads)
task = load_task(cfg.task)
model, tok = models.load_model(cfg.model.path, "float32")
print(f"loaded rss {resident_bytes()/G:.2f} GiB, model.dtype {cfg.model.dtype}", flush=True)
t0 = time.time()
sft.train_sft(model, tok, task, cfg, log=lambda m: print(m, flush=True))
print(f"sft {time.time()-t0:.0f} s, peak (VmHWM) {high_water_bytes()/G:.2f} GiB")
