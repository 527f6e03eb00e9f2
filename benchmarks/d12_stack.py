"""The d12 stack trained on one GPU: bf16 live weights with PackedMuonAdamW against FP32 weights
with torch.optim.Muon + fused AdamW, in one process, on the same batches (issue 38, "Measured").

    python benchmarks/d12_stack.py --out docs/results/D12_STACK.md --json docs/results/d12_stack.json

Stacks (`--stacks`, run one after the other; memory is freed and the peak reset between them):

- `packed`: the model's parameters in bf16 (`model.to(torch.bfloat16)`), every one with an exact
  FP32 master (its bf16 weight + the int16 low half `lo` in the optimizer state, started from the
  FP32 initialisation as the trainer starts them); PackedMuonAdamW with Muon's momentum packed
  (2 bytes) on the blocks' matrices and packed AdamW (4 bytes) on the rest, with its defaults:
  on CUDA Newton-Schulz runs on the Triton kernels, batched over the matrices of one shape.
- `packed-per-matrix`: the same with Newton-Schulz on torch's matmuls matrix by matrix
  (`ns_impl="cublas", batch_ns=False`: torch.optim.Muon's way).
- `reference`: FP32 parameters, forward under bf16 autocast; torch.optim.Muon on the Muon
  groups and torch.optim.AdamW(fused=True) on the AdamW groups (FP32 state), stepped one after
  the other.

Every stack starts from the same FP32 initialisation (same seed), takes the groups of
`ChatGPT.muon_adamw_groups` (nanochat's lrs, betas, eps, weight decays), the same schedule
tables (`apply_schedule` before each step: lr warmup, Muon momentum and weight decay) and the
same batches: rows of `--context` tokens from a Zipf unigram distribution (so that the loss has
something to learn: uniform tokens would start at their entropy), split into documents of
geometric lengths (mean `--mean-document`), each starting with BOS, with their `cu_seqlens`.

`--compile [BACKEND]` compiles each stack's model (forward and backward; not the optimizer step)
with chat_model.compile_chat_model: once for every document count, dynamo's caches reset before
each stack. Each stack's row records the graphs compiled by its first step and in all (equal:
nothing recompiled after the first batch). BACKEND: inductor (the default), or aot_eager / eager
(the captured graphs run eagerly: on the CPU the eager run's bits).

`--rounds R` runs the stacks R times, alternating (packed, reference, packed, ...), each round
a fresh build on the same batches: a stack's row is its round of median tokens/s, and the ratio
to the reference is also given round by round (paired: the rounds that ran side by side), so
that a stretch of slow host time in one stack's window (torch.optim.Muon's per-matrix loop is
host-bound) shows as spread instead of moving the ratio. `--profile` profiles the last round.

Measured per stack: `--warmup` untimed steps (kernel compilation, state allocation), then
`--steps` timed ones. ms/step and tokens/s: CUDA events around the timed steps (the host never
waits inside them); optimizer ms: CUDA events around the optimizer step(s) alone, median over
the timed steps. Peak memory: torch.cuda.max_memory_allocated over the stack's whole run (model
build included, activations of the batch included). Training state: bytes of the parameters'
storages plus the optimizer state's (moments, momentum, low halves of the masters, step
counters), each storage counted once, measured from the tensors; gradients are reported apart
(their bytes after a backward). Loss: the first step's and the last step's. MFU: tokens/s x
nanochat's FLOPs per token (telemetry.chat_flops_per_token: 6 x the matmul weights + 12 x heads x
head_dim x each layer's attention span, a short-window layer at its window) / the GPU's dense
bf16 peak (telemetry.PEAK_BF16_FLOPS: H100 SXM and H200 989 TFLOP/s); null (`-` in the table)
for other GPUs and the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import sys
import time

import torch

from packed_adamw.torch.combined import PackedMuonAdamW
from packed_adamw.torch.gpt.chat_model import PRESETS, ChatGPT, compile_chat_model, compiled_graph_count
from packed_adamw.torch.gpt.optimizers import TorchMuonAdamW, optimizer_state_bytes
from packed_adamw.torch.gpt.packed_data import PackedBatch, cu_seqlens_of
from packed_adamw.torch.gpt.schedules import ScheduleConfig, apply_schedule, build_schedule
from packed_adamw.torch.gpt.telemetry import chat_flops_per_token, model_flops_utilization, peak_bf16_flops

BOS = 0  # token 0 starts every document; the Zipf tokens are 1 .. vocab - 1
STACKS = {
    "packed": ("bf16 + exact FP32 masters",
               "PackedMuonAdamW: Muon packed (defaults: Triton Newton-Schulz, batched) + AdamW packed"),
    "packed-per-matrix": ("bf16 + exact FP32 masters",
                          "PackedMuonAdamW: Muon packed (cuBLAS Newton-Schulz per matrix) + AdamW packed"),
    "reference": ("FP32, bf16 autocast", "torch.optim.Muon + torch.optim.AdamW(fused=True), FP32 state"),
}
GIB = 2 ** 30
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


# ---- data ------------------------------------------------------------------------------------
def synthetic_batches(count: int, rows: int, context: int, vocab: int, seed: int, mean_document: float,
                      zipf_exponent: float) -> list[PackedBatch]:
    """`count` packed batches of `rows` x `context` tokens (module docstring), from a CPU
    generator seeded with `seed`: the same batches on every device and in every stack."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab, dtype=torch.float64) ** -zipf_exponent
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].clone()
    batches = []
    for _ in range(count):
        uniform = torch.rand(rows, context + 1, generator=generator, dtype=torch.float64)
        tokens = (torch.searchsorted(cdf, uniform) + 1).clamp_(max=vocab - 1)
        starts = torch.rand(rows, context + 1, generator=generator) < 1.0 / mean_document
        starts[:, 0] = True  # every row starts a document
        tokens[starts] = BOS
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        batches.append(PackedBatch(inputs, targets, cu_seqlens_of(inputs, BOS)))
    return batches


# ---- measuring -------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU (recorded in the stream, read after a synchronize), host time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- the stacks ------------------------------------------------------------------------------
def build_stack(name: str, config, device: torch.device, seed: int):
    """(model, optimizers, autocast context factory) of stack `name`, from the FP32 initialisation of `seed`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = ChatGPT(config)
    if name == "reference":
        # chat_train's baseline: torch.optim.Muon + fused torch.optim.AdamW, one per group kind
        reference = TorchMuonAdamW(model.muon_adamw_groups(), muon={}, adamw={"fused": True})
        return model, [reference], lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    initial = {id(p): p.detach().clone() for p in model.parameters()}  # the FP32 initialisation
    model.to(torch.bfloat16)  # the same Parameter objects, now bf16
    per_matrix = {} if name == "packed" else dict(ns_impl="cublas", batch_ns=False)
    optimizer = PackedMuonAdamW(model.muon_adamw_groups(), mode="packed", adamw_mode="packed", **per_matrix)
    for rule in optimizer.rules.values():  # exact masters: bf16 weight + low half = the FP32 initialisation
        rule.load_master_weights([initial[id(p)] for g in rule.param_groups for p in g["params"]])
    del initial
    return model, [optimizer], contextlib.nullcontext


def run_stack(name: str, config, batches: list[PackedBatch], args, device: torch.device, profile: int) -> dict:
    free_memory(device)
    if args.compile:
        torch._dynamo.reset()  # each stack compiles afresh (and has the whole recompile limit)
    model, optimizers, autocast = build_stack(name, config, device, args.seed)
    forward = compile_chat_model(model, args.compile) if args.compile else model
    graphs_at_start, graphs_after_first_step = compiled_graph_count(), None
    n_params = model.num_parameters()
    total_steps = args.warmup + args.steps
    tables = build_schedule(ScheduleConfig(num_steps=total_steps, warmup_steps=args.lr_warmup,
                                           weight_decay=args.weight_decay))
    clock = Clock(device)
    losses, marks, gradient_bytes = [], [], None

    def train_step(t: int, batch: PackedBatch):
        """One step of schedule row `t` on `batch`: (its loss, the forward-backward's end, the optimizer's end)."""
        for optimizer in optimizers:
            apply_schedule(optimizer, tables, t)
        with autocast():
            _, loss = forward(batch.inputs, batch.targets, cu_seqlens=batch.cu_seqlens)
        loss.backward()
        nonlocal gradient_bytes
        if gradient_bytes is None:  # the gradients' bytes, measured after the first backward
            gradient_bytes = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        before_step = clock.mark()
        for optimizer in optimizers:
            optimizer.step()
        after_step = clock.mark()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        return loss.detach(), before_step, after_step

    for t in range(total_steps):
        step_start = clock.mark()
        loss, before_step, after_step = train_step(t, batches[t])
        if graphs_after_first_step is None:
            graphs_after_first_step = compiled_graph_count() - graphs_at_start
        losses.append(loss)
        marks.append((step_start, before_step, after_step))
    end = clock.mark()
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = marks[args.warmup:]
    total_ms = clock.ms(timed[0][0], end)
    optimizer_ms = [clock.ms(b, a) for _, b, a in timed]
    parameter_bytes = storage_bytes(model.parameters())
    state_bytes = sum(optimizer_state_bytes(optimizer) for optimizer in optimizers)
    losses = [float(loss) for loss in losses]
    weights, optimizer_text = STACKS[name]
    tokens_per_s = args.batch * config.context * args.steps / (total_ms / 1e3)
    result = {
        "stack": name, "weights": weights, "optimizer": optimizer_text, "parameters": n_params,
        "ms_per_step": total_ms / args.steps,
        "tokens_per_s": tokens_per_s,
        "mfu": model_flops_utilization(tokens_per_s, chat_flops_per_token(model, config.context),
                                       peak_bf16_flops(device)),
        "compiled_graphs_after_first_step": graphs_after_first_step if args.compile else None,
        "compiled_graphs": compiled_graph_count() - graphs_at_start if args.compile else None,
        "optimizer_ms_median": statistics.median(optimizer_ms),
        "optimizer_ms_mean": statistics.fmean(optimizer_ms),
        "parameter_bytes": parameter_bytes,
        "optimizer_state_bytes": state_bytes,
        "training_state_bytes": parameter_bytes + state_bytes,
        "training_state_bytes_per_param": (parameter_bytes + state_bytes) / n_params,
        "gradient_bytes": gradient_bytes,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        "loss_decreased": losses[-1] < losses[0],
    }
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_memory_bytes_per_param"] = result["peak_memory_bytes"] / n_params
        result["allocated_after_bytes"] = torch.cuda.memory_allocated()
    if profile:  # after the timed steps, so that profiling costs them nothing
        # the run's batches again, last first, cycling when --profile asks for more steps than it took
        result["profile"] = profile_steps(
            lambda i: train_step(total_steps - 1, batches[(total_steps - 1 - i) % total_steps]), profile, device)
    del model, forward, optimizers
    free_memory(device)
    return result


# ---- where a step's time goes -----------------------------------------------------------------
# Kernel names to the part of the step they belong to, first match wins (lower-cased substrings).
# The optimizer's are the packed kernels (core/*/kernel.py, ns_kernel.py) and torch's fused
# AdamW and foreach ops; a cuBLAS GEMM inside Newton-Schulz counts as a GEMM (the profile says
# how the step's GPU time splits by kind of work; the optimizer's wall time is `optimizer ms`).
KERNEL_PARTS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("adamw", "muon", "newton", "_ns_", "ns_", "multi_tensor", "foreach", "momentum",
                   "step_scalars")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "aten::mm", "addmm", "bmm")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("norm", ("norm",)),
    ("copy / cast", ("copy", "cast", "convert", "to_copy", "fill", "memset", "memcpy")),
)


def kernel_part(name: str) -> str:
    lowered = name.lower()
    for part, needles in KERNEL_PARTS:
        if any(needle in lowered for needle in needles):
            return part
    return "other elementwise"


def profile_steps(step, count: int, device: torch.device) -> dict:
    """`count` calls of `step(i)` under torch.profiler: the device time per step by part of the
    step (`KERNEL_PARTS`; on the CPU, the ops' self CPU time), the wall time per step, the
    share of the wall time no kernel ran (the host's gaps), the 25 largest kernels, and every
    kernel of the optimizer part (the packed step's phases by name, whatever their rank)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step(0)  # once outside the profile: the profiler's own first call costs nothing of the steps
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(count):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    from torch.autograd import DeviceType
    totals: dict[str, list] = {}  # name -> [us, calls]
    if device.type == "cuda":
        # The kernels themselves, from the events: an op's row carries the device time of the
        # kernels it launched too, and a user annotation's (torch.optim's `Optimizer.step#...`)
        # the time its region spans on the device; counting either counted kernels twice.
        for event in prof.events():
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            total = totals.setdefault(event.name, [0.0, 0])
            total[0] += event.device_time_total
            total[1] += 1
    else:
        for avg in prof.key_averages():
            if avg.key.startswith("aten::"):
                totals[avg.key] = [avg.self_cpu_time_total, avg.count]
    rows = [(name, us, calls) for name, (us, calls) in totals.items() if us > 0]
    rows.sort(key=lambda r: -r[1])
    parts: dict[str, float] = {}
    for name, us, _ in rows:
        parts[kernel_part(name)] = parts.get(kernel_part(name), 0.0) + us
    busy_us = sum(parts.values())
    return {
        "steps": count,
        "wall_ms_per_step": wall_us / count / 1e3,
        "device_ms_per_step": {part: us / count / 1e3 for part, us in sorted(parts.items(), key=lambda kv: -kv[1])},
        "busy_ms_per_step": busy_us / count / 1e3,
        "idle_fraction": max(0.0, 1.0 - busy_us / wall_us),
        "top_kernels": [{"name": name[:160], "part": kernel_part(name), "ms_per_step": us / count / 1e3,
                         "calls_per_step": calls / count} for name, us, calls in rows[:25]],
        "optimizer_kernels": [{"name": name[:160], "ms_per_step": us / count / 1e3, "calls_per_step": calls / count}
                              for name, us, calls in rows if kernel_part(name) == "optimizer"],
    }


# ---- the report ------------------------------------------------------------------------------
def median_round(stack_runs: list[dict]) -> dict:
    """A stack's rounds as one result: the round of median tokens/s (the lower middle of an even
    count), with every round's tokens/s in run order and the last round's profile."""
    chosen = dict(sorted(stack_runs, key=lambda r: r["tokens_per_s"])[(len(stack_runs) - 1) // 2])
    chosen["tokens_per_s_by_round"] = [r["tokens_per_s"] for r in stack_runs]
    if "profile" in stack_runs[-1]:
        chosen["profile"] = stack_runs[-1]["profile"]
    return chosen


def comparison(results: dict) -> dict:
    """Each packed stack against the reference: speed ratio and how much smaller its state is."""
    reference = results.get("reference")
    out = {}
    for name, r in results.items():
        if name == "reference" or reference is None:
            continue
        saved = reference["training_state_bytes"] - r["training_state_bytes"]
        entry = {
            "tokens_per_s_ratio": r["tokens_per_s"] / reference["tokens_per_s"],
            "tokens_per_s_ratio_by_round": [a / b for a, b in zip(r["tokens_per_s_by_round"],
                                                                  reference["tokens_per_s_by_round"])],
            "no_slower": r["tokens_per_s"] >= reference["tokens_per_s"],
            "training_state_bytes_saved": saved,
            "training_state_smaller_fraction": saved / reference["training_state_bytes"],
            "smaller_state": saved > 0,
        }
        if "peak_memory_bytes" in r:
            entry["peak_memory_ratio"] = r["peak_memory_bytes"] / reference["peak_memory_bytes"]
        out[name] = entry
    return out


def render(meta: dict, results: dict, compared: dict) -> str:
    n = meta["parameters"]
    peak = meta["peak_flops_per_s"]
    peak_text = "no known peak for this device" if peak is None else f"{peak / 1e12:,.0f} TFLOP/s (dense bf16)"
    graphs_note = (" Graphs: compiled by the first step / in all (equal: no recompilation after the first batch)."
                   if meta["compile"] else "")
    lines = [f"# The {meta['preset']} stack: bf16 + PackedMuonAdamW against FP32 + torch.optim.Muon + fused AdamW", "",
             f"- Date: {meta['date']}; device: {meta['device_name']}; Python {meta['python']}; torch {meta['torch']}, "
             f"triton {meta['triton']}.",
             f"- Command: `{meta['command']}`",
             f"- Model: {meta['preset']} ({n:,} parameters, vocabulary {meta['vocab_size']:,}, context "
             f"{meta['context']}); batch {meta['batch']} x {meta['context']} = {meta['tokens_per_step']:,} tokens per "
             f"step; {meta['warmup']} warmup steps, then {meta['steps']} timed"
             + (f", in {meta['rounds']} alternating rounds (a row: the stack's round of median tokens/s)"
                if meta["rounds"] > 1 else "") + "; torch.compile: "
             f"{meta['compile'] or 'off'}.",
             "- Training state = parameters + optimizer state (moments, momentum, masters' low halves, step "
             "counters), measured from the tensors' storages; gradients apart.",
             f"- MFU: tokens/s x {meta['flops_per_token']:,} FLOPs per token (nanochat's estimate, the sliding "
             f"windows as they are) / {peak_text}.{graphs_note}", "",
             "| stack | weights | optimizer | tokens/s | MFU | ms/step | optimizer ms | peak GiB | peak B/param "
             "| state B/param | params B/param | opt. state B/param | grads B/param | loss first -> last |"
             + (" graphs |" if meta["compile"] else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if meta["compile"] else "")]
    for r in results.values():
        peak = r.get("peak_memory_bytes")
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        graphs = f" {r['compiled_graphs_after_first_step']} / {r['compiled_graphs']} |" if meta["compile"] else ""
        lines.append(
            f"| {r['stack']} | {r['weights']} | {r['optimizer']} | {r['tokens_per_s']:,.0f} | {mfu} "
            f"| {r['ms_per_step']:.2f} "
            f"| {r['optimizer_ms_median']:.2f} | {'-' if peak is None else f'{peak / GIB:.2f}'} "
            f"| {'-' if peak is None else f'{peak / n:.2f}'} | {r['training_state_bytes_per_param']:.3f} "
            f"| {r['parameter_bytes'] / n:.3f} | {r['optimizer_state_bytes'] / n:.3f} | {r['gradient_bytes'] / n:.3f} "
            f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |{graphs}")
    if compared:
        lines.append("")
    for name, c in compared.items():
        peak = f"; peak memory {c['peak_memory_ratio']:.2f}x" if "peak_memory_ratio" in c else ""
        by_round = c["tokens_per_s_ratio_by_round"]
        rounds = (f", round by round {', '.join(f'{x:.3f}x' for x in by_round)}" if len(by_round) > 1 else "")
        lines.append(f"- {name} vs reference: tokens/s {c['tokens_per_s_ratio']:.3f}x{rounds} "
                     f"({'no slower' if c['no_slower'] else 'SLOWER'}); training state "
                     f"{100 * c['training_state_smaller_fraction']:.1f}% smaller "
                     f"({c['training_state_bytes_saved'] / GIB:.3f} GiB, "
                     f"{c['training_state_bytes_saved'] / n:.3f} B/param less){peak}.")
    for r in results.values():
        if "profile" not in r:
            continue
        prof = r["profile"]
        parts = ", ".join(f"{part} {ms:.2f}" for part, ms in prof["device_ms_per_step"].items())
        after = "the last round's timed ones" if meta["rounds"] > 1 else "the timed ones"
        lines += ["", f"- {r['stack']}, profiled ({prof['steps']} steps after {after}, torch.profiler): "
                  f"{prof['wall_ms_per_step']:.2f} ms/step wall, {prof['busy_ms_per_step']:.2f} ms of kernels "
                  f"({100 * prof['idle_fraction']:.1f}% of the wall time no kernel ran); kernel ms/step by part: "
                  f"{parts}.", "", "  | kernel | part | ms/step | calls/step |", "  |---|---|---|---|"]
        lines += [f"  | `{k['name'][:90]}` | {k['part']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} |"
                  for k in prof["top_kernels"][:15]]
        optimizer = prof.get("optimizer_kernels", [])
        if optimizer:
            listed = "; ".join(f"`{k['name'][:60]}` {k['ms_per_step']:.3f} ms ({k['calls_per_step']:g} calls)"
                               for k in optimizer)
            lines += ["", f"  The optimizer part, every kernel: {listed}."]
    not_learning = [r["stack"] for r in results.values() if not r["loss_decreased"]]
    if not_learning:
        lines.append(f"- WARNING: the loss did not decrease for {', '.join(not_learning)}.")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="d12", choices=sorted(PRESETS))
    parser.add_argument("--vocab", type=int, help="override the preset's vocabulary (tests: a tiny model)")
    parser.add_argument("--context", type=int, help="override the preset's context (row length)")
    parser.add_argument("--d-model", type=int, help="override the preset's width (tests: a tiny model)")
    parser.add_argument("--n-layers", type=int, help="override the preset's depth (tests: a tiny model)")
    parser.add_argument("--batch", type=int, default=16,
                        help="rows per step (default 16: 32,768 tokens of d12, well inside an H200's memory "
                             "for the FP32 reference, whose activations and logits dominate its peak)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, state allocation)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the stacks this many times, alternating, each a fresh build (the ratio's spread)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run, no memory)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, choices=COMPILE_BACKENDS,
                        metavar="BACKEND", help="torch.compile every stack's model, once for every document count "
                        "(BACKEND: inductor, the default, or aot_eager / eager: the graphs run eagerly)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-warmup", type=int, default=5, help="the schedule's lr warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay (cosine schedule)")
    parser.add_argument("--mean-document", type=float, default=512.0, help="mean document length in tokens")
    parser.add_argument("--zipf-exponent", type=float, default=1.1)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, profile this many more (torch.profiler): each stack's "
                        "kernel time by part of the step, the host's gaps, the largest kernels")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--json", help="write the measurements as JSON here")
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "profile"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("d12_stack.py: --device cuda but torch sees no CUDA GPU; run it on the GPU, or pass "
                         "--device cpu (with a small --preset) for a smoke run")
    overrides = {k: v for k, v in (("vocab_size", args.vocab), ("context", args.context), ("d_model", args.d_model),
                                   ("n_layers", args.n_layers)) if v is not None}
    try:
        config = dataclasses.replace(PRESETS[args.preset], **overrides)
    except ValueError as error:
        raise SystemExit(f"d12_stack.py: the overrides {overrides} do not make a model of --preset {args.preset}: "
                         f"{error}") from None
    batches = [PackedBatch(*(t.to(device) for t in batch)) for batch in
               synthetic_batches(args.warmup + args.steps, args.batch, config.context, config.vocab_size,
                                 args.seed, args.mean_document, args.zipf_exponent)]
    with torch.device("meta"):  # shapes only
        flops_per_token = chat_flops_per_token(ChatGPT(config), config.context)
    runs = {name: [] for name in args.stacks}
    for round_index in range(args.rounds):
        last = round_index == args.rounds - 1
        for name in args.stacks:
            runs[name].append(run_stack(name, config, batches, args, device, args.profile if last else 0))
            print(json.dumps({k: v for k, v in runs[name][-1].items() if k != "losses"}), flush=True)
    results = {name: median_round(stack_runs) for name, stack_runs in runs.items()}
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or "cpu"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "command": "python " + " ".join(["benchmarks/d12_stack.py", *(sys.argv[1:] if argv is None else argv)]),
            "preset": args.preset, "parameters": next(iter(results.values()))["parameters"],
            "vocab_size": config.vocab_size, "context": config.context, "batch": args.batch,
            "tokens_per_step": args.batch * config.context, "warmup": args.warmup, "steps": args.steps,
            "rounds": args.rounds,
            "compile": args.compile, "flops_per_token": flops_per_token, "peak_flops_per_s": peak_bf16_flops(device),
            "seed": args.seed, "lr_warmup": args.lr_warmup,
            "weight_decay": args.weight_decay, "mean_document": args.mean_document,
            "zipf_exponent": args.zipf_exponent}
    compared = comparison(results)
    report = render(meta, results, compared)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "stacks": results, "comparison": compared}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
