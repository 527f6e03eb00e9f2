"""optax frontend: `packed_adamw` as a GradientTransformation, and a fused in-place step.

On a CUDA backend the core Triton kernels are launched through jax-triton, many leaves per
launch (docs/MULTI_TENSOR.md); on CPU the numpy step runs through `jax.pure_callback`. Both
follow docs/FORMAT.md, so they give the same bits as `packed_adamw.torch.PackedAdamW`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat
from packed_adamw.core.hyperparams import FLOAT32_MAX, FLOAT32_TINY, validate_hyperparams
from packed_adamw.core.numpy_step import apply_step, step_scalar_row
from packed_adamw.core.portable import PortableState

from . import _triton_launch


class PackedAdamWState(NamedTuple):
    """`count`: steps taken (int32). `moments`: per leaf, uint32 words of the leaf's shape
    (packed, fp16) or float32 of shape [2, *shape] (fp32)."""

    count: jax.Array
    moments: Any


def _leaf_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _check_float32(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.result_type(leaf) != jnp.float32:
            raise TypeError(
                f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {jnp.result_type(leaf)}: "
                "packed_adamw trains float32 parameters only; keep float32 master weights"
            )


def _moments_spec(leaf, fmt: StateFormat) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(fmt.state_shape(jnp.shape(leaf)), jnp.dtype(fmt.state_dtype))


def _zero_moments(leaf, fmt: StateFormat):
    spec = _moments_spec(leaf, fmt)
    return jnp.zeros(spec.shape, spec.dtype)


def _check_state(moments, params, fmt: StateFormat) -> None:
    expected = jax.tree_util.tree_map(lambda p: _moments_spec(p, fmt), params)
    got = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(jnp.shape(s), jnp.result_type(s)), moments)
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got) or expected != got:
        raise ValueError(
            f"packed_adamw: the optimizer state does not match the gradients for mode {fmt.mode!r} "
            f"(format {fmt.identity}); expected {expected}, got {got}. Build the state with init() of a "
            "transform with the same mode and biases over the same parameters"
        )


def _decay_flags(mask, params):
    """Per-leaf weight-decay switch from an optax-style mask: a pytree of bools matching
    params or a prefix of them, or a callable returning one."""
    if mask is None:
        return jax.tree_util.tree_map(lambda _: True, params)
    flags = mask(params) if callable(mask) else mask

    def broadcast(flag, subtree):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"packed_adamw: mask entries must be Python bools known before compilation, got {flag!r}")
        return jax.tree_util.tree_map(lambda _: bool(flag), subtree)

    return jax.tree_util.tree_map(broadcast, flags, params)


def _cpu_leaf_step(p, g, s, hparams, count, *, fmt: StateFormat, write_update: bool):
    def host_step(p, g, s, hparams, count):
        p = np.array(p, dtype=np.float32).reshape(-1)  # callback inputs are read-only: copy
        s = np.array(s).reshape(fmt.flat_state_shape(-1))
        update = np.empty_like(p) if write_update else None
        # The row was validated in the graph (`_refuse_invalid`), the same on every backend.
        scalars = step_scalar_row(int(np.asarray(count).reshape(-1)[0]), np.asarray(hparams, np.float32))
        apply_step(p, np.asarray(g, np.float32).reshape(-1), s, scalars, fmt=fmt, update_out=update)
        return (update if write_update else p).reshape(out_types[0].shape), s.reshape(out_types[1].shape)

    out_types = (jax.ShapeDtypeStruct(p.shape, jnp.float32), jax.ShapeDtypeStruct(s.shape, s.dtype))
    out, new_s = jax.pure_callback(host_step, out_types, p, g, s, hparams, count, vmap_method="sequential")
    return out.reshape(p.shape), new_s.reshape(s.shape)


def _refuse_invalid(hparams):
    """(rows, all valid): rows [lr, b1, b2, eps, weight_decay] checked in the graph by the rules
    of `validate_hyperparams`, for values known only there (schedules, injected arrays). An
    invalid row becomes NaN, so every element of its leaves is rejected and keeps its value and
    state, on CPU and GPU alike; the caller then leaves the count as it was."""
    lr, b1, b2, eps, wd = (hparams[:, i] for i in range(hparams.shape[1]))
    valid = ((lr >= 0) & (lr <= FLOAT32_MAX) & (b1 >= 0) & (b1 < 1) & (b2 >= 0) & (b2 < 1)
             & (eps >= FLOAT32_TINY) & (eps <= FLOAT32_MAX) & (wd >= 0) & (wd <= FLOAT32_MAX)
             & (lr * wd <= FLOAT32_MAX))
    return jnp.where(valid[:, None], hparams, jnp.nan), jnp.all(valid)


def _known_zero(x) -> bool:
    try:
        return float(x) == 0.0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False  # traced: not known


def _increment(count):
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


class _Stepper:
    """What the transform and the fused step share: hyperparameters, format, the step over leaves."""

    def __init__(self, learning_rate, b1, b2, eps, weight_decay, mask, mode, m_bias, rms_bias, multi_tensor):
        # Plain numbers are checked now; arrays (optax.inject_hyperparams) arrive traced.
        validate_hyperparams(learning_rate, (b1, b2), eps, weight_decay, allow_arrays=True)
        self.learning_rate, self.b1, self.b2, self.eps, self.weight_decay = learning_rate, b1, b2, eps, weight_decay
        self.mask = mask
        self.multi_tensor = bool(multi_tensor)
        self.fmt = StateFormat(mode, m_bias, rms_bias)

    def init(self, params) -> PackedAdamWState:
        _check_float32(params, "params")
        return PackedAdamWState(
            count=jnp.zeros([], jnp.int32),
            moments=jax.tree_util.tree_map(lambda p: _zero_moments(p, self.fmt), params),
        )

    def run(self, grads, state: PackedAdamWState, params, *, write_update: bool):
        _check_float32(grads, "grads")
        _check_state(state.moments, grads, self.fmt)
        if params is None:
            if not _known_zero(self.weight_decay):
                raise ValueError(
                    "packed_adamw: weight_decay is nonzero, so update() needs params; call "
                    "tx.update(grads, state, params), or set weight_decay=0"
                )
            params = grads  # never read for decay: lr * 0 * p = 0 for finite p
        else:
            _check_float32(params, "params")
        lr = self.learning_rate(state.count) if callable(self.learning_rate) else self.learning_rate
        decay = _decay_flags(self.mask, params)
        treedef = jax.tree_util.tree_structure(grads)
        params, grads = treedef.flatten_up_to(params), jax.tree_util.tree_leaves(grads)
        moments, decay = treedef.flatten_up_to(state.moments), treedef.flatten_up_to(decay)
        # One hyperparameter row with weight decay, one without (masked leaves).
        hparams = jnp.asarray([[lr, self.b1, self.b2, self.eps, wd] for wd in (self.weight_decay, 0.0)], jnp.float32)
        hparams, valid = _refuse_invalid(hparams)
        count = jnp.where(valid, _increment(state.count), state.count)
        if jax.default_backend() == "gpu":
            outs, moments = _triton_launch.step(params, grads, moments, decay, hparams, count, fmt=self.fmt,
                                                write_update=write_update, multi_tensor=self.multi_tensor)
        else:
            results = [_cpu_leaf_step(p, g, s, hparams[0 if d else 1], count.reshape(1), fmt=self.fmt,
                                      write_update=write_update) for p, g, s, d in zip(params, grads, moments, decay)]
            outs, moments = [r[0] for r in results], [r[1] for r in results]
        return treedef.unflatten(outs), PackedAdamWState(count=count, moments=treedef.unflatten(moments))


def packed_adamw(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
    mode: str = "packed",
    *,
    m_bias: int = DEFAULT_M_BIAS,
    rms_bias: int = DEFAULT_RMS_BIAS,
    multi_tensor: bool = True,
) -> optax.GradientTransformation:
    """AdamW with one uint32 word of state per float32 parameter, as an optax transformation.

    Like `optax.adamw`: `learning_rate` is a float or a schedule of the step count, and `mask`
    (a pytree of bools or a callable returning one) limits weight decay to some leaves. The
    returned updates u satisfy `optax.apply_updates(params, u) == PackedAdamW's in-place step`
    bit for bit. `mode` is "packed" (4 bytes/parameter), "fp16" (4) or "fp32" (8).
    On CUDA, `multi_tensor=True` updates up to 16 leaves per kernel launch (leaves of 2**24
    elements or more get their own); `False` launches once per leaf. Same bits either way.
    Gradient elements that are NaN or Inf get update -0.0 and keep their state; wrap the
    transform in `optax.apply_if_finite` to skip such steps whole.
    """
    stepper = _Stepper(learning_rate, b1, b2, eps, weight_decay, mask, mode, m_bias, rms_bias, multi_tensor)

    def update_fn(updates, state, params=None):
        return stepper.run(updates, state, params, write_update=True)

    return optax.GradientTransformation(stepper.init, update_fn)


def packed_adamw_fused_step(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
    mode: str = "packed",
    *,
    m_bias: int = DEFAULT_M_BIAS,
    rms_bias: int = DEFAULT_RMS_BIAS,
    multi_tensor: bool = True,
) -> Callable[[Any, Any, PackedAdamWState], tuple[Any, PackedAdamWState]]:
    """`step(params, grads, state) -> (params, state)`: the same step, writing parameters
    directly. Under `jax.jit(step, donate_argnums=(0, 2))` on CUDA it updates the donated
    buffers in place (20 bytes of traffic per parameter). The state is the transform's:
    `packed_adamw(...).init(params)` with the same arguments.
    """
    stepper = _Stepper(learning_rate, b1, b2, eps, weight_decay, mask, mode, m_bias, rms_bias, multi_tensor)

    def step(params, grads, state):
        return stepper.run(grads, state, params, write_update=False)

    return step


def export_state(state: PackedAdamWState, mode: str = "packed", *, m_bias: int = DEFAULT_M_BIAS,
                 rms_bias: int = DEFAULT_RMS_BIAS) -> PortableState:
    """The state in leaf order, for `PackedAdamW.import_state` (pass the transform's mode/biases)."""
    fmt = StateFormat(mode, m_bias, rms_bias)
    leaves = jax.tree_util.tree_leaves(state.moments)
    count = int(state.count)
    return PortableState(fmt.identity, [count] * len(leaves), [np.array(leaf) for leaf in leaves])


def import_state(portable: PortableState, params, mode: str = "packed", *, m_bias: int = DEFAULT_M_BIAS,
                 rms_bias: int = DEFAULT_RMS_BIAS) -> PackedAdamWState:
    """A `PackedAdamWState` for `params` from an exported torch (or JAX) state.

    JAX keeps one step count for all leaves, so every tensor must have taken the same steps.
    """
    fmt = StateFormat(mode, m_bias, rms_bias)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    portable.check(fmt, [tuple(jnp.shape(leaf)) for leaf in leaves])
    if len(set(portable.counts)) > 1:
        raise ValueError(
            f"import_state: the tensors have different step counts {sorted(set(portable.counts))}; the JAX "
            "state has one count, so export from an optimizer whose parameters all stepped together"
        )
    count = portable.counts[0] if portable.counts else 0
    return PackedAdamWState(
        count=jnp.asarray(count, jnp.int32),
        moments=treedef.unflatten([jnp.asarray(m) for m in portable.moments]),
    )


__all__ = ["PackedAdamWState", "packed_adamw", "packed_adamw_fused_step", "export_state", "import_state"]
