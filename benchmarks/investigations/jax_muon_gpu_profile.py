"""Where packed_muon's GPU step spends its time (issue 37's JAX target: 0.3x optax.contrib.muon
on the d12 list), on a GPU with jax-triton:

    python benchmarks/investigations/jax_muon_gpu_profile.py [--list d12]

Prints (1) the copies XLA's compiled step makes (a `copy` in the optimized HLO moves a whole
buffer; an aliased custom call whose operand is still live gets one), (2) the step's time beside
its parts timed alone in the same run: Newton-Schulz of each shape group's stacked buffer, the
momentum launches and the weight launches, and (3) a jax.profiler trace's per-kernel GPU time
when --trace DIR is given.
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_muon import LISTS, matrices  # noqa: E402

from packed_adamw.core.muon import ns_kernel  # noqa: E402
from packed_adamw.jax import muon as jax_muon  # noqa: E402
from packed_adamw.jax import packed_muon  # noqa: E402
from packed_adamw.jax import _muon_triton  # noqa: E402


def timed(fn, *args, steps=10, repeats=3) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - begin) * 1e3 / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", default="d12", choices=LISTS)
    parser.add_argument("--trace", help="also write a jax.profiler trace here")
    parser.add_argument("--hlo-dir", help="also write each step's optimized HLO here")
    args = parser.parse_args()
    shapes = matrices(args.list)
    rng = np.random.default_rng(0)
    params = {f"m{i:03d}": jnp.asarray((rng.standard_normal((c, r)) * 0.02).astype(np.float32))
              for i, (r, c) in enumerate(shapes)}
    grads = {k: jnp.asarray((rng.standard_normal(v.shape) * 1e-3).astype(np.float32)) for k, v in params.items()}
    print(f"{args.list}: {len(shapes)} matrices, {sum(r * c for r, c in shapes):,} elements; {jax.devices()[0]}")

    rows = {}
    for name, tx in (("optax.contrib.muon", optax.contrib.muon(0.02, beta=0.95)),
                     ("packed_muon", packed_muon(0.02, beta=0.95))):
        def step(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        state = tx.init(params)
        compiled = jax.jit(step).lower(params, state, grads).compile()
        text = compiled.as_text()
        if args.hlo_dir:
            Path(args.hlo_dir, name.replace(".", "_") + ".hlo.txt").write_text(text)
        copies = collections.Counter(m.group(1) for m in re.finditer(r"= (\S+\[[^\]]*\])\S* copy\(", text))
        custom = len(re.findall(r"custom-call\(", text))
        fusions = len(re.findall(r"= \S+ fusion\(", text))
        print(f"{name}: optimized HLO has {sum(copies.values())} copies, {custom} custom calls, {fusions} fusions")
        for shape, count in copies.most_common(8):
            print(f"    copy {shape} x{count}")
        stepper = jax.jit(step)
        rows[name] = timed(stepper, params, state, grads)

    # The parts, each jitted alone on the shape groups the step forms.
    groups = collections.Counter(_muon_triton_wide(r, c) for r, c in shapes)
    coefficients = jax_muon.DEFAULT_NS_COEFFICIENTS
    ns_scalars = jnp.asarray(ns_kernel.ns_scalars(coefficients, 1e-7))
    ns_ms = 0.0
    for (k, n), count in groups.items():
        x = jax.lax.bitcast_convert_type(
            jnp.asarray((rng.standard_normal((count, k, n)) * 1e-3).astype(np.float32)).astype(jnp.bfloat16), jnp.int16)
        ms = timed(jax.jit(lambda x: _muon_triton.newton_schulz(x, ns_scalars, jax_muon.DEFAULT_NS_STEPS)), x)
        print(f"Newton-Schulz alone, group {count} x [{k}, {n}]: {ms:.3f} ms")
        ns_ms += ms
    rows["Newton-Schulz alone (sum of groups)"] = ns_ms
    base = rows["optax.contrib.muon"]
    for name, ms in rows.items():
        print(f"{name:40s} {ms:8.3f} ms  {ms / base:.2f}x optax.contrib.muon")

    if args.trace:
        tx = packed_muon(0.02, beta=0.95)
        state = tx.init(params)

        @jax.jit
        def step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        jax.block_until_ready(step(params, state, grads))
        with jax.profiler.trace(args.trace):
            for _ in range(3):
                out = step(params, state, grads)
            jax.block_until_ready(out)
        print(f"trace written to {args.trace}")


def _muon_triton_wide(rows: int, cols: int) -> tuple[int, int]:
    """The (k, n) shape group of a torch [rows, cols] matrix (its JAX leaf is [cols, rows])."""
    return (min(rows, cols), max(rows, cols))


if __name__ == "__main__":
    main()
