"""`export_state` / `import_state` of `PackedMuon` and `PackedMuonAdamW`: a `PortableState`
(core/portable.py) in parameter order (param_groups flattened), for
`packed_adamw.jax.muon.import_muon_state` or another torch optimizer.

A Muon parameter's tensor is its momentum entry (uint16 codes, or float32 in fp32 mode) in
torch's [out, in] layout, with count None (torch's Muon keeps no step count), in packed mode its
exponent (0-d int32), and a bf16 parameter's low half. An AdamW parameter's tensor is
`_persistence.export_state`'s. Imports check every tensor (format, shape, dtype, exponent, low
half, values) before anything changes; a packed state exported before the exponents imports with
exponent 0.
"""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import codecs
from packed_adamw.core.portable import PortableState

from . import _dtensor, _engine, _persistence
from ._checks import BFLOAT16
from ._muon_state import fresh_entries
from ._state import LOW_HALF_KEY


def _rules_of(opt) -> list:
    """Per parameter (param_groups flattened): the optimizer whose state format it has (the
    rule of a PackedMuonAdamW group's kind and format, or `opt` itself)."""
    rules = getattr(opt, "_rules", None)
    return [rules[opt.rule_key(g)] if rules is not None else opt for g in opt.param_groups for _ in g["params"]]


def _params(opt) -> list[torch.Tensor]:
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(_dtensor.is_dtensor(p) for p in params):
        raise ValueError(f"{opt.optimizer_name}: the parameters are DTensors (sharded); a PortableState holds whole "
                         "tensors. Save a sharded state with torch.distributed.checkpoint (docs/DISTRIBUTED.md)")
    return params


def _is_muon(rule) -> bool:
    return getattr(rule, "rule_name", None) == "muon"


def _muon_tensor(rule, p) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(momentum, exponent or None, low half or None) of one Muon parameter as numpy arrays;
    zeros if never stepped."""
    fmt = rule.state_format
    state = rule.state.get(p) or fresh_entries(rule, p)
    momentum = state[fmt.state_key].detach().cpu()
    array = momentum.numpy().view(np.uint16) if momentum.dtype is torch.int16 else momentum.numpy()
    exponent = None
    if fmt.exponent_entry is not None:
        exponent = state[fmt.exponent_entry.key].detach().cpu().numpy().copy()
    low = None
    if p.dtype is BFLOAT16:
        stored = state.get(LOW_HALF_KEY)
        low = stored.detach().cpu().numpy().copy() if stored is not None else np.zeros(p.shape, codecs.LOW_HALF_DTYPE)
    return array.copy(), exponent, low


def export_state(opt) -> PortableState:
    params, rules = _params(opt), _rules_of(opt)
    adamw = {}  # id(parameter) -> (moments, count, low half), from each AdamW rule's export
    for rule in dict.fromkeys(rules):
        if not _is_muon(rule):
            part = _persistence.export_state(rule)  # in that rule's groups' order
            lows = part.low_halves or [None] * len(part.moments)
            rule_params = [p for g in rule.param_groups for p in g["params"]]
            adamw.update((id(p), entry) for p, entry in zip(rule_params, zip(part.moments, part.counts, lows)))
    identities, counts, moments, lows, exponents = [], [], [], [], []
    for p, rule in zip(params, rules):
        identities.append(rule.state_format.identity)
        exponent = None
        if _is_muon(rule):
            momentum, exponent, low = _muon_tensor(rule, p)
            counts.append(None)
        else:
            momentum, count, low = adamw[id(p)]
            counts.append(count)
        moments.append(momentum)
        exponents.append(exponent)
        lows.append(low)
    return PortableState.of(identities, counts, moments, lows, exponents)


def import_state(opt, portable: PortableState) -> None:
    params, rules = _params(opt), _rules_of(opt)
    names = [_persistence.name_of(opt, p) for p in params]
    fmts = [rule.state_format for rule in rules]
    split = [p.dtype is BFLOAT16 for p in params]
    portable.check_tensors(fmts, [tuple(p.shape) for p in params], split, names)
    portable.check_muon_values(fmts, names)
    lows = portable.low_halves or [None] * len(params)
    muon_entries, adamw = {}, {}  # AdamW: per rule, its parameters' counts, moments and low halves
    for i, (p, rule, count, momentum, low) in enumerate(zip(params, rules, portable.counts, portable.moments, lows)):
        if _is_muon(rule):
            fmt = rule.state_format
            array = np.array(momentum, order="C", copy=True)
            tensor = torch.from_numpy(array.view(np.int16) if array.dtype == np.uint16 else array)
            entry = {fmt.state_key: tensor.to(p.device)}
            if fmt.exponent_entry is not None:  # 0 for a state exported before the exponents
                entry[fmt.exponent_entry.key] = torch.from_numpy(
                    np.array(portable.muon_exponent(i, fmt), order="C", copy=True)).to(p.device)
            if low is not None:
                entry[LOW_HALF_KEY] = torch.from_numpy(np.array(low, order="C", copy=True)).to(p.device)
            muon_entries[p] = (rule, entry)
        else:
            part = adamw.setdefault(rule, {"counts": [], "moments": [], "lows": []})
            part["counts"].append(count)
            part["moments"].append(momentum)
            part["lows"].append(low)
    # Every AdamW rule checks its counts and values before any commits (Muon's entries are checked).
    checked = [(rule, _persistence.checked_import(rule, PortableState.of(
        [rule.state_format.identity] * len(part["counts"]), part["counts"], part["moments"], part["lows"])))
        for rule, part in adamw.items()]
    for rule, new in checked:
        _persistence.commit_import(rule, new)
    for p, (rule, entry) in muon_entries.items():
        rule.state[p] = entry
    for rule in dict.fromkeys(rules):
        if _is_muon(rule):
            _engine.forget_counts(rule)  # an imported state starts the counts afresh, as a loaded one
