"""Saving, loading and moving an elementwise rule's state (`PackedAdamW`'s, or any
`optimizer.ElementwiseOptimizer`'s), and the FP32 masters of bf16 parameters.
`PackedMuon` and `PackedMuonAdamW` reuse the identity (`with_identity`, `saved_identity`) and,
for AdamW groups, the load checks and restoration.

Written against a parameter's state entries as the rule's state format declares them
(`fmt.state_entry`: its key, dtype and shape; for AdamW the uint32 words or fp32 mode's
moments), a bf16 parameter's low half (`LOW_HALF_KEY`) and the step count (`STEP_KEY`), as
`_state.py` lays them out in torch; none is named here. Covered: the state_dict's format
identity and its checks on load, pickling of uint32 words, `PortableState` export and import
(to and from JAX), and `master_weights` / `load_master_weights`. Everything a load reads is
checked before anything changes.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from packed_adamw.core import codecs as formats
from packed_adamw.core.portable import PortableState

from . import _dtensor
from ._checks import BFLOAT16, check_loaded_layout, check_loaded_values, checked_loaded_low_half, \
    checked_masters, checked_step_count, param_name, shown_group_index
from ._engine import drop_plan
from ._state import LOW_HALF_KEY, STEP_KEY, new_low_half, new_state, state_dtype
from .functional import join_master, split_master_

STATE_DICT_KEY = "packed_adamw"  # the format identity travels in the state_dict under this key
GROUP_FORMAT_KEY = "packed_adamw_format"  # ... and in every saved param group (DCP keeps only groups and state)
STATE_DICT_VERSION = 1


def name_of(opt, p) -> str:
    for gi, group in enumerate(opt.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return param_name(group, shown_group_index(opt, gi), pi)
    return "a parameter"


# ---- state_dict ---------------------------------------------------------------------------
def with_identity(sd: dict, identity: str) -> dict:
    """torch's state_dict with the format identity, at the top and in every group:
    torch.distributed.checkpoint keeps only "state" and "param_groups", so a sharded save is
    checked on load like a plain one."""
    sd[STATE_DICT_KEY] = {"version": STATE_DICT_VERSION, "format": identity}
    sd["param_groups"] = [{**group, GROUP_FORMAT_KEY: identity} for group in sd["param_groups"]]
    return sd


def checked_load(opt, state_dict: dict) -> tuple[dict, dict]:
    """Every check of `load_state_dict`: returns what torch's loader takes (groups without the
    identity) and, per parameter, the checked (step count, moments, low half)."""
    identity = saved_identity(opt, state_dict)
    if identity != opt.state_format.identity:
        raise format_refusal(opt, identity)
    saved_params, our_params = checked_groups(opt, state_dict)
    fmt = opt.state_format
    key = fmt.state_key
    loaded = {}
    for saved_id, p in zip(saved_params, our_params):
        entry = state_dict["state"].get(saved_id)
        if not entry:  # none, or {}: not stepped (torch's defaultdict makes {} where the state was only read)
            continue
        where = f"load_state_dict: state of saved parameter {saved_id!r} (for {name_of(opt, p)})"
        tensor = entry.get(key)
        check_loaded_layout(tensor, p, fmt, key, where)
        count = checked_step_count(entry.get(STEP_KEY), where)
        check_loaded_values(_dtensor.kernel_state(tensor), fmt, where)
        loaded[p] = (count, tensor, checked_loaded_low_half(entry.get(LOW_HALF_KEY), p, where))
    groups = [{k: v for k, v in g.items() if k != GROUP_FORMAT_KEY} for g in state_dict["param_groups"]]
    return {"state": state_dict["state"], "param_groups": groups}, loaded


def format_refusal(opt, identity) -> ValueError:
    """The refusal of a saved state of another format than `opt`'s, with what to do instead
    (every rule's loader words it so)."""
    if isinstance(identity, dict):  # per-rule identities: a PackedMuonAdamW state
        advice = "it was saved by PackedMuonAdamW (a format per rule): load it into a PackedMuonAdamW"
    else:
        advice = _other_format_advice(opt, identity)
    return ValueError(f"load_state_dict: the saved state has format {identity!r} but this optimizer uses "
                      f"{opt.state_format.identity!r}; {advice}")


def checked_groups(opt, state_dict: dict) -> tuple[list, list]:
    """The saved groups' options, and their parameters against this optimizer's, group by group,
    checked before anything changes (torch's loader checks the sizes only after the step plan
    and its pending counts are dropped); returns (saved parameter ids, our parameters)."""
    check_saved_group_options(opt, state_dict["param_groups"])
    saved_params = [i for g in state_dict["param_groups"] for i in g["params"]]
    our_params = [p for g in opt.param_groups for p in g["params"]]
    if len(saved_params) != len(our_params):
        raise ValueError(
            f"load_state_dict: the saved state has {len(saved_params)} parameters, this optimizer "
            f"{len(our_params)}; load it into an optimizer built over the same parameters"
        )
    saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    our_sizes = [len(g["params"]) for g in opt.param_groups]
    if saved_sizes != our_sizes:
        raise ValueError(
            f"load_state_dict: the saved state's parameter groups hold {saved_sizes} parameters, this "
            f"optimizer's {our_sizes}; load it into an optimizer built with the same groups"
        )
    return saved_params, our_params


def check_saved_group_options(opt, saved_groups: list) -> None:
    """torch's loader puts every key of a saved group into the optimizer's: each saved group
    must hold what `add_param_group` would take (`opt._check_group_options`)."""
    for i, group in enumerate(saved_groups):
        where = f"load_state_dict: saved param_groups[{shown_group_index(opt, i)}]"
        opt._check_group_options(group, where)
        opt._check_saved_hyperparams(group, where)


def restore_loaded(opt, loaded: dict) -> None:
    """After torch's loader: torch casts all non-step state to a floating parameter's dtype,
    which would turn the words (and low halves) into float values. Puts the saved tensors
    back, bits unchanged, contiguous and on the parameter's device, with the step counts as
    checked ints."""
    key = opt.state_format.state_key
    for p, (count, tensor, low_half) in loaded.items():
        state = opt.state[p]
        state[STEP_KEY] = count
        state[key] = _on_param_device(tensor, p)
        if low_half is not None:
            state[LOW_HALF_KEY] = _on_param_device(low_half, p)


# ---- pickling -----------------------------------------------------------------------------
def words_as_int32(opt, state: dict, formats=None) -> dict:
    """torch cannot unpickle uint32 storages: plain words travel as int32 views of the same
    bits (`words_from_int32` undoes it). `formats`: the state formats whose entries `opt.state`
    holds (PackedMuonAdamW's AdamW rules'); `opt`'s own by default."""
    keys = {fmt.state_key for fmt in (formats if formats is not None else [opt.state_format])
            if state_dtype(fmt) is torch.uint32}
    if keys:
        state["state"] = defaultdict(dict, {
            p: {k: (v.view(torch.int32) if k in keys and v.dtype == torch.uint32 else v) for k, v in s.items()}
            for p, s in opt.state.items()})
        state["_words_pickled_as_int32"] = True
    return state


def words_from_int32(opt, formats=None) -> None:
    keys = {fmt.state_key for fmt in (formats if formats is not None else [opt.state_format])
            if state_dtype(fmt) is torch.uint32}
    for s in opt.state.values():
        for key in keys:
            words = s.get(key)
            if words is not None and not _dtensor.is_dtensor(words) and words.dtype == torch.int32:
                s[key] = words.view(torch.uint32)


# ---- PortableState, masters -----------------------------------------------------------------
def export_state(opt) -> PortableState:
    """The moments and step counts in parameter order, for `packed_adamw.jax.import_state`
    (bf16 parameters add their low halves, which the JAX optimizer does not take)."""
    counts, moments, lows = [], [], []
    for p in (p for g in opt.param_groups for p in g["params"]):
        if _dtensor.is_dtensor(p):
            raise ValueError(
                "export_state: the parameters are DTensors (sharded); a PortableState holds whole tensors. "
                "Save a sharded state with torch.distributed.checkpoint (docs/DISTRIBUTED.md)"
            )
        state = opt.state.get(p) or {}
        counts.append(int(state[STEP_KEY]) if state else 0)
        tensor = state[opt.state_format.state_key] if state else new_state(p, opt.state_format)
        moments.append(_to_numpy(tensor).view(np.dtype(opt.state_format.state_dtype)))  # (torch's int16: uint16)
        if p.dtype is BFLOAT16:
            lows.append(_to_numpy(state[LOW_HALF_KEY]) if LOW_HALF_KEY in state else
                        np.zeros(p.shape, formats.LOW_HALF_DTYPE))
        else:
            lows.append(None)
    return PortableState(opt.state_format.identity, counts, moments,
                         lows if any(low is not None for low in lows) else None)


def import_state(opt, portable: PortableState) -> None:
    """Replace the state with one exported from JAX (or torch); checks format, shapes, step
    counts, values and low halves (exactly the bf16 parameters have them) before changing
    anything."""
    commit_import(opt, checked_import(opt, portable))


def checked_import(opt, portable: PortableState) -> dict:
    """Every check of `import_state`, changing nothing; returns, per parameter, its new state
    entries (None: as never stepped), for `commit_import`."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(_dtensor.is_dtensor(p) for p in params):
        raise ValueError(
            "import_state: the parameters are DTensors (sharded); a PortableState holds whole tensors. "
            "Load a sharded state with torch.distributed.checkpoint (docs/DISTRIBUTED.md)"
        )
    portable.check(opt.state_format, [tuple(p.shape) for p in params], [p.dtype is BFLOAT16 for p in params])
    lows = portable.low_halves or [None] * len(params)
    new = {}
    for i, (p, count, moments, low) in enumerate(zip(params, portable.counts, portable.moments, lows)):
        name = name_of(opt, p)
        count = checked_step_count(count, f"import_state: tensor {i} ({name})")
        if count == 0 and (low is None or not np.any(low)):
            new[p] = None  # as never stepped (a nonzero low half is kept: load_master_weights set it)
            continue
        array = np.array(moments, order="C", copy=True)  # keeps 0-d shapes (ascontiguousarray does not)
        tensor = _state_tensor(array, opt.state_format)
        check_loaded_values(tensor, opt.state_format, f"import_state: tensor {i} ({name})")
        new[p] = {STEP_KEY: count, opt.state_format.state_key: tensor.to(p.device)}
        if low is not None:
            new[p][LOW_HALF_KEY] = torch.from_numpy(np.array(low, order="C", copy=True)).to(p.device)
    return new


def commit_import(opt, new: dict) -> None:
    """Puts `checked_import`'s entries in place (the plan and the counts start afresh)."""
    drop_plan(opt, keep_counts=False)
    for p, entry in new.items():
        if entry is None:
            opt.state.pop(p, None)
        else:
            opt.state[p] = entry


def master_weights(opt) -> list[torch.Tensor]:
    """The FP32 master weights in parameter order (param_groups flattened): for a bfloat16
    parameter a new float32 tensor joining its weight and low half exactly (FORMAT.md,
    "Split masters"; a DTensor laid out like the parameter when it is one), for a float32
    parameter the parameter itself. For saving or evaluating the model in FP32; on CUDA
    the join runs on host copies."""
    masters = []
    for p in (p for g in opt.param_groups for p in g["params"]):
        if p.dtype is not BFLOAT16:
            masters.append(p)
            continue
        low_half = (opt.state.get(p) or {}).get(LOW_HALF_KEY)
        local_low = None if low_half is None else _dtensor.kernel_low_half(low_half)
        masters.append(_dtensor.like_param(p, join_master(_dtensor.local(p), local_low)))
    return masters


def load_master_weights(opt, masters, fresh_entries=None) -> None:
    """Set the parameters from FP32 master weights in parameter order (as `master_weights()`
    returns them, e.g. an FP32 model's parameters): a float32 parameter takes the value, a
    bfloat16 one its exact split (its weight the master rounded to nearest bf16, ties away
    from zero, and the low half in its optimizer state), so `master_weights()` gives the
    masters back bit for bit. Moments and step counts stay as they are (a parameter never
    stepped gets a fresh state holding its low half: `fresh_entries(p)`, the state entries of
    its rule's first step, `fresh_state_entries` by default). Everything is checked before anything
    changes (`_checks.checked_masters`). Masters of DTensor parameters must be DTensors laid
    out like them. Call it under torch.no_grad()."""
    params = [p for g in opt.param_groups for p in g["params"]]
    locals_ = checked_masters(params, list(masters), [name_of(opt, p) for p in params], opt.state)
    for p, local in zip(params, locals_):
        if p.dtype is not BFLOAT16:
            _dtensor.local(p).copy_(local)
            continue
        state = opt.state[p]
        if not state:  # never stepped: a fresh state that keeps the low half
            state.update(fresh_entries(p) if fresh_entries is not None else fresh_state_entries(opt, p))
        split_master_(local, _dtensor.local(p), _dtensor.kernel_low_half(state[LOW_HALF_KEY]))


def fresh_state_entries(opt, p) -> dict:
    """An elementwise rule's parameter state before its first step (PackedAdamW's, or any
    `optimizer.ElementwiseOptimizer`'s): step 0, every entry its state format lists zeroed (for
    a bf16 parameter the low half too), laid out like the parameter."""
    return {STEP_KEY: 0, **_dtensor.new_entries(p, opt.state_format, name_of(opt, p))}


def saved_identity(opt, state_dict: dict) -> str:
    meta = state_dict.get(STATE_DICT_KEY)
    if meta is not None:
        if not isinstance(meta, dict) or "format" not in meta:
            raise ValueError(
                f"load_state_dict: the {STATE_DICT_KEY!r} entry has no 'format' (got {meta!r}); the state_dict "
                f"was not written by {opt.optimizer_name}.state_dict() or was edited: save it again from the optimizer"
            )
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_DICT_VERSION:
            raise ValueError(
                f"load_state_dict: state_dict version {version!r} is not one this release reads (1 to "
                f"{STATE_DICT_VERSION}); load it with the packed-adamw release that saved it"
            )
        return meta["format"]
    groups = state_dict.get("param_groups") or []
    identities = {g.get(GROUP_FORMAT_KEY) for g in groups}
    if groups and None not in identities and len(identities) == 1:
        return identities.pop()  # a distributed checkpoint: only the groups came through
    raise ValueError(
        f"load_state_dict: this state_dict was not saved by {opt.optimizer_name} (no 'packed_adamw' entry and no "
        f"{GROUP_FORMAT_KEY!r} in its param groups); start this optimizer fresh instead of loading another "
        "optimizer's state"
    )


def _other_format_advice(opt, identity) -> str:
    """What to do with a saved state of another format than `opt`'s. Its rule is read from the
    identity where core knows it (`core.rules`: AdamW's and Muon's formats, every bias): a state
    of another rule loads into that rule's optimizer, and no option of this one makes it fit."""
    name, rule = opt.optimizer_name, opt.state_format.rule.name
    saved = _rule_of_identity(identity)
    if saved is not None and saved != rule:
        return (f"it was saved by an optimizer of rule {saved!r}, and {name} steps rule {rule!r}: load it into "
                f"an optimizer of rule {saved!r}, or start {name} fresh")
    if saved is None and _rule_of_identity(opt.state_format.identity) == rule:  # core knows all of this rule's formats
        return (f"{identity!r} is no format of rule {rule!r} ({name}'s): it was saved by another rule's optimizer; "
                f"load it into that optimizer, or start {name} fresh")
    if not opt.format_keys:
        return f"{name} has one state format: start it fresh, or load a state it saved"
    return f"construct {name} with the same {_listed(opt.format_keys)}"


def _rule_of_identity(identity) -> str | None:
    """The name of the rule whose state format `identity` is, where core knows it; else None."""
    from packed_adamw.core.rules import state_format_from_identity

    try:
        return state_format_from_identity(identity).rule.name
    except ValueError:
        return None


def _listed(names) -> str:
    """("mode", "m_bias", "rms_bias") -> "mode, m_bias and rms_bias"."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _on_param_device(tensor, p):
    """A loaded state tensor, contiguous and on the parameter's device (a copy of a plain one)."""
    if _dtensor.is_dtensor(tensor):
        return _contiguous_dtensor(tensor, p)
    return tensor.to(p.device, copy=True).contiguous()


def _contiguous_dtensor(tensor, p):
    local = tensor.to_local()
    if local.is_contiguous() and local.device == _dtensor.local(p).device:
        return tensor
    return type(tensor).from_local(local.to(_dtensor.local(p).device).contiguous(), tensor.device_mesh,
                                   tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride())


def _state_tensor(array: np.ndarray, fmt) -> torch.Tensor:
    """A state entry checked in its format's numpy dtype as the tensor the optimizer keeps
    (`state_dtype`: uint32 words, 16-bit codes as int16), the same bits."""
    if array.dtype == np.uint32:
        return torch.from_numpy(array.view(np.int32)).view(torch.uint32)
    dtype = state_dtype(fmt)
    return torch.from_numpy(array.view(np.int16) if dtype is torch.int16 else array)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int32).numpy().view(np.uint32).copy() if t.dtype == torch.uint32 else t.numpy().copy()
