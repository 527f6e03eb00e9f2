"""The XLA-native step (`jax_frontend/_xla_step.py`) against the numpy step, bit for bit.

On CPU, XLA runs compiled code with FTZ/DAZ (subnormals flushed), which nothing turns off, so the
step is compared with the numpy step run in the same floating-point environment (inside a CPU
callback, which XLA runs under FTZ/DAZ too); the contract's own bits (IEEE numpy) are then
checked where no subnormal arises, and the inputs are checked to make the two differ somewhere.
The `cuda` tests compare against the IEEE numpy step everywhere and probe whether XLA's GPU
backend contracts multiply-adds: run them on a GPU machine with
`.venv/bin/python -m pytest tests/jax_frontend/test_jax_xla_step.py -m cuda -rs -s -q`.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from packed_adamw.core import StateFormat  # noqa: E402
from packed_adamw.core.adamw import numpy_step  # noqa: E402
from packed_adamw.core.adamw.state_format import first_moment_format, rms_format  # noqa: E402
from packed_adamw.core.codecs import FLOAT32_MAX, FLOAT32_TINY, FP16, SPLIT_MASTER_MAX  # noqa: E402
from packed_adamw.jax import _xla_step  # noqa: E402
from packed_adamw.jax._rules import ADAMW  # noqa: E402
from packed_adamw.jax._step import StepConfig, StepOperands, _flushes_subnormals  # noqa: E402
from jax_helpers import step_callbacks  # noqa: E402

F32, U32, U16 = np.float32, np.uint32, np.uint16
CPU = jax.devices("cpu")[0]
MODES = ("packed", "fp16", "fp32")
FORMATS = [first_moment_format(15), rms_format(15), first_moment_format(0), rms_format(100), FP16]
SUBNORMAL_MAX = float(np.uint32(0x007FFFFF).view(F32))
SPECIALS = np.array([0.0, -0.0, 2.0**-149, -(2.0**-149), SUBNORMAL_MAX, FLOAT32_TINY, -1.0, 1.0, 2.0, 65504.0,
                     SPLIT_MASTER_MAX, FLOAT32_MAX, -FLOAT32_MAX, np.inf, -np.inf, np.nan], F32)
# (hyperparameter row with weight decay, count): the transform's second row is the same without decay.
HPARAM_CASES = [((1e-3, 0.9, 0.999, 1e-8, 0.01), 7),  # count 7: where 1/sqrt(x) != rsqrt(x)
                ((3.0, 0.0, 0.5, FLOAT32_TINY, 1e-3), 1),
                ((1e-40, 0.99, 0.9999, 1e-30, 1e30), 2**31 - 1),  # a subnormal lr, the largest count
                ((1e36, 0.9, 0.999, 1e-8, 0.0), 3),  # masters pushed past SPLIT_MASTER_MAX
                ((np.nan,) * 5, 1)]  # a refused step: every element keeps its state


def gpu_device():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view({4: U32, 2: U16}[a.dtype.itemsize])


@functools.lru_cache(maxsize=None)
def _jitted(fn):
    return jax.jit(fn)


def on(device, fn, *args):
    """fn jitted (once per fn), on `device`, its results as numpy."""
    results = _jitted(fn)(*jax.device_put(args, device))
    return jax.tree_util.tree_map(np.asarray, results)


def compiled_code_flushes(device) -> bool:
    """Whether XLA's compiled float32 arithmetic on `device` flushes subnormals (FTZ/DAZ)."""
    return bool(on(device, lambda x, y: x * y, np.array([1e-40], F32), np.ones(1, F32))[0] == 0)


def in_xla_cpu_thread(fn, *arrays):
    """numpy fn(*arrays) run inside a CPU callback: in XLA's floating-point environment."""
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), fn(*arrays))
    return on(CPU, _in_callback(fn, jax.tree_util.tree_structure(shapes), tuple(jax.tree_util.tree_leaves(shapes))),
              *arrays)


@functools.lru_cache(maxsize=None)
def _in_callback(fn, treedef, leaf_shapes):
    def callback(*xs):
        if not _flushes_subnormals():
            raise AssertionError("XLA's CPU callbacks no longer flush subnormals; revisit this test's model")
        return fn(*jax.tree_util.tree_map(np.array, xs))

    return lambda *xs: jax.pure_callback(callback, treedef.unflatten(leaf_shapes), *xs)


# ---------------------------------------------------------------------------------------------
# The problem: four leaves over wide exponent ranges and every special value
# ---------------------------------------------------------------------------------------------
def wide(rng, n, lo=-45.0, hi=38.5, signed=True):
    x = 10.0 ** rng.uniform(lo, hi, n)
    if signed:
        x *= rng.choice([-1.0, 1.0], n)
    return np.asarray(x, np.float64).astype(F32)


def problem(rng, mode: str, n: int = 4096):
    """(params, grads, states, lows, decay) of four leaves: float32 with and without decay, and
    two split masters (bf16 weights) with float32 and bf16 gradients."""
    pairs = np.array(list(itertools.product(SPECIALS, SPECIALS)), F32)  # every (p, g) pair of specials
    params, grads, states, lows = [], [], [], []
    for leaf in range(4):
        p, g = wide(rng, n), wide(rng, n)
        p[:len(pairs)], g[:len(pairs)] = pairs[:, 0], pairs[:, 1]
        p[len(pairs):2 * len(pairs)] = wide(rng, len(pairs), -4, 1)  # ordinary parameters beside special gradients
        g[len(pairs):2 * len(pairs)] = np.resize(SPECIALS, len(pairs))
        if mode == "fp32":
            state = np.stack([wide(rng, n, -45, 38), wide(rng, n, -45, 38, signed=False)])
            state[:, :len(SPECIALS)] = SPECIALS  # includes v < 0, NaN and Inf: a foreign state
        else:
            state = rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32)  # every code, saturating ones included
            state[:4] = [0x7FFF7FFF, 0xFFFFFFFF, 0x7FFF0000, 0x80000001]
        if leaf >= 2:  # a split master: the weight's bits and a low half, stale pairs included
            w = rng.integers(0, 2**16, n, dtype=np.uint64).astype(U16)
            w[:len(SPECIALS)] = (SPECIALS.view(U32) >> 16).astype(U16)
            lo = rng.integers(-2**15, 2**15, n).astype(np.int16)
            lo[len(SPECIALS):2 * len(SPECIALS)] = -5  # beside zero weights below: stale pairs
            w[len(SPECIALS):2 * len(SPECIALS)] = 0x8000
            edge = slice(2 * len(SPECIALS), 2 * len(SPECIALS) + 256)  # the largest weights, either sign
            w[edge] = rng.choice(np.array([0x7F7F, 0xFF7F, 0x7F7E, 0xFF7E], U16), 256)
            g[edge] = rng.choice(np.array([-1.0, 1.0], F32), 256)
            params.append(jnp.asarray(w).view(jnp.bfloat16))
            lows.append(lo)
            if leaf == 3:
                g = jnp.asarray(g).astype(jnp.bfloat16)
        else:
            params.append(p)
            lows.append(None)
        grads.append(g)
        states.append(state)
    return params, grads, states, lows, (True, False, True, False)


def config_for(mode, write_update, decay) -> StepConfig:
    """Each leaf's row: AdamW's decayed variant (0) or the undecayed one (1)."""
    return StepConfig(fmt=StateFormat(mode), steps=ADAMW, write_update=write_update, multi_tensor=True,
                      leaf_rows=tuple(0 if d else 1 for d in decay), paths=tuple(f"[{i}]" for i in range(len(decay))),
                      split=(2, 3))


def xla_results(device, config, params, grads, states, lows, hparams, count, barriers=True):
    """(outs, states, lows) of `xla_step`; for the transform also the optax.apply_updates of
    each float32 leaf in the same jit (fused with the step)."""
    return on(device, _xla_run(config, barriers), params, grads, states, lows, hparams, np.int32(count))


@functools.lru_cache(maxsize=None)
def _xla_run(config, barriers):
    def run(params, grads, states, lows, hparams, count):
        results = _xla_step.xla_step(StepOperands(params, grads, states, lows, hparams, count), config=config,
                                     contraction_barriers=barriers)
        applied = [p + u if lo is None and config.write_update else None
                   for p, u, lo in zip(params, results.outs, lows)]
        return results.outs, results.states, results.lows, applied

    return run


def numpy_results(config, params, grads, states, lows, hparams, count):
    """The numpy step of every leaf: (outs, states, lows, applied), as `xla_results`."""
    fmt, outs, new_states, new_lows, applied = config.fmt, [], [], [], []
    for p, g, s, lo, leaf_row in zip(params, grads, states, lows, config.leaf_rows):
        scalars = numpy_step.step_scalar_row(int(count), hparams[leaf_row])
        s = s.copy()
        if lo is None:
            p = p.copy()
            update = np.empty_like(p) if config.write_update else None
            numpy_step.apply_step(p, g, s, scalars, fmt=fmt, update_out=update)
            outs.append(update if config.write_update else p)
            new_lows.append(None)
            applied.append(p + update if config.write_update else None)
        else:
            w, lo = p.copy().view(U16), lo.copy()
            numpy_step.apply_split_step(w, lo, g.view(U16) if g.dtype.itemsize == 2 else g, s, scalars, fmt=fmt)
            outs.append(w)
            new_lows.append(lo)
            applied.append(None)
        new_states.append(s)
    return outs, new_states, new_lows, applied


@functools.lru_cache(maxsize=None)
def _numpy_results_of(config):
    return functools.partial(numpy_results, config)


def assert_same_bits(got, want, what, where=None):
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None and b is None:
            continue
        a, b = bits(a).reshape(-1), bits(b).reshape(-1)
        differ = a != b if where is None else (a != b) & where[i]
        bad = np.flatnonzero(differ)
        assert bad.size == 0, (f"{what}, leaf {i}: {bad.size} of {a.size} elements differ; first at {bad[0]}: "
                               f"{a[bad[0]]:#x} vs {b[bad[0]]:#x}")


def agreeing(ieee, flushed):
    """Per leaf, the elements where the IEEE and FTZ/DAZ numpy steps agree on every output."""
    masks = []
    for leaf in zip(*ieee, *flushed):
        n = len(leaf) // 2
        agree = None
        for a, b in zip(leaf[:n], leaf[n:]):
            if a is None:
                continue
            same = (bits(a) == bits(b)).reshape(-1, a.shape[-1]).all(axis=0)  # fp32 state: both rows
            agree = same if agree is None else agree & same
        masks.append(agree)
    return masks


def as_numpy_inputs(params, grads):
    return [np.asarray(p) for p in params], [np.asarray(g) for g in grads]


# ---------------------------------------------------------------------------------------------
# Codes and scalars: exact on CPU (no float subnormal arises in them)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.identity)
def test_decode_every_code_and_encode(fmt):
    codes = np.arange(1 << 16, dtype=U32)
    np.testing.assert_array_equal(bits(on(CPU, lambda c: _xla_step.decode(c, fmt), codes)), bits(fmt.decode_table))
    values = fmt.decode_table[np.isfinite(fmt.decode_table)]
    ordered = np.unique(np.abs(values.astype(np.float64)))
    midpoints = ((ordered[1:] + ordered[:-1]) / 2).astype(F32)  # exact in float32: ties to even
    rng = np.random.default_rng(1)
    x = np.concatenate([values, midpoints, -midpoints, wide(rng, 1 << 15), SPECIALS[np.isfinite(SPECIALS)],
                        np.array([fmt.max_value * 1.5, fmt.min_subnormal / 2, fmt.min_subnormal * 0.75], F32)])
    if not fmt.signed:
        x = np.abs(x)
    np.testing.assert_array_equal(on(CPU, lambda v: _xla_step.encode(v, fmt), x), fmt.encode_unchecked(x))


def test_step_scalars():
    rng = np.random.default_rng(2)
    rows = np.array([case[0] for case in HPARAM_CASES[:2]]
                    + [[10.0 ** rng.uniform(-6, 0), rng.uniform(0, 1), rng.uniform(0.5, 1),
                        10.0 ** rng.uniform(-12, -4), rng.uniform(0, 0.1)] for _ in range(6)], F32)
    derive = jax.jit(lambda rows, count: _xla_step.step_scalars(rows, count, _xla_step.contraction_guard(count)))
    for count in [*range(1, 40), 1000, 12345, 2**20 + 7, 2**31 - 1, *rng.integers(1, 2**31 - 1, 8)]:
        got = np.asarray(derive(rows, np.int32(count)))
        want = np.array([numpy_step.step_scalar_row(int(count), row) for row in rows], F32)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"count {count}")


# ---------------------------------------------------------------------------------------------
# The whole step
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("write_update", [True, False], ids=["transform", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_step_matches_numpy_on_cpu(mode, write_update):
    rng = np.random.default_rng(3)
    params, grads, states, lows, decay = problem(rng, mode)
    config = config_for(mode, write_update, decay)
    np_params, np_grads = as_numpy_inputs(params, grads)
    flushes = compiled_code_flushes(CPU)
    subnormal_differences = 0
    for row, count in HPARAM_CASES:
        hparams = np.array([row, (*row[:4], 0.0)], F32)
        got = xla_results(CPU, config, params, grads, states, lows, hparams, count)
        ieee = numpy_results(config, np_params, np_grads, states, lows, hparams, count)
        if flushes:  # the numpy step in XLA's environment: the same bits everywhere
            flushed = in_xla_cpu_thread(_numpy_results_of(config),
                                        np_params, np_grads, states, lows, hparams, np.int32(count))
            assert_same_bits(got[0] + got[1] + got[2] + got[3], flushed[0] + flushed[1] + flushed[2] + flushed[3],
                             f"{mode} vs numpy under FTZ/DAZ, row {row}")
            masks = agreeing(ieee, flushed)
            subnormal_differences += sum(int((~m).sum()) for m in masks)
        else:
            masks = None
        # The contract itself wherever the flushing does not matter.
        for got_part, want_part, what in zip(got, ieee, ("outs", "states", "lows", "applied")):
            per_element = None if masks is None else [
                np.repeat(m[None], np.asarray(x).size // m.size, 0).reshape(-1) if x is not None else None
                for m, x in zip(masks, want_part)]
            assert_same_bits(got_part, want_part, f"{mode} {what} vs numpy, row {row}", per_element)
    if flushes:
        assert subnormal_differences > 0, "the inputs never made FTZ/DAZ matter: they test no subnormal"


def contraction_probe(device, barriers: bool):
    """(b1 * m + (1 - b1) * g as the step's first moment gives it, fused result, unfused
    result) on inputs where the two differ: b1 = m = 1 + 2**-12, (1 - b1) g = -(1 + 2**-11)."""
    a, c = F32(1 + 2**-12), F32(-(1 + 2**-11))
    fused, unfused = F32(np.float64(a) * np.float64(a) + np.float64(c)), F32(a * a + c)
    assert fused != unfused
    n = 256

    def first_moment(m, g, s, count):
        guard = _xla_step.contraction_guard(count) if barriers else None
        return _xla_step._rounded(s[0] * m, guard) + _xla_step._rounded(s[1] * g, guard)

    got = on(device, first_moment, np.full(n, a), np.full(n, c), np.array([a, 1.0], F32), np.int32(3))
    return got, fused, unfused


def test_contraction_on_cpu():
    """XLA's CPU backend contracts an unguarded multiply-add (the finding the guards answer);
    the guarded one rounds the product."""
    got, fused, unfused = contraction_probe(CPU, barriers=False)
    assert set(np.unique(got)) <= {fused, unfused}, got
    print(f"\nCPU, unguarded b1*m + c*g: {'contracted (FMA)' if got[0] == fused else 'not contracted'}")
    got, fused, unfused = contraction_probe(CPU, barriers=True)
    np.testing.assert_array_equal(bits(got), bits(np.full_like(got, unfused)))


def test_refuses_track_format():
    config = StepConfig(fmt=StateFormat("packed"), steps=ADAMW, write_update=True, multi_tensor=True, leaf_rows=(0,),
                        paths=("x",), track_format=True)
    x = np.ones(4, F32)
    with pytest.raises(ValueError, match="does not count formats"):
        _xla_step.xla_step(StepOperands([x], [x], [np.zeros(4, U32)], [None], np.ones((2, 5), F32), np.int32(1)),
                           config=config)


# ---------------------------------------------------------------------------------------------
# On a GPU: the contract's bits everywhere, and what XLA's GPU backend contracts
# ---------------------------------------------------------------------------------------------
GPU = gpu_device()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a JAX GPU backend")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.identity)
def test_gpu_codes(fmt):
    codes = np.arange(1 << 16, dtype=U32)
    np.testing.assert_array_equal(bits(on(GPU, lambda c: _xla_step.decode(c, fmt), codes)), bits(fmt.decode_table))
    x = np.concatenate([fmt.decode_table, wide(np.random.default_rng(1), 1 << 16)])
    x = x if fmt.signed else np.abs(x)
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(on(GPU, lambda v: _xla_step.encode(v, fmt), x), fmt.encode_unchecked(x))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("write_update", [True, False], ids=["transform", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_step_matches_numpy(mode, write_update):
    assert not compiled_code_flushes(GPU), "XLA flushes float32 subnormals on this GPU (is --xla_gpu_ftz set?)"
    rng = np.random.default_rng(3)
    params, grads, states, lows, decay = problem(rng, mode)
    config = config_for(mode, write_update, decay)
    np_params, np_grads = as_numpy_inputs(params, grads)
    for row, count in HPARAM_CASES:
        hparams = np.array([row, (*row[:4], 0.0)], F32)
        got = xla_results(GPU, config, params, grads, states, lows, hparams, count)
        want = numpy_results(config, np_params, np_grads, states, lows, hparams, count)
        for got_part, want_part, what in zip(got, want, ("outs", "states", "lows", "applied")):
            if what == "applied":  # optax.apply_updates' own addition: a NaN parameter stays NaN, but the
                # GPU's adder returns its canonical NaN (0x7fffffff, measured on an H100) where numpy
                # keeps the operand's payload (0x7fc00000): compared as NaN, not by payload
                got_part, want_part = ([None if x is None else np.where(np.isnan(x), F32(np.nan), x) for x in part]
                                       for part in (got_part, want_part))
            assert_same_bits(got_part, want_part, f"GPU {mode} {what}, row {row}")


@pytest.mark.cuda
@needs_gpu
def test_gpu_contraction():
    """Reports whether XLA's GPU backend contracts the unguarded multiply-add, and whether the
    unguarded step loses the contract's bits; the guarded step must not."""
    got, fused, unfused = contraction_probe(GPU, barriers=False)
    assert set(np.unique(got)) <= {fused, unfused}, got
    params, grads, states, lows, decay = problem(np.random.default_rng(4), "packed")
    config = config_for("packed", True, decay)
    hparams = np.array([HPARAM_CASES[0][0], (*HPARAM_CASES[0][0][:4], 0.0)], F32)
    unguarded = xla_results(GPU, config, params, grads, states, lows, hparams, 7, barriers=False)
    want = numpy_results(config, *as_numpy_inputs(params, grads), states, lows, hparams, 7)
    differing = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(unguarded[0], want[0]))
    print(f"\nGPU ({GPU.device_kind}), unguarded b1*m + c*g: "
          f"{'contracted (FMA)' if got[0] == fused else 'not contracted'}; unguarded step: {differing} updates "
          "differ from the contract")
    got, fused, unfused = contraction_probe(GPU, barriers=True)
    np.testing.assert_array_equal(bits(got), bits(np.full_like(got, unfused)))


# ---------------------------------------------------------------------------------------------
# In the transform: impl="xla" against impl="kernel"
# ---------------------------------------------------------------------------------------------
def transform_runs(impls, device):
    """Per impl, the per-step results (new params, updates, state, then the fused step's params
    and state) of three jitted steps of the transform and the fused step on `device`: a tree of
    float32 and bf16 leaves with a weight-decay mask, its values clear of subnormals (where a
    CPU's FTZ/DAZ would rightly make the XLA step differ)."""
    import optax

    from packed_adamw.jax import packed_adamw, packed_adamw_fused_step

    rng = np.random.default_rng(5)
    params = {"a": wide(rng, 64 * 33, -4, 1).reshape(64, 33), "b": jnp.asarray(wide(rng, 17, -4, 1), jnp.bfloat16),
              "c": wide(rng, 5, -4, 1)}
    params = jax.device_put(params, device)
    grads = [jax.device_put(jax.tree_util.tree_map(
        lambda p: jnp.asarray(wide(rng, p.size, -8, 2).reshape(p.shape), p.dtype), params), device) for _ in range(3)]
    mask = {"a": True, "b": True, "c": False}
    runs = {}
    for mode in MODES:
        for impl in impls:
            tx = packed_adamw(3e-3, weight_decay=0.1, mask=mask, mode=mode, impl=impl)
            fused = jax.jit(packed_adamw_fused_step(3e-3, weight_decay=0.1, mask=mask, mode=mode, impl=impl))
            transform_step = jax.jit(lambda p, s, g, tx=tx: (lambda u, s: (optax.apply_updates(p, u), u, s))(
                *tx.update(g, s, p)))
            p, s, fp, fs = params, tx.init(params), params, tx.init(params)
            outs = []
            for g in grads:
                p, u, s = transform_step(p, s, g)
                fp, fs = fused(fp, g, fs)
                outs.append(jax.tree_util.tree_map(np.asarray, (p, u, s, fp, fs)))
            runs[mode, impl] = outs
    return runs


def assert_same_runs(runs, impl, reference):
    for mode in MODES:
        for step, (want, got) in enumerate(zip(runs[mode, reference], runs[mode, impl])):
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{mode}, impl={impl}, step {step + 1}, "
                                                                        f"{jax.tree_util.keystr(path)}")


def test_transform_impl_xla_matches_kernel(monkeypatch):
    """impl="xla" in the transform and the fused step gives impl="kernel"'s bits (the numpy
    callback here). XLA's CPU runtime flushes subnormals, so the transform refuses impl="xla"
    on a CPU and stages it for CUDA only; this test stages it for the CPU (checking that the
    compiled step holds no callback), on inputs where flushing does not matter."""
    from packed_adamw.jax import packed_adamw
    from packed_adamw.jax import transform

    ran = []
    monkeypatch.setattr(transform, "_step_platforms", lambda tree: {"gpu"})
    # the staged choice, with the XLA step staged for the CPU instead of CUDA
    monkeypatch.setattr(transform, "_on_cuda_xla_step",
                        functools.partial(transform._on_cuda_xla_step, xla_platform="cpu"))
    monkeypatch.setattr(transform, "xla_step", lambda *a, **k: ran.append(1) or _xla_step.xla_step(*a, **k))
    transform._staged_step.cache_clear()  # traced afresh, with the spy
    tx = packed_adamw(1e-3, impl="xla")
    params = {"w": jax.device_put(np.linspace(-1, 1, 64, dtype=F32), CPU)}
    text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    assert step_callbacks(text) == 0 and ran, "impl='xla' did not compile the XLA step"
    runs = transform_runs(("kernel", "xla"), CPU)
    assert_same_runs(runs, "xla", "kernel")


def test_a_gpu_hosts_staged_choice(monkeypatch):
    """On a host with a GPU, impl="auto" stages the choice (`lax.platform_dependent`): lowered
    for CUDA the step is the XLA step (no callback, no Triton call, the float64 division);
    lowered for the CPU (arrays placed there) it is the numpy callback. Eager calls go through
    the same jitted choice (`_staged_step`, one for the config) with the kernel path's bits.
    (Which device an eager call's choice follows differs only on a GPU host: the CUDA suite's
    eager tests run it there.)"""
    import optax

    from packed_adamw.jax import packed_adamw, transform

    monkeypatch.setattr(transform, "_step_platforms", lambda tree: {"gpu", "cpu"})
    tx = packed_adamw(1e-3, weight_decay=0.1, impl="auto")
    params = {"w": jax.device_put(np.linspace(-1, 1, 64, dtype=F32), CPU),
              "b": jax.device_put(np.linspace(-1, 1, 6, dtype=F32).astype(jnp.bfloat16), CPU)}
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    traced = step.trace(params, tx.init(params), params)
    for platform, xla_step_there in (("cuda", True), ("cpu", False)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("xla_ffi_python_cpu_callback" in text) != xla_step_there, platform
        assert "triton" not in text.lower() and ("f64" in text) == xla_step_there, platform
    kernel = packed_adamw(1e-3, weight_decay=0.1, impl="kernel")
    state, kernel_state = tx.init(params), kernel.init(params)
    transform._staged_step.cache_clear()
    for _ in range(2):  # eagerly
        updates, state = tx.update(params, state, params)
        kernel_updates, kernel_state = kernel.update(params, kernel_state, params)
        for a, b in zip(jax.tree_util.tree_leaves((updates, state)), jax.tree_util.tree_leaves((kernel_updates,
                                                                                                 kernel_state))):
            np.testing.assert_array_equal(bits(a), bits(b))
    assert transform._staged_step.cache_info().currsize == 1  # the eager calls went through the staged choice


def test_transform_impl_choices_and_refusals():
    from packed_adamw.jax import packed_adamw, packed_adamw_fused_step
    from packed_adamw.jax import transform

    with pytest.raises(ValueError, match="impl='fast': pass 'auto'"):
        packed_adamw(1e-3, impl="fast")
    with pytest.raises(ValueError, match="impl='xla' does not count formats"):
        packed_adamw_fused_step(1e-3, impl="xla", track_format=True)
    params = {"w": jax.device_put(np.ones(8, F32), CPU)}
    state = packed_adamw(1e-3).init(params)
    with pytest.raises(ValueError, match="impl='xla' runs on CUDA GPUs only"):
        packed_adamw(1e-3, impl="xla").update(params, state, params)
    with pytest.raises(ValueError, match="impl='xla' runs on CUDA GPUs only"):
        packed_adamw_fused_step(1e-3, impl="xla")(params, params, state)
    group = transform._adamw_group(1e-3, 0.9, 0.999, 1e-8, 0.0)
    auto = transform._Stepper(group, None, "packed", None, None, True)
    counting = transform._Stepper(group, None, "packed", None, None, True, track_format=True)
    kernel = transform._Stepper(group, None, "packed", None, None, True, impl="kernel")
    assert auto.step_function(params, counting=False) is transform.sharded_step  # on a CPU-only host
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transform, "_step_platforms", lambda tree: {"gpu"})
        assert auto.step_function(params, counting=False) is transform._on_cuda_xla_step
        assert counting.step_function(params, counting=True) is transform.sharded_step
        assert kernel.step_function(params, counting=False) is transform.sharded_step


@pytest.mark.cuda
@needs_gpu
def test_gpu_transform_impls_match():
    """On a GPU: impl="auto" (the XLA step there) gives impl="kernel"'s bits (the Triton
    kernel) in the transform, its applied updates and the fused step."""
    runs = transform_runs(("kernel", "auto"), GPU)  # impl="xla" runs auto's code on a GPU
    assert_same_runs(runs, "auto", "kernel")
