"""Format counts in JAX: `packed_adamw(..., track_format=True)` keeps per-leaf counts of
saturated, flushed and subnormal moments in its state (FORMAT.md, "Format counts"), and
`packed_adamw.jax.format_stats` reads them.

Against the numpy step's counts and a recount from the formats' definitions (eager and under
`jax.jit`), against torch `PackedAdamW(track_format=True)`, on 8 CPU devices (a child
process, as in test_jax_sharding.py), through the CUDA launch code run in the Triton
interpreter with a stand-in for jax-triton, and on CUDA (marked `cuda`).
"""
from __future__ import annotations

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import kernel_harness as H
from jax_helpers import (F32, SHARDED_SHAPES, InterpretedJaxTriton, assert_bits_equal, case_recorder,
                         jax_cuda_unavailable, optax_train_step, run_cases_child, sharded_specs, spanning_values,
                         step_callbacks)
from packed_adamw.core import StateFormat, launch
from packed_adamw.core.adamw import RULE as ADAMW_RULE
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT
from packed_adamw.core.adamw.hyperparams import SCALAR_FIELDS
from packed_adamw.core.adamw.numpy_step import update_chunk as _update_chunk, apply_step, step_scalar_row
from packed_adamw.jax import (
    FormatCounts,
    PackedAdamWState,
    export_state,
    format_stats,
    import_state,
    packed_adamw,
    packed_adamw_fused_step,
)
from packed_adamw.torch import PackedAdamW
from test_format_counts import recount
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

DEVICES = 8
COUNTED_MODES = ["packed", "fp16"]
KEYS = ("a", "b", "c")  # sorted: JAX's leaf order
SHAPES = {"a": (65, 67), "b": (3, 5), "c": ()}
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01
ROW = [LR, B1, B2, EPS, WD]


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    return (lambda f: jax.jit(f)) if request.param == "jit" else (lambda f: f)


def path_of(key: str) -> str:
    return jax.tree_util.keystr((jax.tree_util.DictKey(key),))


def random_start(mode: str, seed: int):
    """Parameters, gradients with NaN/Inf, and state words of every kind (random bits, zero,
    saturated, subnormal codes), so one step's moments land everywhere in the formats."""
    fmt = StateFormat(mode)
    rng = np.random.default_rng(seed)
    params, grads, words = {}, {}, {}
    for k, shape in SHAPES.items():
        n = int(np.prod(shape))
        params[k] = H.random_params(rng, n).reshape(shape)
        g = H.random_grads(rng, n, fmt)
        if n > 100:
            H.inject_nonfinite(rng, g)
        grads[k] = g.reshape(shape)
        words[k] = H.random_state(rng, n, fmt).reshape(shape)
    return params, grads, words


def numpy_counts(params, grads, words, count: int, fmt: StateFormat) -> dict:
    """One numpy step per leaf from these words: {key: (new words, [6] int64 counts)}."""
    out = {}
    for k in KEYS:
        p, s = np.array(params[k], F32).reshape(-1), np.array(words[k]).reshape(-1)
        counts = np.zeros(6, np.int64)
        apply_step(p, np.array(grads[k], F32).reshape(-1), s, step_scalar_row(count, ROW), fmt=fmt,
                   format_counts_out=counts)
        out[k] = (s, counts)
    return out


def recount_from_words(params, grads, words, new_words, count: int, fmt: StateFormat) -> np.ndarray:
    """test_format_counts.recount over one leaf: the unrounded moments from the decoded old
    words, and the stored codes from the new words."""
    scalars = dict(zip(SCALAR_FIELDS, step_scalar_row(count, ROW)))
    p, g, s = (np.asarray(x).reshape(-1) for x in (params, grads, words))
    m_fmt, r_fmt = fmt.formats
    with np.errstate(all="ignore"):
        _, _, accepted = _update_chunk(p, g, s, scalars, fmt)
        g0 = np.where(np.isfinite(g), g, F32(0))
        m = m_fmt.decode_table[s >> np.uint32(MOMENT_SHIFT)]
        rms = r_fmt.decode_table[s & np.uint32(0xFFFF)]
        m_next = scalars["b1"] * m + scalars["one_minus_b1"] * g0
        rms_next = np.sqrt(scalars["b2"] * (rms * rms) + scalars["one_minus_b2"] * (g0 * g0))
    return recount(m_next, rms_next, np.asarray(new_words).reshape(-1), accepted, fmt)


def tracked_state(tx, params, words, count: int):
    return tx.init(params)._replace(count=jnp.asarray(count, jnp.int32),
                                    moments={k: jnp.asarray(v) for k, v in words.items()})


def as_counts(stats: dict, key: str) -> list[int]:
    return [stats[path_of(key)][name] for name in FORMAT_COUNTS]


def _step_equations(jaxpr):
    """The `packed_adamw_step` equations of a jaxpr, also inside nested ones (jit, shard_map)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "packed_adamw_step":
            yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _step_equations(inner)


def step_outputs(step, *args, **kwargs) -> int:
    """How many results the step primitive has in `step(*args, **kwargs)`: one more (the
    counts) when the step counts."""
    eqns = list(_step_equations(jax.make_jaxpr(functools.partial(step, **kwargs))(*args).jaxpr))
    assert len(eqns) == 1, eqns
    return len(eqns[0].outvars)


# ---------------------------------------------------------------------------------------------
# CPU: the numpy step in the callback
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_counts_equal_the_numpy_step_and_a_recount_from_the_definitions(mode, variant):
    fmt = StateFormat(mode)
    params, grads, words = random_start(mode, seed=3)
    tx = packed_adamw(LR, B1, B2, EPS, WD, mode=mode, track_format=True)
    state = tracked_state(tx, params, words, count=2)
    _, new_state = variant(tx.update)({k: jnp.asarray(v) for k, v in grads.items()}, state,
                                      {k: jnp.asarray(v) for k, v in params.items()})
    stats = format_stats(new_state)
    expected = numpy_counts(params, grads, words, 3, fmt)
    assert set(stats) == {path_of(k) for k in KEYS}
    for k in KEYS:
        new_words, counts = expected[k]
        assert_bits_equal(new_state.moments[k].reshape(-1), new_words, f"words of {k} with counting on")
        assert as_counts(stats, k) == counts.tolist(), k
        assert counts.tolist() == recount_from_words(params[k], grads[k], words[k], new_words, 3, fmt).tolist(), k
        assert stats[path_of(k)]["elements"] == int(np.prod(SHAPES[k]))
    # The spanning values saturate, flush and land subnormal in the large leaf.
    assert all(c > 0 for c in as_counts(stats, "a")), stats


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_the_cpu_callback_keeps_float32_subnormals_as_the_numpy_step_does(mode, variant):
    """XLA's callback threads flush subnormals to zero; the step must not (a subnormal
    parameter's decay, a fp32-mode v of a tiny gradient; for counting, a moment whose only
    nonzero part is subnormal is "flushed")."""
    fmt = StateFormat(mode)
    p = np.array([1e-39, 1.0, 0.5, -3e-41], F32)
    g = np.array([0.0, 1e-20, 1e-25, 0.0], F32)
    tx = packed_adamw(LR, weight_decay=0.1, mode=mode)
    u, s = variant(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.asarray(p)}), {"w": jnp.asarray(p)})
    update, words = np.empty_like(p), np.zeros(fmt.flat_state_shape(4), fmt.state_dtype)
    apply_step(p.copy(), g, words, step_scalar_row(1, [LR, 0.9, 0.999, 1e-8, 0.1]), fmt=fmt, update_out=update)
    assert np.asarray(update).view(np.uint32)[0] != 0x80000000  # -(lr * wd * p): subnormal, not -0.0
    assert_bits_equal(u["w"], update, "updates")
    assert_bits_equal(s.moments["w"], words, "state")


@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_huge_gradients_give_saturated_counts_and_tiny_ones_flushed_counts(mode, variant):
    n = 1000
    params = {"w": jnp.ones((n,), jnp.float32)}
    tx = packed_adamw(LR, mode=mode, track_format=True)
    for scale, saturated in ((1e8, True), (1e-12, False)):
        _, state = variant(tx.update)({"w": jnp.full((n,), scale, jnp.float32)}, tx.init(params), params)
        stats = format_stats(state)["['w']"]
        assert (stats["saturated_m"] == n and stats["saturated_rms"] == n) == saturated, stats
        assert (stats["flushed_m"] == n and stats["flushed_rms"] == n) == (not saturated), stats
        assert stats["elements"] == n


def test_counts_accumulate_over_steps_and_carry_into_the_high_word(variant):
    fmt = StateFormat("packed")
    rng = np.random.default_rng(8)
    params = {k: spanning_values(rng, s, -4.0, 1.0) for k, s in SHAPES.items()}
    grads = [{k: spanning_values(rng, s, -14.0, 3.0) for k, s in SHAPES.items()} for _ in range(3)]
    tx = packed_adamw(LR, B1, B2, EPS, WD, track_format=True)
    step = variant(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    p, state = {k: jnp.asarray(v) for k, v in params.items()}, tx.init(params)
    ref_p = {k: np.array(v, F32).reshape(-1) for k, v in params.items()}
    ref_s = {k: np.zeros(v.size, np.uint32) for k, v in ref_p.items()}
    ref_counts = {k: np.zeros(6, np.int64) for k in KEYS}
    for t, g in enumerate(grads, start=1):
        p, state = step(p, state, {k: jnp.asarray(v) for k, v in g.items()})
        for k in KEYS:
            apply_step(ref_p[k], g[k].reshape(-1).astype(F32), ref_s[k], step_scalar_row(t, ROW), fmt=fmt,
                       format_counts_out=ref_counts[k])
    stats = format_stats(state, params)
    for k in KEYS:
        assert as_counts(stats, k) == ref_counts[k].tolist(), k
        assert stats[path_of(k)]["elements"] == 3 * int(np.prod(SHAPES[k]))
        assert_bits_equal(p[k].reshape(-1), ref_p[k], f"params of {k}")
    # 64-bit totals: a low word about to wrap carries into the high word.
    halves = np.zeros((3, 6, 2), np.uint32)
    halves[0, :, 0] = np.uint32(2**32 - 5)
    halves[0, :, 1] = 7
    near_wrap = state._replace(format_counts=FormatCounts(state.format_counts.steps, jnp.asarray(halves)))
    huge = {k: jnp.full(s, 1e8, jnp.float32) for k, s in SHAPES.items()}
    _, after = variant(tx.update)(huge, near_wrap, p)
    n = int(np.prod(SHAPES["a"]))
    assert format_stats(after)["['a']"]["saturated_m"] == 7 * 2**32 + 2**32 - 5 + n


@pytest.mark.filterwarnings("ignore:PackedAdamW.*saturated:RuntimeWarning")
def test_torch_and_jax_count_the_same(variant):
    rng = np.random.default_rng(11)
    params = {k: spanning_values(rng, s, -4.0, 1.0) for k, s in SHAPES.items()}
    grads = [{k: spanning_values(rng, s, -14.0, 3.0) for k, s in SHAPES.items()} for _ in range(3)]
    tensors = [torch.nn.Parameter(torch.from_numpy(params[k].copy())) for k in KEYS]
    opt = PackedAdamW(list(zip(KEYS, tensors)), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, track_format=True)
    tx = packed_adamw(LR, B1, B2, EPS, WD, track_format=True)
    p, state = {k: jnp.asarray(v) for k, v in params.items()}, tx.init(params)
    update = variant(tx.update)
    for g in grads:
        for k, t in zip(KEYS, tensors):
            t.grad = torch.from_numpy(g[k].copy())
        opt.step()
        u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, u)
    torch_stats, jax_stats = opt.format_stats(), format_stats(state)
    assert {path_of(k): v for k, v in torch_stats.items()} == jax_stats
    assert sum(jax_stats["['a']"].values()) > jax_stats["['a']"]["elements"]  # something was counted


@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_counting_changes_no_bit_and_costs_nothing_when_off(mode):
    """Off (the default): the state holds only the count and the words (its format counts are
    None) and the step primitive has no counts output; on, the parameters and words are the
    same bits."""
    params, grads, words = random_start(mode, seed=5)
    params = {k: jnp.asarray(v) for k, v in params.items()}
    grads = {k: jnp.asarray(v) for k, v in grads.items()}
    off, on = packed_adamw(LR, mode=mode), packed_adamw(LR, mode=mode, track_format=True)
    off_state = off.init(params)
    assert type(off_state) is PackedAdamWState and off_state.format_counts is None and off_state.low_halves is None
    assert len(jax.tree_util.tree_leaves(off_state)) == 1 + len(KEYS)  # the count and the words, no more
    for tx in (off, on):
        assert step_outputs(tx.update, grads, tx.init(params), params) == 2 * len(KEYS) + (tx is on)
    u_off, s_off = jax.jit(off.update)(grads, off.init(params)._replace(moments=words), params)
    u_on, s_on = jax.jit(on.update)(grads, on.init(params)._replace(moments=words), params)
    for k in KEYS:
        assert_bits_equal(u_on[k], u_off[k], f"updates of {k}")
        assert_bits_equal(s_on.moments[k], s_off.moments[k], f"words of {k}")
    fused_off = packed_adamw_fused_step(LR, mode=mode)
    fused_on = packed_adamw_fused_step(LR, mode=mode, track_format=True)
    p_off, _ = jax.jit(fused_off)(params, grads, off.init(params))
    p_on, f_on = jax.jit(fused_on)(params, grads, on.init(params))
    for k in KEYS:
        assert_bits_equal(p_on[k], p_off[k], f"fused params of {k}")
    assert format_stats(f_on) == format_stats(jax.jit(on.update)(grads, on.init(params), params)[1])


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_steps_updated_with_track_format_false_count_nothing_and_change_no_bit(jitted):
    """Counting on sampled steps: `update(..., track_format=False)` runs the uncounted step
    and keeps the counts, through `optax.chain` too; the counts are the numpy step's over the
    counted steps only and every bit is the plain transform's."""
    fmt = StateFormat("packed")
    params, grads, words = random_start("packed", seed=9)
    params = {k: jnp.asarray(v) for k, v in params.items()}
    tracked = optax.chain(optax.identity(), packed_adamw(LR, B1, B2, EPS, WD, track_format=True))
    plain = packed_adamw(LR, B1, B2, EPS, WD)
    update = jax.jit(tracked.update, static_argnames="track_format") if jitted else tracked.update
    state = tracked.init(params)
    state = (state[0], state[1]._replace(moments={k: jnp.asarray(v) for k, v in words.items()}))
    plain_state = plain.init(params)._replace(moments={k: jnp.asarray(v) for k, v in words.items()})
    host_words, expected = {k: np.array(v) for k, v in words.items()}, {k: np.zeros(6, np.int64) for k in KEYS}
    counted = (False, True, False, True)
    for step, on in enumerate(counted, start=1):
        g = {k: jnp.asarray(v) * (4.0 ** (step - 2)) for k, v in grads.items()}
        for k, (new_words, counts) in numpy_counts(params, g, host_words, step, fmt).items():
            host_words[k] = new_words.reshape(SHAPES[k])
            expected[k] += counts if on else 0
        updates, state = update(g, state, params, track_format=on)
        plain_updates, plain_state = plain.update(g, plain_state, params)
        for k in KEYS:
            assert_bits_equal(updates[k], plain_updates[k], f"updates of {k}, step {step}")
            assert_bits_equal(state[1].moments[k].reshape(-1), host_words[k].reshape(-1), f"words of {k}")
        params = optax.apply_updates(params, updates)
    assert int(state[1].format_counts.steps) == sum(counted)
    stats = format_stats(state)
    for k in KEYS:
        assert as_counts(stats, k) == expected[k].tolist(), k
        assert stats[path_of(k)]["elements"] == sum(counted) * int(np.prod(SHAPES[k]))


def test_the_per_step_track_format_is_a_python_bool_of_a_counting_transform():
    params = {"w": jnp.ones(3)}
    tracked, plain = packed_adamw(LR, track_format=True), packed_adamw(LR)
    with pytest.raises(TypeError, match="static argument"):
        jax.jit(lambda flag: tracked.update(params, tracked.init(params), params, track_format=flag))(True)
    with pytest.raises(TypeError, match="Python bool"):
        tracked.update(params, tracked.init(params), params, track_format=1)
    for flag in (True, False):  # a member of an optax tree that does not count ignores the switch
        _, state = plain.update(params, plain.init(params), params, track_format=flag)
        assert type(state) is PackedAdamWState and state.format_counts is None


def test_the_state_keeps_its_types_through_scan_cond_chain_multi_steps_and_inject_hyperparams():
    params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
    grads = {k: jnp.full(s, 1e-3, jnp.float32) for k, s in SHAPES.items()}
    tx = optax.chain(optax.clip_by_global_norm(1.0), packed_adamw(LR, track_format=True))
    state = tx.init(params)

    def body(carry, _):
        p, s = carry
        u, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, u), s), None

    (_, scanned), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=4))((params, state))
    types = lambda s: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), s)  # noqa: E731
    assert types(scanned) == types(state)
    stats = format_stats(scanned)  # found inside the chain's state
    assert stats["['a']"]["elements"] == 4 * int(np.prod(SHAPES["a"]))
    skipped = jax.jit(lambda s: jax.lax.cond(True, lambda s: s, lambda s: tx.update(grads, s, params)[1], s))(state)
    assert types(skipped) == types(state)
    every_2 = optax.MultiSteps(packed_adamw(LR, track_format=True), every_k_schedule=2)
    multi = jax.jit(every_2.update)
    s_multi = every_2.init(params)
    for _ in range(4):
        _, s_multi = multi(grads, s_multi, params)
    assert format_stats(s_multi)["['a']"]["elements"] == 2 * int(np.prod(SHAPES["a"]))  # the inner steps
    injected = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, track_format=True)
    plain = packed_adamw(LR, track_format=True)
    _, s_inj = jax.jit(injected.update)(grads, injected.init(params), params)
    _, s_plain = jax.jit(plain.update)(grads, plain.init(params), params)
    assert format_stats(s_inj) == format_stats(s_plain)


def test_a_step_refused_whole_counts_neither_elements_nor_moments():
    params = {"w": jnp.ones((10,), jnp.float32)}
    tx = optax.inject_hyperparams(packed_adamw)(learning_rate=LR, track_format=True)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(-1.0)  # invalid: refused in the graph under jit
    _, state = jax.jit(tx.update)({"w": jnp.full((10,), 1e8, jnp.float32)}, state, params)
    assert format_stats(state)["['w']"] == dict.fromkeys(["elements", *FORMAT_COUNTS], 0)


def test_import_state_with_track_format_starts_the_counts_at_zero():
    rng = np.random.default_rng(2)
    params = {k: jnp.asarray(spanning_values(rng, s, -4.0, 1.0)) for k, s in SHAPES.items()}
    grads = {k: jnp.asarray(spanning_values(rng, s, -14.0, 3.0)) for k, s in SHAPES.items()}
    tx = packed_adamw(LR, track_format=True)
    _, state = tx.update(grads, tx.init(params), params)
    imported = import_state(export_state(state, "packed"), params, "packed", track_format=True)
    assert isinstance(imported, PackedAdamWState) and imported.format_counts is not None and int(imported.count) == 1
    assert all(v == 0 for entry in format_stats(imported).values() for v in entry.values())
    _, again = tx.update(grads, imported, params)
    assert format_stats(again)["['a']"]["elements"] == int(np.prod(SHAPES["a"]))
    untracked = import_state(export_state(state, "packed"), params, "packed")
    assert type(untracked) is PackedAdamWState and untracked.format_counts is None


def test_refusals_name_what_to_do():
    params = {"w": jnp.ones((3,), jnp.float32)}
    for factory in (packed_adamw, packed_adamw_fused_step):
        with pytest.raises(ValueError, match="fp32 mode stores float32 moments"):
            factory(1e-3, mode="fp32", track_format=True)
    with pytest.raises(ValueError, match="fp32 mode has none"):
        import_state(export_state(packed_adamw(1e-3, mode="fp32").init(params), "fp32"), params, "fp32",
                     track_format=True)
    on, off = packed_adamw(1e-3, track_format=True), packed_adamw(1e-3)
    with pytest.raises(ValueError, match="has no format counts"):
        on.update(params, off.init(params), params)
    with pytest.raises(ValueError, match="built with track_format=False"):
        off.update(params, on.init(params), params)
    with pytest.raises(ValueError, match="track_format=True"):
        format_stats(off.init(params))
    with pytest.raises(ValueError, match="no packed_adamw state"):
        format_stats(optax.adam(1e-3).init(params))
    with pytest.raises(ValueError, match="2 packed_adamw states with format counts"):
        format_stats((on.init(params), on.init(params)))
    with pytest.raises(ValueError, match="not those of params"):
        format_stats(on.init(params), {"v": params["w"]})
    with pytest.raises(TypeError, match="cannot run under jax.jit"):
        jax.jit(lambda s: format_stats(s)["['w']"]["elements"])(on.init(params))
    with pytest.raises(TypeError, match="track_format="):
        packed_adamw(1e-3, track_format="yes")


# ---------------------------------------------------------------------------------------------
# The CUDA launch code (`_triton_launch.step`), run in the Triton interpreter
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not launch.interpreting(), reason="runs the kernels in the Triton interpreter")
@pytest.mark.parametrize("mode", COUNTED_MODES)
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["leaf_groups", "per_leaf"])
@pytest.mark.parametrize("write_update", [True, False], ids=["transform", "fused"])
def test_the_cuda_launches_count_as_the_numpy_step_in_the_interpreter(mode, multi_tensor, write_update, monkeypatch):
    from packed_adamw.core.adamw.kernel import FUNCTIONAL_KERNELS as KERNELS
    from packed_adamw.jax import _leaf_group, _triton_launch

    fmt = StateFormat(mode)
    rng = np.random.default_rng(17)
    sizes = [1300, 1, 0, 7, 600] + [5] * (_leaf_group.LEAVES_PER_LAUNCH - 2)  # two leaf groups, an empty leaf
    params = [H.random_params(rng, n) for n in sizes]
    grads = [H.random_grads(rng, n, fmt) for n in sizes]
    H.inject_nonfinite(rng, grads[0])
    words = [H.random_state(rng, n, fmt) for n in sizes]
    # The rule's row variants: the row with weight decay, then without (a mask leaves these out).
    leaf_rows = [ADAMW_RULE.leaf_variant(i % 3 != 1) for i in range(len(sizes))]
    rows = [ROW, ROW[:4] + [0.0]]
    count = 4
    stand_in = InterpretedJaxTriton()
    monkeypatch.setattr(_triton_launch, "_jax_triton", lambda: stand_in)
    outs, new_states, counts = _triton_launch.step(
        [jnp.asarray(p) for p in params], [jnp.asarray(g) for g in grads], [jnp.asarray(s) for s in words],
        leaf_rows,
        jnp.asarray(rows, jnp.float32), jnp.asarray(count, jnp.int32), fmt=fmt, kernels=KERNELS,
        write_update=write_update, multi_tensor=multi_tensor, alias_grads=write_update, track_format=True)
    counting = {KERNELS.tensor_counting, KERNELS.leaf_group}
    launched = [k for k, m in stand_in.launches if k in counting and m["TRACK_FORMAT"]]
    assert len(launched) == (2 if multi_tensor else len(sizes) - 1), stand_in.kernels
    if multi_tensor:  # groups of 16 and 2 leaves: one compiled kernel (same constants, same argument dtypes)
        assert len({stand_in.variant(i) for i, k in enumerate(stand_in.kernels) if k is KERNELS.leaf_group}) == 1
    assert counts.shape == (len(sizes), 6) and counts.dtype == jnp.uint32
    for i, n in enumerate(sizes):
        p, s = params[i].copy(), words[i].copy()
        update = np.empty_like(p) if write_update else None
        expected = np.zeros(6, np.int64)
        apply_step(p, grads[i], s, step_scalar_row(count, rows[leaf_rows[i]]), fmt=fmt, update_out=update,
                   format_counts_out=expected)
        assert_bits_equal(outs[i], update if write_update else p, f"{'updates' if write_update else 'params'} {i}")
        assert_bits_equal(new_states[i], s, f"words {i}")
        assert np.asarray(counts[i]).tolist() == expected.tolist(), i
    assert np.asarray(counts[0]).min() > 0, counts[0]
    # Off: no counts, and only the kernels without a counters output.
    stand_in.clear()
    *_, none = _triton_launch.step(
        [jnp.asarray(p) for p in params], [jnp.asarray(g) for g in grads], [jnp.asarray(s) for s in words],
        leaf_rows,
        jnp.asarray(rows, jnp.float32), jnp.asarray(count, jnp.int32), fmt=fmt, kernels=KERNELS,
        write_update=write_update, multi_tensor=multi_tensor, track_format=False)
    assert none is None and KERNELS.tensor_counting not in stand_in.kernels
    assert not any(m.get("TRACK_FORMAT") for _, m in stand_in.launches)


# ---------------------------------------------------------------------------------------------
# 8 CPU devices (a child process)
# ---------------------------------------------------------------------------------------------
def _cases():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from packed_adamw.core import StateFormat
    from packed_adamw.jax import format_stats, packed_adamw, packed_adamw_fused_step

    assert len(jax.devices()) == DEVICES, jax.devices()
    rng = np.random.default_rng(0)
    shapes, specs = SHARDED_SHAPES, sharded_specs()
    params0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads0 = [{k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-14, 3, s)).astype(np.float32)
               for k, s in shapes.items()} for _ in range(3)]
    explicit = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Auto,))
    grid = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs2 = {"a": P("data", "model"), "b": P("model"), "c": P(), "d": P(None, ("data", "model")), "r": P("data")}
    shapes2 = dict(shapes, r=(4,))

    def put(tree, mesh, spec_of):
        return {k: jax.device_put(v, NamedSharding(mesh, spec_of[k])) for k, v in tree.items()}

    def reference(mode, params, grads):
        tx = packed_adamw(1e-2, weight_decay=0.1, mode=mode, track_format=True)
        p = {k: jnp.asarray(v) for k, v in params.items()}
        state = tx.init(p)
        for g in grads:
            p, state = jax.jit(optax_train_step(tx))(p, state, {k: jnp.asarray(v) for k, v in g.items()})
        return format_stats(state), state

    results, case = case_recorder()

    @case("sharded_counts_equal_unsharded")
    def _():
        for mode in ("packed", "fp16"):
            want, want_state = reference(mode, params0, grads0)
            assert sum(v for entry in want.values() for v in entry.values()) > 0, want
            for mesh, jit in ((explicit, True), (explicit, False), (auto, True)):
                with jax.set_mesh(mesh):
                    tx = packed_adamw(1e-2, weight_decay=0.1, mode=mode, track_format=True)
                    step = jax.jit(optax_train_step(tx)) if jit else optax_train_step(tx)
                    p = put(params0, mesh, specs)
                    state = tx.init(p)
                    for g in grads0:
                        p, state = step(p, state, put(g, mesh, specs))
                    where = f"{mode} {mesh.axis_types} jit={jit}"
                    assert format_stats(state) == want, (where, format_stats(state), want)
                    for k in shapes:
                        assert np.array_equal(np.asarray(state.moments[k]).view(np.uint32),
                                              np.asarray(want_state.moments[k]).view(np.uint32)), (where, k)

    @case("replicated_leaves_are_not_counted_twice")
    def _():
        # A 2-d mesh: "b" is split over "model" and replicated over "data", "r" the other way.
        params2 = dict(params0, r=params0["r"][:4])
        grads2 = [dict(g, r=g["r"][:4]) for g in grads0]
        want, _ = reference("packed", params2, grads2)
        with jax.set_mesh(grid):
            fused = jax.jit(packed_adamw_fused_step(1e-2, weight_decay=0.1, track_format=True), donate_argnums=(0, 2))
            p = put(params2, grid, specs2)
            state = packed_adamw(1e-2, track_format=True).init(p)
            for g in grads2:
                p, state = fused(p, {k: jnp.asarray(v) for k, v in g.items()}, state)
            assert format_stats(state) == want, (format_stats(state), want)
            assert {k: v["elements"] for k, v in want.items()} == \
                {f"['{k}']": 3 * int(np.prod(s)) for k, s in shapes2.items()}

    @case("sharded_uncounted_steps_count_nothing_and_change_no_bit")
    def _():
        # Counting on sampled steps over a mesh: a step given track_format=False is the step
        # primitive without counts (compiled: no all-reduce, the counts being the only collective)
        # and gives the plain transform's bits; the counts are the numpy step's over the counted steps.
        counted = (True, False, True)
        fmt, row = StateFormat("packed"), [1e-2, 0.9, 0.999, 1e-8, 0.1]
        want, every_step = {}, {}
        for k, shape in shapes.items():
            p, s = params0[k].reshape(-1).copy(), np.zeros(params0[k].size, np.uint32)
            sampled, full = np.zeros(6, np.int64), np.zeros(6, np.int64)
            for t, (on, g) in enumerate(zip(counted, grads0), start=1):
                step_counts = np.zeros(6, np.int64)
                apply_step(p, g[k].reshape(-1), s, step_scalar_row(t, row), fmt=fmt, format_counts_out=step_counts)
                sampled += step_counts if on else 0
                full += step_counts
            want[f"['{k}']"] = {"elements": sum(counted) * p.size, **dict(zip(FORMAT_COUNTS, sampled.tolist()))}
            every_step[k] = full
        assert any((every_step[k] - [want[f"['{k}']"][n] for n in FORMAT_COUNTS]).any() for k in shapes)
        with jax.set_mesh(explicit):
            tx = packed_adamw(1e-2, weight_decay=0.1, track_format=True)
            plain = packed_adamw(1e-2, weight_decay=0.1)

            def sampled_step(params, state, grads, track_format):
                updates, state = tx.update(grads, state, params, track_format=track_format)
                return optax.apply_updates(params, updates), state

            step = jax.jit(sampled_step, static_argnames="track_format")
            plain_step = jax.jit(optax_train_step(plain))
            p, q = put(params0, explicit, specs), put(params0, explicit, specs)
            state, plain_state = tx.init(p), plain.init(q)
            g0 = put(grads0[0], explicit, specs)
            uncounted = step_outputs(plain.update, g0, plain_state, q)
            for on in (False, True):
                assert step_outputs(tx.update, g0, state, p, track_format=on) == uncounted + on, on
                text = step.lower(p, state, g0, on).compile().as_text()
                assert ("all-reduce" in text) == on, on
            for on, g in zip(counted, grads0):
                p, state = step(p, state, put(g, explicit, specs), on)
                q, plain_state = plain_step(q, plain_state, put(g, explicit, specs))
            assert int(state.format_counts.steps) == sum(counted)
            assert format_stats(state) == want, (format_stats(state), want)
            for k in shapes:
                assert p[k].sharding.is_equivalent_to(NamedSharding(explicit, specs[k]), p[k].ndim), k  # stays sharded
                for a, b in ((p[k], q[k]), (state.moments[k], plain_state.moments[k])):
                    assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), k

    @case("tracked_state_types_agree_eager_and_jit")
    def _():
        with jax.set_mesh(explicit):
            params = jnp.zeros((2, 8, 4), jnp.float32, out_sharding=NamedSharding(explicit, P(None, "x")))
            tx = packed_adamw(1.0, track_format=True)
            state0 = tx.init(params)
            _, state1 = tx.update(params, state0, params)
            _, state2 = jax.jit(tx.update)(params, state0, params)
            types = [jax.tree_util.tree_map(jax.typeof, s) for s in (state0, state1, state2)]
            assert types[0] == types[1] == types[2], types

    @case("the_counts_are_the_only_collective")
    def _():
        with jax.set_mesh(explicit):
            tx = packed_adamw(1e-2, weight_decay=0.1, track_format=True)
            p = put(params0, explicit, specs)
            text = jax.jit(tx.update).lower(put(grads0[0], explicit, specs), tx.init(p), p).compile().as_text()
            found = sorted(set(re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                                          r"(?:-start)?\(", text)))
            assert found == ["all-reduce"], found
            reductions = [line for line in text.splitlines() if re.search(r"\ball-reduce(-start)?\(", line)]
            assert all("u32[" in line and "f32[" not in line for line in reductions), reductions  # counts only
            assert step_callbacks(text) == 1

    @case("custom_partitioning_sums_the_counts_of_the_shards")
    def _():
        from packed_adamw.jax._sharding import partitioned_step
        from packed_adamw.jax._rules import ADAMW
        from packed_adamw.jax._step import StepConfig, StepOperands

        def body(*args, config):  # stand-in: each shard "counts" its elements, i + 1 per element
            n = config.n_leaves
            ps, ss = args[:n], args[2 * n:3 * n]
            counts = jnp.stack([jnp.full((6,), p.size * (i + 1), jnp.uint32) for i, p in enumerate(ps)])
            return [p + 0 for p in ps] + [s + 0 for s in ss] + [counts]

        fmt = StateFormat("packed")
        config = StepConfig(fmt=fmt, steps=ADAMW, write_update=True, multi_tensor=True,
                            leaf_rows=(0,) * len(shapes), paths=tuple(shapes), track_format=True)
        p = [jax.device_put(params0[k], NamedSharding(auto, specs[k])) for k in shapes]
        s = [jax.device_put(np.zeros(shapes[k], np.uint32), NamedSharding(auto, specs[k])) for k in shapes]
        h, c = jnp.full((2, 5), 0.5, jnp.float32), jnp.asarray(3, jnp.int32)
        fn = jax.jit(lambda p, g, s, h, c: partitioned_step(StepOperands(p, g, s, [None] * len(p), h, c),
                                                             config=config, body=body))
        counts = fn(p, p, s, h, c).counts
        want = [np.full(6, int(np.prod(shapes[k])) * (i + 1)) for i, k in enumerate(shapes)]
        assert np.asarray(counts).tolist() == np.stack(want).tolist(), np.asarray(counts)
        assert counts.sharding.is_fully_replicated, counts.sharding

    return results


@pytest.fixture(scope="module")
def child_results():
    return run_cases_child(__file__, DEVICES)


@pytest.mark.parametrize("name", ["sharded_counts_equal_unsharded",
                                  "sharded_uncounted_steps_count_nothing_and_change_no_bit",
                                  "replicated_leaves_are_not_counted_twice",
                                  "tracked_state_types_agree_eager_and_jit", "the_counts_are_the_only_collective",
                                  "custom_partitioning_sums_the_counts_of_the_shards"])
def test_on_eight_cpu_devices(child_results, name):
    assert name in child_results, f"case {name} did not run: {sorted(child_results)}"
    assert child_results[name] == "ok", child_results[name]


# ---------------------------------------------------------------------------------------------
# CUDA (jax-triton)
# ---------------------------------------------------------------------------------------------
_why_no_cuda = jax_cuda_unavailable


@pytest.mark.cuda
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["leaf_groups", "per_leaf"])
@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_cuda_counts_equal_the_numpy_step_and_torch_cuda(mode, multi_tensor):
    """The jax-triton launches (a solo launch of several blocks per program, leaf groups, the
    transform writing into the gradients and the donated fused step) count as the numpy step
    does, and as torch's CUDA launches."""
    reason = _why_no_cuda()
    if reason is not None:
        pytest.skip(reason)
    fmt = StateFormat(mode)
    shapes = {"big": (1031, 1027), "odd": (7,), "one": (1,), "s": (), "cube": (13, 17, 3)}
    if multi_tensor:
        shapes["huge"] = (launch.SOLO_ELEMENTS + 3,)  # a launch of its own
    keys = sorted(shapes)
    rng = np.random.default_rng(23)
    params0 = {k: spanning_values(rng, s, -4.0, 1.0) for k, s in shapes.items()}
    grads = [{k: spanning_values(rng, s, -14.0, 6.0) for k, s in shapes.items()} for _ in range(2)]
    ref_p = {k: params0[k].reshape(-1).copy() for k in keys}
    ref_s = {k: np.zeros(ref_p[k].size, np.uint32) for k in keys}
    ref_counts = {k: np.zeros(6, np.int64) for k in keys}
    for t, g in enumerate(grads, start=1):
        for k in keys:
            apply_step(ref_p[k], g[k].reshape(-1), ref_s[k], step_scalar_row(t, ROW), fmt=fmt,
                       format_counts_out=ref_counts[k])
    want = {path_of(k): {"elements": len(grads) * ref_p[k].size,
                         **dict(zip(FORMAT_COUNTS, ref_counts[k].tolist()))} for k in keys}
    # Every count these values can reach is reached; fp16's RMS (max 65504) cannot saturate on gradients below 2**6.
    reachable = [name for name in FORMAT_COUNTS if not (mode == "fp16" and name == "saturated_rms")]
    assert all(want[path_of("big")][name] > 0 for name in reachable), want

    tx = packed_adamw(LR, B1, B2, EPS, WD, mode=mode, multi_tensor=multi_tensor, track_format=True)
    fused = jax.jit(packed_adamw_fused_step(LR, B1, B2, EPS, WD, mode=mode, multi_tensor=multi_tensor,
                                            track_format=True), donate_argnums=(0, 2))

    @jax.jit
    def train_step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p_t = {k: jnp.asarray(v) for k, v in params0.items()}
    p_f = {k: jnp.asarray(v) for k, v in params0.items()}
    s_t, s_f = tx.init(p_t), tx.init(p_f)
    for g in grads:
        p_t, s_t = train_step(p_t, s_t, {k: jnp.asarray(v) for k, v in g.items()})
        p_f, s_f = fused(p_f, {k: jnp.asarray(v) for k, v in g.items()}, s_f)
    assert format_stats(s_t) == want
    assert format_stats(s_f) == want
    for k in keys:
        assert_bits_equal(np.asarray(p_t[k]).reshape(-1), ref_p[k], f"transform params[{k!r}]")
        assert_bits_equal(np.asarray(s_f.moments[k]).reshape(-1), ref_s[k], f"fused words[{k!r}]")

    # torch's CUDA launches count the same.
    tensors = [torch.nn.Parameter(torch.from_numpy(params0[k].copy()).cuda()) for k in keys]
    opt = PackedAdamW(list(zip(keys, tensors)), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, mode=mode,
                      track_format=True, multi_tensor=multi_tensor)
    for g in grads:
        for k, t in zip(keys, tensors):
            t.grad = torch.from_numpy(g[k].copy()).cuda()
        opt.step()
    assert {path_of(k): v for k, v in opt.format_stats().items()} == want


@pytest.mark.cuda
def test_cuda_custom_partitioning_counts_equal_the_plain_step():
    """The Auto-axes path (`custom_partitioning`, lowered inline on one GPU) returns the counts
    of the plain step."""
    reason = _why_no_cuda()
    if reason is not None:
        pytest.skip(reason)
    from packed_adamw.jax._sharding import partitioned_step
    from packed_adamw.jax._rules import ADAMW
    from packed_adamw.jax._step import StepConfig, StepOperands, local_step

    fmt = StateFormat("packed")
    params, grads, words = random_start("packed", seed=31)
    config = StepConfig(fmt=fmt, steps=ADAMW, write_update=True, multi_tensor=True, leaf_rows=(0,) * len(KEYS),
                        paths=KEYS, alias_grads=True, track_format=True)
    p = [jnp.asarray(params[k]) for k in KEYS]
    g = [jnp.asarray(grads[k]) for k in KEYS]
    s = [jnp.asarray(words[k]) for k in KEYS]
    h = jnp.asarray([ROW, ROW[:4] + [0.0]], jnp.float32)
    c = jnp.asarray(3, jnp.int32)
    operands = lambda p, g, s, h, c: StepOperands(p, g, s, [None] * len(p), h, c)  # noqa: E731
    want = jax.jit(lambda *a: local_step(operands(*a), config=config))(p, g, s, h, c)
    got = jax.jit(lambda *a: partitioned_step(operands(*a), config=config))(p, g, s, h, c)
    expected = numpy_counts(params, grads, words, 3, fmt)
    assert np.asarray(want.counts).tolist() == [expected[k][1].tolist() for k in KEYS]
    assert np.asarray(got.counts).tolist() == np.asarray(want.counts).tolist()


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:PackedAdamW.*saturated:RuntimeWarning")  # gradients up to 100 saturate
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["leaf_groups", "per_leaf"])
def test_cuda_steps_updated_with_track_format_false_count_nothing_and_change_no_bit(multi_tensor):
    """Sampled counting on CUDA: steps given track_format=False (the transform under jit and
    the donated fused step; a bf16 leaf's split launch among them, and with leaf groups a solo
    launch) lower to the step without counts; the counts are torch CUDA's over the same
    counted steps, and every bit is that of a transform that never counts."""
    reason = _why_no_cuda()
    if reason is not None:
        pytest.skip(reason)
    shapes = {"big": (1031, 1027), "odd": (7,), "s": (), "w16": (129, 33)}
    if multi_tensor:
        shapes["huge"] = (launch.SOLO_ELEMENTS + 3,)  # a launch of its own
    dtypes = {k: (jnp.bfloat16 if k == "w16" else jnp.float32) for k in shapes}
    keys = sorted(shapes)
    rng = np.random.default_rng(29)
    params0 = {k: jnp.asarray(spanning_values(rng, s, -4.0, 1.0)).astype(dtypes[k]) for k, s in shapes.items()}
    switch = (False, True, True, False, True)
    grads = [{k: jnp.asarray(spanning_values(rng, s, -14.0, 2.0)).astype(dtypes[k]) for k, s in shapes.items()}
             for _ in switch]

    tracked = packed_adamw(LR, B1, B2, EPS, WD, multi_tensor=multi_tensor, track_format=True)
    plain = packed_adamw(LR, B1, B2, EPS, WD, multi_tensor=multi_tensor)
    fused_step = packed_adamw_fused_step(LR, B1, B2, EPS, WD, multi_tensor=multi_tensor, track_format=True)
    fused = jax.jit(fused_step, donate_argnums=(0, 2), static_argnames="track_format")

    def jitted_train_step(tx):
        def run(p, s, g, track_format=None):
            kwargs = {} if track_format is None else {"track_format": track_format}
            u, s = tx.update(g, s, p, **kwargs)
            return optax.apply_updates(p, u), s
        return jax.jit(run, static_argnames="track_format")

    # An uncounted step is the plain transform's step primitive, not a counted one whose counts are dropped.
    g0, uncounted = grads[0], step_outputs(plain.update, grads[0], plain.init(params0), params0)
    for on in (False, True):
        assert step_outputs(tracked.update, g0, tracked.init(params0), params0, track_format=on) == uncounted + on
        assert step_outputs(fused_step, params0, g0, tracked.init(params0), track_format=on) == uncounted + on

    tracked_step, plain_step = jitted_train_step(tracked), jitted_train_step(plain)
    p_t, p_p = dict(params0), dict(params0)
    p_f = {k: jnp.array(v, copy=True) for k, v in params0.items()}  # donated
    s_t, s_p, s_f = tracked.init(p_t), plain.init(p_p), tracked.init(p_f)
    for on, g in zip(switch, grads):
        p_t, s_t = tracked_step(p_t, s_t, g, track_format=on)
        p_p, s_p = plain_step(p_p, s_p, g)
        p_f, s_f = fused(p_f, g, s_f, track_format=on)
    assert int(s_t.format_counts.steps) == int(s_f.format_counts.steps) == sum(switch)
    as_bits = lambda x: np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32)  # noqa: E731
    for k in keys:
        for got, what in ((p_t[k], "transform"), (p_f[k], "fused step"), (s_t.moments[k], "transform words"),
                          (s_f.moments[k], "fused step words")):
            want = s_p.moments[k] if "words" in what else p_p[k]
            np.testing.assert_array_equal(as_bits(got), as_bits(want), err_msg=f"{what} [{k!r}]")
    for s in (s_t, s_f):
        np.testing.assert_array_equal(np.asarray(s.low_halves["w16"]), np.asarray(s_p.low_halves["w16"]))

    # torch's CUDA launches, switched the same way, count the same; counting every step would count more.
    def torch_counts(switched: bool) -> dict:
        tensors = [torch.nn.Parameter(torch.from_numpy(np.array(params0[k].astype(jnp.float32))).to(
            torch.bfloat16 if k == "w16" else torch.float32).cuda()) for k in keys]
        opt = PackedAdamW(list(zip(keys, tensors)), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD,
                          multi_tensor=multi_tensor, track_format=True)
        for on, g in zip(switch, grads):
            opt.track_format = on or not switched
            for k, t in zip(keys, tensors):
                t.grad = torch.from_numpy(np.array(g[k].astype(jnp.float32))).to(t.dtype).cuda()  # exact
            opt.step()
        return {path_of(k): v for k, v in opt.format_stats().items()}

    want, every_step = torch_counts(switched=True), torch_counts(switched=False)
    assert want[path_of("big")]["elements"] == sum(switch) * 1031 * 1027
    for k in keys:  # the uncounted steps had something to count
        if k != "s":
            assert [want[path_of(k)][n] for n in FORMAT_COUNTS] != \
                [every_step[path_of(k)][n] for n in FORMAT_COUNTS], k
    assert format_stats(s_t) == want
    assert format_stats(s_f) == want


if __name__ == "__main__" and "--cases" in sys.argv:
    _cases()
