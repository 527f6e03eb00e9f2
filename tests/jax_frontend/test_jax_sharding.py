"""Sharded parameters on 8 CPU devices: the state follows the parameters' shardings, the update
runs shard by shard with no collective, and the bits equal the unsharded step.

The cases need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts, so they
run in one child process (this file executed as a script) and every other test keeps one
device. The child prints one JSON line per case; each test below reads its own. The meshes
follow optax's sharding tests: axis "x" of 8 devices, `Explicit` axes under `jax.set_mesh`
(sharding in types), and a (4, 2) mesh for two-dimensional specs.
"""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from jax_helpers import (SHARDED_SHAPES, case_recorder, normalized_spec, optax_train_step, run_cases_child,
                         sharded_specs, step_callbacks)

DEVICES = 8
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\b")
MODES = ["packed", "fp16", "fp32"]


# ---------------------------------------------------------------------------------------------
# The cases (run in the child, with 8 devices)
# ---------------------------------------------------------------------------------------------
def _cases():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from packed_adamw.core import StateFormat
    from packed_adamw.jax import import_state, packed_adamw, packed_adamw_fused_step

    assert len(jax.devices()) == DEVICES, jax.devices()
    rng = np.random.default_rng(0)
    # Leaves sharded on each dimension, a 0-d leaf and a replicated one.
    shapes, specs = SHARDED_SHAPES, sharded_specs()
    params0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads0 = [{k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 1, s)).astype(np.float32)
               for k, s in shapes.items()} for _ in range(3)]
    mask = {"a": True, "b": False, "c": True, "d": True, "r": False}

    def bits(x):
        return np.asarray(x).view(np.uint32)

    def same_bits(a, b):
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        return len(la) == len(lb) and all(np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))

    def put(tree, mesh, spec_of=lambda k: specs[k]):
        return {k: jax.device_put(v, NamedSharding(mesh, spec_of(k))) for k, v in tree.items()}

    def spec_of_state(spec, mode):
        return P(None, *spec) if mode == "fp32" else spec

    def reference(mode):
        """The unsharded run on one device: params and state after each step."""
        tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
        params = {k: jnp.asarray(v) for k, v in params0.items()}
        state, out = tx.init(params), []
        step = jax.jit(optax_train_step(tx))
        for g in grads0:
            params, state = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
            out.append((params, state))
        return out

    def collectives(compiled_text):
        return sorted({m.group(1) for m in COLLECTIVE.finditer(compiled_text)})

    def entry_shapes(compiled_text):
        return re.search(r"ENTRY[^\n]*", compiled_text).group(0)

    results, case = case_recorder()

    explicit = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Auto,))
    start = time.perf_counter()
    refs = {mode: reference(mode) for mode in MODES}
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1)}), flush=True)

    @case("init_state_follows_params_like_optax_adamw")
    def _():
        # optax's own pattern: params of shape (2, 8, 4) sharded P(None, 'x') under set_mesh.
        with jax.set_mesh(explicit):
            params = jnp.zeros((2, 8, 4), jnp.float32, out_sharding=NamedSharding(explicit, P(None, "x")))
            mu = optax.adamw(1.0).init(params)[0].mu
            for mode in MODES:
                tx = packed_adamw(1.0, mode=mode)
                state = tx.init(params)
                ndim = state.moments.ndim
                want = normalized_spec(spec_of_state(jax.typeof(mu).sharding.spec, mode), ndim)
                assert want == ((None,) * (ndim - 3) + (None, "x", None)), want
                assert normalized_spec(jax.typeof(state.moments).sharding.spec, ndim) == want, (mode, jax.typeof(state.moments))
                assert normalized_spec(state.moments.sharding.spec, ndim) == want, (mode, state.moments.sharding)
                assert jax.tree_util.tree_map(jax.typeof, jax.jit(tx.init)(params)) == \
                    jax.tree_util.tree_map(jax.typeof, state), mode

    @case("init_from_abstract_inputs")
    def _():
        for mode in MODES:
            tx = packed_adamw(1.0, mode=mode)
            plain = tx.init(jax.ShapeDtypeStruct((2, 4, 8), jnp.float32))  # optax's test_init_with_abstract_input
            assert plain.moments.shape == StateFormat(mode).state_shape((2, 4, 8))
            sds = jax.ShapeDtypeStruct((16, 12), jnp.float32, sharding=NamedSharding(auto, P("x", None)))
            state = tx.init(sds)
            assert normalized_spec(state.moments.sharding.spec, state.moments.ndim) == \
                normalized_spec(spec_of_state(P("x", None), mode), state.moments.ndim), state.moments.sharding
            with jax.set_mesh(explicit):
                typed = jax.ShapeDtypeStruct((16, 12), jnp.float32, sharding=NamedSharding(explicit, P("x", None)))
                shape = jax.eval_shape(tx.init, typed)
                assert normalized_spec(shape.moments.sharding.spec, shape.moments.ndim) == \
                    normalized_spec(spec_of_state(P("x", None), mode), shape.moments.ndim), shape

    @case("init_and_update_types_agree_eager_and_jit")
    def _():
        # optax's test_state_sharding_type_init_match_update / _preserved_with_jit.
        with jax.set_mesh(explicit):
            params = jnp.zeros((2, 8, 4), jnp.float32, out_sharding=NamedSharding(explicit, P(None, "x")))
            for mode in MODES:
                for factory in (packed_adamw, lambda lr, mode: optax.inject_hyperparams(packed_adamw)(lr, mode=mode)):
                    tx = factory(1.0, mode=mode)
                    state0 = tx.init(params)
                    _, state1 = tx.update(params, state0, params)
                    _, state2 = jax.jit(tx.update)(params, state0, params)
                    types = [jax.tree_util.tree_map(jax.typeof, s) for s in (state0, state1, state2)]
                    assert types[0] == types[1] == types[2], (mode, types)

    @case("sharded_bits_equal_unsharded_transform_and_fused")
    def _():
        for mode in MODES:
            for mesh, jit in ((explicit, True), (explicit, False), (auto, False)):
                with jax.set_mesh(mesh):
                    tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
                    fused = packed_adamw_fused_step(1e-2, weight_decay=0.1, mask=mask, mode=mode)

                    t_step = jax.jit(optax_train_step(tx)) if jit else optax_train_step(tx)
                    f_step = jax.jit(fused, donate_argnums=(0, 2)) if jit else fused
                    pt, pf = put(params0, mesh), put(params0, mesh)
                    st, sf = tx.init(pt), tx.init(pf)
                    for i, g in enumerate(grads0):
                        pt, st = t_step(pt, st, put(g, mesh))
                        pf, sf = f_step(pf, put(g, mesh), sf)
                        want_p, want_s = refs[mode][i]
                        where = f"{mode} {mesh.axis_types} jit={jit} step {i + 1}"
                        assert same_bits(pt, want_p) and same_bits(st, want_s), "transform " + where
                        assert same_bits(pf, want_p) and same_bits(sf, want_s), "fused " + where
                    for k, leaf in st.moments.items():
                        want = normalized_spec(spec_of_state(specs[k], mode), leaf.ndim)
                        assert normalized_spec(leaf.sharding.spec, leaf.ndim) == want, (where, k, leaf.sharding)
                        assert normalized_spec(pf[k].sharding.spec, pf[k].ndim) == normalized_spec(specs[k], pf[k].ndim)

    @case("compiled_sharded_update_has_no_collectives")
    def _():
        for mode in MODES:
            with jax.set_mesh(explicit):
                tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
                fused = packed_adamw_fused_step(1e-2, weight_decay=0.1, mask=mask, mode=mode)
                params, grads = put(params0, explicit), put(grads0[0], explicit)
                state = tx.init(params)
                for what, fn, args in (("update", jax.jit(tx.update), (grads, state, params)),
                                       ("train step", jax.jit(optax_train_step(tx), donate_argnums=(0, 1)),
                                        (params, state, grads)),
                                       ("fused", jax.jit(fused, donate_argnums=(0, 2)), (params, grads, state))):
                    text = fn.lower(*args).compile().as_text()
                    assert collectives(text) == [], (mode, what, collectives(text))
                    # Each device's program takes its shard: leaf "a" (16, 12) over 8 devices is (2, 12).
                    assert "f32[2,12]" in entry_shapes(text) and "f32[16,12]" not in entry_shapes(text), entry_shapes(text)
                    assert step_callbacks(text) == 1, (mode, what)  # one callback per device

    @case("two_dimensional_mesh_and_grads_laid_out_otherwise")
    def _():
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        specs2 = {"a": P("data", "model"), "b": P("model"), "c": P(), "d": P(None, ("data", "model")), "r": P()}
        for mode in MODES:
            with jax.set_mesh(mesh):
                fused = jax.jit(packed_adamw_fused_step(1e-2, weight_decay=0.1, mask=mask, mode=mode),
                                donate_argnums=(0, 2))
                params = put(params0, mesh, lambda k: specs2[k])
                state = packed_adamw(1e-2, mode=mode).init(params)
                text = fused.lower(params, put(grads0[0], mesh, lambda k: P()), state).compile().as_text()
                assert collectives(text) == [], collectives(text)
                for i, g in enumerate(grads0):
                    params, state = fused(params, put(g, mesh, lambda k: P()), state)  # replicated gradients
                    assert same_bits(params, refs[mode][i][0]) and same_bits(state, refs[mode][i][1]), (mode, i)
                leaf = state.moments["a"]
                assert normalized_spec(leaf.sharding.spec, leaf.ndim) == \
                    normalized_spec(spec_of_state(P("data", "model"), mode), leaf.ndim), leaf.sharding
                # Eagerly too: replicated or uncommitted gradients are moved to the parameters' layout.
                eager = packed_adamw_fused_step(1e-2, weight_decay=0.1, mask=mask, mode=mode)
                params = put(params0, mesh, lambda k: specs2[k])
                state = packed_adamw(1e-2, mode=mode).init(params)
                for i, g in enumerate(grads0):
                    laid_out = put(g, mesh, lambda k: P()) if i % 2 == 0 else {k: jnp.asarray(v) for k, v in g.items()}
                    params, state = eager(params, laid_out, state)
                    assert same_bits(params, refs[mode][i][0]) and same_bits(state, refs[mode][i][1]), (mode, i, "eager")

    @case("auto_axes_under_jit_on_cpu_give_the_same_bits")
    def _():
        # Documented: a host callback cannot be partitioned, so on a CPU mesh with Auto axes the
        # jitted step is gathered (correct, not distributed). The bits must still be right.
        for mode in MODES:
            tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
            step = jax.jit(optax_train_step(tx))
            params = put(params0, auto)
            state = tx.init(params)
            for i, g in enumerate(grads0):
                params, state = step(params, state, put(g, auto))
                assert same_bits(params, refs[mode][i][0]) and same_bits(state, refs[mode][i][1]), (mode, i)

    @case("xla_step_is_partitioned_by_xla_with_the_unsharded_bits")
    def _():
        # The XLA step (impl="auto" on GPUs) on sharded leaves: no shard_map, XLA partitions it.
        # Staged here for the CPU (which the transform refuses for it, as XLA's CPU runtime
        # flushes subnormals; these inputs make none), through the same jitted
        # `lax.platform_dependent` as on a GPU, with Explicit and Auto axes.
        import functools

        from packed_adamw.jax import transform

        saved = transform._step_platforms, transform._on_cuda_xla_step
        transform._step_platforms = lambda tree: {"gpu"}
        transform._on_cuda_xla_step = functools.partial(saved[1], xla_platform="cpu")
        try:
            for mode in MODES:
                for mesh in (explicit, auto):
                    with jax.set_mesh(mesh):
                        tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode, impl="xla")
                        step = jax.jit(optax_train_step(tx))
                        params = put(params0, mesh)
                        state = tx.init(params)
                        text = step.lower(params, state, put(grads0[0], mesh)).compile().as_text()
                        assert collectives(text) == [], (mode, mesh.axis_types, collectives(text))
                        assert "f32[2,12]" in entry_shapes(text) and "f32[16,12]" not in entry_shapes(text)
                        assert step_callbacks(text) == 0
                        for i, g in enumerate(grads0):
                            params, state = step(params, state, put(g, mesh))
                            assert same_bits(params, refs[mode][i][0]) and same_bits(state, refs[mode][i][1]), \
                                (mode, mesh.axis_types, i)
        finally:
            transform._step_platforms, transform._on_cuda_xla_step = saved

    @case("custom_partitioning_steps_each_shard_on_its_device")
    def _():
        # The GPU path for Auto axes, with a stand-in body (a host callback cannot run inside a
        # partition): each device must see only its shards, and nothing is gathered.
        from packed_adamw.jax._sharding import partitioned_step
        from packed_adamw.jax._rules import ADAMW
        from packed_adamw.jax._step import StepConfig, StepOperands

        seen = []

        def body(*args, config):
            n = config.n_leaves
            ps, gs, ss, h, c = args[:n], args[n:2 * n], args[2 * n:3 * n], args[3 * n], args[3 * n + 1]
            seen.append(([p.shape for p in ps], [s.shape for s in ss], h.shape, c.shape))
            return [p * 2 + g + h[0, 0] for p, g in zip(ps, gs)] + [s + c.astype(s.dtype) for s in ss]

        for mode in ("packed", "fp32"):
            fmt = StateFormat(mode)
            config = StepConfig(fmt=fmt, steps=ADAMW, write_update=True, multi_tensor=True,
                                leaf_rows=(0,) * len(shapes), paths=tuple(shapes))
            p = [jax.device_put(params0[k], NamedSharding(auto, specs[k])) for k in shapes]
            g = [jax.device_put(grads0[0][k], NamedSharding(auto, specs[k])) for k in shapes]
            s = [jax.device_put(np.zeros(fmt.state_shape(shapes[k]), fmt.state_dtype),
                                NamedSharding(auto, spec_of_state(specs[k], mode))) for k in shapes]
            h, c = jnp.full((2, 5), 0.5, jnp.float32), jnp.asarray(3, jnp.int32)
            fn = jax.jit(lambda p, g, s, h, c: partitioned_step(StepOperands(p, g, s, [None] * len(p), h, c),
                                                                 config=config, body=body))
            text = fn.lower(p, g, s, h, c).compile().as_text()
            assert collectives(text) == [], collectives(text)
            local_p, local_s, h_shape, c_shape = seen[-1]
            assert local_p == [(2, 12), (1,), (), (3, 2), (5,)], local_p
            assert local_s == [fmt.state_shape(x) for x in local_p], local_s
            assert (h_shape, c_shape) == ((2, 5), ())
            results = fn(p, g, s, h, c)
            outs, states = results.outs, results.states
            for k, o, st, pp, gg in zip(shapes, outs, states, p, g):
                assert np.array_equal(np.asarray(o), np.asarray(pp) * 2 + np.asarray(gg) + np.float32(0.5)), k
                assert np.all(np.asarray(st) == 3), k
                assert normalized_spec(o.sharding.spec, o.ndim) == normalized_spec(specs[k], o.ndim), (k, o.sharding)

    @case("import_state_places_the_state_like_the_params")
    def _():
        from packed_adamw.jax import export_state

        for mode in MODES:
            tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
            _, state = refs[mode][-1]
            params = put(params0, auto)
            imported = import_state(export_state(state, mode), params, mode)
            assert same_bits(imported, state), mode
            for k, leaf in imported.moments.items():
                assert leaf.sharding.mesh == auto, (k, leaf.sharding)
                assert normalized_spec(leaf.sharding.spec, leaf.ndim) == \
                    normalized_spec(spec_of_state(specs[k], mode), leaf.ndim), (k, leaf.sharding)
            updates, _ = jax.jit(tx.update)(put(grads0[0], auto), imported, params)  # and steps from there
            assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)

    @case("packed_muon_sharded_bits_equal_unsharded")
    def _():
        # Muon leaves sharded on either dimension (one bfloat16, with its low half) and an AdamW
        # leaf: the whole matrices are gathered for the phases, the results resharded.
        from packed_adamw.jax.muon import packed_muon

        m_shapes = {"w": (16, 24), "v": (24, 8), "s": (8, 8), "b": (8,)}
        m_specs = {"w": P("x", None), "v": P(None, "x"), "s": P("x", None), "b": P("x")}
        m_params = {k: (rng.standard_normal(v) * 0.2).astype(np.float32) for k, v in m_shapes.items()}
        m_grads = [{k: (rng.standard_normal(v) * 0.01).astype(np.float32) for k, v in m_shapes.items()}
                   for _ in range(2)]
        as_leaf = lambda k, x: jnp.asarray(x).astype(jnp.bfloat16 if k == "s" else jnp.float32)  # noqa: E731

        def run(mode, mesh, jit):
            tx = packed_muon(0.02, mode=mode)
            place = (lambda t: {k: as_leaf(k, v) for k, v in t.items()}) if mesh is None else \
                (lambda t: {k: jax.device_put(as_leaf(k, v), NamedSharding(mesh, m_specs[k])) for k, v in t.items()})
            params = place(m_params)
            state = tx.init(params)
            step = jax.jit(optax_train_step(tx)) if jit else optax_train_step(tx)
            for g in m_grads:
                params, state = step(params, state, place(g))
            return params, state

        for mode in ("packed", "fp32"):
            want_p, want_s = run(mode, None, False)
            for mesh, jit in ((explicit, True), (explicit, False), (auto, True), (auto, False)):
                with jax.set_mesh(mesh):
                    got_p, got_s = run(mode, mesh, jit)
                where = f"{mode} {mesh.axis_types} jit={jit}"
                assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() and a.dtype == b.dtype for a, b in
                           zip(jax.tree_util.tree_leaves((got_p, got_s)), jax.tree_util.tree_leaves((want_p, want_s)))), where
                assert len(jax.tree_util.tree_leaves(got_s)) == len(jax.tree_util.tree_leaves(want_s)), where
                for k in ("w", "v", "s"):  # the weights keep their layout
                    assert normalized_spec(got_p[k].sharding.spec, 2) == normalized_spec(m_specs[k], 2), (where, k)
                    if mesh is explicit or not jit:  # the state too, where the layout is decided by the step
                        assert normalized_spec(got_s.momentum[k].sharding.spec, 2) == normalized_spec(m_specs[k], 2), (where, k)

    @case("refusal_warning_of_an_accelerator_host_on_a_mesh")
    def _():
        # An accelerator host's refusal warning (a pure callback the step reads, no effect), forced
        # on these CPU devices: a refused step of sharded leaves warns once and changes nothing.
        import warnings

        from packed_adamw.jax import RefusedStepWarning, _hyperparams

        kept = _hyperparams._effect_free_refusals
        _hyperparams._effect_free_refusals = lambda: True
        try:
            tx = packed_adamw(lambda count: jnp.where(count >= 1, -1.0, 1e-2), weight_decay=0.1)
            with jax.set_mesh(explicit):
                params = put(params0, explicit)
                step = jax.jit(optax_train_step(tx))
                params, state = step(params, tx.init(params), put(grads0[0], explicit))
                assert not jax.make_jaxpr(optax_train_step(tx))(params, state, put(grads0[1], explicit)).effects
                with warnings.catch_warnings(record=True) as heard:
                    warnings.simplefilter("always")
                    after, after_state = step(params, state, put(grads0[1], explicit))
                    jax.block_until_ready(after)
        finally:
            _hyperparams._effect_free_refusals = kept
        assert [type(w.message) for w in heard] == [RefusedStepWarning], [str(w.message) for w in heard]
        assert int(after_state.count) == 1 and same_bits((after, after_state), (params, state))
        for k in params:
            assert normalized_spec(after[k].sharding.spec, after[k].ndim) == \
                normalized_spec(specs[k], after[k].ndim), (k, after[k].sharding)

    return results


# ---------------------------------------------------------------------------------------------
# The tests (this process: one device)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def child_results():
    return run_cases_child(__file__, DEVICES)


def _check(child_results, name):
    assert name in child_results, f"case {name} did not run: {sorted(child_results)}"
    assert child_results[name] == "ok", child_results[name]


def test_init_state_follows_params_like_optax_adamw(child_results):
    _check(child_results, "init_state_follows_params_like_optax_adamw")


def test_init_from_abstract_inputs(child_results):
    _check(child_results, "init_from_abstract_inputs")


def test_init_and_update_types_agree_eager_and_jit(child_results):
    _check(child_results, "init_and_update_types_agree_eager_and_jit")


def test_sharded_bits_equal_unsharded_transform_and_fused(child_results):
    _check(child_results, "sharded_bits_equal_unsharded_transform_and_fused")


def test_compiled_sharded_update_has_no_collectives(child_results):
    _check(child_results, "compiled_sharded_update_has_no_collectives")


def test_two_dimensional_mesh_and_grads_laid_out_otherwise(child_results):
    _check(child_results, "two_dimensional_mesh_and_grads_laid_out_otherwise")


def test_auto_axes_under_jit_on_cpu_give_the_same_bits(child_results):
    _check(child_results, "auto_axes_under_jit_on_cpu_give_the_same_bits")


def test_xla_step_is_partitioned_by_xla_with_the_unsharded_bits(child_results):
    _check(child_results, "xla_step_is_partitioned_by_xla_with_the_unsharded_bits")


def test_custom_partitioning_steps_each_shard_on_its_device(child_results):
    _check(child_results, "custom_partitioning_steps_each_shard_on_its_device")


def test_import_state_places_the_state_like_the_params(child_results):
    _check(child_results, "import_state_places_the_state_like_the_params")


def test_packed_muon_sharded_bits_equal_unsharded(child_results):
    _check(child_results, "packed_muon_sharded_bits_equal_unsharded")


def test_refusal_warning_of_an_accelerator_host_on_a_mesh(child_results):
    _check(child_results, "refusal_warning_of_an_accelerator_host_on_a_mesh")


if __name__ == "__main__" and "--cases" in sys.argv:
    _cases()
