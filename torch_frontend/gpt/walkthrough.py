"""A walkthrough of one training step of a chat-family model, from a saved training state.

    python -m packed_adamw.torch.gpt.walkthrough STATE_FILE [--device cpu|cuda] [--matrix NAME]

It reloads `STATE_FILE` (a state_stepNNNNNN.safetensors, training_state.py), takes the saved
next batch, and spells out with plain tensor operations (no call into the model's modules):

1. the last layer's forward: from the stream entering it (the model's own, hooked) through
   the residual scalars, the norm, q/k/v, QK-norm, rotary positions, attention over the packed
   documents, the output projection, the MLP (ReLU^2), then the final norm, head, soft cap and
   loss;
2. its backward by hand (the chain rule in plain operations, in float64) down to the gradients
   of that layer's matrices;
3. one Muon step on one matrix (default: the last block's MLP up-projection): the E5M10
   momentum decoded bit by bit and scaled by the matrix's power-of-two exponent, the momentum
   update and Nesterov (the contract's fused lerp), Newton-Schulz, the learning-rate adjustment,
   weight decay, the update of the FP32 master (joined from w and the mantissa), the new
   exponent chosen from max |m'|, the new momentum encoded under it and the new master split.

Every stage is printed (shape, dtype, a few values, norm) and checked against what the model,
autograd and the optimizer compute (the optimizer steps a copy rebuilt from the file):

- bit for bit where the operations are the same on the same device: every forward stage
  against the model's hooked tensors (the rotation against what the model's chat_model.rotate
  returned), the schedule row against the one the saved ScheduleConfig gives, every Muon stage
  against the contract's numpy phases (core/muon) and the optimizer's step;
- within a stated tolerance where they cannot be: the explicit formulas beside the torch
  operations the model calls (rms_norm, softmax attention, cross-entropy: other reduction
  orders), and the hand backward against autograd (other summation orders; against the
  model's own low-precision backward, its roundings).

The forward is the model's: FP32 weights in FP32 (chat_train on the CPU); bf16 weights with the
residual stream, norms and logits in float32 and the matmuls and attention in bf16, as the
model's own autocast runs them (chat_model.py, "Precision"), spelled out here with explicit
casts. FP32 weights on CUDA, which chat_train runs under bf16 autocast, are refused. Before any forward
the arguments are checked against the state (--matrix among its Muon matrices, --rows within
its batch) and so is the state: a finished run's final state has no next step (walk through a
mid-run one: chat_train --save-every K or --stop-at STEP), and NaN or Inf in a weight, master or
momentum is named with its tensor. Exits 1 if any check fails, 2 if an argument or the state
cannot be used. docs/D12.md, "Walkthrough", says what it prints.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import re
import sys
import warnings

import torch
import torch.nn.functional as F

from .._persistence import GROUP_FORMAT_KEY
from ..combined import PackedMuonAdamW
from . import chat_model
from .attention import _varlen_window_options, attention_mask, uses_varlen, varlen_attn
from .chat_model import PRESETS, QK_GAIN, SMEAR_CHANNELS, VALUE_GATE_CHANNELS, ChatConfig, ChatGPT
from .chat_train import PARAM_DTYPES, forward_context
from .packed_data import PackedBatch
from .schedules import ScheduleTables
from .training_state import (
    TrainingStateError, _optimizer_state_dict, check_finite, load_optimizer_state, param_group_from_json,
    read_state,
)
from .walkthrough_muon import muon_step
from .walkthrough_report import Report, Restored

FLOAT64 = torch.float64
# The hand backward (float64) against autograd of the same model in float64: only the order of
# the sums in the matrix products and reductions differs, ~1e-15 relative per operation.
FLOAT64_TOLERANCE = 1e-9
# The hand backward (float64) against the model's own autograd in its dtype: the model's
# backward rounds every intermediate to that dtype (bf16: 8 significant bits), through ~20
# operations and the reductions of the weight gradients. Relative Frobenius norm of the
# difference; measured on the tests' tiny model over five seeds: bf16 0.0075 to 0.024, float32 ~1.3e-6.
MODEL_DTYPE_TOLERANCE = {torch.bfloat16: 0.08, torch.float16: 0.02, torch.float32: 1e-4, torch.float64: 1e-9}


def explicit_tolerance(dtype: torch.dtype) -> float:
    """An explicit formula against the torch operation the model calls (rms_norm, attention,
    cross-entropy), relative Frobenius: the same mathematics with sums in another order (fused
    or blockwise kernels; errors of a few ulps times the depth of the sums, which torch keeps
    logarithmic), and in bf16/fp16 the kernel's own intermediate roundings."""
    return (16 if dtype in (torch.bfloat16, torch.float16) else 256) * torch.finfo(dtype).eps


# ---- the run's configuration ------------------------------------------------------------------
def model_config_of(run_config: dict) -> ChatConfig:
    """The ChatConfig of the run that wrote a state, from the state's "config" (the trainer's).

    The convention (the one place to adapt when the trainer records it otherwise):
    `run_config["model"]` is a chat preset name ("d12"), or a dict: {"preset": name, **field
    overrides}, or every ChatConfig field (as `run_identity.trajectory` records a model)."""
    model = run_config.get("model") if isinstance(run_config, dict) else None
    if isinstance(model, str):
        model = {"preset": model}
    if not isinstance(model, dict):
        raise TrainingStateError(f"the state's config has no 'model' entry naming a chat preset (got {model!r}); "
                                 f"the walkthrough rebuilds the model from it: one of {sorted(PRESETS)}, or a dict "
                                 "{'preset': name, **overrides}")
    fields = dict(model)
    preset = fields.pop("preset", None)
    if preset is not None and preset not in PRESETS:
        raise TrainingStateError(f"the state's config names model preset {preset!r}, not a chat preset; the "
                                 f"walkthrough knows the chat family: {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ChatConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TrainingStateError(f"the state's model config has fields {unknown} that ChatConfig lacks; is it a "
                                 "chat-family run?")
    return dataclasses.replace(PRESETS[preset], **fields) if preset else ChatConfig(**fields)


# ---- restoring a state ------------------------------------------------------------------------
class ArgumentError(ValueError):
    """An argument (--matrix, --rows) that the state does not offer."""


def check_forward_precision(path, run_config: dict, tensors: dict, device: torch.device) -> None:
    """The walkthrough spells out the forward in the weights' dtype, as chat_train runs it on the
    CPU and for bf16 weights; chat_train runs FP32 weights under bf16 autocast on CUDA
    (chat_train.forward_context), which it does not spell out: refused. (The run's config does
    not record the device it trained on: the walkthrough shows the step chat_train takes on the
    walkthrough's device.)"""
    names = {dtype: name for name, dtype in PARAM_DTYPES.items()}
    embedding = tensors.get("params/tok_emb.weight/w")
    param_dtype = run_config.get("param_dtype") or (names.get(embedding.dtype) if embedding is not None else None)
    with warnings.catch_warnings():  # asked only which context; without CUDA, torch warns it would disable it
        warnings.simplefilter("ignore")
        autocast = isinstance(forward_context(param_dtype, device), torch.autocast)
    if autocast:
        raise TrainingStateError(f"{path} holds {param_dtype} weights, which chat_train runs under bf16 autocast on "
                                 f"{device.type}; the walkthrough spells out the forward without autocast: pass "
                                 "--device cpu (where chat_train runs FP32 weights in FP32)")


def first_rows(batch: PackedBatch, rows: int | None) -> PackedBatch:
    """The batch's first `rows` rows (whole documents: every row starts one); None: all."""
    B, T = batch.inputs.shape
    if rows is None or rows == B:
        return batch
    if not 1 <= rows <= B:
        raise ArgumentError(f"--rows {rows}: the saved batch has {B} rows; pass 1 to {B}")
    cu = batch.cu_seqlens
    return PackedBatch(batch.inputs[:rows], batch.targets[:rows], cu[cu <= rows * T].contiguous())


def check_next_step(path, schedule: ScheduleTables, t_step: int) -> None:
    """The step the walkthrough spells out reads schedule row `t_step`: the final state of a
    finished run has none."""
    if not 0 <= t_step < len(schedule):
        raise TrainingStateError(f"{path} is at t_step {t_step}, past its schedule's {len(schedule)} steps: the state "
                                 "of a finished run has no next step to walk through; use a mid-run state, written "
                                 "with chat_train --save-every K (a state every K steps) or --stop-at STEP (the run "
                                 "ends after STEP with its state, and resumes from it later)")


def restore(path, device: str = "cpu", rows: int | None = None, matrix: str | None = None) -> Restored:
    """The model (each parameter's saved dtype and bits) and a PackedMuonAdamW over it with the
    saved groups and state, from a state file; nothing of the trainer is needed. `rows`: keep
    the saved batch's first rows only; `matrix`: the Muon matrix to step (resolve_matrix).

    Checked from the file before the model is built: the arguments (ArgumentError), then the
    state (TrainingStateError): its optimizer, its next step's schedule row, finite weights,
    masters and momenta (naming the tensors), the forward's precision on `device`."""
    tensors, metadata = read_state(path)
    run_config = metadata["config"]
    config = model_config_of(run_config)
    saved_optimizer = metadata["optimizer"]
    if saved_optimizer["class"] != PackedMuonAdamW.__name__:
        raise TrainingStateError(f"{path} was written with a {saved_optimizer['class']}; the walkthrough steps "
                                 "Muon: pass a state of a run with PackedMuonAdamW")
    muon_names = [n for g in saved_optimizer["param_groups"] if g.get("kind") == "muon" for n in g["param_names"]]
    matrix = resolve_matrix(muon_names, config.n_layers, matrix)
    batch = first_rows(PackedBatch(*(tensors[f"batch/{key}"] for key in PackedBatch._fields)), rows)
    schedule = ScheduleTables.from_tensors(metadata["schedule"], tensors)
    t_step = int(metadata["t_step"])
    check_next_step(path, schedule, t_step)
    check_finite(path, tensors, metadata, "the walkthrough spells out a step from finite weights and momenta: walk "
                 "through an earlier state of the run (one before they became non-finite)")
    device = torch.device(device)
    check_forward_precision(path, run_config, tensors, device)
    with torch.device(device):
        model = ChatGPT(config)
    missing = []
    for name, p in model.named_parameters():
        saved = tensors.get(f"params/{name}/w")
        if saved is None or saved.shape != p.shape:
            missing.append(f"{name} {tuple(p.shape)}: " + ("not in the state" if saved is None else
                                                            f"saved {tuple(saved.shape)}"))
            continue
        p.data = saved.to(device, copy=True)  # the saved dtype too (bf16 weights stay bf16)
    if missing:
        raise TrainingStateError(f"{path} does not hold the model its config names ({config}):\n  " +
                                 "\n  ".join(missing))
    named = dict(model.named_parameters())
    groups = []
    for group in map(param_group_from_json, saved_optimizer["param_groups"]):
        options = {k: v for k, v in group.items() if k not in ("params", "param_names", GROUP_FORMAT_KEY)}
        groups.append({"params": [named[n] for n in group["param_names"]], "param_names": group["param_names"],
                       **options})
    formats = saved_optimizer["formats"]
    muon, adamw = formats.get("muon", {}), formats.get("adamw", {})
    # Newton-Schulz with torch's matmuls, one matrix at a time: the step this file spells out
    # (on CUDA the optimizer's default is the Triton kernels, whose summation order is their own).
    optimizer = PackedMuonAdamW(groups, **{k: v for k, v in muon.items() if k in ("mode", "mu_bias")},
                                ns_impl="cublas", batch_ns=False,
                                **({"adamw_mode": adamw["mode"], "m_bias": adamw["m_bias"],
                                    "rms_bias": adamw["rms_bias"]} if adamw else {}))
    load_optimizer_state(path, optimizer, _optimizer_state_dict(tensors, saved_optimizer))
    batch = PackedBatch(*(t.to(device) for t in batch))
    return Restored(config, run_config, model, optimizer, tensors, metadata, batch, schedule, t_step, matrix)


# ---- 1. the last layer's forward --------------------------------------------------------------
class Hooks:
    """The tensors the model computes around its last layer, captured by module hooks."""

    def __init__(self, model: ChatGPT):
        self.seen, self.handles = {}, []
        n = model.config.n_layers
        last = model.blocks[-1]

        def keep(name, value):
            self.seen[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value

        def output_of(name):
            return lambda module, args, out: keep(name, out)

        def input_of(name):
            return lambda module, args: keep(name, args[0])

        if n > 1:
            self.handles.append(model.blocks[-2].register_forward_hook(output_of("stream before the last layer")))
        self.handles.append(model.blocks[n // 2].register_forward_hook(output_of("backout stream")))

        # The rotation is a function (chat_model.rotate), which has no hooks: while the last block
        # runs, a stand-in records what the model's own rotate returns (q's, then k's).
        rotations, model_rotate = [], chat_model.rotate

        def recording_rotate(x, cos, sin):
            out = model_rotate(x, cos, sin)
            rotations.append(out.detach().clone())
            return out

        def block_inputs(module, args):
            for key, value in zip(("block input", "value embedding", "cos", "sin"), args):
                keep(key, value)
            chat_model.rotate = recording_rotate

        def block_output(module, args, out):
            chat_model.rotate = model_rotate
            keep("block output", out)
            if len(rotations) == 2:  # not two: the model rotates otherwise, and the checks say so
                keep("rotated q", rotations[0])
                keep("rotated k", rotations[1])

        self.restore_rotate = lambda: setattr(chat_model, "rotate", model_rotate)
        self.handles.append(last.register_forward_pre_hook(block_inputs))
        self.handles.append(last.register_forward_hook(block_output))
        for name, module in (("q", last.attn.q), ("k", last.attn.k), ("v", last.attn.v),
                             ("value gate logits", last.attn.ve_gate), ("attention output", last.attn.proj),
                             ("mlp fc", last.mlp.fc), ("mlp proj", last.mlp.proj), ("head", model.lm_head)):
            if module is not None:
                self.handles.append(module.register_forward_hook(output_of(name)))
        self.handles.append(last.attn.proj.register_forward_pre_hook(input_of("attention (heads joined)")))
        self.handles.append(last.mlp.proj.register_forward_pre_hook(input_of("relu^2")))

    def remove(self):
        self.restore_rotate()  # also when the forward raised inside the last block
        for handle in self.handles:
            handle.remove()


def run_model(model: ChatGPT, batch: PackedBatch) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The model's forward on the batch with hooks: (captured tensors, logits, loss)."""
    hooks = Hooks(model)
    try:
        logits, loss = model(batch.inputs, batch.targets, cu_seqlens=batch.cu_seqlens)
    finally:
        hooks.remove()
    return hooks.seen, logits, loss


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch computes a reduced-precision tensor's reductions in."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def rms_norm(x: torch.Tensor, report: Report, stage: str) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), spelled out (in the op-math dtype, eps of that dtype, one rounding
    at the end, as torch's CPU kernel computes it) and checked against torch's F.rms_norm, the op
    the model calls, whose result is returned (a fused kernel may sum the squares in another order)."""
    wide = x.to(opmath(x.dtype))
    explicit = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + torch.finfo(wide.dtype).eps)).to(x.dtype)
    library = F.rms_norm(x, (x.size(-1),))
    # A tolerance check even where the bits agree here (it says so): another kernel may sum the
    # squares in another order, so equal bits are not what the formula promises.
    report.within(f"{stage} (explicit rms_norm)", explicit, library, explicit_tolerance(x.dtype),
                  "torch's rms_norm", "its kernel may sum the squares in another order")
    return library


def block_diagonal_mask(cu_seqlens: torch.Tensor, batch: int, seq_len: int, window: int | None,
                        device) -> torch.Tensor:
    """(batch, 1, T, T), True where query t may see key s: s <= t, the same document, and (with
    a window) t - s <= window."""
    token = torch.arange(batch * seq_len, device=device)
    document = (token[:, None] >= cu_seqlens.to(device).long()[None, 1:]).sum(-1).view(batch, seq_len)
    t = torch.arange(seq_len, device=device)
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed = allowed & (t[:, None] - t[None, :] <= window)
    return (allowed & (document[:, :, None] == document[:, None, :]))[:, None]


def attention(q, k, v, cu_seqlens, window, report: Report) -> torch.Tensor:
    """Causal attention within the packed documents: the kernel the model uses (varlen_attn on
    CUDA in bf16/fp16, else scaled_dot_product_attention with the block-diagonal mask), and
    beside it the explicit softmax((q k^T) / sqrt(D) + mask) v, checked within tolerance."""
    B, T, H, D = q.shape
    window = None if window is not None and window >= T - 1 else window  # as attention.py: plain causal
    mask = block_diagonal_mask(cu_seqlens, B, T, window, q.device)
    report.show("block-diagonal causal mask", mask)
    report.bitwise("attention mask", mask, attention_mask(cu_seqlens, B, T, window, q.device),
                   "attention.py's attention_mask")
    if uses_varlen(q, window):
        out = varlen_attn(q.reshape(B * T, H, D), k.reshape(B * T, H, D), v.reshape(B * T, H, D), cu_seqlens,
                          cu_seqlens, T, T, **_varlen_window_options(window)).view(B, T, H, D)
    else:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    wide, explicit = opmath(q.dtype), torch.empty_like(out)
    for b in range(B):  # a row at a time: the T x T scores of one row's heads
        qb, kb, vb = (t[b].transpose(0, 1).to(wide) for t in (q, k, v))  # (H, T, D)
        scores = (qb @ kb.transpose(-1, -2)) / math.sqrt(D)
        probabilities = torch.softmax(scores.masked_fill(~mask[b], float("-inf")), dim=-1)
        explicit[b] = (probabilities @ vb).transpose(0, 1).to(q.dtype)
    report.within("attention (explicit softmax)", explicit, out, explicit_tolerance(q.dtype),
                  "the attention kernel", "it sums the softmax blockwise (online), and in bf16 rounds the "
                  "probabilities before P @ V")
    return out


def rotate(x, cos, sin):
    """Rotary positions, spelled out: channel i pairs with i + D/2 and turns by its angle
    (checked bit for bit against the model's chat_model.rotate, recorded by Hooks)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def autocast_dtype(op, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype `op` of a `dtype` tensor returns under torch.autocast(device, dtype): autocast's
    op lists differ by device and torch version (pow: float32 on CUDA, kept on CPU)."""
    with torch.autocast(device.type, dtype=dtype):
        return op(torch.ones(2, device=device, dtype=dtype)).dtype


@torch.no_grad()
def spelled_forward(model: ChatGPT, batch: PackedBatch, seen: dict, logits: torch.Tensor, loss: torch.Tensor,
                    report: Report) -> dict:
    """The last layer and the head in plain operations on the model's weights, each stage
    checked bit for bit against the model's (`seen`, `logits`, `loss`); returns the activations
    the backward needs."""
    config, (B, T) = model.config, batch.inputs.shape
    H, D, L = config.n_heads, config.head_dim, config.n_layers - 1
    block, idx, cu = model.blocks[L], batch.inputs, batch.cu_seqlens
    # The parameters themselves, not detached copies: torch's matmul folds a 3-D input into one
    # GEMM or not depending on whether the weight requires grad, so a detached weight can take
    # another path, with other bits (seen on the CPU for the smear gate's strided input).
    W = dict(model.named_parameters())
    prefix = f"blocks.{L}."
    a = {}
    # What the model's autocast does (chat_model.py, "Precision"): bf16 weights keep the stream in
    # float32 and take bf16 inputs in every matmul and in attention; other models compute in
    # their weights' dtype.
    weights = model.tok_emb.weight.dtype
    mixed = model.stream == "float32" and weights in (torch.bfloat16, torch.float16)
    matmul = weights if mixed else None
    stream = chat_model.widened if model.stream == "float32" else (lambda t: t)

    def linear(x, w):
        """x W^T with autocast's casts (a weight already in the matmul dtype is the parameter itself)."""
        return x @ w.T if matmul is None else x.to(matmul) @ w.to(matmul).T

    if mixed:
        report.say(f"  mixed precision: the stream in float32, matmuls and attention in {weights}")
    report.say(f"  embedding and smear (x0, which every layer mixes in; the stream itself is the model's)")
    x = rms_norm(stream(W["tok_emb.weight"][idx]), report, "x0")
    token = torch.arange(B * T, device=idx.device)
    start = cu.long()[(token[:, None] >= cu.long()[None, 1:]).sum(-1)]
    position = (token - start).view(B, T)
    gate = stream(W["smear_lambda"]) * torch.sigmoid(linear(x[:, 1:, :SMEAR_CHANNELS], W["smear_gate.weight"]))
    previous = x[:, :-1].masked_fill((position[:, 1:] == 0).unsqueeze(-1), 0.0)
    a["x0"] = x0 = torch.cat([x[:, :1], x[:, 1:] + gate * previous], dim=1)
    report.show("x0", x0)

    report.say(f"  layer {L} (the last) of {config.n_layers}")
    a["x_prev"] = x_prev = seen["stream before the last layer"] if L > 0 else x0
    report.show("stream entering (hooked)", x_prev)
    x_in = stream(W["resid_lambdas"][L]) * x_prev + stream(W["x0_lambdas"][L]) * x0
    report.say(f"    residual scalars: x = {W['resid_lambdas'][L].item():.6g} * x + "
               f"{W['x0_lambdas'][L].item():.6g} * x0")
    report.show("block input", x_in)
    report.bitwise("block input", x_in, seen["block input"], "the model's (hooked)")
    a["x_in"] = x_in

    cos = model.rope_cos[position].to(x_in.dtype).unsqueeze(-2)
    sin = model.rope_sin[position].to(x_in.dtype).unsqueeze(-2)
    report.show("rotary cos (by document)", cos)
    report.bitwise("rotary cos", cos, seen["cos"], "the model's")
    report.bitwise("rotary sin", sin, seen["sin"], "the model's")
    a["cos"], a["sin"] = cos, sin

    a["x_n"] = x_n = rms_norm(x_in, report, "attention norm")
    report.show("rms_norm(x)", x_n)
    for name in ("q", "k", "v"):
        a[f"{name}_lin"] = out = linear(x_n, W[f"{prefix}attn.{name}.weight"])
        report.show(f"{name} = x W{name}^T", out)
        report.bitwise(name, out, seen[name], f"the model's attn.{name}")
    q, k, v = (a[f"{name}_lin"].view(B, T, H, D) for name in ("q", "k", "v"))
    if block.attn.ve_gate is not None:
        a["ve"] = ve = stream(W[f"value_embeds.{L}.weight"][idx])
        report.bitwise("value embedding", ve, seen["value embedding"], "the model's")
        a["gate_logits"] = gate_logits = linear(x_n[..., :VALUE_GATE_CHANNELS], W[f"{prefix}attn.ve_gate.weight"])
        report.bitwise("value gate logits", gate_logits, seen["value gate logits"], "the model's attn.ve_gate")
        gate = 3 * torch.sigmoid(gate_logits)
        report.show("value gate 3 sigmoid(.)", gate)
        v = v + gate.unsqueeze(-1) * ve.view(B, T, H, D)
    a["v"] = v
    a["q_rot"], a["k_rot"] = q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
    report.show("q rotated: (q1 cos - q2 sin, q1 sin + q2 cos)", q_rot)
    report.bitwise("rotated q", q_rot, seen.get("rotated q", torch.empty(0)), "the model's chat_model.rotate")
    report.bitwise("rotated k", k_rot, seen.get("rotated k", torch.empty(0)), "the model's chat_model.rotate")
    q = rms_norm(q_rot, report, "QK-norm (q)") * QK_GAIN
    k = rms_norm(k_rot, report, "QK-norm (k)") * QK_GAIN
    a["q"], a["k"] = q, k
    report.show(f"q: RoPE, rms_norm, * {QK_GAIN}", q)
    report.show(f"k: RoPE, rms_norm, * {QK_GAIN}", k)
    if mixed:  # autocast casts attention's inputs (attention.py does it for varlen_attn)
        q, k, v = (t.to(matmul) for t in (q, k, v))
    y = attention(q, k, v, cu, config.layer_windows()[L], report)
    a["y"] = y = y.reshape(B, T, -1)
    report.show("attention (heads joined)", y)
    report.bitwise("attention", y, seen["attention (heads joined)"], "the model's")
    attn_out = linear(y, W[f"{prefix}attn.proj.weight"])
    report.show("output projection", attn_out)
    report.bitwise("output projection", attn_out, seen["attention output"], "the model's attn.proj")
    a["x1"] = x1 = x_in + attn_out
    report.show("x + attention", x1)

    a["u"] = u = rms_norm(x1, report, "MLP norm")
    a["fc"] = fc = linear(u, W[f"{prefix}mlp.fc.weight"])
    report.show("MLP up: u Wfc^T", fc)
    report.bitwise("MLP up", fc, seen["mlp fc"], "the model's mlp.fc")
    # square() is a pow, which CUDA's autocast runs in float32 (CPU's keeps bf16): the dtype is
    # asked of autocast on this device rather than assumed, so the spelled stage has the model's.
    squared_in = autocast_dtype(lambda t: t.square(), fc.device, matmul) if mixed else fc.dtype
    if squared_in != fc.dtype:
        in_words = str(squared_in).removeprefix("torch.")
        report.say(f"    (relu^2 in {in_words}: autocast runs pow in it on {fc.device.type})")
    a["relu2"] = relu2 = F.relu(fc).to(squared_in).square()
    report.show("relu(.)^2", relu2)
    report.bitwise("relu^2", relu2, seen["relu^2"], "the model's")
    mlp_out = linear(relu2, W[f"{prefix}mlp.proj.weight"])
    report.show("MLP down", mlp_out)
    report.bitwise("MLP down", mlp_out, seen["mlp proj"], "the model's mlp.proj")
    a["x_out"] = x_out = x1 + mlp_out
    report.show("block output", x_out)
    report.bitwise("block output", x_out, seen["block output"], "the model's")

    report.say("  head")
    a["backout_is_last"] = L == config.n_layers // 2
    x_backout = x_out if a["backout_is_last"] else seen["backout stream"]
    a["z"] = z = x_out - stream(W["backout_lambda"]) * x_backout
    report.say(f"    backout: x - {W['backout_lambda'].item():.6g} * (stream after layer {config.n_layers // 2})")
    a["h"] = h = rms_norm(z, report, "final norm")
    report.show("final rms_norm", h)
    raw = linear(h, W["lm_head.weight"])
    report.show("head h Wh^T", raw)
    report.bitwise("head", raw, seen["head"], "the model's lm_head")
    a["raw_logits"] = raw = raw.to(torch.promote_types(raw.dtype, torch.float32))
    cap = config.logit_softcap
    capped = cap * torch.tanh(raw / cap)
    report.show(f"logits {cap:g} tanh(./{cap:g})", capped)
    report.bitwise("logits", capped, logits, "the model's logits")
    a["logits"] = capped
    flat, targets = capped.flatten(0, 1), batch.targets.flatten()
    ours = F.cross_entropy(flat, targets, ignore_index=-1)
    valid = targets != -1
    explicit = (torch.logsumexp(flat[valid], -1) - flat[valid].gather(1, targets[valid, None])[:, 0]).mean()
    report.say(f"    loss = mean(logsumexp(logits) - logits[target]) = {ours.item():.8g} nats over "
               f"{int(valid.sum())} tokens")
    report.within("loss (explicit)", explicit, ours, explicit_tolerance(ours.dtype), "F.cross_entropy",
                  "another summation order")
    report.bitwise("loss", ours, loss.detach(), "the model's loss")
    return a


# ---- 2. the backward, by hand -----------------------------------------------------------------
def rms_norm_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """y = x r with r = (mean(x^2) + eps)^-1/2: dx = r (dy - y mean(dy y))."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)
    y = x * r
    return r * (dy - y * (dy * y).mean(-1, keepdim=True))


def rotate_backward(dy, cos, sin):
    half = dy.size(-1) // 2
    d1, d2 = dy[..., :half], dy[..., half:]
    return torch.cat([d1 * cos + d2 * sin, -d1 * sin + d2 * cos], dim=-1)


def attention_backward(q, k, v, dy, mask):
    """Of y = softmax(q k^T / sqrt(D) masked) v, per row of the batch (bounds the T x T memory):
    dV = P^T dY, dP = dY V^T, dS = P (dP - rowsum(dP P)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D)."""
    D = q.size(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b in range(q.size(0)):
        qb, kb, vb, dyb = (t[b].transpose(0, 1) for t in (q, k, v, dy))  # (H, T, D)
        p = torch.softmax(((qb @ kb.transpose(-1, -2)) / math.sqrt(D)).masked_fill(~mask[b], float("-inf")), -1)
        dp = dyb @ vb.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[b] = ((ds @ kb) / math.sqrt(D)).transpose(0, 1)
        dk[b] = ((ds.transpose(-1, -2) @ qb) / math.sqrt(D)).transpose(0, 1)
        dv[b] = (p.transpose(-1, -2) @ dyb).transpose(0, 1)
    return dq, dk, dv


def hand_backward(model: ChatGPT, batch: PackedBatch, a: dict) -> dict:
    """The chain rule from the mean cross-entropy down to the last layer's matrices, on the
    float64 activations `a` of `spelled_forward`. Returns {parameter name: gradient}."""
    config, (B, T) = model.config, batch.inputs.shape
    H, D, L = config.n_heads, config.head_dim, config.n_layers - 1
    W = {name: p.detach() for name, p in model.named_parameters()}
    prefix, grads = f"blocks.{L}.", {}
    flat2 = lambda t: t.reshape(B * T, -1)  # noqa: E731

    # loss = mean over valid tokens of logsumexp(c) - c[target], c = cap tanh(raw / cap)
    targets = batch.targets.flatten()
    valid = (targets != -1).to(a["logits"].dtype)
    d_capped = torch.softmax(a["logits"].flatten(0, 1), -1)
    d_capped[torch.arange(B * T, device=targets.device), targets.clamp(min=0)] -= 1
    d_capped = d_capped * valid[:, None] / valid.sum()
    d_raw = d_capped * (1 - torch.tanh(a["raw_logits"].flatten(0, 1) / config.logit_softcap).square())
    grads["lm_head.weight"] = d_raw.T @ flat2(a["h"])
    dz = rms_norm_backward(a["z"], (d_raw @ W["lm_head.weight"]).view(B, T, -1))
    dx_out = dz * (1 - W["backout_lambda"]) if a["backout_is_last"] else dz

    # MLP: x_out = x1 + relu(u Wfc^T)^2 Wp^T, u = rms_norm(x1)
    grads[prefix + "mlp.proj.weight"] = flat2(dx_out).T @ flat2(a["relu2"])
    d_fc = (dx_out @ W[prefix + "mlp.proj.weight"]) * 2 * F.relu(a["fc"])
    grads[prefix + "mlp.fc.weight"] = flat2(d_fc).T @ flat2(a["u"])
    dx1 = dx_out + rms_norm_backward(a["x1"], d_fc @ W[prefix + "mlp.fc.weight"])

    # attention: x1 = x_in + y Wproj^T
    grads[prefix + "attn.proj.weight"] = flat2(dx1).T @ flat2(a["y"])
    dy = (dx1 @ W[prefix + "attn.proj.weight"]).view(B, T, H, D)
    window = config.layer_windows()[L]
    window = None if window is not None and window >= T - 1 else window
    mask = block_diagonal_mask(batch.cu_seqlens, B, T, window, dy.device)
    dq, dk, dv = attention_backward(a["q"], a["k"], a["v"], dy, mask)
    dq_lin = rotate_backward(rms_norm_backward(a["q_rot"], QK_GAIN * dq), a["cos"], a["sin"]).reshape(B, T, -1)
    dk_lin = rotate_backward(rms_norm_backward(a["k_rot"], QK_GAIN * dk), a["cos"], a["sin"]).reshape(B, T, -1)
    dv_lin = dv.reshape(B, T, -1)
    dx_n = sum(d @ W[f"{prefix}attn.{name}.weight"] for name, d in (("q", dq_lin), ("k", dk_lin), ("v", dv_lin)))
    for name, d in (("q", dq_lin), ("k", dk_lin), ("v", dv_lin)):
        grads[f"{prefix}attn.{name}.weight"] = flat2(d).T @ flat2(a["x_n"])
    if "ve" in a:  # v += 3 sigmoid(x_n[:12] Wg^T) * ve
        sig = torch.sigmoid(a["gate_logits"])
        d_logits = (dv * a["ve"].view(B, T, H, D)).sum(-1) * 3 * sig * (1 - sig)
        grads[prefix + "attn.ve_gate.weight"] = flat2(d_logits).T @ flat2(a["x_n"][..., :VALUE_GATE_CHANNELS])
        dx_n = torch.cat([dx_n[..., :VALUE_GATE_CHANNELS] + d_logits @ W[prefix + "attn.ve_gate.weight"],
                          dx_n[..., VALUE_GATE_CHANNELS:]], dim=-1)
    grads["the last block's input"] = dx_in = dx1 + rms_norm_backward(a["x_in"], dx_n)
    # the residual scalars: x_in = resid_lambda x_prev + x0_lambda x0. Their gradients are sums
    # over every element of the stream, so an error's natural size is the sum of |terms|.
    for scalar, factor in ((f"resid_lambdas[{L}]", a["x_prev"]), (f"x0_lambdas[{L}]", a["x0"])):
        grads[scalar] = (dx_in * factor).sum()
        grads[scalar + " |terms|"] = (dx_in * factor).abs().sum()
    return grads


def float64_copy(model: ChatGPT, L: int) -> tuple[ChatGPT, dict]:
    """The model with its weights in float64 (exact copies of the saved values); only the last
    layer's parameters and the head take gradients, and the last block's input enters as a leaf
    (same values), so autograd records only that part and gives the gradient of that input too.
    Returns (model, {"leaf": the input leaf once the forward has run})."""
    copied = copy.deepcopy(model)
    for name, p in copied.named_parameters():
        p.data = p.data.to(FLOAT64)
        p.requires_grad_(name.startswith((f"blocks.{L}.", "lm_head.")))
        p.grad = None
    entry = {}

    def as_leaf(module, args):
        entry["leaf"] = args[0].detach().requires_grad_()
        return (entry["leaf"], *args[1:])

    copied.blocks[L].register_forward_pre_hook(as_leaf)
    return copied, entry


def autograd_gradient(model: ChatGPT, name: str) -> torch.Tensor:
    if name.endswith("]"):  # resid_lambdas[L]: one element of a vector
        vector, index = name[:-1].split("[")
        return dict(model.named_parameters())[vector].grad[int(index)]
    return dict(model.named_parameters())[name].grad


def resolve_matrix(muon: list[str], n_layers: int, name: str | None) -> str:
    """A Muon matrix's parameter name (of the names `muon`): a full name, or a part of the last
    block's ("mlp.fc", "attn.q", "q"); default the last block's MLP up-projection."""
    last = f"blocks.{n_layers - 1}."
    name = f"{last}mlp.fc.weight" if name is None else name
    in_order = sorted(muon, key=lambda n: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", n)])
    candidates = [name] if name in muon else [n for n in in_order if n.startswith(last) and
                                                 (n.endswith(f".{name}.weight") or n.endswith(f".{name}"))]
    if len(candidates) == 1:
        return candidates[0]
    parts = ", ".join(n[len(last):].removesuffix(".weight") for n in in_order if n.startswith(last))
    full = f"{in_order[0]}, ..., {in_order[-1]}, {len(muon)} in all" if len(muon) > 2 else ", ".join(in_order)
    found = f"more than one Muon matrix {candidates}" if candidates else "no Muon matrix of the state"
    raise ArgumentError(f"--matrix {name!r} names {found}; give a part of the last block's ({parts}) or a full name "
                        f"of a Muon matrix ({full})")


# ---- the whole walkthrough --------------------------------------------------------------------
def walkthrough(state_path, device: str = "cpu", matrix: str | None = None, rows: int | None = None,
                out=None) -> Report:
    report = Report(out)
    restored = restore(state_path, device, rows, matrix)  # every argument and the state checked: nothing ran yet
    model, batch, config = restored.model, restored.batch, restored.config
    L = config.n_layers - 1
    dtype = model.tok_emb.weight.dtype
    B, T = batch.inputs.shape
    report.say(f"state {state_path}: step {restored.metadata['step']}, t_step {restored.t_step}; model {config}")
    saved_rows = restored.tensors["batch/inputs"].size(0)
    report.say(f"batch: {B} rows x {T} tokens{f' (the first {B} of the saved {saved_rows})' if B < saved_rows else ''}"
               f", {batch.cu_seqlens.numel() - 1} documents; weights {dtype}; device {device}")

    report.say(f"\n1. forward of the last layer ({dtype}; every stage against the model's, bit for bit)")
    seen, logits, loss = run_model(model, batch)
    spelled_forward(model, batch, seen, logits, loss, report)
    loss.backward()  # the model's gradients, as the trainer's backward gives them (chat_train clips none)

    report.say("\n2. backward by hand (float64, on a float64 copy of the same weights)")
    model64, block_input = float64_copy(model, L)
    quiet = Report(out, quiet=True)
    seen64, logits64, loss64 = run_model(model64, batch)
    a64 = spelled_forward(model64, batch, seen64, logits64, loss64, quiet)
    report.failures += quiet.failures
    report.bitwise_passed += quiet.bitwise_passed
    report.tolerance_passed += quiet.tolerance_passed
    report.say(f"  the same forward in float64: {quiet.bitwise_passed} stages bit for bit against the float64 "
               f"model, loss {loss64.item():.10g} (the model's {loss.item():.10g})")
    loss64.backward()
    grads = hand_backward(model64, batch, a64)
    tolerance, rounding = MODEL_DTYPE_TOLERANCE[dtype], f"its backward rounds every intermediate to {dtype}"
    for name, grad in grads.items():
        if name.endswith("|terms|"):
            continue
        report.show(f"dL/d {name}", grad)
        if name == "the last block's input":
            report.within(f"gradient of {name}", grad, block_input["leaf"].grad, FLOAT64_TOLERANCE,
                          "autograd in float64", "other summation orders")
        elif "[" in name:  # a residual scalar: the model's own gradient (the float64 copy records no layer before)
            report.within(f"gradient of {name} ({dtype})", grad, autograd_gradient(model, name), tolerance,
                          f"the model's autograd in {dtype}, relative to the sum of |terms|", rounding,
                          scale=grads[name + " |terms|"].item())
        else:
            report.within(f"gradient of {name}", grad, autograd_gradient(model64, name), FLOAT64_TOLERANCE,
                          "autograd in float64", "other summation orders")
            report.within(f"gradient of {name} ({dtype})", grad, autograd_gradient(model, name), tolerance,
                          f"the model's autograd in {dtype}", rounding)
    del model64, a64

    name = restored.matrix
    report.say(f"\n3. one Muon step on {name} {tuple(dict(model.named_parameters())[name].shape)} "
               "(bit for bit against the contract and the optimizer)")
    muon_step(restored, name, report)

    total = report.bitwise_passed + report.tolerance_passed + len(report.failures)
    report.say(f"\n{total} checks: {report.bitwise_passed} bit for bit, {report.tolerance_passed} within their "
               f"stated tolerance, {len(report.failures)} failed")
    for failure in report.failures:
        print(f"  FAILED {failure}", file=report.out)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.torch.gpt.walkthrough", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state", help="a state_stepNNNNNN.safetensors written by training_state.save_state")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--matrix", default=None, help="the Muon matrix to step: a parameter name, or a part of "
                        "the last block's (mlp.fc, mlp.proj, attn.q, attn.k, attn.v, attn.proj, ve_gate); "
                        "default the last block's MLP up-projection")
    parser.add_argument("--rows", type=int, default=None, help="use the saved batch's first ROWS rows only (default "
                        "all): the float64 copy holds its logits and the layer's activations, so a d12 batch of "
                        "32 x 2048 wants a few rows")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    try:
        report = walkthrough(args.state, args.device, args.matrix, args.rows)
    except (TrainingStateError, ArgumentError) as error:
        print(f"walkthrough: {error}", file=sys.stderr)
        return 2
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
