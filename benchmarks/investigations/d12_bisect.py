"""Bisect the d12 stack's gap to its reference (issue 53): run the reference (FP32 weights,
torch.optim.Muon + torch.optim.AdamW) and one variant side by side from the same seed and the
same batches, and say after each step how far apart they are.

    python benchmarks/investigations/d12_bisect.py --data DIR --preset chat-tiny --steps 50 \\
        --variant packed-fp32-states --grads shared

--grads shared: the variant steps with the reference's gradients (cast to its weights' dtype),
so only the optimizer differs; the weights' distance then measures the optimizer's semantics
and its storage alone. --grads own: each runs its own forward and backward (its weights, its
forward's precision), as two training runs do.

The distance printed per parameter kind is ||w_variant - w_ref|| / ||w_ref - w_0|| (the
variant's FP32 masters where its weights are bf16): the share of the reference's movement that
the variant did not reproduce. With the same semantics and exact storage it stays at float32
rounding (about 1e-6 after one step); a semantic difference shows at the first step.

Variants (each one difference from the row above it, so that a jump names its cause):
    reference             the reference again (a control: distances must be 0)
    packed-fp32-states    PackedMuonAdamW, FP32 weights, Muon and AdamW state in fp32 mode,
                          Newton-Schulz on torch's matmuls per matrix (the reference's math)
    packed-triton-ns      the same with the default Newton-Schulz (Triton, batched on CUDA)
    packed-muon-packed    + Muon momentum packed (E5M10)
    packed-storage        + AdamW moments packed: packed storage, FP32 weights
    bf16-fp32-states      bf16 weights + FP32 masters, every state in fp32 mode
    packed-defaults       bf16 weights + masters, packed storage (chat_train's defaults)
Add `+bf16stream` to a bf16 variant to run its forward in the earlier way, everything in bf16
(ChatGPT(stream="param")); without it a bf16 model keeps its residual stream in float32.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from packed_adamw.tokenizer.tape import TapeReader
from packed_adamw.torch.combined import PackedMuonAdamW
from packed_adamw.torch.gpt.chat_model import PRESETS, ChatGPT, chat_parameter_kind
from packed_adamw.torch.gpt.chat_train import evaluate
from packed_adamw.torch.gpt.optimizers import TorchMuonAdamW
from packed_adamw.torch.gpt.packed_data import PackedDocumentLoader
from packed_adamw.torch.gpt.schedules import ScheduleConfig, apply_schedule, build_schedule

VARIANTS = {
    # name: (param dtype, muon mode, adamw mode, ns_impl, batch_ns)
    "reference": None,
    "packed-fp32-states": ("fp32", "fp32", "fp32", "cublas", False),
    "packed-triton-ns": ("fp32", "fp32", "fp32", "auto", None),
    "packed-muon-packed": ("fp32", "packed", "fp32", "auto", None),
    "packed-storage": ("fp32", "packed", "packed", "auto", None),
    "bf16-fp32-states": ("bf16", "fp32", "fp32", "auto", None),
    "packed-defaults": ("bf16", "packed", "packed", "auto", None),
}


def build(preset: str, vocab: int | None, seed: int, device, dtype: str, bf16_stream: bool):
    config = PRESETS[preset]
    if vocab:
        config = dataclasses.replace(config, vocab_size=vocab)
    torch.manual_seed(seed)
    model = ChatGPT(config, stream="param" if bf16_stream else "float32").to(device)
    initial = None
    if dtype == "bf16":
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
    return model, initial


def optimizer_for(model, variant, initial, device, args):
    groups = model.muon_adamw_groups(matrix_lr=args.matrix_lr)
    if variant is None:
        return TorchMuonAdamW(groups, muon={}, adamw={"fused": device.type == "cuda"})
    _, muon_mode, adamw_mode, ns_impl, batch_ns = variant
    biases = {k: v for k, v in (("m_bias", args.m_bias), ("rms_bias", args.rms_bias), ("mu_bias", args.mu_bias)) if v}
    names = {id(p): n for n, p in model.named_parameters()}
    apart = [g for g in groups if g["kind"] == "adamw"
             and {chat_parameter_kind(names[id(p)]) for p in g["params"]} & set(args.fp32_adamw_kinds)]
    opt = PackedMuonAdamW([g for g in groups if all(g is not a for a in apart)], mode=muon_mode, adamw_mode=adamw_mode, ns_impl=ns_impl,
                          batch_ns=batch_ns, **biases)
    if apart:  # an experiment's stand-in for per-group state formats: these groups' AdamW in fp32 mode
        opt = Stepped(opt, PackedMuonAdamW(apart, adamw_mode="fp32"))
    if initial is not None:
        for part in getattr(opt, "parts", [opt]):
            for rule in part.rules.values():
                rule.load_master_weights([initial[names[id(p)]].to(p.device) for g in rule.param_groups
                                          for p in g["params"]])
    return opt


class Stepped:
    """Several optimizers stepped as one (param_groups joined, for apply_schedule)."""

    def __init__(self, *parts):
        self.parts = parts
        self.param_groups = [g for part in parts for g in part.param_groups]

    def step(self):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad(set_to_none)

    def master_weights(self):
        return [m for part in self.parts for m in part.master_weights()]


def masters(model, opt) -> dict[str, torch.Tensor]:
    """Each parameter's FP32 value (the master of a bf16 weight) by name."""
    if isinstance(opt, (PackedMuonAdamW, Stepped)):
        by_id = dict(zip((id(p) for g in opt.param_groups for p in g["params"]), opt.master_weights()))
    else:
        by_id = {}
    return {n: by_id.get(id(p), p).detach().float().cpu().clone() for n, p in model.named_parameters()}


def distances(ref: dict, var: dict, start: dict) -> dict[str, float]:
    moved, apart = {}, {}
    for name in ref:
        kind = chat_parameter_kind(name)
        moved[kind] = moved.get(kind, 0.0) + float((ref[name] - start[name]).double().square().sum())
        apart[kind] = apart.get(kind, 0.0) + float((var[name] - ref[name]).double().square().sum())
    return {k: math.sqrt(apart[k]) / math.sqrt(moved[k]) if moved[k] else math.sqrt(apart[k]) for k in sorted(moved)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--preset", default="chat-tiny")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--schedule-steps", type=int, default=300, help="the schedule's length (a run of this many steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", required=True, help="|".join(VARIANTS) + ", optionally +bf16stream")
    p.add_argument("--grads", choices=("shared", "own"), default="shared")
    p.add_argument("--matrix-lr", type=float, default=0.02)
    p.add_argument("--device", default="cpu")
    p.add_argument("--report", default="1,2,3,5,10,20,50,100,200,300")
    p.add_argument("--eval-at", default="", help="steps at which both models' val bpb is measured, e.g. 100,200,300")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--m-bias", type=int, default=None, help="the variant's AdamW first-moment bias")
    p.add_argument("--rms-bias", type=int, default=None, help="the variant's AdamW RMS bias")
    p.add_argument("--mu-bias", type=int, default=None, help="the variant's Muon momentum bias")
    p.add_argument("--fp32-adamw-kinds", default="", type=lambda t: [k for k in t.split(",") if k],
                   help="parameter kinds (chat_parameter_kind) whose AdamW groups keep fp32-mode moments, e.g. scalar")
    p.add_argument("--solo", action="store_true",
                   help="train the variant alone (no reference beside it, no distances): for val bpb at the --eval-at steps")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per reported step")
    args = p.parse_args(argv)
    name, _, extra = args.variant.partition("+")
    if name not in VARIANTS or extra not in ("", "bf16stream"):
        p.error(f"--variant {args.variant}: one of {', '.join(VARIANTS)}, optionally with +bf16stream")
    variant, bf16_stream = VARIANTS[name], extra == "bf16stream"
    device = torch.device(args.device)
    report = {int(s) for s in args.report.split(",")}
    eval_at = {int(s) for s in args.eval_at.split(",") if s}

    if args.solo and args.grads == "shared":
        p.error("--solo trains the variant on its own gradients: pass --grads own")
    ref_model, _ = build(args.preset, args.vocab_size, args.seed, device, "fp32", False)
    var_model, initial = build(args.preset, args.vocab_size, args.seed, device,
                               variant[0] if variant else "fp32", bf16_stream)
    start = {n: p.detach().float().cpu().clone() for n, p in ref_model.named_parameters()}
    ref_opt = optimizer_for(ref_model, None, None, device, args)
    var_opt = optimizer_for(var_model, variant, initial, device, args)
    schedule = build_schedule(ScheduleConfig(num_steps=args.schedule_steps, warmup_steps=40, warmdown_ratio=0.65,
                                             momentum_warmup_steps=400, weight_decay=0.28))
    tape = TapeReader(args.data / "train.tape", vocab_size=ref_model.config.vocab_size)
    val_tape = TapeReader(args.data / "val.tape", vocab_size=ref_model.config.vocab_size)
    loader = PackedDocumentLoader(tape, args.batch, args.context)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    ref_params = dict(ref_model.named_parameters())
    started = time.time()
    for step in range(args.steps):
        apply_schedule(ref_opt, schedule, step)
        apply_schedule(var_opt, schedule, step)
        batch = loader.next_batch()
        x, y, cu = (t.to(device) for t in (batch.inputs, batch.targets, batch.cu_seqlens))
        if args.solo:
            ref_loss = torch.zeros(())
        else:
            with autocast:
                _, ref_loss = ref_model(x, y, cu_seqlens=cu)
            ref_loss.backward()
        if args.grads == "shared":
            var_loss = ref_loss
            for n, q in var_model.named_parameters():
                q.grad = ref_params[n].grad.to(q.dtype).clone()
        else:
            with (autocast if not variant or variant[0] == "fp32" else torch.autocast("cpu", enabled=False)):
                _, var_loss = var_model(x, y, cu_seqlens=cu)
            var_loss.backward()
        if not args.solo:
            ref_opt.step()
        var_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        var_opt.zero_grad(set_to_none=True)
        if step + 1 in report or step + 1 == args.steps or step + 1 in eval_at:
            d = None if args.solo else distances(masters(ref_model, ref_opt), masters(var_model, var_opt), start)
            biases = "".join(f" {k}={v}" for k, v in (("m_bias", args.m_bias), ("rms_bias", args.rms_bias),
                                                         ("mu_bias", args.mu_bias)) if v)
            biases += f" fp32-adamw={','.join(args.fp32_adamw_kinds)}" if args.fp32_adamw_kinds else ""
            record = {"variant": args.variant + biases, "grads": args.grads, "seed": args.seed, "step": step + 1,
                      "ref_loss": float(ref_loss.detach()), "var_loss": float(var_loss.detach()), "distance": d,
                      "seconds": round(time.time() - started, 1)}
            if step + 1 in eval_at:
                evaluated = [("var", var_model, variant[0] if variant else "fp32")]
                if not args.solo:
                    evaluated.insert(0, ("ref", ref_model, "fp32"))
                for key, model, dtype in evaluated:
                    record[f"{key}_val_bpb"] = evaluate(model, val_tape, args.batch, args.context, args.eval_batches,
                                                        dtype, device)["val_bpb"]
            print(json.dumps(record), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
