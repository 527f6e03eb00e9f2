"""Device memory of one JAX optimizer step on one leaf, in bytes per parameter.

    python benchmarks/bench_jax_memory.py                       # writes docs/results/JAX_MEMORY.md
    python benchmarks/bench_jax_memory.py --elements 1048576 --out /tmp/mem.md

Each configuration runs in a process of its own (so its peak is its own), with
XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX then allocates what it uses instead of most of the GPU)
and XLA_FLAGS=--xla_gpu_autotune_level=0 (GEMM autotuning would allocate matrix-sized buffers
while compiling, and the process peak would be the compiler's, not the step's),
on one float32 leaf of `--elements` parameters (default 2**27, 512 MiB), a matrix W:

- `optax.adamw`: `tx.update` + `optax.apply_updates` under `jax.jit`;
- `packed transform (kernel)`: `packed_adamw(impl="kernel")`'s `tx.update` +
  `optax.apply_updates`, the same way, with the update written into the gradient's buffer
  (`reuse_grad_buffer=True`, the default) and without;
- `packed transform (xla)`: `impl="xla"`, the step as XLA operations (`impl="auto"`'s on a GPU);
- `packed fused step (kernel)`, `packed fused step (xla)`: `packed_adamw_fused_step`.

Two kinds of step, each `jax.jit(step, donate_argnums=(0, 1))` with the parameters and the
state donated:

- train step: the gradient is computed in the step, from a matrix-product loss
  `sum((x @ W) * y)` (x, y: 64 rows), so XLA materializes it as backpropagation would;
- gradients passed in: the gradient is an argument that the caller keeps (as in
  benchmarks/bench_step.py); donating it would not help, as JAX passes a donated argument to
  XLA only where an output of the same shape takes its buffer.

The inputs are copied to the device from host arrays, so nothing but the arrays themselves is
allocated before the step. Reported, from `jax.devices()[0].memory_stats()`: `bytes_in_use`
with the inputs resident (before the step), `peak_bytes_in_use` of the process (the step's
peak: nothing before it allocates more) and `bytes_in_use` after the step, and XLA's
`memory_analysis()` temporaries of the compiled step; then the step's time (median over 5
rounds of 20 chained steps, the train step's time including its matrix products).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ["optax.adamw", "packed transform (kernel)", "packed transform (kernel), reuse_grad_buffer=False",
           "packed transform (xla)", "packed fused step (kernel)", "packed fused step (xla)"]
SCENARIOS = {"train": "train step (gradient computed in the step)",
             "given": "gradients passed in (kept by the caller)"}
BATCH = 64
REPO = Path(__file__).resolve().parents[1]


def matrix_shape(n: int) -> tuple[int, int]:
    rows = 1 << (max(n.bit_length() - 1, 0) // 2)
    if n % rows:
        raise SystemExit(f"--elements {n}: use a power of two")
    return rows, n // rows


def child(config: str, scenario: str, n: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from packed_adamw.jax import packed_adamw, packed_adamw_fused_step

    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    rows, cols = matrix_shape(n)
    params = {"w": jax.device_put((rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05)), device)}
    x = jax.device_put(rng.standard_normal((BATCH, rows), dtype=np.float32), device)
    y = jax.device_put(rng.standard_normal((BATCH, cols), dtype=np.float32), device)
    impl = "xla" if "(xla)" in config else "kernel"
    tx = optax.adamw(1e-3) if config == "optax.adamw" else packed_adamw(
        1e-3, reuse_grad_buffer=not config.endswith("reuse_grad_buffer=False"), impl=impl)
    state = tx.init(params)
    fused = packed_adamw_fused_step(1e-3, impl=impl)

    def apply(params, state, grads):
        if config.startswith("packed fused step"):
            return fused(params, grads, state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def loss(params, x, y):
        return jnp.sum((x @ params["w"]) * y) * 1e-4

    if scenario == "train":
        def step(params, state, x, y):
            return apply(params, state, jax.grad(loss)(params, x, y))

        args = (params, state, x, y)
    else:
        grads = {"w": jax.device_put(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(1e-3), device)}
        del x, y

        def step(params, state, grads):
            return apply(params, state, grads)

        args = (params, state, grads)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    jax.block_until_ready(args)
    before = device.memory_stats() or {}  # None where the platform keeps no statistics (CPU)
    params, state = compiled(*args)
    jax.block_until_ready((params, state))
    after = device.memory_stats() or {}
    analysis = compiled.memory_analysis()
    # Then the step's time: median over 5 rounds of the mean of 20 chained steps.
    rest = args[2:]
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            params, state = compiled(params, state, *rest)
        jax.block_until_ready((params, state))
        samples.append((time.perf_counter() - start) / 20 * 1e3)
    return {
        "ms": statistics.median(samples),
        "config": config,
        "scenario": scenario,
        "elements": n,
        "device": device.device_kind,
        "resident_before": before.get("bytes_in_use"),
        "peak": after.get("peak_bytes_in_use"),
        "resident_after": after.get("bytes_in_use"),
        "temp": getattr(analysis, "temp_size_in_bytes", None),
    }


def versions() -> str:
    names = ["jax", "jaxlib", "optax", "jax_triton", "triton"]
    found = []
    for name in names:
        try:
            module = __import__(name)
            found.append(f"{name} {getattr(module, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            found.append(f"{name} absent")
    return ", ".join(found)


def table(rows: list[dict]) -> list[str]:
    n = rows[0]["elements"]
    per = lambda b: f"{b / n:.2f}" if b is not None else "n/a"  # noqa: E731
    lines = ["| step | resident before | peak during the step | resident after | XLA temporaries | ms per step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {per(r['resident_before'])} | {per(r['peak'])} | {per(r['resident_after'])} "
                     f"| {per(r['temp'])} | {r['ms']:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 27)
    parser.add_argument("--out", default=str(REPO / "docs" / "results" / "JAX_MEMORY.md"))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    matrix_shape(args.elements)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.scenario, args.elements)), flush=True)
        return

    # XLA's GEMM autotuning allocates buffers of the matrix product's size while compiling,
    # which would set the process peak before the step runs: the children compile without it.
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=flags)
    results = {scenario: [] for scenario in SCENARIOS}
    for scenario in SCENARIOS:
        for config in CONFIGS:
            done = subprocess.run([sys.executable, __file__, "--child", config, "--scenario", scenario,
                                   "--elements", str(args.elements)], capture_output=True, text=True, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"{config} ({scenario}) failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-4000:]}")
            results[scenario].append(json.loads(lines[-1][len("RESULT "):]))
    rows = results["train"]

    command = "python benchmarks/bench_jax_memory.py" + ("" if args.elements == 1 << 27 else f" --elements {args.elements}")
    report = [
        "# JAX step memory",
        "",
        f"- Date: {datetime.date.today().isoformat()}; device {rows[0]['device']}; {versions()}; "
        f"Python {platform.python_version()}",
        f"- Command: `{command}` (each configuration in its own process, XLA_PYTHON_CLIENT_PREALLOCATE=false, "
        "XLA_FLAGS=--xla_gpu_autotune_level=0)",
        f"- One float32 leaf of {args.elements:,} elements (a {' x '.join(map(str, matrix_shape(args.elements)))} "
        "matrix); `jax.jit(step, donate_argnums=(0, 1))` with the parameters and state donated; bytes per "
        "parameter from `memory_stats()` (peak: `peak_bytes_in_use` of the process) and XLA's "
        "`memory_analysis()`; milliseconds per step (median of 5 rounds of 20 chained steps). The docstring of "
        "benchmarks/bench_jax_memory.py describes both steps.",
    ]
    for scenario, title in SCENARIOS.items():
        report += ["", f"## {title[0].upper()}{title[1:]}", "", *table(results[scenario])]
    report.append("")
    text = "\n".join(report)
    print(text)
    from packed_adamw.core.atomic_file import atomic_write

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, text.encode())


if __name__ == "__main__":
    main()
