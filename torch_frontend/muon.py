"""`PackedMuon`: torch.optim.Muon with its momentum in 2 bytes per parameter (docs/MUON.md).

A step per matrix: the momentum phase (core/muon's numpy phase on the CPU, its Triton kernel
on CUDA: per matrix, or per batch with `batch_ns`), Newton-Schulz (on CUDA by default
core/muon's Triton kernels over the matrices of one shape, JAX's bits; elsewhere torch
operations in bf16, `newton_schulz`, as torch.optim.Muon runs it; `ns_impl` and `batch_ns`
choose), the weight phase (numpy or kernel). The shared machinery serves it as it serves
PackedAdamW: parameter names and group checks (`_checks.py`), the low halves of bf16
parameters and their masters (`_state.py`, `functional.py`, `_persistence.load_master_weights`),
the state_dict's identity and the loaded tensors' restoration (`_persistence.py`), the format
counts and `format_stats` (`_engine.py`), DTensor state layouts (`_dtensor.py`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import launch
from packed_adamw.core.muon import (
    DEFAULT_MU_BIAS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    FORMAT_COUNTS,
    RULE,
    StateFormat,
    commit_momentum,
    momentum_update,
    ortho_finite,
    step_scalar_row,
    validate_ns,
    weight_phase,
    weight_phase_split,
)

from . import _checks, _dtensor, _engine, _muon_capturable, _muon_kernels
from ._base import _REQUIRED, PackedOptimizer
from ._engine import NonFiniteGradientError
from ._muon_state import (  # noqa: F401  (fresh_entries, checked_load, restore_loaded: this module's names too)
    _checked_state,
    add_missing_exponents,
    checked_load,
    fresh_entries,
    local_entry,
    local_exponent,
    restore_loaded,
)
from ._state import LOW_HALF_KEY

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
COMBINED_NAME = "PackedMuonAdamW"  # where the parameters Muon refuses belong (combined.py)


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


def _ns_scalars(coefficients, eps, device: torch.device, capturing: bool = False) -> torch.Tensor:
    """The Triton Newton-Schulz's float32 scalar row on `device`, made once per settings (a
    capture cannot copy it from the host: a capturable step makes it first, outside one)."""
    from packed_adamw.core.muon import ns_kernel

    key = (tuple(float(v) for v in coefficients), float(eps), device)
    if key not in _NS_SCALARS:
        if capturing:
            raise RuntimeError(_muon_capturable.capture_refusal("the Newton-Schulz settings changed"))
        if len(_NS_SCALARS) > 64:
            _NS_SCALARS.clear()  # a capture keeps the rows it read (_muon_capturable.keep_for_capture)
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


# ---- the state of DTensor (FSDP2) parameters ------------------------------------------------
# A DTensor parameter's momentum entry is a DTensor on its mesh with its placements, so that
# torch.distributed.checkpoint saves, loads and reshards it as the model's. The 16-bit codes are
# stored as int8 pairs [*shape, 2], as _dtensor.py stores a low half: torch.distributed's
# collectives carry no int16, and a trailing pair dimension keeps every placement of the
# parameter's dims meaning the same. fp32 momenta are float32 DTensors laid out like the parameter.
# Packed mode's exponent (one int32 a matrix) is a 0-d DTensor replicated on the parameter's mesh:
# every rank holds the whole matrix's (`_dtensor.wrap_entry` lays every entry out).
NAN_BF16_BITS = 0x7FC0  # a shard that refuses its part of X sends these (see `_gathered_input`)


class PackedMuon(PackedOptimizer):
    """torch.optim.Muon (its arguments, names and defaults) whose momentum is a 2-byte code per
    parameter: `mode="packed"` (E5M10 codes scaled by a power of two per matrix, `mu_exponent`,
    chosen each step from the matrix's largest momentum: like torch.optim.Muon's, the step is
    invariant to a power-of-two scale of the gradients, and `mu_bias`, default 31, no longer
    moves it), `"bf16"`, or `"fp32"` (torch's float32 `momentum_buffer`; on CPU it equals
    torch.optim.Muon bit for bit).

    Parameters are 2-D matrices, float32 or bfloat16 (a bf16 one keeps an exact FP32 master as
    PackedAdamW's do: its state adds the int16 low half `"lo"`), contiguous, on one device.
    Embeddings, heads, norms and scalars belong to AdamW: `PackedMuonAdamW` steps both rules
    as one optimizer. A parameter group sets its own hyperparameters (torch.optim.Muon's and
    `maximize`); one that sets an option of the optimizer (`mode`, `mu_bias`, a switch) is
    refused naming it, when added and when a state_dict's groups load: every group shares the
    optimizer's state format. `maximize=True` steps on the negated gradient. A matrix whose
    gradient, momentum or Newton-Schulz input is not finite is refused whole: its weights and momentum
    stay as they were (MUON.md); with `check_nonfinite=True` the step then raises
    `NonFiniteGradientError` naming it. DTensor parameters (FSDP2's `fully_shard`) step shard
    by shard with Newton-Schulz on the gathered whole matrix, with the single process's bits,
    and keep DTensor state that torch.distributed.checkpoint saves and reshards (MUON.md,
    "FSDP2"). Under `torch.compile` (`fullgraph=True` holds) the step is the custom op PackedAdamW's
    compiled step is (`packed_adamw::step_`, torch_frontend/_compiled.py), with the eager step's
    bits and state (MUON.md, "Compiled steps"). `capturable=True` (CUDA, each group's lr a
    one-element tensor on the device) keeps the step on the GPU, so that `torch.cuda.graph` can
    capture it; its bits are the eager step's (MUON.md, "Capturable steps (CUDA graphs)").
    `track_format=True` counts, per matrix, the steps it was refused in and, of those it was
    accepted in, the element-steps and (packed mode) where the momentum codes saturated, flushed
    or went subnormal (MUON.md, "Format counts"), as PackedAdamW's `track_format` does:
    `format_stats()` reads them; counting changes no bit of the step and waits for no GPU.

    `ns_impl`: "auto" (default) is "triton" on CUDA devices of compute capability 8.0 or later
    (not ROCm's) and "cublas" elsewhere. "cublas" runs
    Newton-Schulz with torch's matmuls (cuBLAS on CUDA), as torch.optim.Muon does: on the CPU
    with mode="fp32" its bits are torch.optim.Muon's. "triton" runs core/muon's Triton kernels,
    the ones `packed_muon` launches on a JAX GPU backend: the same bits as JAX, with or without
    `batch_ns` (a matrix's result does not depend on its batch). "triton" needs CUDA (or
    Triton's CPU interpreter).

    `batch_ns=True` runs Newton-Schulz once per batch of matrices that share a shape (up to
    transposition) and settings, and on CUDA each elementwise phase as one launch per batch:
    far fewer launches. With "cublas" a batched GEMM may round in another order than the
    per-matrix one: on the CPU rare elements differ (MUON.md, "Batched Newton-Schulz").
    `batch_ns=False` steps one matrix at a time. The default, None, batches where batching
    cannot change a bit: with the Triton kernels, not with torch's matmuls. So the defaults
    give, on CUDA, JAX's bits and a step of 0.18x to 0.26x torch.optim.Muon's on the d12, GPT-2
    and reference GPT lists and 0.86x on a 1.3B list (H100; docs/results/MUON_NS.md), and on
    the CPU torch.optim.Muon's way and bits.
    """

    rule_name = "muon"
    display_name = "Muon"
    state_format_class = StateFormat
    format_keys = ("mode", "mu_bias")
    torch_twin = "torch.optim.Muon"
    counts_refusals = True  # a refused matrix is counted in every mode
    # An older pickle lacks the later options: it stepped per matrix, with torch's matmuls.
    pickled_options = {"state_format": _REQUIRED, "check_nonfinite": False, "capturable": False,
                       "batch_ns": False, "ns_impl": "cublas"}
    # The optimizer's options a group cannot set (`_checks.check_group_options`), each the
    # constructor's option of the same name.
    group_options = {key: key for key in ("mode", "mu_bias", "check_nonfinite", "capturable", "batch_ns", "ns_impl",
                                          "track_format")}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        mode: str = "packed",
        mu_bias: int = DEFAULT_MU_BIAS,
        maximize: bool = False,
        check_nonfinite: bool = False,
        capturable: bool = False,
        batch_ns: bool | None = None,
        ns_impl: str = "auto",
        track_format: bool = False,
    ):
        check_options(type(self).__name__, capturable, batch_ns, ns_impl, lr=lr, check_nonfinite=check_nonfinite)
        self.state_format = StateFormat(mode, mu_bias)
        self.check_nonfinite = check_nonfinite
        self.capturable = capturable
        self.track_format = track_format  # checked against capturable (the property)
        self.batch_ns = batch_ns
        self.ns_impl = ns_impl
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, maximize=maximize)
        validate_group(defaults, "defaults")
        super().__init__(params, defaults)

    def _unpickled(self) -> None:
        add_missing_exponents(self)

    def _check_new_group(self, group: dict, index: int) -> None:
        validate_group(group, f"param_groups[{index}]")
        for param_index, p in enumerate(group["params"]):
            check_matrix(p, _checks.param_name(group, index, param_index))

    def _eager_update(self, live: dict | None = None) -> None:
        step(self, live)

    def _count_names(self) -> tuple:
        """`refused` (steps that refused the matrix), `elements` (element-steps of the steps that
        accepted it) and, in packed mode, `saturated_mu`, `flushed_mu`, `subnormal_mu` over those
        (MUON.md, "Format counts")."""
        return FORMAT_COUNTS if self.state_format.mode == "packed" else ()

    def _checked_load(self, state_dict: dict) -> tuple[dict, dict]:
        return checked_load(self, state_dict)

    def _restore_loaded(self, loaded: dict) -> None:
        restore_loaded(self, loaded)

    def _fresh_entries(self, p: torch.Tensor) -> dict:
        return fresh_entries(self, p)

    def _portable(self):
        from . import _muon_portable  # it imports this module

        return _muon_portable


# ---- checks ------------------------------------------------------------------------------
def check_options(owner: str, capturable, batch_ns, ns_impl, *, lr, check_nonfinite) -> None:
    """The constructor options of Muon's step (PackedMuon's, PackedMuonAdamW's)."""
    if capturable not in (True, False):
        raise ValueError(f"{owner}(capturable={capturable!r}): pass True or False")
    if capturable and check_nonfinite:
        raise ValueError(f"{owner}(capturable=True, check_nonfinite=True): counting non-finite elements waits for "
                         "the GPU, which a captured step cannot; pass check_nonfinite=False")
    if capturable and not (isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point()):
        raise ValueError(f"{owner}(capturable=True) needs lr as a one-element floating tensor on the parameters' "
                         f"device, got lr={lr!r}: a captured step reads it at every replay (LR schedulers update "
                         "it in place), where a Python float would be frozen into the graph; "
                         "lr=torch.tensor(0.02, device='cuda')")
    if batch_ns is not None and not isinstance(batch_ns, bool):
        raise TypeError(f"{owner}(batch_ns={batch_ns!r}): batch_ns must be None (batch where it changes no "
                        "bit), True or False")
    if ns_impl not in NS_IMPLS:
        raise ValueError(f"{owner}(ns_impl={ns_impl!r}): pass 'auto' (Triton on CUDA, torch's matmuls "
                         "elsewhere), 'cublas' (torch's matmuls, torch.optim.Muon's bits) or 'triton' "
                         "(core/muon's Triton kernels, JAX's bits on the GPU)")


def validate_group(group: dict, where: str) -> None:
    """A group's hyperparameters and static settings; the error names the group."""
    try:
        # torch.optim.Muon takes a one-element tensor of any shape as a number: each is made a
        # float first, as the step's row reads it (the shared reading takes a 1-D tensor for a
        # tuple, as AdamW's betas may be one).
        _checks.validate_rule_hyperparams({key: _checks.plain(group[key], key) for key in RULE.group_keys}, RULE)
        validate_ns(group["ns_coefficients"], group["ns_steps"], group["adjust_lr_fn"])
        _checks.check_maximize(group.get("maximize", False), "maximize")
        if not isinstance(group.get("nesterov"), bool):
            raise TypeError(f"nesterov must be a bool, got {group.get('nesterov')!r}")
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def check_matrix(p: torch.Tensor, name: str) -> None:
    if p.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(p.shape)}: Muon orthogonalises 2-D matrices only; give it to "
                         f"AdamW: {COMBINED_NAME} steps both (a group with kind='adamw'; muon_param_groups(model) "
                         "splits a model's parameters)")
    if p.dtype not in (FLOAT32, BFLOAT16):
        raise TypeError(f"{name} has dtype {p.dtype}: PackedMuon trains float32 or bfloat16 matrices; convert it "
                        "with .float() or .to(torch.bfloat16)")
    if _dtensor.is_dtensor(p):
        # Newton-Schulz gathers the whole matrix and each rank keeps its part of the result: a
        # placement must say which part of the matrix a rank holds.
        if not all(isinstance(pl, (_dtensor.Shard, _dtensor.Replicate)) for pl in p.placements):
            raise ValueError(f"{name} is {_dtensor.describe(p)}: PackedMuon steps DTensor parameters that are "
                             "sharded or replicated (Shard, Replicate), as FSDP2 and tensor parallelism lay them out")
    if not _dtensor.local(p).is_contiguous():
        raise ValueError(f"{name} is not contiguous: pass a contiguous parameter")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {p.device}: PackedMuon runs on CPU and CUDA devices")


def _checked_grad(p: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient the phases read: a DTensor gradient's local shard (laid out like its
    parameter's), or the gradient itself."""
    p_local, g = _checks.kernel_tensors(p, name)
    if not (g.layout is torch.strided and g.shape == p_local.shape and g.is_contiguous()
            and (g.dtype is FLOAT32 or g.dtype is p.dtype) and g.device == p_local.device):
        _checks.raise_grad_error(p_local, g, name, "PackedMuon")
    return g


# ---- the step ------------------------------------------------------------------------------
class Matrix(NamedTuple):
    """One matrix of a step, with the local tensors its phases read and write (a DTensor
    parameter's local shards; a plain one's tensors themselves)."""
    param: torch.Tensor  # as the optimizer holds it: its shape is the whole matrix's
    grad: torch.Tensor
    group: dict
    row: tuple
    name: str
    weights: torch.Tensor
    momentum: torch.Tensor
    low: torch.Tensor | None  # a bf16 parameter's int16 low half
    exponent: torch.Tensor | None  # packed mode's 0-d int32 exponent

    @property
    def sharded(self) -> bool:
        return _dtensor.is_dtensor(self.param)


class Checked(NamedTuple):
    """A matrix `check_step` found ready to step: what `run_step` needs, nothing made yet."""
    param: torch.Tensor
    grad: torch.Tensor
    state: dict  # empty before its first step: `run_step` makes the entries
    group: dict
    row: tuple
    name: str


def step(opt, live: dict | None = None) -> None:
    """One step of every matrix with a gradient: `check_step`, then `run_step`. `live`
    (id(param) -> tensor): parameters whose values a compiled program holds in a copy of its
    own (it writes them back when its graph ends): those copies step instead (`_compiled.run`)."""
    run_step(opt, check_step(opt, live), live)


def check_step(opt, live: dict | None = None) -> list[Checked]:
    """Every check of a step (groups' rows, matrices, gradients, states, one device, the
    Newton-Schulz implementation's device), changing nothing: what raises here leaves the
    optimizer as it was. PackedMuonAdamW checks Muon's step this way before AdamW steps."""
    capturing = _checks.capturing()
    if capturing and not opt.capturable:
        raise RuntimeError("PackedMuon.step() was called while a CUDA graph captures, but this optimizer was built "
                           "without capturable=True: its step computes the step scalars on the host, which a "
                           "captured graph would freeze. Build it with capturable=True and lr tensors on the "
                           "device to capture its step, or step it outside the capture")
    checked = []
    for gi, group in enumerate(opt.param_groups):
        shown = _checks.shown_group_index(opt, gi)
        if opt.capturable:
            _muon_capturable.check_host_values(group, f"param_groups[{shown}]")
        row = _checked_row(opt, group, gi)
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = _checks.param_name(group, shown, pi)
            check_matrix(p, name)
            checked.append(Checked(p, _checked_grad(p, name), _checked_state(opt, p, name), group, row, name))
    _checks.check_one_device([c.param for c in checked], "PackedMuon.step", "PackedMuon")
    if checked:
        weights = _dtensor.local(checked[0].param) if live is None else \
            live.get(id(checked[0].param), _dtensor.local(checked[0].param))
        _check_ns_device(opt, weights.device)
        if opt.capturable:
            _check_capturable_step(opt, checked, weights.device, capturing, live)
    return checked


def _check_capturable_step(opt, checked: list[Checked], device: torch.device, capturing: bool, live) -> None:
    """What a capturable step needs beyond an eager one's checks: the kernels' device, plain
    (not DTensor) matrices, every group's lr tensor there, and under capture every matrix's
    state and what the step reads on the device made by an eager step (so that a refusal comes
    before PackedMuonAdamW's AdamW step is captured)."""
    if not _runs_kernels(opt, device):
        raise ValueError(f"{type(opt).__name__}(capturable=True) runs the step on a CUDA device; these matrices are "
                         f"on {device}: use capturable=False there")
    for c in checked:
        if c.param.numel() and _dtensor.is_dtensor(c.param):
            raise ValueError(f"{c.name} is {_dtensor.describe(c.param)}: capturable=True is not offered for "
                             "DTensor (FSDP2) matrices, whose Newton-Schulz gathers them across ranks; "
                             "use capturable=False")
    for gi, group in enumerate(opt.param_groups):
        _muon_capturable.check_lr(group, f"param_groups[{_checks.shown_group_index(opt, gi)}]", device)
    if capturing:
        if any(not c.state for c in checked):
            raise RuntimeError(_muon_capturable.capture_refusal("a matrix has no state yet (its first step)"))
        work = _matrices(opt, checked, live)
        if work:
            words = _muon_kernels.batch_tables(opt, work)[0] if _batches_ns(opt, device) else None
            _muon_kernels.capture_inputs(opt, work, words, capturing=True, dry_run=True)


def run_step(opt, checked: list[Checked], live: dict | None = None) -> None:
    """The step of matrices `check_step` checked (nothing else may have changed them since):
    the first step's state entries, then the phases. Raises only NonFiniteGradientError (with
    `check_nonfinite`), after every other matrix stepped."""
    for p, g, state, group, row, name in checked:
        if not state:
            opt.state[p].update(fresh_entries(opt, p))
    work = _matrices(opt, checked, live)
    if work and _runs_kernels(opt, work[0].weights.device):
        refused, rejected = _muon_kernels.cuda_step(opt, work)
    else:
        refused, rejected = _cpu_step(opt, work)
    if opt.check_nonfinite and (any(refused) or any(rejected)):
        bad = [f"{w.name} ({'refused whole' if r else f'{n} of {w.param.numel()} weights kept'})"
               for w, r, n in zip(work, refused, rejected) if r or n]
        raise NonFiniteGradientError(
            "PackedMuon.step: non-finite values in " + ", ".join(bad) + ". A refused matrix (NaN/Inf gradient, "
            "momentum, Newton-Schulz input or output) kept its weights and momentum; the others were updated. Find "
            "the source of the NaN/Inf (a finite input whose Newton-Schulz output is not points at ns_coefficients "
            "or ns_steps), or skip such steps with torch.amp.GradScaler / clip_grad_norm_(error_if_nonfinite=True)")


def _matrices(opt, checked: list[Checked], live) -> list[Matrix]:
    """The checked matrices with their state made, as the phases read them. A zero-size one
    has nothing to step (and no learning-rate ratio); its empty state is made, as
    torch.optim.Muon makes its empty buffer."""
    fmt = opt.state_format
    work = []
    for p, g, _, group, row, name in checked:
        if p.numel() == 0:
            continue
        state = opt.state[p]
        low = local_entry(state[LOW_HALF_KEY]) if p.dtype is BFLOAT16 else None
        exponent = local_exponent(state[fmt.exponent_entry.key]) if fmt.exponent_entry else None
        weights = _dtensor.local(p) if live is None else live.get(id(p), _dtensor.local(p))
        work.append(Matrix(p, g, group, row, name, weights, local_entry(state[fmt.state_key]), low, exponent))
    return work


def _runs_kernels(opt, device: torch.device) -> bool:
    """The Triton phases on CUDA; core/muon's numpy phases on the CPU (a test also runs an
    optimizer's kernel step on CPU tensors, through Triton's interpreter)."""
    return device.type == "cuda"


def _checked_row(opt, group: dict, index: int) -> tuple:
    """The group's hyperparameter row (`RULE.group_row` of its `group_keys`: lr, momentum,
    weight_decay, eps as floats), validated once per distinct row and static settings (the
    Newton-Schulz ones, maximize, nesterov), which `validate_group` checks with it.

    Not `_engine.checked_row`: its cache key holds the row and maximize only, and its
    validation (the rule's and maximize) knows neither `validate_ns` nor nesterov."""
    capturable = opt.capturable
    try:
        values = [group[key] for key in RULE.group_keys]
        if capturable:
            values[0] = 0.0  # read on the device, each step (_muon_capturable); its type checked there
        row = RULE.group_row(*values)
        settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["adjust_lr_fn"],
                    group.get("maximize", False), group.get("nesterov"))
        # The verdict depends on the values' types too (5 == 5.0, 1 == True, a tensor lr == a
        # float): a value whose type a fresh check refuses is never let through by an equal one.
        types = _checks.type_signature([*values, *settings])
        key, lr_free_key = (row, settings, types), (row[1:], settings, types)
        hash(key)
    except (TypeError, ValueError, KeyError, RuntimeError):
        key = lr_free_key = None
    valid = opt.__dict__.setdefault("_valid_rows", {})
    # A row that differs from a validated one in its lr alone (a scheduler's Python float) takes
    # only the lr's own checks, as `_engine.checked_row` does (a capturable lr is a tensor).
    if key is None or (key not in valid and (type(group["lr"]) is not float or lr_free_key not in valid
                                             or not RULE.field_holds(0, row))):
        where = f"param_groups[{_checks.shown_group_index(opt, index)}]"
        validate_group({**group, "lr": 0.0} if capturable else group, where)
        if key is None:  # validation said nothing, yet the row is not plain numbers: say so
            raise TypeError(f"{where}: lr, momentum, weight_decay and eps must be numbers, "
                            "ns_coefficients three numbers")
        if len(valid) > 64:
            valid.clear()
        valid[key] = valid[lr_free_key] = True
    return (group["lr"], *row[1:]) if capturable else row


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
        raise ValueError(f"{type(opt).__name__}(ns_impl='triton'): the Triton Newton-Schulz runs on CUDA devices "
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


def _numpy16(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(torch.int16).numpy()


def _scalar_row(w: Matrix) -> tuple:
    return step_scalar_row(w.row, tuple(w.param.shape), adjust_lr_fn=w.group["adjust_lr_fn"])


# ---- DTensor parameters: Newton-Schulz on the whole matrix ----------------------------------
# Each rank runs the elementwise phases on its shards; the Newton-Schulz input X is gathered
# whole (DTensor.full_tensor), every rank orthogonalises the same bits, and each keeps its part of
# the result for its weight phase. A matrix is refused on every rank or on none: a rank that
# refuses its part sends NaNs in place of X, so all of them see a non-finite X.
def _gathered_input(param: torch.Tensor, local_x: torch.Tensor) -> torch.Tensor:
    """The whole X (bf16 bits as int16, the matrix's shape) from every rank's part `local_x`."""
    pairs = _dtensor.wrap_low_half(param, local_x.contiguous())  # int8 pairs: the collectives carry no int16
    return pairs.full_tensor().view(torch.int16).squeeze(-1)


def _local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole matrix laid out as `param`'s local shard (a local
    redistribution from Replicate: no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local().contiguous()


def _cpu_step(opt, work: list[Matrix]) -> tuple[list[bool], list[int]]:
    fmt = opt.state_format
    refused, rejected = [False] * len(work), [0] * len(work)
    # With track_format, each matrix's format counts (added only where it is accepted).
    counts = np.zeros((len(work), launch.MAX_FORMAT_COUNTS), np.int64) if opt.track_format else None
    for batch in _ns_batches(opt, work):
        updates, inputs, scalar_rows = {}, {}, {}
        for i in batch:
            w = work[i]
            scalar_rows[i] = _scalar_row(w)
            grad = w.grad.detach().numpy() if w.grad.dtype is FLOAT32 else _numpy16(w.grad)
            update = momentum_update(grad, w.momentum.numpy(), scalar_rows[i], fmt=fmt,
                                     exponent=None if w.exponent is None else w.exponent.numpy(),
                                     nesterov=w.group["nesterov"], maximize=bool(w.group.get("maximize", False)))
            x = None if update is None else torch.from_numpy(update.ns_bits.view(np.int16))
            if w.sharded:
                x = _gathered_input(w.param, torch.full(w.weights.shape, NAN_BF16_BITS, dtype=torch.int16)
                                    if x is None else x)
                if not bool(torch.isfinite(x.view(BFLOAT16)).all()):
                    x = None
            if x is None:
                refused[i] = True
            else:
                updates[i], inputs[i] = update, x.view(BFLOAT16)
        # A sharded matrix's exponent from its largest |m'| over every shard: one collective for the
        # batch's, before Newton-Schulz (every rank passes the same matrices).
        sharded = [i for i in batch if work[i].sharded] if fmt.exponent_entry else []
        whole_amax = _amax_over_shards([work[i] for i in sharded], [
            torch.tensor(updates[i].amax if i in updates else 0.0) for i in sharded])
        if not inputs:
            continue
        for i, result in zip(inputs, _ns(opt, list(inputs.values()), work[batch[0]].group)):
            w = work[i]
            # The whole O (every rank's, for a sharded matrix: the same) must be finite: one that is
            # not refuses the matrix, and only then are its momentum and exponent stored.
            whole = _numpy16(result.contiguous())
            if not ortho_finite(whole):
                refused[i] = True
                continue
            commit_momentum(updates[i], w.momentum.numpy(), fmt=fmt,
                            exponent=None if w.exponent is None else w.exponent.numpy(),
                            amax=whole_amax.get(id(w.param)),
                            format_counts_out=None if counts is None else counts[i, :len(FORMAT_COUNTS)])
            ortho = _numpy16(_local_part(w.param, result)) if w.sharded else whole
            if w.low is not None:
                rejected[i] = weight_phase_split(_numpy16(w.weights), w.low.numpy(), ortho, scalar_rows[i])
            else:
                rejected[i] = weight_phase(w.weights.detach().numpy(), ortho, scalar_rows[i])
            if w.sharded and opt.check_nonfinite:
                rejected[i] = int(_dtensor.summed_over_shards(w.param, torch.tensor(rejected[i])))
    if counts is not None:
        _track(opt, work, torch.from_numpy(counts), torch.tensor([not r for r in refused]))
    return refused, rejected


def _amax_over_shards(matrices: list[Matrix], values: list[torch.Tensor]) -> dict:
    """id(param) -> the largest |m'| over every rank's part, of the sharded matrices among
    `matrices` (`values`: this rank's, 0-d, in their order): one all-reduce (MAX) per mesh, on
    the values' device, with no wait. Every rank passes the same matrices, refused ones too."""
    if not any(w.sharded for w in matrices):
        return {}
    from torch.distributed.tensor import DTensor, Partial

    by_mesh: dict[int, tuple] = {}
    for w, value in zip(matrices, values):
        if w.sharded:
            by_mesh.setdefault(id(w.param.device_mesh), (w.param.device_mesh, []))[1].append((w, value))
    whole = {}
    for mesh, members in by_mesh.values():
        local = torch.stack([value for _, value in members])
        reduced = DTensor.from_local(local, mesh, [Partial("max")] * mesh.ndim, run_check=False).full_tensor()
        whole.update((id(w.param), reduced[j]) for j, (w, _) in enumerate(members))
    return whole


def _track(opt, work: list[Matrix], counts: torch.Tensor, accepted: torch.Tensor) -> None:
    """A step's counts for `format_stats` (`track_format`): per matrix its format counts ([n,
    MAX_FORMAT_COUNTS], kept only where it was accepted) and whether it was (refused on every
    rank or none, for a DTensor), on the device, without a wait."""
    _engine.add_pending_counts(opt, [w.param for w in work], [w.weights.numel() for w in work], counts, accepted)


def _counting(opt) -> bool:
    """Whether this step launches the counting twins of the momentum kernels: `track_format`
    in packed mode (the other modes have no codes to count, only refusals)."""
    return opt.track_format and opt.state_format.mode == "packed"


__all__ = ["PackedMuon", "newton_schulz", "newton_schulz_batched", "newton_schulz_triton", "newton_schulz_triton_stacked"]
