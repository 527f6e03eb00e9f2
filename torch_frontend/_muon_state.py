"""PackedMuon's state as torch tensors: a matrix's entries before its first step, the checks a
step makes of them, and `load_state_dict`'s checks and restoration (the optimizer class and its
step live in muon.py; the launches in _muon_kernels.py)."""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core.muon import StateFormat, decode_momentum

from . import _checks, _dtensor, _persistence
from ._state import LOW_HALF_KEY, TORCH_DTYPES
from .functional import nonfinite_count

BFLOAT16 = torch.bfloat16
EXPONENT_DTYPE = TORCH_DTYPES["int32"]  # packed mode's per-matrix exponent (StateFormat.exponent_entry)


def fresh_entries(opt, p: torch.Tensor) -> dict:
    """A matrix's state before its first step (`_dtensor.new_entries`, every rule's): a zero
    momentum entry (and, packed mode, its exponent 0) and, for a bf16 one, a zero low half, each
    laid out like the parameter."""
    return _dtensor.new_entries(p, opt.state_format, _persistence.name_of(opt, p))


def new_exponent(param: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Packed mode's exponent 0 for `param` (a state saved before the exponents reads with it):
    a 0-d int32 tensor on its device, replicated for a DTensor."""
    return _dtensor.new_entries(param, fmt, "")[fmt.exponent_entry.key]


def add_missing_exponents(opt) -> None:
    """An optimizer pickled before packed mode's exponents holds codes alone: each such matrix
    gets exponent 0, under which its codes read as the values they had."""
    entry = opt.__dict__.get("state_format") and opt.state_format.exponent_entry
    if not entry:
        return
    for p, state in opt.state.items():
        if opt.state_format.state_key in state and entry.key not in state:
            state[entry.key] = new_exponent(p, opt.state_format)


def local_exponent(stored: torch.Tensor) -> torch.Tensor:
    """The 0-d int32 tensor the phases read and write of a stored exponent (a replicated
    DTensor's local value)."""
    return _dtensor.local(stored)


def local_entry(stored: torch.Tensor) -> torch.Tensor:
    """The local tensor the phases read and write of a stored momentum entry or low half: a
    view of the stored bits (int16 codes from int8 pairs, float32 momenta as they are)."""
    return _dtensor.kernel_low_half(stored)


def _checked_state(opt, p, name: str) -> dict:
    fmt = opt.state_format
    state = opt.state.get(p)
    if not state:
        return {}
    stored = state.get(fmt.state_key)
    dtype, shape = _dtensor.stored_layout(p, fmt.state_entry)
    p_local = _dtensor.local(p)
    laid_out = isinstance(stored, torch.Tensor) and _dtensor.is_dtensor(stored) == _dtensor.is_dtensor(p) \
        and stored.dtype == dtype and tuple(stored.shape) == shape \
        and (not _dtensor.is_dtensor(p) or tuple(stored.placements) == tuple(p.placements))
    local = local_entry(stored) if laid_out else None
    if not laid_out or local.shape != p_local.shape or local.device != p_local.device or not local.is_contiguous():
        raise ValueError(f"{name}: its optimizer state has no contiguous {dtype} {fmt.state_key!r} tensor of "
                         f"shape {shape} on {p_local.device} ({_dtensor.describe(p)}, like the parameter); load a "
                         "state saved by PackedMuon with the same mode (a sharded one through "
                         "torch.distributed.checkpoint), or start fresh")
    _check_exponent(fmt, p, state.get(fmt.exponent_entry.key) if fmt.exponent_entry else None, name)
    if p.dtype is BFLOAT16:
        _checks.check_live_low_half(p, p_local, state, name)
    return state


def _check_exponent(fmt: StateFormat, p: torch.Tensor, exponent, where: str) -> None:
    """Packed mode's stored exponent of `p`: a 0-d int32 tensor on its device (replicated on a
    DTensor's mesh)."""
    entry = fmt.exponent_entry
    if entry is None:
        return
    laid_out = isinstance(exponent, torch.Tensor) and _dtensor.is_replicated_on(exponent, p) \
        and exponent.dtype == EXPONENT_DTYPE and exponent.dim() == 0 \
        and local_exponent(exponent).device == _dtensor.local(p).device
    if not laid_out:
        got = exponent if not isinstance(exponent, torch.Tensor) else \
            f"{_dtensor.describe(exponent)} {exponent.dtype} {tuple(exponent.shape)}"
        raise ValueError(f"{where}: its optimizer state has no 0-d int32 {entry.key!r} tensor on "
                         f"{_dtensor.local(p).device} (the matrix's exponent in {fmt.identity}"
                         + (", replicated on the parameter's mesh" if _dtensor.is_dtensor(p) else "")
                         + f"), got {got}; load a state saved by PackedMuon with the same mode, or start fresh")


# ---- saving and loading --------------------------------------------------------------------
def checked_load(opt, state_dict: dict) -> tuple[dict, dict]:
    """Every check of `load_state_dict`; returns what torch's loader takes and, per parameter,
    the checked (momentum, exponent, low half). A packed state saved before the exponents (its
    identity without them) loads with every exponent 0: its codes keep the values they had."""
    identity = _persistence.saved_identity(opt, state_dict)
    if isinstance(identity, dict) or not opt.state_format.reads(identity):
        raise _persistence.format_refusal(opt, identity)
    without_exponents = opt.state_format.check_identity(identity)
    saved_params, our_params = _persistence.checked_groups(opt, state_dict)
    return _strip_identity(state_dict), checked_entries(opt, state_dict["state"], saved_params, our_params,
                                                        without_exponents=without_exponents)


def checked_entries(opt, saved_state: dict, saved_params: list, our_params: list, *,
                    without_exponents: bool = False) -> dict:
    fmt = opt.state_format
    loaded = {}
    for saved_id, p in zip(saved_params, our_params):
        entry = saved_state.get(saved_id)
        if not entry:  # none, or {}: not stepped (as `_persistence.checked_load` reads it)
            continue
        where = f"load_state_dict: state of saved parameter {saved_id!r} (for {_persistence.name_of(opt, p)})"
        tensor = entry.get(fmt.state_key)
        if isinstance(tensor, torch.Tensor) and not _dtensor.is_dtensor(tensor) and tensor.dtype == torch.uint16:
            tensor = tensor.view(torch.int16)
        if isinstance(tensor, torch.Tensor) and _dtensor.is_dtensor(tensor) != _dtensor.is_dtensor(p):
            raise ValueError(f"{where}: {fmt.state_key!r} is {_dtensor.describe(tensor)} but the parameter is "
                             f"{_dtensor.describe(p)}: a sharded state loads into the sharded model through "
                             "torch.distributed.checkpoint (set_optimizer_state_dict), which also reshards it")
        dtype, shape = _dtensor.stored_layout(p, fmt.state_entry)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            got = tensor if not isinstance(tensor, torch.Tensor) else f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"{where}: {fmt.state_key!r} must be a {dtype} tensor of shape {shape} "
                             f"({fmt.identity}), got {got}; load a state saved by PackedMuon over these parameters")
        exponent = _checked_loaded_exponent(fmt, p, entry, where, without_exponents)
        if nonfinite_momenta(p, tensor, fmt, exponent):  # a DTensor's count is over every rank: all refuse
            raise ValueError(f"{where}: the momentum holds NaN or Inf, which no step stores (that matrix would be "
                             "refused at every step); this state cannot continue a run: load an undamaged one")
        low = _checks.checked_loaded_low_half(entry.get(LOW_HALF_KEY), p, where)
        loaded[p] = (tensor, exponent, low)
    return loaded


def _checked_loaded_exponent(fmt: StateFormat, p: torch.Tensor, entry: dict, where: str, without_exponents: bool):
    """The saved exponent of `p` (packed mode; None otherwise), checked as the step will read it,
    or a 0 one for a state saved before the exponents."""
    if fmt.exponent_entry is None:
        return None
    key = fmt.exponent_entry.key
    exponent = entry.get(key)
    if without_exponents:
        if exponent is not None:
            raise ValueError(f"{where}: the state's identity {fmt.legacy_identity!r} keeps no {key!r}, yet it holds "
                             "one; the state was edited or damaged: save it again")
        return new_exponent(p, fmt)
    if isinstance(exponent, torch.Tensor) and _dtensor.is_dtensor(exponent) != _dtensor.is_dtensor(p):
        raise ValueError(f"{where}: {key!r} is {_dtensor.describe(exponent)} but the parameter is "
                         f"{_dtensor.describe(p)}: a sharded state loads into the sharded model through "
                         "torch.distributed.checkpoint (set_optimizer_state_dict)")
    if not (isinstance(exponent, torch.Tensor) and exponent.dtype == EXPONENT_DTYPE and exponent.dim() == 0
            and _dtensor.is_replicated_on(exponent, p)):
        got = exponent if not isinstance(exponent, torch.Tensor) else \
            f"{_dtensor.describe(exponent)} {exponent.dtype} {tuple(exponent.shape)}"
        raise ValueError(f"{where}: {key!r} must be a 0-d {EXPONENT_DTYPE} tensor (the matrix's exponent in "
                         f"{fmt.identity}" + (", replicated on the parameter's mesh" if _dtensor.is_dtensor(p) else "")
                         + f"), got {got}; load a state saved by PackedMuon over these parameters")
    # The codes' range is `nonfinite_momenta`'s, which counts over every rank of a sharded matrix.
    fmt.check_exponent(local_exponent(exponent).detach().cpu().numpy(), f"{where}: {key!r}",
                       remedy="the state was edited or damaged: load an undamaged one")
    return exponent


def nonfinite_momenta(p: torch.Tensor, stored: torch.Tensor, fmt: StateFormat, exponent=None) -> int:
    """How many values of `p`'s stored momentum entry are NaN or Inf: fp32 values, bf16 codes
    (exponent all ones), packed codes whose value times 2**exponent is past float32's range
    (a damaged exponent). A DTensor's count is over every rank."""
    if fmt.mode == "fp32":
        return nonfinite_count(stored)
    if fmt.mode == "bf16":
        return nonfinite_count(_dtensor.like_param(p, local_entry(stored).view(BFLOAT16)))
    codes = local_entry(stored).detach().cpu().numpy()
    with np.errstate(over="ignore"):
        count = torch.tensor(int(np.count_nonzero(~np.isfinite(
            decode_momentum(codes, fmt, int(local_exponent(exponent)))))))
    return int(_dtensor.summed_over_shards(p, count)) if _dtensor.is_dtensor(p) else int(count)


def _strip_identity(state_dict: dict) -> dict:
    groups = [{k: v for k, v in g.items() if k != _persistence.GROUP_FORMAT_KEY} for g in state_dict["param_groups"]]
    return {"state": state_dict["state"], "param_groups": groups}


def restore_loaded(opt, loaded: dict) -> None:
    """torch's loader casts state tensors to a floating parameter's dtype: put the saved codes
    (and exponents, low halves) back, bits unchanged, on the parameter's device."""
    fmt = opt.state_format
    for p, (tensor, exponent, low) in loaded.items():
        state = opt.state[p]
        state.pop("step", None)
        state[fmt.state_key] = _persistence._on_param_device(tensor, p)
        if exponent is not None:
            state[fmt.exponent_entry.key] = _persistence._on_param_device(exponent, p)
        if low is not None:
            state[LOW_HALF_KEY] = _persistence._on_param_device(low, p)

