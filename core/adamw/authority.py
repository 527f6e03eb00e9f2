"""AdamW's scalar authority: its step (docs/FORMAT.md) executed one element at a time.

Pure Python floats and integers only, from core/authority.py's primitives; it shares no code
with the numpy step or the kernel, so agreeing with it is evidence, not tautology.
"""
from __future__ import annotations

import math

from ..authority import SPLIT_MASTER_MAX_BITS, Codec, bits_f32, f32, f32_bits, join_master, power, split_master

MODES = ("packed", "fp16", "fp32")


def codecs(mode: str, m_bias: int = 15, rms_bias: int = 15) -> tuple[Codec, Codec]:
    if mode == "packed":
        return Codec(True, 4, 11, m_bias), Codec(False, 4, 12, rms_bias)
    if mode == "fp16":
        half = Codec(True, 5, 10, 15, ieee_specials=True)
        return half, half
    raise ValueError(f"mode {mode!r} has no codecs")


def adamw_element(p, g, state, *, count, lr, b1, b2, eps, weight_decay, mode="packed", m_bias=15, rms_bias=15):
    """One element's step. `state` is a uint32 word (packed, fp16) or an (m, v) pair (fp32).

    Returns (p_new, update, state_new, accepted). A rejected element (non-finite gradient or
    result) keeps p and state, and its update is -0.0.
    """
    lr, b1, b2, eps, weight_decay, p, g = (f32(x) for x in (lr, b1, b2, eps, weight_decay, p, g))
    one_minus_b1, one_minus_b2 = f32(1.0 - b1), f32(1.0 - b2)
    step_size = f32(lr / f32(1.0 - power(b1, count)))
    inv_sqrt_bias_correction2 = f32(1.0 / f32(math.sqrt(f32(1.0 - power(b2, count)))))
    lr_wd = f32(lr * weight_decay)

    if mode == "fp32":
        m, v = state
    else:
        m_codec, r_codec = codecs(mode, m_bias, rms_bias)
        m, rms = m_codec.decode(state >> 16), r_codec.decode(state & 0xFFFF)
        v = f32(rms * rms)
    grad_finite = math.isfinite(g)
    g_used = g if grad_finite else 0.0
    m_next = f32(f32(b1 * m) + f32(one_minus_b1 * g_used))
    v_next = f32(f32(b2 * v) + f32(one_minus_b2 * f32(g_used * g_used)))
    rms_next = f32(math.sqrt(v_next))
    denom = f32(f32(rms_next * inv_sqrt_bias_correction2) + eps)  # >= eps > 0
    ratio = f32(m_next / denom)
    update = -f32(f32(step_size * ratio) + f32(lr_wd * p))
    p_next = f32(p + update)
    accepted = grad_finite and math.isfinite(p_next)
    if mode == "fp32":
        accepted = accepted and math.isfinite(m_next) and math.isfinite(v_next)
        state_next = (m_next, v_next)
    else:
        rms_code = r_codec.encode(rms_next)
        m_code = 0 if rms_code == 0 else m_codec.encode(m_next)  # the zero-RMS rule
        state_next = (m_code << 16) | rms_code
    if not accepted:
        return p, -0.0, state, False
    return p_next, update, state_next, True


def adamw_split_element(w_bits, lo, g, state, **step):
    """One element of a bf16 parameter held as (bf16 bits, low half): the master's
    `adamw_element` step (same keyword arguments), with a new master past SPLIT_MASTER_MAX
    rejected like a non-finite one. Returns (w_bits_new, lo_new, state_new, accepted)."""
    if w_bits % 2**15 == 0 and lo < 0:  # a zero written to the weight: it reads as that zero
        master_bits = (w_bits >> 15) << 31
    else:
        master_bits = join_master(w_bits, lo)
    master = bits_f32(master_bits)
    p_next, _, state_next, accepted = adamw_element(master, g, state, **step)
    if accepted and (f32_bits(p_next) & (2**31 - 1)) > SPLIT_MASTER_MAX_BITS:
        accepted = False
    if not accepted:  # the element keeps what it read (the same pair, but for a zero's stale low half)
        return (*split_master(master_bits), state, False)
    return (*split_master(f32_bits(p_next)), state_next, True)
