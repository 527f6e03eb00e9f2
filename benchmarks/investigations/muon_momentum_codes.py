"""Muon's momentum magnitudes and 16-bit momentum codes: a CPU sanity study (docs/MUON.md, "Why bias 31").

    python -m packed_adamw.tokenizer.tape build --out runs/data/muon-study
    python benchmarks/investigations/muon_momentum_codes.py VARIANT STEPS SEED [TAPES_DIR]

The tiny reference GPT on the Shakespeare tapes: torch.optim.Muon (lr 0.02, momentum 0.95,
adjust_lr_fn "match_rms_adamw", no weight decay) on the blocks' matrices, torch AdamW (3e-3,
betas 0.9/0.95) on the rest, gradient clipping at 1.0, warmup 50 steps and a linear decay over
the last 30%. After every step the momentum buffers are replaced by their value in VARIANT:
fp32 (unchanged), bf16, fixed:E:M:BIAS (a signed minifloat, core/codecs.py's MiniFloat),
offset:E:M:TOP (the same with a per-matrix power-of-two offset placing the largest |momentum|
in the top binade 2**TOP). Prints one JSON line: the final validation loss (20 batches) and,
every 50 steps, the per-matrix log2 ranges of |momentum| (max, median, 0.1% quantile)."""
import sys, json, math, time
import numpy as np, torch
from packed_adamw.torch.gpt.model import GPT, GPTConfig
from packed_adamw.tokenizer.tape import TapeReader
from packed_adamw.core.codecs import MiniFloat

torch.set_num_threads(1)
variant = sys.argv[1]; steps = int(sys.argv[2]); seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.manual_seed(seed)
cfg = GPTConfig.preset("tiny")
model = GPT(cfg)
mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n]
others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "emb" not in n)]
muon = torch.optim.Muon(mats, lr=0.02, momentum=0.95, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
adam = torch.optim.AdamW(others, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)

def quantizer(v):
    if v == "fp32": return None
    if v == "bf16": return lambda b: b.bfloat16().float()
    kind, *rest = v.split(":")
    if kind == "fixed":  # fixed-bias signed minifloat E{e}M{m} bias b
        e, m, b = map(int, rest); f = MiniFloat("m", True, e, m, b)
        return lambda t: torch.from_numpy(f.decode(f.encode(t.numpy())))
    if kind == "offset":  # per-matrix power-of-two offset: max |buf| lands at 2**top in a fixed code
        e, m, top = map(int, rest); b = (1 << e) - 1 - top - 0  # largest exponent code maps to 2**top
        f = MiniFloat("m", True, e, m, b)
        def q(t):
            mx = t.abs().max().item()
            if mx == 0: return t
            k = math.floor(math.log2(mx)) - top
            s = 2.0 ** k
            return torch.from_numpy(f.decode(f.encode((t / s).numpy()))) * s
        return q
    raise ValueError(v)

q = quantizer(variant)
tapes = sys.argv[4] if len(sys.argv) > 4 else "runs/data/muon-study"
train = TapeReader(f"{tapes}/train.tape"); val = TapeReader(f"{tapes}/val.tape")
B, T = 16, cfg.context
log = []
def evaluate():
    model.eval(); tot = 0; n = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(val.iter_eval_batches(B, T)):
            if i >= 20: break
            _, loss = model(torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
            tot += loss.item(); n += 1
    model.train(); return tot / n
t0 = time.time()
for step in range(steps):
    frac = min(1.0, (step + 1) / 50) * (1.0 if step < 0.7 * steps else (steps - step) / (0.3 * steps))
    for g in muon.param_groups: g["lr"] = 0.02 * frac
    for g in adam.param_groups: g["lr"] = 3e-3 * frac
    x, y = train.next_batch(B, T)
    _, loss = model(torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
    muon.zero_grad(); adam.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    muon.step(); adam.step()
    if q is not None:
        for p in mats:
            buf = muon.state[p]["momentum_buffer"]; buf.copy_(q(buf))
    if step % 50 == 0 or step == steps - 1:
        stats = []
        for p in mats:
            a = muon.state[p]["momentum_buffer"].abs().flatten()
            nz = a[a > 0]
            stats.append((math.log2(a.max().item()), math.log2(nz.median().item()), math.log2(torch.quantile(nz[:100000], 0.001).item())))
        s = np.array(stats)
        log.append(dict(step=step, loss=loss.item(), max_log2=[float(s[:,0].min()), float(s[:,0].max())],
                        med_log2=[float(s[:,1].min()), float(s[:,1].max())], q001_log2=[float(s[:,2].min()), float(s[:,2].max())]))
print(json.dumps(dict(variant=variant, seed=seed, val=evaluate(), secs=time.time()-t0, log=log)))
