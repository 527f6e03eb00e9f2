"""Times the JAX step's leaf-group launches on one CUDA GPU, on model-shaped leaf lists.

    python benchmarks/jax_leaf_group_timing.py --out /tmp/leaf_groups_new.md
    python benchmarks/jax_leaf_group_timing.py --dtype bfloat16 --track-format --out /tmp/bf16.md

Uses only the public API (`packed_adamw`, `packed_adamw_fused_step`), so the same file times
any tree: run it with one checkout installed, then another, on the same machine, and compare
(the table's first line names the tree whose package was imported).
Leaves below launch.SOLO_ELEMENTS share leaf-group launches (up to 16 leaves each); GPT-2's
embedding launches alone. Rows, each for GPT-2 small's and the reference GPT's leaf list:

- the fused step, `jax.jit(packed_adamw_fused_step(...), donate_argnums=(0, 2))`;
- the transform, `tx.update` + `optax.apply_updates` under `jax.jit` with the parameters and
  state donated (the gradients are an argument the caller keeps, so `reuse_grad_buffer=False`);

each timed one step per jitted call (with JAX's dispatch of every buffer) and LOOP steps per
call inside `lax.fori_loop` (the optimizer's own cost). "first call" is the wall time of the
first call: tracing and compiling, the leaf-group kernels' compilation included.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

LOOP = 20  # steps per jitted call in the looped rows
REPEATS = 7


def leaf_lists() -> dict[str, list[tuple[int, ...]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_step import gpt_shapes, reference_gpt_shapes  # one home for the lists

    return {"GPT-2 small (124M)": gpt_shapes(50257, 768, 12, 1024), "reference GPT": reference_gpt_shapes()}


def time_steps(shapes, *, dtype: str, mode: str, track_format: bool) -> dict[str, tuple[float, float]]:
    """Per row: (first call in s, median ms per step over REPEATS rounds)."""
    import jax
    import jax.numpy as jnp
    import optax

    from packed_adamw.jax import packed_adamw, packed_adamw_fused_step

    key = jax.random.PRNGKey(0)
    params = {f"{i:04d}": jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dtype)
              for i, s in enumerate(shapes)}
    grads = jax.tree_util.tree_map(lambda p: (p * 1e-3).astype(p.dtype), params)
    tx = packed_adamw(1e-3, mode=mode, reuse_grad_buffer=False, track_format=track_format)
    fused = packed_adamw_fused_step(1e-3, mode=mode, track_format=track_format)

    def transform(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state  # (back in the leaf's dtype)

    steps = {"fused step": lambda params, state, grads: fused(params, grads, state), "transform + apply": transform}
    results = {}
    for name, step in steps.items():
        one = jax.jit(step, donate_argnums=(0, 1))
        looped = jax.jit(lambda params, state, grads, step=step: jax.lax.fori_loop(
            0, LOOP, lambda _, carry: step(*carry, grads), (params, state)), donate_argnums=(0, 1))
        for label, fn, per_call in ((f"{name}, 1 step per call", one, 1),
                                    (f"{name}, {LOOP} steps per call", looped, LOOP)):
            carry = (jax.tree_util.tree_map(jnp.copy, params), tx.init(params))
            start = time.perf_counter()
            carry = jax.block_until_ready(fn(*carry, grads))
            first = time.perf_counter() - start
            calls = LOOP // per_call  # LOOP steps a round either way
            samples = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                for _ in range(calls):
                    carry = fn(*carry, grads)
                jax.block_until_ready(carry)
                samples.append((time.perf_counter() - start) * 1e3 / LOOP)
            results[label] = (first, statistics.median(samples))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the leaves' dtype (bfloat16: split masters, the split leaf-group launches)")
    parser.add_argument("--mode", choices=("packed", "fp16", "fp32"), default="packed")
    parser.add_argument("--track-format", action="store_true", help="count formats (the counting launches)")
    args = parser.parse_args(argv)
    if args.track_format and args.mode == "fp32":
        parser.error("--track-format counts packed or fp16 codes; fp32 mode has none")

    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit(f"jax_leaf_group_timing.py times CUDA launches; JAX's backend here is "
                         f"{jax.default_backend()!r}: run it on a GPU host with a CUDA jaxlib and jax-triton")
    import packed_adamw.jax
    from packed_adamw.core import launch

    # Which tree was timed: the package imported, not the folder this script sits in.
    tree = Path(packed_adamw.jax.__file__).resolve().parents[1]
    lines = [f"JAX leaf-group timing of {tree} on {jax.devices()[0].device_kind}, jax {jax.__version__}: "
             f"dtype {args.dtype}, mode {args.mode}, track_format={args.track_format}; median of {REPEATS} rounds", "",
             "| leaf list | leaves (grouped / alone) | step | first call (s) | ms per step |", "|---|---|---|---|---|"]
    for list_name, shapes in leaf_lists().items():
        sizes = [math.prod(s) for s in shapes]
        alone = sum(n >= launch.SOLO_ELEMENTS for n in sizes)
        for label, (first, ms) in time_steps(shapes, dtype=args.dtype, mode=args.mode,
                                             track_format=args.track_format).items():
            lines.append(f"| {list_name} | {len(sizes) - alone} / {alone} | {label} | {first:.2f} | {ms:.4f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
