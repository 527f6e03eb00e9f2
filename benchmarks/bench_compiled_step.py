"""A whole compiled training step of the reference GPT (forward, backward, optimizer step) with
PackedAdamW against torch.optim.AdamW(fused=True): tokens per second on one CUDA GPU.

    python benchmarks/bench_compiled_step.py --out docs/results/COMPILED_STEP.md

Batch 32 x 256 random tokens, float32 parameters. Each variant builds a fresh model (same
initialisation), compiles `train_step` (forward, loss.backward(), opt.step(); gradients set to
None before each call, outside it), warms up, then times `--repeats` runs of `--steps` steps
(CUDA events) and reports the median. Variants:

- eager: no compile, for reference;
- compiled: torch.compile(train_step), default mode. PackedAdamW's step is one custom op, so
  the whole step is one graph (`fullgraph=True`) where dynamo can trace backward()
  (`torch._dynamo.config.trace_autograd_ops`, torch 2.13); torch's AdamW breaks the graph
  around its step by design (torch.optim's `_use_grad`), so it compiles with fullgraph=False;
- reduce-overhead: mode="reduce-overhead" (CUDA graphs) with capturable=True and a tensor lr
  for both optimizers.

A variant that fails is reported with its error instead of a number.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys
import traceback

import torch

from packed_adamw.torch import PackedAdamW
from packed_adamw.torch.gpt.model import GPT, GPTConfig

BATCH, CONTEXT = 32, 256
PRESET, DEVICE = "reference", "cuda"  # module constants, so a smoke test can shrink them
LR, WEIGHT_DECAY = 1e-3, 0.1
TRACES_BACKWARD = hasattr(torch._dynamo.config, "trace_autograd_ops")


def make_optimizer(name: str, params, capturable: bool):
    lr = torch.tensor(LR, device=DEVICE) if capturable else LR
    if name == "packed":
        return PackedAdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, capturable=capturable)
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=DEVICE == "cuda", capturable=capturable)


def run_variant(optimizer: str, variant: str, tokens: torch.Tensor, steps: int, repeats: int, warmup: int,
                backend: str = "inductor") -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(PRESET)).to(DEVICE)
    opt = make_optimizer(optimizer, model.parameters(), capturable=variant == "reduce-overhead")

    def train_step(idx):
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        return loss.detach()

    fullgraph = optimizer == "packed" and TRACES_BACKWARD
    if variant == "eager":
        step, fullgraph = train_step, None
    else:
        step = torch.compile(train_step, fullgraph=fullgraph, backend=backend,
                             mode="reduce-overhead" if variant == "reduce-overhead" else None)

    def one(i):
        model.zero_grad(set_to_none=True)
        return step(tokens[i % len(tokens)])

    with torch._dynamo.config.patch(trace_autograd_ops=True) if TRACES_BACKWARD else contextlib.nullcontext():
        for i in range(warmup):
            loss = one(i)
        torch.cuda.synchronize()
        samples = []
        for r in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(steps):
                loss = one(warmup + r * steps + i)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / steps)
    step_ms = statistics.median(samples)
    return {"step_ms": step_ms, "tokens_per_s": BATCH * CONTEXT / (step_ms / 1e3), "fullgraph": fullgraph,
            "spread": (min(samples), max(samples)), "loss": float(loss)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the markdown table here (also printed)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, CUDA graphs)")
    parser.add_argument("--variants", default="eager,compiled,reduce-overhead")
    parser.add_argument("--optimizers", default="packed,fused")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    vocab = GPTConfig.preset("reference").vocab_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (8, BATCH, CONTEXT), device="cuda", generator=gen)

    rows = []
    for variant in args.variants.split(","):
        for optimizer in args.optimizers.split(","):
            label = "PackedAdamW (packed)" if optimizer == "packed" else "torch AdamW(fused=True)"
            try:
                result = run_variant(optimizer, variant, tokens, args.steps, args.repeats, args.warmup)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result too
                traceback.print_exc()
                first_line = (str(e).strip().splitlines() or [""])[0][:160]
                rows.append(f"| {variant} | {label} | - | failed: {type(e).__name__}: {first_line} | | |")
                continue
            fullgraph = {None: "-", True: "yes", False: "no"}[result["fullgraph"]]
            low, high = result["spread"]
            rows.append(f"| {variant} | {label} | {fullgraph} | {result['tokens_per_s']:,.0f} | "
                        f"{result['step_ms']:.2f} | {low:.2f}-{high:.2f} |")
            print(rows[-1], flush=True)

    command = "python " + " ".join(["benchmarks/bench_compiled_step.py", *(argv if argv is not None else sys.argv[1:])])
    import triton

    text = "\n".join([
        "# A compiled training step of the reference GPT: PackedAdamW vs fused AdamW",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- versions: torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- command: `{command}`",
        f"- batch {BATCH} x {CONTEXT} random tokens, float32 parameters, lr {LR}, weight decay {WEIGHT_DECAY}; "
        f"median of {args.repeats} runs of {args.steps} steps after {args.warmup} warm-up steps",
        "- fullgraph: whether the compiled step is one graph (`fullgraph=True`)",
        "",
        "| variant | optimizer | fullgraph | tokens/s | step ms | min-max ms |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
