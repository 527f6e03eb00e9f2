"""Muon's step as the step primitive lowers it (`_step.py`): `lower`, the `RuleSteps.lower` of
`_rules.MUON`, traced for the platform the step is compiled for.

The primitive hands it the Muon leaves (parameters, gradients, momenta, the exponents of packed
mode, the low halves of bfloat16 leaves) and one hyperparameter row, NaN where the step was
refused in the graph. It reads each leaf as matrices (`MatrixView`, in `MuonOptions`) and runs
the contract's three phases (docs/MUON.md):

- on the host platform (`"host"`: the CPU, or any platform without a CUDA lowering), the momentum
  phase is core/muon's numpy phase through `jax.pure_callback`, Newton-Schulz runs in jax.numpy
  with bf16 operands (`newton_schulz`), the weight phase is core/muon's numpy phase again;
- on CUDA, the phases are core/muon's Triton kernels through jax-triton and Newton-Schulz is
  core/muon/ns_kernel.py's (the kernels torch launches with `ns_impl="triton"`), `_gpu_phases`
  and _muon_triton.py.

Since the lowering chooses, arrays placed on a GPU host's CPU (or `jit(..., backend="cpu")`) take
the host phases, as packed_adamw's step does. A float32 leaf's out is its update (with
`write_update`) or new weight; a bfloat16 leaf's is its new weight, the transform deriving the
update (`_masters.transform_update`), as the primitive's contract says for split leaves.

Layout: a JAX kernel is [in, out] (optax's reduction axis, then output axis). Muon's contract
is written in torch's [out, in] layout, so each matrix is read as its transpose there: the
learning-rate ratio and the Newton-Schulz orientation are those torch gives the same layer.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import struct

import jax
import jax.numpy as jnp
import numpy as np

from packed_adamw.core.codecs import FLOAT32_MAX
from packed_adamw.core.muon import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    StateFormat,
    momentum_phase,
    step_scalar_row,
    weight_phase,
    weight_phase_split,
)

from ._masters import BF16, FLOAT32
from ._muon_state import MatrixView, _like
from ._step import CpuStepError, StepConfig, StepOperands, StepResults, _subnormals_kept

# The CUDA lowering's phases on every platform: the tests set it to run core/muon's kernels in
# Triton's CPU interpreter through the whole transform (it is part of `MuonOptions`, so a step
# compiled with it is not reused without it).
KERNELS_EVERYWHERE = False


def binary64_bits(x: float | None) -> int | None:
    """A Python float's binary64 bits (None stays None): what a compiled step is keyed by, since
    floats compare equal where their bits differ (0.0 == -0.0) and the step reads the bits."""
    return None if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def _binary64(bits: int | None) -> float | None:
    return None if bits is None else struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Muon's `StepConfig.options`: what its step compiles for besides the arrays (hashable)."""

    views: tuple[MatrixView, ...]  # per Muon leaf: how it is read as matrices
    nesterov: bool
    adjust_lr_fn: str | None
    # (lr, momentum, weight_decay, eps) as given: a Python number's binary64 bits (`binary64_bits`),
    # None where the value is an array (traced, or known only as float32)
    static_bits: tuple
    coefficients: tuple[float, float, float]  # Newton-Schulz's
    ns_steps: int
    kernels_everywhere: bool = False  # `KERNELS_EVERYWHERE` when the step was built

    @property
    def static_row(self) -> tuple:
        """(lr, momentum, weight_decay, eps): the Python numbers as given, None where traced."""
        return tuple(map(_binary64, self.static_bits))


@functools.partial(jax.jit, static_argnames=("coefficients", "steps"))
def newton_schulz(x, coefficients=DEFAULT_NS_COEFFICIENTS, steps: int = DEFAULT_NS_STEPS, eps=1e-7):
    """MUON.md's Newton-Schulz phase on one JAX [in, out] matrix, read as torch's [out, in]
    matrix (its transpose), with jnp bf16 operands: the wide orientation, division by the
    Frobenius norm clamped at eps (norm and eps rounded to bf16, as torch's bf16
    `norm().clamp(min=eps)`), then `steps` quintic iterations whose GEMMs accumulate in float32
    and whose combined results (`b A + c A A`, `a Y + B Y`, as torch's `addmm`) are rounded to
    bf16 once. Returns bf16 [in, out].

    Always compiled (jax.jit), so a call outside jit and the same call inside a jitted step
    give the same bits: XLA's GEMMs sum in an order that depends on how their operands are laid
    out, which op-by-op dispatch would change. MUON.md ("JAX / optax") gives its distance to
    torch's Newton-Schulz."""
    return _newton_schulz_torch_layout(jnp.asarray(x).astype(BF16).T, coefficients, steps, eps).T


def _newton_schulz_torch_layout(y, coefficients, steps, eps):
    a, b, c = coefficients
    # Each scaled term is rounded to float32 before its sum: the barrier keeps XLA from
    # contracting `s * t + r` into a fused multiply-add.
    scaled = lambda scalar, t: jax.lax.optimization_barrier(np.float32(scalar) * t)  # noqa: E731
    tall = y.shape[0] > y.shape[1]
    if tall:
        y = y.T
    norm = jnp.sqrt(jnp.sum(jnp.square(y.astype(FLOAT32)))).astype(BF16)  # bf16 squares are exact in float32
    norm = jnp.maximum(norm, jnp.asarray(eps).astype(BF16))
    y = (y.astype(FLOAT32) / norm.astype(FLOAT32)).astype(BF16)
    for _ in range(steps):
        gram = jnp.matmul(y, y.T, preferred_element_type=FLOAT32).astype(BF16)
        square = jnp.matmul(gram, gram, preferred_element_type=FLOAT32)
        polynomial = (scaled(b, gram.astype(FLOAT32)) + scaled(c, square)).astype(BF16)
        y = (scaled(a, y.astype(FLOAT32)) + jnp.matmul(polynomial, y, preferred_element_type=FLOAT32)).astype(BF16)
    return y.T if tall else y


# ---------------------------------------------------------------------------------------------
# The host side: core/muon's numpy phases
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _PhaseConfig:
    """What the host phases depend on besides the arrays (hashable, static under jit)."""

    fmt: StateFormat
    nesterov: bool
    adjust_lr_fn: str | None
    static_row: tuple  # (lr, momentum, weight_decay, eps): a Python number, or None where traced
    shapes: tuple  # per Muon leaf: its matrices' torch shape (rows, cols)
    split: tuple  # per Muon leaf: a bfloat16 weight with a low half
    paths: tuple  # per Muon leaf, for messages


def _row_values(row, config: _PhaseConfig) -> tuple[float, ...]:
    """The hyperparameters as given where known before compilation (binary64, as torch takes
    Python floats), else the float32 values the graph computed (MUON.md, "Step scalars")."""
    row = np.asarray(row, np.float32)
    return tuple(float(row[k]) if given is None else float(given) for k, given in enumerate(config.static_row))


def _bits16(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 and x.dtype != np.int16 else x


def _host_momentum(valid, row, *flat, config: _PhaseConfig):
    """Per Muon leaf [batch, rows, cols]: (new state, new exponents [batch] (packed mode),
    Newton-Schulz input as bf16 bits, accepted per matrix). A refused matrix keeps its state
    and exponent and gets a zero input."""
    n = len(config.shapes)
    grads, states = flat[:n], flat[n:2 * n]
    exponents = flat[2 * n:] if config.fmt.exponent_entry is not None else [None] * n
    values = _row_values(row, config)
    new_states, new_exponents, inputs, accepted = [], [], [], []
    with _subnormals_kept():
        for g, s, exps, shape, path in zip(grads, states, exponents, config.shapes, config.paths):
            g, s = _bits16(g), np.array(s)  # callback inputs are read-only: the phase writes a copy
            exps = None if exps is None else np.array(exps, np.int32)
            scalars = step_scalar_row(values, shape, adjust_lr_fn=config.adjust_lr_fn)
            x = np.zeros(g.shape, np.uint16)
            ok = np.zeros(g.shape[0], np.bool_)
            for b in range(g.shape[0] if bool(np.asarray(valid)) else 0):
                try:
                    result = momentum_phase(g[b], s[b], scalars, fmt=config.fmt,
                                            exponent=None if exps is None else exps[b:b + 1], nesterov=config.nesterov)
                except Exception as e:  # surfaces as JaxRuntimeError: say which leaf
                    raise CpuStepError(f"packed_muon momentum phase of leaf {path}: {type(e).__name__}: {e}") from None
                if result is not None:
                    x[b], ok[b] = result, True
            new_states.append(s)
            if exps is not None:
                new_exponents.append(exps)
            inputs.append(x)
            accepted.append(ok)
    return [*new_states, *new_exponents, *inputs, *accepted]


def _host_weight(row, *flat, config: _PhaseConfig):
    """Per Muon leaf [batch, rows, cols]: the new weights (and low halves of split leaves),
    stepped where the matrix was accepted."""
    n, k = len(config.shapes), sum(config.split)
    params, lows, orthos, accepted = flat[:n], flat[n:n + k], flat[n + k:2 * n + k], flat[2 * n + k:]
    values = _row_values(row, config)
    lows = iter(lows)
    new_params, new_lows = [], []
    with _subnormals_kept():
        for p, o, ok, shape, split, path in zip(params, orthos, accepted, config.shapes, config.split, config.paths):
            scalars = step_scalar_row(values, shape, adjust_lr_fn=config.adjust_lr_fn)
            o = _bits16(o)
            try:
                if split:
                    w, lo = np.array(_bits16(p)), np.array(next(lows))
                    for b in np.flatnonzero(ok):
                        weight_phase_split(w[b], lo[b], o[b], scalars)
                    new_params.append(w.view(jnp.bfloat16))
                    new_lows.append(lo)
                else:
                    w = np.array(p, np.float32)
                    for b in np.flatnonzero(ok):
                        weight_phase(w[b], o[b], scalars)
                    new_params.append(w)
            except Exception as e:
                raise CpuStepError(f"packed_muon weight phase of leaf {path}: {type(e).__name__}: {e}") from None
    return [*new_params, *new_lows]


@functools.partial(jax.jit, static_argnames=("coefficients", "steps"))
def _orthogonalize(inputs, coefficients, steps, eps):
    """`newton_schulz` of each [in, out] matrix of `inputs` [batch, in, out] (bf16), one matrix
    at a time (`lax.map`), so a batched leaf's matrices get the bits a 2-D leaf gets. Compiled
    (an eager step of a batched leaf would trace the map again at every call)."""
    one = lambda m: newton_schulz(m, coefficients, steps, eps)  # noqa: E731
    if inputs.shape[0] == 1:
        return one(inputs[0])[None]
    return jax.lax.map(one, inputs)


def _float32_update(p, p_new):
    """The float32 u for `optax.apply_updates(p, u)`: p_new - p, or -0.0 where the weight does
    not change (p + -0.0 is p for every p, -0.0 included). Where p_new - p is exact (most
    elements: |p_new| and |p| within a factor 2 of each other) p + u is p_new. Where it is not,
    no float32 u gives p_new when p_new - p rounded is not it: the rounding of p + u is a
    second rounding, and the neighbours of p_new - p land farther away (MUON.md, "JAX / optax"
    measures how often; `packed_muon_fused_step` writes p_new itself)."""
    u = jnp.clip(p_new - p, -FLOAT32_MAX, FLOAT32_MAX)
    unchanged = jax.lax.bitcast_convert_type(p, jnp.uint32) == jax.lax.bitcast_convert_type(p_new, jnp.uint32)
    return jnp.where(unchanged, np.float32(-0.0), u)


def _python_number(x) -> float | None:
    """x as a float if it is a plain number (known before compilation, exact in binary64)."""
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)):
        return float(x)
    return None


def _cpu_phases(config: _PhaseConfig, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, coefficients, steps,
                eps):
    """The CPU step of the Muon leaves' matrices: core/muon's numpy phases through two
    callbacks around `newton_schulz`. `e_mats`: per Muon leaf its int32 exponents [batch]
    (packed mode), else empty. Returns (new params, iterator of the split leaves' new low
    halves, new states, new exponents), per Muon leaf as [batch, rows, cols] ([batch])."""
    out_types = ([_like(s) for s in s_mats] + [_like(e) for e in e_mats]
                 + [jax.ShapeDtypeStruct(s.shape, jnp.uint16) for s in s_mats]
                 + [jax.ShapeDtypeStruct(s.shape[:1], jnp.bool_) for s in s_mats])
    results = jax.pure_callback(functools.partial(_host_momentum, config=config), out_types, valid, row,
                                *g_mats, *s_mats, *e_mats, vmap_method="sequential")
    n, k = len(g_mats), len(e_mats)
    new_states, new_exponents = results[:n], results[n:n + k]
    inputs, accepted = results[n + k:2 * n + k], results[2 * n + k:]
    ns_eps = eps if _python_number(eps) is not None else row[3]
    # Compiled even under jax.disable_jit(): op by op, XLA's GEMMs sum in another order (`newton_schulz`).
    with jax.disable_jit(False):
        orthos = [_orthogonalize(jax.lax.bitcast_convert_type(x, BF16), coefficients, steps, ns_eps)
                  for x in inputs]
    # An O that is not finite refuses its matrix too (MUON.md, "The matrix is refused"): its
    # momentum and exponent as they were, its weights untouched.
    accepted = [ok & jnp.all(jnp.isfinite(o), axis=(1, 2)) for ok, o in zip(accepted, orthos)]
    new_states = [jnp.where(ok.reshape(ok.shape + (1,) * (s.ndim - 1)), new, s)
                  for ok, new, s in zip(accepted, new_states, s_mats)]
    new_exponents = [jnp.where(ok, new, e) for ok, new, e in zip(accepted, new_exponents, e_mats)]
    weight_types = [_like(p) for p in p_mats] + [_like(lo) for lo in lo_mats]
    stepped = jax.pure_callback(functools.partial(_host_weight, config=config), weight_types, row, *p_mats,
                                *lo_mats, *orthos, *accepted, vmap_method="sequential")
    return stepped[:n], iter(stepped[n:]), new_states, list(new_exponents)


def _gpu_phases(config: _PhaseConfig, views, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, coefficients,
                steps, *, write_update: bool = False):
    """`_cpu_phases` on a GPU: core/muon's Triton kernels through jax-triton (_muon_triton.py),
    Newton-Schulz once per shape group with the kernels torch's `ns_impl="triton"` launches.
    A matrix is refused (weights, momentum and exponent kept) when the row is invalid, the
    momentum kernel counts a refusing element in it, or its Newton-Schulz output is not finite. With `write_update`, a float32 matrix's
    entry of the new parameters is its update u instead (`_float32_update`'s, from the weight
    launch)."""
    from packed_adamw.core.muon import ns_kernel
    from packed_adamw.core.muon.kernel import MATRIX_COUNTERS

    from . import _muon_triton

    eps = config.static_row[3]
    if eps is not None:
        ns_scalars = jnp.asarray(ns_kernel.ns_scalars(coefficients, eps))
    else:  # the graph's float32 eps, as the CPU path's Newton-Schulz takes it
        ns_scalars = jnp.concatenate([jnp.asarray(ns_kernel.ns_scalars(coefficients, 1.0)[:3]), row[3:4]])
    refused_if_invalid = jnp.where(valid, 0, 1).astype(jnp.int32)
    lows = iter(lo_mats)
    lo_of = [next(lows) if is_split else None for is_split in config.split]
    exponent_of = e_mats if e_mats else [None] * len(g_mats)
    new_params, new_lows, new_states, new_exponents = list(p_mats), list(lo_of), list(s_mats), list(exponent_of)
    groups: dict[tuple, list[int]] = {}
    for j, view in enumerate(views):
        if g_mats[j].size:  # a zero-size matrix has nothing to step
            groups.setdefault(_muon_triton.wide_shape(view)[:2], []).append(j)
    for (k, n_cols), members in groups.items():
        matrices = sum(g_mats[j].shape[0] for j in members)
        x = jnp.zeros((matrices, k, n_cols), jnp.int16)
        # One counters row a matrix for the whole group (core/muon/kernel.py's COUNTER_COLUMNS: refused
        # elements, rejected weights, max |m'|, the old exponent), threaded through its launches (a
        # buffer a leaf would be an XLA operation a leaf, each a launch of its own).
        counters = jnp.zeros((matrices, MATRIX_COUNTERS), jnp.int32).at[:, 0].set(refused_if_invalid)
        slots, slot = {}, 0
        for j in members:
            slots[j] = slot
            slot += g_mats[j].shape[0]
        # A launch takes leaves of one orientation, gradient dtype and weight kind (the kernels'
        # constexprs), up to the kernels' slots.
        kinds: dict[tuple, list[int]] = {}
        for j in members:
            kind = (_muon_triton.wide_shape(views[j])[2], g_mats[j].dtype == BF16, config.split[j])
            kinds.setdefault(kind, []).append(j)
        launches = [leaves[i:i + _muon_triton.LEAVES_PER_LAUNCH] for leaves in kinds.values()
                    for i in range(0, len(leaves), _muon_triton.LEAVES_PER_LAUNCH)]
        scalars = {}
        for leaves in launches:
            # A launch's leaves share their torch shape (the shape group and orientation), so their
            # step scalars: one row, computed once (a launch of its own under a traced lr).
            shared = _muon_triton.leaf_scalars(row, config.static_row, config.shapes[leaves[0]], config.adjust_lr_fn)
            scalars[leaves[0]] = jnp.broadcast_to(shared, (len(leaves), shared.shape[0]))
            x, counters = _muon_triton.momentum_group_step(
                [g_mats[j] for j in leaves], [s_mats[j] for j in leaves], [exponent_of[j] for j in leaves],
                scalars[leaves[0]], x, counters, [slots[j] for j in leaves], views[leaves[0]], fmt=config.fmt,
                nesterov=config.nesterov)
        ortho = _muon_triton.newton_schulz(x, ns_scalars, steps)
        # An O that is not finite refuses its matrix (the weight kernels then store nothing of it).
        counters = counters.at[:, 0].add(_muon_triton.nonfinite_matrices(ortho))
        for leaves in launches:
            split = config.split[leaves[0]]
            weights, leaf_lows, leaf_states, leaf_exponents, counters = _muon_triton.weight_group_step(
                [p_mats[j] for j in leaves], [lo_of[j] for j in leaves] if split else None,
                [g_mats[j] for j in leaves], [s_mats[j] for j in leaves], [exponent_of[j] for j in leaves],
                scalars[leaves[0]], counters, ortho, [slots[j] for j in leaves], views[leaves[0]], fmt=config.fmt,
                write_update=write_update and not split)
            for t, j in enumerate(leaves):
                new_params[j], new_states[j], new_exponents[j] = weights[t], leaf_states[t], leaf_exponents[t]
                if split:
                    new_lows[j] = leaf_lows[t]
    return (new_params, iter([lo for lo, is_split in zip(new_lows, config.split) if is_split]), new_states,
            new_exponents if e_mats else [])


def lower(ops: StepOperands, config: StepConfig, platform: str) -> StepResults:
    """Muon's step over the primitive's leaves for `platform` ("cuda" or "host"): the phases on
    each leaf's matrices, then every result in its leaf's layout."""
    opts: MuonOptions = config.options
    views, n = opts.views, config.n_leaves
    split = tuple(i in config.split for i in range(n))
    phase = _PhaseConfig(config.fmt, opts.nesterov, opts.adjust_lr_fn, opts.static_row,
                         tuple(v.torch_shape for v in views), split, config.paths)
    row = ops.hparams[0]
    valid = ~jnp.isnan(row[0])  # a step refused in the graph has a NaN row (`_refuse_invalid`); a valid one none
    g_mats = [v.to_matrices(g) for v, g in zip(views, ops.grads)]
    s_mats = [v.to_matrices(s) for v, s in zip(views, ops.states)]
    p_mats = [v.to_matrices(p) for v, p in zip(views, ops.params)]
    lo_mats = [views[i].to_matrices(ops.lows[i]) for i in config.split]
    e_mats = [e.reshape(v.batch) for v, e in zip(views, ops.exponents)] if config.has_exponents else []
    on_kernels = platform == "cuda" or opts.kernels_everywhere
    if on_kernels:  # a float32 leaf's update comes from its weight launch
        new_params, new_lows, new_states, new_exponents = _gpu_phases(
            phase, views, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, opts.coefficients, opts.ns_steps,
            write_update=config.write_update)
    else:
        new_params, new_lows, new_states, new_exponents = _cpu_phases(
            phase, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, opts.coefficients, opts.ns_steps,
            opts.static_row[3])
    outs, lows = [], [None] * n
    for i, (view, p, p_new) in enumerate(zip(views, ops.params, new_params)):
        p_new = view.from_matrices(p_new)
        if split[i]:
            lows[i] = view.from_matrices(next(new_lows))
        elif config.write_update and not on_kernels:
            p_new = _float32_update(p, p_new)
        outs.append(p_new)
    states = [view.from_matrices(s) for view, s in zip(views, new_states)]
    exponents = ([e.reshape(view.batch_shape) for view, e in zip(views, new_exponents)] if config.has_exponents
                 else [None] * n)
    return StepResults(outs, states, lows, None, exponents)
