"""`packed_muon` (jax_frontend/muon.py, docs/MUON.md "JAX / optax") on the CPU: its Muon
leaves against the contract's numpy phases (bit for bit around its own Newton-Schulz), against
torch.optim.Muon (momentum bit for bit, weights within the measured Newton-Schulz tolerance),
its AdamW leaves against packed_adamw alone, its state, jit, refusals."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

from muon_helpers import fused_torch  # noqa: E402
from packed_adamw.core.muon import (  # noqa: E402
    StateFormat,
    momentum_phase,
    step_scalar_row,
    weight_phase,
    weight_phase_split,
)
from packed_adamw.jax import RefusedStepWarning, packed_adamw  # noqa: E402
from packed_adamw.jax.muon import (  # noqa: E402
    PackedMuonState,
    export_muon_state,
    import_muon_state,
    newton_schulz,
    packed_muon,
    packed_muon_fused_step,
)
from packed_adamw.jax import _muon_step  # noqa: E402
from layout import REPO

F32 = np.float32
LR, BETA, WD, EPS = 0.02, 0.95, 0.1, 1e-7
COEFFICIENTS, STEPS = (3.4445, -4.775, 2.0315), 5
# |O_jax - O_torch| measured on the CPU (jax 0.10.2 against torch 2.13; docs/MUON.md, "JAX /
# optax"): equal bits up to 33 x 17, then at most 2**-7 (two bf16 ulps below 1) up to
# 512 x 512 and 256 x 1024. The tests allow twice that.
NS_TOLERANCE = 2.0 ** -6


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def gradient(rng, shape, low=-12, high=0):
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(low, high, shape)).astype(F32)


def make_params(rng, bf16=False):
    """[in, out] kernels: tall, wide and square in torch's layout; a bias and a scalar."""
    w = lambda shape: jnp.asarray((rng.standard_normal(shape) * 0.2).astype(F32))  # noqa: E731
    params = {"tall": w((6, 14)), "wide": w((14, 5)), "square": w((8, 8)), "bias": w((14,)), "scale": w(())}
    if bf16:
        params["tall"] = params["tall"].astype(jnp.bfloat16)
    return params


def make_grads(rng, params):
    return jax.tree.map(lambda p: jnp.asarray(gradient(rng, p.shape)), params)


def jax_ns(x_bits):
    """Our Newton-Schulz of an [in, out] matrix given as bf16 bits."""
    return bits(newton_schulz(jnp.asarray(x_bits).view(jnp.bfloat16), COEFFICIENTS, STEPS, EPS))


def torch_ns(x_bits):
    """torch.optim.Muon's own Newton-Schulz (private: the oracle's) of the same [in, out]
    matrix, run on its [out, in] transpose as torch holds the layer."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.from_numpy(np.ascontiguousarray(x_bits.T).view(np.int16)).view(torch.bfloat16)
    return _zeropower_via_newtonschulz(x, COEFFICIENTS, STEPS, EPS).view(torch.int16).numpy().view(np.uint16).T


class Reference:
    """The contract on one [in, out] float32 or bf16 kernel: numpy phases around `ns`; the
    learning-rate ratio of torch's [out, in] layout."""

    def __init__(self, p, fmt, ns, nesterov=True, adjust_lr_fn=None, lr=LR):
        self.fmt, self.ns, self.nesterov = fmt, ns, nesterov
        self.bf16 = p.dtype == jnp.bfloat16
        self.p = np.array(p).view(np.uint16).copy() if self.bf16 else np.array(p, F32)
        self.lo = np.zeros(p.shape, np.int16)
        self.state = np.zeros(p.shape, np.dtype(fmt.state_dtype))
        self.exponent = np.zeros((), np.int32) if fmt.mode == "packed" else None
        self.scalars = step_scalar_row((lr, BETA, WD, EPS), p.shape[::-1], adjust_lr_fn=adjust_lr_fn)

    def step(self, g):
        x = momentum_phase(np.asarray(g), self.state, self.scalars, fmt=self.fmt, exponent=self.exponent,
                           nesterov=self.nesterov)
        assert x is not None
        ortho = self.ns(x)
        if self.bf16:
            assert weight_phase_split(self.p, self.lo, ortho, self.scalars) == 0
        else:
            assert weight_phase(self.p, ortho, self.scalars) == 0


MUON_LEAVES = ("tall", "wide", "square")


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """packed_muon's CUDA lowering on the CPU: `_muon_step.KERNELS_EVERYWHERE` runs core/muon's
    kernels, each launch in Triton's CPU interpreter through jax_helpers' jax-triton stand-in (a
    host callback where the step is compiled), which it yields. The steps compiled meanwhile are
    dropped before and after, so none bound to another test's stand-in (or to other launch sizes)
    is reused."""
    from conftest import interpreting
    from jax_helpers import InterpretedJaxTriton

    if not interpreting():
        pytest.skip("runs the kernels in Triton's CPU interpreter")
    from packed_adamw.jax import _muon_step, _muon_triton, _step

    stand_in = InterpretedJaxTriton()
    monkeypatch.setattr(_muon_triton, "_jax_triton", lambda: stand_in)
    monkeypatch.setattr(_muon_step, "KERNELS_EVERYWHERE", True)
    _step._jitted.cache_clear()
    jax.clear_caches()
    yield stand_in
    _step._jitted.cache_clear()
    jax.clear_caches()


@pytest.mark.parametrize("mode", ["fp32", "packed", "bf16"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("nesterov,adjust_lr_fn", [(True, None), (False, "match_rms_adamw")])
def test_muon_leaves_take_the_contracts_step_bit_for_bit(mode, jit, nesterov, adjust_lr_fn):
    """The fused step's new weights and the momenta equal the numpy phases around the same
    jax.numpy Newton-Schulz, bit for bit, over three steps."""
    rng = np.random.default_rng(3)
    params = make_params(rng)
    fmt = StateFormat(mode)
    step = packed_muon_fused_step(LR, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, mode=mode)
    step = jax.jit(step) if jit else step
    state = packed_muon(LR, mode=mode).init(params)
    refs = {k: Reference(params[k], fmt, jax_ns, nesterov, adjust_lr_fn) for k in MUON_LEAVES}
    for _ in range(3):
        grads = make_grads(rng, params)
        params, state = step(params, grads, state)
        for k in MUON_LEAVES:
            refs[k].step(grads[k])
            assert np.array_equal(bits(params[k]), bits(refs[k].p)), k
            assert np.array_equal(bits(state.momentum[k]), bits(refs[k].state)), k
            if mode == "packed":  # one int32 exponent a matrix
                assert state.exponents[k].dtype == jnp.int32 and state.exponents[k].shape == ()
                assert int(state.exponents[k]) == int(refs[k].exponent), k
            else:
                assert state.exponents is None
    assert int(state.count) == 3


@pytest.mark.parametrize("jit", [False, True])
def test_updates_give_the_new_weights_where_a_float32_update_can(jit):
    """optax.apply_updates(p, u) is the contract's new weight except where p' - p is inexact in
    float32 and its rounding misses p'; there no float32 u gives p' (its neighbours checked
    too) and the weight lands within an ulp of u. Such elements are rare but present."""
    rng = np.random.default_rng(5)
    params = make_params(rng)
    tx = packed_muon(LR, mode="fp32")
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    missed = total = 0
    for _ in range(3):
        grads = make_grads(rng, params)
        contract, _ = packed_muon_fused_step(LR, mode="fp32")(params, grads, state)
        updates, state = update(grads, state, params)
        applied = optax.apply_updates(params, updates)
        for k in MUON_LEAVES:
            p, want, got = np.asarray(params[k]), np.asarray(contract[k]), np.asarray(applied[k])
            miss = bits(got) != bits(want)
            u = (want - p).astype(F32)
            for candidate in (u, np.nextafter(u, F32(np.inf)), np.nextafter(u, F32(-np.inf))):
                assert not np.any(miss & (bits((p + candidate).astype(F32)) == bits(want))), k
            # apply_updates rounds p + u once more: off by at most half an ulp of u (plus half of p').
            assert np.all((np.abs(got - want) <= np.spacing(np.abs(u)))[miss]), k
            missed, total = missed + int(miss.sum()), total + miss.size
        params = applied
    assert 0 < missed < total // 20  # present (the checks above ran), and rare here


@pytest.mark.parametrize("jit", [False, True])
def test_bf16_muon_leaves_keep_exact_masters(jit):
    """A bf16 kernel steps its FP32 master (weight + low half) as the contract's split phase;
    the update gives the new bf16 weight through apply_updates."""
    rng = np.random.default_rng(7)
    params = make_params(rng, bf16=True)
    tx = packed_muon(LR)
    state = tx.init(params)
    assert state.low_halves["tall"].dtype == jnp.int16 and isinstance(state.low_halves["wide"], optax.MaskedNode)
    ref = Reference(params["tall"], StateFormat("packed"), jax_ns)
    update = jax.jit(tx.update) if jit else tx.update
    for _ in range(3):
        grads = make_grads(rng, params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref.step(grads["tall"])
        assert params["tall"].dtype == jnp.bfloat16
        assert np.array_equal(bits(params["tall"]), ref.p)
        assert np.array_equal(bits(state.low_halves["tall"]), bits(ref.lo))


@fused_torch
@pytest.mark.parametrize("shape", [(6, 14), (14, 5), (8, 8), (48, 160)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fp32_mode_against_torch_optim_muon(shape, nesterov):
    """torch.optim.Muon on the transposed ([out, in]) matrix: the momentum is the same bits
    (the momentum phase reads only gradients); the weights differ only through Newton-Schulz
    (XLA's GEMMs against torch's), within NS_TOLERANCE * adjusted lr per step."""
    rng = np.random.default_rng(sum(shape))
    p0 = (rng.standard_normal(shape) * 0.2).astype(F32)
    torch_param = torch.nn.Parameter(torch.from_numpy(p0.T.copy()))
    opt = torch.optim.Muon([torch_param], lr=LR, momentum=BETA, weight_decay=WD, nesterov=nesterov, eps=EPS,
                           ns_coefficients=COEFFICIENTS, ns_steps=STEPS)
    step = packed_muon_fused_step(LR, nesterov=nesterov, mode="fp32")
    params = {"w": jnp.asarray(p0)}
    state = packed_muon(LR, mode="fp32").init(params)
    adjusted = LR * max(1.0, shape[1] / shape[0]) ** 0.5
    for n in range(1, 5):
        g = gradient(rng, shape)
        torch_param.grad = torch.from_numpy(g.T.copy())
        opt.step()
        params, state = step(params, {"w": jnp.asarray(g)}, state)
        assert np.array_equal(bits(state.momentum["w"]), bits(opt.state[torch_param]["momentum_buffer"].numpy().T))
        gap = np.abs(np.asarray(params["w"]) - torch_param.detach().numpy().T).max()
        assert gap <= n * adjusted * NS_TOLERANCE * 1.01, gap


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (8, 8), (64, 256), (256, 64), (128, 128)])
def test_newton_schulz_is_within_the_stated_tolerance_of_torchs(shape):
    rng = np.random.default_rng(sum(shape))
    x = torch.from_numpy(gradient(rng, shape)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    ours = np.asarray(jnp.asarray(jax_ns(x)).view(jnp.bfloat16).astype(jnp.float32))
    theirs = torch.from_numpy(torch_ns(x).view(np.int16)).view(torch.bfloat16).float().numpy()
    assert ours.shape == shape and np.abs(theirs).max() < 2
    assert np.abs(ours - theirs).max() <= NS_TOLERANCE


@pytest.mark.parametrize("mode,nbytes", [("packed", 2), ("bf16", 2), ("fp32", 4)])
def test_state_holds_one_momentum_entry_per_muon_element(mode, nbytes):
    params = make_params(np.random.default_rng(0))
    state = packed_muon(LR, mode=mode).init(params)
    for k in MUON_LEAVES:
        m = state.momentum[k]
        assert m.shape == params[k].shape and m.dtype == (jnp.uint16 if nbytes == 2 else jnp.float32)
        assert m.nbytes == nbytes * params[k].size
        # packed mode adds one int32 exponent per matrix (4 bytes a matrix, not an element's)
        if mode == "packed":
            assert state.exponents[k].shape == () and state.exponents[k].dtype == jnp.int32
    assert isinstance(state.momentum["bias"], optax.MaskedNode) and state.low_halves is None
    assert (state.exponents is None) == (mode != "packed")
    if mode == "packed":
        assert isinstance(state.exponents["bias"], optax.MaskedNode)


@pytest.mark.parametrize("jit", [False, True])
def test_other_leaves_take_packed_adamws_bits(jit):
    """Non-2-D leaves get packed_adamw's updates and state, as packed_adamw alone on them."""
    rng = np.random.default_rng(11)
    params = make_params(rng)
    kw = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05)
    tx = packed_muon(LR, adam_learning_rate=3e-3, adam_b1=kw["b1"], adam_b2=kw["b2"], adam_eps=kw["eps"],
                     adam_weight_decay=kw["weight_decay"])
    alone = packed_adamw(3e-3, **kw)
    others = lambda tree: {k: tree[k] for k in ("bias", "scale")}  # noqa: E731
    update = jax.jit(tx.update) if jit else tx.update
    state, alone_state = tx.init(params), alone.init(others(params))
    for _ in range(3):
        grads = make_grads(rng, params)
        updates, state = update(grads, state, params)
        alone_updates, alone_state = alone.update(others(grads), alone_state, others(params))
        for k in ("bias", "scale"):
            assert np.array_equal(bits(updates[k]), bits(alone_updates[k])), k
            assert np.array_equal(bits(state.adamw.inner_state.moments[k]), bits(alone_state.moments[k])), k
        params = optax.apply_updates(params, updates)


def test_dimension_numbers_pick_muon_leaves_and_batch_their_matrices():
    """A 3-D leaf with a batch axis steps each matrix as a 2-D leaf of that shape would; a leaf
    given None goes to AdamW."""
    rng = np.random.default_rng(13)
    stack = jnp.asarray((rng.standard_normal((3, 6, 10)) * 0.2).astype(F32))
    params = {"stack": stack, "kept": jnp.asarray((rng.standard_normal((4, 4))).astype(F32))}
    dims = {"stack": MuonDimensionNumbers(reduction_axis=1, output_axis=2), "kept": None}
    step = packed_muon_fused_step(LR, muon_weight_dimension_numbers=dims)
    state = packed_muon(LR, muon_weight_dimension_numbers=dims).init(params)
    assert isinstance(state.momentum["kept"], optax.MaskedNode) and state.momentum["stack"].shape == (3, 6, 10)
    assert state.exponents["stack"].shape == (3,) and isinstance(state.exponents["kept"], optax.MaskedNode)
    single = packed_muon_fused_step(LR)
    slices = {str(b): stack[b] for b in range(3)}
    single_state = packed_muon(LR).init(slices)
    for _ in range(2):
        g = jnp.asarray(gradient(rng, (3, 6, 10)))
        params, state = step(params, {"stack": g, "kept": jnp.ones((4, 4), jnp.float32)}, state)
        slices, single_state = single(slices, {str(b): g[b] for b in range(3)}, single_state)
        for b in range(3):
            assert np.array_equal(bits(params["stack"][b]), bits(slices[str(b)]))
            assert int(state.exponents["stack"][b]) == int(single_state.exponents[str(b)])  # each matrix its own
    assert not np.array_equal(bits(state.adamw.inner_state.moments["kept"]), np.zeros((4, 4), np.uint32))


def test_a_non_finite_gradient_refuses_its_matrix_only():
    rng = np.random.default_rng(17)
    params = make_params(rng)
    tx = packed_muon(LR)
    state = tx.init(params)
    grads = make_grads(rng, params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    grads = make_grads(rng, params)
    grads["wide"] = grads["wide"].at[2, 3].set(jnp.nan)
    updates, new_state = tx.update(grads, state, params)
    assert np.all(bits(updates["wide"]) == 0x80000000)  # -0.0 everywhere: the weight stays
    assert np.array_equal(bits(new_state.momentum["wide"]), bits(state.momentum["wide"]))
    assert int(new_state.exponents["wide"]) == int(state.exponents["wide"])
    assert not np.array_equal(bits(new_state.momentum["tall"]), bits(state.momentum["tall"]))


@pytest.mark.parametrize("path", ["cpu", "interpreted gpu", pytest.param("gpu", marks=pytest.mark.cuda)])
def test_a_newton_schulz_output_that_is_not_finite_refuses_the_matrix_whole(path, request):
    """Coefficients that pass validation but overflow (1e20 each) make Newton-Schulz's output
    Inf/NaN from finite inputs: every Muon matrix is refused whole (update -0.0, momentum codes
    and exponent kept), as for a NaN gradient, while the AdamW leaves step. Before, the momentum
    advanced while every weight element was rejected. On the CPU's numpy phases and through the
    GPU path's kernels (_muon_triton.py) in Triton's CPU interpreter, and compiled on a GPU."""
    if path == "gpu" and _cuda_reason() is not None:
        pytest.skip(f"needs CUDA for JAX plus jax_triton: {_cuda_reason()}")
    if path == "interpreted gpu":
        request.getfixturevalue("interpreted_kernels")
    rng = np.random.default_rng(19)
    params = make_params(rng)
    tx = packed_muon(LR, ns_coeffs=(1e20, 1e20, 1e20), ns_steps=2)
    state = tx.init(params)
    for _ in range(2):
        updates, new_state = tx.update(make_grads(rng, params), state, params)
        for name in ("tall", "wide", "square"):
            assert np.all(bits(updates[name]) == 0x80000000), name  # -0.0 everywhere: the weight stays
            assert np.array_equal(bits(new_state.momentum[name]), bits(state.momentum[name])), name
            assert int(new_state.exponents[name]) == int(state.exponents[name]), name
        assert not np.all(bits(updates["bias"]) == 0x80000000)  # the AdamW half steps
        params, state = optax.apply_updates(params, updates), new_state


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(learning_rate=-1.0), ValueError, "Learning rate"),
    (dict(beta=1.0), ValueError, "momentum should be below 1"),
    (dict(eps=0.0), ValueError, "eps should be > 0"),
    (dict(weight_decay=-0.1), ValueError, "weight decay"),
    (dict(ns_steps=0), ValueError, "ns_steps=0"),
    (dict(ns_coeffs=(1.0, 2.0)), ValueError, "exactly 3"),
    (dict(adjust_lr_fn="rms"), ValueError, "adjust_lr_fn"),
    (dict(mode="fp16"), ValueError, "mode='fp16'"),
    (dict(mu_bias=200), ValueError, "mu_bias=200"),
    (dict(nesterov="yes"), TypeError, "nesterov"),
    (dict(adam_b1=1.5), ValueError, "b1"),
    # Not numbers: each named, with what it takes (a schedule only where the step reads one).
    (dict(weight_decay=None), TypeError, "weight_decay=None is not a number.*or a schedule"),
    (dict(beta=jnp.full((3,), 0.9)), TypeError, "beta=.* is not a number"),
    (dict(learning_rate="0.02"), TypeError, "learning_rate='0.02' is not a number"),
    (dict(adam_eps=None), TypeError, "adam_eps=None is not a number"),
    (dict(adam_b1=lambda count: 0.9), TypeError, "adam_b1 is a schedule.*learning rate only.*inject_hyperparams"),
    (dict(adam_b2=lambda count: 0.99), TypeError, "adam_b2 is a schedule"),
    (dict(adam_eps=lambda count: 1e-8), TypeError, "adam_eps is a schedule"),
    (dict(adam_weight_decay=lambda count: 0.01), TypeError, "adam_weight_decay is a schedule"),
    # The rules' words are torch's and packed_adamw's: the message says which argument they mean.
    (dict(beta=1.0), ValueError, "^packed_muon: momentum should be below 1.*momentum is beta"),
    (dict(adam_learning_rate=-1.0), ValueError, "^packed_muon: the AdamW half refused.*adam_learning_rate"),
    # A bool is not a number (it stepped with 1.0, in packed_adamw too).
    (dict(learning_rate=True), TypeError, "learning_rate=True is a bool"),
    (dict(weight_decay=np.bool_(True)), TypeError, "weight_decay=.*is a bool"),
    # An int past a float's range is refused by its bound, naming it (it raised a bare OverflowError).
    (dict(learning_rate=10**400), ValueError, "^packed_muon: Learning rate should be >= 0 but is: inf"),
    (dict(adam_weight_decay=10**400), ValueError, "^packed_muon: the AdamW half.*weight_decay=inf"),
    (dict(ns_coeffs=(10**400, 0.0, 0.0)), ValueError, "a coefficient is not finite"),
])
def test_bad_hyperparameters_are_refused_when_built(kwargs, error, message):
    kwargs = {"learning_rate": LR, **kwargs}
    with pytest.raises(error, match=message):
        packed_muon(**kwargs)
    if kwargs["learning_rate"] is True:
        with pytest.raises(TypeError, match="packed_adamw: learning_rate=True is a bool"):
            packed_adamw(True)


def test_misuse_found_by_a_review_is_refused_naming_what_to_do():
    """A gradient of another shape than its parameter (it stepped a matrix of that shape and the
    update reshaped the parameter) or of another tree; a tree without Muon leaves with a damaged
    count or another tree's Muon entries (the Muon checks were skipped there); master_weights of
    a Muon state (it misread it); the export of a damaged state (it wrote a file every import
    refuses)."""
    rng = np.random.default_rng(31)
    params = make_params(rng)
    tx = packed_muon(LR)
    state = tx.init(params)
    grads = make_grads(rng, params)
    with pytest.raises(ValueError, match=r"grads leaf \['wide'\] has shape \(5, 14\), but its parameter has \(14, 5\)"):
        tx.update({**grads, "wide": grads["wide"].T}, state, params)
    with pytest.raises(ValueError, match="the gradients' tree is not the parameters'"):
        tx.update({"other": grads["bias"]}, state, params)
    no_matrices = {"bias": params["bias"]}
    alone = tx.init(no_matrices)
    with pytest.raises(ValueError, match="step count is -3"):
        tx.update({"bias": grads["bias"]}, alone._replace(count=jnp.int32(-3)), no_matrices)
    with pytest.raises(ValueError, match="momentum does not have the parameters' tree"):
        tx.update({"bias": grads["bias"]}, alone._replace(momentum=state.momentum), no_matrices)
    # A count of shape (1,) spread its shape to the next state; a float32 one stops moving at 2**24.
    for transform, words in ((tx, "packed_muon"), (packed_adamw(LR), "packed_adamw")):
        for count in (jnp.zeros((1,), jnp.int32), jnp.float32(0)):
            with pytest.raises(TypeError, match=f"{words}: the state's step count is .*; a count is an int32 scalar"):
                transform.update(grads, transform.init(params)._replace(count=count), params)
    from packed_adamw.jax import master_weights
    with pytest.raises(ValueError, match="master_weights: the state is packed_muon's"):
        master_weights(params, state)
    _, stepped = tx.update(grads, state, params)
    with pytest.raises(ValueError, match="outside the"):
        export_muon_state(stepped._replace(exponents={**stepped.exponents, "wide": jnp.int32(500)}), params)
    for mode, nan in (("fp32", jnp.nan), ("bf16", jnp.uint16(0x7FC0))):  # a float32 NaN, a bf16 NaN code
        tx_mode = packed_muon(LR, mode=mode)
        _, mode_state = tx_mode.update(grads, tx_mode.init(params), params)
        damaged = mode_state._replace(momentum={**mode_state.momentum,
                                                "tall": mode_state.momentum["tall"].at[0, 0].set(nan)})
        # refused by the export (no file any import refuses) and by an eager step (no matrix frozen for good)
        for refusing in (lambda: export_muon_state(damaged, params, mode=mode),
                         lambda: tx_mode.update(grads, damaged, params)):
            with pytest.raises(ValueError, match=r"momentum of leaf \['tall'\] holds NaN or Inf.*restore it"):
                refusing()


def test_guards_of_the_second_hostile_pass_hold_for_both_transforms():
    """What a hostile pass found packed_muon (or packed_adamw) lacking: an export refuses a count
    no import takes (it wrote files every import refuses; packed_muon's AdamW half too); a
    schedule's value must be a real number of shape () (True stepped with lr 1.0); a state of
    another type is refused by name; optax's tree_map_params sees only the parameters' trees as
    parameter-like (packed_muon's exponents were taken for one; bfloat16 failed); format_stats of
    a Muon state says packed_muon counts nothing; a float or bool axis and the state format are
    refused in packed_muon's words."""
    import optax

    from packed_adamw.jax import export_state, format_stats

    rng = np.random.default_rng(41)
    params = make_params(rng)
    grads = make_grads(rng, params)
    muon, adamw = packed_muon(LR), packed_adamw(LR)
    _, stepped = muon.update(grads, muon.init(params), params)
    inner = stepped.adamw.inner_state
    for damaged, what in ((stepped._replace(count=jnp.int32(-1)), "Muon "),
                          (stepped._replace(adamw=stepped.adamw._replace(inner_state=inner._replace(
                              count=jnp.int32(-1)))), "AdamW half's ")):
        with pytest.raises(ValueError, match=f"^export_muon_state: the state's {what}step count is -1, .*no import"):
            export_muon_state(damaged, params)
    _, adamw_state = adamw.update(grads, adamw.init(params), params)
    with pytest.raises(ValueError, match="^export_state: the state's step count is -1"):
        export_state(adamw_state._replace(count=jnp.int32(-1)), "packed")
    for name, make in (("packed_muon", packed_muon), ("packed_adamw", packed_adamw)):
        for schedule, got in ((lambda count: count >= 0, "bool of shape \\(\\)"),
                              (lambda count: jnp.full((1,), LR), "float32 of shape \\(1,\\)")):
            tx = make(schedule)
            with pytest.raises(TypeError, match=f"^{name}: the schedule given as learning_rate returned {got}"):
                jax.jit(tx.update)(grads, tx.init(params), params)
    for tx, other, name in ((adamw, stepped, "packed_adamw"), (muon, adamw_state, "packed_muon")):
        with pytest.raises(TypeError, match=f"^{name}: the state is a {type(other).__name__}; pass the state init"):
            tx.update(grads, other, params)
    with pytest.raises(TypeError, match="^export_state: the state is a PackedMuonState"):
        export_state(stepped, "packed")
    with pytest.raises(ValueError, match="^format_stats: this is packed_muon's state, .*counts no format events"):
        format_stats(stepped)
    for bf16 in (False, True):
        tree = make_params(np.random.default_rng(41), bf16=bf16)
        state = muon.init(tree)
        marked = optax.tree_utils.tree_map_params(muon, lambda p: f"param {jnp.shape(p)}", state,
                                                  transform_non_params=lambda _: "other")
        assert sorted(jax.tree_util.tree_leaves(marked.momentum)) == sorted(
            f"param {p.shape}" for p in tree.values() if jnp.ndim(p) == 2)
        assert all(x == "other" for x in jax.tree_util.tree_leaves((marked.count, marked.low_halves,
                                                                    marked.exponents)))
    for axes in (MuonDimensionNumbers(np.array([0]), range(1, 2)), MuonDimensionNumbers(jnp.int32(0), np.int64(1))):
        tx = packed_muon(LR, muon_weight_dimension_numbers={k: axes if jnp.ndim(p) == 2 else None
                                                            for k, p in params.items()})
        assert jax.tree_util.tree_structure(tx.init(params)) == jax.tree_util.tree_structure(muon.init(params))
    for axes in (MuonDimensionNumbers(0.0, 1), MuonDimensionNumbers(True, 1)):
        tx = packed_muon(LR, muon_weight_dimension_numbers={k: axes if jnp.ndim(p) == 2 else None
                                                            for k, p in params.items()})
        with pytest.raises(ValueError, match=r"^packed_muon: leaf \['\w+'\] \(rank 2\) has reduction_axis="):
            tx.init(params)
    with pytest.raises(ValueError, match="^packed_muon: mode='fp8' is not one of"):
        packed_muon(LR, mode="fp8")


def test_a_state_whose_low_halves_do_not_fit_the_leaves_is_refused_naming_the_leaf():
    """packed_muon's low halves are checked by packed_adamw's check (test_jax_split_master.py): a
    bfloat16 Muon leaf given a state built for float32 leaves, a float32 leaf given a bfloat16
    leaf's state, a low half of another dtype, low halves of another tree; each refused naming
    the leaf before anything steps, by update and by export_muon_state."""
    rng = np.random.default_rng(37)
    params, bf16 = make_params(rng), make_params(np.random.default_rng(37), bf16=True)
    tx = packed_muon(LR)
    grads = make_grads(rng, params)
    f32_state, bf16_state = tx.init(params), tx.init(bf16)
    wrong_dtype = bf16_state._replace(low_halves={**bf16_state.low_halves,
                                                  "tall": bf16_state.low_halves["tall"].astype(jnp.int32)})
    cases = [
        (f32_state, bf16, r"params leaf \['tall'\] is bfloat16 but the state has no low halves"),
        (bf16_state, params, r"holds a low half for params leaf \['tall'\] .* the leaf is float32, not a bfloat16 Muon leaf"),
        (wrong_dtype, bf16, r"the low half of leaf \['tall'\] is int32 \(6, 14\), expected int16 \(6, 14\)"),
        (bf16_state._replace(low_halves={"tall": bf16_state.low_halves["tall"]}), bf16,
         "low halves do not have the parameters' tree"),
    ]
    for state, leaves, message in cases:
        with pytest.raises(ValueError, match=message):
            tx.update(grads, state, leaves)
        with pytest.raises(ValueError, match=message):
            export_muon_state(state, leaves)


def test_a_schedule_turning_invalid_is_refused_eagerly_and_in_the_graph(refusal_callback):
    params = make_params(np.random.default_rng(19))
    tx = packed_muon(lambda count: jnp.where(count >= 1, -1.0, LR))
    state = tx.init(params)
    grads = make_grads(np.random.default_rng(20), params)
    _, state = tx.update(grads, state, params)
    with pytest.raises(ValueError, match="Learning rate"):
        tx.update(grads, state, params)
    with pytest.warns(RefusedStepWarning, match="Learning rate"):
        updates, refused = jax.jit(tx.update)(grads, state, params)
        jax.block_until_ready(updates)
    assert int(refused.count) == 1
    for k in MUON_LEAVES:
        assert np.all(bits(updates[k]) == 0x80000000)
        assert np.array_equal(bits(refused.momentum[k]), bits(state.momentum[k]))
    # An effect would cost the jitted step JAX's C++ dispatch path: none on an accelerator host,
    # where the warning is a pure callback that the step reads, so keeping only the updates keeps it.
    assert bool(jax.make_jaxpr(tx.update)(grads, state, params).effects) != refusal_callback
    with pytest.warns(RefusedStepWarning, match="Learning rate"):
        jax.block_until_ready(jax.jit(lambda g, s, p: tx.update(g, s, p)[0])(grads, state, params))
        jax.effects_barrier()


@pytest.mark.parametrize("jit, refusal_callback", [(False, "debug callback"), (True, "debug callback"),
                                                   (True, "pure callback")], indirect=["refusal_callback"])
def test_a_negative_count_refuses_the_step_eagerly_and_warns_under_jit(jit, refusal_callback):
    """A damaged count (here -3, with plain-number hyperparameters, so nothing else is known only
    in the graph) refuses the step: eagerly a ValueError, under jit a RefusedStepWarning naming
    the count (transform.py's `_report_refusal`); nothing changes, the AdamW half's leaves and
    state neither (one transform's step is all or nothing)."""
    params = make_params(np.random.default_rng(31))
    tx = packed_muon(LR)
    state = tx.init(params)
    state = state._replace(count=jnp.asarray(-3, jnp.int32))
    grads = make_grads(np.random.default_rng(32), params)
    if not jit:
        with pytest.raises(ValueError, match="packed_muon: .*count -3.*step count is -3"):
            tx.update(grads, state, params)
        return
    with pytest.warns(RefusedStepWarning, match="packed_muon: step refused at count -3: the state's step count is -3"):
        updates, refused = jax.jit(tx.update)(grads, state, params)
        jax.block_until_ready(updates)
        jax.effects_barrier()
    assert int(refused.count) == -3
    for k in MUON_LEAVES:
        assert np.all(bits(updates[k]) == 0x80000000)
        assert np.array_equal(bits(refused.momentum[k]), bits(state.momentum[k]))
    for k in ("bias", "scale"):  # the AdamW half refused too
        assert np.all(bits(updates[k]) == 0x80000000)
    assert_same_adamw_state(refused, state)


def assert_same_adamw_state(new, old) -> None:
    """The AdamW half's state (count, words, format counts) unchanged, bit for bit."""
    for a, b in zip(jax.tree_util.tree_leaves(new.adamw), jax.tree_util.tree_leaves(old.adamw), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fused", [False, True], ids=["transform", "fused_step"])
def test_a_step_refused_under_jit_by_either_half_refuses_the_whole_step(fused):
    """One transform's step is all or nothing: a Muon hyperparameter turning invalid refuses the
    AdamW leaves too (their updates -0.0, their state and count kept), and an AdamW one (here its
    own learning-rate schedule) refuses the Muon matrices; each warns once naming the value, and
    neither count moves. The learning rate both halves share (no adam_learning_rate) warns once
    too, in packed_muon's words. The Muon warning says nothing changed, and nothing did."""
    params = make_params(np.random.default_rng(39))
    rng = np.random.default_rng(40)
    turning_invalid = lambda value: lambda count: jnp.where(count >= 1, value, LR)  # noqa: E731
    for half, kwargs, words in (
            ("packed_muon", dict(learning_rate=LR, beta=lambda count: jnp.where(count >= 1, 1.5, BETA)),
             "momentum should be below 1"),
            ("packed_adamw", dict(learning_rate=LR, adam_learning_rate=turning_invalid(-1.0)),
             "Invalid learning rate: lr=-1.0"),
            ("packed_muon", dict(learning_rate=turning_invalid(-1.0)), "Learning rate should be >= 0")):
        tx = packed_muon(**kwargs)
        fused_step = packed_muon_fused_step(**kwargs)
        # (grads, state, params) -> (updates, or the new params, state)
        step = jax.jit(lambda g, s, p: fused_step(p, g, s)) if fused else jax.jit(tx.update)
        state = tx.init(params)
        stepped, state = step(make_grads(rng, params), state, params)
        stepped = stepped if fused else optax.apply_updates(params, stepped)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RefusedStepWarning)
            out, refused = step(make_grads(rng, params), state, stepped)
            jax.block_until_ready(out)
            jax.effects_barrier()
        messages = [str(w.message) for w in caught if issubclass(w.category, RefusedStepWarning)]
        assert len(messages) == 1 and messages[0].startswith(f"{half}: step refused at count 1: {words}"), messages
        if half == "packed_muon":
            assert "No weight, momentum, AdamW state word or count changed" in messages[0]
        for k in params:
            assert np.all(bits(out[k]) == (bits(stepped[k]) if fused else 0x80000000)), (half, k)
        assert int(refused.count) == 1
        for k in MUON_LEAVES:
            assert np.array_equal(bits(refused.momentum[k]), bits(state.momentum[k]))
            assert np.array_equal(np.asarray(refused.exponents[k]), np.asarray(state.exponents[k]))
        assert_same_adamw_state(refused, state)


def test_a_tree_without_muon_leaves_keeps_its_count_when_the_adamw_step_is_refused():
    """Without Muon leaves the step is the AdamW half's alone: refused under jit, packed_muon's
    count stays with packed_adamw's (it moved regardless)."""
    params = {k: v for k, v in make_params(np.random.default_rng(44)).items() if k not in MUON_LEAVES}
    tx = packed_muon(lambda count: jnp.where(count >= 1, -1.0, LR))
    update = jax.jit(tx.update)
    rng = np.random.default_rng(45)
    _, state = update(make_grads(rng, params), tx.init(params), params)
    with pytest.warns(RefusedStepWarning, match="packed_adamw: step refused at count 1"):
        updates, refused = update(make_grads(rng, params), state, params)
        jax.block_until_ready(updates)
        jax.effects_barrier()
    assert int(refused.count) == 1 and int(refused.adamw.inner_state.count) == 1


@pytest.mark.parametrize("name,schedule,words", [
    ("beta", optax.constant_schedule(1.0), "momentum should be below 1"),
    ("learning_rate", lambda count: float("nan"), "Learning rate should be >= 0"),
    ("weight_decay", lambda count: -0.1, "weight decay should be >= 0"),
])
def test_a_schedule_of_an_invalid_plain_number_raises_under_jit_as_eagerly(name, schedule, words):
    """A schedule returning a plain number (optax.constant_schedule's) is the same at every
    count: known when the step is traced, an invalid one raises naming it under jit too, as
    packed_adamw's does (transform.py's `_refused_eagerly`), instead of a step refusing every
    matrix at every count."""
    params = make_params(np.random.default_rng(41))
    tx = packed_muon(**{"learning_rate": LR, name: schedule})
    state = tx.init(params)
    grads = make_grads(np.random.default_rng(42), params)
    with pytest.raises(ValueError, match=f"packed_muon: step refused at count 0: {words}"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match=f"packed_muon: invalid hyperparameters, known when the step was traced.*"
                                         f"{words}"):
        jax.jit(tx.update)(grads, state, params)


@pytest.mark.parametrize("count", [np.array(5), jnp.asarray(5), np.int64(5), "state"])
def test_import_takes_a_0d_integer_array_count_as_its_int(count):
    """A state's count (a 0-d int32 array) or a numpy one is a step count, as import_state takes it."""
    params = {k: v for k, v in make_params(np.random.default_rng(43)).items() if k in MUON_LEAVES}
    state = packed_muon(LR).init(params)
    portable = _without_muon_counts(export_muon_state(state, params))
    count = state._replace(count=jnp.asarray(5, jnp.int32)).count if count == "state" else count
    imported = import_muon_state(portable, params, count=count)
    assert int(imported.count) == 5 and imported.count.dtype == jnp.int32
    assert int(imported.adamw.inner_state.count) == 5


def test_a_valid_jitted_step_warns_nothing():
    params = make_params(np.random.default_rng(33))
    tx = packed_muon(LR)
    grads = make_grads(np.random.default_rng(34), params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RefusedStepWarning)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        jax.block_until_ready(updates)
        jax.effects_barrier()


def _without_muon_counts(portable):
    """An exported state as torch's PackedMuon writes it: no step count on the Muon tensors."""
    return dataclasses.replace(portable, counts=[None] * len(portable.counts))


@pytest.mark.parametrize("count", [-3, 2.5, True, "4", 2 ** 31 - 1, 2 ** 31])
def test_import_refuses_a_count_argument_that_is_not_a_step_count(count):
    """count= must be a whole number from 0 to 2**31 - 2: the int32 count stops at 2**31 - 1, so
    a state there could never step again (torch's step limit, the same number)."""
    params = {k: v for k, v in make_params(np.random.default_rng(35)).items() if k in MUON_LEAVES}
    portable = _without_muon_counts(export_muon_state(packed_muon(LR).init(params), params))
    with pytest.raises(ValueError, match=f"import_muon_state: count={count!r} is not a step count.*2147483646"):
        import_muon_state(portable, params, count=count)
    state = import_muon_state(portable, params, count=2 ** 31 - 2)  # the last count that can still step
    assert int(state.count) == 2 ** 31 - 2 and int(state.adamw.inner_state.count) == 2 ** 31 - 2


def test_import_refuses_a_tensors_count_that_is_not_a_step_count():
    """A count carried by the tensors (edited or damaged) is refused too, naming where it came from."""
    params = make_params(np.random.default_rng(36))
    portable = export_muon_state(packed_muon(LR).init(params), params)
    edited = dataclasses.replace(portable, counts=[None if jnp.ndim(leaf) == 2 else -3
                                                   for leaf in jax.tree_util.tree_leaves(params)])
    with pytest.raises(ValueError, match="import_muon_state: the state's AdamW tensors took -3 steps"):
        import_muon_state(edited, params)
    edited = dataclasses.replace(portable, counts=[2 ** 31 - 1] * len(portable.counts))
    with pytest.raises(ValueError, match="import_muon_state: the state's Muon tensors took 2147483647 steps"):
        import_muon_state(edited, params)


@pytest.mark.parametrize("name,first,second", [("weight_decay", 0.1, 0.05), ("beta", 0.9, 0.8),
                                               ("eps", 1e-7, 1e-3)])
def test_a_schedule_of_a_muon_hyperparameter_steps_as_its_values(name, first, second):
    """beta, weight_decay and eps may be schedules of the count, as learning_rate is: each step
    has the bits of a transform built from that step's float32 value (a schedule's value is
    read as its float32 value, as an injected array's is), jitted; one turning invalid refuses
    the step with a warning naming it."""
    rng = np.random.default_rng(37)
    params = {k: v for k, v in make_params(rng).items() if k in MUON_LEAVES}
    values = jnp.asarray([first, second, -1.0], jnp.float32)
    scheduled = packed_muon(LR, **{name: lambda count: values[jnp.minimum(count, 2)]})
    state = scheduled.init(params)
    update = jax.jit(scheduled.update)
    for value in (first, second):
        grads = make_grads(rng, params)
        updates, new_state = update(grads, state, params)
        plain_updates, plain_state = packed_muon(LR, **{name: float(F32(value))}).update(grads, state, params)
        for k in MUON_LEAVES:
            assert np.array_equal(bits(updates[k]), bits(plain_updates[k])), (k, value)
            assert np.array_equal(bits(new_state.momentum[k]), bits(plain_state.momentum[k])), (k, value)
        params, state = optax.apply_updates(params, updates), new_state
    words = {"weight_decay": "weight decay should be >= 0", "beta": "momentum should be >= 0",
             "eps": "eps should be > 0"}
    with pytest.warns(RefusedStepWarning, match=f"packed_muon: step refused at count 2: {words[name]}"):
        updates, refused = update(make_grads(rng, params), state, params)
        jax.block_until_ready(updates)
        jax.effects_barrier()
    assert int(refused.count) == 2 and all(np.all(bits(updates[k]) == 0x80000000) for k in MUON_LEAVES)


def test_an_adamw_hyperparameter_schedule_goes_through_inject_hyperparams_as_the_error_says():
    """packed_adamw takes no weight-decay schedule; optax.inject_hyperparams, which the refusal
    names, evaluates one and passes its value: the bits of packed_muon built with that value."""
    rng = np.random.default_rng(38)
    params = make_params(rng)
    injected = optax.inject_hyperparams(packed_muon, static_args=("ns_steps", "mu_bias"))(
        learning_rate=LR, adam_weight_decay=lambda count: 0.01)
    plain = packed_muon(float(F32(LR)), beta=float(F32(0.95)), weight_decay=float(F32(WD)), eps=float(F32(EPS)),
                        adam_learning_rate=LR, adam_weight_decay=float(F32(0.01)))
    grads = make_grads(rng, params)
    updates, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    plain_updates, _ = plain.update(grads, plain.init(params), params)
    for k in params:
        assert np.array_equal(bits(updates[k]), bits(plain_updates[k])), k


def test_the_adamw_half_is_packed_adamw_without_nesterov_as_muon_md_says():
    """optax.contrib.muon's AdamW half is Nesterov's (adamw(..., nesterov=True)); packed_muon's is
    packed_adamw's, which has no Nesterov form. Pinned, with the numbers docs/MUON.md quotes (a
    1-D leaf from 0, a constant gradient, lr 0.01, five steps) and the recipe it gives for
    optax's behaviour: an optax.partition of packed_muon and optax.adamw(nesterov=True) gives
    optax.contrib.muon's bits on that leaf and packed_muon's on the matrix."""
    lr = 0.01
    params = {"w": jnp.asarray((np.random.default_rng(39).standard_normal((4, 6)) * 0.2).astype(F32)),
              "b": jnp.zeros((3,), jnp.float32)}
    grads = {"w": jnp.full((4, 6), 0.1, jnp.float32), "b": jnp.ones((3,), jnp.float32)}
    labels = lambda tree: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", tree)  # noqa: E731
    recipe = optax.partition({"muon": packed_muon(lr), "adam": optax.adamw(lr, eps=1e-8, weight_decay=0.0,
                                                                           nesterov=True)}, labels)
    bias_alone = packed_adamw(lr, weight_decay=0.0)
    runs = {name: (jax.jit(tx.update), params, tx.init(params)) for name, tx in
            (("ours", packed_muon(lr)), ("optax", optax.contrib.muon(lr)), ("recipe", recipe),
             ("plain adamw", optax.adamw(lr, eps=1e-8, weight_decay=0.0)))}
    alone_params, alone_state = {"b": params["b"]}, bias_alone.init({"b": params["b"]})
    first = None  # how far the leaf moved in step 1
    for _ in range(5):
        for name, (update, p, s) in runs.items():
            u, s = update(grads, s, p)
            runs[name] = (update, optax.apply_updates(p, u), s)
        first = first or {name: -float(p["b"][0]) for name, (_, p, _) in runs.items()}
        u, alone_state = bias_alone.update({"b": grads["b"]}, alone_state, alone_params)
        alone_params = optax.apply_updates(alone_params, u)
        assert np.array_equal(bits(runs["ours"][1]["b"]), bits(alone_params["b"]))  # packed_adamw's, every step
    ours, theirs, recipe_params, plain = (runs[name][1] for name in ("ours", "optax", "recipe", "plain adamw"))
    assert np.array_equal(bits(recipe_params["b"]), bits(theirs["b"]))  # optax's AdamW half, bit for bit
    assert np.array_equal(bits(recipe_params["w"]), bits(ours["w"]))  # and our Muon step
    # optax.adamw's without Nesterov, up to packed_adamw's state format (FORMAT.md)
    assert np.abs(np.asarray(ours["b"]) - np.asarray(plain["b"])).max() < 1e-5
    page = " ".join((REPO / "docs" / "MUON.md").read_text().split())
    for said in (f"packed_muon moves it by {-float(ours['b'][0]):.4f}, optax.contrib.muon by "
                 f"{-float(theirs['b'][0]):.4f}", f"(step 1: {first['ours']:.4f} against {first['optax']:.4f})"):
        assert said in page, f"docs/MUON.md should say: {said}"


def test_misuse_is_refused_with_a_message():
    params = make_params(np.random.default_rng(23))
    tx = packed_muon(LR)
    state = tx.init(params)
    grads = make_grads(np.random.default_rng(24), params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, state)
    with pytest.raises(ValueError, match="momentum of leaf \\['square'\\] is uint16"):
        packed_muon(LR, mode="fp32").update(grads, state, params)
    with pytest.raises(TypeError, match="dtype float16"):
        tx.init({**params, "tall": params["tall"].astype(jnp.float16)})
    with pytest.raises(ValueError, match="rank 1"):
        packed_muon(LR, muon_weight_dimension_numbers={**{k: None for k in params},
                                                       "bias": MuonDimensionNumbers()}).init(params)


@pytest.mark.cuda
def test_arrays_on_the_cpu_of_a_gpu_host_take_the_host_phases():
    """The platform the step is compiled for chooses Muon's phases, as it chooses packed_adamw's:
    a GPU host's arrays placed on its CPU take core/muon's numpy phases around the jax.numpy
    Newton-Schulz, compiled for the CPU, with the contract's bits (they were refused with a
    NotImplementedError when the default backend chose)."""
    if _cuda_reason() is not None:
        pytest.skip(f"needs CUDA for JAX plus jax_triton: {_cuda_reason()}")
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(5)
    params = jax.device_put(make_params(rng), cpu)
    state = jax.device_put(packed_muon(LR).init(params), cpu)
    step = jax.jit(packed_muon_fused_step(LR))

    def cpu_ns(x_bits):
        x = jax.device_put(jnp.asarray(x_bits).view(jnp.bfloat16), cpu)
        return bits(newton_schulz(x, COEFFICIENTS, STEPS, EPS))

    refs = {k: Reference(params[k], StateFormat("packed"), cpu_ns) for k in MUON_LEAVES}
    text = step.lower(params, jax.device_put(make_grads(rng, params), cpu), state).compile().as_text()
    assert "xla_ffi_python_cpu_callback" in text and "triton" not in text.lower()
    for n in range(3):  # two compiled steps, then one outside jit (whose row and count sit on the GPU)
        grads = jax.device_put(make_grads(rng, params), cpu)
        params, state = (step if n < 2 else packed_muon_fused_step(LR))(params, grads, state)
        for k in MUON_LEAVES:
            refs[k].step(np.asarray(grads[k]))
            assert np.array_equal(bits(params[k]), bits(refs[k].p)), k
            assert np.array_equal(bits(state.momentum[k]), bits(refs[k].state)), k
            assert int(state.exponents[k]) == int(refs[k].exponent), k
    assert all(leaf.devices() == {cpu} for leaf in jax.tree_util.tree_leaves((params, state)))


def test_a_learning_rate_of_negative_zero_is_its_own_step_eagerly_and_in_one_jit():
    """Hyperparameters given as Python numbers are compiled into the step, keyed by their binary64
    bits: lr=-0.0 (a valid rate) and lr=0.0 compare equal as floats but step a -0.0 weight to
    different bits (-lr is +0.0 for one, -0.0 for the other), and each must get its own step, in
    either order, eagerly and inside one jit (a review found the second reusing the first's)."""
    p = {"w": jnp.asarray(np.array([[-0.0, 1.0, 0.5], [0.25, -0.5, 2.0]], F32))}
    g = {"w": jnp.asarray(np.array([[1e-3, -2e-3, 3e-3], [1e-3, 5e-3, -1e-3]], F32))}
    fmt = StateFormat("fp32")

    def want(lr):
        ref = Reference(p["w"], fmt, jax_ns, lr=lr)
        ref.step(np.asarray(g["w"]))
        return bits(ref.p)

    def fused(lr):
        return packed_muon_fused_step(lr, mode="fp32")(p, g, packed_muon(lr, mode="fp32").init(p))[0]["w"]

    assert not np.array_equal(want(0.0), want(-0.0))  # the case tells the two apart
    for order in ((0.0, -0.0), (-0.0, 0.0)):
        for lr in order:
            assert np.array_equal(bits(fused(lr)), want(lr)), (order, lr)
        both = jax.jit(lambda: [fused(lr) for lr in order])()
        for lr, got in zip(order, both):
            assert np.array_equal(bits(got), want(lr)), ("jit", order, lr)


def test_steps_under_disable_jit_are_the_compiled_steps():
    """jax.disable_jit() runs the step primitive's lowering op by op for either rule (it recursed:
    the primitive's eager rule called a jitted bind of itself): the same bits as the compiled step,
    Newton-Schulz compiled still (a 128 x 256 matrix's GEMMs sum in another order op by op)."""
    rng = np.random.default_rng(37)
    params = {**make_params(rng, bf16=True), "big": jnp.asarray((rng.standard_normal((128, 256)) * 0.05).astype(F32))}
    grads = make_grads(rng, params)
    for tx in (packed_muon(LR), packed_adamw(LR, impl="kernel")):
        state = tx.init(params)
        want = jax.jit(tx.update)(grads, state, params)
        with jax.disable_jit():
            got = tx.update(grads, state, params)
        for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert np.array_equal(bits(x), bits(y))


def test_a_schedule_value_past_a_floats_range_is_refused_naming_the_rate():
    """A schedule returning an int too large for a float (or a Fraction) is read as inf and refused
    in each transform's words, not with a bare OverflowError."""
    from fractions import Fraction

    params = make_params(np.random.default_rng(41))
    grads = make_grads(np.random.default_rng(42), params)
    for huge in (10**400, Fraction(10**400)):
        for tx, words in ((packed_adamw(lambda count: huge), "Invalid learning rate: lr=inf"),
                          (packed_muon(lambda count: huge), "Learning rate should be >= 0 but is: inf")):
            with pytest.raises(ValueError, match=words):
                tx.update(grads, tx.init(params), params)


def test_eager_steps_compile_no_step_per_learning_rate():
    """An eager loop that builds packed_muon with a new Python learning rate each step compiles no
    new step for it: the Muon leaves' lowering runs op by op outside a trace (a review measured a
    compiled step per value, 9x slower), while packed_adamw's primitive is compiled once."""
    from packed_adamw.jax import _step

    rng = np.random.default_rng(31)
    params = make_params(rng)
    state = packed_muon(LR).init(params)
    packed_muon(LR).update(make_grads(rng, params), state, params)
    compiled = _step._jitted.cache_info().currsize
    for lr in (0.011, 0.012, 0.013):
        updates, state = packed_muon(lr).update(make_grads(rng, params), state, params)
        params = optax.apply_updates(params, updates)
    assert _step._jitted.cache_info().currsize == compiled


def test_injected_hyperparameters_step_as_the_same_float32_numbers():
    """optax.inject_hyperparams (arrays, traced under jit) gives the bits of a transform built
    from the same float32 values as numbers; the ints that fix the compiled step must be
    static, and saying so is the error."""
    rng = np.random.default_rng(29)
    params = make_params(rng)
    with pytest.raises(TypeError, match="static_args"):
        optax.inject_hyperparams(packed_muon)(learning_rate=LR).init(params)
    injected = optax.inject_hyperparams(packed_muon, static_args=("ns_steps", "mu_bias"))(
        learning_rate=LR, beta=0.9, weight_decay=0.05)
    plain = packed_muon(float(F32(LR)), beta=float(F32(0.9)), weight_decay=float(F32(0.05)),
                        eps=float(F32(EPS)), adam_learning_rate=LR, adam_weight_decay=0.0)
    state, plain_state = injected.init(params), plain.init(params)
    for _ in range(2):
        grads = make_grads(rng, params)
        updates, state = jax.jit(injected.update)(grads, state, params)
        plain_updates, plain_state = plain.update(grads, plain_state, params)
        for k in MUON_LEAVES:
            assert np.array_equal(bits(updates[k]), bits(plain_updates[k])), k
        params = optax.apply_updates(params, updates)


def test_a_tree_without_matrices_is_packed_adamws_and_counts_its_steps():
    params = {"bias": jnp.ones((5,), jnp.float32)}
    tx, alone = packed_muon(LR, adam_weight_decay=0.01), packed_adamw(LR, weight_decay=0.01)
    state, alone_state = tx.init(params), alone.init(params)
    grads = {"bias": jnp.full((5,), 0.5, jnp.float32)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    alone_updates, _ = alone.update(grads, alone_state, params)
    assert np.array_equal(bits(updates["bias"]), bits(alone_updates["bias"])) and int(state.count) == 1


# ---- CUDA: the same bits as torch's PackedMuon(ns_impl="triton") ---------------------------------
# JAX [in, out] leaves: torch-tall, torch-wide of the same Newton-Schulz shape (one batch), a
# square one, one over several tiles of every product, and a bf16 leaf (a split master).
# ---- scale invariance (issue 53): tests/torch_frontend/test_torch_muon.py's acceptance test, for packed_muon ----
SCALES = (0, -12, 12, 20)


def weights_after_scaled_steps(scale, dtype, steps=6, **options):
    """packed_muon's fused step (packed mode) over `steps` steps of gradients times 2**scale:
    the Muon leaves' weight bits and the state's exponents."""
    rng = np.random.default_rng(63)
    params = {k: jnp.asarray((rng.standard_normal(s) * 0.3).astype(F32), dtype)
              for k, s in (("tall", (6, 10)), ("wide", (10, 6)))}
    step = packed_muon_fused_step(LR, **options)
    state = packed_muon(LR, **options).init(params)
    for _ in range(steps):
        grads = {k: jnp.asarray(gradient(rng, p.shape) * F32(2.0 ** scale), dtype) for k, p in params.items()}
        params, state = step(params, grads, state)
    return {k: bits(p).copy() for k, p in params.items()}, {k: int(e) for k, e in state.exponents.items()}


def assert_scale_invariant(dtype, **options) -> None:
    (weights, exponents), *scaled = (weights_after_scaled_steps(scale, dtype, **options) for scale in SCALES)
    for scale, (weights_s, exponents_s) in zip(SCALES[1:], scaled):
        for k in weights:
            assert np.array_equal(weights[k], weights_s[k]), (k, scale)
            assert exponents_s[k] == exponents[k] + scale, (k, scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weights_are_the_same_for_power_of_two_scaled_gradients(dtype):
    """The issue's acceptance test on the CPU: weights after 6 steps bit for bit the same for
    gradients times 2**-12, 2**12 and 2**20 as unscaled (torch.optim.Muon's control is in
    tests/torch_frontend/test_torch_muon.py), float32 and bf16 weights; the exponents move by the scale."""
    assert_scale_invariant(dtype)


def test_weights_are_the_same_for_power_of_two_scaled_gradients_in_the_interpreted_gpu_path(interpreted_kernels):
    """The acceptance test through the GPU path's kernels (_muon_triton.py) in Triton's CPU
    interpreter, float32 weights, two steps (the interpreter is slow)."""
    from packed_adamw.jax import _muon_triton

    stand_in = interpreted_kernels
    (weights, exponents), *scaled = (weights_after_scaled_steps(scale, jnp.float32, steps=2, ns_steps=2)
                                     for scale in SCALES)
    assert stand_in.kernels.count(_muon_triton.muon_momentum_group_kernel) == 2 * 2 * len(SCALES)
    for scale, (weights_s, exponents_s) in zip(SCALES[1:], scaled):
        for k in weights:
            assert np.array_equal(weights[k], weights_s[k]) and exponents_s[k] == exponents[k] + scale, (k, scale)


def test_a_packed_state_without_exponents_is_refused_and_one_made_before_them_steps_given_zeros():
    """A packed PackedMuonState without exponents (built with four fields, or unpickled from
    before them) cannot tell a state made before the exponents (its codes read with 0) from one
    that lost them (its momenta off by 2**-s): the step, the fused step and the export refuse it
    naming `exponents` and the line that continues a state made before them, which then steps as
    one whose exponents are 0, its codes read as the values they had, and the step returns the
    exponents; a state of another mode holding exponents is refused."""
    rng = np.random.default_rng(64)
    params = make_params(rng)
    tx = packed_muon(LR)
    state = tx.init(params)
    codes = {k: jnp.asarray(StateFormat().code.encode(gradient(rng, params[k].shape, -30, 0))) for k in MUON_LEAVES}
    state = state._replace(momentum={**state.momentum, **codes})
    legacy = PackedMuonState(state.count, state.momentum, state.low_halves, state.adamw)
    assert legacy.exponents is None
    grads = make_grads(rng, params)
    message = (r"^packed_muon: the state's exponents are None, but mode 'packed' keeps each Muon matrix's momentum as "
               r"its codes times 2\*\*exponent .*state\._replace\(exponents=tx\.init\(params\)\.exponents\)")
    for refused in (lambda: tx.update(grads, legacy, params), lambda: jax.jit(tx.update)(grads, legacy, params),
                    lambda: packed_muon_fused_step(LR)(params, grads, legacy),
                    lambda: export_muon_state(legacy, params)):
        with pytest.raises(ValueError, match=message):
            refused()
    legacy = legacy._replace(exponents=tx.init(params).exponents)  # the line the message gives
    want_updates, want_state = tx.update(grads, state, params)
    got_updates, got_state = tx.update(grads, legacy, params)
    want, got = (jax.tree_util.tree_leaves(tree) for tree in ((want_updates, want_state), (got_updates, got_state)))
    assert len(want) == len(got) and all(np.array_equal(bits(a), bits(b)) for a, b in zip(want, got))
    with pytest.raises(ValueError, match="the state holds exponents, which muon-fp32:mu=f32 does not keep"):
        packed_muon(LR, mode="fp32").update(grads, packed_muon(LR, mode="fp32").init(params)._replace(
            exponents=state.exponents), params)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_weights_are_the_same_for_power_of_two_scaled_gradients(dtype):
    """The acceptance test compiled on a GPU (jax-triton)."""
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(f"needs CUDA for JAX plus jax_triton: {reason}")
    assert_scale_invariant(dtype)


# "tall" and "tall2" share a launch of each phase (one shape group, orientation and dtype).
CUDA_LEAVES = {"tall": (64, 192), "tall2": (64, 192), "wide": (192, 64), "square": (128, 128), "odd": (300, 130),
               "half": (96, 40)}


def _cuda_reason():
    from jax_helpers import jax_cuda_unavailable

    return jax_cuda_unavailable()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
@pytest.mark.parametrize("batch_ns", [False, True])
@pytest.mark.parametrize("schedule", [False, True])
def test_gpu_step_equals_torch_triton_newton_schulz_bit_for_bit(mode, batch_ns, schedule):
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(f"needs CUDA for torch and JAX plus jax_triton: {reason}")
    from packed_adamw.torch import PackedMuon

    rng = np.random.default_rng(37)
    steps = 3
    # A zero lr at the first step, and a row of -0.0 weights: the step's -lr must be -0.0 there
    # (computed on the device under the schedule), or p * 1 + (+0.0) * O turns -0.0 into +0.0.
    table = np.float32([0.0, 0.02, 0.01, 0.005])
    p0 = {k: (rng.standard_normal(s) * 0.2).astype(F32) for k, s in CUDA_LEAVES.items()}
    p0["square"][0] = -0.0
    grads = [{k: gradient(rng, s) for k, s in CUDA_LEAVES.items()} for _ in range(steps)]
    bf16_leaf = lambda k: k == "half"  # noqa: E731

    params = {k: jnp.asarray(v, jnp.bfloat16 if bf16_leaf(k) else jnp.float32) for k, v in p0.items()}
    lr = (lambda count: jnp.asarray(table)[count]) if schedule else LR
    step = jax.jit(packed_muon_fused_step(lr, beta=BETA, eps=EPS, weight_decay=WD, mode=mode))
    tx = packed_muon(lr, beta=BETA, eps=EPS, weight_decay=WD, mode=mode)
    update = jax.jit(tx.update)
    state = tx.init(params)
    for g in grads:  # a bf16 leaf's gradient in bf16 (torch >= 2.11 refuses a float32 one for a bf16 parameter)
        g = {k: jnp.asarray(v, params[k].dtype) for k, v in g.items()}
        if not batch_ns:  # (torch's option) the transform from the same point: its updates are the fused step's
            updates, t_state = update(g, state, params)
        new_params, new_state = step(params, g, state)
        if not batch_ns:  # a float32 leaf's u from its weight launch, as MUON.md's "Updates" defines it
            for k in CUDA_LEAVES:
                if bf16_leaf(k):  # applied, its update gives the new weight (the low half keeps the master)
                    got, want = optax.apply_updates(params[k], updates[k]), new_params[k]
                else:
                    got, want = updates[k], _muon_step._float32_update(params[k], new_params[k])
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"update of {k}")
            for a, b in zip(*(jax.tree_util.tree_leaves((st.momentum, st.low_halves, st.exponents))
                              for st in (t_state, new_state))):
                np.testing.assert_array_equal(bits(a), bits(b))
        params, state = new_params, new_state
    assert all(leaf.devices().pop().platform == "gpu" for leaf in jax.tree_util.tree_leaves(params))

    torch_params = {k: torch.nn.Parameter(torch.from_numpy(v.T.copy()).to("cuda", torch.bfloat16 if bf16_leaf(k)
                                                                           else torch.float32))
                    for k, v in p0.items()}
    opt = PackedMuon(list(torch_params.values()), lr=LR, momentum=BETA, eps=EPS, weight_decay=WD, mode=mode,
                     ns_impl="triton", batch_ns=batch_ns)
    for n, g in enumerate(grads):
        if schedule:
            opt.param_groups[0]["lr"] = float(table[n])  # the float32 value the JAX schedule gives
        for k, p in torch_params.items():
            p.grad = torch.from_numpy(g[k].T.copy()).to("cuda", p.dtype)
        opt.step()
    key = "momentum_buffer" if mode == "fp32" else "momentum_code"
    for k, p in torch_params.items():
        theirs = p.detach().cpu()
        theirs = theirs.view(torch.int16).numpy().view(np.uint16) if bf16_leaf(k) else theirs.numpy().view(np.uint32)
        np.testing.assert_array_equal(bits(params[k]).T, theirs, err_msg=f"weights of {k}")
        momentum = opt.state[p][key].cpu().numpy()
        np.testing.assert_array_equal(bits(state.momentum[k]).T, momentum.view(np.uint32 if mode == "fp32"
                                                                             else np.uint16), err_msg=k)
        if mode == "packed":
            assert int(state.exponents[k]) == int(opt.state[p]["mu_exponent"]), k
        if bf16_leaf(k):
            np.testing.assert_array_equal(np.asarray(state.low_halves[k]).T, opt.state[p]["lo"].cpu().numpy())


@pytest.mark.cuda
def test_gpu_transform_gives_a_refused_float32_matrix_negative_zero_updates():
    """Compiled, the weight launch's update for a refused float32 matrix is -0.0 everywhere (not
    +0.0, which `apply_updates` would turn a -0.0 weight into +0.0 with: Triton 3.6 compiles -x
    as 0 - x), beside a stepped matrix of the same launch."""
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(f"needs CUDA for JAX plus jax_triton: {reason}")
    rng = np.random.default_rng(53)
    params = {k: jnp.asarray((rng.standard_normal((64, 192)) * 0.2).astype(F32)) for k in ("kept", "stepped")}
    params["kept"] = params["kept"].at[0, 0].set(-0.0)
    grads = {k: jnp.asarray(gradient(rng, (64, 192))) for k in params}
    grads["kept"] = grads["kept"].at[3, 5].set(np.nan)
    tx = packed_muon(LR, beta=BETA, eps=EPS, weight_decay=WD)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert (bits(updates["kept"]) == np.uint32(0x80000000)).all()
    assert bits(optax.apply_updates(params, updates)["kept"])[0, 0] == np.uint32(0x80000000)
    assert (bits(updates["stepped"]) != np.uint32(0x80000000)).any()


# JAX's [in, out]; "stack": two [4, 8] matrices in one leaf (batch axis 0). The interpreter is slow.
INTERPRETED_LEAVES = {"tall": (4, 8), "wide": (8, 4), "half": (6, 6), "stack": (2, 4, 8)}


@pytest.mark.parametrize("mode,schedule", [("packed", False), ("fp32", True)])
def test_gpu_path_in_the_interpreter_equals_torch_triton_newton_schulz(mode, schedule, monkeypatch, interpreted_kernels):
    """The GPU path's launches (_muon_triton.py) run in Triton's CPU interpreter through a
    stand-in for jax-triton 0.3.1's triton_call (arrays and scalars in order, then the outputs),
    against torch's PackedMuon(ns_impl="triton") with its kernels, also interpreted: the same
    bits, a tall, a wide, a bf16 and a batched leaf (the cuda test's comparison, on tiny
    shapes; the batched leaf's matrices go to torch as two parameters). Packed codes with a
    constant lr; float32 momenta (the kernels' other pointer types) with a scheduled lr (the
    step scalars computed on the device, `muon_scalars_kernel`)."""
    from packed_adamw.jax import _muon_triton
    from packed_adamw.torch import PackedMuon
    from packed_adamw.torch import muon as torch_muon

    stand_in = interpreted_kernels
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)
    rng = np.random.default_rng(41)
    p0 = {k: (rng.standard_normal(s) * 0.2).astype(F32) for k, s in INTERPRETED_LEAVES.items()}
    grads = [{k: gradient(rng, s) for k, s in INTERPRETED_LEAVES.items()} for _ in range(3)]
    # The last step refuses the wide leaf's matrix, the second slot of the Newton-Schulz group it
    # shares with the tall leaf, and the batched leaf's second matrix (slot 3 + 1): the counters
    # are the group's, indexed by slot and matrix.
    grads[2]["wide"][1, 2] = np.nan
    grads[2]["stack"][1, 0, 3] = np.nan
    grads[2]["half"][0, 0] = np.inf  # the bf16 leaf (a launch of its own) refused too
    bf16_leaf = lambda k: k == "half"  # noqa: E731
    table = np.float32([0.02, 0.0, 0.01])  # a zero lr in the schedule: the weights stay

    params = {k: jnp.asarray(v, jnp.bfloat16 if bf16_leaf(k) else jnp.float32) for k, v in p0.items()}
    before_refusal = {}
    dims = {k: MuonDimensionNumbers(reduction_axis=len(s) - 2, output_axis=len(s) - 1)
            for k, s in INTERPRETED_LEAVES.items()}
    lr = (lambda count: jnp.asarray(table)[count]) if schedule else LR
    options = dict(ns_steps=2, beta=BETA, eps=EPS, weight_decay=WD, muon_weight_dimension_numbers=dims, mode=mode)
    tx, fused = packed_muon(lr, **options), packed_muon_fused_step(lr, **options)
    state = tx.init(params)
    for n, g in enumerate(grads):  # eagerly: the stand-in runs each launch as it comes
        if n == 2:
            before_refusal = {k: bits(params[k]) for k in ("wide", "tall", "stack", "half")}
        g = {k: jnp.asarray(v, params[k].dtype) for k, v in g.items()}
        # The transform from the same point as the fused step: its updates are the fused step's
        # (MUON.md, "Updates"), the weights it leaves after apply_updates need not be.
        updates, t_state = tx.update(g, state, params)
        new_params, new_state = fused(params, g, state)
        for k in INTERPRETED_LEAVES:
            if bf16_leaf(k):
                np.testing.assert_array_equal(bits(optax.apply_updates(params[k], updates[k])), bits(new_params[k]))
            else:
                np.testing.assert_array_equal(bits(updates[k]), float32_update_bits(params[k], new_params[k]),
                                              err_msg=f"update of {k}")
        for x, y in zip(*(jax.tree_util.tree_leaves((st.momentum, st.low_halves, st.exponents))
                          for st in (t_state, new_state))):
            np.testing.assert_array_equal(bits(x), bits(y))
        params, state = new_params, new_state
    # A launch a kind of leaf: the tall and the batched leaf share one (one orientation, float32),
    # the wide leaf and the bf16 leaf have one each; three steps of the transform and the fused step.
    assert stand_in.kernels.count(_muon_triton.muon_momentum_group_kernel) == 3 * 3 * 2
    weight_launches = [meta for kernel, meta in stand_in.launches if kernel is _muon_triton.muon_weight_group_kernel]
    assert len(weight_launches) == 3 * 3 * 2
    assert sorted((m["SPLIT"], m["UPDATE"]) for m in weight_launches[:6]) == [
        (False, False), (False, False), (False, True), (False, True), (True, False), (True, False)]
    if schedule:  # the step scalars on the device: a row a launch
        assert stand_in.kernels.count(_muon_triton.muon_scalars_kernel) == 3 * 3 * 2
    assert np.array_equal(bits(params["wide"]), before_refusal["wide"])  # refused: kept
    assert np.array_equal(bits(params["half"]), before_refusal["half"])
    assert not np.array_equal(bits(params["tall"]), before_refusal["tall"])  # its group neighbour stepped
    assert np.array_equal(bits(params["stack"][1]), before_refusal["stack"][1])  # refused: kept
    assert not np.array_equal(bits(params["stack"][0]), before_refusal["stack"][0])

    def matrices(tree):  # torch's 2-D parameters: the batched leaf's matrices one by one
        out = {k: v for k, v in tree.items() if k != "stack"}
        out.update({f"stack{i}": tree["stack"][i] for i in range(INTERPRETED_LEAVES["stack"][0])})
        return out

    p0, grads = matrices(p0), [matrices(g) for g in grads]
    params = matrices(params)
    state_momentum = matrices(state.momentum)
    state_exponents = matrices(state.exponents) if mode == "packed" else None
    torch_params = {k: torch.nn.Parameter(torch.from_numpy(v.T.copy()).to(torch.bfloat16 if bf16_leaf(k)
                                                                         else torch.float32))
                    for k, v in p0.items()}
    opt = PackedMuon(list(torch_params.values()), lr=LR, ns_steps=2, momentum=BETA, eps=EPS, weight_decay=WD,
                     ns_impl="triton", mode=mode)
    for n, g in enumerate(grads):
        if schedule:
            opt.param_groups[0]["lr"] = float(table[n])  # the float32 value the JAX schedule gives
        for k, p in torch_params.items():
            p.grad = torch.from_numpy(g[k].T.copy()).to(p.dtype)  # the bf16 leaf's gradient in bf16, as JAX's
        opt.step()
    for k, p in torch_params.items():
        theirs = p.detach()
        theirs = theirs.view(torch.int16).numpy().view(np.uint16) if bf16_leaf(k) else theirs.numpy().view(np.uint32)
        key, view = ("momentum_buffer", np.uint32) if mode == "fp32" else ("momentum_code", np.uint16)
        np.testing.assert_array_equal(bits(state_momentum[k]).T, opt.state[p][key].numpy().view(view), err_msg=k)
        if mode == "packed":  # each matrix's exponent, the batched leaf's two included
            assert int(state_exponents[k]) == int(opt.state[p]["mu_exponent"]), k
        np.testing.assert_array_equal(bits(params[k]).T, theirs, err_msg=f"weights of {k}")


def test_gpu_path_launches_split_at_the_kernels_slots_in_the_interpreter(monkeypatch, interpreted_kernels):
    """17 leaves of one kind take two launches of each phase (16 slots, then 1), the second from
    slot 16 of the shape group's buffers: the same bits, updates and momenta, as one launch a
    leaf; a leaf refused in the second launch is refused alone."""
    from packed_adamw.jax import _muon_triton, _step

    stand_in = interpreted_kernels
    rng = np.random.default_rng(43)
    names = [f"m{i:02d}" for i in range(17)]
    params = {k: jnp.asarray((rng.standard_normal((2, 4)) * 0.2).astype(F32)) for k in names}
    grads = {k: jnp.asarray(gradient(rng, (2, 4))) for k in names}
    grads["m16"] = grads["m16"].at[0, 1].set(np.nan)  # the second launch's only leaf: refused
    tx = packed_muon(LR, ns_steps=1, beta=BETA, eps=EPS, weight_decay=WD)
    state = tx.init(params)

    def run(leaves_per_launch):
        monkeypatch.setattr(_muon_triton, "LEAVES_PER_LAUNCH", leaves_per_launch)
        _step._jitted.cache_clear()  # the launches are chosen when the step is compiled
        stand_in.clear()
        updates, new_state = tx.update(grads, state, params)
        return updates, new_state, stand_in.kernels.count(_muon_triton.muon_momentum_group_kernel)

    grouped, grouped_state, launches = run(16)
    assert launches == 2
    alone, alone_state, launches = run(1)
    assert launches == 17
    for k in names:
        np.testing.assert_array_equal(bits(grouped[k]), bits(alone[k]), err_msg=k)
        np.testing.assert_array_equal(bits(grouped_state.momentum[k]), bits(alone_state.momentum[k]), err_msg=k)
    assert not np.any(bits(grouped["m16"]) != bits(jnp.full((2, 4), -0.0, jnp.float32)))  # refused: -0.0 updates
    assert np.any(bits(grouped["m15"]) != bits(jnp.full((2, 4), -0.0, jnp.float32)))  # its group neighbour stepped


def float32_update_bits(p, p_next) -> np.ndarray:
    """`_float32_update`'s rules in numpy (uint32 bits): p' - p clipped to the float32 range,
    -0.0 where p' has p's bits. (XLA's CPU runtime would flush subnormal differences; the
    GPU's does not, nor does the kernel.)"""
    p, p_next = np.asarray(p, F32), np.asarray(p_next, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        u = np.clip(p_next - p, -np.finfo(F32).max, np.finfo(F32).max).astype(F32)
    u[p.view(np.uint32) == p_next.view(np.uint32)] = np.float32(-0.0)
    return u.view(np.uint32)


def test_the_weight_kernels_float32_update_is_the_transforms_bit_for_bit():
    """core/muon/kernel.py's `float32_update` (the update the GPU path's weight launch writes for
    a float32 leaf) against `_float32_update` on pairs that exercise each of its rules: p' with
    p's bits (-0.0, +0.0 and -0.0 apart, NaN kept), differences that overflow (clipped),
    subnormal ones, and ordinary steps."""
    from conftest import interpreting

    if not interpreting():
        pytest.skip("runs the kernel in Triton's CPU interpreter")
    apply = _float32_update_kernel()
    big, tiny = np.float32(3e38), np.float32(1e-45)
    rng = np.random.default_rng(7)
    ordinary = rng.standard_normal(40).astype(F32)
    p = np.concatenate([[0.0, -0.0, 0.0, -0.0, np.nan, np.inf, big, -big, tiny, 2 * tiny, 1.0], ordinary]).astype(F32)
    p_next = np.concatenate([[-0.0, 0.0, 0.0, -0.0, np.nan, np.inf, -big, big, 2 * tiny, -tiny, 1.0],
                             ordinary * np.float32(0.999) + np.float32(1e-3)]).astype(F32)
    u = torch.empty(p.size, dtype=torch.float32)
    apply[(1,)](torch.from_numpy(p), torch.from_numpy(p_next), u, p.size, BLOCK=64)
    # `_float32_update`'s rules in numpy: XLA's CPU runtime would flush the subnormal differences
    # (the GPU's does not), so the transform's own function is compared where it agrees.
    want = float32_update_bits(p, p_next).view(F32)
    np.testing.assert_array_equal(u.numpy().view(np.uint32), want.view(np.uint32))
    normal = np.abs(want) >= np.finfo(F32).tiny
    np.testing.assert_array_equal(
        np.asarray(_muon_step._float32_update(jnp.asarray(p), jnp.asarray(p_next))).view(np.uint32)[normal],
        want.view(np.uint32)[normal])


def _float32_update_kernel():
    """A kernel applying core/muon/kernel.py's `float32_update` to (p, p') arrays (made on
    first use: the interpreter resolves the names it calls in this module's globals)."""
    import triton
    import triton.language as tl

    from packed_adamw.core.muon import kernel

    globals()["_muon_kernel"] = kernel

    @triton.jit
    def apply(p_ptr, p_next_ptr, u_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(p_ptr + offsets, mask=mask)
        tl.store(u_ptr + offsets, _muon_kernel.float32_update(p, tl.load(p_next_ptr + offsets, mask=mask)),
                 mask=mask)

    return apply
