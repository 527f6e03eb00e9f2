"""The step over one device's leaves as a JAX primitive, lowered per platform.

`local_step` binds `packed_adamw_step`, a primitive whose lowering is chosen by the platform
the computation is compiled for: on CUDA the jax-triton launches of `_triton_launch`, on
every other platform (CPU first of all) the numpy step through one `jax.pure_callback`.

Why a primitive and not `jax.default_backend()` or `jax.lax.platform_dependent`: the
backend default says nothing about where the arrays are (arrays placed on the CPU of a GPU
host, or `jit(..., backend="cpu")`, compile for the CPU), and `platform_dependent` traces
every branch when the step is traced, so the CUDA branch would import jax_triton, which fails
with a CPU-only jaxlib. A lowering rule runs only for the platform being compiled, so the
CUDA rule, and with it `import jax_triton`, is reached only when compiling for a GPU.

The primitive sees the shapes of the arrays it is given: under `shard_map` or a
`custom_partitioning` partition (`_sharding.py`) those are one device's shards, so every
leaf-group table and callback works on the local shards (a rule with a matrix phase is given
whole leaves: `_sharding.sharded_step`).

The primitive knows no rule: `StepConfig.fmt` is the rule's state format (its layout, and its
`rule` declaring the hyperparameter and scalar rows and the format counts) and `StepConfig.steps`
its numpy step and Triton entry points (`RuleSteps`; AdamW's is `_rules.ADAMW`). It takes one
hyperparameter row per row variant of the rule (`Rule.variant_rows`) and steps each leaf with
the row `StepConfig.leaf_rows` gives it. A rule whose step is not elementwise (Muon: a
Newton-Schulz phase over whole matrices between two elementwise phases, `_rules.MUON`) gives its
own lowering instead (`RuleSteps.lower`, traced for "cuda" or "host"), its static settings in
`StepConfig.options` and its per-matrix exponents among the operands and results; outside a
trace it runs that lowering's operations one by one (`_impl`).

With `StepConfig.track_format` the primitive has one more output, the step's format counts
(docs/FORMAT.md, "Format counts") of each leaf's elements on this device: uint32
[n_leaves, len(fmt.rule.count_names)]. Without it the primitive, its outputs and its launches
are what they are without counting.

Leaves listed in `StepConfig.split` are bf16 live weights of FP32 masters (docs/FORMAT.md,
"Split masters"): the primitive takes their int16 low halves and returns their new weights
(never an update: the transform derives u from the new weight) and new low halves. Their
gradients may be bf16 or float32.

The primitive's operands and results are flat lists; `StepOperands` and `StepResults` are the
one place that orders them (`flat` / `of`), and everything else (the transform, the lowerings,
the host callback, `shard_map` specs, `custom_partitioning` shardings and sharding rule) goes
through them.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from packed_adamw.core.rule import Rule, StateLayout

# A step's counts of one leaf on one device travel as uint32, so a counted leaf (or its shard
# on a device) must have fewer elements than this.
COUNTABLE_ELEMENTS = 1 << 32


@dataclasses.dataclass(frozen=True)
class RuleSteps:
    """A rule's step as the primitive runs it, the same bits on every platform. An elementwise rule
    gives its numpy step (CPU) and Triton entry points (CUDA), which the primitive's own lowerings
    run over its leaves; a rule with a matrix phase (Muon's Newton-Schulz between two elementwise
    phases) gives `lower` instead, its whole step over the leaves for one platform. Its state format
    (`StepConfig.fmt`) gives the rest; `rule`, the rule they step, is checked against that format's
    (`packed_rule`)."""

    # the rule they step (its bounds are a dict, so the functions below identify the steps)
    rule: Rule = dataclasses.field(compare=False)
    # numpy, in place: (p, g, state, scalar row, *, fmt, update_out, format_counts_out)
    apply_step: Callable | None = None
    # numpy, in place: (bf16 weight's bits, low half, g, state, scalar row, *, fmt, format_counts_out)
    apply_split_step: Callable | None = None
    step_scalar_row: Callable | None = None  # (count, hyperparameter row) -> the row of step scalars
    # () -> the rule's core.kernel.FunctionalKernels, called only when compiling for CUDA (it imports Triton)
    kernels: Callable | None = None
    # (operands, config, platform) -> StepResults, traced for the platform being compiled ("cuda", or
    # "host" for every other): the step of a rule that is not elementwise; None for an elementwise rule
    lower: Callable | None = None
    # (transform, peer): the optax transformation stepping this rule, for the refusal of a derivative
    # (`not_differentiable`), and the one that differentiates
    names: tuple[str, str] = ("packed_adamw", "optax.adamw")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step's compiled code depends on besides array shapes (hashable)."""

    fmt: StateLayout  # the rule's state format
    steps: RuleSteps
    write_update: bool
    multi_tensor: bool
    leaf_rows: tuple[int, ...]  # per leaf: its row of hparams (its rule's row variant, `Rule.leaf_variant`)
    paths: tuple[str, ...]  # per leaf, for messages
    alias_grads: bool = False  # CUDA transform: write u into the gradient's buffer
    track_format: bool = False  # one more output: the step's format counts per leaf
    split: tuple[int, ...] = ()  # the leaves that are bf16 weights with split masters (a low half each)
    options: Any = None  # a `lower` rule's own static settings (hashable): Muon's matrices, Newton-Schulz

    @property
    def n_leaves(self) -> int:
        return len(self.leaf_rows)

    @property
    def has_exponents(self) -> bool:
        """Whether each leaf's state has a per-matrix exponent beside its entry (`exponent_entry`:
        Muon's packed mode), an operand and a result of the primitive."""
        return self.fmt.exponent_entry is not None

    def per_leaf(self, compact) -> list:
        """The split leaves' arrays (in `split` order) -> one entry per leaf, None where FP32."""
        full = [None] * self.n_leaves
        for i, x in zip(self.split, compact):
            full[i] = x
        return full


def counts_shape(config: StepConfig) -> tuple[int, int]:
    """The shape of one step's format counts: a row of the rule's count names per leaf."""
    return (config.n_leaves, len(config.fmt.rule.count_names))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "grads", "states", "lows", "hparams",
                                                                  "count", "exponents"], meta_fields=[])
@dataclasses.dataclass
class StepOperands:
    """The step primitive's operands, by name. `lows` has one entry per leaf: the low half of a
    leaf in `config.split`, None for a FP32 leaf. Also used for what follows the operands
    (their shardings, specs, sharding-rule factors). `hparams` is float32 [rows,
    rule.hyperparam_row], the rule's `variant_rows` (`config.leaf_rows` picks each leaf's; NaN
    rows: a step refused in the graph, `_hyperparams._refuse_invalid`), `count` the int32 count
    after this step (>= 1). `exponents`: per leaf its int32 per-matrix exponents where the format
    keeps them (`config.has_exponents`), else None."""

    params: list
    grads: list
    states: list
    lows: list
    hparams: Any
    count: Any
    exponents: list | None = None

    def flat(self, config: StepConfig) -> list:
        """The primitive's operand order: *params, *grads, *states, *exponents (with
        `has_exponents`), *low halves (split leaves, in order), hparams, count."""
        exponents = self.exponents if config.has_exponents else []
        return [*self.params, *self.grads, *self.states, *exponents, *(self.lows[i] for i in config.split),
                self.hparams, self.count]

    @classmethod
    def of(cls, flat, config: StepConfig) -> "StepOperands":
        n, k = config.n_leaves, len(config.split)
        e = n if config.has_exponents else 0
        exponents = list(flat[3 * n:3 * n + e]) if e else [None] * n
        rest = flat[3 * n + e:]
        return cls(list(flat[:n]), list(flat[n:2 * n]), list(flat[2 * n:3 * n]), config.per_leaf(rest[:k]), rest[k],
                   rest[k + 1], exponents)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["outs", "states", "lows", "counts", "exponents"],
                   meta_fields=[])
@dataclasses.dataclass
class StepResults:
    """The step primitive's results, by name: per leaf its out (update, or new parameter; a
    split leaf's new weight), new state and new low half (None for a FP32 leaf), the step's
    format counts with `config.track_format` (else None), and per leaf its new exponents with
    `config.has_exponents` (else None)."""

    outs: list
    states: list
    lows: list
    counts: Any = None
    exponents: list | None = None

    def flat(self, config: StepConfig) -> list:
        """The primitive's result order: *outs, *new states, *new exponents (with
        `has_exponents`), *new low halves (split leaves, in order), then the counts with
        `track_format`."""
        exponents = self.exponents if config.has_exponents else []
        return [*self.outs, *self.states, *exponents, *(self.lows[i] for i in config.split),
                *([self.counts] if config.track_format else [])]

    @classmethod
    def of(cls, flat, config: StepConfig) -> "StepResults":
        n, k = config.n_leaves, len(config.split)
        e = n if config.has_exponents else 0
        exponents = list(flat[2 * n:2 * n + e]) if e else [None] * n
        rest = flat[2 * n + e:]
        return cls(list(flat[:n]), list(flat[n:2 * n]), config.per_leaf(rest[:k]),
                   rest[k] if config.track_format else None, exponents)


def check_countable(arrays, config: StepConfig) -> None:
    """Refuses, when counting, a leaf whose local elements could overflow a uint32 count."""
    if not config.track_format:
        return
    for p, path in zip(arrays, config.paths):
        if int(np.prod(np.shape(p))) >= COUNTABLE_ELEMENTS:
            raise ValueError(
                f"packed_adamw: leaf {path or '<root>'} has {int(np.prod(np.shape(p)))} elements on one device; "
                f"track_format=True counts fewer than 2**32 per leaf and device. Shard it over more devices, "
                "or pass track_format=False")


def local_step(operands: StepOperands, *, config: StepConfig) -> StepResults:
    """Every leaf's out and new state (and low half), for the arrays as given, and with
    `config.track_format` the step's format counts of these arrays."""
    return StepResults.of(packed_adamw_step_p.bind(*operands.flat(config), config=config), config)


packed_adamw_step_p = Primitive("packed_adamw_step")
packed_adamw_step_p.multiple_results = True


@packed_adamw_step_p.def_abstract_eval
def _abstract_eval(*avals, config: StepConfig):
    ops = StepOperands.of(avals, config)
    # The outputs have the types (and shardings) of the parameters, states and low halves (a
    # split leaf's out is its new bf16 weight); the counts are replicated like the
    # hyperparameter rows (both rank 2).
    strong = lambda xs: [None if a is None else a.update(weak_type=False) for a in xs]  # noqa: E731
    counts = ops.hparams.update(shape=counts_shape(config), dtype=np.dtype(np.uint32), weak_type=False)
    return StepResults(strong(ops.params), strong(ops.states), strong(ops.lows), counts,
                       strong(ops.exponents)).flat(config)


@functools.lru_cache(maxsize=256)
def _jitted(config: StepConfig):
    return jax.jit(lambda *args: packed_adamw_step_p.bind(*args, config=config))


@functools.cache
def _cuda_devices() -> frozenset:
    """The CUDA devices of this process (none without a CUDA jaxlib)."""
    try:
        return frozenset(jax.devices("cuda"))
    except RuntimeError:
        return frozenset()


def _eager_platform(args, config: StepConfig) -> str:
    """The platform a step outside a trace runs on: the parameters' ("cuda" where they are on a
    CUDA GPU), as a compiled step's is the platform it is compiled for. (The hyperparameter rows
    and the count may sit uncommitted on the default device, a GPU, beside CPU-placed parameters.)"""
    devices = {d for p in StepOperands.of(args, config).params if isinstance(p, jax.Array) for d in p.devices()}
    return "cuda" if devices and devices <= _cuda_devices() else "host"


@packed_adamw_step_p.def_impl
def _impl(*args, config: StepConfig):
    # Outside a trace: compile the primitive alone, for the devices the arrays are on. A rule that
    # lowers itself runs its lowering's operations one by one instead, as any eager JAX code: its
    # options hold values known before compilation (Muon's hyperparameters as given), so a compiled
    # step would compile again for each new value (an eager loop changing a number each step). So
    # does every rule under jax.disable_jit(), where the compiled step would call this again.
    if config.steps.lower is not None or jax.config.jax_disable_jit:
        lowering = _cuda_step if _eager_platform(args, config) == "cuda" else _cpu_step
        return lowering(*args, config=config)
    return _jitted(config)(*args)


def _batched(args, dims, *, config: StepConfig):
    """vmap: one step per batch element, in sequence (as `pure_callback`'s "sequential")."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: packed_adamw_step_p.bind(*xs, config=config), moved)
    return outs, [0] * len(outs)


batching.primitive_batchers[packed_adamw_step_p] = _batched


def not_differentiable(name: str, peer: str) -> TypeError:
    """The refusal of jax.grad (jvp, linearize) through a packed step, saying why and what to do;
    `peer` names the optax transformation that differentiates."""
    return TypeError(
        f"{name}: the optimizer step is not differentiable (its kernels and host callbacks have no derivative, "
        "it rounds its state to the stored format and it steps in place), and jax.grad / jax.jvp reached it "
        "through its parameters, gradients, state or hyperparameters. Differentiate the loss alone and call "
        "update() outside the differentiated function, or wrap its inputs in jax.lax.stop_gradient; to "
        f"differentiate through optimizer steps (meta-learning), use {peer}")


def _not_differentiable(primals, tangents, *, config: StepConfig):
    """The primitive's JVP rule. JAX calls it only when some operand carries a tangent, so a
    step beside a gradient (the usual train step) never reaches it."""
    raise not_differentiable(*config.steps.names)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _tangent_free(refusal: tuple, arrays):
    return arrays


@_tangent_free.defjvp
def _refuse_tangents(refusal: tuple, primals, tangents):
    raise not_differentiable(*refusal)


def without_tangents(arrays, name: str, peer: str):
    """`arrays` (a pytree) unchanged, for a transform whose inputs reach more than one step
    (packed_muon's: the primitive's Muon rule and packed_adamw's half): a tangent reaching them is
    refused as the primitive's are (`not_differentiable`), in `name`'s words, before any step
    sees it, and none reaches them beside a gradient. The identity leaves the compiled step as it is."""
    return _tangent_free((name, peer), arrays)


ad.primitive_jvps[packed_adamw_step_p] = _not_differentiable


# ---------------------------------------------------------------------------------------------
# CPU (and any platform without a CUDA rule): the numpy step, one callback per device (a rule
# with its own lowering: `RuleSteps.lower` for "host")
# ---------------------------------------------------------------------------------------------
class CpuStepError(RuntimeError):
    """An error inside the CPU step's callback, with the leaf named on one line."""


def _flushes_subnormals() -> bool:
    return bool(np.float32(1e-40) * np.float32(1.0) == 0)  # 1e-40 is a float32 subnormal


@functools.cache
def _c_float_environment():
    """(fegetenv, fesetenv, the default environment's address) of the C library, or None."""
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None  # elsewhere FE_DFL_ENV may be the address of a global: no guessing
    for name in (ctypes.util.find_library("m"), ctypes.util.find_library("c"), None):
        try:
            lib = ctypes.CDLL(name)
            get, set_ = lib.fegetenv, lib.fesetenv
            if sys.platform == "darwin":
                default = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.in_dll(lib, "_FE_DFL_ENV")))
            else:
                default = ctypes.c_void_p(-1)  # glibc and musl: FE_DFL_ENV is (const fenv_t *) -1
        except (OSError, AttributeError, ValueError, TypeError):
            continue
        return get, set_, default
    return None


@contextlib.contextmanager
def _subnormals_kept():
    """The C default floating-point environment for the numpy step, then the caller's again.

    XLA runs CPU callbacks on its own threads, which flush float32 subnormals to zero (FTZ and
    DAZ); numpy there would give other bits than the numpy step everywhere else (a subnormal
    parameter's decay, a fp32-mode v of a gradient below 1e-19, the format counts)."""
    if not _flushes_subnormals():
        yield
        return
    env = _c_float_environment()
    saved = ctypes.create_string_buffer(1024)  # larger than any fenv_t
    if env is None or env[0](saved) != 0:
        raise CpuStepError("packed_adamw CPU step: this thread flushes float32 subnormals to zero and the C "
                           "library's fesetenv is not available to undo it, so the numpy step would lose bits")
    try:
        env[1](env[2])
        if _flushes_subnormals():
            raise CpuStepError("packed_adamw CPU step: fesetenv(FE_DFL_ENV) left this thread flushing float32 "
                               "subnormals to zero, so the numpy step would lose bits")
        yield
    finally:
        env[1](saved)


def _host_step(*flat, config: StepConfig):
    """Every leaf of one device in one callback: a callback costs far more than the numpy step
    of a small leaf, so leaves do not get one each."""
    fmt, steps, ops = config.fmt, config.steps, StepOperands.of(flat, config)
    params, grads, states, lows, hparams, count = ops.params, ops.grads, ops.states, ops.lows, ops.hparams, ops.count
    hparams = np.asarray(hparams, np.float32)
    count = int(np.asarray(count).reshape(-1)[0])
    outs, new_states, new_lows = [], [], [None] * config.n_leaves
    counts = np.zeros(counts_shape(config), np.int64) if config.track_format else None
    with _subnormals_kept():
        for i, (p, g, s, lo, row, path) in enumerate(zip(params, grads, states, lows, config.leaf_rows,
                                                         config.paths)):
            shape, state_shape = np.shape(p), np.shape(s)
            try:  # callback inputs are read-only: the step works on copies
                s = np.array(s).reshape(fmt.flat_state_shape(-1))
                scalars = steps.step_scalar_row(count, hparams[row])
                leaf_counts = None if counts is None else counts[i]
                if lo is None:
                    p = np.array(p, dtype=np.float32).reshape(-1)
                    update = np.empty_like(p) if config.write_update else None
                    steps.apply_step(p, np.asarray(g, np.float32).reshape(-1), s, scalars, fmt=fmt, update_out=update,
                                     format_counts_out=leaf_counts)
                    out = update if config.write_update else p
                else:  # a split master: the new bf16 weight and low half, in place on the copies
                    p, lo = np.array(p).view(np.uint16).reshape(-1), np.array(lo).reshape(-1)
                    g = np.asarray(g)
                    g = (g.view(np.uint16) if g.dtype == jnp.bfloat16 else g.astype(np.float32)).reshape(-1)
                    steps.apply_split_step(p, lo, g, s, scalars, fmt=fmt, format_counts_out=leaf_counts)
                    out = p.view(jnp.bfloat16)
                    new_lows[i] = lo.reshape(shape)
            except Exception as e:  # surfaces as JaxRuntimeError; make its last line say what failed
                raise CpuStepError(f"packed_adamw CPU step of leaf {path or '<root>'}: {type(e).__name__}: {e}") \
                    from None
            outs.append(out.reshape(shape))
            new_states.append(s.reshape(state_shape))
    counts = None if counts is None else counts.astype(np.uint32)  # fits: check_countable
    return StepResults(outs, new_states, new_lows, counts).flat(config)


def _cpu_step(*args, config: StepConfig):
    ops = StepOperands.of(args, config)
    if config.steps.lower is not None:
        return config.steps.lower(ops, config, "host").flat(config)
    check_countable(ops.params, config)
    if not ops.params:
        return StepResults([], [], [], jnp.zeros(counts_shape(config), jnp.uint32)).flat(config)
    # A FP32 leaf's out (u or p) and a split leaf's (its new weight) have the parameter's type.
    like = lambda xs: [None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]  # noqa: E731
    out_types = StepResults(like(ops.params), like(ops.states), like(ops.lows),
                            jax.ShapeDtypeStruct(counts_shape(config), jnp.uint32)).flat(config)
    return list(jax.pure_callback(functools.partial(_host_step, config=config), out_types, *args,
                                  vmap_method="sequential"))


def _cuda_step(*args, config: StepConfig):
    from . import _triton_launch

    ops = StepOperands.of(args, config)
    if config.steps.lower is not None:
        return config.steps.lower(ops, config, "cuda").flat(config)
    check_countable(ops.params, config)
    outs, new_states, counts, *new_lows = _triton_launch.step(
        ops.params, ops.grads, ops.states, list(config.leaf_rows), ops.hparams, ops.count, fmt=config.fmt,
        kernels=config.steps.kernels(), write_update=config.write_update, multi_tensor=config.multi_tensor,
        alias_grads=config.alias_grads, track_format=config.track_format, lows=ops.lows if config.split else None)
    new_lows = new_lows[0] if config.split else [None] * config.n_leaves
    return StepResults(list(outs), list(new_states), list(new_lows), counts).flat(config)


mlir.register_lowering(packed_adamw_step_p, mlir.lower_fun(_cpu_step, multiple_results=True))
mlir.register_lowering(packed_adamw_step_p, mlir.lower_fun(_cuda_step, multiple_results=True), platform="cuda")
