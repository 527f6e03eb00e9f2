"""`PackedMuon`: torch.optim.Muon with its momentum in 2 bytes per parameter (docs/MUON.md).

A step per matrix: the momentum phase (core/muon's numpy phase on the CPU, its Triton kernel
on CUDA: per matrix, or per batch with `batch_ns`), Newton-Schulz with torch operations in
bf16 (`newton_schulz`, as torch.optim.Muon runs it; or `newton_schulz_batched` over the
matrices of one shape, with `batch_ns`), the weight phase (numpy or kernel). The shared machinery serves it as it serves
PackedAdamW: parameter names and group checks (`_checks.py`), the low halves of bf16
parameters and their masters (`_state.py`, `functional.py`), the state_dict's identity and the
loaded tensors' restoration (`_persistence.py`).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.optim import Optimizer

from packed_adamw.core import launch
from packed_adamw.core.muon import (
    DEFAULT_MU_BIAS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    StateFormat,
    momentum_phase,
    step_scalar_row,
    validate_hyperparams,
    validate_ns,
    weight_phase,
    weight_phase_split,
)

from . import _checks, _dtensor, _persistence
from ._engine import NonFiniteGradientError
from ._state import LOW_HALF_KEY, new_low_half
from .functional import join_master, split_master_

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
COMBINED_NAME = "PackedMuonAdamW"  # where the parameters Muon refuses belong (combined.py)
# The 16-bit momentum codes live in int16 tensors: torch has few uint16 operations, and
# core/muon reads an int16 view as its bits.
_TORCH_DTYPES = {"uint16": torch.int16, "float32": torch.float32}


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
                          eps: float = 1e-7) -> list[torch.Tensor]:
    """`newton_schulz` of several bf16 matrices that share one wide orientation (m, n), m <= n
    (a tall one enters transposed): stacked into one [B, m, n] tensor, each matrix divided by its
    own Frobenius norm, the iterations as batched GEMMs. Fifteen GEMM launches for the whole
    batch instead of fifteen per matrix, and a few copies (the stacking, the tall results'
    transposition) whatever B is. Returns each result contiguous, in its input's orientation.

    Each matrix's arithmetic is the per-matrix one, but a batched GEMM may sum or round in
    another order than the solo one: on the CPU rare elements differ from `newton_schulz`'s; on
    CUDA tests/test_torch_muon.py compares them (MUON.md, "Batched Newton-Schulz"). A matrix's
    result does not depend on its batch-mates."""
    tall = [i for i, x in enumerate(xs) if x.size(0) > x.size(1)]
    wide = [i for i, x in enumerate(xs) if x.size(0) <= x.size(1)]
    m, n = sorted(xs[0].shape)
    y = torch.empty((len(xs), m, n), dtype=BFLOAT16, device=xs[0].device)  # the tall matrices first
    if tall:
        y[:len(tall)] = torch.stack([xs[i].bfloat16() for i in tall]).transpose(1, 2)
    if wide:
        torch.stack([xs[i].bfloat16() for i in wide], out=y[len(tall):])
    y = newton_schulz_stacked(y, coefficients, steps, eps)
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


def ns_batch_key(shape, group: dict) -> tuple:
    """Matrices with equal keys run Newton-Schulz as one batch: the wide orientation and the
    group's Newton-Schulz settings."""
    rows, cols = shape
    return (min(rows, cols), max(rows, cols), tuple(float(v) for v in group["ns_coefficients"]),
            int(group["ns_steps"]), float(group["eps"]))


def new_momentum(param: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return torch.zeros(fmt.state_shape(param.shape), dtype=_TORCH_DTYPES[fmt.state_dtype], device=param.device)


class PackedMuon(Optimizer):
    """torch.optim.Muon (its arguments, names and defaults) whose momentum is a 2-byte code per
    parameter: `mode="packed"` (E5M10 with exponent bias `mu_bias`, default 31), `"bf16"`, or
    `"fp32"` (torch's float32 `momentum_buffer`; on CPU it equals torch.optim.Muon bit for bit).

    Parameters are 2-D matrices, float32 or bfloat16 (a bf16 one keeps an exact FP32 master as
    PackedAdamW's do: its state adds the int16 low half `"lo"`), contiguous, on one device.
    Embeddings, heads, norms and scalars belong to AdamW: `PackedMuonAdamW` steps both rules
    as one optimizer. `maximize=True` steps on the negated gradient. A matrix whose gradient,
    momentum or Newton-Schulz input is not finite is refused whole: its weights and momentum
    stay as they were (MUON.md); with `check_nonfinite=True` the step then raises
    `NonFiniteGradientError` naming it. Not offered here: torch.compile, capturable steps
    (CUDA graphs) and DTensor (FSDP2) parameters; they are refused.

    `batch_ns=True` runs Newton-Schulz once per batch of matrices that share a shape (up to
    transposition) and settings, as batched GEMMs, and on CUDA each elementwise phase as one
    launch per batch: far fewer launches. Its bits are its
    own: on the CPU they differ from the per-matrix ones in rare elements, on CUDA it is not
    known yet (MUON.md, "Batched Newton-Schulz"). The default, False, is torch.optim.Muon's
    per-matrix way and bits.
    """

    rule_name = "muon"

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
        batch_ns: bool = False,
    ):
        if capturable:
            raise ValueError("PackedMuon(capturable=True): capturable steps (CUDA graphs) are not offered for Muon "
                             "yet; its Newton-Schulz phase is launched from the host. Step it eagerly")
        self.state_format = StateFormat(mode, mu_bias)
        self.check_nonfinite = check_nonfinite
        self.capturable = False
        if not isinstance(batch_ns, bool):
            raise TypeError(f"PackedMuon(batch_ns={batch_ns!r}): batch_ns must be True or False")
        self.batch_ns = batch_ns
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, maximize=maximize)
        validate_group(defaults, "defaults")
        super().__init__(params, defaults)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "state_format": self.state_format, "check_nonfinite": self.check_nonfinite,
                "capturable": False, "batch_ns": getattr(self, "batch_ns", False)}

    def add_param_group(self, param_group: dict) -> None:
        with warnings.catch_warnings():  # a repeated parameter is refused below instead
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        try:
            index = len(self.param_groups) - 1
            group = self.param_groups[index]
            _checks.check_listed_once(group, index)
            validate_group(group, f"param_groups[{index}]")
            for param_index, p in enumerate(group["params"]):
                check_matrix(p, _checks.param_name(group, index, param_index))
            _checks.check_one_device([p for g in self.param_groups for p in g["params"]], f"param_groups[{index}]",
                                     "PackedMuon")
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            raise RuntimeError("PackedMuon.step() under torch.compile is not offered yet: call it outside the "
                               "compiled region (torch.compiler.disable), as an eager step")
        self._opt_called = True  # for LR schedulers (see PackedAdamW.step)
        self._update()
        return loss

    step._wrapped_by_lr_sched = True

    def _update(self) -> None:
        step(self)

    def state_dict(self) -> dict:
        return _persistence.with_identity(super().state_dict(), self.state_format.identity)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by `state_dict()`: its format identity, and every parameter's
        momentum and low half, are checked before anything changes."""
        for_torch, loaded = checked_load(self, state_dict)
        super().load_state_dict(for_torch)
        restore_loaded(self, loaded)

    def master_weights(self) -> list[torch.Tensor]:
        """As PackedAdamW.master_weights: the FP32 masters in parameter order."""
        return [p if p.dtype is not BFLOAT16 else join_master(p, (self.state.get(p) or {}).get(LOW_HALF_KEY))
                for g in self.param_groups for p in g["params"]]

    def load_master_weights(self, masters) -> None:
        """As PackedAdamW.load_master_weights: float32 parameters take the values, bf16 ones
        their exact split (weight and low half); the momentum stays."""
        params = [p for g in self.param_groups for p in g["params"]]
        masters = _checks.checked_masters(params, list(masters), [_persistence.name_of(self, p) for p in params],
                                          self.state)
        for p, master in zip(params, masters):
            if p.dtype is not BFLOAT16:
                p.detach().copy_(master)
                continue
            state = self.state[p]
            if not state:
                state[self.state_format.state_key] = new_momentum(p, self.state_format)
                state[LOW_HALF_KEY] = new_low_half(p)
            split_master_(master, p, state[LOW_HALF_KEY])


# ---- checks ------------------------------------------------------------------------------
def validate_group(group: dict, where: str) -> None:
    """A group's hyperparameters and static settings; the error names the group."""
    try:
        validate_hyperparams(_checks.plain(group["lr"], "lr"), _checks.plain(group["momentum"], "momentum"),
                             _checks.plain(group["weight_decay"], "weight_decay"), _checks.plain(group["eps"], "eps"))
        validate_ns(group["ns_coefficients"], group["ns_steps"], group["adjust_lr_fn"])
        _checks.check_maximize(group.get("maximize", False), "maximize")
        if not isinstance(group.get("nesterov"), bool):
            raise TypeError(f"nesterov must be a bool, got {group.get('nesterov')!r}")
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def check_matrix(p: torch.Tensor, name: str) -> None:
    if _dtensor.is_dtensor(p):
        raise ValueError(f"{name} is a DTensor: PackedMuon does not step sharded (FSDP2) parameters yet; "
                         "Newton-Schulz needs the whole matrix. Use PackedAdamW for sharded models")
    if p.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(p.shape)}: Muon orthogonalises 2-D matrices only; give it to "
                         f"AdamW: {COMBINED_NAME} steps both (a group with kind='adamw'; muon_param_groups(model) "
                         "splits a model's parameters)")
    if p.dtype not in (FLOAT32, BFLOAT16):
        raise TypeError(f"{name} has dtype {p.dtype}: PackedMuon trains float32 or bfloat16 matrices; convert it "
                        "with .float() or .to(torch.bfloat16)")
    if not p.is_contiguous():
        raise ValueError(f"{name} is not contiguous: pass a contiguous parameter")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {p.device}: PackedMuon runs on CPU and CUDA devices")


def _checked_grad(p: torch.Tensor, name: str) -> torch.Tensor:
    g = p.grad
    if not (g.layout is torch.strided and g.shape == p.shape and g.is_contiguous()
            and (g.dtype is FLOAT32 or g.dtype is p.dtype) and g.device == p.device):
        _checks.raise_grad_error(p, g, name, "PackedMuon")
    return g


def _checked_state(opt, p, name: str) -> dict:
    fmt = opt.state_format
    state = opt.state.get(p)
    if not state:
        return {}
    stored = state.get(fmt.state_key)
    expected = _TORCH_DTYPES[fmt.state_dtype]
    if not isinstance(stored, torch.Tensor) or stored.dtype != expected or stored.shape != p.shape \
            or stored.device != p.device or not stored.is_contiguous():
        raise ValueError(f"{name}: its optimizer state has no contiguous {expected} {fmt.state_key!r} tensor of "
                         f"shape {tuple(p.shape)} on {p.device}; load a state saved by PackedMuon with the same "
                         "mode, or start fresh")
    if p.dtype is BFLOAT16:
        _checks.check_live_low_half(p, p, state, name)
    return state


# ---- the step ------------------------------------------------------------------------------
def step(opt) -> None:
    """One step of every matrix with a gradient. Everything is checked, and the first step's
    state entries made, before any matrix steps."""
    if _checks.capturing():
        raise RuntimeError("PackedMuon.step() was called while a CUDA graph captures; Muon's step is not "
                           "capturable: step it outside the capture")
    fmt = opt.state_format
    work = []
    for gi, group in enumerate(opt.param_groups):
        row = _checked_row(opt, group, gi)
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = _checks.param_name(group, gi, pi)
            check_matrix(p, name)
            work.append((p, _checked_grad(p, name), _checked_state(opt, p, name), group, row, name))
    _checks.check_one_device([w[0] for w in work], "PackedMuon.step", "PackedMuon")
    for p, _, state, _, _, _ in work:
        if not state:
            entries = opt.state[p]
            entries[fmt.state_key] = new_momentum(p, fmt)
            if p.dtype is BFLOAT16:
                entries[LOW_HALF_KEY] = new_low_half(p)
    if work and _runs_kernels(opt, work[0][0].device):
        refused, rejected = _cuda_step(opt, work)
    else:
        refused, rejected = _cpu_step(opt, work)
    if opt.check_nonfinite and (any(refused) or any(rejected)):
        bad = [f"{w[5]} ({'refused whole' if r else f'{n} of {w[0].numel()} weights kept'})"
               for w, r, n in zip(work, refused, rejected) if r or n]
        raise NonFiniteGradientError(
            "PackedMuon.step: non-finite values in " + ", ".join(bad) + ". A refused matrix (NaN/Inf gradient, "
            "momentum or Newton-Schulz input) kept its weights and momentum; the others were updated. Find the "
            "source of the NaN/Inf, or skip such steps with torch.amp.GradScaler / "
            "clip_grad_norm_(error_if_nonfinite=True)")


def _runs_kernels(opt, device: torch.device) -> bool:
    """The Triton phases on CUDA; core/muon's numpy phases on the CPU (a test also runs an
    optimizer's kernel step on CPU tensors, through Triton's interpreter)."""
    return device.type == "cuda"


def _checked_row(opt, group: dict, index: int) -> tuple:
    """(lr, momentum, weight_decay, eps) as floats, validated once per distinct row and settings."""
    try:
        row = tuple(float(group[k]) for k in ("lr", "momentum", "weight_decay", "eps"))
        key = (row, tuple(group["ns_coefficients"]), group["ns_steps"], group["adjust_lr_fn"],
               group.get("maximize", False), group.get("nesterov"))
        hash(key)
    except (TypeError, ValueError, KeyError, RuntimeError):
        key = None
    valid = opt.__dict__.setdefault("_valid_rows", {})
    if key is None or key not in valid:
        validate_group(group, f"param_groups[{index}]")
        if key is None:  # validation said nothing, yet the row is not plain numbers: say so
            raise TypeError(f"param_groups[{index}]: lr, momentum, weight_decay and eps must be numbers, "
                            "ns_coefficients three numbers")
        if len(valid) > 64:
            valid.clear()
        valid[key] = True
    return row


def _ns_batches(opt, work) -> list[list[int]]:
    """Indices into `work` of the matrices whose Newton-Schulz runs as one call: all of one
    `ns_batch_key` with `batch_ns`, else each matrix alone (torch.optim.Muon's way)."""
    if not _batches_ns(opt):
        return [[i] for i in range(len(work))]
    batches: dict[tuple, list[int]] = {}
    for i, w in enumerate(work):
        batches.setdefault(ns_batch_key(w[0].shape, w[3]), []).append(i)
    return list(batches.values())


def _batches_ns(opt) -> bool:
    return getattr(opt, "batch_ns", False)  # optimizers pickled before batch_ns existed have none


def _ns(opt, xs: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Newton-Schulz of one batch with its group's settings. With `batch_ns` a lone matrix runs
    the batched function too: its bits do not depend on whether it has batch-mates."""
    settings = (tuple(group["ns_coefficients"]), int(group["ns_steps"]), float(group["eps"]))
    if not _batches_ns(opt):
        return [newton_schulz(x, *settings) for x in xs]
    return newton_schulz_batched(xs, *settings)


def _numpy16(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(torch.int16).numpy()


def _cpu_step(opt, work) -> tuple[list[bool], list[int]]:
    fmt = opt.state_format
    refused, rejected = [False] * len(work), [0] * len(work)
    for batch in _ns_batches(opt, work):
        inputs, scalar_rows = {}, {}
        for i in batch:
            p, g, _, group, row, _ = work[i]
            scalar_rows[i] = step_scalar_row(row, p.shape, adjust_lr_fn=group["adjust_lr_fn"])
            grad = g.detach().numpy() if g.dtype is FLOAT32 else _numpy16(g)
            ns_bits = momentum_phase(grad, opt.state[p][fmt.state_key].numpy(), scalar_rows[i], fmt=fmt,
                                     nesterov=group["nesterov"], maximize=bool(group.get("maximize", False)))
            if ns_bits is None:
                refused[i] = True
            else:
                inputs[i] = torch.from_numpy(ns_bits.view(np.int16)).view(torch.bfloat16)
        if not inputs:
            continue
        for i, result in zip(inputs, _ns(opt, list(inputs.values()), work[batch[0]][3])):
            p, state, scalars = work[i][0], opt.state[work[i][0]], scalar_rows[i]
            ortho = _numpy16(result.contiguous())
            if p.dtype is BFLOAT16:
                rejected[i] = weight_phase_split(_numpy16(p), state[LOW_HALF_KEY].numpy(), ortho, scalars)
            else:
                rejected[i] = weight_phase(p.detach().numpy(), ortho, scalars)
    return refused, rejected


def _cuda_step(opt, work) -> tuple[list[bool], list[int]]:
    """One momentum launch and one weight launch per matrix (core/muon/kernel.py), with
    Newton-Schulz per matrix between them; with `batch_ns`, `_cuda_step_batched`. Nothing waits
    for the GPU unless `check_nonfinite` asks."""
    if _batches_ns(opt):
        return _cuda_step_batched(opt, work)
    from packed_adamw.core.muon.kernel import muon_momentum_kernel, muon_weight_kernel

    fmt = opt.state_format
    constants = fmt.kernel_constexprs(track_format=False)
    device = work[0][0].device
    counters = torch.zeros((len(work), 2), dtype=torch.int32, device=device)  # refused elements, rejected weights
    block = launch.block_size()
    scalar_rows = torch.tensor(np.array([step_scalar_row(w[4], w[0].shape, adjust_lr_fn=w[3]["adjust_lr_fn"])
                                         for w in work], np.float32).reshape(len(work), 4), device=device)
    # Each matrix's views made in two calls, not by indexing per launch (host time is the cost here).
    rows, counts = scalar_rows.unbind(0), counters.view(-1).split(1)  # counts: refused 2i, rejected 2i + 1
    for batch in _ns_batches(opt, work):
        batch = [i for i in batch if work[i][0].numel()]
        scratches, inputs = {}, {}
        for i in batch:
            p, g, _, group, _, _ = work[i]
            stored = opt.state[p][fmt.state_key]
            scratches[i], x = torch.empty_like(stored), torch.empty(p.shape, dtype=torch.int16, device=device)
            grad_bf16 = g.dtype is BFLOAT16
            muon_momentum_kernel[launch.grid(p.numel(), block)](
                g.view(torch.int16) if grad_bf16 else g, stored, scratches[i], x, rows[i], counts[2 * i], p.numel(),
                MODE=constants["MODE"], MU_FRAC=constants["MU_FRAC"], MU_BIAS=constants["MU_BIAS"],
                MU_MAX=constants["MU_MAX"], NESTEROV=bool(group["nesterov"]),
                MAXIMIZE=bool(group.get("maximize", False)), GRAD_BF16=grad_bf16, BLOCK=block,
                **launch.COMPILE_OPTIONS)
            inputs[i] = x.view(torch.bfloat16)
        if not batch:
            continue
        # A refused matrix's X may hold anything: Newton-Schulz runs anyway (no host wait); its
        # output is not used, and a batch's matrices do not mix.
        for i, result in zip(batch, _ns(opt, list(inputs.values()), work[batch[0]][3])):
            p = work[i][0]
            state = opt.state[p]
            ortho = result.contiguous().view(torch.int16)
            split = p.dtype is BFLOAT16
            weights = p.detach().view(torch.int16) if split else p.detach()
            low = state[LOW_HALF_KEY] if split else weights
            muon_weight_kernel[launch.grid(p.numel(), block)](
                weights, low, ortho, scratches[i], state[fmt.state_key], rows[i], counts[2 * i], counts[2 * i + 1],
                p.numel(), SPLIT=split, BLOCK=block, **launch.COMPILE_OPTIONS)
    return _counted(opt, counters)


def _counted(opt, counters: torch.Tensor) -> tuple[list[bool], list[int]]:
    """Per matrix: refused, and how many weights were rejected (read only if `check_nonfinite`)."""
    if not opt.check_nonfinite:
        return [False] * len(counters), [0] * len(counters)
    host = counters.cpu().tolist()
    return [r > 0 for r, _ in host], [n for _, n in host]


def _cuda_step_batched(opt, work) -> tuple[list[bool], list[int]]:
    """The CUDA step with `batch_ns`: per Newton-Schulz batch one momentum launch, which writes
    each matrix's X into its slot of one [B, m, n] buffer (a tall matrix transposed, as
    `newton_schulz_batched` stacks it: the tall first), Newton-Schulz on that buffer, and one
    weight launch reading each matrix's slot of the result (core/muon/kernel.py's table kernels;
    a batch whose matrices differ in a kernel constant, such as bf16 and float32 gradients,
    takes one launch per constant). Every matrix's addresses and the step's scalar rows reach
    the GPU in one copy. A matrix's counters row refuses it alone, as per matrix."""
    from packed_adamw.core.muon.kernel import muon_momentum_table_kernel, muon_weight_table_kernel

    fmt = opt.state_format
    key, state_dtype = fmt.state_key, _TORCH_DTYPES[fmt.state_dtype]
    device = work[0][0].device
    words, plans = [], []
    for batch in _ns_batches(opt, work):
        batch = [i for i in batch if work[i][0].numel()]
        batch = [i for i in batch if _tall(work[i][0])] + [i for i in batch if not _tall(work[i][0])]
        if not batch:
            continue
        rows, cols = sorted(work[batch[0]][0].shape)
        momentum_rows, weight_rows = {}, {}
        for slot, i in enumerate(batch):
            p, g, _, group, _, _ = work[i]
            state, tall = opt.state[p], int(_tall(p))
            constants = (bool(group["nesterov"]), bool(group.get("maximize", False)), g.dtype is BFLOAT16)
            # The table rows' words, in the order core/muon/kernel.py's *_TABLE_COLUMNS name them.
            momentum_rows.setdefault(constants, []).append((g.data_ptr(), state[key].data_ptr(), i, slot, tall))
            split = p.dtype is BFLOAT16
            low = state[LOW_HALF_KEY] if split else p
            weight_rows.setdefault(split, []).append(
                (p.data_ptr(), low.data_ptr(), state[key].data_ptr(), i, slot, tall))
        launches = []
        for table_rows in (momentum_rows, weight_rows):
            offsets = {}
            for constants, members in table_rows.items():
                offsets[constants] = (len(words), len(members))
                words.extend(word for member in members for word in member)
            launches.append(offsets)
        plans.append((batch, rows, cols, work[batch[0]][3], *launches))
    # A model's matrices share a few (row, shape, adjustment)s: each scalar row is computed once.
    row_keys = [(w[4], tuple(w[0].shape), w[3]["adjust_lr_fn"]) for w in work]
    distinct = {k: step_scalar_row(k[0], k[1], adjust_lr_fn=k[2]) for k in dict.fromkeys(row_keys)}
    scalar_rows = np.array([distinct[k] for k in row_keys], np.float32).reshape(len(work), 4)
    staged = torch.empty(len(words) + scalar_rows.size // 2, dtype=torch.int64, pin_memory=device.type == "cuda")
    host = staged.numpy()
    host[:len(words)] = words
    host[len(words):].view(np.float32)[:] = scalar_rows.reshape(-1)
    table = staged.to(device, non_blocking=True)
    scalars = table[len(words):].view(torch.float32)
    counters = torch.zeros((len(work), 2), dtype=torch.int32, device=device)  # refused elements, rejected weights
    mode = fmt.kernel_constexprs(track_format=False)
    block = launch.block_size()
    for batch, rows, cols, group, momentum_launches, weight_launches in plans:
        x = torch.empty((len(batch), rows, cols), dtype=torch.int16, device=device)
        scratch = torch.empty((len(batch), rows * cols), dtype=state_dtype, device=device)
        blocks = launch.grid(rows * cols, block)[0]
        for (nesterov, maximize, grad_bf16), (offset, count) in momentum_launches.items():
            muon_momentum_table_kernel[(blocks, count)](
                table[offset:], scratch, x, scalars, counters, rows, cols, MODE=mode["MODE"],
                MU_FRAC=mode["MU_FRAC"], MU_BIAS=mode["MU_BIAS"], MU_MAX=mode["MU_MAX"], NESTEROV=nesterov,
                MAXIMIZE=maximize, GRAD_BF16=grad_bf16, BLOCK=block, **launch.COMPILE_OPTIONS)
        # A refused matrix's X may hold anything: Newton-Schulz runs anyway (no host wait); its
        # output is not used, and a batch's matrices do not mix.
        ortho = newton_schulz_stacked(x.view(BFLOAT16), tuple(group["ns_coefficients"]), int(group["ns_steps"]),
                                      float(group["eps"])).view(torch.int16)
        for split, (offset, count) in weight_launches.items():
            muon_weight_table_kernel[(blocks, count)](
                table[offset:], scratch, ortho, scalars, counters, rows, cols, MODE=mode["MODE"], SPLIT=split,
                BLOCK=block, **launch.COMPILE_OPTIONS)
    return _counted(opt, counters)


def _tall(p: torch.Tensor) -> bool:
    return p.size(0) > p.size(1)


# ---- saving and loading --------------------------------------------------------------------
def checked_load(opt, state_dict: dict) -> tuple[dict, dict]:
    """Every check of `load_state_dict`; returns what torch's loader takes and, per parameter,
    the checked (momentum, low half)."""
    identity = _persistence.saved_identity(opt, state_dict)
    opt.state_format.check_identity(identity)
    saved_params = [i for g in state_dict["param_groups"] for i in g["params"]]
    our_params = [p for g in opt.param_groups for p in g["params"]]
    if len(saved_params) != len(our_params):
        raise ValueError(f"load_state_dict: the saved state has {len(saved_params)} parameters, this optimizer "
                         f"{len(our_params)}; load it into an optimizer built over the same parameters")
    return _strip_identity(state_dict), checked_entries(opt, state_dict["state"], saved_params, our_params)


def checked_entries(opt, saved_state: dict, saved_params: list, our_params: list) -> dict:
    fmt = opt.state_format
    expected = _TORCH_DTYPES[fmt.state_dtype]
    loaded = {}
    for saved_id, p in zip(saved_params, our_params):
        entry = saved_state.get(saved_id)
        if not entry:
            continue
        where = f"load_state_dict: state of saved parameter {saved_id!r} (for {_persistence.name_of(opt, p)})"
        tensor = entry.get(fmt.state_key)
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint16:
            tensor = tensor.view(torch.int16)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != expected or tuple(tensor.shape) != tuple(p.shape):
            got = tensor if not isinstance(tensor, torch.Tensor) else f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"{where}: {fmt.state_key!r} must be a {expected} tensor of shape {tuple(p.shape)} "
                             f"({fmt.identity}), got {got}; load a state saved by PackedMuon over these parameters")
        if fmt.mode == "fp32" and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: the momentum holds NaN or Inf; this state cannot continue a run")
        low = _checks.checked_loaded_low_half(entry.get(LOW_HALF_KEY), p, where)
        loaded[p] = (tensor, low)
    return loaded


def _strip_identity(state_dict: dict) -> dict:
    groups = [{k: v for k, v in g.items() if k != _persistence.GROUP_FORMAT_KEY} for g in state_dict["param_groups"]]
    return {"state": state_dict["state"], "param_groups": groups}


def restore_loaded(opt, loaded: dict) -> None:
    """torch's loader casts state tensors to a floating parameter's dtype: put the saved codes
    (and low halves) back, bits unchanged, on the parameter's device."""
    key = opt.state_format.state_key
    for p, (tensor, low) in loaded.items():
        state = opt.state[p]
        state.pop("step", None)
        state[key] = tensor.to(p.device, copy=True).contiguous()
        if low is not None:
            state[LOW_HALF_KEY] = low.to(p.device, copy=True).contiguous()


__all__ = ["PackedMuon", "newton_schulz", "newton_schulz_batched"]
