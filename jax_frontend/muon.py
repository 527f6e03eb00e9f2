"""optax frontend for Muon: `packed_muon`, a GradientTransformation (docs/MUON.md, "JAX / optax").

Muon leaves (2-D by default, or those given `MuonDimensionNumbers`) take the contract's step:
the momentum phase is core/muon's numpy phase through `jax.pure_callback`, Newton-Schulz runs
in jax.numpy with bf16 operands (`newton_schulz`), the weight phase is core/muon's numpy phase
again. Every other leaf takes `packed_adamw`, reused unchanged behind `optax.masked`.

On a GPU backend the phases are core/muon's Triton kernels through jax-triton and Newton-Schulz
is core/muon/ns_kernel.py's (the kernels torch launches with `ns_impl="triton"`: meant to give
the same bits, checked by tests/jax_frontend/test_jax_muon.py's cuda-marked test on an H100); see
`_gpu_phases` and _muon_triton.py.

Layout: a JAX kernel is [in, out] (optax's reduction axis, then output axis). Muon's contract
is written in torch's [out, in] layout, so each matrix is read as its transpose there: the
learning-rate ratio and the Newton-Schulz orientation are those torch gives the same layer.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.core.codecs import FLOAT32_MAX
from packed_adamw.core.muon import (
    DEFAULT_MU_BIAS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    RULE,
    StateFormat,
    momentum_phase,
    step_scalar_row,
    validate_ns,
    weight_phase,
    weight_phase_split,
)
from packed_adamw.core.rule import MAX_STEP_COUNT

from . import _masters
from ._masters import BF16, FLOAT32, LOW_HALF
from ._muon_portable import export_muon_state, import_muon_state  # noqa: F401 (packed_adamw.jax.muon's names)
from ._states import PackedMuonState
from ._muon_state import MatrixView, _check_grad_dtypes, _check_grads, _check_param_dtypes, _checked_exponents, \
    _checked_lows, _checked_momenta, _like, _zero_exponents, leaf_views
from ._step import CpuStepError, _subnormals_kept, without_tangents
from ._hyperparams import _at_count, _at_count_named, _check_count, _check_count_type, _check_hyperparameter_kinds, \
    _concrete_float, _increment, _known_or_given, _refusal_reason, _refuse_invalid, _refused_eagerly, _warn_refused
from .transform import _LOW_HALVES_UNKNOWN, _is_params_placeholder, _step_platforms, packed_adamw

# torch.optim.Muon's defaults (optax.contrib.muon's are eps=1e-8 and weight_decay=0).
DEFAULT_EPS = 1e-7
DEFAULT_WEIGHT_DECAY = 0.1
ISSUE = "issue 37"
# The most steps a state may have taken (core's one number, which says why).
MAX_COUNT = MAX_STEP_COUNT
# The hyperparameters that may be schedules of the count: the Muon row's, read at
# `PackedMuonState.count` as the step reads an injected array, and the AdamW half's learning
# rate (read at the AdamW half's count; its other hyperparameters take numbers).
SCHEDULES = ("learning_rate", "beta", "weight_decay", "eps", "adam_learning_rate")


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


def _orthogonalize(inputs, coefficients, steps, eps):
    """`newton_schulz` of each [in, out] matrix of `inputs` [batch, in, out] (bf16), one matrix
    at a time (`lax.map`), so a batched leaf's matrices get the bits a 2-D leaf gets."""
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


# ---------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------
def _python_number(x) -> float | None:
    """x as a float if it is a plain number (known before compilation, exact in binary64)."""
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)):
        return float(x)
    return None


def _rate_valid(rate):
    """Whether a learning rate is one Muon's step takes (its float32 value within RULE's bound,
    as `_refuse_invalid` checks the row); True for one known when the step is traced, which was
    validated there."""
    if _concrete_float(rate) is not None:
        return True
    return RULE.bounds["lr"].holds(jnp.asarray(rate, jnp.float32))


def _screened_rate(rate):
    """The AdamW half's learning rate where it shares the Muon half's: the same value where Muon
    takes it (`_rate_valid`), else 0, a rate packed_adamw takes, so a step refused for it warns
    once (Muon's `RefusedStepWarning`); Muon's refusal hands the AdamW half NaN gradients, which
    keep every AdamW leaf and word, and the count stays (`_whole_step_valid`). A schedule stays a
    schedule; a value known when the step is traced stays as it is."""
    def screened(value):
        if _concrete_float(value) is not None:
            return value
        return jnp.where(_rate_valid(value), value, jnp.zeros_like(value))

    return (lambda count: screened(rate(count))) if callable(rate) else screened(rate)


# The host side of transform.py's `_report_refusal` for the Muon half, in packed_muon's words. A
# refused step is the whole transform's: the AdamW leaves keep theirs too (`_whole_step_valid`).
_warn_muon_refused = functools.partial(_warn_refused, "packed_muon", RULE,
                                       unchanged="weight, momentum, AdamW state word or count")


def _refused_schedule(name: str, value) -> str:
    """`_check_hyperparameter_kinds`' message for a schedule outside SCHEDULES (an adam_* one)."""
    return (f"packed_muon: {name} is a schedule ({value!r}), but packed_muon takes schedules for the Muon half's "
            "hyperparameters and the AdamW half's learning rate only: pass a number, or let "
            "optax.inject_hyperparams evaluate the schedule and pass its value "
            f"(optax.inject_hyperparams(packed_muon, static_args=('ns_steps', 'mu_bias'))(..., {name}=schedule))")


def _step_platform(tree) -> str:
    """"cpu" (the numpy phases through callbacks, Newton-Schulz in jax.numpy) or "gpu" (the
    Triton kernels through jax-triton): the default backend's, which every concrete leaf must
    share. A mix (a GPU host placing the step's arrays on its CPU, or the other way round) and
    other accelerators are refused."""
    platforms = _step_platforms(tree)
    if platforms == {"cpu"}:
        return "cpu"
    if platforms == {"gpu"}:
        return "gpu"
    raise NotImplementedError(
        f"packed_muon steps on the CPU (numpy phases, jax.numpy Newton-Schulz) or on CUDA GPUs (Triton kernels "
        f"through jax-triton), with every array on the default backend's devices; found platforms "
        f"{sorted(platforms)} (default backend {jax.default_backend()!r}). Put the parameters, gradients and state "
        f"on the default backend's devices ({ISSUE}), or use packed_adamw.torch.PackedMuonAdamW")


def _refuse_accelerators(tree) -> None:
    _step_platform(tree)


def packed_muon(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    beta: float = 0.95,
    eps: float = DEFAULT_EPS,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    *,
    nesterov: bool = True,
    adjust_lr_fn: str | None = None,
    mode: str = "packed",
    mu_bias: int = DEFAULT_MU_BIAS,
    adam_learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    adam_mask: Any = None,
    adam_mode: Any = "packed",
    muon_weight_dimension_numbers: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Muon with its momentum in 2 bytes per parameter, as an optax transformation; the step
    of docs/MUON.md (torch.optim.Muon's semantics: on the CPU, fp32 mode with a torch
    Newton-Schulz is torch.optim.Muon bit for bit; docs/MUON.md, "JAX / optax", says what the
    jax.numpy Newton-Schulz gives instead).

    Named as optax.contrib.muon: `beta` is torch's `momentum`, `ns_coeffs` its
    `ns_coefficients`. Defaults are torch.optim.Muon's: `eps=1e-7` (a clamp of the Frobenius
    norm, not optax's 1e-8 added to it) and `weight_decay=0.1` (decoupled: p * (1 - lr * wd));
    `adjust_lr_fn` None / "original" is optax's width scaling, "match_rms_adamw" its
    `consistent_rms=0.2`. `mode`: "packed" (E5M10 codes with a power-of-two exponent per
    matrix, `PackedMuonState.exponents`, which makes the step invariant to a power-of-two scale
    of the gradients; `mu_bias` no longer moves it), "bf16" (2 bytes per parameter each) or
    "fp32" (4). `learning_rate`, `beta`, `weight_decay` and `eps`
    may be schedules of the count (`PackedMuonState.count`); `adam_learning_rate` too.

    Muon leaves: by default every 2-D leaf, read as a JAX [in, out] kernel; or as given by
    `muon_weight_dimension_numbers` (a tree of `optax.contrib.MuonDimensionNumbers` / None,
    or a callable returning one; batch axes give one matrix each). They are float32 or
    bfloat16 (an exact FP32 master: its low half in `PackedMuonState.low_halves`). A matrix
    whose gradient, momentum or Newton-Schulz input is not finite is refused whole: update
    -0.0, momentum kept. An invalid hyperparameter of either half (or a damaged count) refuses
    the whole step: eagerly a ValueError; under `jax.jit` nothing changes in either half, with a
    `RefusedStepWarning` naming it (MUON.md, "Refusals"). Every other leaf takes
    `packed_adamw(adam_learning_rate (default: learning_rate), adam_b1, adam_b2, adam_eps,
    adam_weight_decay, adam_mask, adam_mode)`
    (optax.contrib.muon's AdamW defaults: weight decay 0). That AdamW is plain AdamW:
    optax.contrib.muon's is Nesterov's (`optax.adamw(..., nesterov=True)`), which packed_adamw
    has no form of, so those leaves take other steps (larger in the first ~10 steps where the
    gradient keeps its sign; docs/MUON.md, "optax.contrib.muon: the differences", gives the
    numbers and how to get optax's: an `optax.partition` of packed_muon for the matrices and
    `optax.adamw(..., nesterov=True)` for the rest). `update` needs `params`.

    A float32 Muon leaf's update is u = p' - p in float32: `optax.apply_updates` gives the
    contract's p' wherever that difference is exact, and elsewhere (0.2% to 2% of elements
    in our measurements, more where steps are large beside the weights) no float32 u can, and
    the weight lands within an ulp of u from p' (MUON.md, "JAX / optax").
    `packed_muon_fused_step` writes p' itself. On a GPU backend (CUDA, with jax-triton) the step
    runs core/muon's Triton kernels, Newton-Schulz included: the bits of torch's
    `PackedMuon(ns_impl="triton")` on the same inputs.
    """
    init_fn, run = _muon(**locals())

    def update_fn(updates, state, params=None, **extra_args):
        return run(updates, state, params, extra_args, write_update=True)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def packed_muon_fused_step(*args, **kwargs) -> Callable[[Any, Any, PackedMuonState], tuple[Any, PackedMuonState]]:
    """`step(params, grads, state) -> (params, state)`: `packed_muon`'s step (same arguments,
    same state: `packed_muon(...).init(params)`) writing the new parameters instead of updates.
    A float32 Muon leaf then gets the contract's new weight bit for bit everywhere, which an
    update cannot give for the elements MUON.md ("JAX / optax") names; the AdamW leaves get
    `optax.apply_updates` of packed_adamw's updates, which is its exact step."""
    bound = inspect.signature(packed_muon).bind(*args, **kwargs)
    bound.apply_defaults()
    _, run = _muon(**bound.arguments)

    def step(params, grads, state):
        return run(grads, state, params, {}, write_update=False)

    return step


def _applied(updates, params, write_update: bool):
    return updates if write_update else optax.apply_updates(params, updates)


def _muon(learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, *, nesterov, adjust_lr_fn, mode, mu_bias,
          adam_learning_rate, adam_b1, adam_b2, adam_eps, adam_weight_decay, adam_mask, adam_mode,
          muon_weight_dimension_numbers):
    """`packed_muon`'s checks, then its (init, run)."""
    values = dict(learning_rate=learning_rate, beta=beta, eps=eps, weight_decay=weight_decay,
                  adam_learning_rate=adam_learning_rate, adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
                  adam_weight_decay=adam_weight_decay)
    if adam_learning_rate is None:  # the Muon half's learning rate
        del values["adam_learning_rate"]
    _check_hyperparameter_kinds("packed_muon", values, SCHEDULES, _refused_schedule)
    for name, value in (("ns_steps", ns_steps), ("mu_bias", mu_bias)):
        if isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(f"packed_muon: {name}={value!r} is an array, but it fixes the compiled step (the "
                            "Newton-Schulz loop, the momentum code), so it must be a Python int; "
                            f"optax.inject_hyperparams turns numbers into arrays: list {name!r} in its static_args")
    try:
        fmt = StateFormat(mode, mu_bias)
    except (ValueError, TypeError) as e:
        raise type(e)(f"packed_muon: {e}") from None
    if not isinstance(nesterov, (bool, np.bool_)):
        raise TypeError(f"packed_muon: nesterov={nesterov!r}: pass True or False")
    try:  # the rule's words are torch.optim.Muon's: say which of packed_muon's arguments they mean
        coefficients, steps = validate_ns(ns_coeffs, ns_steps, adjust_lr_fn)
        RULE.validate(*(_known_or_given(x) for x in (learning_rate, beta, weight_decay, eps)), allow_arrays=True)
    except ValueError as e:
        raise ValueError(f"packed_muon: {e} (torch.optim.Muon's names: lr is learning_rate, momentum is beta, "
                         "ns_coefficients is ns_coeffs)") from None

    # The AdamW half's hyperparameters pass the tangent guard (`_tangent_free`) before packed_adamw's
    # primitive sees them, so a gradient through them is refused in packed_muon's words.
    adam_b1, adam_b2, adam_eps, adam_weight_decay = map(_tangent_free, (adam_b1, adam_b2, adam_eps, adam_weight_decay))

    def adamw_half(rate):
        return optax.masked(
            packed_adamw(_tangent_free_rate(rate, "adam_learning_rate" if adam_learning_rate is not None else
                                            "learning_rate"),
                         adam_b1, adam_b2, adam_eps, adam_weight_decay, mask=adam_mask, mode=adam_mode),
            lambda tree: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree),
                                                      [v is None for v in leaf_views(muon_weight_dimension_numbers,
                                                                                     tree)]))

    shared_rate = adam_learning_rate is None  # both halves read `learning_rate`
    try:
        adamw = adamw_half(learning_rate if shared_rate else adam_learning_rate)  # alone: no Muon leaf to refuse for it
    except (ValueError, TypeError) as e:  # packed_adamw's words: say they are the AdamW half's arguments
        rate = "learning_rate" if shared_rate else "adam_learning_rate"
        raise type(e)(f"packed_muon: the AdamW half refused its arguments (packed_adamw's lr, b1, b2, eps, "
                      f"weight_decay, mask and mode are packed_muon's {rate}, adam_b1, adam_b2, adam_eps, "
                      f"adam_weight_decay, adam_mask and adam_mode): {e}") from None
    # Beside Muon leaves a shared rate that Muon refuses is read as 0 by the AdamW half: that step
    # is Muon's refusal, heard once in packed_muon's words, not again in packed_adamw's.
    adamw_beside_muon = adamw_half(_screened_rate(learning_rate)) if shared_rate else adamw

    def init_fn(params):
        if _is_params_placeholder(params):  # optax.tree_utils.tree_map_params: which fields are the parameters'
            return PackedMuonState(jnp.zeros([], jnp.int32), params, _LOW_HALVES_UNKNOWN, adamw.init(params),
                                   _EXPONENTS_NOT_PARAMS)
        _refuse_accelerators(params)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        views = leaf_views(muon_weight_dimension_numbers, params)
        _check_param_dtypes(params, views)
        momentum = [optax.MaskedNode() if v is None else jnp.zeros_like(p, dtype=jnp.dtype(fmt.state_dtype))
                    for p, v in zip(leaves, views)]
        split = [v is not None and jnp.result_type(p) == BF16 for p, v in zip(leaves, views)]
        lows = None
        if any(split):
            lows = treedef.unflatten([jnp.zeros_like(p, dtype=LOW_HALF) if s else optax.MaskedNode()
                                      for p, s in zip(leaves, split)])
        return PackedMuonState(jnp.zeros([], jnp.int32), treedef.unflatten(momentum), lows, adamw.init(params),
                               _zero_exponents(leaves, treedef, views, fmt))

    def run(updates, state, params, extra_args, *, write_update: bool):
        """(updates, state), or with write_update=False (new params, state)."""
        _refuse_accelerators((updates, params))
        if not isinstance(state, PackedMuonState):
            raise TypeError(f"packed_muon: the state is a {type(state).__name__}; pass the state init() returned")
        # Callbacks, launches and packed_adamw's primitive have no derivative: a tangent reaching the step
        # through its arrays is refused here, in packed_muon's words (hyperparameters: below and `adamw_half`).
        updates, state, params = _tangent_free((updates, state, params))
        _check_count_type(state.count, "packed_muon")
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
        try:
            p_leaves = None if params is None else treedef.flatten_up_to(params)
        except (ValueError, TypeError) as e:
            raise ValueError(f"packed_muon: the gradients' tree is not the parameters' ({e}); pass one gradient per "
                             "parameter, in the parameters' structure") from None
        views = leaf_views(muon_weight_dimension_numbers, updates)
        muon = [i for i, v in enumerate(views) if v is not None]
        paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in flat]
        if not muon:
            # The Muon half's entries are still checked: a tree without Muon leaves holds none.
            _check_count(state.count, "packed_muon")
            none = [None] * len(flat)
            if p_leaves is not None:
                _check_grads([g for _, g in flat], p_leaves, paths)
            _checked_momenta(state.momentum, treedef, none, views, paths, fmt)
            _checked_exponents(state.exponents, treedef, none, views, paths, fmt)
            _checked_lows(state.low_halves, treedef, none, [False] * len(flat), paths)
            adamw_updates, adamw_state = adamw.update(updates, state.adamw, params, **extra_args)
            accepted = _adamw_accepted(adamw_state, state.adamw)
            return _applied(adamw_updates, params, write_update), state._replace(
                count=jnp.where(accepted, _increment(state.count), state.count), adamw=adamw_state)
        if params is None:
            raise ValueError("packed_muon: the Muon step reads the weights (decay, and the update that gives the new "
                             "weight), so update() needs params: call tx.update(grads, state, params)")
        grads = [g for _, g in flat]
        _check_grads(grads, p_leaves, paths)
        split = _check_param_dtypes(params, views)
        _check_grad_dtypes(grads, split, views, paths)
        momenta = _checked_momenta(state.momentum, treedef, p_leaves, views, paths, fmt)
        exponents = _checked_exponents(state.exponents, treedef, p_leaves, views, paths, fmt)
        lows = _checked_lows(state.low_halves, treedef, p_leaves, split, paths)

        values = _tangent_free(_at_count_named((learning_rate, beta, weight_decay, eps),  # RULE.group_keys order
                                               ("learning_rate", "beta", "weight_decay", "eps"), state.count,
                                               "packed_muon"))
        given = RULE.group_row(*values, number=lambda x: x)  # hyperparam_fields order, as given
        row = jnp.asarray([jnp.asarray(x, jnp.float32) for x in given])
        # Only `valid` is taken: the phases read the row as given and step no matrix of a refused step.
        _, valid = _refuse_invalid(RULE, row, state.count)
        if shared_rate:  # a rate the AdamW half reads as 0 at its count (the step keeps it Muon's) refuses the step
            valid = valid & _rate_valid(learning_rate(state.adamw.inner_state.count) if callable(learning_rate)
                                        else learning_rate)
        on_gpu = _step_platform((updates, params)) == "gpu"
        # Known outside jit (a schedule's value, say): raise in Muon's words; under jit refused in
        # the graph, and heard as transform.py's `_refused_eagerly` says (MUON.md, "Refusals").
        refused, receipt = _refused_eagerly("packed_muon", RULE, _warn_muon_refused, values, row, valid, state.count)
        if refused:
            count = int(state.count)
            raise ValueError(f"packed_muon: step refused at count {count}: "
                             f"{_refusal_reason(RULE, np.asarray(row), count)}")
        # The step reads the receipt (always 0), so a jit that keeps only the updates keeps the warning.
        valid = valid & (receipt == 0)

        # After Muon's checks, so that a bad shared learning rate is reported by Muon's words first.
        adamw_updates, adamw_state = adamw_beside_muon.update(_refused_unless(valid, updates, views), state.adamw,
                                                              params, **extra_args)
        adamw_state, valid = _whole_step_valid(valid, adamw_state, state.adamw)
        config = _PhaseConfig(fmt, bool(nesterov), adjust_lr_fn, tuple(_python_number(x) for x in given),
                              tuple(views[i].torch_shape for i in muon), tuple(split[i] for i in muon),
                              tuple(paths[i] for i in muon))
        g_mats = [views[i].to_matrices(grads[i]) for i in muon]
        s_mats = [views[i].to_matrices(momenta[i]) for i in muon]
        e_mats = [exponents[i].reshape(views[i].batch) for i in muon] if fmt.exponent_entry is not None else []
        p_mats = [views[i].to_matrices(p_leaves[i]) for i in muon]
        lo_mats = [views[i].to_matrices(lows[i]) for i in muon if split[i]]
        placed = _unplaced  # the GPU path's leaves are not sharded: see MUON.md
        # On the GPU a float32 leaf's update comes from its weight launch (`_muon_triton.weight_group_step`).
        kernel_updates = write_update and on_gpu
        if on_gpu:
            new_params, new_lows, new_states, new_exponents = _gpu_phases(
                config, [views[i] for i in muon], g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, coefficients,
                steps, write_update=write_update)
        else:
            new_params, new_lows, new_states, new_exponents, placed = _cpu_phases_placed(
                [p_leaves[i] for i in muon], config, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid,
                coefficients, steps, given[3])

        out = list(treedef.flatten_up_to(_applied(adamw_updates, params, write_update)))
        new_momenta = list(treedef.flatten_up_to(state.momentum))
        low_list = None if state.low_halves is None else list(treedef.flatten_up_to(state.low_halves))
        for j, (i, p_new, s_new) in enumerate(zip(muon, new_params, new_states)):
            view, p = views[i], p_leaves[i]
            p_new, new_momenta[i] = placed(view.from_matrices(p_new), j), placed(view.from_matrices(s_new), j)
            if not split[i]:
                out[i] = p_new if not write_update or kernel_updates else _float32_update(p, p_new)
                continue
            lo_new = placed(view.from_matrices(next(new_lows)), j)
            if not write_update:
                out[i], low_list[i] = p_new, lo_new
            else:
                out[i], low_list[i] = _masters.transform_update(p, p_new, lo_new)
        new_exponent_tree = None
        if fmt.exponent_entry is not None:
            exponent_list = list(exponents)
            for j, (i, e_new) in enumerate(zip(muon, new_exponents)):
                exponent_list[i] = placed(e_new.reshape(views[i].batch_shape), j, replicated=True)
            new_exponent_tree = treedef.unflatten([optax.MaskedNode() if e is None else e for e in exponent_list])
        count = jnp.where(valid, _increment(state.count), state.count)
        new_state = PackedMuonState(count, treedef.unflatten(new_momenta),
                                    None if low_list is None else treedef.unflatten(low_list), adamw_state,
                                    new_exponent_tree)
        return treedef.unflatten(out), new_state

    return init_fn, run


# What optax.tree_utils.tree_map_params sees in place of the fields that are not the parameters'
# tree of arrays shaped like them (`transform_non_params` applies to them), as packed_adamw's low halves.
_EXPONENTS_NOT_PARAMS = "exponents: one per matrix of a Muon leaf, not the parameters' shapes"


def _tangent_free(tree):
    """`tree` with its arrays through `_step.without_tangents`, in packed_muon's words; Python
    numbers stay numbers (the step reads a number as given: MUON.md, "Step scalars")."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
    guarded = without_tangents([leaves[i] for i in arrays], "packed_muon", "optax.contrib.muon")
    for i, x in zip(arrays, guarded):
        leaves[i] = x
    return treedef.unflatten(leaves)


def _tangent_free_rate(rate, field: str):
    """The AdamW half's learning rate through `_tangent_free`; a schedule's value checked at each
    count in packed_muon's words, naming `field`."""
    if callable(rate):
        return lambda count: _tangent_free(_at_count(rate, count, "packed_muon", field))
    return _tangent_free(rate)


# ---- one step, all or nothing ------------------------------------------------------------------
# A step that either half refuses (an invalid hyperparameter, a damaged count) changes nothing in
# either: the optax user sees one transform. The AdamW half refuses through packed_adamw's own
# contracts, in its step, so its state keeps being updated in place (no copy of it to select from):
# a non-finite gradient element keeps its parameter and state (FORMAT.md), and a refused step of
# packed_adamw keeps its count.
def _refused_unless(valid, updates, views):
    """The gradients the AdamW half steps on: as given, or NaN when Muon refused the step (so
    packed_adamw keeps every AdamW parameter and word; its update is -0.0, as a refusal's)."""
    try:
        if bool(valid):
            return updates  # known outside jit: nothing to select
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError):
        pass
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    return treedef.unflatten([g if v is not None else jnp.where(valid, g, jnp.asarray(jnp.nan, jnp.result_type(g)))
                              for g, v in zip(leaves, views)])


def _adamw_accepted(new, old):
    """Whether packed_adamw accepted the AdamW half's step: its count moved (a refused step keeps
    it), or stood past the last count that moves (MAX_COUNT + 1, where steps go on)."""
    new, old = new.inner_state.count, old.inner_state.count
    return (new != old) | (old > MAX_COUNT)


def _whole_step_valid(valid, adamw_state, old_adamw):
    """(the AdamW half's state, the whole step's validity): a step Muon refused keeps the AdamW
    count and format counts (its words and weights kept themselves, `_refused_unless`), and one
    the AdamW half refused refuses the Muon matrices (packed_adamw's warning names why)."""
    accepted = _adamw_accepted(adamw_state, old_adamw)
    inner, old = adamw_state.inner_state, old_adamw.inner_state
    kept = lambda new_x, old_x: jnp.where(valid, new_x, old_x)  # noqa: E731 (scalars and the small counts)
    inner = inner._replace(count=kept(inner.count, old.count),
                           format_counts=None if inner.format_counts is None else
                           jax.tree_util.tree_map(kept, inner.format_counts, old.format_counts))
    return adamw_state._replace(inner_state=inner), valid & accepted


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
    orthos = [_orthogonalize(jax.lax.bitcast_convert_type(x, BF16), coefficients, steps, ns_eps) for x in inputs]
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


def _unplaced(x, j, replicated=False):
    """The `placed` of a step on one device: results stay where the step put them."""
    return x


def _cpu_phases_placed(muon_params, config: _PhaseConfig, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid,
                       coefficients, steps, eps):
    """`_cpu_phases`, and `placed(x, j, replicated=False)` which lays out a result of Muon leaf
    j as its parameter (or, `replicated`, whole on every device: an exponent). Leaves sharded
    over a mesh (docs/MUON.md, "Sharded leaves"): Newton-Schulz needs whole matrices and a
    matrix is refused whole, so the phases run on whole matrices on every device
    (`_sharding.on_whole_leaves`, the sharding machinery packed_adamw's step uses) and their
    results are laid out as the parameters again (`_sharding.placed_as`: each device keeps its
    part; every device keeps every exponent). The bits are the unsharded step's."""
    from . import _sharding

    where = _sharding.placement(muon_params)
    if where is None:
        return (*_cpu_phases(config, g_mats, s_mats, e_mats, p_mats, lo_mats, row, valid, coefficients, steps, eps),
                _unplaced)
    n, k, m = len(g_mats), len(lo_mats), len(e_mats)

    def per_device(*flat):
        g, st, e = flat[:n], flat[n:2 * n], flat[2 * n:2 * n + m]
        p, lo = flat[2 * n + m:3 * n + m], flat[3 * n + m:3 * n + m + k]
        new_params, new_lows, new_states, new_exponents = _cpu_phases(
            config, list(g), list(st), list(e), list(p), list(lo), flat[-2], flat[-1], coefficients, steps, eps)
        return (*new_params, *new_lows, *new_states, *new_exponents)

    results = _sharding.on_whole_leaves(where, per_device, [*g_mats, *s_mats, *e_mats, *p_mats, *lo_mats, row, valid],
                                        2 * n + k + m)
    return (list(results[:n]), iter(results[n:n + k]), list(results[n + k:2 * n + k]), list(results[2 * n + k:]),
            functools.partial(_sharding.placed_as, where))


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


__all__ = ["DEFAULT_EPS", "DEFAULT_WEIGHT_DECAY", "MAX_COUNT", "MatrixView", "PackedMuonState", "export_muon_state",
           "import_muon_state", "leaf_views", "newton_schulz",
           "packed_muon", "packed_muon_fused_step"]
