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

import torch

from packed_adamw.core.muon import DEFAULT_MU_BIAS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, FORMAT_COUNTS, RULE, \
    StateFormat, validate_ns

from . import _capture, _checks, _dtensor, _muon_capturable, _muon_kernels, _muon_ns, _muon_portable, _muon_step
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
from ._muon_ns import (  # noqa: F401  (the public Newton-Schulz functions: this module's names too)
    newton_schulz,
    newton_schulz_batched,
    newton_schulz_stacked,
    newton_schulz_triton,
    newton_schulz_triton_stacked,
)
from ._state import LOW_HALF_KEY

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
COMBINED_NAME = "PackedMuonAdamW"  # where the parameters Muon refuses belong (combined.py)


# ---- the state of DTensor (FSDP2) parameters ------------------------------------------------
# A DTensor parameter's momentum entry is a DTensor on its mesh with its placements, so that
# torch.distributed.checkpoint saves, loads and reshards it as the model's. The 16-bit codes are
# stored as int8 pairs [*shape, 2], as _dtensor.py stores a low half: torch.distributed's
# collectives carry no int16, and a trailing pair dimension keeps every placement of the
# parameter's dims meaning the same. fp32 momenta are float32 DTensors laid out like the parameter.
# Packed mode's exponent (one int32 a matrix) is a 0-d DTensor replicated on the parameter's mesh:
# every rank holds the whole matrix's (`_dtensor.wrap_entry` lays every entry out).
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
        check_options(self.optimizer_name, capturable, batch_ns, ns_impl, lr=lr, check_nonfinite=check_nonfinite)
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

    def _check_saved_hyperparams(self, group: dict, where: str) -> None:
        _checks.check_saved_group_holds(group, (*RULE.group_keys, *NS_GROUP_KEYS), where)
        validate_group(group, where)

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
    if ns_impl not in _muon_ns.NS_IMPLS:
        raise ValueError(f"{owner}(ns_impl={ns_impl!r}): pass 'auto' (Triton on CUDA, torch's matmuls "
                         "elsewhere), 'cublas' (torch's matmuls, torch.optim.Muon's bits) or 'triton' "
                         "(core/muon's Triton kernels, JAX's bits on the GPU)")


# A group's keys the step reads besides its rule's hyperparameters (`RULE.group_keys`).
NS_GROUP_KEYS = ("ns_coefficients", "ns_steps", "adjust_lr_fn", "nesterov")


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


def _checked_grad(opt, p: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient the phases read: a DTensor gradient's local shard (laid out like its
    parameter's), or the gradient itself."""
    p_local, g = _checks.kernel_tensors(p, name)
    if not (g.layout is torch.strided and g.shape == p_local.shape and g.is_contiguous()
            and (g.dtype is FLOAT32 or g.dtype is p.dtype) and g.device == p_local.device):
        _checks.raise_grad_error(p_local, g, name, opt.optimizer_name)
    return g


# ---- the step ------------------------------------------------------------------------------
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
        raise RuntimeError(f"{opt.optimizer_name}.step() was called while a CUDA graph captures, but this optimizer "
                           "was built "
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
            checked.append(Checked(p, _checked_grad(opt, p, name), _checked_state(opt, p, name), group, row, name))
    _checks.check_one_device([c.param for c in checked], f"{opt.optimizer_name}.step", opt.optimizer_name)
    if checked:
        weights = _dtensor.local(checked[0].param) if live is None else \
            live.get(id(checked[0].param), _dtensor.local(checked[0].param))
        _muon_ns._check_ns_device(opt, weights.device)
        if opt.capturable:
            _check_capturable_step(opt, checked, weights.device, capturing, live)
    return checked


def _check_capturable_step(opt, checked: list[Checked], device: torch.device, capturing: bool, live) -> None:
    """What a capturable step needs beyond an eager one's checks: the kernels' device, plain
    (not DTensor) matrices, every group's lr tensor there, and under capture every matrix's
    state and what the step reads on the device made by an eager step (so that a refusal comes
    before PackedMuonAdamW's AdamW step is captured)."""
    if not _runs_kernels(opt, device):
        raise ValueError(f"{opt.optimizer_name}(capturable=True) runs the step on a CUDA device; these matrices are "
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
            raise RuntimeError(_capture.refusal(opt.optimizer_name, "a matrix has no state yet (its first step)"))
        work = _matrices(opt, checked, live)
        if work:
            words = _muon_kernels.batch_tables(opt, work)[0] if _muon_ns._batches_ns(opt, device) else None
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
        refused, rejected = _muon_step.cpu_step(opt, work)
    if opt.check_nonfinite and (any(refused) or any(rejected)):
        bad = [f"{w.name} ({'refused whole' if r else f'{n} of {w.param.numel()} weights kept'})"
               for w, r, n in zip(work, refused, rejected) if r or n]
        raise NonFiniteGradientError(
            f"{opt.optimizer_name}.step: non-finite values in " + ", ".join(bad) + ". A refused matrix (NaN/Inf gradient, "
            "momentum, Newton-Schulz input or output) kept its weights and momentum; the others were updated. Find "
            "the source of the NaN/Inf (a finite input whose Newton-Schulz output is not points at ns_coefficients "
            "or ns_steps), or skip such steps with torch.amp.GradScaler / clip_grad_norm_(error_if_nonfinite=True)")


def _matrices(opt, checked: list[Checked], live) -> list[_muon_step.Matrix]:
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
        work.append(_muon_step.Matrix(p, g, group, row, name, weights, local_entry(state[fmt.state_key]), low, exponent))
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
    except (TypeError, ValueError, KeyError, RuntimeError, OverflowError):  # overflow: an int past a float's range
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


__all__ = ["PackedMuon", "newton_schulz", "newton_schulz_batched", "newton_schulz_triton", "newton_schulz_triton_stacked"]
