"""optax frontend: `packed_adamw` as a GradientTransformation, and a fused in-place step.

The step over the leaves is either one primitive lowered per platform (`_step.py`, `impl=
"kernel"`): on CUDA the core Triton kernels launched through jax-triton, many leaves per launch
(docs/MULTI_TENSOR.md); on every other platform the numpy step through `jax.pure_callback`,
sharded leaves stepped shard by shard on their own devices (`_sharding.py`). Or, on CUDA GPUs,
the same step written as XLA operations (`_xla_step.py`, `impl="xla"`), which XLA fuses with
the gradient's producer and `optax.apply_updates` and partitions like any elementwise
computation. `impl="auto"` (the default) takes the XLA step on GPUs unless format counts are on,
the primitive elsewhere. Every path follows docs/FORMAT.md, so they give the same bits as
`packed_adamw.torch.PackedAdamW`. docs/JAX.md is the user's page.

A bfloat16 leaf is the live weight of an exact FP32 master (docs/FORMAT.md, "Split masters"):
the state keeps its int16 low half (`PackedAdamWState.low_halves`), the step runs on the
master, and the transform's float32 update is chosen so that `optax.apply_updates` gives the
step's new weight (`_masters.transform_update`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from packed_adamw.core import StateFormat
from packed_adamw.core.adamw.rule import FORMAT_COUNTS
from packed_adamw.core.rule import StateLayout

from . import _masters
from ._hyperparams import (  # noqa: F401  (RefusedStepWarning and the count's helpers: this module's names too)
    RefusedStepWarning,
    _as_given,
    _as_step_count,
    _at_count_named,
    _check_count,
    _check_hyperparameter_kinds,
    _concrete_float,
    _increment,
    _is_step_count,
    _known_or_given,
    _map_group,
    _refusal_reason,
    _refuse_invalid,
    _refused_eagerly,
    _warn_refused,
)
from ._masters import BF16, FLOAT32, LOW_HALF
from ._state_io import export_state, import_state, load_master_weights, master_weights  # noqa: F401 (names here too)
from ._states import (  # noqa: F401  (the state types and state_format: this module's names too)
    FormatCounts,
    PackedAdamWState,
    PackedMuonState,
    _check_low_halves,
    _is_ours,
    _leaf_name,
    _split_flags,
    _zero_format_counts,
    state_format,
)
from ._sharding import sharded_step
from ._rules import ADAMW
from ._step import RuleSteps, StepConfig, StepOperands, StepResults
from ._xla_step import xla_step

# optax.adamw's default; torch.optim.AdamW (and PackedAdamW) use 1e-2.
DEFAULT_WEIGHT_DECAY = 1e-4
IMPLS = ("auto", "kernel", "xla")


def _on_cuda_xla_step(operands: StepOperands, *, config: StepConfig, xla_platform: str = "cuda") -> StepResults:
    """The XLA step where the step is lowered for CUDA, the primitive elsewhere (a GPU host's
    CPU): both are traced, one is lowered. (`xla_platform` lets the tests stage it for the CPU.)"""
    return StepResults.of(_staged_step(config, xla_platform)(*operands.flat(config)), config)


@functools.lru_cache(maxsize=128)
def _staged_step(config: StepConfig, xla_platform: str):
    """`_on_cuda_xla_step`'s choice for one config, jitted: an eager call then lowers it for
    its arguments' devices and compiles once (called eagerly, `lax.platform_dependent` would
    pick the default device's branch, and run the XLA step one operation at a time); under an
    outer jit it is inlined. The cache keeps one jitted function per config for the process's
    life, as `_sharding._mapped` does."""
    def staged(*flat):
        return lax.platform_dependent(
            *flat,
            default=lambda *flat: sharded_step(StepOperands.of(flat, config), config=config).flat(config),
            **{xla_platform: lambda *flat: xla_step(StepOperands.of(flat, config), config=config).flat(config)})

    return jax.jit(staged)


def _step_platforms(tree) -> set[str]:
    """The platforms the step runs on: the default backend's, and every concrete leaf's."""
    platforms = {jax.default_backend()}
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.core.Tracer) and isinstance(leaf, jax.Array):
            platforms |= {d.platform for d in leaf.devices()}
    return platforms


# The names of the per-feature state types of version 1.0 (tracked counts, bf16 leaves): the
# one state type now. Kept so that imports and isinstance checks keep working.
PackedAdamWTrackedState = PackedAdamWState
PackedAdamWSplitState = PackedAdamWState

# optax.tree_utils.tree_map_params calls `init` on a placeholder with no leaves and no dtypes,
# then maps its function over the fields where the placeholder comes back (the copies of the
# parameters' tree). Whether a tree has low halves depends on its dtypes, which the placeholder
# lacks, so `init` gives the placeholder's state this mark instead: a leaf, which matches the
# field whatever it holds (None, or the low halves), and which tree_map_params treats as a
# non-parameter field (`transform_non_params`, if given, applies to it).
_LOW_HALVES_UNKNOWN = "low halves: known only from the parameters' dtypes"


def _is_params_placeholder(params) -> bool:
    """Whether `params` is optax's `tree_map_params` placeholder (a leafless node of optax's)."""
    kind = type(params)
    return kind.__module__.startswith("optax.") and kind.__name__ == "_ParamsPlaceholder"


def _has_format_counts(state) -> bool:
    return state.format_counts is not None


def _accumulated(counts, step_counts):
    """64-bit totals as (low, high) uint32 halves, plus one step's uint32 counts."""
    low = counts[..., 0] + step_counts  # wraps modulo 2**32; the carry goes to the high half
    high = counts[..., 1] + (low < step_counts).astype(jnp.uint32)
    return jnp.stack([low, high], axis=-1)


def _check_format_counts(state, tracked: bool, n_leaves: int, count_names: tuple[str, ...],
                         name: str = "packed_adamw") -> None:
    has_counts = _has_format_counts(state)
    if tracked and not has_counts:
        raise ValueError(
            f"{name}: the transform counts formats (track_format=True) but the state has no format counts; "
            "build it with init() (or import_state(..., track_format=True)) of a transform with track_format=True")
    if not tracked and has_counts:
        raise ValueError(
            f"{name}: the state carries format counts (a track_format=True state) but the transform was built "
            "with track_format=False; build both with the same track_format")
    if not tracked:
        return
    expected = FormatCounts(jax.ShapeDtypeStruct((), jnp.dtype(jnp.int32)),
                            jax.ShapeDtypeStruct((n_leaves, len(count_names), 2), jnp.dtype(jnp.uint32)))
    got = FormatCounts(*(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in state.format_counts))
    if got != expected:
        raise ValueError(f"{name}: the state's format counts are {got}, expected {expected} for "
                         f"{n_leaves} leaves; build the state with init() over the same parameters")


def _check_grad_dtypes(flat_grads, split: list[bool], name: str = "packed_adamw") -> None:
    """A float32 leaf takes float32 gradients; a bfloat16 leaf bfloat16 or float32 ones
    (`flat_grads`: the gradients' (path, leaf) pairs)."""
    for (path, g), is_split in zip(flat_grads, split):
        dtype = jnp.result_type(g)
        if dtype == FLOAT32 or (is_split and dtype == BF16):
            continue
        allowed = "bfloat16 or float32 (a bfloat16 parameter)" if is_split else "float32 (a float32 parameter)"
        raise TypeError(f"grads leaf {_leaf_name(path)} has dtype {dtype}: {name} takes gradients of dtype "
                        f"{allowed}; cast the gradient with .astype(jnp.float32)")


def _moments_spec(leaf, fmt: StateFormat) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(fmt.state_shape(jnp.shape(leaf)), jnp.dtype(fmt.state_dtype))


def _zero_moments(leaf, fmt: StateFormat):
    """Zero state for one leaf, placed as the leaf is (as optax's own zeros_like states are):
    a concrete sharded leaf, a `ShapeDtypeStruct` with a sharding, or a traced leaf with
    sharding in types give state words with that sharding: the state entry's leading axes
    (fp32 mode's [2, *shape]) are stacked outside the leaf's, so they stay unsharded, as
    `StateEntry.sharding` declares."""
    zeros = jnp.zeros_like(leaf, dtype=jnp.dtype(fmt.state_dtype))
    for size in reversed(fmt.state_entry.leading):
        zeros = jnp.stack([zeros] * size)
    return zeros


def _check_state(moments, params, fmt: StateFormat, name: str = "packed_adamw") -> None:
    expected = jax.tree_util.tree_map(lambda p: _moments_spec(p, fmt), params)
    got = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(jnp.shape(s), jnp.result_type(s)), moments)
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got) or expected != got:
        raise ValueError(
            f"{name}: the optimizer state does not match the gradients for mode {getattr(fmt, 'mode', None)!r} "
            f"(format {fmt.identity}); expected {expected}, got {got}. Build the state with init() of a "
            "transform with the same mode and biases over the same parameters"
        )


def _mask_flags(mask, params, name: str = "packed_adamw"):
    """Per-leaf switch from an optax-style mask (AdamW's weight-decay mask): a pytree of bools
    matching params or a prefix of them, or a callable returning one. True where a leaf is
    selected (all leaves without a mask)."""
    if mask is None:
        return jax.tree_util.tree_map(lambda _: True, params)
    flags = mask(params) if callable(mask) else mask

    def broadcast(flag, subtree):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: mask entries must be Python bools known before compilation, got {flag!r}")
        return jax.tree_util.tree_map(lambda _: bool(flag), subtree)

    try:
        jax.tree_util.tree_structure(flags).flatten_up_to(params)
    except (ValueError, TypeError):
        raise ValueError(
            f"{name}: mask has the tree {jax.tree_util.tree_structure(flags)}, which is neither the parameters' "
            f"tree {jax.tree_util.tree_structure(params)} nor a prefix of it; give one bool per parameter leaf (or "
            "per subtree of a prefix), or a callable that returns such a tree from the parameters") from None
    return jax.tree_util.tree_map(broadcast, flags, params)


def _adamw_group(learning_rate, b1, b2, eps, weight_decay) -> tuple:
    """The transform's arguments as AdamW's rule takes a group's values (`RULE.group_keys`:
    lr, betas, eps, weight_decay). Each may be a schedule of the count (as packed_muon's
    learning rate, beta, weight_decay and eps may), read at the count as an injected array is;
    anything else that is not a number or a scalar array is refused here, naming it."""
    values = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    _check_hyperparameter_kinds("packed_adamw", values, schedules=tuple(values))
    return learning_rate, (b1, b2), eps, weight_decay


_ADAMW_GROUP_NAMES = ("learning_rate", ("b1", "b2"), "eps", "weight_decay")  # `_adamw_group`'s layout


class _Stepper:
    """What the transform and the fused step share: hyperparameters, format, the step over
    leaves. `group`: the hyperparameters in the rule's `group_keys` order (the learning rate
    first), each a number, an array or a schedule of the count. `mode`: AdamW's mode (with the
    biases, as `state_format` takes them), or any rule's state format, whose `rule` is the
    rule `steps` (`RuleSteps`; AdamW's when left out) runs; `name` starts the messages."""

    def __init__(self, group, mask, mode, m_bias, rms_bias, multi_tensor, reuse_grad_buffer=False,
                 track_format=False, impl="auto", *, steps: RuleSteps | None = None, name: str = "packed_adamw",
                 group_names: tuple | None = None):
        if isinstance(mode, StateLayout) and not isinstance(mode, StateFormat):  # another rule's format
            self.fmt = mode
        else:
            self.fmt = state_format(mode, m_bias, rms_bias)
        self.rule, self.name = self.fmt.rule, name
        self.steps = ADAMW if steps is None else steps  # (read when built: tests replace AdamW's steps)
        if impl not in IMPLS:
            raise ValueError(f"{name}: impl={impl!r}: pass 'auto' (the default), 'kernel' or 'xla'")
        if impl == "xla" and track_format:
            raise ValueError(f"{name}: impl='xla' does not count formats; with track_format=True use "
                             "impl='kernel' (or 'auto', which picks it)")
        self.impl = impl
        self.warn_refused = functools.partial(_warn_refused, name, self.rule)  # `_report_refusal`'s host side
        if track_format not in (True, False):
            raise TypeError(f"{name}: track_format={track_format!r}: pass True or False")
        if track_format and self.fmt.formats is None:  # (AdamW's fp32 mode)
            raise ValueError(f"{name}: track_format=True counts where packed or fp16 codes saturate, flush or "
                             f"go subnormal; {self.fmt.mode} mode stores float32 moments: use mode='packed' or "
                             "'fp16'")
        self.track_format = bool(track_format)
        self.reuse_grad_buffer = bool(reuse_grad_buffer)
        # Numbers and concrete arrays (optax.inject_hyperparams outside jit) are checked now;
        # traced ones and schedules are checked in the graph.
        self.rule.validate(*_map_group(_known_or_given, group), allow_arrays=True)
        self.group = tuple(group)
        # the arguments the group's values came from, in its layout (messages); packed_rule's are the keys
        self.group_names = group_names or tuple(
            tuple(f"{key}[{i}]" for i in range(len(value))) if isinstance(value, tuple) else key
            for key, value in zip(self.rule.group_keys, self.group))
        self.mask = mask
        self.multi_tensor = bool(multi_tensor)

    def step_function(self, tree, counting: bool):
        """The step over the leaves, `step(operands, config=config) -> StepResults`: the
        primitive (`sharded_step`), or on CUDA GPUs the XLA step (`xla_step`).

        The XLA step only on CUDA: there XLA keeps float32 subnormals and the step's bits are
        the contract's (tests/jax_frontend/test_jax_xla_step.py); XLA's CPU runtime flushes them, so on a CPU
        the numpy step (the primitive's callback) stays. Under `jax.jit` the arrays are tracers
        and the platform is known only when the step is lowered, so on a host with a GPU the
        choice is staged out (`lax.platform_dependent`): arrays placed on such a host's CPU
        still take the numpy step. A CPU-only host never stages the XLA step."""
        if self.impl == "kernel" or (self.impl == "auto" and counting):
            return sharded_step
        platforms = _step_platforms(tree)
        if "gpu" not in platforms:
            if self.impl == "xla":
                raise ValueError(
                    f"{self.name}: impl='xla' runs on CUDA GPUs only, and this step's arrays are on "
                    f"{sorted(platforms)}: XLA's CPU runtime flushes float32 subnormals, which the contract keeps. "
                    "Use impl='auto' (the default) or 'kernel'")
            return sharded_step
        return _on_cuda_xla_step

    def _check_params_unread(self, given, leaf_rows) -> None:
        """An update without params: refused unless every leaf's update is the same for any
        finite parameter (its row holds 0 in each field the update reads the parameter through,
        `Rule.param_read_through`: AdamW's weight_decay, unless the mask leaves it out)."""
        value = dict(zip(self.rule.hyperparam_fields, given))
        for variant in sorted(set(leaf_rows)):
            fields = self.rule.param_reading_fields(variant)
            if fields is None:
                raise ValueError(f"{self.name}: the update reads the parameters, so update() needs params: call "
                                 "tx.update(grads, state, params)")
            for field in fields:
                if _concrete_float(value[field]) is None:
                    raise ValueError(
                        f"{self.name}: {field} is not known to be zero (it is traced, e.g. injected by "
                        "optax.inject_hyperparams under jit), so update() needs params: call "
                        "tx.update(grads, state, params)"
                    )
                if _concrete_float(value[field]) != 0.0:
                    raise ValueError(
                        f"{self.name}: {field} is nonzero, so update() needs params; call "
                        f"tx.update(grads, state, params), or set {field}=0"
                    )

    def init(self, params):
        count = jnp.zeros([], jnp.int32)
        moments = jax.tree_util.tree_map(lambda p: _zero_moments(p, self.fmt), params)
        counts = (_zero_format_counts(len(jax.tree_util.tree_leaves(params)), self.rule.count_names)
                  if self.track_format else None)
        if _is_params_placeholder(params):  # optax.tree_utils.tree_map_params: no dtypes to go by
            return PackedAdamWState(count, moments, _LOW_HALVES_UNKNOWN, counts)
        low_halves = None
        if any(_split_flags(params, name=self.name)):  # a low half of 0: each master starts at its bf16 weight
            low_halves = jax.tree_util.tree_map(
                lambda p: jnp.zeros_like(p, dtype=LOW_HALF) if jnp.result_type(p) == BF16 else None, params)
        return PackedAdamWState(count, moments, low_halves, counts)

    def counting(self, track_format) -> bool:
        """Whether this step counts: the transform's `track_format` unless the caller's
        per-step `track_format` (a Python bool, static under jit) turns it off. `True` only
        leaves it on: optax trees hand the argument to every member, counting or not."""
        if track_format is None:
            return self.track_format
        if not isinstance(track_format, bool):
            raise TypeError(
                f"{self.name}: update(..., track_format={track_format!r}) picks the step's launch, so it must be a "
                "Python bool known when the step is traced; under jax.jit pass it as a static argument "
                "(jax.jit(train_step, static_argnames='track_format')), one compilation each way")
        return self.track_format and track_format

    def run(self, grads, state, params, *, write_update: bool, track_format: bool | None = None):
        if not isinstance(state, PackedAdamWState):
            raise TypeError(f"{self.name}: the state is a {type(state).__name__}; pass the state init() returned")
        counting = self.counting(track_format)
        flat_grads, treedef = jax.tree_util.tree_flatten_with_path(grads)
        if params is None:
            split = [False] * treedef.num_leaves
            if state.low_halves is not None:
                raise ValueError(
                    f"{self.name}: the parameters have bfloat16 leaves, whose weights are half of their FP32 "
                    "masters, so update() needs params: call tx.update(grads, state, params)")
        else:
            split = _split_flags(params, name=self.name)
        _check_grad_dtypes(flat_grads, split, self.name)
        _check_state(state.moments, grads, self.fmt, self.name)
        lows = _check_low_halves(state, treedef, grads if params is None else params, split, self.name)
        _check_format_counts(state, self.track_format, treedef.num_leaves, self.rule.count_names, self.name)
        _check_count(state.count, self.name)
        rule = self.rule
        selected = treedef.flatten_up_to(_mask_flags(self.mask, grads if params is None else params, self.name))
        leaf_rows = tuple(rule.leaf_variant(masked_in) for masked_in in selected)
        at_count = _at_count_named(self.group, self.group_names, state.count, self.name)  # schedules' values
        given = rule.group_row(*at_count, number=_as_given)  # hyperparam_fields order, as given
        if params is None:
            self._check_params_unread(given, leaf_rows)
            params = grads  # never read: the fields the update reads it through are 0
        paths = tuple(jax.tree_util.keystr(path) for path, _ in flat_grads)
        params, grads = treedef.flatten_up_to(params), [g for _, g in flat_grads]
        moments = treedef.flatten_up_to(state.moments)
        rows = jnp.asarray(rule.variant_rows(given), jnp.float32)  # the leaves' rows: AdamW's mask
        hparams, valid = _refuse_invalid(rule, rows, state.count)
        # Known outside jit (a schedule's value, say): say so instead of refusing silently; under
        # jit refused in the graph, and heard as `_refused_eagerly` says (docs/JAX.md).
        refused, receipt = _refused_eagerly(self.name, rule, self.warn_refused, at_count, rows[0], valid, state.count)
        if refused:
            raise ValueError(f"{self.name}: invalid hyperparameters at count {int(state.count)}: "
                             f"{_refusal_reason(rule, np.asarray(rows)[0], int(state.count))}")
        count = jnp.where(valid, _increment(state.count), state.count) + receipt
        step_count = jnp.where(valid, count, 1)  # a refused step's rows are NaN: any count in range will do
        config = StepConfig(fmt=self.fmt, steps=self.steps, write_update=write_update, multi_tensor=self.multi_tensor,
                            leaf_rows=leaf_rows, paths=paths,
                            alias_grads=write_update and self.reuse_grad_buffer, track_format=counting,
                            split=tuple(i for i, lo in enumerate(lows) if lo is not None))
        step = self.step_function((params, grads, moments), counting)
        results = step(StepOperands(params, grads, moments, lows, hparams, step_count), config=config)
        outs, new_lows = results.outs, results.lows
        if write_update:  # a split leaf's out is its new weight: the update that gives it (_masters)
            for i in config.split:
                outs[i], new_lows[i] = _masters.transform_update(params[i], outs[i], new_lows[i])
        format_counts = state.format_counts if self.track_format else None  # an uncounted step keeps them
        if counting:
            # A refused step rejects every element, so it adds no counts; nor does it count as a step.
            old = state.format_counts
            format_counts = FormatCounts(steps=jnp.where(valid, _increment(old.steps), old.steps),
                                         counts=_accumulated(old.counts, results.counts))
        low_halves = None if state.low_halves is None else treedef.unflatten(new_lows)
        return treedef.unflatten(outs), PackedAdamWState(count, treedef.unflatten(results.states), low_halves,
                                                         format_counts)


def packed_adamw(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    mask: Any = None,
    mode: str | StateFormat = "packed",
    *,
    m_bias: int | None = None,
    rms_bias: int | None = None,
    multi_tensor: bool = True,
    reuse_grad_buffer: bool = True,
    track_format: bool = False,
    impl: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """AdamW with one uint32 word of state per float32 parameter, as an optax transformation.

    Like `optax.adamw` (same defaults, `weight_decay=1e-4` included): `learning_rate` is a
    float or a schedule of the step count, and `mask` (a pytree of bools or a callable
    returning one) limits weight decay to some leaves. `b1`, `b2`, `eps` and `weight_decay` may
    be schedules too (as packed_muon's beta, eps and weight_decay; optax.adamw takes one for its
    weight decay), each read at `PackedAdamWState.count` as its float32 value, the bits of a
    transform built from that value; one that turns invalid refuses the step as an invalid
    learning rate does. The returned updates u satisfy
    `optax.apply_updates(params, u) == PackedAdamW's in-place step` bit for bit.

    `mode` is "packed" (4 bytes/parameter), "fp16" (4) or "fp32" (8), or a
    `packed_adamw.core.StateFormat` that also carries the exponent biases
    (`StateFormat("packed", m_bias=18, rms_bias=18)`); `m_bias` / `rms_bias` (default 15) are
    the same biases given separately. A format object stays static under
    `optax.inject_hyperparams` without `static_args`.

    `impl` picks how the step runs; every choice gives the same bits. "xla": as XLA
    operations, which XLA fuses with the gradient's producer and `optax.apply_updates`, where
    the step is lowered for CUDA (refused on a host with no GPU: XLA's CPU runtime flushes
    subnormals; arrays on a GPU host's CPU take the numpy step); on an H100 0.69x optax.adamw's
    optimizer time in a jitted train step, peak 12 bytes/parameter (docs/JAX.md). "kernel": the
    Triton kernel through jax-triton on CUDA, the numpy step on other platforms. "auto" (the
    default): the XLA step where the step is lowered for CUDA, unless `track_format` is on; the
    kernel path everywhere else.
    The kernel's options: on CUDA, `multi_tensor=True` updates up to 16 leaves per kernel
    launch (leaves of 2**24 elements or more get their own); `False` launches once per leaf.
    With `reuse_grad_buffer=True` the CUDA kernel writes u into the gradient's buffer, so a
    jitted train step whose gradients are computed in the step needs no buffer for u (its
    peak is parameters + state + gradients); gradients passed into the jitted function and
    kept by the caller are then copied first, so for such a step with the kernel pass False.
    Same bits. The XLA step ignores both: XLA places its buffers and partitions sharded leaves;
    with the kernel, sharded leaves are updated shard by shard on their own devices
    (docs/JAX.md).
    Gradient elements that are NaN or Inf get update -0.0 and keep their state; wrap the
    transform in `optax.apply_if_finite` to skip such steps whole.

    `track_format=True` (packed and fp16 modes) counts, in the step, per leaf, the elements
    whose new first moment or RMS saturated, flushed to zero or landed subnormal
    (docs/FORMAT.md, "Format counts"). The counts live in the state
    (`PackedAdamWState.format_counts`, cumulative since init, replicated over a mesh),
    so they work under `jax.jit` and the step never waits for them; `format_stats(state)`
    reads them. Off (the default) the step, its launches and its state are as without it.
    To count only some steps (those a training loop logs), pass `track_format=False` to
    `update` on the others (a Python bool: static under `jax.jit`; `optax.chain` passes it
    through): they run the uncounted launch and leave the counts as they were.

    bfloat16 leaves are the live weights of exact FP32 masters (docs/FORMAT.md, "Split
    masters"): the state (`PackedAdamWState.low_halves`) keeps each one's int16 low half, the step
    runs on the master (the bits of a float32 leaf holding it), and their gradients may be
    bfloat16 or float32. Their updates are float32, u = float32(new weight) - float32(weight),
    so that `optax.apply_updates(params, u)` gives the new bf16 weight; apply them unchanged
    (the low half belongs to that weight). docs/JAX.md ("bf16 leaves") gives the rare elements
    where no float32 u can, and what the state does there. `master_weights(params, state)`
    returns the masters; `load_master_weights` sets them.
    """
    return _transform(_Stepper(_adamw_group(learning_rate, b1, b2, eps, weight_decay), mask, mode, m_bias, rms_bias,
                               multi_tensor, reuse_grad_buffer, track_format, impl,
                               group_names=_ADAMW_GROUP_NAMES))


def packed_rule(
    steps: RuleSteps,
    fmt: StateLayout,
    mask: Any = None,
    *,
    multi_tensor: bool = True,
    reuse_grad_buffer: bool = True,
    track_format: bool = False,
    name: str | None = None,
    **hyperparams,
) -> optax.GradientTransformationExtraArgs:
    """Any elementwise rule as an optax transformation (docs/ARCHITECTURE.md, "How a rule plugs
    in"): `steps` its numpy steps, host step scalars and Triton entry points (`RuleSteps`;
    the rule it names must be fmt's), `fmt` its state format (whose `rule` declares the rest), `hyperparams` a group's values by
    the rule's `group_keys` (each a number, a scalar array or a schedule of the count; a tuple,
    as AdamW's betas, of those). Its state is `PackedAdamWState` (`moments`: the rule's state
    entry per leaf), its step the primitive's (`impl="kernel"` of `packed_adamw`: the numpy step
    on CPU, the Triton kernels on CUDA), bf16 leaves split masters, `mask` a leaf selection for
    the rule's `masked_variant`, `track_format` its format counts: as `packed_adamw`, which is
    this transform of AdamW's rule (with, on CUDA, AdamW's XLA step besides). `name` starts its
    messages (the rule's name by default)."""
    if not isinstance(fmt, StateLayout):
        raise TypeError(f"packed_rule: fmt={fmt!r} must be the rule's state format (a core.rule.StateLayout, as "
                        "packed_adamw.core.StateFormat() is AdamW's), which names its rule")
    rule = fmt.rule
    name = name or rule.name
    steps_rule = steps.rule
    if steps_rule != rule:  # its numpy step and kernels would misread the rows and state
        raise TypeError(f"{name}: steps steps rule {steps_rule.name!r} but fmt's rule is {rule.name!r}; give the "
                        "RuleSteps and the state format of one rule")
    if set(hyperparams) != set(rule.group_keys):
        raise TypeError(f"{name}: pass the hyperparameters {', '.join(rule.group_keys)} (the rule's group keys), "
                        f"got {', '.join(sorted(hyperparams)) or 'none'}")
    flat = {}
    for key in rule.group_keys:
        value = hyperparams[key]
        flat.update({f"{key}[{i}]": v for i, v in enumerate(value)} if isinstance(value, tuple) else {key: value})
    _check_hyperparameter_kinds(name, flat, schedules=tuple(flat))
    group = tuple(hyperparams[key] for key in rule.group_keys)
    return _transform(_Stepper(group, mask, fmt, None, None, multi_tensor, reuse_grad_buffer, track_format, "kernel",
                               steps=steps, name=name))


def _transform(stepper: _Stepper) -> optax.GradientTransformationExtraArgs:
    def update_fn(updates, state, params=None, *, track_format: bool | None = None, **extra_args):
        del extra_args  # accepted, as every optax alias does, and unused
        return stepper.run(updates, state, params, write_update=True, track_format=track_format)

    return optax.GradientTransformationExtraArgs(stepper.init, update_fn)


def packed_adamw_fused_step(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    mask: Any = None,
    mode: str | StateFormat = "packed",
    *,
    m_bias: int | None = None,
    rms_bias: int | None = None,
    multi_tensor: bool = True,
    track_format: bool = False,
    impl: str = "auto",
) -> Callable[[Any, Any, PackedAdamWState], tuple[Any, PackedAdamWState]]:
    """`step(params, grads, state) -> (params, state)`: the same step, writing parameters
    directly. Under `jax.jit(step, donate_argnums=(0, 2))` on CUDA it updates the donated
    buffers in place (20 bytes of traffic per parameter). The state is the transform's:
    `packed_adamw(...).init(params)` with the same arguments (`track_format` included; as in
    `update`, `step(..., track_format=False)` leaves a step uncounted). A
    bfloat16 leaf gets its new weight and the state its new low half, in place likewise.
    `impl` as for `packed_adamw`.
    """
    stepper = _Stepper(_adamw_group(learning_rate, b1, b2, eps, weight_decay), mask, mode, m_bias, rms_bias,
                       multi_tensor, track_format=track_format, impl=impl, group_names=_ADAMW_GROUP_NAMES)

    def step(params, grads, state, *, track_format: bool | None = None):
        return stepper.run(grads, state, params, write_update=False, track_format=track_format)

    return step


def _tracked_state(state):
    """The one packed_adamw state with format counts inside an optax state (chain,
    inject_hyperparams, ...)."""
    found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_ours) if _is_ours(x)]
    tracked = [x for x in found if _has_format_counts(x)]
    if len(tracked) == 1:
        return tracked[0]
    if len(tracked) > 1:
        raise ValueError(f"format_stats: the state holds {len(tracked)} packed_adamw states with format counts; "
                         "pass the one you mean (say, state[1] of an optax.chain)")
    muon = lambda x: isinstance(x, PackedMuonState)  # noqa: E731
    if any(muon(x) for x in jax.tree_util.tree_leaves(state, is_leaf=muon)):
        raise ValueError("format_stats: this is packed_muon's state, and packed_muon counts no format events (it "
                         "takes no track_format); torch's PackedMuonAdamW(track_format=True) counts both rules'")
    if found:
        raise ValueError("format_stats: the packed_adamw state has no format counts; build the transform with "
                         "packed_adamw(..., track_format=True)")
    raise ValueError(f"format_stats: no packed_adamw state in {type(state).__name__}; pass the state of a "
                     "packed_adamw(..., track_format=True) transform, or an optax state that contains it")


def format_stats(state, params=None, *, count_names: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
    """Where the moments landed in their formats since `init`, per leaf, from the state of a
    `packed_adamw(..., track_format=True)` transform (or an optax state holding one, such as
    a chain's or inject_hyperparams').

    Returns, keyed by each leaf's tree path (`jax.tree_util.keystr`, "" for a bare array), the
    keys of torch's `PackedAdamW.format_stats()` as Python ints: `elements` (element-steps
    counted), `saturated_m`, `saturated_rms`, `flushed_m`, `flushed_rms`, `subnormal_m`,
    `subnormal_rms` (docs/FORMAT.md, "Format counts"). Unlike torch's, which resets on
    read, the counts are cumulative since init: the state is a value, so take differences
    between two reads. Reading waits for the step that produced the state (call it outside
    jit; inside, `state.format_counts` is the data). `params`, if given, must be the
    parameters the state belongs to (checked: tree and shapes). `count_names`: the counts'
    names for a `packed_rule` state of another rule (its `fmt.rule.count_names`; AdamW's by
    default), checked against the counts the state holds.
    """
    tracked = _tracked_state(state)
    flat = jax.tree_util.tree_flatten_with_path(tracked.moments)[0]
    if params is not None:
        want = [(jax.tree_util.keystr(path), tuple(jnp.shape(m))) for path, m in flat]
        got = [(jax.tree_util.keystr(path), tuple(jnp.shape(p)))
               for path, p in jax.tree_util.tree_flatten_with_path(params)[0]]
        if want != got:
            raise ValueError(f"format_stats: the state's leaves {want} are not those of params {got}; pass the "
                             "parameters the state was built for")
    if any(isinstance(x, jax.core.Tracer) for x in tracked.format_counts):
        raise TypeError("format_stats reads the counts on the host, so it cannot run under jax.jit; call it on the "
                        "state a jitted step returned, or read state.format_counts inside")
    names = FORMAT_COUNTS if count_names is None else tuple(count_names)
    counted_dtype = jnp.dtype(StateFormat().state_dtype)  # the words of AdamW's modes with counts (packed, fp16)
    if count_names is None and any(jnp.result_type(m) != counted_dtype for _, m in flat):
        held = sorted({str(jnp.result_type(m)) for _, m in flat})
        raise ValueError(f"format_stats: the state's moments are {', '.join(held)}, not packed_adamw's "
                         f"{counted_dtype} words: it is a packed_rule state of another rule, whose counts AdamW's "
                         "names would mislabel; pass count_names=fmt.rule.count_names of its rule's state format")
    if tracked.format_counts.counts.shape[1] != len(names):
        held = tracked.format_counts.counts.shape[1]
        raise ValueError(f"format_stats: the state holds {held} format counts per leaf, not the {len(names)} of "
                         f"{names}; for a packed_rule state pass count_names="
                         "fmt.rule.count_names of its rule's state format")
    halves = np.asarray(tracked.format_counts.counts).astype(np.uint64)
    totals = halves[..., 0] + (halves[..., 1] << np.uint64(32))
    steps = int(np.asarray(tracked.format_counts.steps))
    return {
        jax.tree_util.keystr(path): {"elements": steps * int(np.prod(jnp.shape(m), dtype=np.int64)),
                                     **{name: int(c) for name, c in zip(names, totals[i])}}
        for i, (path, m) in enumerate(flat)
    }


__all__ = ["DEFAULT_WEIGHT_DECAY", "FormatCounts", "PackedAdamWSplitState", "PackedAdamWState",
           "PackedAdamWTrackedState", "RefusedStepWarning", "export_state", "format_stats", "import_state",
           "load_master_weights", "master_weights", "packed_adamw", "packed_adamw_fused_step", "packed_rule",
           "state_format"]
