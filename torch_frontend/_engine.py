"""How an elementwise rule's step runs (PackedAdamW's, any `optimizer.ElementwiseOptimizer`'s),
apart from the class that holds the options and the state.

Every step takes one route to the launches (or the numpy step): a `StepPlan` (`_plan.py`) and
its `run`. A step whose plan still holds calls `plan.step`; otherwise `full_step` checks every
tensor and its state, inserts the state entries a first step needs, builds a new plan over
them and runs it, so what a full step launches is what the plan's later steps launch. A step
that raises changes nothing: the entries it inserted are taken out again.

Also here: the format counts a plan accumulates, folded into per-parameter totals
(`drop_plan`, `format_stats`), and the error that names the parameters a step rejected
elements of.
"""
from __future__ import annotations

import operator
import warnings
from typing import NamedTuple

import torch

from packed_adamw.core import launch

from . import _checks, _dtensor
from ._launch import launch_kind
from ._plan import CapturableStepPlan, StepPlan
from ._state import LOW_HALF_KEY, STEP_KEY, format_counts, has_format_counts, new_counters, new_low_half, new_state

# format_stats() warns once per parameter when more than this fraction of its element-steps
# saturated a moment (docs/FORMAT_HEALTH.md).
SATURATION_WARNING = 1e-3
FLOAT32, BFLOAT16, STRIDED = torch.float32, torch.bfloat16, torch.strided


class NonFiniteGradientError(FloatingPointError):
    """Some gradient elements were NaN or Inf; those elements were left unchanged."""


class _Checked(NamedTuple):
    """What a full step checked, one entry per parameter with a gradient, launch kinds side
    by side (their counter rows are then one view)."""

    params: list  # as the optimizer holds them
    kernel_params: list  # the tensors the kernel updates (a DTensor's local shard, or a compiled program's copy)
    grads: list  # local gradients
    states: list  # each parameter's state dict, or None before its first step
    names: list[str]
    counts: list[int]  # the step counts after this step
    group_of: list[int]
    kinds: list
    device: int  # -1 for the CPU


# ---- the step ------------------------------------------------------------------------------
def step(opt, live: dict | None = None) -> None:
    """One eager step of `opt`. `live` (id(param) -> tensor): parameters whose values a
    compiled program holds in a tensor of its own (a copy it writes back when its graph ends):
    those tensors step instead, through a full step whose plan is not kept."""
    if not opt.capturable and _checks.capturing():
        name = opt.optimizer_name
        raise RuntimeError(
            f"{name}.step() was called while a CUDA graph captures, but this optimizer was built without "
            "capturable=True: its step reads the step counts and the learning rate on the host, which a captured "
            f"graph would freeze. Build it with {name}(..., lr=torch.tensor(lr, device='cuda'), "
            "capturable=True) to capture its step, or step it outside the capture")
    rows = [checked_row(opt, group, index) for index, group in enumerate(opt.param_groups)]
    kept = opt.__dict__.get("_kept_rows")
    if kept and max(kept) >= len(rows):  # groups were taken away: their dicts need not stay alive here
        for position in [position for position in kept if position >= len(rows)]:
            del kept[position]
    plan = opt.__dict__.get("_plan")
    rejected = plan.step(opt, rows) if plan is not None and live is None else None
    if rejected is None:
        drop_plan(opt)  # a full step that raises must not leave an older plan behind
        opt._plan, params, rejected = full_step(opt, rows, live)
        if live is not None:
            drop_plan(opt)  # its addresses are the copies' (its format counts are kept)
    else:
        params = plan.params
    raise_if_rejected(opt, params, rejected)


def full_step(opt, group_rows: list, live: dict | None = None) -> tuple[StepPlan | None, list, list[int]]:
    """Every check, then the state entries a first step needs, then a new plan and its run.
    Returns the plan (later steps reuse it while nothing but gradients and hyperparameters
    changes), the stepped parameters and their rejected counts."""
    checked = _check_step(opt, live)
    if not checked.params:
        return None, [], []
    if opt.capturable:
        if checked.device < 0:
            raise ValueError("capturable=True runs the step on a CUDA device; these parameters are on the CPU: "
                             "use capturable=False there")
        if _checks.capturing():
            raise RuntimeError(
                f"{opt.optimizer_name}(capturable=True): this step must check and (re)build its plan, which cannot "
                "happen while a CUDA graph captures: take a few eager steps first (torch.cuda.graph's warm-up on a "
                "side stream), and capture again after changing parameters, gradients' presence or the state")
    fmt = opt.state_format
    stored = [state[fmt.state_key] if state else _dtensor.wrap_state(p, new_state(pl, fmt), fmt, name)
              for p, pl, state, name in zip(checked.params, checked.kernel_params, checked.states, checked.names)]
    stored_lows = [None if not kind.split else state[LOW_HALF_KEY] if state else
                   _dtensor.wrap_low_half(p, new_low_half(pl))
                   for p, pl, state, kind in zip(checked.params, checked.kernel_params, checked.states, checked.kinds)]
    counters = None
    if opt.track_format and not opt.capturable:
        counters = new_counters(len(checked.params), checked.kernel_params[0].device)
    states, undo = _insert_states(opt, checked, stored, stored_lows)
    try:
        plan_type = CapturableStepPlan if opt.capturable else StepPlan
        plan = plan_type(opt, checked.params, checked.kernel_params, states, stored,
                         [_dtensor.kernel_state(s) for s in stored], checked.group_of, checked.device, counters,
                         rule=opt.rule_launch, kinds=checked.kinds,
                         lows=[None if lo is None else _dtensor.kernel_low_half(lo) for lo in stored_lows],
                         stored_lows=stored_lows)
        rejected = plan.run(opt, checked.grads, [g.data_ptr() for g in checked.grads], checked.counts, group_rows)
        if rejected is None:
            raise RuntimeError(f"{opt.optimizer_name}: a step plan could not run right after it was made; please "
                               "report this")
    except BaseException:  # a failed step changes nothing
        undo()
        raise
    return plan, checked.params, rejected


def _check_step(opt, live: dict | None) -> _Checked:
    """The parameters with gradients and what their step needs, every check made."""
    fmt = opt.state_format
    params, kernel_params, grads, states, names, counts, group_of = [], [], [], [], [], [], []
    device = None
    for group_index, group in enumerate(opt.param_groups):
        shown_index = _checks.shown_group_index(opt, group_index)
        for param_index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = _checks.param_name(group, shown_index, param_index)
            pl, g = _checks.kernel_tensors(p, name)
            if live is not None:
                pl = live.get(id(p), pl)
            if not (  # what the kernel relies on; raise_grad_error says which failed
                (pl.dtype is FLOAT32 or pl.dtype is BFLOAT16) and (g.dtype is FLOAT32 or g.dtype is pl.dtype)
                and g.layout is STRIDED and g.shape == pl.shape and g.is_contiguous() and pl.is_contiguous()
                and g.get_device() == pl.get_device()
            ):
                _checks.raise_grad_error(pl, g, name, opt.optimizer_name)
            if device is None:
                device = pl.get_device()  # an int (-1 for CPU): cheaper than torch.device objects
            elif pl.get_device() != device:
                _checks.check_one_device([pl, kernel_params[0]], f"{opt.optimizer_name}.step", opt.optimizer_name)
            state = opt.state.get(p)
            counts.append(_checks.check_live_state(p, pl, state, fmt, name, opt.optimizer_name) + 1 if state else 1)
            params.append(p)
            names.append(name)
            kernel_params.append(pl)
            grads.append(g)
            states.append(state)
            group_of.append(group_index)
    kinds = [launch_kind(pl, g) for pl, g in zip(kernel_params, grads)]
    columns = [params, kernel_params, grads, states, names, counts, group_of, kinds]
    if len(set(kinds)) > 1:  # each launch kind's tensors side by side: their counter rows are one view
        order = sorted(range(len(kinds)), key=kinds.__getitem__)
        columns = [[column[i] for i in order] for column in columns]
    return _Checked(*columns, device)


def _insert_states(opt, checked: _Checked, stored: list, stored_lows: list) -> tuple[list[dict], callable]:
    """Each parameter's state dict, with the entries a first step needs inserted and the step
    count the plan's run advances (this step's count less one); and the function that undoes
    all of it."""
    key = opt.state_format.state_key
    states, inserted, old_steps = [], [], []
    for p, state, tensor, low_half, count in zip(checked.params, checked.states, stored, stored_lows, checked.counts):
        if not state:
            state = opt.state[p]
            state[key] = tensor
            if low_half is not None:
                state[LOW_HALF_KEY] = low_half
            inserted.append(p)
        old_steps.append(state.get(STEP_KEY))
        state[STEP_KEY] = count - 1
        states.append(state)

    def undo() -> None:
        for state, old in zip(states, old_steps):
            state[STEP_KEY] = old
        for p in inserted:
            opt.state.pop(p, None)

    return states, undo


def checked_row(opt, group: dict, index: int) -> tuple:
    """The group's torch hyperparameter row (`RuleLaunch`): the rule's `group_row` of its
    `group_keys` (for AdamW lr, b1, b2, eps, weight_decay as floats), then maximize. Validity
    depends on the values alone, so rows already seen valid are not checked again (a scheduler
    changes lr), and a group whose values are the very immutable objects of its last step gives
    that step's row back (`_kept_rows`, position -> (group, values, row))."""
    rule = opt.rule_launch.rule
    # The row this group gave last, while it holds the very same value objects and they are
    # immutable (numbers, bools, tuples of them): the same values, so the same verdict and row
    # (a tensor or a list could have changed in place; those take the path below every step).
    # A new float lr beside them (a scheduler's, every step) needs only the checks that read the
    # lr (`Rule.field_holds`), as below; what fails them takes the path below, which says why.
    kept = opt.__dict__.setdefault("_kept_rows", {})
    position = index
    if position in kept:
        held, objects, row = kept[position]
        keys = rule.group_keys
        if held is group and group.get("maximize", False) is objects[-1] \
                and all(map(operator.is_, map(group.get, keys[1:]), objects[1:-1])):
            lr = group.get(keys[0])
            if lr is objects[0]:
                return row
            if type(lr) is float and type(objects[0]) is float:
                row = (lr, *row[1:])
                if rule.field_holds(0, row[:-1]):
                    kept[position] = (group, (lr, *objects[1:]), row)
                    return row
    index = _checks.shown_group_index(opt, index)  # for messages
    lr_key = rule.group_keys[0]  # the learning rate: first, as LR schedulers and capturable steps set it
    if opt.capturable and not (isinstance(group.get(lr_key), torch.Tensor) and group[lr_key].numel() == 1):
        raise ValueError(f"param_groups[{index}][{lr_key!r}] is {group.get(lr_key)!r}: capturable=True needs a "
                         f"one-element tensor {lr_key} on the parameters' device; change it in place "
                         "(lr.fill_(x)), as LR schedulers do")
    try:
        values = [group[key] for key in rule.group_keys]
        maximize = group.get("maximize", False)
        if opt.capturable:
            values[0] = 0.0  # the lr stays on the device and is checked there (CapturableStepPlan)
        row = rule.group_row(*values)
        row = ("on the device" if opt.capturable else row[0], *row[1:], maximize)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # overflow: an int past a float's range
        row = None  # let the validation say what is wrong
    # The verdict depends on the values' types too (5 == 5.0 == True, a tensor lr == a float),
    # so a value whose type a fresh check would refuse is never let through by an equal one.
    # A row that differs from a validated one in its lr alone (a scheduler's, every step) needs
    # only the checks that read the lr (`Rule.field_holds`: a few float comparisons, where the
    # whole validation costs tens of microseconds a group): the second key leaves the lr's value
    # out (its type stays in). A capturable lr is a tensor, so it never takes that path.
    if row is None:
        _checks.validate_group_hyperparams(group, index, rule, check_lr=not opt.capturable)
        return row  # not reached: a row that could not be made is refused above
    types = (_checks.type_signature([group.get(k) for k in rule.group_keys]), type(group.get("maximize", False)))
    key, lr_free_key = (row, *types), (row[1:], *types)
    valid = opt.__dict__.setdefault("_valid_rows", {})
    if key not in valid:
        # Only a Python float lr: the row holds float(lr), which for it (and not for, say, an np.int64
        # or np.longdouble, which the validation rounds to float32 directly) rounds as the validation does.
        if type(group[lr_key]) is not float or lr_free_key not in valid or not rule.field_holds(0, row[:-1]):
            _checks.validate_group_hyperparams(group, index, rule, check_lr=not opt.capturable)
        if len(valid) > 64:
            valid.clear()
        valid[key] = valid[lr_free_key] = True
    objects = (*map(group.get, rule.group_keys), group.get("maximize", False))
    if all(map(_immutable, objects)):
        kept[position] = (group, objects, row)
    else:
        kept.pop(position, None)
    return row


_IMMUTABLE = (float, int, bool, str, type(None))


def _immutable(value) -> bool:
    """Whether a hyperparameter value cannot change in place (a number, a tuple of numbers)."""
    return type(value) in _IMMUTABLE or (type(value) is tuple and all(map(_immutable, value)))


def raise_if_rejected(opt, params: list, rejected: list[int]) -> None:
    if not (opt.check_nonfinite and any(rejected)):
        return
    counts_by_param = dict(zip(map(id, params), rejected))
    bad = [f"{_checks.param_name(group, _checks.shown_group_index(opt, gi), pi)} ({counts_by_param[id(p)]} of "
           f"{p.numel()} elements)"
           for gi, group in enumerate(opt.param_groups) for pi, p in enumerate(group["params"])
           if counts_by_param.get(id(p))]
    raise NonFiniteGradientError(
        f"{opt.optimizer_name}.step: non-finite values (NaN/Inf gradients, or a parameter or update that is not "
        "finite; for a bfloat16 parameter also a master past the bf16 range) in " + ", ".join(bad) +
        ". Those elements kept their parameter and state; the rest were "
        "updated. Find the source of the NaN/Inf, or use torch.amp.GradScaler / "
        "clip_grad_norm_(error_if_nonfinite=True) to skip such steps."
    )


# ---- format counts -----------------------------------------------------------------------
# Per parameter, until `format_stats` reads them (`_format_totals`, id(param) -> entry): the
# format counts ([MAX_FORMAT_COUNTS] int64, the rule's `count_names` first, on the device), the
# element-steps counted (an int, or an int64 tensor on the device) and, for a rule that refuses
# whole matrices (Muon), the steps it refused (an int64 tensor; None for AdamW, which refuses
# elements). A step adds to its plan's counter rows (AdamW) or to the optimizer's
# `PendingCounts` (Muon, which has no plan), on the device: neither waits for the GPU.
class _Totals(NamedTuple):
    param: torch.Tensor
    counts: torch.Tensor
    elements: int | torch.Tensor
    refused: torch.Tensor | None


def _add_totals(totals: dict, p: torch.Tensor, counts: torch.Tensor, elements, refused=None) -> None:
    entry = totals.get(id(p))
    if entry is None or entry.param is not p:
        entry = _Totals(p, torch.zeros_like(counts), 0, None if refused is None else torch.zeros_like(refused))
    totals[id(p)] = entry._replace(counts=entry.counts + counts, elements=entry.elements + elements,
                                   refused=None if refused is None else entry.refused + refused)


class PendingCounts:
    """What the tracked steps of one list of matrices (`params`) counted since the last read,
    each a few tensor operations on the device: per matrix its format counts and, of the steps
    it was accepted in, the element-steps, and the steps it was refused in."""

    def __init__(self, params: list, numels: list[int], device):
        self.params = list(params)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.counts = torch.zeros((len(params), launch.MAX_FORMAT_COUNTS), dtype=torch.int64, device=device)
        self.elements = torch.zeros(len(params), dtype=torch.int64, device=device)
        self.refused = torch.zeros(len(params), dtype=torch.int64, device=device)

    def holds(self, params: list) -> bool:
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def add(self, counts: torch.Tensor, accepted: torch.Tensor) -> None:
        """One step: `counts` [n, MAX_FORMAT_COUNTS] of every matrix (a refused one's are left
        out), `accepted` [n] bools."""
        accepted = accepted.to(torch.int64)
        self.counts += counts * accepted[:, None]
        self.elements += self.numels * accepted
        self.refused += 1 - accepted

    def fold(self, totals: dict) -> None:
        for i, p in enumerate(self.params):
            _add_totals(totals, p, self.counts[i], self.elements[i], self.refused[i])


def add_pending_counts(opt, params: list, numels: list[int], counts: torch.Tensor, accepted: torch.Tensor) -> None:
    """A tracked step's counts of the matrices `params` (`PendingCounts.add`); a step over
    another list first moves the pending counts to the totals."""
    pending = opt.__dict__.get("_pending_counts")
    if pending is None or not pending.holds(params):
        if pending is not None:
            pending.fold(opt.__dict__.setdefault("_format_totals", {}))
        pending = opt._pending_counts = PendingCounts(params, numels, counts.device)
    pending.add(counts, accepted)


def forget_counts(opt) -> None:
    """A loaded state starts a new record: every count kept or pending goes."""
    opt.__dict__.setdefault("_format_totals", {}).clear()
    opt.__dict__.pop("_pending_counts", None)
    plan = opt.__dict__.get("_plan")
    if plan is not None and plan.counters is not None:
        plan.counters.zero_()
        plan.tracked_steps = 0


def drop_plan(opt, keep_counts: bool = True) -> None:
    """Forget the step plan; its format counts go to the per-parameter totals (or, when a
    loaded state starts a new record, away with every total)."""
    plan = opt.__dict__.get("_plan")
    totals = opt.__dict__.setdefault("_format_totals", {})
    if not keep_counts:
        forget_counts(opt)
    elif plan is not None and plan.counters is not None and plan.tracked_steps:
        _fold_counts(plan, totals)
    opt._plan = None


def _add_plan_counts(plan, totals: dict) -> None:
    """Adds a plan's counts to `totals`, on the device (new tensors: the plan's stay as they are)."""
    counts = format_counts(plan.counters)
    for i, p in enumerate(plan.params):
        _add_totals(totals, p, counts[i], plan.numels[i] * plan.tracked_steps)


def _fold_counts(plan, totals: dict) -> None:
    """Adds a plan's counts to `totals`, on the device, and zeroes them."""
    _add_plan_counts(plan, totals)
    plan.counters.zero_()
    plan.tracked_steps = 0


def _unread_totals(opt) -> dict:
    """Every count not read yet (id(param) -> _Totals): the totals kept, the plan's counters and
    the pending counts, gathered on the device without moving any."""
    totals = dict(opt.__dict__.get("_format_totals", {}))
    plan = opt.__dict__.get("_plan")
    if plan is not None and plan.counters is not None and plan.tracked_steps:
        _add_plan_counts(plan, totals)
    pending = opt.__dict__.get("_pending_counts")
    if pending is not None:
        pending.fold(totals)
    return totals


def pickled_counts(opt) -> list | None:
    """The counts not read yet, for a pickle or a copy of `opt` (its `__getstate__`): per
    parameter in param_groups order, its (counts, elements, refused) or None; None when there
    are none. The plan and the pending counts do not travel, their counts do."""
    totals = _unread_totals(opt)
    if not totals:
        return None
    entries = []
    for p in (p for group in opt.param_groups for p in group["params"]):
        entry = totals.get(id(p))
        entries.append(None if entry is None or entry.param is not p else tuple(entry)[1:])
    return entries


def restore_pickled_counts(opt, entries: list | None) -> None:
    """`pickled_counts`' entries back as the totals of the unpickled (or copied) `opt`'s
    parameters, for `format_stats` to read as the original would have."""
    if not entries:
        return
    totals = opt.__dict__.setdefault("_format_totals", {})
    for p, entry in zip((p for group in opt.param_groups for p in group["params"]), entries):
        if entry is not None:
            totals[id(p)] = _Totals(p, *entry)


def counts_to_read(opt) -> bool:
    """Whether `format_stats` has counts to read: steps are counted now, or were since the last read."""
    plan = opt.__dict__.get("_plan")
    return bool(opt.track_format or opt.__dict__.get("_format_totals")
                or (plan is not None and plan.counters is not None and plan.tracked_steps)
                or opt.__dict__.get("_pending_counts") is not None)


def no_counts_error(owner: str) -> ValueError:
    return ValueError(f"format_stats() reads the counts of steps made with track_format on, and none was made "
                      f"since the last read: pass {owner}(..., track_format=True), or set "
                      "opt.track_format = True before the steps to count")


# format_stats' entry of a rule that refuses whole matrices (Muon): the matrix-steps it refused.
REFUSED_STAT = "refused"


def format_stats(opt, count_names: tuple[str, ...]) -> dict:
    """`PackedAdamW.format_stats` (and PackedMuon's): the counts since the last call, per
    parameter, keyed by its name or its (group, position) as messages number them. With no
    counted step since the last read: {} while `track_format` is on (none made yet), and an
    error while it is off (none could be: the switch was forgotten, or the counts read)."""
    if not counts_to_read(opt):
        raise no_counts_error(opt.optimizer_name)
    totals = opt.__dict__.setdefault("_format_totals", {})
    plan = opt.__dict__.get("_plan")
    if plan is not None and plan.counters is not None and plan.tracked_steps:
        _fold_counts(plan, totals)
    pending = opt.__dict__.pop("_pending_counts", None)
    if pending is not None:
        pending.fold(totals)
    stats = {}
    warned = opt.__dict__.setdefault("_saturation_warned", set())
    for gi, group in enumerate(opt.param_groups):
        shown = _checks.shown_group_index(opt, gi)
        for pi, p in enumerate(group["params"]):
            entry = totals.get(id(p))
            if entry is None or entry.param is not p:
                continue
            key = group["param_names"][pi] if group.get("param_names") else (shown, pi)
            stats[key] = {"elements": int(entry.elements)}
            if entry.refused is not None:
                stats[key][REFUSED_STAT] = int(entry.refused)
            stats[key].update(zip(count_names, entry.counts.cpu().tolist()))
            if id(p) not in warned and stats[key]["elements"]:
                _warn_saturation(opt, _checks.param_name(group, shown, pi), stats[key], warned, id(p))
    totals.clear()
    return stats


def _warn_saturation(opt, name: str, entry: dict, warned: set, key: int) -> None:
    """Warns when more than SATURATION_WARNING of a parameter's element-steps saturated one of
    the rule's codes (`Rule.codes`, their codecs the state format's `formats`)."""
    fmt = opt.state_format
    if not has_format_counts(fmt):
        return
    problems = []
    for code, codec in zip(fmt.rule.codes, fmt.formats):
        share = entry[f"saturated_{code.suffix}"] / entry["elements"]
        if share > SATURATION_WARNING:
            # a mode whose codes have a fixed bias (AdamW's fp16) cannot lower it: its packed mode can
            hint = (f"lower {code.bias_option} (now {getattr(fmt, code.bias_option)}; each step down doubles the "
                    "largest value)" if getattr(fmt, "mode", "packed") == "packed"
                    else "use mode='packed' with a lower bias")
            problems.append(f"{share:.2%} of its {code.holds} saturated at {codec.max_value:g}: {hint}")
    if problems:
        warned.add(key)
        warnings.warn(f"{opt.optimizer_name}: {name}: " + "; ".join(problems), RuntimeWarning, stacklevel=4)
