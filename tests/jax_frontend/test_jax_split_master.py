"""bf16 leaves with exact FP32 masters in the optax frontend (docs/FORMAT.md, "Split masters";
docs/JAX.md, "bf16 leaves").

A bfloat16 leaf is the live weight w of a master M = join(w, lo); the state carries the int16
low half lo. Fed the same gradient values, the masters of a bf16 run equal an FP32 run's
parameters bit for bit (and its words and format counts), w is always split(M).w, the
transform's `optax.apply_updates(p, u)` equals the fused step's w, and torch `PackedAdamW` over
bf16 parameters gives the same bits; `PortableState` carries lo both ways. Like
tests/jax_frontend/test_jax_transform.py (optax's alias_test style) every stateful test runs over the modes
and over a `variant` (eager or `jax.jit`), with table-lookup schedules.

The exceptions of the transform's updates (no float32 u gives the new weight) are tested
against their documented description, including a search around each for a u that would.
The CUDA launch code (`_triton_launch.step`) runs here in the Triton interpreter through a
bf16-aware stand-in for jax-triton; the `cuda`-marked tests compile it on a GPU.

Bits are compared as integers (bf16 and int16 as uint16, float32 and uint32 as uint32).
"""
from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch

from jax_helpers import (SHARDED_SHAPES, InterpretedJaxTriton, case_recorder, jax_cuda_unavailable, normalized_spec,
                         optax_train_step, run_cases_child, sharded_specs, step_callbacks)
from packed_adamw.core import StateFormat, codecs as formats, launch
from packed_adamw.core.adamw import RULE as ADAMW_RULE
from packed_adamw.core.adamw.numpy_step import apply_split_step, apply_step, step_scalar_row
from packed_adamw.core.portable import PortableState
from packed_adamw.jax import (
    PackedAdamWState,
    export_state,
    format_stats,
    import_state,
    load_master_weights,
    master_weights,
    packed_adamw,
    packed_adamw_fused_step,
)
from packed_adamw.jax import _masters

F32, U32, U16 = np.float32, np.uint32, np.uint16
BF16 = jnp.bfloat16
MODES = ["packed", "fp16", "fp32"]
GRAD_KINDS = ["bf16_grads", "fp32_grads"]
# Sorted key order is JAX's leaf order. "w", "e" and "s" (a 0-d leaf) are bf16, "b" float32.
SHAPES = {"b": (17,), "e": (5, 3, 2), "s": (), "w": (33, 17)}
SPLIT_KEYS = ("e", "s", "w")
LR, WD, STEPS = 3e-3, 0.1, 6
TABLE = np.linspace(1e-2, 1e-3, STEPS + 2).astype(F32)  # index = count before the step

pytestmark = [pytest.mark.filterwarnings("ignore:Some donated buffers were not usable"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def table_schedule(count):
    return jnp.asarray(TABLE)[count]


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    """optax-style variant: the function itself, or the function under jax.jit."""
    return (lambda f, **kw: jax.jit(f, **kw)) if request.param == "jit" else (lambda f, **kw: f)


# ------------------------------------------------------------------------------ helpers ----
def bits16(x) -> np.ndarray:
    """The 16-bit patterns of a bf16 / int16 array (jax, numpy or torch) as uint16."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.int16).numpy().view(U16).copy()
    a = np.asarray(x)
    assert a.dtype in (np.dtype(ml_dtypes.bfloat16), np.int16, np.uint16), a.dtype
    return a.view(U16)


def bits32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return (t.view(torch.int32) if t.dtype == torch.uint32 else t).numpy().view(U32).copy()
    a = np.asarray(x)
    assert a.dtype in (np.float32, np.uint32, np.int32), a.dtype
    return a.view(U32)


def assert_same(a, b, what: str) -> None:
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} differ; first [{bad[0]}]: {a[bad[0]]:#x} vs {b[bad[0]]:#x}"


def leaf_bits(x) -> np.ndarray:
    itemsize = x.element_size() if isinstance(x, torch.Tensor) else np.asarray(x).dtype.itemsize
    return bits16(x) if itemsize == 2 else bits32(x)


def assert_trees_same(a, b, what: str) -> None:
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), f"{what}: {len(la)} leaves vs {len(lb)}"
    for (path, x), y in zip(la, lb):
        assert_same(leaf_bits(x), leaf_bits(y), f"{what} {jax.tree_util.keystr(path)}")


def spanning(rng, shape, lo_exp, hi_exp, zero_share=0.05) -> np.ndarray:
    x = np.asarray(10.0 ** rng.uniform(lo_exp, hi_exp, size=shape) * rng.choice([-1.0, 1.0], size=shape), F32)
    x[rng.random(shape) < zero_share] = 0.0
    return x


def problem(seed=0, steps=STEPS, grad_kind="bf16_grads", shapes=SHAPES, split_keys=SPLIT_KEYS):
    """(FP32 masters, [gradients per step for the bf16 run], [the same values in float32]).
    Gradients span 1e-12 .. 1e2 (and 1e5 .. 1e8 on a stride of "w", so fp16 saturates); a
    bf16 leaf's gradients are bf16 with `grad_kind="bf16_grads"`."""
    rng = np.random.default_rng(seed)
    masters = {k: spanning(rng, s, -4.0, 1.0) for k, s in shapes.items()}
    grads, grads32 = [], []
    for _ in range(steps):
        g = {k: spanning(rng, s, -12.0, 2.0) for k, s in shapes.items()}
        if "w" in g:
            g["w"][::5] = (g["w"][::5] * F32(10.0) ** rng.uniform(3, 6, size=g["w"][::5].shape)).astype(F32)
        if grad_kind == "bf16_grads":
            g = {k: v.astype(ml_dtypes.bfloat16) if k in split_keys else v for k, v in g.items()}
        grads.append(g)
        grads32.append({k: np.asarray(v, F32) for k, v in g.items()})
    return masters, grads, grads32


def to_jax(tree):
    return {k: jnp.asarray(v) for k, v in tree.items()}


def bf16_template(masters, split_keys=SPLIT_KEYS):
    return {k: jnp.asarray(v).astype(BF16) if k in split_keys else jnp.asarray(v) for k, v in masters.items()}


def start_split(tx, masters, split_keys=SPLIT_KEYS):
    """bf16 params and state holding the FP32 masters exactly (load_master_weights)."""
    params = bf16_template(masters, split_keys)
    return load_master_weights(to_jax(masters), params, tx.init(params))


def step_fn(tx):
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return step


def assert_split_invariant(params, state, what: str) -> None:
    """Every bf16 weight is split(M).w and its low half split(M).lo, M = join(w, lo)."""
    masters = master_weights(params, state)
    for k in SPLIT_KEYS:
        m = np.asarray(masters[k])
        w, lo = formats.split_master(m)
        assert_same(bits16(params[k]), w, f"{what}: w != split(M).w for {k!r}")
        assert_same(bits16(state.low_halves[k]), lo.view(U16), f"{what}: lo != split(M).lo for {k!r}")


# --------------------------------------------------------------------------- the codec ----
EDGE_PATTERNS = np.array([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00008001,
                          0x3F7F8000, 0x3F808000, 0x3F800000, 0x3F807FFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,
                          0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFF8000, 0xFFFFFFFF, 0x807FFFFF], U32)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_jnp_codec_equals_the_numpy_codec_on_every_kind_of_pattern(jitted):
    rng = np.random.default_rng(1)
    patterns = np.concatenate([EDGE_PATTERNS, rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(U32)])
    masters = patterns.view(F32)
    split = jax.jit(_masters.split) if jitted else _masters.split
    join = jax.jit(_masters.join) if jitted else _masters.join
    w, lo = split(jnp.asarray(masters))
    want_w, want_lo = formats.split_master(masters)
    assert w.dtype == BF16 and lo.dtype == jnp.int16
    assert_same(bits16(w), want_w, "split: weights")
    assert_same(bits16(lo), want_lo.view(U16), "split: low halves")
    # join inverts split on every pair, NaN patterns included
    assert_same(bits32(join(w, lo)), patterns, "join(split(M))")
    pairs_w, pairs_lo = rng.integers(0, 2**16, 4096).astype(U16), rng.integers(0, 2**16, 4096).astype(U16)
    got = join(jnp.asarray(pairs_w.view(ml_dtypes.bfloat16)), jnp.asarray(pairs_lo.view(np.int16)))
    assert_same(bits32(got), bits32(formats.join_master(pairs_w, pairs_lo.view(np.int16))), "join of any pair")
    outside = np.asarray(_masters.outside_domain(jnp.asarray(masters)))
    assert outside.tolist() == (~(np.abs(masters) <= F32(formats.SPLIT_MASTER_MAX))).tolist()


# ------------------------------------------------------------------------------ init ------
def test_init_gives_low_halves_of_zero_for_bf16_leaves_and_keeps_fp32_only_states_as_they_were():
    masters, _, _ = problem(steps=1)
    params = bf16_template(masters)
    state = packed_adamw(LR).init(params)
    assert type(state) is PackedAdamWState and state.low_halves is not None and state.format_counts is None
    assert state.low_halves["b"] is None
    for k in SPLIT_KEYS:
        lo = state.low_halves[k]
        assert lo.dtype == jnp.int16 and lo.shape == params[k].shape and not np.any(bits16(lo))
    # the master starts at the bf16 value
    for k, m in master_weights(params, state).items():
        assert_same(bits32(m), bits32(np.asarray(params[k]).astype(F32)), f"initial master {k!r}")
    fp32_state = packed_adamw(LR).init(to_jax(masters))
    assert type(fp32_state) is PackedAdamWState and fp32_state.low_halves is None and fp32_state.format_counts is None
    assert len(jax.tree_util.tree_leaves(fp32_state)) == 1 + len(masters)  # the count and the words, no more
    tracked = packed_adamw(LR, track_format=True).init(params)
    assert type(tracked) is PackedAdamWState and tracked.low_halves is not None and tracked.format_counts is not None
    from packed_adamw.jax import PackedAdamWSplitState, PackedAdamWTrackedState  # the 1.0 names: one type now
    assert PackedAdamWSplitState is PackedAdamWState and PackedAdamWTrackedState is PackedAdamWState


@pytest.mark.parametrize("track_format", [False, True], ids=["plain", "tracked"])
def test_tree_map_params_maps_the_moments_of_trees_with_and_without_bf16_leaves(track_format):
    """optax.tree_utils.tree_map_params calls init on a placeholder with no dtypes; the one
    state type lets it map the moments of a tree with bf16 leaves (it raised on the old
    per-feature types), with and without extra trees, and keeps the low halves (not a copy of
    the parameters' tree: transform_non_params applies to them). Float32 trees as before."""
    masters, _, _ = problem(steps=1)
    for params in (bf16_template(masters), to_jax(masters)):
        for tx in (packed_adamw(LR, track_format=track_format),
                   optax.chain(optax.clip_by_global_norm(1.0), packed_adamw(LR, track_format=track_format))):
            state = tx.init(params)
            ones = optax.tree_utils.tree_map_params(tx, lambda v: jnp.ones_like(v), state)
            ours = ones if isinstance(ones, PackedAdamWState) else ones[1]
            assert all(np.all(np.asarray(m) == 1) for m in jax.tree_util.tree_leaves(ours.moments))
            assert jax.tree_util.tree_structure(ones) == jax.tree_util.tree_structure(state)
            start = state if isinstance(state, PackedAdamWState) else state[1]
            assert jax.tree_util.tree_structure(ours.low_halves) == jax.tree_util.tree_structure(start.low_halves)
            shapes = optax.tree_utils.tree_map_params(tx, lambda v, p: (v.shape, p.shape), state, params,
                                                      transform_non_params=lambda _: None)
            ours = shapes if isinstance(shapes, PackedAdamWState) else shapes[1]
            assert ours.moments == {k: (p.shape, p.shape) for k, p in params.items()}
            assert ours.count is None and ours.low_halves is None


# ------------------------------------------------------- masters follow the FP32 run ------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_kind", GRAD_KINDS)
def test_masters_follow_the_fp32_run_and_the_transform_equals_the_fused_step(mode, grad_kind, variant):
    """Every step, in a mixed tree with a schedule and a weight-decay mask: the transform's
    masters and the fused step's equal the FP32 run's parameters, the words are equal,
    w == split(M), and apply_updates(p, u) is the fused step's w."""
    masters, grads, grads32 = problem(seed=3, grad_kind=grad_kind)
    mask = {"b": True, "e": False, "s": True, "w": True}
    kwargs = dict(weight_decay=WD, mask=mask, mode=mode)
    tx = packed_adamw(table_schedule, **kwargs)
    step = variant(step_fn(tx))
    fused = variant(packed_adamw_fused_step(table_schedule, **kwargs), donate_argnums=(0, 2))
    p32, s32 = to_jax(masters), tx.init(to_jax(masters))
    pb, sb = start_split(tx, masters)
    pf, sf = start_split(tx, masters)
    for t, (g, g32) in enumerate(zip(grads, grads32), start=1):
        p32, s32 = step(p32, s32, to_jax(g32))
        pb, sb = step(pb, sb, to_jax(g))
        pf, sf = fused(pf, to_jax(g), sf)
        assert int(sb.count) == int(sf.count) == t
        assert_trees_same(master_weights(pb, sb), p32, f"step {t}: transform masters vs the FP32 run")
        assert_trees_same(master_weights(pf, sf), p32, f"step {t}: fused masters vs the FP32 run")
        assert_trees_same(pf, pb, f"step {t}: apply_updates(p, u) vs the fused step's weights")
        assert_trees_same(sb.moments, s32.moments, f"step {t}: words vs the FP32 run")
        assert_trees_same(sf, sb, f"step {t}: fused state vs transform state")
        assert_split_invariant(pb, sb, f"step {t}")
    for k in SPLIT_KEYS:
        assert pb[k].dtype == BF16 and not np.array_equal(bits32(p32[k]), bits32(masters[k])), k


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_updates_of_bf16_leaves_are_float32_and_compile_once(mode):
    masters, grads, _ = problem(seed=4, steps=3)
    tx = packed_adamw(table_schedule, weight_decay=WD, mode=mode)
    traces = []

    def update(g, s, p):
        traces.append(1)
        return tx.update(g, s, p)

    jitted = jax.jit(update)
    params, state = start_split(tx, masters)
    for g in grads:
        updates, state = jitted(to_jax(g), state, params)
        params = optax.apply_updates(params, updates)
        assert {k: str(u.dtype) for k, u in updates.items()} == {"b": "float32", "e": "float32", "s": "float32",
                                                                  "w": "float32"}
        assert all(params[k].dtype == BF16 for k in SPLIT_KEYS)
    assert len(traces) == 1 and jitted._cache_size() == 1


@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_format_counts_of_bf16_leaves_equal_the_fp32_run(mode, variant):
    masters, grads, grads32 = problem(seed=5)
    tx = packed_adamw(LR, weight_decay=WD, mode=mode, track_format=True)
    step = variant(step_fn(tx))
    p32, s32 = to_jax(masters), tx.init(to_jax(masters))
    pb, sb = start_split(tx, masters)
    for g, g32 in zip(grads, grads32):
        p32, s32 = step(p32, s32, to_jax(g32))
        pb, sb = step(pb, sb, to_jax(g))
    assert isinstance(sb, PackedAdamWState) and sb.low_halves is not None and sb.format_counts is not None
    assert format_stats(sb, pb) == format_stats(s32, p32)
    assert any(v["flushed_m"] or v["subnormal_rms"] or v["saturated_m"] for v in format_stats(sb).values())


def test_a_nested_mixed_tree_through_chain_inject_hyperparams_and_multi_steps():
    """optax wrappers keep a split state's structure (lax.cond in MultiSteps, the hyperparams
    of inject_hyperparams) and the bits of the plain transform on the same gradients."""
    rng = np.random.default_rng(6)
    masters = {"layer": {"kernel": spanning(rng, (9, 4), -3, 0), "bias": spanning(rng, (4,), -3, 0)},
               "scale": spanning(rng, (4,), -1, 0)}
    to_bf16 = lambda path, m: jnp.asarray(m).astype(BF16) if "bias" not in jax.tree_util.keystr(path) \
        else jnp.asarray(m)  # noqa: E731
    template = jax.tree_util.tree_map_with_path(to_bf16, masters)
    grads = [jax.tree_util.tree_map(lambda m: jnp.asarray(spanning(rng, m.shape, -6, 0)), masters) for _ in range(4)]
    grads = [jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), g, template) for g in grads]

    plain = packed_adamw(LR, weight_decay=WD)
    wrapped = optax.chain(optax.clip_by_global_norm(1e9),  # far above the norm: changes nothing
                          optax.inject_hyperparams(packed_adamw)(learning_rate=LR, weight_decay=WD))
    multi = optax.MultiSteps(packed_adamw(LR, weight_decay=WD), every_k_schedule=1)
    results = []
    for tx in (plain, wrapped, multi):
        params = template
        state = tx.init(params)
        params, state = load_master_weights(jax.tree_util.tree_map(jnp.asarray, masters), params, state)
        step = jax.jit(step_fn(tx))
        for g in grads:
            params, state = step(params, state, g)
        results.append((params, master_weights(params, state)))
    moved = [not np.array_equal(leaf_bits(a), leaf_bits(b))
             for a, b in zip(jax.tree_util.tree_leaves(results[0][0]), jax.tree_util.tree_leaves(template))]
    assert all(moved), moved
    for params, masters_now in results[1:]:
        assert_trees_same(params, results[0][0], "params under the optax wrappers")
        assert_trees_same(masters_now, results[0][1], "masters under the optax wrappers")


# ----------------------------------------------------------------- torch parity (CPU) -----
def set_torch_grad(t: torch.nn.Parameter, a: np.ndarray) -> None:
    """t.grad = the gradient a (bf16 or float32), also a float32 one of a bf16 parameter
    (torch's setter refuses a dtype other than the parameter's; autograd gives one under
    `t.grad_dtype = torch.float32`)."""
    a = np.asarray(a)
    g = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 \
        else torch.from_numpy(np.array(a, F32))
    g = g.reshape(t.shape)
    if g.dtype == t.dtype:
        t.grad = g
    else:
        t.grad = torch.zeros_like(t)
        t.grad.data = g


def torch_run(masters, grads, *, mode, lr_table, split_keys=SPLIT_KEYS, mask=None, steps=None):
    """torch PackedAdamW over bf16 parameters (the split keys) started from the masters."""
    from packed_adamw.torch import PackedAdamW

    keys = sorted(masters)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(masters[k].copy()).to(torch.bfloat16 if k in split_keys
                                                                            else torch.float32)) for k in keys}
    mask = mask or {k: True for k in keys}
    groups = [{"params": [tensors[k] for k in keys if mask[k]]},
              {"params": [tensors[k] for k in keys if not mask[k]], "weight_decay": 0.0}]
    opt = PackedAdamW([g for g in groups if g["params"]], lr=float(lr_table[0]), weight_decay=WD, mode=mode)
    opt.load_master_weights([torch.from_numpy(masters[k].copy()) for g in opt.param_groups for k in keys
                             if any(p is tensors[k] for p in g["params"])])
    for i, g in enumerate(grads[:steps]):
        for group in opt.param_groups:
            group["lr"] = float(lr_table[i])
        for k in keys:
            set_torch_grad(tensors[k], g[k])
        opt.step()
    return opt, tensors


def torch_words(opt, t):
    state = opt.state[t]
    return state["moments"] if "moments" in state else state["words"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_kind", GRAD_KINDS)
def test_torch_bf16_parameters_and_jax_give_the_same_bits(mode, grad_kind):
    masters, grads, _ = problem(seed=7, grad_kind=grad_kind)
    mask = {"b": True, "e": False, "s": True, "w": True}
    opt, tensors = torch_run(masters, grads, mode=mode, lr_table=TABLE, mask=mask)
    kwargs = dict(weight_decay=WD, mask=mask, mode=mode)
    tx = packed_adamw(table_schedule, **kwargs)
    step, fused = jax.jit(step_fn(tx)), jax.jit(packed_adamw_fused_step(table_schedule, **kwargs))
    pb, sb = start_split(tx, masters)
    pf, sf = start_split(tx, masters)
    for g in grads:
        pb, sb = step(pb, sb, to_jax(g))
        pf, sf = fused(pf, to_jax(g), sf)
    for params, state, what in ((pb, sb, "transform"), (pf, sf, "fused")):
        for k in SHAPES:
            t = tensors[k]
            assert_same(leaf_bits(params[k]), leaf_bits(t), f"{what} vs torch: weights {k!r}")
            assert_same(bits32(state.moments[k]), bits32(torch_words(opt, t)), f"{what} vs torch: words {k!r}")
            if k in SPLIT_KEYS:
                assert_same(bits16(state.low_halves[k]), bits16(opt.state[t]["lo"]), f"{what} vs torch: lo {k!r}")
        torch_masters = opt.master_weights()
        order = [k for g in opt.param_groups for k in sorted(SHAPES) if any(p is tensors[k] for p in g["params"])]
        for k, m in zip(order, torch_masters):
            assert_same(bits32(master_weights(params, state)[k]), bits32(m), f"{what} vs torch: master {k!r}")


@pytest.mark.parametrize("mode", MODES)
def test_portable_state_carries_the_low_halves_from_torch_to_jax_and_back(mode, tmp_path):
    """torch steps 3, JAX continues 3 (both paths), torch continues 3 more from JAX's export:
    the same bits as 9 uninterrupted torch steps (and JAX's own uninterrupted run)."""
    masters, grads, _ = problem(seed=8, steps=9)
    table = np.full(9, LR, F32)
    reference, ref_tensors = torch_run(masters, grads, mode=mode, lr_table=table)
    opt, tensors = torch_run(masters, grads, mode=mode, lr_table=table, steps=3)
    opt.export_state().save(tmp_path / "torch.safetensors")
    params = {k: jnp.asarray(np.asarray(bits16(t)).view(ml_dtypes.bfloat16).reshape(t.shape)) if k in SPLIT_KEYS
              else jnp.asarray(t.detach().numpy().copy()) for k, t in tensors.items()}
    state = import_state(PortableState.load(tmp_path / "torch.safetensors"), params, mode)
    assert isinstance(state, PackedAdamWState) and int(state.count) == 3 and state.low_halves["b"] is None
    tx = packed_adamw(LR, weight_decay=WD, mode=mode)
    step, fused = jax.jit(step_fn(tx)), jax.jit(packed_adamw_fused_step(LR, weight_decay=WD, mode=mode))
    pf, sf = params, state
    for g in grads[3:6]:
        params, state = step(params, state, to_jax(g))
        pf, sf = fused(pf, to_jax(g), sf)
    assert_trees_same(pf, params, "fused vs transform after the import")
    assert_trees_same(sf, state, "fused vs transform state after the import")
    export_state(state, mode).save(tmp_path / "jax.safetensors")
    portable = PortableState.load(tmp_path / "jax.safetensors")
    assert portable.low_halves[0] is None and all(lo is not None for lo in portable.low_halves[1:])
    from packed_adamw.torch import PackedAdamW

    back = {k: torch.nn.Parameter(torch.from_numpy(np.asarray(bits16(params[k])).view(np.int16).copy())
                                  .view(torch.bfloat16).reshape(params[k].shape)) if k in SPLIT_KEYS
            else torch.nn.Parameter(torch.from_numpy(np.array(params[k]))) for k in sorted(params)}
    opt2 = PackedAdamW([back[k] for k in sorted(back)], lr=LR, weight_decay=WD, mode=mode)
    opt2.import_state(portable)
    for g in grads[6:]:
        for k, t in back.items():
            set_torch_grad(t, g[k])
        opt2.step()
    for k in SHAPES:
        assert_same(leaf_bits(back[k]), leaf_bits(ref_tensors[k]), f"weights {k!r} vs uninterrupted torch")
        assert_same(bits32(torch_words(opt2, back[k])), bits32(torch_words(reference, ref_tensors[k])), f"words {k!r}")
        if k in SPLIT_KEYS:
            assert_same(bits16(opt2.state[back[k]]["lo"]), bits16(reference.state[ref_tensors[k]]["lo"]), f"lo {k!r}")


def test_portable_states_between_fp32_and_bf16_leaves_are_refused_both_ways():
    masters, grads, grads32 = problem(seed=9, steps=2)
    tx = packed_adamw(LR, weight_decay=WD)
    pb, sb = start_split(tx, masters)
    pb, sb = step_fn(tx)(pb, sb, to_jax(grads[0]))
    split_export = export_state(sb, "packed")
    with pytest.raises(ValueError, match=re.escape("has a low half")):
        import_state(split_export, to_jax(masters), "packed")  # into FP32 leaves
    fp32_params = to_jax(masters)
    _, s32 = step_fn(tx)(fp32_params, tx.init(fp32_params), to_jax(grads32[0]))
    with pytest.raises(ValueError, match=re.escape("has no low half")):
        import_state(export_state(s32, "packed"), pb, "packed")  # into bf16 leaves
    from packed_adamw.torch import PackedAdamW

    fp32_torch = PackedAdamW([torch.nn.Parameter(torch.from_numpy(masters[k].copy())) for k in sorted(masters)], lr=LR)
    with pytest.raises(ValueError, match=re.escape("has a low half")):
        fp32_torch.import_state(split_export)
    # the round trip inside JAX keeps the state exactly
    assert_trees_same(import_state(split_export, pb, "packed"), sb, "export/import round trip")
    tracked = import_state(split_export, pb, "packed", track_format=True)
    assert isinstance(tracked, PackedAdamWState) and tracked.low_halves is not None
    assert int(tracked.format_counts.steps) == 0


# ------------------------------------------------------------------ master weights --------
def test_load_master_weights_then_master_weights_gives_the_masters_back_at_ties_and_edges():
    rng = np.random.default_rng(10)
    edges = np.array([0x3F808000, 0xBF808000, 0x00000001, 0x80000000, 0x7F7F7FFF, 0xFF7F7FFF, 0x3F7FFFFF, 0x00008000,
                      0x007FFFFF, 0x33800000], U32).view(F32)
    masters = {"a": np.concatenate([edges, spanning(rng, (54,), -30, 30)]).reshape(8, 8), "b": spanning(rng, (3,), -2, 0)}
    params = {"a": jnp.zeros((8, 8), BF16), "b": jnp.zeros(3, jnp.float32)}
    chain = optax.chain(optax.clip(1.0), packed_adamw(LR))  # a nested state: replaced where it is
    state = chain.init(params)
    new_params, new_state = jax.jit(load_master_weights)(to_jax(masters), params, state)
    assert isinstance(new_state[1], PackedAdamWState) and new_state[1].low_halves is not None
    assert new_params["a"].dtype == BF16
    assert_trees_same(master_weights(new_params, new_state), masters, "masters after load_master_weights")
    w, lo = formats.split_master(masters["a"])
    assert_same(bits16(new_params["a"]), w, "weights: the masters' split (ties away from zero)")
    assert_same(bits16(new_state[1].low_halves["a"]), lo.view(U16), "low halves")
    assert_same(bits32(new_params["b"]), bits32(masters["b"]), "a float32 leaf takes its master")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, float(np.uint32(0x7F7F8000).view(F32))])
def test_load_master_weights_refuses_masters_no_bf16_weight_can_hold(bad):
    masters = {"a": np.ones((4,), F32), "b": np.ones(3, F32)}
    masters["a"][2] = bad
    params = {"a": jnp.zeros(4, BF16), "b": jnp.zeros(3, jnp.float32)}
    state = packed_adamw(LR).init(params)
    with pytest.raises(ValueError, match=r"master of leaf \['a'\] has 1 of 4 values with no finite bf16 weight"):
        load_master_weights(to_jax(masters), params, state)
    masters["a"][2] = 1.0
    masters["b"][0] = bad
    if np.isfinite(bad):  # a float32 leaf may hold a finite master above SPLIT_MASTER_MAX
        load_master_weights(to_jax(masters), params, state)
    else:  # but not a NaN or Inf one, though it is a float32
        with pytest.raises(ValueError, match=r"master of leaf \['b'\] has 1 of 3 values that are NaN or Inf"):
            load_master_weights(to_jax(masters), params, state)


def test_load_master_weights_checks_every_master_before_changing_anything():
    """A non-finite master of a float32 leaf after a good bfloat16 one: refused before the
    bfloat16 leaf is split (no half-done load), and the state given stays as it was."""
    params = {"a": jnp.zeros(4, BF16), "b": jnp.zeros(3, jnp.float32)}
    state = packed_adamw(LR).init(params)
    masters = {"a": jnp.full(4, 1.5, jnp.float32), "b": jnp.asarray([1.0, np.nan, 2.0], jnp.float32)}
    with pytest.raises(ValueError, match=r"master of leaf \['b'\] has 1 of 3 values that are NaN or Inf"):
        load_master_weights(masters, params, state)
    assert not np.any(np.asarray(bits16(state.low_halves["a"]))) and not np.any(np.asarray(params["b"]))


def test_load_master_weights_refuses_other_dtypes_shapes_and_trees():
    params = {"a": jnp.zeros(4, BF16), "b": jnp.zeros(3, jnp.float32)}
    state = packed_adamw(LR).init(params)
    with pytest.raises(ValueError, match=r"master of leaf \['a'\] is bfloat16"):
        load_master_weights({"a": jnp.zeros(4, BF16), "b": jnp.zeros(3)}, params, state)
    with pytest.raises(ValueError, match=r"master of leaf \['b'\] is float32 \(4,\)"):
        load_master_weights({"a": jnp.zeros(4), "b": jnp.zeros(4)}, params, state)
    with pytest.raises(ValueError, match="tree"):
        load_master_weights({"a": jnp.zeros(4)}, params, state)
    with pytest.raises(ValueError, match="no low halves"):
        load_master_weights({"a": jnp.zeros(4), "b": jnp.zeros(3)}, params,
                            packed_adamw(LR).init({"a": jnp.zeros(4), "b": jnp.zeros(3)}))
    with pytest.raises(ValueError, match="2 packed_adamw states"):
        master_weights(params, (state, state))


# ------------------------------------------------ where apply_updates cannot give w -------
def _f32(bits16_values):
    return (np.asarray(bits16_values, U32) << U32(16)).view(F32)


def _bf16(bits16_values):
    return jnp.asarray(np.asarray(bits16_values, U16).view(ml_dtypes.bfloat16))


def test_apply_updates_gives_the_new_weight_except_where_no_float32_update_can():
    """docs/JAX.md ("bf16 leaves"): u = f32(w_new) - f32(w) (clipped to the float32 range)
    gives w_new through apply_updates unless (1) w_new is -0.0 and w is not, (2) |w_new - w| >
    FLT_MAX and w + u (u = +-FLT_MAX) does not round to w_new, or (3) |w| > 2**16 |w_new| and
    the difference is not a float32. In (2) and (3) no float32 u near it does either. Where it
    fails, the low half becomes 0, so the master is the weight apply_updates gives. Weights and
    differences stay above the subnormals, which XLA's CPU arithmetic flushes (a test below)."""
    rng = np.random.default_rng(11)
    n = 1 << 17
    p = rng.integers(40, 255, n) << 7 | rng.integers(0, 128, n) | rng.integers(0, 2, n) << 15
    exponent = np.clip(((p >> 7) & 0xFF) + rng.integers(-40, 40, n), 30, 254)
    t = exponent << 7 | rng.integers(0, 128, n) | rng.integers(0, 2, n) << 15
    t[:64] = 0x8000  # -0.0 from a nonzero weight
    t[64:128] = p[64:128]  # unchanged
    p, t = p.astype(U16), t.astype(U16)
    lo_new = rng.integers(-2**15, 2**15, n).astype(np.int16)
    u, lo = jax.jit(_masters.transform_update)(_bf16(p), _bf16(t), jnp.asarray(lo_new))
    applied = bits16(optax.apply_updates(_bf16(p), u))
    assert_same(bits16(jax.jit(optax.apply_updates)(_bf16(p), u)), applied, "apply_updates eager vs jit")
    p32, t32 = _f32(p), _f32(t)
    exact_diff = (t32.astype(np.float64) - p32.astype(np.float64))
    representable = exact_diff.astype(F32).astype(np.float64) == exact_diff
    largest = np.copysign(np.finfo(F32).max, exact_diff).astype(F32)
    with np.errstate(over="ignore"):
        overshoot = (p32 + largest).astype(ml_dtypes.bfloat16).view(U16) != t  # numpy: no flushing
    documented = ((t == 0x8000) & (p != 0x8000)) | ((np.abs(exact_diff) > np.finfo(F32).max) & overshoot) | (
        (np.abs(p32.astype(np.float64)) > 2.0**16 * np.abs(t32)) & ~representable)
    fails = applied != t
    assert fails.tolist() == documented.tolist(), (np.flatnonzero(fails != documented)[:5])
    assert 0 < fails.sum() < n // 2 and fails[:64].all() and not fails[64:128].any()
    assert (bits32(u)[64:128] == U32(0x80000000)).all(), "an unchanged weight gets u = -0.0"
    # lo: kept where apply_updates gives w_new, else 0 (the master is then the applied weight)
    assert_same(bits16(lo)[~fails], lo_new.view(U16)[~fails], "low halves kept")
    assert not bits16(lo)[fails].any()
    # (2) and (3): no float32 within 2**12 ulps of u gives w_new either
    for i in np.flatnonzero(fails & (t != 0x8000))[:400]:
        near = (bits32(u)[i].astype(np.int64) + np.arange(-4096, 4097)).astype(U32).view(F32)
        with np.errstate(over="ignore", invalid="ignore"):
            reached = (p32[i] + near).astype(ml_dtypes.bfloat16).view(U16)
        assert not (reached == t[i]).any(), (hex(p[i]), hex(t[i]))


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_collapsing_past_float32_reach_keeps_a_consistent_state_in_the_transform(mode, variant):
    """A constructed step with b1 = b2 = 0 and eps tiny, so u = -lr exactly: the master
    1 - 2**-10 (weight 1.0) goes to -3 * 2**-24. The fused step and the FP32 run agree; the new
    weight -3 * 2**-24 is not 1.0 + any float32, so apply_updates lands on -2**-22, and the
    transform's state holds that weight as the master (low half 0): no NaN, w == split(M)."""
    master = np.array([1.0 - 2.0**-10, 0.5], F32)
    lr = F32(1.0 - 2.0**-10 + 3 * 2.0**-24)
    kwargs = dict(b1=0.0, b2=0.0, eps=1e-30, weight_decay=0.0, mode=mode)
    tx = packed_adamw(float(lr), **kwargs)
    g = {"a": jnp.asarray([1.0, 0.0], jnp.float32)}
    p32, s32 = variant(step_fn(tx))({"a": jnp.asarray(master)}, tx.init({"a": jnp.asarray(master)}), g)
    assert bits32(p32["a"])[0] == bits32(F32(-3 * 2.0**-24))
    params, state = load_master_weights({"a": jnp.asarray(master)}, {"a": jnp.zeros(2, BF16)},
                                        tx.init({"a": jnp.zeros(2, BF16)}))
    pf, sf = variant(packed_adamw_fused_step(float(lr), **kwargs))(params, g, state)
    assert_same(bits32(master_weights(pf, sf)["a"]), bits32(p32["a"]), "fused masters vs the FP32 run")
    updates, st = variant(tx.update)(g, state, params)
    applied = optax.apply_updates(params, updates)
    assert bits16(applied["a"])[0] == bits16(jnp.asarray(F32(-2.0**-22)).astype(BF16)) != bits16(pf["a"])[0]
    assert bits16(applied["a"])[1] == bits16(pf["a"])[1]
    joined = np.asarray(master_weights(applied, st)["a"])
    assert_same(bits32(joined)[:1], bits32(np.asarray(applied["a"]).astype(F32))[:1], "the master is the weight")
    assert np.isfinite(joined).all()
    assert_same(bits32(st.moments["a"]), bits32(sf.moments["a"]), "the words are the fused step's")


def test_on_xla_cpu_a_subnormal_weight_is_flushed_by_apply_updates_and_the_state_follows():
    """XLA's CPU backend flushes float32 subnormals in arithmetic, so apply_updates turns a
    subnormal bf16 weight (|w| < 2**-126) into zero even with u = -0.0 (as it does a subnormal
    float32 parameter); the fused step keeps it. The low half then becomes 0: the master is
    the weight the parameters hold."""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU arithmetic is what flushes")
    sub = np.array([0x0001, 0x8040, 0x3F80], U16)  # two subnormal weights and 1.0
    p = _bf16(sub)
    lo_new = jnp.asarray(np.array([5, 7, 9], np.int16))
    u, lo = _masters.transform_update(p, p, lo_new)
    applied = bits16(optax.apply_updates(p, u))
    assert applied.tolist() == [0x0000, 0x8000, 0x3F80], [hex(x) for x in applied]
    assert np.asarray(lo).tolist() == [0, 0, 9]


# ------------------------------------------------------------------------- refusals -------
def test_fp16_and_other_leaves_are_refused_naming_the_leaf_and_saying_what_to_use():
    tx = packed_adamw(LR)
    with pytest.raises(TypeError, match=r"\['w'\] has dtype float16.*bfloat16.*float32"):
        tx.init({"w": jnp.ones(3, jnp.float16)})
    with pytest.raises(TypeError, match=r"\['w'\] has dtype int32"):
        tx.init({"w": jnp.ones(3, jnp.int32)})
    params = {"b": jnp.ones(3, jnp.float32), "w": jnp.ones(3, BF16)}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"grads leaf \['b'\] has dtype bfloat16"):
        tx.update({"b": jnp.ones(3, BF16), "w": jnp.ones(3, BF16)}, state, params)  # FP32 leaf, bf16 grads
    with pytest.raises(TypeError, match=r"grads leaf \['w'\] has dtype float16"):
        tx.update({"b": jnp.ones(3), "w": jnp.ones(3, jnp.float16)}, state, params)
    with pytest.raises(TypeError, match=r"params leaf \['w'\] has dtype float16"):
        tx.update({"b": jnp.ones(3), "w": jnp.ones(3)}, state, {"b": params["b"], "w": jnp.ones(3, jnp.float16)})


def test_states_built_for_other_dtypes_and_updates_without_params_are_refused():
    tx = packed_adamw(LR, weight_decay=0.0)
    fp32 = {"b": jnp.ones(3), "w": jnp.ones(3)}
    mixed = {"b": jnp.ones(3), "w": jnp.ones(3, BF16)}
    grads = {"b": jnp.ones(3), "w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"\['w'\] is bfloat16 but the state has no low halves"):
        tx.update(grads, tx.init(fp32), mixed)
    with pytest.raises(ValueError, match=r"low half for params leaf \['w'\].*but the leaf is float32"):
        tx.update(grads, tx.init(mixed), fp32)
    with pytest.raises(ValueError, match=r"\['b'\] is bfloat16 but the state has no low half for it"):
        tx.update(grads, tx.init(mixed), {"b": jnp.ones(3, BF16), "w": jnp.ones(3, BF16)})
    with pytest.raises(ValueError, match=r"update\(\) needs params"):
        tx.update(grads, tx.init(mixed))  # zero weight decay, but a bf16 weight is half the master
    bad_lows = tx.init(mixed)._replace(low_halves={"b": None, "w": jnp.zeros(3, jnp.int32)})
    with pytest.raises(ValueError, match=r"low half of leaf \['w'\] is int32"):
        tx.update(grads, bad_lows, mixed)


# ---------------------------------------------------- the CUDA launch code, interpreted ---
@pytest.mark.skipif(not launch.interpreting(), reason="runs the kernels in the Triton interpreter")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["leaf_groups", "per_leaf"])
@pytest.mark.parametrize("write_update", [True, False], ids=["transform", "fused"])
def test_the_cuda_launches_of_mixed_kinds_equal_the_numpy_step_in_the_interpreter(mode, multi_tensor, write_update,
                                                                                   monkeypatch):
    """FP32 leaves, split leaves with float32 and with bf16 gradients, an empty split leaf:
    one launch per kind (or per leaf), each leaf's bits those of the numpy step, the counts
    too where the mode has codes."""
    from packed_adamw.core.adamw.kernel import FUNCTIONAL_KERNELS as KERNELS
    from packed_adamw.jax import _triton_launch

    fmt = StateFormat(mode)
    track = mode != "fp32"
    rng = np.random.default_rng(12)
    # (size, kind): kind 0 FP32, 1 split with float32 gradients, 2 split with bf16 gradients
    leaves = [(700, 1), (3, 0), (1, 2), (0, 1), (600, 2), (5, 1), (9, 2), (40, 0)]
    masters = [spanning(rng, (n,), -4, 1) for n, _ in leaves]
    grads = [spanning(rng, (n,), -12, 2) for n, _ in leaves]
    grads[0][:3] = [np.nan, np.inf, 3e38]  # rejected elements keep everything
    grads = [g.astype(ml_dtypes.bfloat16) if kind == 2 else g for g, (_, kind) in zip(grads, leaves)]
    words = [(rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32) & U32(0x3FFF3FFF)) if mode != "fp32"
             else np.abs(spanning(rng, (2, n), -8, -2)) for n, _ in leaves]
    splits = [formats.split_master(m) if kind else (None, None) for m, (_, kind) in zip(masters, leaves)]
    params = [jnp.asarray(w.view(ml_dtypes.bfloat16)) if kind else jnp.asarray(m)
              for m, (w, _), (_, kind) in zip(masters, splits, leaves)]
    lows = [jnp.asarray(lo) if kind else None for (_, lo), (_, kind) in zip(splits, leaves)]
    # The rule's row variants: the row with weight decay, then without (a mask leaves these out).
    leaf_rows = [ADAMW_RULE.leaf_variant(i % 3 != 1) for i in range(len(leaves))]
    rows = [[1e-2, 0.9, 0.95, 1e-8, 0.1], [1e-2, 0.9, 0.95, 1e-8, 0.0]]
    count = 3
    stand_in = InterpretedJaxTriton()
    monkeypatch.setattr(_triton_launch, "_jax_triton", lambda: stand_in)
    outs, new_states, counts, new_lows = _triton_launch.step(
        params, [jnp.asarray(g) for g in grads], [jnp.asarray(s) for s in words], leaf_rows,
        jnp.asarray(rows, jnp.float32), jnp.asarray(count, jnp.int32), fmt=fmt, kernels=KERNELS,
        write_update=write_update, multi_tensor=multi_tensor, alias_grads=write_update, track_format=track, lows=lows)
    updates = [k for k in stand_in.kernels if k is not KERNELS.step_scalars]
    split_groups = [m["GRAD_BF16"] for k, m in stand_in.launches if k is KERNELS.leaf_group and m["SPLIT"]]
    if multi_tensor:
        assert sorted(split_groups) == [False, True], stand_in.kernels  # one launch per split kind
    assert len(updates) == (3 if multi_tensor else len(leaves) - 1), stand_in.kernels
    for i, (n, kind) in enumerate(leaves):
        s = words[i].copy()
        scalars = step_scalar_row(count, rows[leaf_rows[i]])
        expected = np.zeros(6, np.int64)
        if kind:
            w, lo = splits[i][0].copy(), splits[i][1].copy()
            g = grads[i].view(U16) if kind == 2 else grads[i]
            apply_split_step(w, lo, g, s, scalars, fmt=fmt, format_counts_out=expected if track else None)
            assert_same(bits16(outs[i]), w, f"new weight {i}")
            assert_same(bits16(new_lows[i]), lo.view(U16), f"new low half {i}")
        else:
            p = masters[i].copy()
            update = np.empty_like(p) if write_update else None
            apply_step(p, grads[i], s, scalars, fmt=fmt, update_out=update,
                       format_counts_out=expected if track else None)
            assert_same(bits32(outs[i]), bits32(update if write_update else p), f"out {i}")
            assert new_lows[i] is None
        assert_same(bits32(new_states[i]), bits32(s), f"state {i}")
        if track:
            assert np.asarray(counts[i]).tolist() == expected.tolist(), i
    # without low halves the step returns what it did before: (outs, states, counts)
    assert len(_triton_launch.step([params[1]], [jnp.asarray(grads[1])], [jnp.asarray(words[1])], [0],
                                   jnp.asarray(rows, jnp.float32), jnp.asarray(count, jnp.int32), fmt=fmt,
                                   kernels=KERNELS, write_update=write_update, multi_tensor=multi_tensor)) == 3


# ------------------------------------------------------------- 8 CPU devices (a child) ----
DEVICES = 8


def _cases():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from packed_adamw.core import StateFormat
    from packed_adamw.jax import (import_state, export_state, load_master_weights, master_weights, packed_adamw,
                                  packed_adamw_fused_step)

    assert len(jax.devices()) == DEVICES, jax.devices()
    rng = np.random.default_rng(0)
    shapes, specs = SHARDED_SHAPES, sharded_specs()
    split = {"a", "c", "d"}  # bf16; "b" and "r" float32
    masters0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads0 = [{k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 1, s)).astype(np.float32)
               for k, s in shapes.items()} for _ in range(3)]
    grads0 = [{k: jnp.asarray(v).astype(jnp.bfloat16) if k in ("a", "c") else jnp.asarray(v) for k, v in g.items()}
              for g in grads0]  # "d": float32 gradients of a bf16 leaf
    mask = {"a": True, "b": False, "c": True, "d": True, "r": False}
    template = {k: jnp.asarray(v).astype(jnp.bfloat16) if k in split else jnp.asarray(v) for k, v in masters0.items()}

    def bits(x):
        a = np.asarray(x)
        return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)

    def same_bits(a, b):
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        return len(la) == len(lb) and all(np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))

    def put(tree, mesh):
        return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}

    def start(tx, mesh=None):
        params = template if mesh is None else put(template, mesh)
        masters = {k: jnp.asarray(v) for k, v in masters0.items()}
        return load_master_weights(masters if mesh is None else put(masters, mesh), params, tx.init(params))

    def reference(mode):
        tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
        params, state = start(tx)
        step = jax.jit(optax_train_step(tx))
        for g in grads0:
            params, state = step(params, state, g)
        return params, state

    results, case = case_recorder()

    explicit = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Auto,))
    modes = ["packed", "fp32"]
    refs = {mode: reference(mode) for mode in modes}
    refs_first = {}  # after one eager step
    for mode in modes:
        tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
        params, state = start(tx)
        refs_first[mode] = optax_train_step(tx)(params, state, grads0[0])

    @case("low_halves_follow_the_params_shardings")
    def _():
        tx = packed_adamw(1e-2)
        for mesh in (explicit, auto):
            params, state = start(tx, mesh)
            for k in split:
                lo = state.low_halves[k]
                assert lo.sharding.mesh == mesh and lo.dtype == jnp.int16, (k, lo.sharding)
                assert normalized_spec(lo.sharding.spec, lo.ndim) == normalized_spec(specs[k], lo.ndim), (k, lo.sharding)
            assert state.low_halves["b"] is None
            with jax.set_mesh(explicit):
                traced = jax.jit(tx.init)(put(template, explicit))
            assert normalized_spec(traced.low_halves["a"].sharding.spec, 2) == ("x", None)

    @case("sharded_bits_equal_unsharded_transform_and_fused")
    def _():
        for mode in modes:
            tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask, mode=mode)
            fused = jax.jit(packed_adamw_fused_step(1e-2, weight_decay=0.1, mask=mask, mode=mode),
                            donate_argnums=(0, 2))
            want_p, want_s = refs[mode]
            for mesh, context in ((explicit, lambda: jax.set_mesh(explicit)), (auto, None)):
                params, state = start(tx, mesh)
                fp, fs = start(tx, mesh)
                step = jax.jit(optax_train_step(tx))
                eager = optax_train_step(tx)
                ep, es = start(tx, mesh)
                for i, g in enumerate(grads0):
                    g = put(g, mesh)
                    if context is not None:
                        with context():
                            params, state = step(params, state, g)
                    else:
                        params, state = step(params, state, g)
                    fp, fs = fused(fp, g, fs)
                    if i == 0:
                        ep, es = eager(ep, es, g)
                        assert same_bits(ep, refs_first[mode][0]) and same_bits(es, refs_first[mode][1]), "eager"
                assert same_bits(params, want_p) and same_bits(state, want_s), (mode, str(mesh.axis_types))
                assert same_bits(fp, want_p) and same_bits(fs, want_s), ("fused", mode, str(mesh.axis_types))
                assert same_bits(master_weights(params, state), master_weights(want_p, want_s))

    @case("compiled_sharded_update_has_no_collectives")
    def _():
        tx = packed_adamw(1e-2, weight_decay=0.1, mask=mask)
        with jax.set_mesh(explicit):
            params, state = start(tx, explicit)
            text = jax.jit(optax_train_step(tx)).lower(params, state, put(grads0[0], explicit)).compile().as_text()
        found = re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                           text)
        assert not found, sorted(set(found))
        assert step_callbacks(text) == 1

    @case("import_state_places_the_low_halves_like_the_params")
    def _():
        want_p, want_s = refs["packed"]
        params = put(want_p, auto)
        imported = import_state(export_state(want_s, "packed"), params, "packed")
        assert same_bits(imported, want_s)
        for k in split:
            lo = imported.low_halves[k]
            assert normalized_spec(lo.sharding.spec, lo.ndim) == normalized_spec(specs[k], lo.ndim), (k, lo.sharding)

    @case("custom_partitioning_places_the_low_halves_like_the_params")
    def _():
        from packed_adamw.jax._sharding import partitioned_step
        from packed_adamw.jax._rules import ADAMW
        from packed_adamw.jax._step import StepConfig, StepOperands

        def body(*args, config):  # stand-in for the step: passes its operands through
            n, k = config.n_leaves, len(config.split)
            return [x + 0 for x in args[:n]] + [x + 0 for x in args[2 * n:3 * n + k]]

        keys = sorted(shapes)
        fmt = StateFormat("packed")
        config = StepConfig(fmt=fmt, steps=ADAMW, write_update=False, multi_tensor=True, leaf_rows=(0,) * len(keys),
                            paths=tuple(keys), split=tuple(i for i, k in enumerate(keys) if k in split))
        p = [jax.device_put(template[k], NamedSharding(auto, specs[k])) for k in keys]
        s = [jax.device_put(np.zeros(shapes[k], np.uint32), NamedSharding(auto, specs[k])) for k in keys]
        lows = [jax.device_put(np.full(shapes[k], 3, np.int16), NamedSharding(auto, specs[k])) for k in keys
                if k in split]
        h, c = jnp.full((2, 5), 0.5, jnp.float32), jnp.asarray(3, jnp.int32)
        fn = jax.jit(lambda p, s, lows, h, c: partitioned_step(StepOperands(p, p, s, config.per_leaf(lows), h, c),
                                                                config=config, body=body))
        new_lows = fn(p, s, lows, h, c).lows
        for k, lo in zip(keys, new_lows):
            if k in split:
                assert np.asarray(lo).tolist() == np.full(shapes[k], 3).tolist()
                assert normalized_spec(lo.sharding.spec, lo.ndim) == normalized_spec(specs[k], lo.ndim), (k, lo.sharding)
            else:
                assert lo is None

    return results


@pytest.fixture(scope="module")
def child_results():
    return run_cases_child(__file__, DEVICES)


@pytest.mark.parametrize("name", ["low_halves_follow_the_params_shardings",
                                  "sharded_bits_equal_unsharded_transform_and_fused",
                                  "compiled_sharded_update_has_no_collectives",
                                  "import_state_places_the_low_halves_like_the_params",
                                  "custom_partitioning_places_the_low_halves_like_the_params"])
def test_on_eight_cpu_devices(child_results, name):
    assert name in child_results, f"case {name} did not run: {sorted(child_results)}"
    assert child_results[name] == "ok", child_results[name]


# ----------------------------------------------------------------------- CUDA (H200) ------
_cuda_reason = jax_cuda_unavailable


# One split leaf over 2**24 elements launches alone; the rest share launches of their kind.
CUDA_SHAPES = {"big": (4097, 4097), "b": (1031,), "e": (7, 3), "s": (), "w": (257, 33)}
CUDA_SPLIT = ("big", "e", "s", "w")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_kind", GRAD_KINDS)
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["leaf_groups", "per_leaf"])
def test_cuda_transform_and_fused_equal_the_fp32_run_torch_cuda_and_the_cpu(mode, grad_kind, multi_tensor):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    masters, grads, grads32 = problem(seed=21, steps=4, grad_kind=grad_kind, shapes=CUDA_SHAPES,
                                      split_keys=CUDA_SPLIT)
    kwargs = dict(weight_decay=WD, mode=mode, multi_tensor=multi_tensor, track_format=mode != "fp32")
    tx = packed_adamw(table_schedule, **kwargs)
    step = jax.jit(step_fn(tx))
    fused = jax.jit(packed_adamw_fused_step(table_schedule, **kwargs), donate_argnums=(0, 2))
    p32, s32 = to_jax(masters), tx.init(to_jax(masters))
    pb, sb = start_split(tx, masters, CUDA_SPLIT)
    pf, sf = start_split(tx, masters, CUDA_SPLIT)
    for g, g32 in zip(grads, grads32):
        p32, s32 = step(p32, s32, to_jax(g32))
        pb, sb = step(pb, sb, to_jax(g))
        pf, sf = fused(pf, to_jax(g), sf)
    assert all(x.devices().pop().platform == "gpu" for x in jax.tree_util.tree_leaves(pf))
    assert_trees_same(master_weights(pb, sb), p32, "transform masters vs the FP32 run")
    assert_trees_same(master_weights(pf, sf), p32, "fused masters vs the FP32 run")
    assert_trees_same(pf, pb, "fused weights vs apply_updates")
    assert_trees_same(sf, sb, "fused state vs transform state")
    assert_trees_same(sb.moments, s32.moments, "words vs the FP32 run")
    if mode != "fp32":
        assert format_stats(sb) == format_stats(s32)
    if not multi_tensor:
        return  # torch once per mode and gradient kind
    opt, tensors = torch_run(masters, grads, mode=mode, lr_table=TABLE, split_keys=CUDA_SPLIT)  # on the CPU
    for k in CUDA_SHAPES:
        assert_same(leaf_bits(pb[k]), leaf_bits(tensors[k]), f"JAX GPU vs torch CPU weights {k!r}")
        if k in CUDA_SPLIT:
            assert_same(bits16(sb.low_halves[k]), bits16(opt.state[tensors[k]]["lo"]), f"lo {k!r}")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_cuda_fused_step_updates_donated_weights_low_halves_and_words_in_place(mode):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    masters, grads, _ = problem(seed=22, steps=2, shapes={"w": (1 << 20,)}, split_keys=("w",))
    tx = packed_adamw(LR, mode=mode)
    fused = jax.jit(packed_adamw_fused_step(LR, mode=mode, impl="kernel"), donate_argnums=(0, 2))
    params, state = start_split(tx, masters, ("w",))
    pointers = (params["w"].unsafe_buffer_pointer(), state.low_halves["w"].unsafe_buffer_pointer(),
                state.moments["w"].unsafe_buffer_pointer())
    params, state = fused(params, to_jax(grads[0]), state)
    assert (params["w"].unsafe_buffer_pointer(), state.low_halves["w"].unsafe_buffer_pointer(),
            state.moments["w"].unsafe_buffer_pointer()) == pointers


if __name__ == "__main__" and "--cases" in sys.argv:
    _cases()
