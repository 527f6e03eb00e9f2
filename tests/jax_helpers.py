"""Shared helpers for the optax-frontend tests (CPU and CUDA): bit views, test trees, and
the same training run driven through torch `PackedAdamW` and through the optax transform.

Data moves between the frameworks through numpy (no dlpack).
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from layout import REPO, child_env

F32 = np.float32
U32 = np.uint32
MODES = ["packed", "fp16", "fp32"]


def step_callbacks(compiled_text: str) -> int:
    """Host callbacks in a compiled step's text other than the refusal warning's (side effect
    only, which packed_adamw compiles in wherever a step is lowered for the CPU)."""
    return sum("xla_ffi_python_cpu_callback" in line and "custom_call_has_side_effect=true" not in line
               for line in compiled_text.splitlines())


def bits(x) -> np.ndarray:
    """uint32 view of a float32 / uint32 array (jax, torch or numpy), for bitwise comparison."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            if t.dtype == torch.uint32:
                t = t.view(torch.int32)
            return t.numpy().view(U32).copy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(x)
    assert a.dtype in (np.float32, np.uint32, np.int32), a.dtype
    return a.view(U32)


def assert_bits_equal(a, b, what: str) -> None:
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    diff = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
    assert diff.size == 0, (
        f"{what}: {diff.size} of {a.size} elements differ; first at flat index {diff[0]}: "
        f"{a.reshape(-1)[diff[0]]:#010x} vs {b.reshape(-1)[diff[0]]:#010x}"
    )


def spanning_values(rng, shape, lo_exp: float, hi_exp: float, zero_share: float = 0.05) -> np.ndarray:
    """float32 values with log-uniform magnitudes 10**[lo_exp, hi_exp], random signs, some zeros."""
    mag = 10.0 ** rng.uniform(lo_exp, hi_exp, size=shape)
    x = np.asarray(mag * rng.choice([-1.0, 1.0], size=shape), dtype=F32)
    x[rng.random(shape) < zero_share] = 0.0
    return x


def make_problem(seed: int, shapes: dict, steps: int, *, grad_exp=(-12.0, 2.0)):
    """(params0, [grads per step]) as dicts of float32 numpy arrays.

    Gradient magnitudes span 1e-12 .. 1e2 so the moments reach the formats' subnormals (and
    flush to zero) as well as their saturation near 2 (E4M11/E4M12) and 65504 (fp16).
    """
    rng = np.random.default_rng(seed)
    params0 = {k: spanning_values(rng, s, -4.0, 1.0) for k, s in shapes.items()}
    grads = [{k: spanning_values(rng, s, *grad_exp) for k, s in shapes.items()} for _ in range(steps)]
    return params0, grads


def torch_words(opt, p):
    """The torch optimizer's state tensor for parameter p (words or [2, *shape] moments)."""
    state = opt.state[p]
    return state["moments"] if "moments" in state else state["words"]


def run_torch(params0: dict, grads: list, *, mode: str, lr, weight_decay: float, no_decay=(), device="cpu",
              b1=0.9, b2=0.999, eps=1e-8):
    """Torch PackedAdamW over the dict's keys in sorted order (JAX's leaf order).

    `lr` is a float or a float32 table indexed by step. Keys in `no_decay` go into a second
    param group with weight_decay 0. Returns (params as numpy, state tensors as numpy, opt, tensors).
    """
    import torch

    from packed_adamw.torch import PackedAdamW

    keys = sorted(params0)
    tensors = {k: torch.nn.Parameter(torch.from_numpy(params0[k].copy()).to(device)) for k in keys}
    lr0 = float(lr[0]) if isinstance(lr, np.ndarray) else lr
    groups = [{"params": [tensors[k] for k in keys if k not in no_decay]}]
    if no_decay:
        groups.append({"params": [tensors[k] for k in keys if k in no_decay], "weight_decay": 0.0})
    opt = PackedAdamW(groups, lr=lr0, betas=(b1, b2), eps=eps, weight_decay=weight_decay, mode=mode)
    for i, g in enumerate(grads):
        if isinstance(lr, np.ndarray):
            for group in opt.param_groups:
                group["lr"] = float(lr[i])
        for k in keys:
            tensors[k].grad = torch.from_numpy(np.array(g[k], dtype=F32)).to(device)
        opt.step()
    params = {k: bits(tensors[k]) for k in keys}
    states = {k: bits(torch_words(opt, tensors[k])) for k in keys}
    return params, states, opt, tensors


def run_jax(params0: dict, grads: list, tx, *, jit: bool = True):
    """The optax transform + optax.apply_updates. Returns (params, state) as jax values."""
    import jax
    import jax.numpy as jnp
    import optax

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    if jit:
        step = jax.jit(step)
    params = {k: jnp.asarray(v) for k, v in params0.items()}
    state = tx.init(params)
    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
    return params, state


def run_numpy(params0: dict, grads: list, *, mode: str, lr, weight_decay: float, b1=0.9, b2=0.999, eps=1e-8):
    """The numpy CPU step (`packed_adamw.core.adamw_step`) over the same run, in place on copies.

    `lr` is a float or a float32 table indexed by step. Returns (params bits, state bits) by key.
    """
    from packed_adamw.core import Hyperparams, StateFormat, adamw_step

    fmt = StateFormat(mode)
    params = {k: np.array(v, dtype=F32).reshape(-1) for k, v in params0.items()}
    states = {k: (np.zeros((2, v.size), F32) if mode == "fp32" else np.zeros(v.size, U32)) for k, v in params.items()}
    for t, g in enumerate(grads, start=1):
        step_lr = float(lr[t - 1]) if isinstance(lr, np.ndarray) else lr
        hp = Hyperparams(lr=step_lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
        for k in params:
            adamw_step(params[k], np.array(g[k], dtype=F32).reshape(-1), states[k], count=t, hp=hp, fmt=fmt)
    shaped_p = {k: params[k].reshape(np.shape(params0[k])).view(U32) for k in params}
    shaped_s = {k: states[k].reshape(((2,) if mode == "fp32" else ()) + np.shape(params0[k])).view(U32) for k in params}
    return shaped_p, shaped_s


def jax_cuda_unavailable() -> str | None:
    """Why the jax-triton CUDA path cannot run here (a skip reason), or None."""
    import jax
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if jax.default_backend() != "gpu":
        return f"JAX backend is {jax.default_backend()!r}, not 'gpu'"
    try:
        from packed_adamw.jax import _triton_launch

        _triton_launch._jax_triton()  # the frontend's import, which restores TRITON_CACHE_DIR
    except Exception as e:  # ImportError, or jax-triton / triton version clashes
        return f"jax_triton does not import: {type(e).__name__}: {e}"
    return None


def run_cases_child(test_file: str, devices: int) -> dict:
    """Runs `test_file --cases` in a child process with `devices` forced CPU devices and
    returns {case: "ok" or the failure}, from the JSON lines the child prints."""
    import pytest

    env = child_env(dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                         JAX_PLATFORMS="cpu"))
    path = Path(test_file).resolve()
    done = subprocess.run([sys.executable, str(path), "--cases"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            results.update({k: v for k, v in json.loads(line).items() if k != "seconds"})
    if not results:
        pytest.fail(f"the {devices}-device child ran no case (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-3000:]}")
    return results


# The leaves the 8-device cases shard ("x" the mesh's axis): one sharded on each dimension, a 0-d
# leaf and a replicated one.
SHARDED_SHAPES = {"a": (16, 12), "b": (8,), "c": (), "d": (3, 16), "r": (5,)}
_SHARDED_AXES = {"a": ("x", None), "b": ("x",), "c": (), "d": (None, "x"), "r": ()}


def sharded_specs() -> dict:
    """SHARDED_SHAPES' PartitionSpecs."""
    from jax.sharding import PartitionSpec

    return {k: PartitionSpec(*axes) for k, axes in _SHARDED_AXES.items()}


def normalized_spec(spec, ndim: int) -> tuple:
    """A PartitionSpec padded with None to `ndim` axes, as a sharding reports it."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def optax_train_step(tx) -> Callable:
    """(params, state, grads) -> (params, state): one `tx` update applied, as a training loop does."""
    import optax

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def case_recorder() -> tuple[dict, Callable]:
    """The child side of `run_cases_child`: (results, case), where `@case(name)` runs the function
    at once, records "ok" or its traceback under `name` and prints that as the JSON line the
    parent reads (with the seconds it took)."""
    import time
    import traceback

    results = {}

    def case(name):
        def register(fn):
            start = time.perf_counter()
            try:
                fn()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc(limit=12)
            print(json.dumps({name: results[name], "seconds": round(time.perf_counter() - start, 1)}), flush=True)
            return fn
        return register

    return results, case


class InterpretedJaxTriton:
    """A stand-in for jax-triton 0.3.1's `triton_call` (monkeypatched into
    `_triton_launch._jax_triton`), passing the kernel its arguments as that version's lowering
    does: the array and scalar arguments in order, then one buffer per output, an output
    aliased to an input (`input_output_aliases`, indices among the array arguments) being that
    input's buffer and any other output uninitialised (garbage, not zeros), and every constexpr
    passed by name, those with defaults too, as that version requires. Runs eagerly, in
    the Triton interpreter, on torch copies of the arrays (float32, uint32, int16 and bf16).
    `launches` records (kernel, metaparameters) per call, `signatures` the dtypes of its array
    arguments and outputs and its warps."""

    def __init__(self):
        self.launches = []
        self.signatures = []

    def clear(self) -> None:
        self.launches.clear()
        self.signatures.clear()

    def variant(self, index: int) -> tuple:
        """What jax-triton compiles launch `index` for (its cache key, but for the compute
        capability): the kernel, the constexprs and the argument dtypes."""
        kernel, metaparams = self.launches[index]
        return kernel, tuple(sorted(metaparams.items())), self.signatures[index]

    @property
    def kernels(self) -> list:
        return [kernel for kernel, _ in self.launches]

    @staticmethod
    def _tensor(a: np.ndarray):
        import ml_dtypes
        import torch

        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy((a.view(np.int32) if a.dtype == np.uint32 else a).copy())

    @staticmethod
    def _array(t, dtype):
        import jax.numpy as jnp
        import ml_dtypes
        import torch

        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        a = t.numpy()
        return jnp.asarray(a.view(np.uint32) if np.dtype(dtype) == np.uint32 else a)

    def triton_call(self, *args, kernel, out_shape, grid, input_output_aliases=None, num_warps=None,
                    enable_fp_fusion=True, **metaparams):
        import jax

        # jax-triton 0.3.1 fills in no default constexpr: a launch that leaves one out fails there.
        fn = kernel
        while hasattr(fn, "fn"):  # the interpreter's wrapper, then the JITFunction, then the function
            fn = fn.fn
        left_out = [name for name, p in inspect.signature(fn).parameters.items()
                    if "constexpr" in str(p.annotation) and name not in metaparams]
        assert not left_out, f"{fn.__name__} launched without its constexpr {', '.join(left_out)}"
        shapes = list(out_shape) if isinstance(out_shape, (tuple, list)) else [out_shape]
        launch = functools.partial(self._launch, args, kernel, shapes, grid, dict(input_output_aliases or {}),
                                   num_warps, metaparams)
        is_number = lambda a: isinstance(a, (bool, int, float))  # noqa: E731
        if any(isinstance(a, jax.core.Tracer) for a in args):
            # Traced (a step primitive's lowering, compiled): the launch runs, and is recorded, each time
            # the compiled step runs, in a host callback.
            results = jax.pure_callback(lambda *arrays: [np.asarray(r) for r in launch(arrays)],
                                        [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes],
                                        *[a for a in args if not is_number(a)])
        else:
            results = launch([np.asarray(a) for a in args if not is_number(a)])
        return tuple(results) if isinstance(out_shape, (tuple, list)) else results[0]

    def _launch(self, args, kernel, shapes, grid, aliases, num_warps, metaparams, arrays) -> list:
        """One launch in the interpreter: `args` as given, their arrays replaced by `arrays` (numpy)."""
        self.launches.append((kernel, metaparams))
        values = iter(arrays)
        args = [a if isinstance(a, (bool, int, float)) else next(values) for a in args]
        arg_types = tuple(type(a).__name__ if isinstance(a, (bool, int, float)) else str(np.asarray(a).dtype)
                          for a in args)
        self.signatures.append((arg_types, tuple(str(np.dtype(s.dtype)) for s in shapes), num_warps))
        arrays = [self._tensor(np.asarray(a)) for a in args if not isinstance(a, (bool, int, float))]
        outs = []
        for k, shape in enumerate(shapes):
            source = [i for i, o in aliases.items() if o == k]
            if source:
                assert arrays[source[0]].shape == tuple(shape.shape), (source, shape)
                outs.append(arrays[source[0]])  # the same buffer, as XLA aliases it
            else:
                garbage = np.full(int(np.prod(shape.shape)) * np.dtype(shape.dtype).itemsize, 0x5A, np.uint8)
                outs.append(self._tensor(garbage.view(np.dtype(shape.dtype)).reshape(shape.shape)))
        it = iter(arrays)
        kernel[grid](*[a if isinstance(a, (bool, int, float)) else next(it) for a in args], *outs, **metaparams)
        return [self._array(o, s.dtype) for o, s in zip(outs, shapes)]
