"""optax frontend for Muon: `packed_muon`, a GradientTransformation (docs/MUON.md, "JAX / optax").

Muon leaves (2-D by default, or those given `MuonDimensionNumbers`) take the contract's step
through the step primitive packed_adamw's step is (`_step.py`, its rule `_rules.MUON`): lowered
for the platform it is compiled for (`_muon_step.lower`: core/muon's numpy phases around a
jax.numpy Newton-Schulz on the host, core/muon's Triton kernels through jax-triton on CUDA),
over whole matrices where the leaves are sharded (`_sharding.sharded_step`). Every other leaf
takes `packed_adamw`, reused unchanged behind `optax.masked`. This module checks the arguments,
the state and the hyperparameters, makes one step of the two halves (all or nothing), and puts
the results into the state.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.core.muon import DEFAULT_MU_BIAS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, RULE, StateFormat, \
    validate_ns
from packed_adamw.core.rule import MAX_STEP_COUNT

from . import _masters, _muon_step
from ._masters import BF16, LOW_HALF
from ._muon_portable import export_muon_state, import_muon_state  # noqa: F401 (packed_adamw.jax.muon's names)
from ._muon_step import MuonOptions, _python_number, binary64_bits, newton_schulz
from ._states import PackedMuonState
from ._muon_state import MatrixView, _check_grad_dtypes, _check_grads, _check_param_dtypes, _checked_exponents, \
    _checked_lows, _checked_momenta, _zero_exponents, leaf_views
from ._rules import MUON
from ._sharding import sharded_step
from ._step import StepConfig, StepOperands, without_tangents
from ._hyperparams import _at_count, _at_count_named, _check_count, _check_count_type, _check_hyperparameter_kinds, \
    _concrete_float, _increment, _known_or_given, _refusal_reason, _refuse_invalid, _refused_eagerly, _warn_refused
from .transform import _LOW_HALVES_UNKNOWN, _is_params_placeholder, packed_adamw

# torch.optim.Muon's defaults (optax.contrib.muon's are eps=1e-8 and weight_decay=0).
DEFAULT_EPS = 1e-7
DEFAULT_WEIGHT_DECAY = 0.1
# The most steps a state may have taken (core's one number, which says why).
MAX_COUNT = MAX_STEP_COUNT
# The hyperparameters that may be schedules of the count: the Muon row's, read at
# `PackedMuonState.count` as the step reads an injected array, and the AdamW half's learning
# rate (read at the AdamW half's count; its other hyperparameters take numbers).
SCHEDULES = ("learning_rate", "beta", "weight_decay", "eps", "adam_learning_rate")


# ---------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------

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
    `packed_muon_fused_step` writes p' itself. Compiled for a CUDA GPU (with jax-triton) the step
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
        # Only `valid` is taken: the phases read the row as given (MUON.md, "Step scalars"), NaN where the
        # whole step is refused (`valid` as it stands below, after the AdamW half's verdict).
        _, valid = _refuse_invalid(RULE, row, state.count)
        if shared_rate:  # a rate the AdamW half reads as 0 at its count (the step keeps it Muon's) refuses the step
            valid = valid & _rate_valid(learning_rate(state.adamw.inner_state.count) if callable(learning_rate)
                                        else learning_rate)
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
        count = jnp.where(valid, _increment(state.count), state.count)
        # The Muon leaves through the step primitive (`_step.py`, the rule `_rules.MUON`): lowered for the
        # platform it is compiled for, over whole matrices where the leaves are sharded (`sharded_step`).
        config = StepConfig(fmt=fmt, steps=MUON, write_update=write_update, multi_tensor=False,
                            leaf_rows=(0,) * len(muon), paths=tuple(paths[i] for i in muon),
                            split=tuple(j for j, i in enumerate(muon) if split[i]),
                            options=MuonOptions(tuple(views[i] for i in muon), bool(nesterov), adjust_lr_fn,
                                                tuple(binary64_bits(_python_number(x)) for x in given),
                                                coefficients, steps,
                                                _muon_step.KERNELS_EVERYWHERE))
        of_muon = lambda leaves: [leaves[i] for i in muon]  # noqa: E731
        results = sharded_step(StepOperands(of_muon(p_leaves), of_muon(grads), of_muon(momenta), of_muon(lows),
                                            jnp.where(valid, row, jnp.nan)[None], count, of_muon(exponents)),
                               config=config)

        out = list(treedef.flatten_up_to(_applied(adamw_updates, params, write_update)))
        new_momenta = list(treedef.flatten_up_to(state.momentum))
        low_list = None if state.low_halves is None else list(treedef.flatten_up_to(state.low_halves))
        exponent_list = list(exponents)
        for j, i in enumerate(muon):
            p_new, new_momenta[i], exponent_list[i] = results.outs[j], results.states[j], results.exponents[j]
            if not split[i]:  # the update (with write_update) or the new weight
                out[i] = p_new
            elif not write_update:
                out[i], low_list[i] = p_new, results.lows[j]
            else:
                out[i], low_list[i] = _masters.transform_update(p_leaves[i], p_new, results.lows[j])
        new_exponent_tree = None
        if fmt.exponent_entry is not None:
            new_exponent_tree = treedef.unflatten([optax.MaskedNode() if e is None else e for e in exponent_list])
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


__all__ = ["DEFAULT_EPS", "DEFAULT_WEIGHT_DECAY", "MAX_COUNT", "MatrixView", "PackedMuonState", "export_muon_state",
           "import_muon_state", "leaf_views", "newton_schulz",
           "packed_muon", "packed_muon_fused_step"]
