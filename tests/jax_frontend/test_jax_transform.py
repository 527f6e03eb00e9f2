"""The optax frontend (`packed_adamw.jax`) on CPU: state pytree, compilation, exactness against
the scalar authority, composition with optax wrappers, and bit parity with torch `PackedAdamW`.
Patterns follow optax's alias_test.py: every test runs over the three modes, and the
stateful ones over a `variant` (eager or `jax.jit`).

Every numeric comparison is on float32/uint32 bits. Learning-rate schedules are table lookups
(`lambda c: jnp.asarray(table)[c]`): XLA CPU contracts FMAs under jit, so a schedule computed
arithmetically in-graph could differ from the float32 value fed to torch (about 30% of elements
of `b1*m + (1-b1)*g` differ by one ulp under jit on XLA CPU).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jax_helpers import F32, MODES, U32, assert_bits_equal, bits, make_problem, run_jax, run_torch
from packed_adamw.core import StateFormat
from packed_adamw.core.adamw import authority
from packed_adamw.core.portable import PortableState
from packed_adamw.jax import PackedAdamWState, export_state, import_state, packed_adamw, packed_adamw_fused_step
from packed_adamw.torch import PackedAdamW
from packed_adamw.torch.optimizer import NonFiniteGradientError

# Sorted key order is JAX's leaf order; "s" is a 0-d leaf, "e" a 3-d one, "w" an odd-sized matrix.
SHAPES = {"b": (17,), "e": (5, 3, 2), "s": (), "w": (33, 17)}
LR = 3e-3
WD = 0.1
STEPS = 10
TABLE = np.linspace(1e-2, 1e-3, STEPS + 2).astype(F32)  # index = count before the step


def table_schedule(count):
    return jnp.asarray(TABLE)[count]


LR_KINDS = {"const": LR, "schedule": table_schedule}
TORCH_LR = {"const": LR, "schedule": TABLE}

# Donating buffers on CPU may warn that a donation was not usable; that is not what we test.
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    """optax-style variant: the function itself, or the function under jax.jit."""
    return (lambda f, **kw: jax.jit(f, **kw)) if request.param == "jit" else (lambda f, **kw: f)


def to_jax(tree: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in tree.items()}


def problem(seed=0, steps=STEPS, shapes=SHAPES):
    """Params and gradients; leaf "w" also gets huge gradients so fp16 (max 65504) saturates."""
    params0, grads = make_problem(seed, shapes, steps)
    rng = np.random.default_rng(seed + 1000)
    for g in grads:
        if "w" in g:
            g["w"][::5] = (g["w"][::5] * F32(10.0) ** rng.uniform(3, 6, size=g["w"][::5].shape)).astype(F32)
    return params0, grads


def step_fn(tx):
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return step


def assert_trees_bits_equal(a, b, what):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), what
    for (path, x), y in zip(la, lb):
        assert_bits_equal(x, y, f"{what} {jax.tree_util.keystr(path)}")


# ---------------------------------------------------------------------------------------------
# State pytree and compilation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_state_is_a_fixed_shape_namedtuple_across_updates(mode, variant):
    params0, grads = problem(steps=4)
    tx = packed_adamw(table_schedule, weight_decay=WD, mode=mode)
    params = to_jax(params0)
    state = tx.init(params)

    def structure(state):
        return jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), state)

    assert isinstance(state, PackedAdamWState)
    assert state.count.shape == () and state.count.dtype == jnp.int32 and int(state.count) == 0
    for k, p in params.items():
        m = state.moments[k]
        if mode == "fp32":
            assert (m.shape, m.dtype) == ((2, *p.shape), jnp.float32)
        else:
            assert (m.shape, m.dtype) == (p.shape, jnp.uint32)
        assert not np.any(bits(m)), "initial state must be all zero words"
    initial = structure(state)
    step = variant(step_fn(tx))
    for i, g in enumerate(grads):
        params, state = step(params, state, to_jax(g))
        assert isinstance(state, PackedAdamWState)
        assert structure(state) == initial, f"state changed shape/dtype at step {i + 1}"
        assert int(state.count) == i + 1
    assert any(np.any(bits(m)) for m in state.moments.values()), "state never written"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lr_kind", ["const", "schedule"])
def test_jitted_update_and_fused_step_compile_once(mode, lr_kind):
    params0, grads = problem(steps=6)
    tx = packed_adamw(LR_KINDS[lr_kind], weight_decay=WD, mode=mode)
    traces = []

    def counted(params, state, g):
        traces.append("update")
        return step_fn(tx)(params, state, g)

    update = jax.jit(counted)
    params, state = to_jax(params0), tx.init(to_jax(params0))
    for g in grads:
        params, state = update(params, state, to_jax(g))
    assert traces == ["update"], "the jitted update retraced across steps"
    assert update._cache_size() == 1

    fused_traces = []
    fused = packed_adamw_fused_step(LR_KINDS[lr_kind], weight_decay=WD, mode=mode)

    def counted_fused(params, g, state):
        fused_traces.append("fused")
        return fused(params, g, state)

    fused_step = jax.jit(counted_fused, donate_argnums=(0, 2))
    params2, state2 = to_jax(params0), tx.init(to_jax(params0))
    for g in grads:
        params2, state2 = fused_step(params2, to_jax(g), state2)
    assert fused_traces == ["fused"] and fused_step._cache_size() == 1
    if lr_kind == "schedule":
        # The schedule really changed the step: a constant TABLE[0] gives other bits.
        const_params, _ = run_jax(params0, grads, packed_adamw(float(TABLE[0]), weight_decay=WD, mode=mode))
        assert not np.array_equal(bits(const_params["w"]), bits(params["w"]))


# ---------------------------------------------------------------------------------------------
# Exactness against the scalar authority
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_matches_scalar_authority_bit_for_bit(mode, variant):
    steps, stride = 4, 5
    params0, grads = problem(seed=3, steps=steps)
    tx = packed_adamw(table_schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=WD, mode=mode)
    step = variant(step_fn(tx))
    params = to_jax(params0)
    state = tx.init(params)
    expected_p = {k: v.reshape(-1)[::stride].astype(np.float64).tolist() for k, v in params0.items()}
    zero = (0.0, 0.0) if mode == "fp32" else 0
    expected_s = {k: [zero] * len(v) for k, v in expected_p.items()}
    for t, g in enumerate(grads, start=1):
        params, state = step(params, state, to_jax(g))
        for k in params0:
            for j, (p, gi, s) in enumerate(zip(expected_p[k], g[k].reshape(-1)[::stride], expected_s[k])):
                expected_p[k][j], _, expected_s[k][j], _ = authority.adamw_element(
                    p, float(gi), s, count=t, lr=float(TABLE[t - 1]), b1=0.9, b2=0.95, eps=1e-8,
                    weight_decay=WD, mode=mode)
    for k in params0:
        got_p = bits(params[k]).reshape(-1)[::stride]
        want_p = np.array(expected_p[k], dtype=F32).view(U32)
        assert_bits_equal(got_p, want_p, f"params[{k!r}]")
        moments = np.asarray(state.moments[k])
        if mode == "fp32":
            got = moments.reshape(2, -1)[:, ::stride]
            want = np.array(expected_s[k], dtype=F32).T
        else:
            got = moments.reshape(-1)[::stride]
            want = np.array(expected_s[k], dtype=U32)
        assert_bits_equal(got, want, f"state[{k!r}]")


# ---------------------------------------------------------------------------------------------
# Composition with optax
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_chain_with_clip_by_global_norm_equals_clipping_by_hand(mode, variant):
    params0, grads = problem(seed=5, steps=4)
    plain = packed_adamw(LR, weight_decay=WD, mode=mode)
    chained = optax.chain(optax.clip_by_global_norm(1.0), packed_adamw(LR, weight_decay=WD, mode=mode))
    clip = optax.clip_by_global_norm(1.0)
    chained_step, plain_step = variant(step_fn(chained)), variant(step_fn(plain))
    clip_fn = variant(lambda g: clip.update(g, clip.init(g))[0])
    p_chain, s_chain = to_jax(params0), chained.init(to_jax(params0))
    p_hand, s_hand = to_jax(params0), plain.init(to_jax(params0))
    for g in grads:
        g = to_jax(g)
        assert float(optax.tree.norm(g)) > 1.0, "clipping must be active for the test to mean anything"
        p_chain, s_chain = chained_step(p_chain, s_chain, g)
        p_hand, s_hand = plain_step(p_hand, s_hand, clip_fn(g))
    assert_trees_bits_equal(p_chain, p_hand, "params")
    assert_trees_bits_equal(s_chain[1], s_hand, "state")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("static_args", [(), ("mode", "m_bias", "rms_bias")], ids=["no-static-args", "static-args"])
def test_inject_hyperparams_learning_rate_changes_without_recompiling(mode, static_args):
    params0, grads = problem(seed=6, steps=3)
    tx = optax.inject_hyperparams(packed_adamw, static_args=static_args)(learning_rate=LR, weight_decay=WD, mode=mode)
    traces = []

    def counted(params, state, g):
        traces.append(1)
        return step_fn(tx)(params, state, g)

    step = jax.jit(counted)
    params = to_jax(params0)
    state = tx.init(params)
    params, state = step(params, state, to_jax(grads[0]))
    ref_params, ref_state = run_jax(params0, grads[:1], packed_adamw(LR, weight_decay=WD, mode=mode))
    assert_trees_bits_equal(params, ref_params, "params after step 1")
    # Change the learning rate in the state: the next update must use it, without a retrace.
    new_lr = 7e-3
    state.hyperparams["learning_rate"] = jnp.asarray(new_lr, jnp.float32)
    before = params
    params, state = step(params, state, to_jax(grads[1]))
    ref_next, ref_next_state = jax.jit(step_fn(packed_adamw(new_lr, weight_decay=WD, mode=mode)))(
        before, ref_state, to_jax(grads[1]))
    assert_trees_bits_equal(params, ref_next, "params after the lr change")
    assert_trees_bits_equal(state.inner_state, ref_next_state, "state after the lr change")
    assert len(traces) == 1 and step._cache_size() == 1


# With a mask, the leaves exempt from decay use the row without weight decay: only an invalid
# weight decay leaves that row valid, so that is the case the mask adds.
@pytest.mark.parametrize("name, bad, masked", [("learning_rate", -1e-3, False), ("learning_rate", float("nan"), False),
                                               ("b1", 1.0, False), ("eps", 0.0, False), ("weight_decay", -0.1, False),
                                               ("weight_decay", -0.1, True)])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_invalid_injected_hyperparameter_refuses_the_step_whole(name, bad, masked, jitted):
    """A value known only in the graph is checked there by the rules of the constructor's
    validation, the same on every backend: the step changes no parameter, word or count,
    including the leaves a mask exempts from weight decay. Known outside jit, it raises."""
    params0, grads = problem(seed=16, steps=2)
    mask = {"b": False, "e": True, "s": False, "w": True} if masked else None
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=WD, mask=mask)
    step = jax.jit(step_fn(tx)) if jitted else step_fn(tx)
    params = to_jax(params0)
    state = tx.init(params)
    params, state = step(params, state, to_jax(grads[0]))
    state.hyperparams[name] = jnp.asarray(bad, jnp.float32)
    if not jitted:
        with pytest.raises(ValueError, match="Invalid|invalid hyperparameters"):
            step(params, state, to_jax(grads[1]))
        return
    from packed_adamw.jax import RefusedStepWarning

    with pytest.warns(RefusedStepWarning, match="step refused at count 1: Invalid"):  # never silent
        after, after_state = step(params, state, to_jax(grads[1]))
        jax.effects_barrier()
    assert_trees_bits_equal(after, params, f"params after a step with {name}={bad}")
    assert_trees_bits_equal(after_state.inner_state.moments, state.inner_state.moments, "words")
    assert int(after_state.inner_state.count) == int(state.inner_state.count) == 1
    for leaf in jax.tree_util.tree_leaves(after):
        assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.parametrize("jitted, refusal_callback", [(False, "debug callback"), (True, "debug callback"),
                                                      (True, "pure callback")], indirect=["refusal_callback"])
def test_a_schedule_gone_negative_is_refused_visibly(jitted, refusal_callback):
    """A schedule that turns invalid at some count: eagerly the update raises; under jit the
    step is refused in the graph and a RefusedStepWarning names the value, every refused step
    (the count stays, so the schedule stays invalid). Valid steps warn nothing. On an
    accelerator host the jitted step has no effect in its jaxpr (which would cost every call
    JAX's C++ dispatch path), and still warns."""
    import warnings

    from packed_adamw.jax import RefusedStepWarning

    params0, grads = problem(seed=18, steps=3)
    table = jnp.asarray([LR, -2e-3, -2e-3, -2e-3], jnp.float32)
    tx = packed_adamw(lambda count: table[count], weight_decay=WD)
    step = jax.jit(step_fn(tx)) if jitted else step_fn(tx)
    params = to_jax(params0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RefusedStepWarning)
        params, state = step(params, tx.init(params), to_jax(grads[0]))
        jax.effects_barrier()
    if not jitted:
        with pytest.raises(ValueError, match="Invalid learning rate: lr=-0.002"):
            step(params, state, to_jax(grads[1]))
        return
    assert bool(jax.make_jaxpr(step_fn(tx))(params, state, to_jax(grads[1])).effects) != refusal_callback
    with pytest.warns(RefusedStepWarning, match="step refused at count 1"):  # a jit keeping the updates only
        jax.block_until_ready(jax.jit(lambda g, s, p: tx.update(g, s, p)[0])(to_jax(grads[1]), state, params))
        jax.effects_barrier()
    for g in grads[1:]:
        with pytest.warns(RefusedStepWarning, match=r"step refused at count 1: Invalid learning rate: lr=-0.002"):
            after, after_state = step(params, state, to_jax(g))
            jax.effects_barrier()
        assert_trees_bits_equal(after, params, "params after a refused step")
        assert int(after_state.count) == 1


@pytest.mark.parametrize("name, first, second, bad, says", [
    ("b1", 0.9, 0.8, -0.5, "Invalid beta parameter at index 0"),
    ("b2", 0.999, 0.99, 1.0, "Invalid beta parameter at index 1"),
    ("eps", 1e-8, 1e-3, 0.0, "Invalid epsilon value"),
    ("weight_decay", 0.1, 0.05, -1.0, "Invalid weight_decay value"),
])
def test_a_schedule_of_b1_b2_eps_or_weight_decay_steps_as_its_values(name, first, second, bad, says):
    """b1, b2, eps and weight_decay may be schedules of the count, as learning_rate is (and as
    packed_muon's beta, weight_decay and eps are): each jitted step has the bits of a transform
    built from that step's float32 value; a value turning invalid is refused as an invalid
    learning rate is: eagerly a ValueError, under jit a RefusedStepWarning naming it, nothing
    changed and the count kept."""
    from packed_adamw.jax import RefusedStepWarning

    params0, grads = problem(seed=20, steps=3)
    values = jnp.asarray([first, second, bad], jnp.float32)
    scheduled = packed_adamw(LR, **{"weight_decay": WD, name: lambda count: values[jnp.minimum(count, 2)]})
    update = jax.jit(scheduled.update)
    params = to_jax(params0)
    state = scheduled.init(params)
    for value, g in zip((first, second), grads):
        plain = packed_adamw(LR, **{"weight_decay": WD, name: float(F32(value))})
        updates, new_state = update(to_jax(g), state, params)
        plain_updates, plain_state = plain.update(to_jax(g), state, params)
        assert_trees_bits_equal(updates, plain_updates, f"updates with {name}={value}")
        assert_trees_bits_equal(new_state, plain_state, f"state with {name}={value}")
        params, state = optax.apply_updates(params, updates), new_state
    with pytest.raises(ValueError, match=f"packed_adamw: invalid hyperparameters at count 2: {says}"):
        scheduled.update(to_jax(grads[2]), state, params)
    with pytest.warns(RefusedStepWarning, match=f"packed_adamw: step refused at count 2: {says}"):
        updates, refused = update(to_jax(grads[2]), state, params)
        jax.effects_barrier()
    assert int(refused.count) == 2
    assert_trees_bits_equal(refused.moments, state.moments, "words after a refused step")
    assert all(np.all(bits(u) == U32(0x80000000)) for u in jax.tree_util.tree_leaves(updates))


@pytest.mark.parametrize("factory", [packed_adamw, packed_adamw_fused_step])
@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=None), "learning_rate=None is not a number"),
    (dict(b1=None), "b1=None is not a number"),
    (dict(b2="0.99"), "b2='0.99' is not a number"),
    (dict(eps=jnp.full((3,), 1e-8)), "eps=.* is not a number"),
    (dict(weight_decay=None), "weight_decay=None is not a number.*or a schedule of the step count"),
])
def test_a_hyperparameter_neither_a_number_nor_a_schedule_is_refused_when_built_naming_it(factory, kwargs, message):
    kwargs = {"learning_rate": LR, **kwargs}
    with pytest.raises(TypeError, match=f"packed_adamw: {message}"):
        factory(**kwargs)


@pytest.mark.parametrize("transform_name, other", [("packed_adamw", "packed_muon"), ("packed_muon", "packed_adamw")])
def test_the_refusal_warning_speaks_for_the_transform_that_refused(transform_name, other):
    """The host side of the jitted refusal (`_warn_refused`, `_refusal_reason`) is shared by
    packed_adamw and packed_muon: it names the transform it speaks for and no other, and for a
    damaged (negative) count says to restore the state, not to fix a schedule."""
    from packed_adamw.core.adamw import RULE as ADAMW_RULE
    from packed_adamw.core.muon import RULE as MUON_RULE
    from packed_adamw.jax import RefusedStepWarning, transform

    rule = {"packed_adamw": ADAMW_RULE, "packed_muon": MUON_RULE}[transform_name]
    with pytest.warns(RefusedStepWarning) as caught:
        transform._warn_refused(transform_name, rule, np.bool_(False), np.zeros(rule.hyperparam_row, F32),
                                np.int32(-3))
    message = str(caught[0].message)
    assert message.startswith(f"{transform_name}: step refused at count -3: the state's step count is -3"), message
    assert other not in message and "restore" in message and "fix the schedule" not in message, message


def test_a_negative_count_under_jit_warns_that_the_step_was_refused(refusal_callback):
    """With a hyperparameter known only in the graph (here injected), the refusal warning also
    names a negative count (on any platform; with plain-number hyperparameters only on the CPU:
    see docs/JAX.md)."""
    from packed_adamw.jax import RefusedStepWarning

    params0, grads = problem(seed=17, steps=1)
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=WD)
    params = to_jax(params0)
    state = tx.init(params)
    state = state._replace(inner_state=state.inner_state._replace(count=jnp.asarray(-3, jnp.int32)))
    with pytest.warns(RefusedStepWarning, match="step refused at count -3: the state's step count is -3"):
        jax.jit(tx.update)(to_jax(grads[0]), state, params)
        jax.effects_barrier()


@pytest.mark.parametrize("kwargs, says", [
    (dict(b1=optax.constant_schedule(1.0)), r"Invalid beta parameter at index 0: b1 \(betas\[0\]\)=1.0"),
    (dict(weight_decay=optax.constant_schedule(-0.1)), r"Invalid weight_decay value: weight_decay=-0.1"),
    (dict(learning_rate=optax.constant_schedule(float("nan"))), r"Invalid learning rate: lr=nan"),
])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_schedule_of_an_invalid_plain_number_raises_under_jit_as_eagerly(kwargs, says, jitted):
    """A schedule that returns a plain number (optax.constant_schedule's) is known when the step
    is traced, and the same at every count: under jit an invalid one raises naming it, as the
    eager update does, instead of compiling a step that refuses every weight without a word."""
    params0, grads = problem(seed=22, steps=1)
    params = to_jax(params0)
    tx = packed_adamw(**{"learning_rate": LR, "weight_decay": WD, **kwargs})
    fused = packed_adamw_fused_step(**{"learning_rate": LR, "weight_decay": WD, **kwargs})
    state = tx.init(params)
    update, step = (jax.jit(tx.update), jax.jit(fused)) if jitted else (tx.update, fused)
    with pytest.raises(ValueError, match=f"packed_adamw: invalid hyperparameters.*: {says}"):
        update(to_jax(grads[0]), state, params)
    with pytest.raises(ValueError, match=f"packed_adamw: invalid hyperparameters.*: {says}"):
        step(params, to_jax(grads[0]), state)


@pytest.mark.parametrize("hyperparameter", ["number", "traced"])
def test_the_jitted_refusal_warning_is_compiled_in_on_the_cpu_and_where_a_value_is_traced(hyperparameter):
    """The one rule packed_adamw and packed_muon share (`_refused_eagerly`): under jit the
    refusal warning's callback is compiled in where the step is lowered for the CPU, which
    waits for its host callbacks anyway (so a damaged count warns with plain-number
    hyperparameters too), and for CUDA only where a hyperparameter is known only in the graph.
    (A CUDA lowering of a host callback needs a GPU host, so that case is read off the jaxpr.)"""
    from packed_adamw.core.adamw import RULE as ADAMW_RULE
    from packed_adamw.jax import transform

    warn = functools.partial(transform._warn_refused, "packed_adamw", ADAMW_RULE)

    def guarded(lr, count):
        values = (lr if hyperparameter == "traced" else LR, (0.9, 0.999), 1e-8, WD)
        row = jnp.asarray(ADAMW_RULE.group_row(*values, number=lambda x: x), jnp.float32)
        _, valid = transform._refuse_invalid(ADAMW_RULE, row, count)
        refused, receipt = transform._refused_eagerly("packed_adamw", ADAMW_RULE, warn, values, row, valid, count)
        assert not refused
        return valid, count + receipt

    args = (jnp.float32(LR), jnp.int32(-3))
    traced = jax.jit(guarded).trace(*args)
    assert "xla_ffi_python_cpu_callback" in traced.lower(lowering_platforms=("cpu",)).as_text()
    jaxpr = str(jax.make_jaxpr(guarded)(*args))
    if hyperparameter == "traced":  # on every platform
        assert "debug_callback" in jaxpr and "platform_index" not in jaxpr, jaxpr
    else:
        assert "callback" not in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mode", MODES)
def test_a_state_format_object_gives_the_bits_of_the_same_biases_and_stays_static_when_injected(mode, variant):
    params0, grads = problem(seed=6, steps=3)
    fmt = StateFormat(mode, m_bias=13, rms_bias=17)
    by_args, by_args_state = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode=mode, m_bias=13, rms_bias=17))
    by_format, by_format_state = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode=fmt))
    assert_trees_bits_equal(by_format, by_args, "params")
    assert_trees_bits_equal(by_format_state, by_args_state, "state")
    injected = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=WD, mode=fmt)
    params = to_jax(params0)
    state = variant(injected.init)(params)
    step = variant(step_fn(injected))
    for g in grads:
        params, state = step(params, state, to_jax(g))
    assert_trees_bits_equal(params, by_args, "params under inject_hyperparams")
    assert_trees_bits_equal(state.inner_state, by_args_state, "state under inject_hyperparams")
    if mode == "packed":  # the biases really matter (fp16 and fp32 have none): the default gives other words
        _, default_state = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode=mode))
        assert not np.array_equal(bits(default_state.moments["w"]), bits(by_args_state.moments["w"]))


def test_integer_biases_under_inject_hyperparams_say_to_use_a_format_object():
    """inject_hyperparams turns numbers into arrays; a bias must be static, so the error says how."""
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=WD, m_bias=18, rms_bias=18)
    params = to_jax(problem(seed=6, steps=1)[0])
    with pytest.raises(TypeError, match=re.escape("mode=StateFormat('packed', m_bias=..., rms_bias=...)")):
        jax.jit(tx.init)(params)
    with pytest.raises(TypeError, match="m_bias"):
        tx.init(params)  # eager too: the bias arrives as an array either way
    static = optax.inject_hyperparams(packed_adamw, static_args=("m_bias", "rms_bias"))(
        learning_rate=LR, weight_decay=WD, m_bias=18, rms_bias=18)
    jax.jit(static.init)(params)  # static_args keep working


@pytest.mark.parametrize("kwargs", [dict(mode=StateFormat("packed", 18, 18), m_bias=15),
                                    dict(mode=StateFormat("fp16"), rms_bias=12)])
def test_biases_that_contradict_the_format_object_are_refused(kwargs):
    with pytest.raises(ValueError, match="contradicts"):
        packed_adamw(LR, **kwargs)


def test_defaults_mirror_optax_adamw():
    """Swapping optax.adamw(lr) for packed_adamw(lr) keeps every shared default (weight decay
    1e-4, not torch's 1e-2)."""
    ours, theirs = inspect.signature(packed_adamw).parameters, inspect.signature(optax.adamw).parameters
    for name in ("b1", "b2", "eps", "weight_decay", "mask"):
        assert ours[name].default == theirs[name].default, name
    assert inspect.signature(packed_adamw_fused_step).parameters["weight_decay"].default == theirs["weight_decay"].default
    params0, grads = problem(seed=3, steps=2)
    default_p, _ = run_jax(params0, grads, packed_adamw(LR))
    explicit_p, _ = run_jax(params0, grads, packed_adamw(LR, weight_decay=1e-4))
    assert_trees_bits_equal(default_p, explicit_p, "params at the default weight decay")
    assert isinstance(packed_adamw(LR), optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize("mode", MODES)
def test_multi_steps_every_2_equals_plain_step_on_mean_gradient(mode, variant):
    params0, grads = problem(seed=7, steps=6)
    tx = optax.MultiSteps(packed_adamw(LR, weight_decay=WD, mode=mode), every_k_schedule=2)
    step = variant(step_fn(tx))
    params, state = to_jax(params0), tx.init(to_jax(params0))
    means = []
    for i in range(0, len(grads), 2):
        g1, g2 = grads[i], grads[i + 1]
        before = params
        params, state = step(params, state, to_jax(g1))
        assert_trees_bits_equal(params, before, f"params after mini-step {i + 1} (no inner step yet)")
        params, state = step(params, state, to_jax(g2))
        # optax's running mean for n=2: acc = g1; acc + (g2 - acc) / 2 (exact to replicate in numpy).
        means.append({k: (g1[k] + (g2[k] - g1[k]) / F32(2)).astype(F32) for k in g1})
    ref_params, ref_state = run_jax(params0, means, packed_adamw(LR, weight_decay=WD, mode=mode))
    assert_trees_bits_equal(params, ref_params, "params")
    assert_trees_bits_equal(state.inner_opt_state, ref_state, "inner state")
    assert int(state.inner_opt_state.count) == len(means)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["pytree", "callable"])
def test_mask_exempts_leaves_from_weight_decay_like_optax_adamw(mode, mask_kind):
    params0, grads = problem(seed=8, steps=5)
    bool_mask = {"b": False, "e": True, "s": False, "w": True}
    mask = bool_mask if mask_kind == "pytree" else (lambda tree: {k: jnp.ndim(v) > 1 for k, v in tree.items()})
    masked_p, masked_s = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mask=mask, mode=mode))
    decayed_p, decayed_s = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode=mode))
    undecayed_p, undecayed_s = run_jax(params0, grads, packed_adamw(LR, weight_decay=0.0, mode=mode))
    for k, decays in bool_mask.items():
        ref_p, ref_s = (decayed_p, decayed_s) if decays else (undecayed_p, undecayed_s)
        assert_bits_equal(masked_p[k], ref_p[k], f"params[{k!r}] (decays={decays})")
        assert_bits_equal(masked_s.moments[k], ref_s.moments[k], f"state[{k!r}] (decays={decays})")
    # The two references really differ, so the comparison can tell decay from no decay.
    assert not np.array_equal(bits(decayed_p["b"]), bits(undecayed_p["b"]))


@pytest.mark.parametrize("mode", MODES)
def test_apply_if_finite_skips_steps_with_nan_gradients(mode, variant):
    params0, grads = problem(seed=9, steps=5)
    bad = {k: v.copy() for k, v in grads[2].items()}
    bad["w"][3, 4] = np.nan
    sequence = grads[:2] + [bad] + grads[3:]
    tx = optax.apply_if_finite(packed_adamw(LR, weight_decay=WD, mode=mode), max_consecutive_errors=3)
    step = variant(step_fn(tx))
    params, state = to_jax(params0), tx.init(to_jax(params0))
    for i, g in enumerate(sequence):
        before_p, before_inner = params, state.inner_state
        params, state = step(params, state, to_jax(g))
        if i == 2:
            assert_trees_bits_equal(params, before_p, "params on the skipped step")
            assert_trees_bits_equal(state.inner_state, before_inner, "state on the skipped step")
            assert int(state.notfinite_count) == 1
    ref_params, ref_state = run_jax(params0, grads[:2] + grads[3:], packed_adamw(LR, weight_decay=WD, mode=mode))
    assert_trees_bits_equal(params, ref_params, "params")
    assert_trees_bits_equal(state.inner_state, ref_state, "state")
    assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lr_kind", ["const", "schedule"])
def test_fused_donated_step_equals_transform_plus_apply_updates(mode, lr_kind):
    params0, grads = problem(seed=10)
    mask = {"b": False, "e": True, "s": True, "w": True}
    tx = packed_adamw(LR_KINDS[lr_kind], weight_decay=WD, mask=mask, mode=mode)
    ref_params, ref_state = run_jax(params0, grads, tx)
    step = jax.jit(packed_adamw_fused_step(LR_KINDS[lr_kind], weight_decay=WD, mask=mask, mode=mode),
                   donate_argnums=(0, 2))
    params, state = to_jax(params0), tx.init(to_jax(params0))
    for g in grads:
        params, state = step(params, to_jax(g), state)
    assert isinstance(state, PackedAdamWState)
    assert_trees_bits_equal(params, ref_params, "params")
    assert_trees_bits_equal(state, ref_state, "state")


# ---------------------------------------------------------------------------------------------
# Cross-frontend bit parity with torch PackedAdamW (CPU)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lr_kind", ["const", "schedule"])
@pytest.mark.parametrize("masked", [False, True], ids=["decay-all", "mask-b-s"])
def test_torch_and_optax_give_the_same_bits(mode, lr_kind, masked):
    params0, grads = problem(seed=11, steps=STEPS)
    no_decay = ("b", "s") if masked else ()
    mask = {k: k not in no_decay for k in SHAPES} if masked else None
    t_params, t_states, opt, _ = run_torch(params0, grads, mode=mode, lr=TORCH_LR[lr_kind], weight_decay=WD,
                                           no_decay=no_decay)
    j_params, j_state = run_jax(params0, grads, packed_adamw(LR_KINDS[lr_kind], weight_decay=WD, mask=mask, mode=mode))
    assert int(j_state.count) == STEPS
    for k in SHAPES:
        assert_bits_equal(j_params[k], t_params[k], f"params[{k!r}]")
        assert_bits_equal(j_state.moments[k], t_states[k], f"state[{k!r}]")
        assert not np.array_equal(t_params[k], bits(params0[k])), f"{k} never moved"


def _continue_torch(opt, tensors, grads):
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.from_numpy(np.array(g[k], dtype=F32))
        opt.step()


CKPT_SHAPES = SHAPES


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_from_torch_continues_in_jax_with_the_same_bits(mode, tmp_path):
    params0, grads = problem(seed=12, steps=8, shapes=CKPT_SHAPES)
    _, _, opt, tensors = run_torch(params0, grads[:4], mode=mode, lr=LR, weight_decay=WD)
    path = tmp_path / "state.safetensors"
    opt.export_state().save(path)
    portable = PortableState.load(path)
    params = {k: jnp.asarray(tensors[k].detach().numpy().copy()) for k in sorted(tensors)}
    state = import_state(portable, params, mode)
    assert int(state.count) == 4
    step = jax.jit(step_fn(packed_adamw(LR, weight_decay=WD, mode=mode)))
    for g in grads[4:]:
        params, state = step(params, state, to_jax(g))
    _continue_torch(opt, tensors, grads[4:])
    for k in CKPT_SHAPES:
        assert_bits_equal(params[k], tensors[k], f"params[{k!r}]")
        assert_bits_equal(state.moments[k], opt.state[tensors[k]]["moments" if mode == "fp32" else "words"],
                          f"state[{k!r}]")
    # And the same as never having switched: an uninterrupted 8-step JAX run.
    ref_params, _ = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode=mode))
    assert_trees_bits_equal(params, ref_params, "params vs uninterrupted run")


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_from_jax_continues_in_torch_with_the_same_bits(mode, tmp_path):
    params0, grads = problem(seed=13, steps=8, shapes=CKPT_SHAPES)
    tx = packed_adamw(LR, weight_decay=WD, mode=mode)
    params, state = run_jax(params0, grads[:4], tx)
    path = tmp_path / "state.safetensors"
    export_state(state, mode).save(path)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(np.array(params[k]))) for k in sorted(params)}
    opt = PackedAdamW([tensors[k] for k in sorted(tensors)], lr=LR, weight_decay=WD, mode=mode)
    opt.import_state(PortableState.load(path))
    _continue_torch(opt, tensors, grads[4:])
    step = jax.jit(step_fn(tx))
    for g in grads[4:]:
        params, state = step(params, state, to_jax(g))
    for k in CKPT_SHAPES:
        assert int(opt.state[tensors[k]]["step"]) == 8
        assert_bits_equal(tensors[k], params[k], f"params[{k!r}]")
        assert_bits_equal(opt.state[tensors[k]]["moments" if mode == "fp32" else "words"], state.moments[k],
                          f"state[{k!r}]")


@pytest.mark.parametrize("mode", ["packed", "fp16"])
@pytest.mark.parametrize("direction", ["torch-to-jax", "jax-to-torch"])
def test_checkpoint_of_a_scalar_parameter_survives_save_and_load(mode, direction, tmp_path):
    p0, g = np.array(0.5, F32), np.array(0.25, F32)
    if direction == "torch-to-jax":
        t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = PackedAdamW([t], lr=LR, mode=mode)
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        opt.export_state().save(tmp_path / "s.safetensors")
        state = import_state(PortableState.load(tmp_path / "s.safetensors"), {"s": jnp.asarray(p0)}, mode)
        assert_bits_equal(state.moments["s"], opt.state[t]["words"], "scalar state")
    else:
        tx = packed_adamw(LR, mode=mode)
        _, state = run_jax({"s": p0}, [{"s": g}], tx)
        export_state(state, mode).save(tmp_path / "s.safetensors")
        t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = PackedAdamW([t], lr=LR, mode=mode)
        opt.import_state(PortableState.load(tmp_path / "s.safetensors"))
        assert_bits_equal(opt.state[t]["words"], state.moments["s"], "scalar state")


def _torch_portable(mode="packed", skip_one_step_for=None, steps=2):
    params0, grads = problem(seed=14, steps=steps)
    keys = sorted(params0)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(params0[k].copy())) for k in keys}
    opt = PackedAdamW([tensors[k] for k in keys], lr=LR, weight_decay=WD, mode=mode)
    for i, g in enumerate(grads):
        for k in keys:
            tensors[k].grad = None if (k == skip_one_step_for and i == 0) else torch.from_numpy(g[k])
        opt.step()
    return opt.export_state(), to_jax(params0)


@pytest.mark.parametrize("case, kwargs, match", [
    ("other mode", dict(mode="fp16"), "format"),
    ("fp32 vs packed", dict(mode="fp32"), "format"),
    ("other m_bias", dict(mode="packed", m_bias=14), "format"),
    ("other rms_bias", dict(mode="packed", rms_bias=18), "format"),
])
def test_import_state_refuses_another_format(case, kwargs, match):
    portable, params = _torch_portable("packed")
    with pytest.raises(ValueError, match=match):
        import_state(portable, params, **kwargs)


def test_import_state_refuses_other_shapes_and_leaf_counts():
    portable, params = _torch_portable("packed")
    reshaped = dict(params, w=params["w"].reshape(17, 33))
    with pytest.raises(ValueError, match="tensor"):
        import_state(portable, reshaped, "packed")
    fewer = {k: v for k, v in params.items() if k != "e"}
    with pytest.raises(ValueError, match="tensors"):
        import_state(portable, fewer, "packed")
    import_state(portable, params, "packed")  # the matching tree is accepted


def test_import_state_refuses_unequal_per_tensor_counts():
    portable, params = _torch_portable("packed", skip_one_step_for="e", steps=3)
    assert sorted(set(portable.counts)) == [2, 3]
    with pytest.raises(ValueError, match="step counts"):
        import_state(portable, params, "packed")


@pytest.mark.parametrize("count", [-3, 1.5, True, 2 ** 31 - 1, 2 ** 31])
def test_import_state_refuses_a_count_that_is_not_a_step_count(count):
    """A portable count must be a whole number from 0 to 2**31 - 2 (import_muon_state's and
    torch's range): a negative one refuses every later step, 2**31 - 1 is where the int32 count
    stops (no step moves it), 2**31 does not fit, a fraction or a bool is no count. The top of
    the range still steps."""
    params = to_jax(problem(seed=19, steps=1)[0])
    portable = export_state(packed_adamw(LR).init(params), "packed")
    edited = dataclasses.replace(portable, counts=[count] * len(portable.counts))
    with pytest.raises(ValueError, match=rf"import_state: the state's tensors took {re.escape(repr(count))} steps, "
                                         r"which is not a step count \(a whole number from 0 to 2147483646\)"):
        import_state(edited, params, "packed")
    last = import_state(dataclasses.replace(portable, counts=[2 ** 31 - 2] * len(portable.counts)), params, "packed")
    assert int(last.count) == 2 ** 31 - 2
    tx = packed_adamw(LR)
    _, stepped = tx.update(params, last, params)
    assert int(stepped.count) == 2 ** 31 - 1


@pytest.mark.parametrize("count", [np.array(5), np.array(5, np.uint8), jnp.asarray(5), np.int64(5), "state"],
                         ids=["numpy", "numpy-uint8", "jax", "numpy-scalar", "a-state's-count"])
def test_a_step_count_may_be_a_0d_integer_array_taken_exactly(count):
    """A 0-d integer array is a step count (a state's `count`, `np.array(5)`), converted exactly to
    a Python int, as the importers' count checks (`_is_step_count`, shared with
    import_muon_state's count=) read it; the portable counts of import_state too."""
    from packed_adamw.jax import transform

    params = to_jax(problem(seed=19, steps=1)[0])
    tx = packed_adamw(LR)
    if isinstance(count, str):
        _, stepped = tx.update(params, tx.init(params), params)
        count = tx.update(params, stepped, params)[1].count  # a jax int32 array holding 2
    expected = int(np.asarray(count))
    assert transform._is_step_count(count)
    exact = transform._as_step_count(count)
    assert type(exact) is int and exact == expected
    top = np.array(2 ** 31 - 2, np.int64)
    assert transform._is_step_count(top) and transform._as_step_count(top) == 2 ** 31 - 2
    portable = export_state(tx.init(params), "packed")
    state = import_state(dataclasses.replace(portable, counts=[count] * len(portable.counts)), params, "packed")
    assert jnp.result_type(state.count) == jnp.int32 and int(state.count) == expected


@pytest.mark.parametrize("count", [np.array(True), jnp.asarray(True), np.bool_(True), np.array(5.0),
                                   jnp.asarray(5.0), np.float64(5.0), np.array(2.5), np.array([5]), jnp.asarray([5]),
                                   np.array(-1), jnp.asarray(-1), np.array(2 ** 31 - 1, np.int64),
                                   np.array(2 ** 32 + 5, np.int64), np.array(2 ** 64 - 1, np.uint64), None, "5"])
def test_a_step_count_is_still_a_whole_number_in_range(count):
    """Arrays pass only as a 0-d integer holding a count in [0, MAX_STEP_COUNT]: bools, floats,
    fractions, values out of range (wrapping none of them) and arrays of other shapes are
    refused, as their Python spellings are."""
    from packed_adamw.jax import transform

    assert not transform._is_step_count(count)


@pytest.mark.parametrize("torch_kwargs", [dict(mode="fp16"), dict(mode="fp32"), dict(mode="packed", rms_bias=12)])
def test_torch_import_state_refuses_a_jax_state_of_another_format(torch_kwargs):
    params0, grads = problem(seed=15, steps=2)
    _, state = run_jax(params0, grads, packed_adamw(LR, weight_decay=WD, mode="packed"))
    tensors = [torch.nn.Parameter(torch.from_numpy(params0[k].copy())) for k in sorted(params0)]
    opt = PackedAdamW(tensors, lr=LR, **torch_kwargs)
    with pytest.raises(ValueError, match="format"):
        opt.import_state(export_state(state, "packed"))


# ---------------------------------------------------------------------------------------------
# Non-finite gradient elements
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_gradient_elements_keep_param_and_state_like_torch(mode, variant):
    params0, grads = problem(seed=16, steps=3)
    params0["w"][0, :4] = [0.0, -0.0, 1.5, -2.5]
    bad_idx = [(0, 0), (0, 1), (0, 2), (0, 3), (7, 7), (20, 3)]
    bad_vals = [np.nan, np.inf, -np.inf, np.nan, np.inf, -np.inf]
    g3 = {k: v.copy() for k, v in grads[2].items()}
    for (i, j), v in zip(bad_idx, bad_vals):
        g3["w"][i, j] = v
    g3["s"] = np.array(np.nan, F32)
    tx = packed_adamw(LR, weight_decay=WD, mode=mode)
    params, state = run_jax(params0, grads[:2], tx)
    update = variant(lambda g, s, p: tx.update(g, s, p))
    updates, new_state = update(to_jax(g3), state, params)
    new_params = optax.apply_updates(params, updates)

    bad = np.zeros(SHAPES["w"], bool)
    bad[tuple(np.array(bad_idx).T)] = True
    assert np.all(bits(updates["w"])[bad] == U32(0x80000000)), "rejected elements must get update -0.0"
    assert bits(updates["s"]) == U32(0x80000000)
    assert_bits_equal(bits(new_params["w"])[bad], bits(params["w"])[bad], "params at non-finite grads")
    assert_bits_equal(new_params["s"], params["s"], "0-d param with a NaN grad")
    old_w, new_w = np.asarray(state.moments["w"]), np.asarray(new_state.moments["w"])
    if mode == "fp32":
        assert_bits_equal(new_w[:, bad], old_w[:, bad], "moments at non-finite grads")
    else:
        assert_bits_equal(new_w[bad], old_w[bad], "words at non-finite grads")
    assert np.count_nonzero(bits(new_params["w"])[~bad] != bits(params["w"])[~bad]) > 0.9 * (~bad).sum()

    # torch takes the same step, rejects the same elements, and raises afterwards.
    t_params, _, opt, tensors = run_torch(params0, grads[:2], mode=mode, lr=LR, weight_decay=WD)
    for k, t in tensors.items():
        t.grad = torch.from_numpy(g3[k])
    opt.check_nonfinite = True
    with pytest.raises(NonFiniteGradientError, match=re.escape("[3] (6 of 561")):  # w is leaf 3
        opt.step()
    for k in SHAPES:
        assert_bits_equal(new_params[k], tensors[k], f"params[{k!r}] vs torch")
        assert_bits_equal(new_state.moments[k], opt.state[tensors[k]]["moments" if mode == "fp32" else "words"],
                          f"state[{k!r}] vs torch")


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_weight_decay_without_params_raises_and_zero_decay_works_without_params():
    params = to_jax(problem(steps=1)[0])
    tx = packed_adamw(LR, weight_decay=WD)
    with pytest.raises(ValueError, match="weight_decay is nonzero.*params"):
        tx.update(params, tx.init(params))
    tx0 = packed_adamw(LR, weight_decay=0.0)
    updates, _ = tx0.update(params, tx0.init(params))
    with_params, _ = tx0.update(params, tx0.init(params), params)
    assert_trees_bits_equal(updates, with_params, "updates with and without params at weight_decay=0")
    # The leaves a mask leaves out take the row without weight decay: only the others need params.
    off = jax.tree_util.tree_map(lambda _: False, params)
    tx_off = packed_adamw(LR, weight_decay=WD, mask=off)
    updates, _ = tx_off.update(params, tx_off.init(params))
    assert_trees_bits_equal(updates, with_params, "updates of leaves all masked out, without params")
    one_on = {**off, "w": True}
    with pytest.raises(ValueError, match="weight_decay is nonzero.*params"):
        packed_adamw(LR, weight_decay=WD, mask=one_on).update(params, tx_off.init(params))
    # A weight decay known only in the graph (injected, under jit) may be nonzero.
    injected = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=0.0)
    with pytest.raises(ValueError, match="weight_decay is not known to be zero.*needs params"):
        jax.jit(injected.update)(params, injected.init(params))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32])  # bfloat16: tests/jax_frontend/test_jax_split_master.py
def test_non_float32_leaves_raise_type_error_naming_the_leaf(dtype):
    params = {"layer": {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.ones((2,), jnp.float32)}}
    tx = packed_adamw(LR)
    with pytest.raises(TypeError, match=re.escape("['layer']['b']")):
        tx.init({"layer": {"w": params["layer"]["w"], "b": params["layer"]["b"].astype(dtype)}})
    state = tx.init(params)
    grads = {"layer": {"w": jnp.ones((3, 2), dtype), "b": jnp.ones((2,), jnp.float32)}}
    with pytest.raises(TypeError, match=re.escape("['layer']['w']")):
        tx.update(grads, state, params)
    with pytest.raises(TypeError, match=re.escape("['w']")):
        packed_adamw(LR).init({"w": jnp.ones((4,), dtype)})


@pytest.mark.parametrize("other", [dict(mode="fp32"), dict(mode="packed", shapes={"b": (18,)}),
                                   dict(mode="packed", shapes={"extra": (2,)})])
def test_update_refuses_a_state_of_another_mode_or_shape(other):
    params = to_jax(problem(steps=1)[0])
    shapes = other.get("shapes", {})
    other_params = dict(params, **{k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()})
    foreign = packed_adamw(LR, mode=other["mode"]).init(other_params)
    with pytest.raises(ValueError, match="state"):
        packed_adamw(LR, mode="packed").update(params, foreign, params)


@pytest.mark.parametrize("factory", [packed_adamw, packed_adamw_fused_step])
@pytest.mark.parametrize("kwargs, name", [
    (dict(learning_rate=-1e-3), "lr"),
    (dict(learning_rate=float("nan")), "lr"),
    (dict(b1=1.0), "b1"),
    (dict(b1=-0.1), "b1"),
    (dict(b2=1.5), "b2"),
    (dict(eps=0.0), "eps"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(mode="bf16"), "mode"),
    (dict(m_bias=101), "bias"),
])
def test_bad_hyperparameters_raise_value_error_naming_the_argument(factory, kwargs, name):
    kwargs = {"learning_rate": LR, **kwargs}
    with pytest.raises(ValueError, match=re.escape(name)):
        factory(**kwargs)


def test_a_mask_may_be_a_prefix_of_the_params_as_in_optax():
    params = {"a": {"x": jnp.ones(3), "y": jnp.ones(2)}, "c": jnp.ones(4)}
    grads = jax.tree_util.tree_map(lambda p: p * 0.1, params)
    masked = packed_adamw(LR, weight_decay=WD, mask={"a": False, "c": True})
    updates, _ = masked.update(grads, masked.init(params), params)
    full = {"a": {"x": False, "y": False}, "c": True}
    reference = packed_adamw(LR, weight_decay=WD, mask=full)
    expected, _ = reference.update(grads, reference.init(params), params)
    assert_trees_bits_equal(updates, expected, "prefix mask vs full mask")


@pytest.mark.parametrize("mask", [{"a": True, "z": False}, [True, False], {"a": {"x": True}, "c": True}],
                         ids=["other_keys", "a_list", "deeper_than_params"])
def test_a_mask_of_another_tree_is_refused_naming_mask(mask):
    params = {"a": {"x": jnp.ones(3), "y": jnp.ones(2)}, "c": jnp.ones(4)}
    tx = packed_adamw(LR, weight_decay=WD, mask=mask)
    with pytest.raises(ValueError, match="mask has the tree .* nor a prefix of it; give one bool per parameter leaf"):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("transform_name, peer", [("packed_adamw", "optax.adamw"),
                                                   ("packed_muon", "optax.contrib.muon")])
@pytest.mark.parametrize("through", ["grads", "params", "learning_rate"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_differentiating_through_the_step_says_it_is_not_differentiable(transform_name, peer, through, jitted):
    """jax.grad through update raises saying the step is not differentiable and what to do,
    not JAX's missing-rule error (packed_muon's phases are callbacks and launches, not the
    primitive), in the words of the transform the user built (packed_muon's AdamW half is
    packed_adamw's primitive), also with update jitted inside the differentiated function; a
    gradient beside the step (the train step) still works."""
    from packed_adamw.jax import packed_muon

    factory = {"packed_adamw": packed_adamw, "packed_muon": packed_muon}[transform_name]
    # a matrix and a vector: packed_muon's AdamW half (packed_adamw's primitive) meets the tangent too
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2), "b": jnp.ones(2, jnp.float32)}
    grads = {"w": jnp.full((3, 2), 0.25, jnp.float32), "b": jnp.full(2, 0.5, jnp.float32)}
    inject = optax.inject_hyperparams(factory, static_args=("ns_steps", "mu_bias") if factory is packed_muon else ())

    def loss(x):
        if through == "learning_rate":
            tx = factory(lambda count: x)
            state = tx.init(params)
            # update jitted inside the differentiated function: JAX differentiates it after it returned
            updates, _ = jax.jit(tx.update)(grads, state, params)
        else:
            tx = factory(LR)
            p, g = (x, grads) if through == "params" else (params, x)
            updates, _ = tx.update(g, tx.init(p), p)
        return sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))

    arg = jnp.asarray(LR, jnp.float32) if through == "learning_rate" else (params if through == "params" else grads)
    fn = jax.jit(jax.grad(loss)) if jitted else jax.grad(loss)
    with pytest.raises(TypeError, match=f"^{transform_name}: the optimizer step is not differentiable.*stop_gradient"
                                        f".*use {re.escape(peer)}(\n|$)"):
        fn(arg)
    tx = inject(learning_rate=LR)
    step = jax.jit(lambda p, s: tx.update(jax.grad(lambda q: jnp.sum(q["w"] ** 2))(p), s, p))
    updates, _ = step(params, tx.init(params))
    assert np.all(np.isfinite(np.asarray(updates["w"])))


def test_injected_zero_weight_decay_needs_no_params():
    params = to_jax(problem(seed=6, steps=1)[0])
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=0.0)
    updates, _ = tx.update(params, tx.init(params))  # no params: fine, nothing to decay
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)


def test_traced_weight_decay_without_params_says_it_is_not_known_to_be_zero():
    """Under jit an injected weight decay is traced: it may be zero, but nothing can tell."""
    params = to_jax(problem(seed=6, steps=1)[0])
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=0.0)
    state = tx.init(params)
    with pytest.raises(ValueError, match="not known to be zero.*pass|not known to be zero.*params"):
        jax.jit(lambda g, s: tx.update(g, s))(params, state)
    updates, _ = jax.jit(tx.update)(params, state, params)  # with params it steps
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)


def test_no_params_are_needed_when_the_mask_exempts_every_leaf():
    params = to_jax(problem(seed=6, steps=1)[0])
    none = jax.tree_util.tree_map(lambda _: False, params)
    tx = packed_adamw(LR, weight_decay=WD, mask=none)
    without, _ = tx.update(params, tx.init(params))
    undecayed = packed_adamw(LR, weight_decay=0.0)
    reference, _ = undecayed.update(params, undecayed.init(params), params)
    assert_trees_bits_equal(without, reference, "updates with every leaf masked, no params")


def test_a_negative_step_count_is_refused_eagerly_and_refuses_the_step_under_jit(refusal_callback):
    """A damaged count with plain-number hyperparameters: eagerly a ValueError; under jit the
    step is refused in the graph and, on the CPU (where the step waits for its host callbacks
    anyway), a RefusedStepWarning names the count, for the transform and the fused step alike."""
    from packed_adamw.jax import RefusedStepWarning

    params0, grads = problem(seed=17, steps=1)
    tx = packed_adamw(LR, weight_decay=WD)
    params = to_jax(params0)
    state = tx.init(params)._replace(count=jnp.asarray(-3, jnp.int32))
    with pytest.raises(ValueError, match="step count is -3"):
        tx.update(to_jax(grads[0]), state, params)
    says = "packed_adamw: step refused at count -3: the state's step count is -3"
    with pytest.warns(RefusedStepWarning, match=says):
        updates, new_state = jax.jit(tx.update)(to_jax(grads[0]), state, params)
        jax.effects_barrier()
    assert int(new_state.count) == -3
    assert_trees_bits_equal(new_state.moments, state.moments, "words after a refused step")
    assert all(np.all(bits(u) == U32(0x80000000)) for u in jax.tree_util.tree_leaves(updates))
    with pytest.warns(RefusedStepWarning, match=says):
        fused = jax.jit(packed_adamw_fused_step(LR, weight_decay=WD))
        stepped, fused_state = fused(params, to_jax(grads[0]), state)
        jax.effects_barrier()
    assert int(fused_state.count) == -3
    assert_trees_bits_equal(stepped, params, "params after a refused fused step")
    assert bool(jax.make_jaxpr(fused)(params, to_jax(grads[0]), state).effects) != refusal_callback


def test_an_error_inside_the_cpu_callback_names_the_leaf_on_its_last_line(monkeypatch):
    import dataclasses

    from packed_adamw.jax import transform

    def broken(*args, **kwargs):
        raise ArithmeticError("the numpy step broke")

    monkeypatch.setattr(transform, "ADAMW", dataclasses.replace(transform.ADAMW, apply_step=broken))
    params = to_jax(problem(seed=6, steps=1)[0])
    tx = packed_adamw(LR, weight_decay=WD)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(tx.update)(params, tx.init(params), params))
    last_line = str(info.value).strip().splitlines()[-1]
    assert "packed_adamw CPU step of leaf ['b']: ArithmeticError: the numpy step broke" in last_line, str(info.value)


def test_the_path_follows_the_lowering_platform_not_the_default_backend():
    """The step is chosen when lowering: the CPU lowering is the numpy callback and imports no
    jax_triton; a CUDA lowering of the same trace reaches the jax-triton launcher (here, with
    no jax_triton installed, its import fails; tests/jax_frontend/test_jax_cuda.py covers a GPU host). The
    CPU lowering's one other host callback is the refusal warning's (side effect only), which
    `_refused_eagerly` compiles in on the CPU."""
    params = to_jax(problem(seed=6, steps=1)[0])
    tx = packed_adamw(LR, weight_decay=WD)
    traced = jax.jit(tx.update).trace(params, tx.init(params), params)
    cpu_text = traced.lower(lowering_platforms=("cpu",)).as_text()
    callbacks = cpu_text.split("custom_call @xla_ffi_python_cpu_callback(")[1:]
    warnings_only = ["has_side_effect = true" in call.split("}")[0] for call in callbacks]
    assert warnings_only.count(False) == 1 and "triton" not in cpu_text
    assert warnings_only.count(True) == 1
    if importlib.util.find_spec("jax_triton") is not None:
        pytest.skip("jax_triton is installed here; the CUDA lowering is checked in tests/jax_frontend/test_jax_cuda.py")
    assert "jax_triton" not in sys.modules
    with pytest.raises(ImportError, match="jax_triton"):
        traced.lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_vmap_over_an_ensemble_steps_each_member_as_alone(mode):
    params0, grads = problem(seed=18, steps=2)
    tx = packed_adamw(LR, weight_decay=WD, mode=mode)
    members = [to_jax(params0), jax.tree_util.tree_map(lambda x: x * 2, to_jax(params0))]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *members)
    g = jax.tree_util.tree_map(lambda x: jnp.stack([x, -x]), to_jax(grads[0]))
    updates, states = jax.jit(jax.vmap(tx.update))(g, jax.vmap(tx.init)(stacked), stacked)
    for i, member in enumerate(members):
        alone, alone_state = tx.update(jax.tree_util.tree_map(lambda x: x[i], g), tx.init(member), member)
        assert_trees_bits_equal(jax.tree_util.tree_map(lambda x: x[i], updates), alone, f"member {i} updates")
        assert_trees_bits_equal(jax.tree_util.tree_map(lambda x: x[i], states.moments), alone_state.moments,
                                f"member {i} state")
