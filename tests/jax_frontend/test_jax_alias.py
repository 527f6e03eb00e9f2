"""optax's alias_test.py, mirrored for `packed_adamw` in every mode (CPU).

Same targets (parabola, Rosenbrock), learning rate (optax's entry for adamw: 1e-1), step count
(10,000 under jit) and tolerances (rtol = atol = 3e-2) as optax's `test_optimization`, then its
conventions: tree_map_params, extra args, inject_hyperparams (with no static_args), preserved
dtypes, state shape/dtype stability through `lax.cond`, gradient accumulation. Where optax
compares within a tolerance and the packed step is exact, the comparison here is bitwise.

packed_adamw trains float32 and bfloat16 (split masters), so optax's complex64 case is replaced
by a check that such leaves are refused with a TypeError.

The two targets share one run: the step is elementwise, so a tree {parabola, rosenbrock} under
one transform gives each leaf exactly the trajectory of its own run (one callback per step
instead of two keeps the 10,000 steps affordable on CPU).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_helpers import MODES, assert_bits_equal
from packed_adamw.core import StateFormat, rms_format
from packed_adamw.jax import packed_adamw

LR = 1e-1  # optax's alias_test entry for adamw
STEPS, CHUNK = 10_000, 1_000
RTOL = ATOL = 3e-2


def parabola():
    initial, final = jnp.array([-1.0, 10.0, 1.0]), jnp.array([1.0, -1.0, 1.0])
    return initial, final, lambda p: jnp.sum(jnp.square(p - final))


def rosenbrock(a=1.0, b=100.0):
    initial, final = jnp.array([0.0, 0.0]), jnp.array([a, a ** 2])
    return initial, final, lambda p: jnp.square(a - p[0]) + b * jnp.square(p[1] - p[0] ** 2)


TARGETS = {"parabola": parabola(), "rosenbrock": rosenbrock()}


def objective(params):
    return sum(TARGETS[k][2](params[k]) for k in TARGETS)


def initial_params():
    return {k: t[0] for k, t in TARGETS.items()}


def optimize(tx):
    """optax's test_optimization loop, CHUNK steps per jitted call. Returns (params, state,
    compiled programs of the chunk)."""

    def one_step(_, carry):
        params, state = carry
        updates, state = tx.update(jax.grad(objective)(params), state, params)
        return optax.apply_updates(params, updates), state

    chunk = jax.jit(lambda params, state: jax.lax.fori_loop(0, CHUNK, one_step, (params, state)))
    params = initial_params()
    state = tx.init(params)
    state = optax.tree_utils.tree_map_params(tx, lambda v: v, state)  # optax: "tree_map_params works"
    for _ in range(STEPS // CHUNK):
        params, state = chunk(params, state)
    return params, state, chunk._cache_size()


def converged(params, name):
    return np.allclose(np.asarray(params[name]), np.asarray(TARGETS[name][1]), rtol=RTOL, atol=ATOL)


# Rosenbrock's gradients reach ~20 along the valley, far above the ~2 where E4M11 and E4M12
# saturate at their default bias 15 (largest finite value (2 - 2**-11) * 2**(15 - bias)): the RMS
# is clipped from about step 500 on (test below), the steps are mis-scaled and the run stops
# short of (1, 1), near (0.87, 0.72). Biases 12 (saturation near 16) pass, as fp16 and fp32 do;
# see FORMAT.md, "Choosing the biases".
RUNS = {
    "packed": (StateFormat("packed"), {"parabola": True, "rosenbrock": False}),
    "packed-bias12": (StateFormat("packed", m_bias=12, rms_bias=12), {"parabola": True, "rosenbrock": True}),
    "fp16": (StateFormat("fp16"), {"parabola": True, "rosenbrock": True}),
    "fp32": (StateFormat("fp32"), {"parabola": True, "rosenbrock": True}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_optimization(run):
    fmt, expected = RUNS[run]
    params, state, programs = optimize(packed_adamw(LR, mode=fmt))
    assert programs == 1, "the optimizer recompiled on a later call"
    assert int(state.count) == STEPS
    for name, should_converge in expected.items():
        assert converged(params, name) == should_converge, (
            f"{run} {name}: ended at {np.asarray(params[name])}, target {np.asarray(TARGETS[name][1])}; "
            f"expected {'convergence' if should_converge else 'the documented saturation failure'}")


def rms_code_peak(fmt, steps):
    """The largest RMS code Rosenbrock's state reaches in `steps` steps at this format."""
    tx = packed_adamw(LR, mode=fmt)
    _, _, obj = TARGETS["rosenbrock"]

    def one_step(_, carry):
        params, state, peak = carry
        updates, state = tx.update(jax.grad(obj)(params), state, params)
        peak = jnp.maximum(peak, jnp.max(state.moments & 0xFFFF))
        return optax.apply_updates(params, updates), state, peak

    initial = TARGETS["rosenbrock"][0]
    run = jax.jit(lambda: jax.lax.fori_loop(0, steps, one_step, (initial, tx.init(initial), jnp.uint32(0))))
    return int(run()[2])


def test_rosenbrock_saturates_the_packed_rms_at_the_default_biases_and_not_at_12():
    """Why packed Rosenbrock fails at bias 15 (test_optimization above): its gradients reach ~20,
    its RMS code reaches the format's largest value (near 2) by step ~500 and stays clipped;
    at bias 12 the largest value is near 16 and the RMS stays below it."""
    default, bias12 = StateFormat("packed"), StateFormat("packed", m_bias=12, rms_bias=12)
    assert rms_code_peak(default, 600) == rms_format(15).max_magnitude_code
    assert rms_code_peak(bias12, 600) < rms_format(12).max_magnitude_code


@pytest.mark.parametrize("mode", MODES)
def test_eager_updates_equal_jitted_updates_bit_for_bit(mode):
    """optax runs its loop under jit only; the transform must give the same bits without it."""
    tx = packed_adamw(LR, mode=mode)
    grad = jax.grad(objective)
    params, state = initial_params(), tx.init(initial_params())
    jit_update = jax.jit(tx.update)
    for _ in range(20):
        g = grad(params)
        eager_u, eager_s = tx.update(g, state, params)
        jit_u, jit_s = jit_update(g, state, params)
        for k in TARGETS:
            assert_bits_equal(eager_u[k], jit_u[k], f"{mode} update[{k!r}]")
            assert_bits_equal(eager_s.moments[k], jit_s.moments[k], f"{mode} state[{k!r}]")
        params, state = optax.apply_updates(params, eager_u), eager_s


@pytest.mark.parametrize("mode", MODES)
def test_optimizers_accept_extra_args(mode):
    tx = packed_adamw(LR, mode=mode)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    initial, _, obj = TARGETS["rosenbrock"]

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(obj)(params), state, params,
                                   unexpected_extra_args_your_optimizer_doesnt_expect=1)
        return optax.apply_updates(params, updates), state

    params, state = initial, tx.init(initial)
    for _ in range(2):
        params, state = step(params, state)
    assert int(state.count) == 2 and not np.array_equal(np.asarray(params), np.asarray(initial))


@pytest.mark.parametrize("fmt", [*MODES, StateFormat("packed", m_bias=12, rms_bias=12)], ids=str)
def test_optimizers_can_be_wrapped_in_inject_hyperparams(fmt):
    """No static_args: the format (a mode string or a StateFormat) is not a number, so
    inject_hyperparams leaves it alone. Updates and states are bitwise equal to the plain
    transform's (optax allows rtol 1e-3)."""
    opt = packed_adamw(LR, mode=fmt)
    opt_inject = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, mode=fmt)
    params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
    updates, new_state = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    updates_inject, new_state_inject = jax.jit(opt_inject.update)(grads, jax.jit(opt_inject.init)(params), params)
    for i in range(2):
        assert_bits_equal(updates_inject[i], updates[i], f"update {i}")
        assert_bits_equal(new_state_inject.inner_state.moments[i], new_state.moments[i], f"state {i}")
    assert int(new_state_inject.inner_state.count) == int(new_state.count) == 1


@pytest.mark.parametrize("mode", MODES)
def test_preserve_dtype(mode):
    opt = packed_adamw(LR, mode=mode)
    fun = lambda x: jnp.sum(x ** 2)  # noqa: E731
    params = jnp.array([1.0, 2.0], dtype=jnp.float32)
    grads = jax.grad(fun)(params)
    updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    assert updates.dtype == grads.dtype == jnp.float32
    # optax also runs complex64 (test_optimization): packed_adamw refuses it.
    with pytest.raises(TypeError, match="float32"):
        opt.init(params.astype(jnp.complex64))
    # bfloat16 leaves hold split masters: their updates are float32, so that
    # optax.apply_updates gives the new bf16 weight (tests/jax_frontend/test_jax_split_master.py).
    bf16 = params.astype(jnp.bfloat16)
    updates, _ = jax.jit(opt.update)(grads.astype(jnp.bfloat16), jax.jit(opt.init)(bf16), bf16)
    assert updates.dtype == jnp.float32


@pytest.mark.parametrize("mode", MODES)
def test_state_shape_dtype_shard_stability(mode):
    opt = packed_adamw(LR, mode=mode)
    initial, _, obj = TARGETS["parabola"]

    @jax.jit
    def step(params, state):
        updates = jax.grad(obj)(params)
        # optax defeats compiler optimization with a random cond: both branches must agree in type.
        cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
        updates, state = jax.lax.cond(cond, lambda: opt.update(updates, state, params), lambda: (params, state))
        return optax.apply_updates(params, updates), state

    params, state = initial, opt.init(initial)
    types = jax.tree_util.tree_map(jax.typeof, state)
    for _ in range(2):
        params, new_state = step(params, state)
        assert jax.tree_util.tree_leaves(params)[0].dtype == jnp.float32
        cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
        state = jax.lax.cond(cond, lambda: state, lambda: new_state)  # noqa: B023
        assert jax.tree_util.tree_map(jax.typeof, state) == types


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation(mode):
    opt = optax.MultiSteps(packed_adamw(LR, mode=mode), every_k_schedule=4)
    fun = lambda x: jnp.sum(x ** 2)  # noqa: E731
    params = jnp.array([1.0, 2.0], dtype=jnp.float32)
    grads = jax.grad(fun)(params)
    updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    # MultiSteps multiplies the inner update by its emit flag (0 here), so each zero carries
    # the sign of the update it hides (-0.0 for a decreasing step): compare values, as optax does.
    np.testing.assert_array_equal(np.asarray(updates), np.zeros(2, np.float32))
    assert updates.dtype == jnp.float32
