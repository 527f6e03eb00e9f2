"""The optax transform's step as XLA operations (jax_frontend/_xla_step.py) against the kernel
step and optax.adamw, in jitted train steps; plus whether the bits match the kernel's.

    python benchmarks/jax_xla_step.py                                   # the H200 sizes of issue 40
    python benchmarks/jax_xla_step.py --dim 256 --matrices 2 --leaf-elements 65536 --out /tmp/x.md

Steps timed, each `jax.jit(step, donate_argnums=(0, 1))` with parameters and state donated:

- train: the gradients come from `jax.grad` of a matrix-product loss `sum((x @ W_i) * y)` over
  `--matrices` float32 matrices of `--dim`^2 (x, y: `--batch` rows), then the optimizer and
  `optax.apply_updates`. "optimizer ms" subtracts the time of the same jitted gradient alone
  (an estimate: the optimizer can also change how XLA schedules the gradient);
- given: one float32 leaf of `--leaf-elements`, its gradient an argument the caller keeps.

Optimizers:

- `optax.adamw`;
- `packed_adamw (kernel)`: `impl="kernel"` (Triton kernel on CUDA, numpy callback on CPU),
  `reuse_grad_buffer` as the scenario suits (train: True; given: False, as docs advise);
- `packed_adamw (xla)`: `impl="xla"`, the step as XLA operations (`_xla_step.xla_step`; what
  the default `impl="auto"` takes on a GPU);
- `packed_adamw (xla, unguarded)`: the same without the contraction guards, to measure what
  they cost and whether the compiler contracts (its bits are reported, never to be trusted).

Bits: one step of each packed variant from the same parameters, state and gradients (the given
leaf, then the train step's matrices), compared bitwise with the kernel step: new parameters
and new state. On CPU the XLA step runs with XLA's FTZ/DAZ (module docstring of _xla_step.py),
so subnormal elements may differ there; on a GPU none may.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.jax import packed_adamw
from packed_adamw.jax import transform as packed_transform
from packed_adamw.jax._xla_step import xla_step

OPTIMIZERS = ["optax.adamw", "packed_adamw (kernel)", "packed_adamw (xla)", "packed_adamw (xla, unguarded)"]
IMPLS = {"packed_adamw (kernel)": "kernel", "packed_adamw (xla)": "xla", "packed_adamw (xla, unguarded)": "xla"}
LR = 1e-3


@contextlib.contextmanager
def step_impl(name: str):
    """While tracing optimizer `name`: for the unguarded row, the transform's XLA step without
    its contraction guards (a measurement, never offered)."""
    saved = packed_transform.xla_step
    # The staged step is a cached jit of whatever `xla_step` was when first traced: start each
    # row afresh, or the unguarded row would reuse the guarded row's compiled step.
    packed_transform._staged_step.cache_clear()
    if name == "packed_adamw (xla, unguarded)":
        packed_transform.xla_step = functools.partial(xla_step, contraction_barriers=False)
    try:
        yield
    finally:
        packed_transform.xla_step = saved
        packed_transform._staged_step.cache_clear()


def optimizer(name: str, mode: str, reuse_grad_buffer: bool):
    if name == "optax.adamw":
        return optax.adamw(LR, weight_decay=1e-2)
    return packed_adamw(LR, weight_decay=1e-2, mode=mode, reuse_grad_buffer=reuse_grad_buffer, impl=IMPLS[name])


def loss(params, x, y):
    return sum(jnp.sum((x @ w) * y) for w in params.values()) * np.float32(1e-4)


def train_problem(args, device):
    rng = np.random.default_rng(0)
    params = {f"w{i}": (rng.standard_normal((args.dim, args.dim), np.float32) * np.float32(0.02))
              for i in range(args.matrices)}
    x = rng.standard_normal((args.batch, args.dim), np.float32)
    y = rng.standard_normal((args.batch, args.dim), np.float32)
    return jax.device_put(params, device), jax.device_put(x, device), jax.device_put(y, device)


def given_problem(args, device):
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal(args.leaf_elements, np.float32) * np.float32(0.02)}
    grads = {"w": rng.standard_normal(args.leaf_elements, np.float32) * np.float32(1e-3)}
    return jax.device_put(params, device), jax.device_put(grads, device)


def build_step(name, scenario, mode):
    tx = optimizer(name, mode, reuse_grad_buffer=scenario == "train")

    def apply(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if scenario == "train":
        def step(params, state, x, y):
            return apply(params, state, jax.grad(loss)(params, x, y))
    else:
        step = apply
    return tx, step


def time_chained(compiled, params, state, rest, steps, rounds):
    """Median over `rounds` of the mean ms of `steps` chained calls (params, state donated)."""
    params, state = compiled(params, state, *rest)  # warm
    jax.block_until_ready((params, state))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            params, state = compiled(params, state, *rest)
        jax.block_until_ready((params, state))
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(samples)


def copied(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def run_scenario(scenario, args, device):
    """{optimizer: ms per step}, {optimizer: temporaries in bytes}, and for train the gradient's ms."""
    if scenario == "train":
        params, x, y = train_problem(args, device)
        rest = (x, y)
    else:
        params, grads = given_problem(args, device)
        rest = (grads,)
    times, temps = {}, {}
    for name in args.optimizers:
        tx, step = build_step(name, scenario, args.mode)
        state = tx.init(params)
        p = copied(params)
        with step_impl(name):
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, state, *rest).compile()
        temps[name] = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
        times[name] = time_chained(compiled, p, state, rest, args.steps, args.rounds)
    gradient_ms = None
    if scenario == "train":
        grad_only = jax.jit(jax.grad(loss))
        jax.block_until_ready(grad_only(params, x, y))
        samples = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                g = grad_only(params, x, y)
            jax.block_until_ready(g)
            samples.append((time.perf_counter() - start) / args.steps * 1e3)
        gradient_ms = statistics.median(samples)
    return times, temps, gradient_ms


def bits_against_kernel(scenario, args, device):
    """{packed optimizer: (differing parameter elements, differing state elements, total)}
    after one step from the same inputs, against the kernel step."""
    if scenario == "train":
        params, x, y = train_problem(args, device)
        rest = (x, y)
    else:
        params, grads = given_problem(args, device)
        rest = (grads,)
    names = [n for n in OPTIMIZERS[1:] if n in args.optimizers or n == OPTIMIZERS[1]]
    results = {}
    for name in names:
        tx, step = build_step(name, scenario, args.mode)
        state = tx.init(params)
        for _ in range(args.check_steps):  # later steps decode nonzero moments
            with step_impl(name):
                new_params, state = jax.jit(step)(params if _ == 0 else new_params, state, *rest)
        results[name] = (jax.device_get(new_params), jax.device_get(state.moments))
    kernel = results.pop(OPTIMIZERS[1])
    out = {}
    for name, (new_params, moments) in results.items():
        as_bits = lambda t: np.concatenate([np.asarray(a).reshape(-1).view(np.uint32)  # noqa: E731
                                            for a in jax.tree_util.tree_leaves(t)])
        p_diff = int(np.count_nonzero(as_bits(new_params) != as_bits(kernel[0])))
        s_diff = int(np.count_nonzero(as_bits(moments) != as_bits(kernel[1])))
        out[name] = (p_diff, s_diff, as_bits(new_params).size)
    return out


def versions() -> str:
    found = []
    for name in ["jax", "jaxlib", "optax", "jax_triton", "triton"]:
        try:
            found.append(f"{name} {getattr(__import__(name), '__version__', '?')}")
        except Exception:  # noqa: BLE001 - reported, not fatal
            found.append(f"{name} absent")
    return ", ".join(found)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=5792, help="train step: each matrix is dim x dim")
    parser.add_argument("--matrices", type=int, default=8, help="train step: how many matrices")
    parser.add_argument("--batch", type=int, default=64, help="train step: rows of x and y")
    parser.add_argument("--leaf-elements", type=int, default=1 << 28, help="given gradients: the leaf's size")
    parser.add_argument("--mode", default="packed", choices=["packed", "fp16", "fp32"])
    parser.add_argument("--steps", type=int, default=20, help="chained steps per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is reported)")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the bit comparison")
    parser.add_argument("--scenarios", nargs="+", default=["train", "given"], choices=["train", "given"])
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS)
    parser.add_argument("--out", help="also write the markdown report here")
    args = parser.parse_args(argv)
    for name in ("dim", "matrices", "batch", "leaf_elements", "steps", "rounds", "check_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    device = jax.devices()[0]
    if device.platform != "gpu":  # the transform refuses impl="xla" off CUDA GPUs (XLA's CPU flushes subnormals)
        dropped = [name for name in args.optimizers if IMPLS.get(name) == "xla"]
        args.optimizers = [name for name in args.optimizers if name not in dropped]
        if dropped:
            print(f"on {device.platform}: leaving out {', '.join(dropped)} (impl='xla' runs on CUDA GPUs only)")
    report = [
        "# The optax transform's step as XLA operations",
        "",
        f"- Date: {datetime.date.today().isoformat()}; device {device.device_kind} ({device.platform}); "
        f"{versions()}; Python {platform.python_version()}",
        f"- Command: `python benchmarks/jax_xla_step.py {' '.join(argv) if argv else ''}`".rstrip() + " (mode "
        f"{args.mode}; ms per step: median of {args.rounds} rounds of {args.steps} chained steps, parameters and "
        "state donated; temporaries: XLA's `memory_analysis()`)",
    ]
    for scenario in args.scenarios:
        times, temps, gradient_ms = run_scenario(scenario, args, device)
        if scenario == "train":
            n = args.matrices * args.dim * args.dim
            report += ["", f"## Train step: {args.matrices} matrices of {args.dim}^2 ({n:,} parameters), gradients "
                       "from jax.grad in the step", "", f"Gradient alone: {gradient_ms:.3f} ms.", ""]
        else:
            n = args.leaf_elements
            report += ["", f"## Gradients passed in: one leaf of {n:,} parameters", ""]
        base = times.get("optax.adamw")
        optimizer_ms = {k: (v - gradient_ms if gradient_ms is not None else v) for k, v in times.items()}
        report += ["| optimizer | ms per step | optimizer ms | vs optax.adamw (optimizer ms) | temporaries B/param |",
                   "|---|---|---|---|---|"]
        for name, ms in times.items():
            ratio = (f"{optimizer_ms[name] / optimizer_ms['optax.adamw']:.2f}x"
                     if base is not None and optimizer_ms["optax.adamw"] > 0 else "n/a")
            temp = f"{temps[name] / n:.2f}" if temps[name] is not None else "n/a"
            report.append(f"| {name} | {ms:.3f} | {optimizer_ms[name]:.3f} | {ratio} | {temp} |")
        if any(IMPLS.get(name) == "xla" for name in args.optimizers):
            report += ["", f"Bits after {args.check_steps} steps against `packed_adamw (kernel)` (parameters, "
                       "state words):", ""]
            for name, (p_diff, s_diff, total) in bits_against_kernel(scenario, args, device).items():
                verdict = "equal" if p_diff == s_diff == 0 else f"{p_diff:,} parameters and {s_diff:,} words differ"
                report.append(f"- {name}: {verdict} (of {total:,})")
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
