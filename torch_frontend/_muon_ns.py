"""Muon's Newton-Schulz phase in torch: which implementation runs (`ns_impl`: torch's matmuls in
bf16, as torch.optim.Muon runs them, or core/muon's Triton kernels, JAX's bits) and on which
batches of one shape (`batch_ns`), for the CPU phases (`_muon_step.py`) and the CUDA launches
(`_muon_kernels.py`) alike. The public functions are `packed_adamw.torch.muon`'s."""
from __future__ import annotations

import torch

from packed_adamw.core import launch
from packed_adamw.core.muon import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS

from . import _capture

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16


def newton_schulz(x: torch.Tensor, coefficients=DEFAULT_NS_COEFFICIENTS, steps: int = DEFAULT_NS_STEPS,
                  eps: float = 1e-7) -> torch.Tensor:
    """MUON.md's Newton-Schulz phase on one bf16 matrix, with torch operations in bf16: the
    wide orientation (a transposed view of a tall matrix), division by the Frobenius norm
    clamped at eps, then `steps` quintic iterations with the GEMM results rounded to bf16 as
    torch's `addmm` rounds them. Returns the bf16 result in `x`'s orientation."""
    a, b, c = coefficients
    y = x.bfloat16()
    tall = y.size(0) > y.size(1)
    if tall:
        y = y.T
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, polynomial, y, beta=a)
    return y.T if tall else y


def newton_schulz_batched(xs, coefficients=DEFAULT_NS_COEFFICIENTS, steps: int = DEFAULT_NS_STEPS,
                          eps: float = 1e-7, *, ns_impl: str = "cublas") -> list[torch.Tensor]:
    """`newton_schulz` of several bf16 matrices that share one wide orientation (m, n), m <= n
    (a tall one enters transposed): stacked into one [B, m, n] tensor, each matrix divided by its
    own Frobenius norm, the iterations as batched GEMMs. Fifteen GEMM launches for the whole
    batch instead of fifteen per matrix, and a few copies (the stacking, the tall results'
    transposition) whatever B is. Returns each result contiguous, in its input's orientation.

    Each matrix's arithmetic is the per-matrix one, but a batched GEMM may sum or round in
    another order than the solo one: on the CPU rare elements differ from `newton_schulz`'s; on
    CUDA tests/torch_frontend/test_torch_muon.py compares them (MUON.md, "Batched Newton-Schulz"). A matrix's
    result does not depend on its batch-mates. `ns_impl="triton"` runs the stack through
    `newton_schulz_triton_stacked` (whose bits are the per-matrix `newton_schulz_triton`'s)."""
    tall = [i for i, x in enumerate(xs) if x.size(0) > x.size(1)]
    wide = [i for i, x in enumerate(xs) if x.size(0) <= x.size(1)]
    m, n = sorted(xs[0].shape)
    y = torch.empty((len(xs), m, n), dtype=BFLOAT16, device=xs[0].device)  # the tall matrices first
    if tall:
        y[:len(tall)] = torch.stack([xs[i].bfloat16() for i in tall]).transpose(1, 2)
    if wide:
        torch.stack([xs[i].bfloat16() for i in wide], out=y[len(tall):])
    y = _stacked_ns(ns_impl)(y, coefficients, steps, eps)
    results = [None] * len(xs)
    for i, result in zip(tall, y[:len(tall)].transpose(1, 2).contiguous()):
        results[i] = result
    for i, result in zip(wide, y[len(tall):]):
        results[i] = result
    return results


def newton_schulz_stacked(y: torch.Tensor, coefficients=DEFAULT_NS_COEFFICIENTS, steps: int = DEFAULT_NS_STEPS,
                          eps: float = 1e-7) -> torch.Tensor:
    """`newton_schulz_batched`'s arithmetic on matrices already stacked in their wide
    orientation: `y` a [B, m, n] bf16 tensor, m <= n (left unchanged). Returns the [B, m, n]
    results, contiguous."""
    a, b, c = coefficients
    y = y / torch.linalg.vector_norm(y, dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(y, y.transpose(1, 2))
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, polynomial, y, beta=a)
    return y.contiguous()


NS_IMPLS = ("auto", "cublas", "triton")
_NS_SCALARS: dict = {}  # (coefficients, eps, device) -> the kernels' float32 row on the device


def newton_schulz_triton_stacked(y: torch.Tensor, coefficients=DEFAULT_NS_COEFFICIENTS,
                                 steps: int = DEFAULT_NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """`newton_schulz_stacked`'s contract through core/muon/ns_kernel.py's Triton kernels (the
    ones JAX launches too: the same bits): `y` a [B, m, n] bf16 tensor, m <= n, on CUDA (or on
    the CPU under Triton's interpreter). Returns a new [B, m, n] bf16 tensor. A matrix's result
    does not depend on its batch-mates."""
    from packed_adamw.core.muon import ns_kernel

    batch, k, n = y.shape
    buffers = {"x": y.to(BFLOAT16).contiguous(), "scalars": _ns_scalars(coefficients, eps, y.device)}
    for name, (shape, dtype) in ns_kernel.buffer_shapes(batch, k, n).items():
        buffers[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=y.device)
    for kernel, grid, names, constants, options in ns_kernel.launch_plan(batch, k, n, int(steps),
                                                                         interpreting=launch.interpreting()):
        kernel[grid](*(buffers[name] for name in names), **constants, **options, **launch.COMPILE_OPTIONS)
    return buffers[ns_kernel.result_buffer(int(steps))]


def _ns_scalars(coefficients, eps, device: torch.device, capturing_for: str | None = None) -> torch.Tensor:
    """The Triton Newton-Schulz's float32 scalar row on `device`, made once per settings (a
    capture cannot copy it from the host: a capturable step makes it first, outside one).
    `capturing_for`: under a capture, the capturing optimizer's name (for its refusal)."""
    from packed_adamw.core.muon import ns_kernel

    key = (tuple(float(v) for v in coefficients), float(eps), device)
    if key not in _NS_SCALARS:
        if capturing_for is not None:
            raise RuntimeError(_capture.refusal(capturing_for, "the Newton-Schulz settings changed"))
        if len(_NS_SCALARS) > 64:
            _NS_SCALARS.clear()  # a capture keeps the rows it read (_capture.keep)
        _NS_SCALARS[key] = torch.from_numpy(ns_kernel.ns_scalars(coefficients, eps)).to(device)
    return _NS_SCALARS[key]


def newton_schulz_triton(x: torch.Tensor, coefficients=DEFAULT_NS_COEFFICIENTS, steps: int = DEFAULT_NS_STEPS,
                         eps: float = 1e-7) -> torch.Tensor:
    """`newton_schulz`'s contract for one matrix through the Triton kernels (a batch of one:
    the bits it gets in any batch). Returns the bf16 result in `x`'s orientation (a transposed
    view for a tall matrix)."""
    y = x.bfloat16()
    tall = y.size(0) > y.size(1)
    result = newton_schulz_triton_stacked((y.T if tall else y).contiguous()[None], coefficients, steps, eps)[0]
    return result.T if tall else result


def _stacked_ns(ns_impl: str):
    return newton_schulz_triton_stacked if ns_impl == "triton" else newton_schulz_stacked


def ns_batch_key(shape, group: dict) -> tuple:
    """Matrices with equal keys run Newton-Schulz as one batch: the wide orientation and the
    group's Newton-Schulz settings."""
    rows, cols = shape
    return (min(rows, cols), max(rows, cols), tuple(float(v) for v in group["ns_coefficients"]),
            int(group["ns_steps"]), float(group["eps"]))


# A batch's buffers live while it runs: its stacked X and the Newton-Schulz iterates, about 8
# bytes an element on CUDA (the weight kernel recomputes the new momentum: no scratch entries,
# which were 2 more in packed mode, 4 in fp32 mode). Batching saves launches, which count
# for small matrices only, so a shape's batch is split into parts of at most this many elements:
# the memory a batched step adds stays bounded on large models (a 7B model's 96 MLP matrices share
# one shape up to transposition, 4.3 G elements), while the d12 and GPT-2 lists keep whole batches
# (their largest holds 56.6 M elements). docs/results/MUON_NS.md measures the limit.
NS_BATCH_ELEMENTS = 1 << 26
MAX_BATCH_MATRICES = 65535  # the batch is the kernels' second grid axis, which CUDA caps at 65,535


def _ns_batches(opt, work) -> list[list[int]]:
    """Indices into `work` of the matrices whose Newton-Schulz runs as one call: those of one
    `ns_batch_key` with `batch_ns`, in parts of at most NS_BATCH_ELEMENTS elements
    (`split_batch`), else each matrix alone (torch.optim.Muon's way)."""
    if not work or not _batches_ns(opt, work[0].weights.device):
        return [[i] for i in range(len(work))]
    batches: dict[tuple, list[int]] = {}
    for i, w in enumerate(work):
        batches.setdefault(ns_batch_key(w.param.shape, w.group), []).append(i)
    return [part for batch in batches.values() for part in split_batch(batch, work[batch[0]].param.numel())]


def split_batch(batch: list[int], elements: int, limit: int | None = None) -> list[list[int]]:
    """`batch` (matrices of `elements` each) in as few parts of at most `limit` elements
    (NS_BATCH_ELEMENTS) and MAX_BATCH_MATRICES matrices as hold them, of equal sizes but the last;
    a matrix over the limit runs alone."""
    limit = NS_BATCH_ELEMENTS if limit is None else limit
    per_part = min(MAX_BATCH_MATRICES, max(1, limit // max(elements, 1)))
    parts = -(-len(batch) // per_part)
    size = -(-len(batch) // parts)
    return [batch[i:i + size] for i in range(0, len(batch), size)]


def _batches_ns(opt, device: torch.device) -> bool:
    """Whether Newton-Schulz runs per batch of one shape on `device`. batch_ns=None (the default)
    batches where batching cannot change a bit: with the Triton kernels, whose result for a matrix
    does not depend on its batch; torch's matmuls may sum a batched GEMM in another order."""
    batch = getattr(opt, "batch_ns", False)  # optimizers pickled before batch_ns existed have none
    return _ns_impl(opt, device) == "triton" if batch is None else batch


def _ns_impl(opt, device: torch.device) -> str:
    """The Newton-Schulz implementation on `device`: ns_impl="auto" (the default) is the Triton
    kernels on NVIDIA GPUs with bf16 tensor cores (JAX's bits; the fastest torch step measured
    on three of the four benchmark lists, docs/MUON.md) and torch's matmuls elsewhere
    (torch.optim.Muon's bits on the CPU)."""
    impl = getattr(opt, "ns_impl", "cublas")  # optimizers pickled before ns_impl existed have none
    if impl == "auto":
        return "triton" if _auto_takes_triton(device) else "cublas"
    return impl


_TRITON_NS_DEVICES: dict[int, bool] = {}  # CUDA device index -> _auto_takes_triton


def _auto_takes_triton(device: torch.device) -> bool:
    """Whether ns_impl="auto" runs the Triton Newton-Schulz on `device`: CUDA devices of compute
    capability 8.0 or later (bf16 tensor cores; the kernels ran on an H100, sm_90, only), not
    ROCm's (never run there) nor older GPUs, where torch's matmuls run as before."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _TRITON_NS_DEVICES:
        _TRITON_NS_DEVICES[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return _TRITON_NS_DEVICES[index]


def _check_ns_device(opt, device: torch.device) -> None:
    if _ns_impl(opt, device) == "triton" and device.type != "cuda" and not launch.interpreting():
        raise ValueError(f"{opt.optimizer_name}(ns_impl='triton'): the Triton Newton-Schulz runs on CUDA devices "
                         f"(or under TRITON_INTERPRET=1), and these matrices are on {device}; use "
                         "ns_impl='cublas' (torch's matmuls) there")


def _ns(opt, xs: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Newton-Schulz of one batch with its group's settings. With `batch_ns` a lone matrix runs
    the batched function too: its bits do not depend on whether it has batch-mates."""
    settings = (tuple(group["ns_coefficients"]), int(group["ns_steps"]), float(group["eps"]))
    impl = _ns_impl(opt, xs[0].device)  # its device was checked with the step's (`_check_ns_device`)
    if not _batches_ns(opt, xs[0].device):
        one = newton_schulz_triton if impl == "triton" else newton_schulz
        return [one(x, *settings) for x in xs]
    if impl == "triton":
        return newton_schulz_batched(xs, *settings, ns_impl=impl)
    return newton_schulz_batched(xs, *settings)
