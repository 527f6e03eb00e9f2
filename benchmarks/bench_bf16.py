"""bf16 live weights with split masters on one CUDA GPU: step time and measured training memory.

    python benchmarks/bench_bf16.py --out docs/results/BF16.md --json docs/results/bf16.json

Step time: PackedAdamW on bf16 parameters (split masters, bf16 gradients) against
torch.optim.AdamW(fused=True) on FP32 parameters and on bf16 parameters (whose moments are
then bf16: the inexact baseline), for one 268M-element tensor and three model-shaped lists.
Floor: 18 bytes/parameter (read weight 2, low half 2, gradient 2, word 4; write weight 2,
low half 2, word 4) at the copy bandwidth measured in this run.

Memory: one training step (forward, backward, step) of the reference GPT and of a GPT-2
124M shape, per configuration: torch.cuda.memory_allocated after the step (weights,
gradients, optimizer state) and torch.cuda.max_memory_allocated during it (with the
activations of the batch given), both per parameter.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from bench_step import BIG, SHAPE_LISTS, copy_bandwidth, cuda_time_ms
from packed_adamw.torch import PackedAdamW
from packed_adamw.torch.gpt.model import GPT, GPTConfig

FLOOR_BYTES = 18
ROUNDS = 3
MODELS = {  # name -> (config, batch, sequence length)
    "reference GPT (11.6M)": (GPTConfig.preset("reference"), 32, 256),
    "GPT-2 124M shape": (GPTConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, context=1024), 8, 1024),
}


def make_params(shapes, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).to(dtype)
    return params


STEPS = {  # name -> (parameter dtype, optimizer)
    "PackedAdamW packed, bf16 weights + split masters": (torch.bfloat16, lambda p: PackedAdamW(p, lr=1e-3)),
    "torch fused AdamW, FP32 weights": (torch.float32, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    "torch fused AdamW, bf16 weights (bf16 moments)": (torch.bfloat16,
                                                       lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    "PackedAdamW packed, FP32 weights": (torch.float32, lambda p: PackedAdamW(p, lr=1e-3)),
}


def step_ms(shapes, dtype, make_opt) -> float:
    params = make_params(shapes, dtype)
    opt = make_opt(params)
    t = cuda_time_ms(opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return t


MEMORY = {  # name -> (parameter dtype, autocast, optimizer)
    "FP32 weights, bf16 autocast, torch fused AdamW": (torch.float32, True,
                                                       lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    "FP32 weights, bf16 autocast, PackedAdamW packed": (torch.float32, True, lambda p: PackedAdamW(p, lr=1e-3)),
    "bf16 weights + split masters, PackedAdamW packed": (torch.bfloat16, False, lambda p: PackedAdamW(p, lr=1e-3)),
    "bf16 weights, torch fused AdamW (bf16 moments, inexact)": (torch.bfloat16, False,
                                                                lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
}


def training_memory(config, batch, length, dtype, autocast, make_opt) -> dict:
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = GPT(config).cuda().to(dtype)
    opt = make_opt(list(model.parameters()))
    n = model.num_parameters()
    idx = torch.randint(0, config.vocab_size, (batch, length), device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated, as in a training loop
        return loss

    train_step()  # creates the optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step()
    torch.cuda.synchronize()
    persistent = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    del model, opt, idx
    torch.cuda.empty_cache()
    return {"params": n, "after_step_bytes_per_param": persistent / n, "peak_bytes_per_param": peak / n}


def render(raw) -> str:
    versions = (f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
                f"GPU {torch.cuda.get_device_name()}")
    lines = ["# bf16 live weights with split masters", "",
             f"- Date: {datetime.date.today().isoformat()}; {versions}",
             "- Command: `python benchmarks/bench_bf16.py --out docs/results/BF16.md --json docs/results/bf16.json`",
             f"- Copy bandwidth measured in this run: {raw['copy_bandwidth_TBps']:.2f} TB/s; floor = {FLOOR_BYTES} "
             "bytes/parameter at that bandwidth.",
             f"- Step times: median of 5 repeats of the mean of 20 steps (CUDA events); lists: median of {ROUNDS} "
             "rounds, the rows alternating.", "",
             "## Step time", "",
             "| parameters | step | ms | time / fused AdamW FP32 | time / floor |", "|---|---|---|---|---|"]
    for name, entry in raw["steps"].items():
        base = entry["torch fused AdamW, FP32 weights"]
        for step, ms in entry.items():
            if step == "params":
                continue
            lines.append(f"| {name} ({entry['params']:,}) | {step} | {ms:.3f} | {ms / base:.2f} | "
                         f"{ms / entry['floor']:.2f} |")
    lines += ["", "## Training memory (one step: forward, backward, optimizer)", "",
              "| model | configuration | bytes/param after the step | peak bytes/param |", "|---|---|---|---|"]
    for name, rows in raw["memory"].items():
        for config, m in rows.items():
            lines.append(f"| {name} | {config} | {m['after_step_bytes_per_param']:.2f} | {m['peak_bytes_per_param']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    raw = {"copy_bandwidth_TBps": bandwidth / 1e9, "steps": {}, "memory": {}}
    for name, shapes in {"one tensor": [(BIG,)], **SHAPE_LISTS}.items():
        n = sum(torch.Size(s).numel() for s in shapes)
        samples = {step: [] for step in STEPS}
        for _ in range(ROUNDS if len(shapes) > 1 else 1):
            for step, (dtype, make_opt) in STEPS.items():
                samples[step].append(step_ms(shapes, dtype, make_opt))
        raw["steps"][name] = {"params": n, "floor": FLOOR_BYTES * n / bandwidth,
                              **{step: statistics.median(ms) for step, ms in samples.items()}}
        print(name, json.dumps(raw["steps"][name]), flush=True)
    for name, (config, batch, length) in MODELS.items():
        raw["memory"][name] = {}
        for config_name, (dtype, autocast, make_opt) in MEMORY.items():
            raw["memory"][name][config_name] = training_memory(config, batch, length, dtype, autocast, make_opt)
            print(name, config_name, raw["memory"][name][config_name], flush=True)
    report = render(raw)
    print(report)
    if args.out:
        open(args.out, "w").write(report)
    if args.json:
        json.dump(raw, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
