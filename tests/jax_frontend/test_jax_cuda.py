"""The optax frontend on CUDA (jax-triton launch) against torch PackedAdamW on CUDA (Triton
launched from torch), the fused in-place step and the numpy CPU step, bit for bit.

Runs only where a CUDA GPU is visible to both torch and JAX and jax_triton imports; data moves
between the frameworks through numpy.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

# Captured before any jax_triton import in this process (jax-triton 0.3.1 blanks it on import).
TRITON_CACHE_DIR_AT_START = os.environ.get("TRITON_CACHE_DIR")

import torch  # noqa: E402

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from jax_helpers import (  # noqa: E402,F401
    F32, MODES, assert_bits_equal, bits, jax_cuda_unavailable, make_problem, run_jax, run_numpy, run_torch,
)

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")]


_why_not_runnable = jax_cuda_unavailable


_REASON = _why_not_runnable()
if _REASON is not None:
    pytest.skip(f"needs CUDA for torch and JAX plus jax_triton: {_REASON}", allow_module_level=True)

from packed_adamw.jax import packed_adamw, packed_adamw_fused_step  # noqa: E402
from packed_adamw.torch import PackedAdamW  # noqa: E402

# One leaf over 1M elements (not a multiple of any block size) plus small odd-sized leaves.
SHAPES = {"big": (1031, 1024 + 3), "odd1": (7,), "odd2": (3, 5), "one": (1,), "cube": (13, 17, 3)}
STEPS = 10
LR, WD = 3e-3, 0.1
TABLE = np.linspace(1e-2, 1e-3, STEPS + 2).astype(F32)


def table_schedule(count):
    return jnp.asarray(TABLE)[count]


LR_KINDS = {"const": (LR, LR), "schedule": (table_schedule, TABLE)}  # (JAX, torch/numpy)


def problem(seed):
    params0, grads = make_problem(seed, SHAPES, STEPS)
    rng = np.random.default_rng(seed + 1)
    for g in grads:  # huge gradients on a strided subset so fp16 (max 65504) saturates too
        g["big"][::7] = (g["big"][::7] * F32(10.0) ** rng.uniform(3, 6, size=g["big"][::7].shape)).astype(F32)
    return params0, grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lr_kind", ["const", "schedule"])
@pytest.mark.parametrize("impl", ["kernel", "auto"])  # auto: the XLA step on a GPU
def test_torch_cuda_jax_gpu_fused_and_numpy_give_the_same_bits(mode, lr_kind, impl):
    assert sum(int(np.prod(s)) for s in SHAPES.values()) >= 1_000_000
    params0, grads = problem(seed=21)
    jax_lr, host_lr = LR_KINDS[lr_kind]

    t_params, t_states, _, _ = run_torch(params0, grads, mode=mode, lr=host_lr, weight_decay=WD, device="cuda")
    tx = packed_adamw(jax_lr, weight_decay=WD, mode=mode, impl=impl)
    j_params, j_state = run_jax(params0, grads, tx)
    assert all(leaf.devices().pop().platform == "gpu" for leaf in jax.tree_util.tree_leaves(j_params))

    fused = jax.jit(packed_adamw_fused_step(jax_lr, weight_decay=WD, mode=mode, impl=impl), donate_argnums=(0, 2))
    f_params = {k: jnp.asarray(v) for k, v in params0.items()}
    f_state = tx.init(f_params)
    for g in grads:
        f_params, f_state = fused(f_params, {k: jnp.asarray(v) for k, v in g.items()}, f_state)

    n_params, n_states = run_numpy(params0, grads, mode=mode, lr=host_lr, weight_decay=WD)
    for k in SHAPES:
        assert_bits_equal(j_params[k], t_params[k], f"JAX vs torch params[{k!r}]")
        assert_bits_equal(j_state.moments[k], t_states[k], f"JAX vs torch state[{k!r}]")
        assert_bits_equal(f_params[k], j_params[k], f"fused vs transform params[{k!r}]")
        assert_bits_equal(f_state.moments[k], j_state.moments[k], f"fused vs transform state[{k!r}]")
        assert_bits_equal(j_params[k], n_params[k], f"JAX GPU vs numpy params[{k!r}]")
        assert_bits_equal(j_state.moments[k], n_states[k], f"JAX GPU vs numpy state[{k!r}]")
    assert not np.array_equal(bits(j_params["big"]), bits(params0["big"]))


@pytest.mark.parametrize("mode", MODES)
def test_jitted_gpu_update_does_not_recompile_when_the_lr_changes(mode):
    params0, grads = problem(seed=22)
    tx = packed_adamw(table_schedule, weight_decay=WD, mode=mode)
    traces = []

    def step(params, state, g):
        traces.append(1)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step)
    params = {k: jnp.asarray(v) for k, v in params0.items()}
    state = tx.init(params)
    for g in grads:
        params, state = jitted(params, state, {k: jnp.asarray(v) for k, v in g.items()})
    assert len(set(TABLE[:STEPS].tolist())) == STEPS, "the lr must change every step"
    assert len(traces) == 1 and jitted._cache_size() == 1


def test_torch_triton_launch_still_works_after_the_jax_triton_path():
    params0, grads = problem(seed=23)
    small = {k: v for k, v in params0.items() if k != "big"}
    small_grads = [{k: g[k] for k in small} for g in grads[:3]]
    run_jax(small, small_grads, packed_adamw(LR, weight_decay=WD, impl="kernel"))  # jax_triton imported and launched
    assert os.environ.get("TRITON_CACHE_DIR") == TRITON_CACHE_DIR_AT_START, "jax_triton import leaked into env"
    # New biases: new constexprs, so torch's Triton must compile (and cache) a fresh kernel now.
    keys = sorted(small)
    tensors = [torch.nn.Parameter(torch.from_numpy(small[k].copy()).cuda()) for k in keys]
    opt = PackedAdamW(tensors, lr=LR, weight_decay=WD, m_bias=17, rms_bias=19)
    for g in small_grads:
        for k, t in zip(keys, tensors):
            t.grad = torch.from_numpy(g[k].copy()).cuda()
        opt.step()
    torch.cuda.synchronize()
    from packed_adamw.core import Hyperparams, StateFormat, adamw_step

    for k, t in zip(keys, tensors):
        p = small[k].copy().reshape(-1)
        s = np.zeros(p.size, np.uint32)
        for i, g in enumerate(small_grads, start=1):
            adamw_step(p, g[k].reshape(-1).copy(), s, count=i, hp=Hyperparams(lr=LR, weight_decay=WD),
                       fmt=StateFormat("packed", 17, 19))
        assert_bits_equal(t, p.reshape(small[k].shape), f"torch CUDA params[{k!r}] after the JAX path")
        assert_bits_equal(opt.state[t]["words"], s.reshape(small[k].shape), f"torch CUDA words[{k!r}]")


@pytest.mark.parametrize("mode", MODES)
def test_leaves_launched_in_groups_give_the_bits_of_a_launch_per_leaf(mode):
    """40 leaves of mixed sizes (one empty, one launched alone, the rest in groups of
    at most LEAVES_PER_LAUNCH, some without weight decay), transform and fused step."""
    from packed_adamw.core import launch
    from packed_adamw.jax._leaf_group import LEAVES_PER_LAUNCH

    rng = np.random.default_rng(24)
    sizes = [int(n) for n in rng.integers(1, 5000, size=37)] + [0, 70_001, launch.SOLO_ELEMENTS]
    shapes = {f"w{i:02d}": (n,) for i, n in enumerate(sizes)}
    params0, grads = make_problem(25, shapes, 3)
    mask = {k: i % 3 != 0 for i, k in enumerate(shapes)}
    results = {}
    for multi in (True, False):
        tx = packed_adamw(table_schedule, weight_decay=WD, mode=mode, mask=mask, multi_tensor=multi, impl="kernel")
        fused = packed_adamw_fused_step(table_schedule, weight_decay=WD, mode=mode, mask=mask, multi_tensor=multi,
                                        impl="kernel")
        jitted = jax.jit(fused, donate_argnums=(0, 2))
        params = {k: jnp.asarray(v) for k, v in params0.items()}
        state = tx.init(params)
        hlo = jitted.lower(params, {k: jnp.asarray(v) for k, v in grads[0].items()}, state).as_text()
        for g in grads:
            params, state = jitted(params, {k: jnp.asarray(v) for k, v in g.items()}, state)
        t_params, t_state = run_jax(params0, grads, tx)
        results[multi] = (params, state, t_params, t_state, hlo.count("triton_kernel_call"))
    grouped = -(-38 // LEAVES_PER_LAUNCH)  # 38 leaves are neither empty nor solo
    assert results[True][4] == 1 + 1 + grouped, "scalars + the solo leaf + the groups"
    assert results[False][4] == 1 + 39, "scalars + one launch per non-empty leaf"
    for k in shapes:
        for i, what in enumerate(["fused params", "fused state", "transform params", "transform state"]):
            a, b = results[True][i], results[False][i]
            a, b = (a[k], b[k]) if i % 2 == 0 else (a.moments[k], b.moments[k])
            assert_bits_equal(a, b, f"{what}[{k!r}]: groups vs per leaf")
        assert_bits_equal(results[True][0][k], results[True][2][k], f"fused vs transform params[{k!r}]")
    no_decay = [k for k in shapes if not mask[k]]
    t_params, t_states, _, _ = run_torch(params0, grads, mode=mode, lr=TABLE, weight_decay=WD, no_decay=no_decay,
                                         device="cuda")
    for k in shapes:
        assert_bits_equal(results[True][0][k], t_params[k], f"groups vs torch params[{k!r}]")
        assert_bits_equal(results[True][1].moments[k], t_states[k], f"groups vs torch state[{k!r}]")


# ---------------------------------------------------------------------------------------------
# Sharding on the one GPU, the arrays' platform, and the update written into the gradient
# ---------------------------------------------------------------------------------------------
def _train_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_sharded_update_and_fused_step_on_a_one_device_mesh_give_the_unsharded_bits(mode, axis_type, impl):
    """Sharded arrays take the shard_map path with the kernel (on a mesh of one device, Auto
    axes too: their one shard is known), which launches the kernels on the shards; the XLA step
    is partitioned by XLA. Either must give the bits of the unsharded kernel step."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    params0, grads = problem(seed=26)
    mask = {k: k != "odd1" for k in SHAPES}
    want_p, want_s = run_jax(params0, grads, packed_adamw(table_schedule, weight_decay=WD, mode=mode, mask=mask,
                                                          impl="kernel"))
    tx = packed_adamw(table_schedule, weight_decay=WD, mode=mode, mask=mask, impl=impl)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    spec = {k: PartitionSpec("x") if len(s) else PartitionSpec() for k, s in SHAPES.items()}
    put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in tree.items()}  # noqa: E731
    with jax.set_mesh(mesh):
        step = jax.jit(_train_step(tx), donate_argnums=(0, 1))
        fused = jax.jit(packed_adamw_fused_step(table_schedule, weight_decay=WD, mode=mode, mask=mask, impl=impl),
                        donate_argnums=(0, 2))
        params, state = put(params0), tx.init(put(params0))
        f_params, f_state = put(params0), tx.init(put(params0))
        text = step.lower(params, state, put(grads[0])).compile().as_text()
        assert ("triton" in text.lower()) == (impl == "kernel") and "all-gather" not in text
        for g in grads:
            params, state = step(params, state, put(g))
            f_params, f_state = fused(f_params, put(g), f_state)
    for k in SHAPES:
        assert_bits_equal(params[k], want_p[k], f"sharded transform params[{k!r}]")
        assert_bits_equal(state.moments[k], want_s.moments[k], f"sharded transform state[{k!r}]")
        assert_bits_equal(f_params[k], want_p[k], f"sharded fused params[{k!r}]")
        assert_bits_equal(f_state.moments[k], want_s.moments[k], f"sharded fused state[{k!r}]")


@pytest.mark.parametrize("mode", MODES)
def test_the_custom_partitioning_step_gives_the_bits_of_the_plain_step(mode):
    """The Auto-axes path of several GPUs (`custom_partitioning`), built and run here on one GPU,
    where XLA lowers it inline: same bits as the plain step. (Its partition callback needs two
    or more GPUs; tests/jax_frontend/test_jax_sharding.py checks it on CPU devices with a stand-in body.)"""
    from packed_adamw.core import StateFormat
    from packed_adamw.jax._sharding import partitioned_step
    from packed_adamw.jax._rules import ADAMW
    from packed_adamw.jax._step import StepConfig, StepOperands, local_step

    params0, grads = problem(seed=30)
    keys = sorted(SHAPES)
    fmt = StateFormat(mode)
    config = StepConfig(fmt=fmt, steps=ADAMW, write_update=True, multi_tensor=True,
                        leaf_rows=tuple(0 if k != "odd1" else 1 for k in keys), paths=tuple(keys), alias_grads=True)
    p = [jnp.asarray(params0[k]) for k in keys]
    g = [jnp.asarray(grads[0][k]) for k in keys]
    s = [jnp.zeros(fmt.state_shape(SHAPES[k]), fmt.state_dtype) for k in keys]
    h = jnp.asarray([[LR, 0.9, 0.999, 1e-8, WD], [LR, 0.9, 0.999, 1e-8, 0.0]], jnp.float32)
    c = jnp.asarray(1, jnp.int32)
    operands = lambda p, g, s, h, c: StepOperands(p, g, s, [None] * len(p), h, c)  # noqa: E731
    want = jax.jit(lambda *a: local_step(operands(*a), config=config))(p, g, s, h, c)
    got = jax.jit(lambda *a: partitioned_step(operands(*a), config=config))(p, g, s, h, c)
    for i, k in enumerate(keys):
        assert_bits_equal(got.outs[i], want.outs[i], f"update[{k!r}]")
        assert_bits_equal(got.states[i], want.states[i], f"state[{k!r}]")
    assert np.any(bits(want.states[keys.index("big")])), "the state was never written"


@pytest.mark.parametrize("mode", MODES)
def test_arrays_on_the_cpu_of_a_gpu_host_take_the_cpu_path(mode):
    """The path follows the platform the step is compiled for, not jax.default_backend()."""
    params0, grads = problem(seed=27)
    small = {k: v for k, v in params0.items() if k != "big"}
    small_grads = [{k: g[k] for k in small} for g in grads[:3]]
    tx = packed_adamw(LR, weight_decay=WD, mode=mode)
    cpu = jax.devices("cpu")[0]
    params = {k: jax.device_put(v, cpu) for k, v in small.items()}
    state = jax.device_put(tx.init(params), cpu)
    step = jax.jit(_train_step(tx))
    grads0 = {k: jax.device_put(v, cpu) for k, v in small_grads[0].items()}
    text = step.lower(params, state, grads0).compile().as_text()
    assert "xla_ffi_python_cpu_callback" in text and "triton" not in text.lower()
    for g in small_grads:
        params, state = step(params, state, {k: jax.device_put(v, cpu) for k, v in g.items()})
    assert all(leaf.devices() == {cpu} for leaf in jax.tree_util.tree_leaves((params, state)))
    gpu_p, gpu_s = run_jax(small, small_grads, tx)  # the same run on the GPU
    n_params, n_states = run_numpy(small, small_grads, mode=mode, lr=LR, weight_decay=WD)
    for k in small:
        assert_bits_equal(params[k], gpu_p[k], f"CPU-placed vs GPU params[{k!r}]")
        assert_bits_equal(state.moments[k], gpu_s.moments[k], f"CPU-placed vs GPU state[{k!r}]")
        assert_bits_equal(params[k], n_params[k], f"CPU-placed vs numpy params[{k!r}]")
        assert_bits_equal(state.moments[k], n_states[k], f"CPU-placed vs numpy state[{k!r}]")


@pytest.mark.parametrize("multi_tensor", [True, False], ids=["groups", "per-leaf"])
def test_the_transform_writes_its_update_into_the_gradient_buffer(multi_tensor):
    """In a jitted train step whose gradients are computed in the step, reuse_grad_buffer=True
    (the default) writes u into the gradient's buffer: XLA's temporaries shrink by one leaf
    against reuse_grad_buffer=False, with the same bits. Gradients passed in and kept by the
    caller are copied, never overwritten."""
    rows, cols, k = 4096, 4096, 64  # the gradient is a matrix product: XLA materializes it
    n = rows * cols
    rng = np.random.default_rng(29)
    params0 = {"w": (rng.standard_normal((rows, cols)) * 0.05).astype(F32), "b": rng.standard_normal(1000).astype(F32)}
    x = jnp.asarray(rng.standard_normal((k, rows)).astype(F32))
    y = jnp.asarray(rng.standard_normal((k, cols)).astype(F32))

    def loss(params, x, y):
        return jnp.sum((x @ params["w"]) * y) * 1e-4 + jnp.sum(params["b"] ** 2)

    results = {}
    for reuse in (True, False):
        tx = packed_adamw(LR, weight_decay=WD, multi_tensor=multi_tensor, reuse_grad_buffer=reuse, impl="kernel")

        def train_step(params, state, x, y, tx=tx):
            updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state

        params = {key: jnp.asarray(v) for key, v in params0.items()}
        state = tx.init(params)
        compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, x, y).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        for _ in range(3):
            params, state = compiled(params, state, x, y)
        results[reuse] = (temp, params, state)
    saved = results[False][0] - results[True][0]
    assert saved >= 4 * n, f"temporaries {results[True][0]} (reuse) vs {results[False][0]} bytes: saved {saved} < {4 * n}"
    for key in params0:
        assert_bits_equal(results[True][1][key], results[False][1][key], f"params[{key!r}], reuse vs not")
        assert_bits_equal(results[True][2].moments[key], results[False][2].moments[key], f"state[{key!r}], reuse vs not")
    # Gradients the caller keeps are copied before the kernel writes into them.
    tx = packed_adamw(LR, weight_decay=WD, multi_tensor=multi_tensor, impl="kernel")
    kept = jax.grad(loss)({key: jnp.asarray(v) for key, v in params0.items()}, x, y)
    before = {key: bits(v).copy() for key, v in kept.items()}
    params = {key: jnp.asarray(v) for key, v in params0.items()}
    jax.block_until_ready(jax.jit(tx.update)(kept, tx.init(params), params))
    for key in params0:
        assert_bits_equal(kept[key], before[key], f"kept gradient {key!r} after an update")
