"""Where packed_muon's GPU step spends its time (issue 37's JAX target: 0.3x optax.contrib.muon
on the d12 list), on a GPU with jax-triton:

    python benchmarks/investigations/jax_muon_gpu_profile.py [--list d12] [--hlo-dir DIR] [--trace DIR]

Prints (1) the buffer copies, custom calls and fusions of the compiled step's entry computation
(a `copy` there moves a whole buffer; an aliased custom call whose operand is still live gets
one), for packed_muon and optax.contrib.muon, the step compiled and timed as
benchmarks/muon_ns_timing.py does (donated); (2) the step times beside Newton-Schulz alone over
the step's shape groups, in the same run; (3) with --trace, a jax.profiler trace of three steps
(per-kernel GPU times, read with TensorBoard or Perfetto). With --stacked, the matrices of
one shape are one leaf [count, in, out] for both optimizers.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_muon import LISTS, matrices  # noqa: E402
from bench_step import jax_time_ms  # noqa: E402
from muon_ns_timing import jax_optimizers, jax_problem, jax_step_ms, jax_train_step  # noqa: E402

from packed_adamw.core.muon import ns_kernel  # noqa: E402
from packed_adamw.jax import muon as jax_muon  # noqa: E402
from packed_adamw.jax import _muon_triton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", default="d12", choices=LISTS)
    parser.add_argument("--trace", help="also write a jax.profiler trace here")
    parser.add_argument("--hlo-dir", help="also write each step's optimized HLO here")
    parser.add_argument("--stacked", action="store_true",
                        help="the list's matrices of one shape stacked in one leaf [count, in, out] (batch axis 0), "
                             "for both optimizers: what a leaf's own launches cost")
    args = parser.parse_args()
    shapes = matrices(args.list)
    params, grads = jax_problem(shapes)
    optimizers = jax_optimizers()
    if args.stacked:
        params, grads, optimizers = stacked_problem(params, grads)
    rng = np.random.default_rng(1)
    print(f"{args.list}: {len(shapes)} matrices, {sum(r * c for r, c in shapes):,} elements; {jax.devices()[0]}")

    rows = {}
    for name, tx in optimizers.items():
        # the step as muon_ns_timing.py times it (donated), compiled here to read its HLO
        state = tx.init(params)
        text = jax_train_step(tx).lower(params, state, grads).compile().as_text()
        if args.hlo_dir:
            Path(args.hlo_dir, name.split(" ")[0].replace(".", "_") + ".hlo.txt").write_text(text)
        entry = text[text.index("\nENTRY "):]  # fused computations' bodies hold no buffers of their own
        entry = entry[:entry.index("\n}")]
        # a copy instruction, or a fusion wrapping one (XLA names both after the copy)
        copies = collections.Counter(m.group(1) for m in re.finditer(r"%\S*copy\S* = (\S+\[[^\]]*\])", entry))
        custom = len(re.findall(r" custom-call\(", entry))
        fusions = len(re.findall(r" fusion\(", entry))
        print(f"{name}: the entry computation has {sum(copies.values())} copies, {custom} custom calls, {fusions} fusions")
        for shape, count in copies.most_common(8):
            print(f"    copy {shape} x{count}")
        rows[name] = jax_step_ms(tx, params, grads, steps=10, repeats=3)

    # The parts, each jitted alone on the shape groups the step forms.
    groups = collections.Counter(_muon_triton_wide(r, c) for r, c in shapes)
    coefficients = jax_muon.DEFAULT_NS_COEFFICIENTS
    ns_scalars = jnp.asarray(ns_kernel.ns_scalars(coefficients, 1e-7))
    ns_ms = 0.0
    for (k, n), count in groups.items():
        x = jax.lax.bitcast_convert_type(
            jnp.asarray((rng.standard_normal((count, k, n)) * 1e-3).astype(np.float32)).astype(jnp.bfloat16), jnp.int16)
        ns = jax.jit(lambda x: (_muon_triton.newton_schulz(x, ns_scalars, jax_muon.DEFAULT_NS_STEPS),))
        ms = jax_time_ms(ns, (x,), steps=10, repeats=3)  # each result the next input: same shape and dtype
        print(f"Newton-Schulz alone, group {count} x [{k}, {n}]: {ms:.3f} ms")
        ns_ms += ms
    rows["Newton-Schulz alone (sum of groups)"] = ns_ms
    base = rows["optax.contrib.muon"]  # ratios as muon_ns_timing.py's JAX rows
    for name, ms in rows.items():
        print(f"{name:40s} {ms:8.3f} ms  {ms / base:.2f}x optax.contrib.muon")

    if args.trace:
        tx = optimizers["packed_muon (GPU, Triton NS)"]
        step = jax_train_step(tx)
        p, state = jax.tree.map(jnp.copy, params), tx.init(params)
        p, state = step(p, state, grads)
        jax.block_until_ready(p)
        with jax.profiler.trace(args.trace):
            for _ in range(3):
                p, state = step(p, state, grads)
            jax.block_until_ready(p)
        print(f"trace written to {args.trace}")


def stacked_problem(params, grads):
    """The leaves of one shape stacked into one [count, in, out] leaf, and the two optimizers
    told so (`muon_weight_dimension_numbers`: axis 0 a batch of matrices)."""
    import optax

    by_shape = collections.defaultdict(list)
    for key, leaf in params.items():
        by_shape[leaf.shape].append(key)
    stack = lambda tree: {f"s{i}": jnp.stack([tree[k] for k in keys])  # noqa: E731
                          for i, keys in enumerate(by_shape.values())}
    stacked_params, stacked_grads = stack(params), stack(grads)
    spec = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    dims = {k: spec for k in stacked_params}
    optimizers = {"optax.contrib.muon": optax.contrib.muon(0.02, beta=0.95, muon_weight_dimension_numbers=dims),
                  "packed_muon (GPU, Triton NS)": jax_muon.packed_muon(0.02, beta=0.95,
                                                                       muon_weight_dimension_numbers=dims)}
    print(f"stacked: {len(stacked_params)} leaves " + ", ".join(str(v.shape) for v in stacked_params.values()))
    return stacked_params, stacked_grads, optimizers


def _muon_triton_wide(rows: int, cols: int) -> tuple[int, int]:
    """The (k, n) shape group of a torch [rows, cols] matrix (its JAX leaf is [cols, rows])."""
    return (min(rows, cols), max(rows, cols))


if __name__ == "__main__":
    main()
