import os, sys, threading, time, collections, torch
torch.set_num_threads(int(os.environ.get("THREADS","1")))
from rollwise.report.memory import resident_bytes
from rollwise.devices import release_freed_memory
from rollwise import models
from rollwise.config import load_config
import rollwise.training.trainer as TT, os, ctypes
# THREADS (1), N_GROUPS (16); allocator arms: MMAP_MB (blocks above it mapped afresh),
# TRIM_MB (malloc_trim before each micro-batch, as train.trim_microbatches now does)
if os.environ.get("MMAP_MB"):
    _mb=float(os.environ["MMAP_MB"])
    def _k():
        libc=ctypes.CDLL("libc.so.6"); libc.mallopt(-3, int(_mb*(1<<20))); libc.mallopt(-1, int(_mb*(1<<20))*2); return True
    TT.keep_freed_memory=_k
from rollwise.bench.gpu import synthetic_groups
G = 2**30
cfg = load_config("smollm2", sys.argv[3:])
m, tok = models.load_model(cfg.model.path, cfg.model.dtype, for_training=True)
t = TT.Trainer(m, cfg.train.model_copy(update={"max_tokens_per_microbatch": int(sys.argv[1])}), pad_id=tok.pad_token_id)
phase = ["other"]; peaks = collections.defaultdict(float); base = [0.0]
def sample():
    while True:
        r = resident_bytes() / G
        peaks[phase[0]] = max(peaks[phase[0]], r); time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
orig = TT.Trainer._micro_loss
n = [0]
def wrapped(self, prep, micro, *a, **k):
    n[0] += 1
    if os.environ.get("TRIM_MB"):
        release_freed_memory()
    phase[0] = f"fwd{n[0]}"
    out = orig(self, prep, micro, *a, **k)
    phase[0] = f"bwd{n[0]}"   # until the next forward or the optimizer step
    return out
TT.Trainer._micro_loss = wrapped
ostep = torch.optim.AdamW.step
groups = synthetic_groups(int(os.environ.get("N_GROUPS","16")), 8, 70, int(sys.argv[2]), m.config.vocab_size)
release_freed_memory(); time.sleep(0.1); print("before update rss", f"{resident_bytes()/G:.2f}")
phase[0] = "prepare"
t0=time.time(); t.update(groups); print("update s", round(time.time()-t0,1))
phase[0] = "after"; time.sleep(0.05)
for k, v in peaks.items():
    if k in ("other", "prepare", "after") or k in ("fwd1", "bwd1", "fwd2", "bwd2", f"fwd{n[0]}", f"bwd{n[0]}"):
        print(f"{k:8s} {v:.2f}")
