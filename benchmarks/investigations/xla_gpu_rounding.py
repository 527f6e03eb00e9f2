"""Which float32 operation of the XLA-native AdamW step (jax_frontend/_xla_step.py) rounds
otherwise than IEEE on a GPU: each intermediate of `element_step`'s arithmetic, on 65,536 random
elements at count 7, computed under `jax.jit` (with the step's contraction guards) and in numpy
float32, mismatches counted; then division, square root and multiplication alone, their inputs
from numpy, so that each operation's own rounding shows.

    python benchmarks/investigations/xla_gpu_rounding.py      # on the GPU machine (jax with CUDA)

Result (docs/JAX.md, "The XLA step"): on an H100 (jax 0.11.2, 2026-12-06) float32 division and
square root are not correctly rounded (19,041 and 11,028 of 65,536 elements 1 ulp off), every
multiplication and addition is; the float64 division of widened float32 operands is narrowed back
to the float32 one unless its operands are guarded (then 0 off), and with the guards
`element_step` and the step scalars are exact.
"""
import numpy as np
import jax
import jax.numpy as jnp
from packed_adamw.jax import _xla_step as X  # noqa
from packed_adamw.core.adamw import numpy_step
from packed_adamw.core.adamw.hyperparams import SCALAR_INDEX
F32 = np.float32
rng = np.random.default_rng(0)
n = 1 << 16
p = rng.standard_normal(n).astype(F32) * F32(0.02)
g = rng.standard_normal(n).astype(F32) * F32(1e-3)
m = rng.standard_normal(n).astype(F32) * F32(1e-4)
v = np.abs(rng.standard_normal(n).astype(F32)) * F32(1e-6)
row = numpy_step.step_scalar_row(7, (3e-4, 0.9, 0.95, 1e-8, 0.1))
s = {k: F32(row[i]) for k, i in SCALAR_INDEX.items()}
print("device", jax.devices()[0], "scalars", {k: float(x) for k, x in s.items()})
def np_chain():
    out = {}
    out["b1m"] = s["b1"] * m; out["omb1g"] = s["one_minus_b1"] * g
    out["m_next"] = out["b1m"] + out["omb1g"]
    out["gg"] = g * g; out["b2v"] = s["b2"] * v; out["omb2gg"] = s["one_minus_b2"] * out["gg"]
    out["v_next"] = out["b2v"] + out["omb2gg"]
    out["rms_next"] = np.sqrt(out["v_next"])
    out["rms_ibc"] = out["rms_next"] * s["inv_sqrt_bias_correction2"]
    out["denom"] = out["rms_ibc"] + s["eps"]
    out["ratio"] = out["m_next"] / out["denom"]
    out["ss_ratio"] = s["step_size"] * out["ratio"]
    out["lrwd_p"] = s["lr_wd"] * p
    out["update"] = -(out["ss_ratio"] + out["lrwd_p"])
    out["p_next"] = p + out["update"]
    return out
ref = np_chain()
def jx_chain(p, g, m, v, sv, count):
    guard = X.contraction_guard(count)
    r = lambda x: X._rounded(x, guard)
    S = {k: sv[i] for k, i in SCALAR_INDEX.items()}
    out = {}
    out["b1m"] = r(S["b1"] * m); out["omb1g"] = r(S["one_minus_b1"] * g)
    out["m_next"] = out["b1m"] + out["omb1g"]
    out["gg"] = g * g; out["b2v"] = r(S["b2"] * v); out["omb2gg"] = r(S["one_minus_b2"] * out["gg"])
    out["v_next"] = out["b2v"] + out["omb2gg"]
    out["rms_next"] = jnp.sqrt(out["v_next"])
    out["rms_ibc"] = r(out["rms_next"] * S["inv_sqrt_bias_correction2"])
    out["denom"] = out["rms_ibc"] + S["eps"]
    out["ratio"] = out["m_next"] / out["denom"]
    out["ss_ratio"] = r(S["step_size"] * out["ratio"])
    out["lrwd_p"] = r(S["lr_wd"] * p)
    out["update"] = X._negated(out["ss_ratio"] + out["lrwd_p"])
    out["p_next"] = p + out["update"]
    return out
sv = np.array([row[i] for i in range(len(row))], F32)
args = [jnp.asarray(a) for a in (p, g, m, v, sv)] + [jnp.int32(7)]
got = jax.jit(jx_chain)(*args)
for k in ref:
    a, b = np.asarray(got[k]), ref[k]
    d = a.view(np.uint32) != b.view(np.uint32)
    first = np.flatnonzero(d)[:1]
    extra = f" first at {first[0]}: jax {a[first[0]]!r} numpy {b[first[0]]!r}" if first.size else ""
    print(f"{k:10s} differs in {int(d.sum()):6d} of {n}{extra}")
# each op alone, its inputs from numpy (isolates the op's own rounding)
single = {
 "div": (lambda a, b: a / b, (ref["m_next"], ref["denom"]), ref["ratio"]),
 "sqrt": (lambda a: jnp.sqrt(a), (ref["v_next"],), ref["rms_next"]),
 "mul": (lambda a, b: a * b, (ref["rms_next"], np.full(n, s["inv_sqrt_bias_correction2"], F32)), ref["rms_ibc"]),
}
for name, (f, ins, want) in single.items():
    out = np.asarray(jax.jit(f)(*[jnp.asarray(x) for x in ins]))
    print(f"alone {name:5s} differs in {int((out.view(np.uint32) != want.view(np.uint32)).sum())} of {n}")
# the module's own float64 division and square root (`_divide`, `_sqrt`), alone and in `element_step`
# (with the guard, as the step calls them, and without: LLVM narrows an unguarded float64
# division of widened float32 operands back to float32's)
for name, f, ins, want in (("_divide", X._divide, (ref["m_next"], ref["denom"]), ref["ratio"]),
                           ("_sqrt", X._sqrt, (ref["v_next"],), ref["rms_next"])):
    for guarded in (True, False):
        g = (lambda *a: f(*a[:-1], X.contraction_guard(a[-1]))) if guarded else (lambda *a: f(*a[:-1], None))
        ins_count = [jnp.asarray(x) for x in ins] + [jnp.int32(7)]
        compiled = jax.jit(g).lower(*ins_count).compile()
        out = np.asarray(compiled(*ins_count))
        print(f"alone {name:8s} {'guarded' if guarded else 'unguarded':9s} differs in "
              f"{int((out.view(np.uint32) != want.view(np.uint32)).sum())} of {n}; "
              f"float64 in the compiled HLO: {'f64' in compiled.as_text()}")


class _Fp32:
    mode = "fp32"


def module_step(p, g, m, v, sv, count):
    S = {k: sv[i] for k, i in SCALAR_INDEX.items()}
    return X.element_step(p, g, m, v, S, _Fp32, split=False, guard=X.contraction_guard(count))


update, p_next, m_next, v_next, _ = jax.jit(module_step)(*args)
for name, got_k, want in (("update", update, ref["update"]), ("p_next", p_next, ref["p_next"]),
                          ("m_next", m_next, ref["m_next"]), ("v_next", v_next, ref["v_next"])):
    a = np.asarray(got_k)
    print(f"element_step {name:7s} differs in {int((a.view(np.uint32) != want.view(np.uint32)).sum())} of {n}")
# the step scalars the XLA step derives in the graph (`step_scalars`: powers, division, square
# root) against numpy's `step_scalar_row`, over counts and hyperparameter rows

hp_rows = np.array([(3e-4, 0.9, 0.95, 1e-8, 0.1), (1e-3, 0.9, 0.999, 1e-8, 0.01), (6e-4, 0.8, 0.95, 1e-6, 0.0),
                    (2e-2, 0.95, 0.98, 1e-10, 0.05)], F32)
counts = list(range(1, 65)) + [100, 257, 1000, 4097, 100_000, 2**31 - 1]
scalars_of = jax.jit(lambda h, c: X.step_scalars(h, c, X.contraction_guard(c)))
bad = {}
for c in counts:
    got_rows = np.asarray(scalars_of(jnp.asarray(hp_rows), jnp.int32(c)))
    for h, got_row in zip(hp_rows, got_rows):
        want_row = np.array(numpy_step.step_scalar_row(c, tuple(h)), F32)
        for name, i in SCALAR_INDEX.items():
            if got_row[i].view(np.uint32) != want_row[i].view(np.uint32):
                bad.setdefault(name, []).append((c, float(h[0]), float(h[1]), float(h[2]), float(got_row[i]), float(want_row[i])))
print(f"step_scalars: {len(counts) * len(hp_rows)} rows; fields differing: "
      + (", ".join(f"{k} in {len(v)} (first {v[0]})" for k, v in bad.items()) or "none"))
import os  # noqa: E402
if os.environ.get("HLO_OUT"):  # the optimized HLO of element_step, to read where it rounds
    with open(os.environ["HLO_OUT"], "w") as f:
        f.write(jax.jit(module_step).lower(*args).compile().as_text())
