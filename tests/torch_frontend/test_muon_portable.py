"""PortableState for Muon (docs/MUON.md, "Moving a state between torch and JAX"): torch's
PackedMuonAdamW -> JAX's packed_muon -> torch, with Muon's momenta transposed between the
layouts, and the refusals.

What can be exact is asserted exact: the exported and imported tensors, the momenta after
continued steps (the momentum phase reads only gradients), the AdamW leaves (torch CPU == JAX
CPU, as for PackedAdamW). The Muon weights after a continued step go through two Newton-Schulz
implementations (torch's and XLA's, which MUON.md promises only within a tolerance on the CPU):
they are compared within tests/jax_frontend/test_jax_muon.py's NS_TOLERANCE per step.
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import torch  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

from packed_adamw.core.codecs import join_master  # noqa: E402
from packed_adamw.core.portable import MIXED, PortableState  # noqa: E402
from packed_adamw.jax import import_state as import_adamw_state  # noqa: E402
from packed_adamw.jax.muon import (  # noqa: E402
    export_muon_state,
    import_muon_state,
    packed_muon,
    packed_muon_fused_step,
)
from packed_adamw.torch import PackedMuon, PackedMuonAdamW  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
# name, torch shape ([out, in] for a matrix), dtype, rule: in torch's parameter order, which is
# the JAX list's leaf order. The square bf16 matrix catches a missing transposition that the
# shapes would not.
PARAMS = [("wide", (6, 14), F32, "muon"), ("tall", (14, 5), F32, "muon"), ("square", (8, 8), BF16, "muon"),
          ("embed", (11, 6), F32, "adamw"), ("gain", (6,), BF16, "adamw"), ("bias", (5,), F32, "adamw")]
MUON = [i for i, (_, _, _, rule) in enumerate(PARAMS) if rule == "muon"]
DIMS = [MuonDimensionNumbers() if rule == "muon" else None for _, _, _, rule in PARAMS]
LR, WD, BETA, ADAM_LR, ADAM_WD = 0.02, 0.1, 0.95, 1e-3, 0.01
NS_TOLERANCE = 2.0 ** -6  # tests/jax_frontend/test_jax_muon.py: twice the measured Newton-Schulz gap, per step


def torch_optimizer(params, mode="packed", adamw_mode="packed"):
    groups = [{"params": [params[i] for i in range(len(PARAMS)) if PARAMS[i][3] == kind], "kind": kind,
               "param_names": [PARAMS[i][0] for i in range(len(PARAMS)) if PARAMS[i][3] == kind]}
              for kind in ("muon", "adamw")]
    return PackedMuonAdamW(groups, lr=LR, weight_decay=WD, momentum=BETA, mode=mode, adamw_lr=ADAM_LR,
                           adamw_weight_decay=ADAM_WD, adamw_mode=adamw_mode)


def jax_args(mode):
    return dict(mode=mode, adam_mode="packed", muon_weight_dimension_numbers=DIMS)


def jax_step(mode):
    return jax.jit(packed_muon_fused_step(LR, beta=BETA, weight_decay=WD, adam_learning_rate=ADAM_LR,
                                          adam_weight_decay=ADAM_WD, **jax_args(mode)))


def problem(seed, steps):
    rng = np.random.default_rng(seed)
    weights = [(rng.standard_normal(shape) * 0.2).astype(np.float32) for _, shape, _, _ in PARAMS]
    grads = [[(rng.standard_normal(shape) * 2.0 ** rng.integers(-10, -2, shape)).astype(np.float32)
              for _, shape, _, _ in PARAMS] for _ in range(steps)]
    return weights, grads


def torch_params(weights):
    return [torch.nn.Parameter(torch.from_numpy(w.copy()).to(dtype)) for w, (_, _, dtype, _) in zip(weights, PARAMS)]


def torch_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = torch.from_numpy(g.copy()).to(p.dtype)
    opt.step()


def jax_layout(x, i):
    """A torch-layout array as JAX's leaf i: a Muon matrix transposed ([in, out])."""
    return x.T if i in MUON else x


def jax_grads(grads):
    """torch's gradients as JAX's: a bf16 parameter's in bf16, as torch_step gives it."""
    return [jnp.asarray(jax_layout(g, i)).astype(jnp.bfloat16 if dtype is BF16 else jnp.float32)
            for i, (g, (_, _, dtype, _)) in enumerate(zip(grads, PARAMS))]


def jax_params_from(params):
    """JAX leaves holding torch's weights (bf16 bits kept)."""
    out = []
    for i, p in enumerate(params):
        w = p.detach()
        w = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if w.dtype is BF16 else w.numpy()
        out.append(jnp.asarray(jax_layout(w, i).copy()))
    return out


def torch_params_from(params):
    out = []
    for i, (leaf, (_, _, dtype, _)) in enumerate(zip(params, PARAMS)):
        w = np.ascontiguousarray(jax_layout(np.asarray(leaf), i))
        tensor = torch.from_numpy(w.view(np.int16).copy()).view(BF16) if dtype is BF16 else torch.from_numpy(w.copy())
        out.append(torch.nn.Parameter(tensor))
    return out


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype.itemsize == 4 else x.view(np.uint16)


def assert_same_tensors(a: PortableState, b: PortableState, what: str) -> None:
    assert a.tensor_formats() == b.tensor_formats(), what
    for i, (x, y) in enumerate(zip(a.moments, b.moments)):
        assert x.dtype == y.dtype and np.array_equal(bits(x), bits(y)), f"{what}: tensor {i} ({PARAMS[i][0]})"
    lows_a, lows_b = a.low_halves or [None] * len(PARAMS), b.low_halves or [None] * len(PARAMS)
    for i, (x, y) in enumerate(zip(lows_a, lows_b)):
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), f"{what}: low half {i}"
    exponents_a, exponents_b = (e.exponents or [None] * len(PARAMS) for e in (a, b))
    for i, (x, y) in enumerate(zip(exponents_a, exponents_b)):
        assert (x is None) == (y is None), f"{what}: exponent {i}"
        assert x is None or (x.dtype == y.dtype == np.int32 and x.shape == y.shape == () and x == y), \
            f"{what}: exponent {i}"


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
def test_a_state_moves_torch_to_jax_and_back(mode, tmp_path):
    """torch steps 3, exports (through a file); JAX imports it and steps 2 beside torch; JAX
    exports, a new torch optimizer imports it, and both step once more."""
    weights, grads = problem(seed=37, steps=6)
    params = torch_params(weights)
    opt = torch_optimizer(params, mode)
    for g in grads[:3]:
        torch_step(opt, params, g)
    exported = opt.export_state()
    assert exported.format == MIXED and [exported.counts[i] for i in MUON] == [None] * len(MUON)
    # packed mode's exponents travel, one int32 a matrix (none for AdamW's tensors)
    assert [e is not None for e in exported.exponents or [None] * len(PARAMS)] == \
        [mode == "packed" and i in MUON for i in range(len(PARAMS))]
    exported.save(tmp_path / "torch.safetensors")
    portable = PortableState.load(tmp_path / "torch.safetensors")
    assert_same_tensors(portable, exported, "saved and loaded")

    jparams = jax_params_from(params)
    state = import_muon_state(portable, jparams, **jax_args(mode))
    assert int(state.count) == 3 and int(state.adamw.inner_state.count) == 3
    # The imported state is laid out as init() lays it out, and exports back to the same tensors.
    fresh = packed_muon(LR, **jax_args(mode)).init(jparams)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(fresh)
    assert jax.tree_util.tree_map(jax.typeof, state) == jax.tree_util.tree_map(jax.typeof, fresh)
    assert_same_tensors(export_muon_state(state, jparams, **jax_args(mode)), portable, "JAX import then export")
    square = MUON[-1]  # the momentum of a matrix is its transpose in JAX
    assert np.array_equal(bits(state.momentum[square]), bits(portable.moments[square].T))
    if mode == "packed":
        assert [int(state.exponents[i]) for i in MUON] == [int(portable.exponents[i]) for i in MUON]

    step = jax_step(mode)
    for n, g in enumerate(grads[3:5], start=1):
        torch_step(opt, params, g)
        jparams, state = step(jparams, jax_grads(g), state)
        ours = export_muon_state(state, jparams, **jax_args(mode))
        theirs = opt.export_state()
        for i, (_, shape, dtype, rule) in enumerate(PARAMS):
            jw = np.asarray(jparams[i])
            tw = params[i].detach()
            if rule == "adamw":  # exact: AdamW's step is the same bits in torch and JAX on the CPU
                assert np.array_equal(bits(jw), bits(tw.view(torch.int16).numpy() if dtype is BF16 else tw.numpy()))
                assert np.array_equal(bits(ours.moments[i]), bits(theirs.moments[i])), (n, PARAMS[i][0])
                assert ours.counts[i] == theirs.counts[i] == 3 + n
                continue
            # Muon: the momentum (and its exponent) exactly, the weights (masters) within the
            # Newton-Schulz tolerance
            assert np.array_equal(bits(ours.moments[i]), bits(theirs.moments[i])), (n, PARAMS[i][0])
            if mode == "packed":
                assert ours.exponents[i] == theirs.exponents[i], (n, PARAMS[i][0])
            if dtype is BF16:
                jm = join_master(jw.view(np.uint16), ours.low_halves[i].T)
                tm = join_master(tw.view(torch.int16).numpy(), theirs.low_halves[i])
            else:
                jm, tm = jw, tw.numpy()
            adjusted = LR * max(1.0, shape[0] / shape[1]) ** 0.5
            gap = np.abs(jm.T - tm).max()
            assert gap <= n * adjusted * NS_TOLERANCE * 1.01, (n, PARAMS[i][0], gap)

    # JAX -> torch: the imported state exports to JAX's tensors, and steps on from them.
    (tmp_path / "jax.safetensors").unlink(missing_ok=True)
    export_muon_state(state, jparams, **jax_args(mode)).save(tmp_path / "jax.safetensors")
    from_jax = PortableState.load(tmp_path / "jax.safetensors")
    assert [from_jax.counts[i] for i in MUON] == [5] * len(MUON)
    back = torch_params_from(jparams)
    opt2 = torch_optimizer(back, mode)
    opt2.import_state(from_jax)
    assert_same_tensors(opt2.export_state(), from_jax, "torch import of JAX's export")
    torch_step(opt2, back, grads[5])
    jparams, state = step(jparams, jax_grads(grads[5]), state)
    ours, theirs = export_muon_state(state, jparams, **jax_args(mode)), opt2.export_state()
    for i, (_, _, dtype, rule) in enumerate(PARAMS):
        assert np.array_equal(bits(ours.moments[i]), bits(theirs.moments[i])), PARAMS[i][0]
        if rule == "muon" and mode == "packed":
            assert ours.exponents[i] == theirs.exponents[i], PARAMS[i][0]
        if rule == "adamw":
            tw = back[i].detach()
            assert np.array_equal(bits(np.asarray(jparams[i])),
                                  bits(tw.view(torch.int16).numpy() if dtype is BF16 else tw.numpy())), PARAMS[i][0]


@pytest.fixture(scope="module")
def exported_once():
    weights, grads = problem(seed=3, steps=1)
    params = torch_params(weights)
    opt = torch_optimizer(params)
    torch_step(opt, params, grads[0])
    return weights, params, opt.export_state()


def test_mismatched_formats_layouts_and_rules_are_refused_naming_the_parameter(exported_once):
    weights, params, portable = exported_once
    jparams = jax_params_from(params)
    with pytest.raises(ValueError, match=r"tensor 0 \(\[0\]\) has format 'muon-packed.*', the optimizer's "
                                         r"'muon-fp32:mu=f32'"):
        import_muon_state(portable, jparams, **jax_args("fp32"))
    untransposed = [jnp.asarray(w) if i in MUON else leaf for i, (w, leaf) in enumerate(zip(weights, jparams))]
    untransposed[MUON[-1]] = untransposed[MUON[-1]].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"tensor 0 \(\[0\]\) is uint16 \(6, 14\), expected uint16 \(14, 6\)"):
        import_muon_state(portable, untransposed, **jax_args("packed"))
    with pytest.raises(ValueError, match=r"tensor 3 \(\[3\]\) has format 'packed:.*', the optimizer's 'muon-packed"):
        import_muon_state(portable, jparams, mode="packed")  # every 2-D leaf Muon's: the embedding too
    with pytest.raises(ValueError, match="portable state mixes formats"):
        import_adamw_state(portable, jparams)
    other = torch_optimizer(torch_params(weights), adamw_mode="fp32")
    with pytest.raises(ValueError, match=r"tensor 3 \('embed'\) has format 'packed:"):
        other.import_state(portable)
    assert not other.state  # nothing changed
    with pytest.raises(ValueError, match="holds 6 tensors and 6 counts, the parameters are 3"):
        PackedMuon([p for p, (_, _, _, rule) in zip(torch_params(weights), PARAMS) if rule == "muon"]).import_state(
            portable)


def test_a_torch_muon_state_without_counts_needs_one_and_bad_values_are_refused(exported_once):
    weights, params, _ = exported_once
    matrices = [params[i] for i in MUON]
    opt = PackedMuon(matrices, lr=LR, mode="fp32")
    for p in matrices:
        p.grad = torch.ones_like(p)
    opt.step()
    portable = opt.export_state()
    assert portable.format == "muon-fp32:mu=f32" and portable.counts == [None] * len(MUON)
    leaves = [jax_params_from(params)[i] for i in MUON]
    with pytest.raises(ValueError, match="has no step count .* pass count="):
        import_muon_state(portable, leaves, mode="fp32")
    state = import_muon_state(portable, leaves, mode="fp32", count=1)
    assert int(state.count) == 1 and int(state.adamw.inner_state.count) == 1
    portable.moments[1][2, 3] = np.nan
    with pytest.raises(ValueError, match=r"tensor 1 \(\[1\]\): the momentum holds NaN or Inf"):
        import_muon_state(portable, leaves, mode="fp32", count=1)
    with pytest.raises(ValueError, match=r"tensor 1 \(param_groups\[0\]\['params'\]\[1\]\): the momentum holds NaN or Inf"):
        PackedMuon(matrices, mode="fp32").import_state(portable)


def test_exponents_travel_and_a_state_exported_before_them_imports_with_exponent_zero(exported_once, tmp_path):
    """A packed state exported before the per-matrix exponents (the identity without them, codes
    alone) imports into torch and JAX with every exponent 0, its codes as saved: the values they
    had. A state of today's identity without its exponents, or with one a step never stores, is
    refused naming the tensor; a batched JAX leaf exports one exponent per matrix."""
    weights, params, portable = exported_once
    fmt = PackedMuon([torch.nn.Parameter(torch.ones(2, 2))]).state_format
    legacy = PortableState(MIXED, list(portable.counts), [m.copy() for m in portable.moments],
                           portable.low_halves, [fmt.legacy_identity if f == fmt.identity else f
                                                 for f in portable.formats])
    legacy.save(tmp_path / "old.safetensors")
    legacy = PortableState.load(tmp_path / "old.safetensors")
    assert legacy.exponents is None
    opt = torch_optimizer(torch_params(weights))
    opt.import_state(legacy)
    for i in MUON:
        p = opt.param_groups[0]["params"][MUON.index(i)]
        assert int(opt.state[p]["mu_exponent"]) == 0 and opt.state[p]["mu_exponent"].dtype == torch.int32
        assert np.array_equal(opt.state[p]["momentum_code"].numpy().view(np.uint16), portable.moments[i])
    state = import_muon_state(legacy, jax_params_from(params), **jax_args("packed"))
    assert [int(state.exponents[i]) for i in MUON] == [0] * len(MUON)
    assert [np.array_equal(bits(state.momentum[i]).T, portable.moments[i]) for i in MUON] == [True] * len(MUON)

    damaged = PortableState(MIXED, portable.counts, portable.moments, portable.low_halves, portable.formats,
                            [None] * len(PARAMS))
    with pytest.raises(ValueError, match=r"tensor 0 \('wide'\) \(muon-packed:mu=SE5M10b31:scale=pow2/matrix\) needs "
                                         r"its matrices' int32 exponents of shape \(\) .*, got none"):
        opt.import_state(damaged)
    for bad, message in ((np.int32(129), r"tensor 0 .*: exponents\[0\] is 129, outside the \[-148, 128\]"),
                         (np.int32(-300), r"tensor 0 .*: exponents\[0\] is -300, outside the \[-148, 128\]"),
                         (np.zeros(2, np.int32), r"int32 exponents of shape \(\) .*, got int32 \(2,\)")):
        damaged.exponents = [np.asarray(bad) if i == 0 else e for i, e in enumerate(portable.exponents)]
        with pytest.raises(ValueError, match=message):
            import_muon_state(damaged, jax_params_from(params), **jax_args("packed"))
    damaged.exponents = list(portable.exponents)
    damaged.exponents[0] = np.int32(128)  # in range, but the largest codes times 2**128 are Inf
    damaged.moments = [m.copy() for m in portable.moments]
    damaged.moments[0][0, 0] = 0x7C00
    with pytest.raises(ValueError, match=r"tensor 0 \('wide'\) .*: exponents\[0\] is 128, under which the momentum "
                                         "holds NaN or Inf"):
        opt.import_state(damaged)

    # A batched leaf: one exponent per matrix, in torch's [batch, out, in] order.
    rng = np.random.default_rng(5)
    stack = {"stack": jnp.asarray((rng.standard_normal((3, 6, 10)) * 0.2).astype(np.float32))}
    dims = {"stack": MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
    base = rng.standard_normal((6, 10)).astype(np.float32)  # one gradient, three scales
    grads = {"stack": jnp.asarray(base * np.float32(2.0) ** np.array([-20, 0, 20], np.float32)[:, None, None])}
    stack, jstate = packed_muon_fused_step(LR, muon_weight_dimension_numbers=dims)(
        stack, grads, packed_muon(LR, muon_weight_dimension_numbers=dims).init(stack))
    out = export_muon_state(jstate, stack, muon_weight_dimension_numbers=dims)
    assert out.exponents[0].shape == (3,)
    assert out.exponents[0].tolist() == np.asarray(jstate.exponents["stack"]).tolist()
    assert np.diff(out.exponents[0]).tolist() == [20, 20]  # each matrix its own scale
    assert np.array_equal(out.moments[0][0], out.moments[0][2])  # and the same codes
    back = import_muon_state(out, stack, muon_weight_dimension_numbers=dims)
    assert np.array_equal(np.asarray(back.exponents["stack"]), np.asarray(jstate.exponents["stack"]))


def own_format_optimizer(params, own: bool = True) -> PackedMuonAdamW:
    """PARAMS in groups of their own state format: fp32 Muon ('tall') and fp32 AdamW ('gain',
    'bias') beside packed groups of each rule, when `own`; all packed otherwise."""
    fp32 = {"mode": "fp32"} if own else {}
    named = dict(zip((name for name, _, _, _ in PARAMS), params))

    def group(kind, names, **options):
        return {"params": [named[n] for n in names], "param_names": list(names), "kind": kind, **options}

    return PackedMuonAdamW([group("muon", ("wide", "square")), group("muon", ("tall",), **fp32),
                            group("adamw", ("embed",)), group("adamw", ("gain", "bias"), **fp32)],
                           lr=LR, weight_decay=WD, momentum=BETA, adamw_lr=ADAM_LR, adamw_weight_decay=ADAM_WD)


def test_groups_of_their_own_state_format_export_and_import_each_tensor_in_its_format(tmp_path):
    """Each tensor travels in its group's format ("mixed"); a fresh optimizer over the same groups
    imports it bit for bit and then steps as the exporting one. One whose groups keep other
    formats is refused naming the parameter, and a bad count in the second AdamW format's tensors
    is refused before the first format's tensors change anything."""
    weights, grads = problem(seed=41, steps=4)
    params, twin = torch_params(weights), torch_params(weights)
    opt = own_format_optimizer(params)
    for g in grads[:2]:
        torch_step(opt, params, g)
    exported = opt.export_state()
    order = ["wide", "square", "tall", "embed", "gain", "bias"]  # param_groups flattened
    assert exported.format == MIXED and exported.tensor_formats() == [
        "muon-packed:mu=SE5M10b31:scale=pow2/matrix", "muon-packed:mu=SE5M10b31:scale=pow2/matrix",
        "muon-fp32:mu=f32", "packed:m=SE4M11b15,rms=UE4M12b15", "fp32:m=f32,v=f32", "fp32:m=f32,v=f32"]
    assert exported.counts == [None, None, None, 2, 2, 2]
    exported.save(tmp_path / "own.safetensors")
    portable = PortableState.load(tmp_path / "own.safetensors")
    imported = own_format_optimizer(twin)
    imported.import_state(portable)
    with torch.no_grad():  # the weights travel apart from the state
        for p, q in zip(params, twin):
            q.copy_(p)
    assert_same_tensors(imported.export_state(), exported, "imported")
    by_name = [dict(zip((n for n, _, _, _ in PARAMS), ps)) for ps in (params, twin)]
    for g in grads[2:]:
        torch_step(opt, params, g)
        torch_step(imported, twin, g)
        assert_same_tensors(imported.export_state(), opt.export_state(), "stepped on")
        for name in order:
            a, b = (named[name].detach() for named in by_name)
            assert torch.equal(a.view(torch.int16) if a.dtype is BF16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype is BF16 else b.view(torch.int32)), name

    packed = own_format_optimizer(torch_params(weights), own=False)
    with pytest.raises(ValueError, match=r"tensor 2 \('tall'\) has format 'muon-fp32:mu=f32', the optimizer's "
                                         r"'muon-packed"):
        packed.import_state(portable)
    assert not packed.state
    portable.counts[5] = -1  # 'bias', in the fp32 AdamW rule, which imports after the packed one
    before = opt.export_state()
    with pytest.raises(ValueError, match=r"tensor 1 \('bias'\): step count -1"):
        opt.import_state(portable)
    assert_same_tensors(opt.export_state(), before, "after a refused import")
