"""What both optax transforms (`packed_adamw`, `packed_muon`) do with their hyperparameters and
step count: the kinds they take (numbers, scalar arrays, schedules of the count), the count's
range and increment, and the refusal of a step whose traced hyperparameters are invalid (checked
in the graph from the rule's bounds; a warning names the value on the host). One home for both,
so a refusal reads the same whichever transform makes it."""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from packed_adamw.core.rule import MAX_STEP_COUNT, float_or_inf

# The receipt of a refusal report (`_report_refusal`): an int32 zero, which the caller's step reads.
NO_RECEIPT = np.int32(0)


def _refuse_invalid(rule, hparams, count):
    """(rows, valid): the hyperparameter rows (`rule.hyperparam_fields`) checked in the graph by
    `rule.rows_valid`, from the same bounds the host's `rule.validate` is written from, for
    values known only there (schedules, injected arrays), and the count before the step (>= 0).
    If anything is invalid every row becomes NaN, so every element of every leaf is rejected
    and keeps its value and state, on CPU and GPU alike; the caller then leaves the count as
    it was."""
    valid = jnp.all(rule.rows_valid(hparams)) & (count >= 0)
    return jnp.where(valid, hparams, jnp.nan), valid


class RefusedStepWarning(RuntimeWarning):
    """A step under `jax.jit` was refused in the graph (an invalid hyperparameter or a negative
    count): nothing changed, and the count did not move."""


def _refusal_reason(rule, row, count: int) -> str:
    """What made a step invalid, in the words of the constructor's validation (the rule's), or
    the damaged count, in words that fit any transform's message (packed_adamw's, packed_muon's)."""
    if count < 0:
        return f"the state's step count is {count} (a count is >= 0: the state is damaged or was built by hand)"
    return rule.refusal_reason(row)


def _warn_refused(transform: str, rule, valid, row, count, *,
                  unchanged: str = "parameter, state word or count") -> np.ndarray:
    """Host side of `_report_refusal` for the transform named `transform` (packed_adamw,
    packed_muon), whose step of `rule` keeps `unchanged` when refused: warns for a refused step
    (under `vmap` it runs for every batch element, refused or not) and returns the receipt, an
    int32 zero. Bind the leading arguments with `functools.partial`."""
    if bool(np.asarray(valid)):
        return NO_RECEIPT
    count = int(np.asarray(count))
    fix = ("restore an undamaged state (init() starts the count at 0, and the importers refuse a negative one)"
           if count < 0 else "since the count did not move, a schedule is evaluated at the same count next step: "
           "fix the schedule or the injected value (the eager update raises on it)")
    warnings.warn(f"{transform}: step refused at count {count}: {_refusal_reason(rule, np.asarray(row), count)}. No "
                  f"{unchanged} changed; {fix}", RefusedStepWarning, stacklevel=2)
    return NO_RECEIPT


def _effect_free_refusals() -> bool:
    """Whether `_report_refusal` hears a refusal through a pure callback (no effect in the step's
    jaxpr) rather than a `jax.debug.callback`: on a host whose default backend is an accelerator,
    where a jitted step's dispatch time matters. Chosen when the step is traced (an effect is in
    the jaxpr whatever platform it is lowered for)."""
    return jax.default_backend() != "cpu"


def _report_refusal(warn, valid, row, count) -> jax.Array:
    """Under jit an invalid step cannot raise: a callback of `warn` (`_warn_refused` with the
    transform's name and rule bound) warns instead (`RefusedStepWarning`, naming the value or the
    count); `_refused_eagerly` says where it is compiled in. The callback is taken only on the
    refusing branch of a `lax.cond`; under `vmap` the cond becomes a select, so the host side
    checks `valid` again. Returns the receipt, an int32 zero that the caller's step reads.

    On an accelerator host (`_effect_free_refusals`) the callback is a `jax.pure_callback` whose
    result is the receipt, which keeps it in the graph: a `jax.debug.callback` puts an effect in
    the step's jaxpr, also where its branch is never lowered (CUDA's plain-number step), and a
    jitted function with an effect loses JAX's C++ dispatch path: every call then flattens and
    checks each argument in Python (docs/JAX.md, "Dispatch": 10x the time of a call with 300
    arrays on the CPU). The caller makes the step itself read the receipt (packed_adamw through
    the count its rows are derived at, packed_muon through `valid`), so that a jit keeping only
    the updates keeps the callback. Over a mesh of several devices the callback runs on one, and
    the refusing branch broadcasts its receipt (an all-reduce on a refused step only). On a CPU
    host (tests, meshes of CPU devices, whose steps wait for their numpy callbacks anyway) the
    debug callback stays."""
    if not _effect_free_refusals():
        lax.cond(valid, lambda *_: None, lambda *args: jax.debug.callback(_without_result, warn, *args),
                 valid, row, count)
        return jnp.int32(NO_RECEIPT)
    receipt_type = jax.ShapeDtypeStruct((), jnp.int32)
    # No tangent reaches the callback (pure callbacks have no JVP rule): a gradient through the
    # step then meets the step's own "not differentiable" error.
    return lax.cond(valid, lambda *_: jnp.int32(NO_RECEIPT),
                    lambda *args: jax.pure_callback(warn, receipt_type, *args, vmap_method="sequential"),
                    valid, lax.stop_gradient(row), count)


def _known_value(x):
    """x as a float where it is known when the step is traced (a number, a concrete array), else x."""
    value = _concrete_float(x)
    return x if value is None else value


def _without_result(fn, *args) -> None:
    fn(*args)  # a debug callback returns nothing


def _refused_eagerly(transform: str, rule, warn, values, row, valid, count) -> tuple[bool, Any]:
    """(refused, receipt). `refused`: whether a step of `rule` whose hyperparameters are `values`
    (in `rule.group_keys` order, schedules read at `count`) is refused where that is known:
    outside jit (`valid`, from `_refuse_invalid`, concrete), where the caller raises in its own
    words. Under jit (or vmap) the graph refuses an invalid step, and this makes the refusal
    heard, for every transform alike (packed_adamw, packed_muon; `transform` names it, `warn` is
    its `_warn_refused`); the caller's step reads `receipt` (an int32 zero, `_report_refusal`'s):

    - values known when the step is traced (a schedule returning a plain number, such as
      optax.constant_schedule's, the same at every count) are validated now: an invalid one
      raises, naming it, as the eager update does, instead of a step that refuses every weight;
    - the refusal warning (`_report_refusal` of `row` and `count`) is compiled in where a value
      is known only in the graph (a traced schedule, an injected array), and otherwise wherever
      the step is lowered for a platform other than CUDA (the CPU): there the step waits for its
      host callbacks anyway, so a damaged count warns too. On CUDA a plain-number step keeps no
      callback and waits for no host; a damaged count there shows only as the count not moving
      (docs/JAX.md, "Known gaps"). The platform is the lowering's (`lax.platform_dependent`),
      not the default backend's, as the step's own path is."""
    try:
        return not bool(valid), NO_RECEIPT
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError):
        pass
    try:
        rule.validate(*_map_group(_known_value, values), allow_arrays=True)
    except ValueError as e:
        raise ValueError(f"{transform}: invalid hyperparameters, known when the step was traced (a schedule that "
                         f"returns a plain number is the same at every count, so every step would be refused): {e}") \
            from None
    if any(_concrete_float(x) is None for x in rule.group_row(*values, number=_as_given)):
        return False, _report_refusal(warn, valid, row, count)
    return False, lax.platform_dependent(valid, row, count, default=functools.partial(_report_refusal, warn),
                                         cuda=lambda *_: jnp.int32(NO_RECEIPT))


def _concrete_float(x) -> float | None:
    """x as a float where it is known before compilation (a number or a concrete array)."""
    try:
        return float_or_inf(x)  # past a float's range: infinite, refused by its bound
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None  # traced (or not a scalar): not known


def _known_or_given(x):
    """A hyperparameter as a float where it is known before compilation, so the rule's checks
    can run when the transform is built; a schedule or a traced value as it is (checked in the
    graph)."""
    value = None if callable(x) else _concrete_float(x)
    return x if value is None else value


def _increment(count):
    """The count after a step: past MAX_STEP_COUNT it stays (int32's largest value, 2**31 - 1)."""
    return jnp.where(count <= MAX_STEP_COUNT, count + 1, count)


def _as_step_count(count):
    """`count` as a Python int where it is an integer: an integral number (not a bool), or a
    concrete 0-d array of an integer dtype (a state's `count`, `np.array(5)`), converted exactly;
    anything else as it is, for `_is_step_count` to refuse."""
    if isinstance(count, (bool, np.bool_)):
        return count
    if isinstance(count, numbers.Integral):
        return int(count)
    if (isinstance(count, (jax.Array, np.ndarray)) and not isinstance(count, jax.core.Tracer)
            and np.ndim(count) == 0 and np.issubdtype(count.dtype, np.integer)):
        return int(np.asarray(count))
    return count


def _is_step_count(count) -> bool:
    """A count a state may hold: a whole number (not a bool; a 0-d integer array too, as
    `_as_step_count` reads it) from 0 to MAX_STEP_COUNT."""
    count = _as_step_count(count)
    return isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_STEP_COUNT


def _check_count_type(count, name: str) -> None:
    """Refuse a count that is not an int32 scalar: a float32 count stops moving at 2**24, and one
    of shape (1,) spreads its shape to the next state's. Known when the step is traced."""
    shape, dtype = jnp.shape(count), jnp.result_type(count)
    if shape != () or dtype != jnp.int32:
        raise TypeError(f"{name}: the state's step count is {dtype} of shape {shape}; a count is an int32 scalar "
                        f"(init() makes one). The state is damaged or not a {name} state")


def _check_count(count, name: str = "packed_adamw") -> None:
    """Refuse a count that is not an int32 scalar (`_check_count_type`), and a negative count
    before the step where it is known (under jit the step is refused in the graph instead, by
    `_refuse_invalid`)."""
    _check_count_type(count, name)
    if isinstance(count, jax.core.Tracer):
        return
    value = int(np.asarray(count))
    if value < 0:
        raise ValueError(f"{name}: the state's step count is {value}; a count is >= 0 (init() starts at 0). "
                         f"The state is damaged or not a {name} state")


def _map_group(f, values) -> tuple:
    """f applied to each of a group's values (`Rule.group_keys` order), and to each element of
    those that are tuples (AdamW's betas)."""
    return tuple(tuple(map(f, v)) if isinstance(v, tuple) else f(v) for v in values)


def _as_given(x):
    return x


def _is_scalar_number(x) -> bool:
    """A real number, or a real array of shape () (optax.inject_hyperparams passes those; traced
    under jit). Bools pass here: the rule's validation refuses them in its own words."""
    if isinstance(x, numbers.Real):
        return True
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        dtype = jnp.result_type(x)
        return jnp.ndim(x) == 0 and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    return False


def _check_hyperparameter_kinds(transform: str, values: dict[str, Any], schedules,
                                refuse_schedule: Callable[[str, Any], str] | None = None) -> None:
    """Each hyperparameter (`values`, by argument name) a number, a scalar array, or (those named
    in `schedules`) a schedule of the count, refused naming it when the transform is built: the
    rule's validation (`allow_arrays`) leaves what is not a number to the caller, and the step
    would fail on it without a name. `transform` starts the messages; `refuse_schedule(name,
    value)` gives the message for a schedule of one not in `schedules`."""
    for name, value in values.items():
        if callable(value) and name not in schedules:
            raise TypeError(refuse_schedule(name, value))
        if isinstance(value, (bool, np.bool_)):  # float(True) would step with 1.0
            raise TypeError(f"{transform}: {name}={value!r} is a bool, not a number: pass a float")
        if not callable(value) and not _is_scalar_number(value):
            raise TypeError(f"{transform}: {name}={value!r} is not a number: pass a float or a scalar array (as "
                            "optax.inject_hyperparams passes)" + (", or a schedule of the step count"
                                                                  if name in schedules else ""))


def _at_count(x, count, name: str = "packed_adamw", field: str = "a hyperparameter"):
    """A hyperparameter's value at `count`: a schedule's value there (a real number of shape (),
    as a value given directly must be, else refused naming `field`), else x as given."""
    if not callable(x):
        return x
    value = x(count)
    if isinstance(value, (bool, np.bool_)) or not _is_scalar_number(value):
        got = (f"{jnp.result_type(value)} of shape {jnp.shape(value)}"
               if isinstance(value, (jax.Array, np.ndarray, np.generic)) else repr(value))
        raise TypeError(f"{name}: the schedule given as {field} returned {got}; a schedule returns a real number of "
                        "shape () at each count (a float or an int, or a 0-d array of one)")
    if isinstance(value, numbers.Real) and not isinstance(value, np.generic) and math.isinf(float_or_inf(value)):
        return float_or_inf(value)  # past a float's range (an int, a Fraction): refused by its bound naming the field
    return value


def _at_count_named(values: tuple, names: tuple, count, name: str) -> tuple:
    """`_at_count` of each of a group's values (`_map_group`'s order: a tuple's elements too),
    `names` the transform's argument names in the same layout."""
    return tuple(tuple(_at_count(v, count, name, n) for v, n in zip(value, field)) if isinstance(value, tuple)
                 else _at_count(value, count, name, field) for value, field in zip(values, names))
