"""Optimizer step speed and memory on one CUDA GPU, every number a ratio to a peer in this run.

    python benchmarks/bench_step.py --out docs/results/BENCHMARKS.md --json docs/results/benchmarks.json

Peers: torch.optim.AdamW(fused=True) and optax.adamw under jax.jit with donated buffers.
Floor: 20 bytes/parameter (read p, g, word; write p, word) at the copy bandwidth measured here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys

import torch

from packed_adamw.torch import PackedAdamW

BIG = 268_435_456  # one 1 GiB FP32 tensor
LIST_ROUNDS = 5
LOOP = 20  # JAX steps inside one jitted call (lax.fori_loop), for the lists


# ---- parameter lists ----------------------------------------------------------------------
def gpt_shapes(vocab, d, layers, context, mlp=4):
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp * d, d), (mlp * d,), (d, mlp * d), (d,)]
    return shapes + [(d,), (d,)]


def reference_gpt_shapes():
    """The parameter list of packed_adamw.torch.gpt's reference model, as it trains."""
    from packed_adamw.torch.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(GPTConfig.preset("reference")).parameters()]


SHAPE_LISTS = {
    "reference GPT (d 288, 8 layers, tied head)": reference_gpt_shapes(),
    "GPT-2 124M": gpt_shapes(50257, 768, 12, 1024),
    "1.3B (d 2048, 24 layers)": gpt_shapes(50257, 2048, 24, 2048),
}


# ---- timing -----------------------------------------------------------------------------------
def cuda_time_ms(fn, steps=20, repeats=5) -> float:
    """Median over `repeats` of the mean time of `steps` back-to-back calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / steps)
    return statistics.median(samples)


def jax_time_ms(fn, state, steps=20, repeats=5) -> float:
    import time

    import jax

    state = fn(*state)
    jax.block_until_ready(state)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state = fn(*state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes/ms of a device-to-device copy (read + write counted)."""
    a = torch.empty(BIG, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a))
    return 2 * 4 * BIG / ms


# ---- torch --------------------------------------------------------------------------------------
def make_params(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
    return params


def torch_step_ms(shapes, make_opt) -> float:
    params = make_params(shapes)
    opt = make_opt(params)
    t = cuda_time_ms(opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return t


def captured_step_ms(shapes, make_opt, before_capture=lambda opt: None) -> float:
    """One optimizer step captured in a CUDA graph (after warm-up steps on a side stream, as
    torch.cuda.graph asks), timed by its replays."""
    params = make_params(shapes)
    opt = make_opt(params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    before_capture(opt)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    t = cuda_time_ms(graph.replay)
    del graph, opt, params
    torch.cuda.empty_cache()
    return t


def without_direct_relaunch(fn):
    """fn() with the step plan's direct relaunch of the compiled kernel switched off: what the
    shim over Triton's internals saves (torch_frontend/_launch.py)."""
    from packed_adamw.torch import _launch

    _launch._Relaunch.enabled = False
    try:
        return fn()
    finally:
        _launch._Relaunch.enabled = True


def state_bytes_per_param(mode) -> float:
    n = 1 << 26
    p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
    p.grad = torch.zeros_like(p)
    opt = PackedAdamW([p], mode=mode)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_allocated() - before) / n


# ---- jax ------------------------------------------------------------------------------------------
def jax_steps_ms(shapes):
    import jax
    import jax.numpy as jnp
    import optax

    from packed_adamw.jax import packed_adamw, packed_adamw_fused_step

    key = jax.random.PRNGKey(0)
    params = {f"{i:04d}": jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) for i, s in enumerate(shapes)}
    grads = jax.tree_util.tree_map(lambda p: p * 1e-3, params)
    results = {}

    # Each step takes (params, state) and the same gradients, and returns (params, state) with
    # params and state donated. (Returning the gradients too would add a copy of them.)
    def transform_loop(tx):
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(step, donate_argnums=(0, 1))
        return lambda params, state: step(params, state, grads)

    tx = optax.adamw(1e-3)
    results["optax.adamw"] = jax_time_ms(transform_loop(tx), (jax.tree_util.tree_map(jnp.copy, params), tx.init(params)))
    # The gradients here are an argument the caller keeps: writing u into their buffer would
    # make XLA copy them first, so this row keeps u in a buffer of its own. Each packed row runs
    # the default (impl="auto": the XLA step on CUDA GPUs) and the Triton kernels (impl="kernel"):
    # same bits, and which is faster depends on the leaves (docs/results/RESTRUCTURE_TIMING.md).
    for impl, suffix in (("auto", ""), ("kernel", ", impl=kernel")):
        tx = packed_adamw(1e-3, reuse_grad_buffer=False, impl=impl)
        results["packed transform + apply_updates" + suffix] = jax_time_ms(
            transform_loop(tx), (jax.tree_util.tree_map(jnp.copy, params), tx.init(params)))
    variants = {"packed fused in-place": {}, "packed fused in-place, impl=kernel": {"impl": "kernel"}}
    if len(shapes) > 1:  # the kernels' leaf groups against a launch per leaf
        variants["packed fused in-place, impl=kernel, launch per leaf"] = {"impl": "kernel", "multi_tensor": False}
    for name, options in variants.items():
        fused = jax.jit(packed_adamw_fused_step(1e-3, **options), donate_argnums=(0, 2))
        results[name] = jax_time_ms(lambda params, state: fused(params, grads, state),
                                    (jax.tree_util.tree_map(jnp.copy, params), tx.init(params)))
    if len(shapes) > 1:
        # Many small leaves: one jitted call per step costs JAX's dispatch of every buffer,
        # for any optimizer. Inside a training step that cost is paid once for the whole
        # step, so also time LOOP steps inside one call: the optimizer's own cost.
        def optax_step(tx):
            def step(params, state, grads):
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state
            return step

        looped = {"optax.adamw": (optax_step(optax.adamw(1e-3)), optax.adamw(1e-3))}
        for impl, suffix in (("auto", ""), ("kernel", ", impl=kernel")):
            fused = packed_adamw_fused_step(1e-3, impl=impl)
            looped["packed fused in-place" + suffix] = (
                lambda params, state, grads, fused=fused: fused(params, grads, state), packed_adamw(1e-3))
        for name, (step, tx) in looped.items():
            # The gradients are an argument, not a closure: XLA would embed them as constants.
            many = jax.jit(lambda params, state, grads, step=step: jax.lax.fori_loop(
                0, LOOP, lambda _, carry: step(*carry, grads), (params, state)), donate_argnums=(0, 1))
            results[f"{name}, {LOOP} steps per jitted call"] = jax_time_ms(
                lambda params, state, many=many: many(params, state, grads),
                (jax.tree_util.tree_map(jnp.copy, params), tx.init(params)), steps=1) / LOOP
    return results


# ---- report -----------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--json", help="write raw numbers here")
    parser.add_argument("--skip-jax", action="store_true")
    parser.add_argument("--only-jax", action="store_true", help="only the JAX rows, printed as each list finishes")
    parser.add_argument("--sweep", action="store_true", help="only time block sizes and warps on one tensor")
    parser.add_argument("--captured-ab", action="store_true",
                        help="only captured steps with the address table read in place against copied")
    parser.add_argument("--sweep-multi", action="store_true",
                        help="only time the multi-tensor launch's block sizes and warps on captured steps of the lists")
    parser.add_argument("--interleave", type=int, metavar="ROUNDS",
                        help="only alternate fused AdamW and PackedAdamW on the reference GPT list, ROUNDS times")
    parser.add_argument("--profile-host", action="store_true",
                        help="only profile the host side of both optimizers' steps on the reference GPT list")
    args = parser.parse_args(argv)
    if args.sweep:
        return sweep()
    if args.sweep_multi:
        return sweep_multi()
    if args.captured_ab:
        return captured_table_ab()
    if args.profile_host:
        return profile_host()
    if args.interleave:
        return interleave(args.interleave)
    if args.only_jax:
        for name, shapes in {**SHAPE_LISTS, "one tensor": [(BIG,)]}.items():
            print(name, json.dumps(jax_steps_ms(shapes)), flush=True)
        return None

    raw = {}
    bandwidth = copy_bandwidth()
    floor_ms = lambda n: 20 * n / bandwidth  # noqa: E731
    raw["copy_bandwidth_TBps"] = bandwidth / 1e9

    # One big tensor.
    fused = torch_step_ms([(BIG,)], lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    raw["single"] = {"torch fused AdamW": fused, "floor": floor_ms(BIG)}
    for mode in ("packed", "fp16", "fp32"):
        raw["single"][f"PackedAdamW {mode} (default)"] = torch_step_ms([(BIG,)], lambda p: PackedAdamW(p, lr=1e-3, mode=mode))
    raw["single"]["PackedAdamW packed, check_nonfinite=True"] = torch_step_ms(
        [(BIG,)], lambda p: PackedAdamW(p, lr=1e-3, check_nonfinite=True))
    # Format telemetry: in-kernel counts, no wait for the GPU (target: at most 3% slower).
    raw["single"]["PackedAdamW packed, track_format=True"] = torch_step_ms(
        [(BIG,)], lambda p: PackedAdamW(p, lr=1e-3, track_format=True))
    raw["state_bytes_per_param"] = {mode: state_bytes_per_param(mode) for mode in ("packed", "fp16", "fp32")}

    # Model-shaped lists.
    raw["lists"] = {}
    for name, shapes in SHAPE_LISTS.items():
        n = sum(torch.Size(s).numel() for s in shapes)
        entry = {"tensors": len(shapes), "params": n, "floor": floor_ms(n)}
        # Small lists are bound by host time, which drifts on a shared machine: alternate the
        # two optimizers over several rounds and keep each one's median.
        fused_ms, packed_ms = [], []
        for _ in range(LIST_ROUNDS):
            fused_ms.append(torch_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)))
            packed_ms.append(torch_step_ms(shapes, lambda p: PackedAdamW(p, lr=1e-3)))
        entry["torch fused AdamW"] = statistics.median(fused_ms)
        entry["packed (default)"] = statistics.median(packed_ms)
        entry["packed, check_nonfinite=True"] = torch_step_ms(
            shapes, lambda p: PackedAdamW(p, lr=1e-3, check_nonfinite=True))
        entry["packed, launch per tensor"] = torch_step_ms(shapes, lambda p: PackedAdamW(p, lr=1e-3, multi_tensor=False))
        entry["torch fused AdamW, capturable, CUDA graph"] = captured_step_ms(
            shapes, lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True))
        entry["packed, capturable, CUDA graph"] = captured_step_ms(
            shapes, lambda p: PackedAdamW(p, lr=torch.tensor(1e-3, device="cuda"), capturable=True))
        entry["packed, capturable, eager"] = torch_step_ms(
            shapes, lambda p: PackedAdamW(p, lr=torch.tensor(1e-3, device="cuda"), capturable=True))
        entry["packed, no direct relaunch"] = without_direct_relaunch(
            lambda: torch_step_ms(shapes, lambda p: PackedAdamW(p, lr=1e-3)))
        raw["lists"][name] = entry
        print(name, json.dumps(entry), flush=True)
    # JAX last: once it has run, its runtime's threads slow the host-bound torch rows.
    if not args.skip_jax:
        raw["single_jax"] = jax_steps_ms([(BIG,)])
        for name, shapes in SHAPE_LISTS.items():
            raw["lists"][name].update({f"jax {k}": v for k, v in jax_steps_ms(shapes).items()})

    report = render(raw)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def interleave(rounds: int):
    """Host-bound lists drift with the machine: show the ratio round by round."""
    shapes = reference_gpt_shapes()
    ratios = []
    for r in range(rounds):
        fused = torch_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
        packed = torch_step_ms(shapes, lambda p: PackedAdamW(p, lr=1e-3))
        ratios.append(packed / fused)
        print(f"round {r}: fused {fused:.3f} ms packed {packed:.3f} ms ratio {packed / fused:.3f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f}; min {min(ratios):.3f}; max {max(ratios):.3f}")


def profile_host(steps=300):
    """Where a host-bound step's time goes: wall time per step without waiting for the GPU
    (the launch queue never fills at this size), then cProfile's top entries."""
    import cProfile
    import pstats
    import time

    shapes = reference_gpt_shapes()
    for name, make_opt in (("torch fused AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
                           ("PackedAdamW", lambda p: PackedAdamW(p, lr=1e-3))):
        params = make_params(shapes)
        opt = make_opt(params)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            host = (time.perf_counter() - t0) * 1e3 / steps
            torch.cuda.synchronize()
            print(f"{name}: {host:.3f} ms host time per step", flush=True)
        profile = cProfile.Profile()
        profile.runcall(lambda: [opt.step() for _ in range(steps)])
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


def sweep():
    from packed_adamw.core import launch

    fused = torch_step_ms([(BIG,)], lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    print(f"torch fused AdamW {fused:.3f} ms")
    for block, warps in ((128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (1024, 2), (1024, 4), (1024, 8)):
        launch.GPU_BLOCK, launch.GPU_NUM_WARPS = block, warps
        for mode in ("packed", "fp32"):
            times = [torch_step_ms([(BIG,)], lambda p: PackedAdamW(p, lr=1e-3, mode=mode))
                     for _ in range(2)]
            print(f"BLOCK {block} warps {warps} {mode}: " + ", ".join(f"{ms:.3f} ms" for ms in times)
                  + f"; {fused / min(times):.2f}x fused AdamW", flush=True)


def captured_table_ab(passes: int = 2):
    """Captured packed steps of each list whose gradients are the warm-up's (the graph reads
    the eager address table in place) against the same with the gradients moved just before
    the capture (the graph copies the table from pinned memory at each replay), interleaved,
    against fused AdamW captured the same way."""
    lr = lambda: torch.tensor(1e-3, device="cuda")  # noqa: E731

    def moved_before_capture(opt):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = p.grad.clone()

    print("| list | fused AdamW ms | packed, table in place: ms | packed, table copied: ms | in place / fused | copied / fused |")
    print("|---|---|---|---|---|---|")
    for name, shapes in SHAPE_LISTS.items():
        fused = captured_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=lr(), fused=True, capturable=True))
        in_place, copied = [], []
        for _ in range(passes):
            in_place.append(captured_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True)))
            copied.append(captured_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True),
                                           before_capture=moved_before_capture))
        print(f"| {name} | {fused:.4f} | {', '.join(f'{t:.4f}' for t in in_place)} | "
              f"{', '.join(f'{t:.4f}' for t in copied)} | {min(in_place) / fused:.3f} | {min(copied) / fused:.3f} |",
              flush=True)


def sweep_multi():
    """Captured steps (no host time) of each list at several multi-tensor programs, as a
    markdown table: two passes over the configurations, against fused AdamW captured once."""
    from packed_adamw.core import launch

    lr = lambda: torch.tensor(1e-3, device="cuda")  # noqa: E731
    configs = ((512, 2), (256, 1), (256, 2), (128, 1), (512, 4))
    print("| list | BLOCK | warps | ms (pass 1, pass 2) | / captured fused AdamW (best pass) |")
    print("|---|---|---|---|---|")
    default = (launch.MULTI_TENSOR_BLOCK, launch.MULTI_TENSOR_NUM_WARPS)
    for name, shapes in SHAPE_LISTS.items():
        fused = captured_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=lr(), fused=True, capturable=True))
        times = {config: [] for config in configs}
        for _ in range(2):
            for config in configs:
                launch.MULTI_TENSOR_BLOCK, launch.MULTI_TENSOR_NUM_WARPS = config
                times[config].append(captured_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True)))
        launch.MULTI_TENSOR_BLOCK, launch.MULTI_TENSOR_NUM_WARPS = default
        print(f"| {name} | fused AdamW | - | {fused:.4f} | 1.000 |")
        for (block, warps), ms in times.items():
            print(f"| {name} | {block} | {warps} | {ms[0]:.4f}, {ms[1]:.4f} | {min(ms) / fused:.3f} |", flush=True)


def render(raw) -> str:
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    try:
        import jax
        import optax

        versions += f", jax {jax.__version__}, optax {optax.__version__}"
    except ImportError:
        pass
    lines = [
        "# Benchmarks",
        "",
        f"- Date: {datetime.date.today().isoformat()}; GPU: {torch.cuda.get_device_name()}; Python {platform.python_version()}; {versions}",
        f"- Command: `{' '.join(['python', *sys.argv])}`",
        f"- Copy bandwidth measured in this run: {raw['copy_bandwidth_TBps']:.2f} TB/s (read + write); "
        "floor = 20 bytes/parameter at that bandwidth.",
        "- Times: median of 5 repeats of the mean of 20 back-to-back steps (CUDA events for torch, "
        "wall clock with block_until_ready for JAX). Ratios are peer time / our time (>1 = faster).",
        f"- Lists: torch fused AdamW and packed (default) alternate over {LIST_ROUNDS} rounds, each row the "
        "median of its rounds (small lists are bound by host time, which drifts); other rows run once.",
        "",
        f"## One tensor of {BIG:,} float32 parameters",
        "",
        "| step | ms | speed-up vs torch fused AdamW |",
        "|---|---|---|",
    ]
    single = raw["single"]
    for name, ms in single.items():
        lines.append(f"| {name} | {ms:.3f} | {single['torch fused AdamW'] / ms:.2f}x |")
    if "single_jax" in raw:
        jx = raw["single_jax"]
        lines += ["", "| JAX step | ms | speed-up vs optax.adamw |", "|---|---|---|"]
        for name, ms in jx.items():
            lines.append(f"| {name} | {ms:.3f} | {jx['optax.adamw'] / ms:.2f}x |")
    lines += ["", "State bytes per parameter (torch.cuda.memory_allocated around the first step): "
              + ", ".join(f"{m} {b:.4f}" for m, b in raw["state_bytes_per_param"].items()), ""]
    lines += ["## Model-shaped parameter lists", "", "| list | tensors | params | step | ms | time / fused AdamW | time / floor |", "|---|---|---|---|---|---|---|"]
    for name, entry in raw["lists"].items():
        for key, ms in entry.items():
            if key in ("tensors", "params"):
                continue
            lines.append(f"| {name} | {entry['tensors']} | {entry['params']:,} | {key} | {ms:.3f} | "
                         f"{ms / entry['torch fused AdamW']:.2f} | {ms / entry['floor']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
