"""bf16 leaves with exact FP32 masters (docs/FORMAT.md, "Split masters") in jax.numpy.

The codec here is FORMAT.md's split and join written with jnp bit operations, so that
`master_weights` and `load_master_weights` run under `jax.jit` and keep each leaf's sharding;
the layout constants come from `core/formats.py` and the tests check it against the numpy
codec (`formats.split_master` / `join_master`) bit for bit.

`transform_update` is how the optax transform turns the step's new live weight into an update:
a float32 `u` whose `optax.apply_updates(p, u)` is the new weight wherever some float32 `u`
gives it (docs/JAX.md, "bf16 leaves", says where none does and why).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from packed_adamw.core.codecs import LOW_HALF_DTYPE, SPLIT_LO_SIGN, SPLIT_MASTER_MAX, SPLIT_SIGN_BIT
from packed_adamw.core.codecs import FLOAT32_MAX

BF16 = jnp.dtype(jnp.bfloat16)
FLOAT32 = jnp.dtype(jnp.float32)
LOW_HALF = jnp.dtype(LOW_HALF_DTYPE)
_MAGNITUDE = np.uint32(0x7FFFFFFF)  # a float32's bits without its sign


def bits16(x):
    """The 16-bit patterns of a bf16 or int16 array, as uint16."""
    return lax.bitcast_convert_type(x, jnp.uint16)


def join(w, lo):
    """bf16 live weights and their int16 low halves -> the float32 masters (any shape)."""
    w_bits = bits16(w).astype(jnp.uint32)
    lo_bits = lax.bitcast_convert_type(lo.astype(jnp.int32), jnp.uint32)  # sign-extended
    magnitude = (((w_bits & np.uint32(SPLIT_SIGN_BIT - 1)) << 16) + lo_bits) & _MAGNITUDE  # mod 2**31
    sign = (w_bits & np.uint32(SPLIT_SIGN_BIT)) << 16
    return lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def read(w, lo):
    """The masters a step reads (core's `formats.read_master`): `join`, except that a zero
    weight beside a negative low half (a zero written to the weight) reads as that zero."""
    stale = ((bits16(w) & np.uint16(SPLIT_SIGN_BIT - 1)) == 0) & (lo < 0)
    zero = lax.bitcast_convert_type((bits16(w).astype(jnp.uint32) << 16), jnp.float32)
    return jnp.where(stale, zero, join(w, lo))


def split(master):
    """float32 masters -> (bf16 live weights: the nearest bf16, ties away from zero; int16 low halves)."""
    bits = lax.bitcast_convert_type(master.astype(jnp.float32), jnp.uint32)
    rounded = ((bits & _MAGNITUDE) + np.uint32(SPLIT_LO_SIGN)) & _MAGNITUDE
    w_bits = ((bits >> 16) & np.uint32(SPLIT_SIGN_BIT)) | (rounded >> 16)
    lo_bits = (rounded & np.uint32(0xFFFF)) ^ np.uint32(SPLIT_LO_SIGN)
    return (lax.bitcast_convert_type(w_bits.astype(jnp.uint16), jnp.bfloat16),
            lax.bitcast_convert_type(lo_bits.astype(jnp.uint16), jnp.int16))


def outside_domain(master):
    """Masters that no bf16 weight can hold: NaN, Inf and |M| > SPLIT_MASTER_MAX."""
    return ~(jnp.abs(master.astype(jnp.float32)) <= np.float32(SPLIT_MASTER_MAX))


def transform_update(p, w_new, lo_new):
    """(u, lo) for a bf16 leaf of the optax transform: `p` the weight the step read, `w_new`
    and `lo_new` the step's new weight and low half.

    u = float32(w_new) - float32(p) (-0.0 where the weight does not change: p + -0.0 is p for
    every p, -0.0 included), clipped to the float32 range. Then `optax.apply_updates(p, u)`,
    which rounds float32(p) + u to bf16, is `w_new` wherever that difference is a float32
    number; where it is not (a weight that shrinks by a factor of more than 2**16 in one step)
    no float32 u gives `w_new`. Such elements, and those where XLA's arithmetic flushes a
    subnormal weight (its CPU backend), would leave a low half meant for another weight, so
    their low half becomes 0: the master is then exactly the weight `apply_updates` gives,
    computed here by the same operations."""
    diff = jnp.clip(w_new.astype(jnp.float32) - p.astype(jnp.float32), -FLOAT32_MAX, FLOAT32_MAX)
    u = jnp.where(bits16(w_new) == bits16(p), np.float32(-0.0), diff)
    applied = (p + u).astype(p.dtype)  # optax.apply_updates, operation for operation
    return u, jnp.where(bits16(applied) == bits16(w_new), lo_new, jnp.zeros_like(lo_new))
