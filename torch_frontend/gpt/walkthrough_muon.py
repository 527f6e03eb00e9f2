"""The walkthrough's third part (walkthrough.py): one Muon step of the chosen matrix, spelled out
in plain tensor operations (the schedule's row, the momentum's decode with its per-matrix
exponent, Nesterov, Newton-Schulz, the weight update on the FP32 master, the new codes and
exponent), each checked against core's numpy phases and the optimizer's own step."""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from packed_adamw.core.codecs import SPLIT_MASTER_MAX, read_master
from packed_adamw.core.muon import StateFormat as MuonFormat
from packed_adamw.core.muon import step_scalar_row
from packed_adamw.core.muon.float32 import bf16_bits, ldexp32, lerp32
from packed_adamw.core.muon.numpy_step import decode_momentum, matrix_exponent

from ..muon import newton_schulz
from .schedules import BASE_LR_KEY, TABLE_NAMES, apply_schedule, build_schedule
from .training_state import LOW_HALF_KEY

if TYPE_CHECKING:
    from .walkthrough_report import Report, Restored


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (MUON.md's fused multiply-add), in plain operations:
    the product of two float32 numbers is exact in float64; TwoSum recovers the float64 sum's
    rounding error; the sum is rounded to odd (an inexact sum with an even last bit moves one
    float64 ulp toward the exact sum), then to float32: a correct single rounding (53 >= 24 + 2)."""
    a, b, c = a.double(), b.double(), c.double()
    product = a * b
    total = product + c
    c_part = total - product
    error = (product - (total - c_part)) + (c - c_part)
    bits = total.view(torch.int64)
    nudge = torch.isfinite(total) & (error != 0) & ((bits & 1) == 0)
    away = (error > 0) == (total > 0)  # int64 steps move the magnitude: +1 away from zero
    bits = torch.where(nudge, bits + torch.where(away, 1, -1), bits)
    return bits.view(torch.float64).float()


def lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MUON.md's lerp: fma(w, end - start, start) if |w| < 0.5, else fma(w - 1, end - start, end)."""
    difference = end - start
    if abs(weight.item()) < 0.5:
        return fma32(weight, difference, start)
    return fma32(weight - 1, difference, end)


def _uint(t: torch.Tensor, width: int) -> torch.Tensor:
    """A 16- or 32-bit tensor's bit patterns as non-negative int64."""
    return t.contiguous().view({16: torch.int16, 32: torch.int32}[width]).to(torch.int64) & ((1 << width) - 1)


def _signed(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative int64 bit patterns -> the int16/int32 tensor holding them."""
    dtype = {16: torch.int16, 32: torch.int32}[width]
    return torch.where(values >= 1 << (width - 1), values - (1 << width), values).to(dtype)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from its bits (e in [-126, 127])."""
    return _signed((exponent + 127) << 23, 32).view(torch.float32)


def ldexp(x: torch.Tensor, n: int) -> torch.Tensor:
    """x * 2^n in float32 as MUON.md defines it: (x * 2^(n >> 1)) * 2^(n - (n >> 1)), two
    rounded products by powers of two (exact unless the result is subnormal); n in [-252, 254]."""
    half = n >> 1  # floor(n / 2), also for negative n
    return (x * power_of_two(torch.tensor(half))) * power_of_two(torch.tensor(n - half))


def floor_log2(amax: torch.Tensor) -> int:
    """floor(log2 amax) of a finite nonzero float32 magnitude, from its bits: the exponent field
    - 127; for a subnormal (field 0), the position of its top set bit - 149."""
    bits = _uint(amax.reshape(1), 32).item()
    field = bits >> 23
    if field:
        return field - 127
    top = int(((torch.tensor(bits) >> torch.arange(23)) > 0).sum()) - 1  # the highest set bit's position
    return top - 149


def decode_e5m10(codes: torch.Tensor, bias: int) -> torch.Tensor:
    """E5M10 codes -> float32 (MUON.md): sign, 5 exponent bits e, 10 fraction bits f;
    e = 0: f * 2^(1 - bias - 10); else (1024 + f) * 2^(e - bias - 10). Exact products."""
    c = _uint(codes, 16)
    sign, e, f = c >> 15, (c >> 10) & 31, c & 1023
    significand = torch.where(e == 0, f, f + 1024).float()
    magnitude = significand * power_of_two(torch.where(e == 0, 1, e) - bias - 10)
    return torch.where(sign == 1, -magnitude, magnitude)


def encode_e5m10(values: torch.Tensor, bias: int) -> torch.Tensor:
    """float32 -> E5M10 codes (int16 tensor of the uint16 bits): round to nearest, ties to even;
    saturate at the largest code; zero (either sign) and what rounds to zero is code 0."""
    bits = _uint(values, 32)
    sign, magnitude = bits >> 31, bits & 0x7FFFFFFF
    # Normal codes: move float32's exponent to the code's bias, then round away 13 fraction bits
    # (a carry into the exponent is the right next code).
    rebiased = magnitude - ((127 - bias) << 23)
    normal = (rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13
    # Subnormal codes: multiples of 2^(1 - bias - 10); the scaling by a power of two is exact and
    # torch.round rounds half to even (1024 there is the smallest normal code, as it should be).
    subnormal = torch.round(values.abs() * power_of_two(torch.tensor(bias + 9))).to(torch.int64)
    code = torch.where(values.abs() < power_of_two(torch.tensor(1 - bias)), subnormal, normal).clamp(max=0x7FFF)
    return _signed(torch.where(code == 0, 0, code | (sign << 15)), 16)


def join_master(w: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """FORMAT.md's split masters: magnitude = ((w & 0x7FFF) << 16) + int16(lo) mod 2^31, with w's
    sign; a zero weight beside a negative low half reads as that zero (the stale-write rule)."""
    w_bits, low = _uint(w, 16), lo.contiguous().view(torch.int16).to(torch.int64)
    magnitude = (((w_bits & 0x7FFF) << 16) + low) & 0x7FFFFFFF
    master = _signed(((w_bits >> 15) << 31) | magnitude, 32).view(torch.float32)
    stale = ((w_bits & 0x7FFF) == 0) & (low < 0)
    return torch.where(stale, _signed(w_bits << 16, 32).view(torch.float32), master)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 low half): rounded = magnitude + 0x8000 mod 2^31; w = sign | rounded >> 16;
    lo = (rounded & 0xFFFF) ^ 0x8000 (the weight is the master rounded to nearest bf16)."""
    bits = _uint(master, 32)
    rounded = ((bits & 0x7FFFFFFF) + 0x8000) & 0x7FFFFFFF
    w = _signed(((bits >> 31) << 15) | (rounded >> 16), 16).view(torch.bfloat16)
    return w, _signed((rounded & 0xFFFF) ^ 0x8000, 16)


def group_of(optimizer, p) -> dict:
    return next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))


def muon_step(restored: Restored, name: str, report: Report) -> None:
    """One Muon step of matrix `name` spelled out, each stage checked bit for bit against the
    contract's numpy phases (core/muon) and the optimizer's own step (taken here, on the copy
    rebuilt from the file, after the model's backward on the batch)."""
    optimizer, tensors = restored.optimizer, restored.tensors
    p = dict(restored.model.named_parameters())[name]
    fmt: MuonFormat = optimizer.rules[optimizer.rule_key(group_of(optimizer, p))].state_format  # the matrix's rule
    key = fmt.state_key
    rows, cols = p.shape
    device = p.device

    report.say(f"  the schedule: row t_step={restored.t_step} of the saved tables")
    table = restored.schedule.row(restored.t_step)  # restore checked that the row exists
    # The saved row against the row this code computes from the saved ScheduleConfig: the
    # tables are what their config says (a run continues on its saved tables, so a difference
    # means edited tables or changed schedule code).
    recomputed = build_schedule(restored.schedule.config).row(restored.t_step)
    report.bitwise("schedule row", torch.tensor([table[k] for k in TABLE_NAMES], dtype=torch.float64),
                   torch.tensor([recomputed[k] for k in TABLE_NAMES], dtype=torch.float64),
                   "the row schedules.build_schedule computes from the saved ScheduleConfig")
    apply_schedule(optimizer, restored.schedule, restored.t_step)  # what the trainer does before its step
    group = group_of(optimizer, p)
    lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
    # Shown, not checked: apply_schedule's product of the group's base lr and the row.
    report.say(f"    apply_schedule: lr = {BASE_LR_KEY} {group[BASE_LR_KEY]!r} * lr_multiplier "
               f"{table['lr_multiplier']!r} = {lr!r}; momentum {momentum!r}; weight decay {weight_decay!r}")
    nesterov, maximize = bool(group["nesterov"]), bool(group.get("maximize", False))
    ratio = (0.2 * math.sqrt(max(rows, cols)) if group["adjust_lr_fn"] == "match_rms_adamw"
             else math.sqrt(max(1.0, rows / cols)))
    scalars = {  # each in binary64 from the values as given, rounded once to float32 (MUON.md)
        "one_minus_momentum": 1.0 - momentum,
        "momentum": momentum,
        "decay": 1.0 - lr * weight_decay,
        "neg_adjusted_lr": -(lr * ratio),
    }
    scalars = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in scalars.items()}
    report.say(f"    lr adjustment ({group['adjust_lr_fn'] or 'original'}): {rows}x{cols} -> ratio {ratio:.6g}; "
               + ", ".join(f"{k} = {v.item():.9g}" for k, v in scalars.items()))
    contract_row = step_scalar_row((lr, momentum, weight_decay, group["eps"]), p.shape,
                                   adjust_lr_fn=group["adjust_lr_fn"])
    report.bitwise("step scalars", torch.stack(list(scalars.values())).cpu(),
                   torch.from_numpy(np.array(contract_row, np.float32)), "core's step_scalar_row")

    report.say("  the saved state of the matrix")
    entry = optimizer.state.get(p, {})
    stepped = bool(restored.tensors.get(f"params/{name}/opt/{key}") is not None)
    saved_code = tensors[f"params/{name}/opt/{key}"] if stepped else torch.zeros(
        p.shape, dtype=torch.int16 if key != "momentum_buffer" else torch.float32)
    saved_w = tensors[f"params/{name}/w"]
    split = saved_w.dtype == torch.bfloat16
    saved_lo = tensors[f"params/{name}/mantissa"].view(torch.int16) if split else None
    report.show(f"momentum ({fmt.identity})", saved_code)
    exponent_key = fmt.exponent_entry.key if fmt.exponent_entry is not None else None
    if exponent_key is not None:
        # Absent from the file: a matrix never stepped, or a state saved before the exponents
        # (its legacy identity), whose codes read with exponent 0 (MUON.md, "The momentum formats").
        saved_exponent = tensors.get(f"params/{name}/opt/{exponent_key}")
        if saved_exponent is None:
            saved_exponent = torch.tensor(0, dtype=torch.int32)
        report.show(f"exponent s ({exponent_key})", saved_exponent)
    if entry:
        report.bitwise("loaded momentum", entry[key].cpu(), saved_code, "the file's")
        if exponent_key is not None:
            report.bitwise("loaded exponent", entry[exponent_key].cpu(), saved_exponent,
                           "the file's" if f"params/{name}/opt/{exponent_key}" in tensors else
                           "the file's (none there: exponent 0)")
        if split:
            report.bitwise("loaded mantissa", entry[LOW_HALF_KEY].cpu(), saved_lo, "the file's")
    report.bitwise("loaded weight", p.detach().cpu(), saved_w, "the file's")
    code, w_old = saved_code.to(device), saved_w.to(device)

    report.say("  the gradient (the model's backward on the saved batch; the optimizer reads p.grad)")
    grad = p.grad.detach().clone()
    report.show("gradient", grad)
    g = grad.float()  # a bf16 gradient is upcast exactly
    if maximize:
        g = -g

    report.say("  momentum phase")
    s = int(saved_exponent) if fmt.mode == "packed" else 0
    if fmt.mode == "packed":
        m = ldexp(decode_e5m10(code, fmt.mu_bias), s)
        how = f"E5M10 bias {fmt.mu_bias}: sign | 5 exponent | 10 fraction bits, x 2^{s}"
    elif fmt.mode == "bf16":
        m = _signed(_uint(code, 16) << 16, 32).view(torch.float32)
        how = "bf16 bits << 16"
    else:
        m = code
        how = "float32 as stored"
    report.show(f"decoded momentum ({how})", m)
    contract_state = saved_code.numpy().view(np.uint16) if fmt.mode != "fp32" else saved_code.numpy()
    report.bitwise("decoded momentum", m.cpu(), torch.from_numpy(decode_momentum(contract_state, fmt, s)),
                   "core's decode_momentum")
    m_next = lerp(m, g, scalars["one_minus_momentum"])
    report.show("m' = lerp(m, g, 1 - momentum)", m_next)
    report.bitwise("momentum update", m_next.cpu(),
                   torch.from_numpy(lerp32(m.cpu().numpy(), g.cpu().numpy(), np.float32(contract_row[0]))),
                   "core's lerp32")
    x = lerp(g, m_next, scalars["momentum"]) if nesterov else m_next
    report.show("Nesterov: lerp(g, m', momentum)" if nesterov else "no Nesterov: m'", x)
    X = x.bfloat16()
    report.show("Newton-Schulz input (bf16)", X)
    # torch's CPU conversion makes every NaN 0xFFFF, core's 0x7FC0 (either refuses the matrix, below)
    report.bitwise("Newton-Schulz input", torch.where(torch.isnan(X.cpu()), 0x7FC0, X.cpu().view(torch.int16)),
                   torch.from_numpy(bf16_bits(x.cpu().numpy()).view(np.int16)), "core's bf16_bits")
    finite = bool(torch.isfinite(g).all() and torch.isfinite(m_next).all() and torch.isfinite(X).all())
    s_next = s
    if fmt.mode == "packed" and not finite:
        code_next = code  # refused (below): no exponent is chosen from a non-finite max
    elif fmt.mode == "packed":
        amax = m_next.abs().max()
        k = floor_log2(amax)
        # amax lands in the code's exponent field 30, one binade below its top: nothing saturates.
        s_next = s if amax.item() == 0 else k + fmt.mu_bias - 30
        report.say(f"    amax = max |m'| = {amax.item():.9g}: floor(log2 amax) = {k} (from its float32 bits); "
                   f"new exponent s' = " + (f"s = {s} (amax is 0)" if amax.item() == 0 else
                                            f"{k} + bias {fmt.mu_bias} - 30 = {s_next}"))
        report.bitwise("chosen exponent", torch.tensor(s_next, dtype=torch.int32),
                       torch.tensor(matrix_exponent(np.float32(amax.item()), s, fmt), dtype=torch.int32),
                       "core's matrix_exponent")
        scaled = ldexp(m_next, -s_next)
        report.show(f"m' x 2^{-s_next}", scaled)
        code_next = encode_e5m10(scaled, fmt.mu_bias)
        report.bitwise("encoded momentum", code_next.cpu(),
                       torch.from_numpy(fmt.code.encode_unchecked(ldexp32(m_next.cpu().numpy(), -s_next))
                                        .astype(np.uint16).view(np.int16)), "core's E5M10 encoder")
    elif fmt.mode == "bf16":
        code_next = m_next.bfloat16().view(torch.int16)
        finite = finite and bool(torch.isfinite(m_next.bfloat16()).all())
    else:
        code_next = m_next
    report.show("new momentum code", code_next)

    report.say("  Newton-Schulz (quintic, wide orientation, bf16 as torch.optim.Muon)")
    a, b, c = (float(v) for v in group["ns_coefficients"])
    Y = X.T if rows > cols else X
    Y = Y / Y.norm().clamp(min=group["eps"])
    report.show("Y / max(|Y|_F, eps)", Y)
    for _ in range(int(group["ns_steps"])):
        A = Y @ Y.T
        Bm = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A A, rounded once to bf16
        Y = torch.addmm(Y, Bm, Y, beta=a)  # a Y + B Y
    O = Y.T if rows > cols else Y
    report.say(f"    {int(group['ns_steps'])} steps of Y <- {a} Y + ({b} A + {c} A A) Y, A = Y Y^T")
    report.show("O", O)
    report.bitwise("Newton-Schulz output", O.contiguous(), newton_schulz(X, (a, b, c), int(group["ns_steps"]),
                                                                         float(group["eps"])).contiguous(),
                   "the optimizer's newton_schulz")
    finite = finite and bool(torch.isfinite(O).all())  # an O that is not finite refuses the matrix too

    report.say("  weight phase")
    if split:
        master = join_master(w_old, saved_lo.to(device))
        report.show("master = join(w, mantissa)", master)
        report.bitwise("master", master.cpu(), torch.from_numpy(read_master(
            saved_w.view(torch.int16).numpy(), saved_lo.numpy()).reshape(p.shape)), "core's read_master")
    else:
        master = w_old
    decayed = master * scalars["decay"]
    report.show("p * (1 - lr wd)", decayed)
    updated = fma32(scalars["neg_adjusted_lr"], O.float(), decayed)
    report.show("p' = fma(-adjusted lr, O, .)", updated)
    accepted = torch.isfinite(updated) & ((updated.abs() <= SPLIT_MASTER_MAX) if split else True)
    new_master = torch.where(accepted, updated, master) if finite else master
    if split:
        w_new, lo_new = split_master(new_master)
        report.show("new w (bf16)", w_new)
        report.show("new mantissa (int16)", lo_new)
    if not finite:
        report.say("    the matrix is refused (a non-finite gradient, momentum, Newton-Schulz input or output): nothing "
                   "changes")
        code_next, s_next = code, s

    report.say("  the optimizer's step on the copy")
    optimizer.step()
    state = optimizer.state[p]
    report.bitwise("new momentum", state[key], code_next, "the optimizer's")
    if exponent_key is not None:
        report.bitwise("new exponent", state[exponent_key].cpu(), torch.tensor(s_next, dtype=torch.int32),
                       "the optimizer's")
    order = [id(q) for g_ in optimizer.param_groups for q in g_["params"]]
    report.bitwise("new master", optimizer.master_weights()[order.index(id(p))], new_master, "the optimizer's")
    if split:
        report.bitwise("new weight", p.detach(), w_new, "the optimizer's")
        report.bitwise("new mantissa", state[LOW_HALF_KEY], lo_new, "the optimizer's")
    else:
        report.bitwise("new weight", p.detach(), new_master, "the optimizer's")
