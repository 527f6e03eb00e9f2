"""`PackedAdamW`: torch.optim.AdamW with one uint32 word of state per FP32 parameter."""
from __future__ import annotations

import numbers
from collections import defaultdict

import numpy as np
import torch
from torch.optim import Optimizer

import warnings

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat, launch, validate_hyperparams
from packed_adamw.core import codecs as formats
from packed_adamw.core.portable import PortableState

from . import _compiled, _dtensor
from ._launch import launch_kind
from ._plan import CapturableStepPlan, StepPlan
from .functional import LOW_HALF_DTYPE, LOW_HALF_KEY, adamw_step_, join_master, new_low_half, new_state, \
    outside_split_domain, split_master_

STATE_DICT_KEY = "packed_adamw"  # the format identity travels in the state_dict under this key
GROUP_FORMAT_KEY = "packed_adamw_format"  # ... and in every saved param group (DCP keeps only groups and state)
STATE_DICT_VERSION = 1
MAX_STEP = 2**31 - 2  # the step count after one more step must stay below 2**31 (FORMAT.md)
# format_stats() warns once per parameter when more than this fraction of its element-steps
# saturated a moment (docs/FORMAT_HEALTH.md).
SATURATION_WARNING = 1e-3
FLOAT32, BFLOAT16, STRIDED = torch.float32, torch.bfloat16, torch.strided


class NonFiniteGradientError(FloatingPointError):
    """Some gradient elements were NaN or Inf; those elements were left unchanged."""


class PackedAdamW(Optimizer):
    """AdamW whose two moments share one uint32 word per parameter (docs/FORMAT.md).

    Arguments are torch.optim.AdamW's, plus `mode`: "packed" (E4M11 first moment + E4M12
    RMS, 4 bytes/parameter), or the comparison modes "fp16" (IEEE half in both halves of the
    word, 4 bytes) and "fp32" (two float32 moments, 8 bytes). `m_bias` and `rms_bias` set
    the packed formats' exponent biases; the saved state records them. On CUDA,
    `multi_tensor=True` updates all tensors in one kernel launch (same bits as one launch per
    tensor, which `multi_tensor=False` selects). `maximize=True` (per group, as in torch)
    gives the bits of a step on the negated gradient. `foreach`, `fused` and `differentiable`
    are accepted as None or False, as configurations pass them; `amsgrad` is refused (the
    word holds no running maximum). `capturable=True` (CUDA, a tensor `lr`) keeps the step
    counts and the learning rate on the device, so `torch.cuda.graph` can capture a step
    (README, "Distributed, compiled, captured"). Under `torch.compile` the step is one custom
    op (`packed_adamw::step_`) with the eager step's bits and state (docs/MULTI_TENSOR.md,
    "Compiled steps").

    Parameters must be float32 or bfloat16, contiguous and on one device; DTensor parameters
    (FSDP2's `fully_shard`) are stepped shard by shard and keep DTensor state
    (docs/DISTRIBUTED.md). A bfloat16 parameter is the live weight of an exact FP32 master
    (docs/FORMAT.md, "Split masters"): its state adds `"lo"`, an int16 low half (2 bytes per
    parameter), its gradient may be bfloat16 or float32, and the step runs the FP32 step on the
    master, so fed the same gradient values its master follows an FP32 parameter's trajectory
    bit for bit, and the weight is always the master rounded to nearest bf16.
    `master_weights()` returns the FP32 masters, `load_master_weights(tensors)` sets them.
    A gradient element that is NaN or Inf is skipped: that element's parameter and state
    stay unchanged, so no NaN or Inf is ever stored. With `check_nonfinite=True` the
    optimizer also raises `NonFiniteGradientError` after such a step, naming the parameters
    (on CUDA this costs a reduction and a wait for the GPU each step). To skip whole steps
    instead, use `torch.amp.GradScaler` or `clip_grad_norm_(..., error_if_nonfinite=True)`.
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        mode: str = "packed",
        *,
        m_bias: int = DEFAULT_M_BIAS,
        rms_bias: int = DEFAULT_RMS_BIAS,
        multi_tensor: bool = True,
        check_nonfinite: bool = False,
        track_format: bool = False,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ):
        if amsgrad:
            raise ValueError(
                "amsgrad=True is not supported: AMSGrad keeps the running maximum of v as a third moment, and "
                "PackedAdamW's one word per parameter holds only m and sqrt(v); use torch.optim.AdamW(amsgrad=True)"
            )
        for flag, value in (("foreach", foreach), ("fused", fused), ("differentiable", differentiable)):
            if value not in (None, False):
                raise ValueError(
                    f"{flag}={value!r} is not supported: PackedAdamW always runs its own fused kernel "
                    f"(multi_tensor=True: one launch for all tensors on CUDA); pass {flag}=None or False, or leave it out"
                )
        self.state_format = StateFormat(mode, m_bias, rms_bias)
        if capturable not in (True, False):
            raise ValueError(f"capturable={capturable!r}: pass True or False")
        if capturable and (check_nonfinite or not multi_tensor):
            raise ValueError("capturable=True keeps every step on the GPU: it needs multi_tensor=True and "
                             "check_nonfinite=False (counting non-finite elements waits for the GPU)")
        if capturable and not (isinstance(lr, torch.Tensor) and lr.numel() == 1):
            raise ValueError(
                "capturable=True needs the learning rate as a one-element tensor on the parameters' device "
                "(PackedAdamW(..., lr=torch.tensor(1e-3, device='cuda'), capturable=True)): a captured graph "
                "reads that tensor at every replay, and LR schedulers update it in place; a Python float lr "
                "would be frozen into the graph"
            )
        self.multi_tensor = multi_tensor
        self.check_nonfinite = check_nonfinite
        self.capturable = capturable
        self.track_format = track_format  # checked against the mode and capturable (the property)
        _check_maximize(maximize, "maximize")
        validate_hyperparams(_plain(lr, "lr") if not capturable else 0.0, _plain_betas(betas), _plain(eps, "eps"),
                             _plain(weight_decay, "weight_decay"))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._compile_token = _compiled.register(self)  # names this optimizer to its compiled steps

    @property
    def track_format(self) -> bool:
        """Whether the steps made from now on count format events (`format_stats`). It may be
        switched between steps, for instance on only the steps a training loop logs: a step
        made with it off runs the uncounted launch and costs what an optimizer built without
        it costs, and the counts already made wait for `format_stats`."""
        return self.__dict__.get("_track_format", False)

    @track_format.setter
    def track_format(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"track_format={value!r}: pass True or False")
        if value and self.state_format.mode == "fp32":
            raise ValueError("track_format=True counts where packed or fp16 codes saturate, flush or go subnormal; "
                             "fp32 mode stores float32 moments: use mode='packed' or 'fp16'")
        if value and self.__dict__.get("capturable"):
            raise ValueError("track_format=True with capturable=True: a captured step's replays are not counted "
                             "on the host; count with an eager optimizer (capturable=False)")
        self._track_format = bool(value)

    def __getstate__(self) -> dict:
        # torch.optim keeps only defaults, state and param_groups; a copy needs the format too.
        state = {**super().__getstate__(), "state_format": self.state_format, "multi_tensor": self.multi_tensor,
                 "check_nonfinite": self.check_nonfinite, "track_format": self.track_format,
                 "capturable": self.capturable}
        # torch cannot unpickle uint32 storages: plain words travel as int32 views of the same bits.
        key = self.state_format.state_key
        if self.state_format.state_dtype == "uint32":
            state["state"] = defaultdict(dict, {
                p: {k: (v.view(torch.int32) if k == key and v.dtype == torch.uint32 else v) for k, v in s.items()}
                for p, s in self.state.items()})
            state["_words_pickled_as_int32"] = True
        return state

    def __setstate__(self, state: dict) -> None:
        as_int32 = state.pop("_words_pickled_as_int32", False)
        # torch's load_state_dict calls this with only "state" and "param_groups": keep the
        # options already set; an older pickle without them gets the defaults.
        state.setdefault("capturable", self.__dict__.get("capturable", False))
        # The switch lives behind the property (`_track_format`); a pickle carries it by name.
        state["_track_format"] = bool(state.pop("track_format", self.__dict__.get("_track_format", False)))
        super().__setstate__(state)
        self._note_param_lists()
        if "_compile_token" not in self.__dict__:  # a copy or an unpickled optimizer (load_state_dict keeps it)
            self._compile_token = _compiled.register(self)
        if as_int32:
            key = self.state_format.state_key
            for s in self.state.values():
                words = s.get(key)
                if words is not None and not _dtensor.is_dtensor(words) and words.dtype == torch.int32:
                    s[key] = words.view(torch.uint32)

    # ---- parameter groups -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:  # a refused group must not stay behind
            index = len(self.param_groups) - 1
            _validate_group(self.param_groups[index], index)
            _check_one_device([p for g in self.param_groups for p in g["params"]], f"param_groups[{index}]")
        except Exception:
            self.param_groups.pop()
            raise
        self._note_param_lists()

    def _note_param_lists(self) -> None:
        """The groups' parameter lists, for compiled steps to iterate (`_compiled.traced_step`):
        dynamo reading the group dicts themselves guards on their hyperparameters (torch 2.11
        does), so a scheduler changing the lr would recompile the step."""
        self._param_lists = [group["params"] for group in self.param_groups]

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            _compiled.traced_step(self)  # one custom op that runs _compiled_step (docs/MULTI_TENSOR.md)
        else:
            self._opt_called = True  # for LR schedulers (see below)
            self._update()
        return loss

    # torch's LR schedulers replace `opt.step` by a wrapper that notes the call in
    # `opt._opt_called` (to warn when the scheduler steps first); dynamo refuses to trace that
    # wrapper, so `fullgraph=True` would fail for any optimizer with a scheduler. They skip
    # optimizers whose step is marked as wrapped already: the step notes the call itself
    # (under compile, when the op runs).
    step._wrapped_by_lr_sched = True

    # The host-side plan and raw-address launches (or the numpy step on CPU) are not for dynamo
    # to trace: compiled code reaches them through the custom op (_compiled.py), or, where it
    # takes a graph break, by calling this between graphs.
    @torch.compiler.disable
    def _update(self, live: dict | None = None) -> None:
        """The eager step. `live` (id(param) -> tensor): parameters whose values a compiled
        program holds in a tensor of its own (a copy it writes back when its graph ends):
        those tensors step instead, through a full step whose plan is not kept."""
        rows = [self._checked_row(group, index) for index, group in enumerate(self.param_groups)]
        plan = self.__dict__.get("_plan")
        rejected = plan.step(self, rows) if plan is not None and live is None else None
        if rejected is None:
            self._drop_plan()  # a full step that raises must not leave an older plan behind
            self._plan, params, rejected = self._full_step(rows, live)
            if live is not None:
                self._drop_plan()  # its addresses are the copies' (its format counts are kept)
        else:
            params = plan.params
        self._raise_if_rejected(params, rejected)

    def _compiled_step(self, params: list, grads: list, positions: list[int]) -> None:
        """The run-time body of the custom op `packed_adamw::step_` (`_compiled.py`):
        `params[i]` is the parameter at flat position `positions[i]` of `param_groups` or the
        compiled program's copy of it, `grads[i]` its gradient (which the program assigns to
        `.grad` only when its graph ends). Runs the eager step, so bits, state and plans are
        the eager step's."""
        lists = self.__dict__.get("_param_lists", [])
        if len(lists) != len(self.param_groups) or any(a is not g["params"] for a, g in zip(lists, self.param_groups)):
            self._note_param_lists()  # the next call traces the new lists (or finds them unchanged)
            raise RuntimeError("PackedAdamW: a param_groups[i]['params'] list was replaced after this step was "
                               "compiled, so the step was not taken: call the compiled step again (it retraces), "
                               "and add parameters through add_param_group")
        everything = [p for group in self.param_groups for p in group["params"]]
        if len(params) != len(positions) or len(grads) != len(positions) or \
                any(not 0 <= i < len(everything) for i in positions):
            raise RuntimeError("PackedAdamW: a compiled step does not fit this optimizer's param_groups; "
                               "compile the step again after changing the parameter groups")
        live = None
        for i, tensor, grad in zip(positions, params, grads):
            p = everything[i]
            if not _same_memory(p.grad, grad):
                p.grad = grad  # what the program assigns when its graph ends: the step reads .grad
            if not _same_memory(p, tensor):
                live = {} if live is None else live
                live[id(p)] = tensor
        if live is not None and self.capturable:
            raise RuntimeError(
                "PackedAdamW(capturable=True) under torch.compile: the compiled program passed copies of the "
                "parameters instead of updating them in place (the 'aot_eager' backend does so), and a "
                "capturable plan steps the parameters' own memory: use the 'inductor' backend (the default), "
                "or capturable=False")
        self._opt_called = True
        self._update(live)

    def _full_step(self, group_rows: list, live: dict | None = None) -> tuple["StepPlan | None", list, list[int]]:
        """Every check, then the update, then the new state entries. Returns the plan that
        later steps reuse while nothing but gradients and hyperparameters changes, the
        stepped parameters and their rejected counts. A step that raises changes nothing.
        `live` as in `_update`."""
        fmt = self.state_format
        key = fmt.state_key
        params, kernel_params, kernel_grads, found, names, counts, rows, group_of = [], [], [], [], [], [], [], []
        device = None
        for group_index, group in enumerate(self.param_groups):
            first = len(params)
            for param_index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = _param_name(group, group_index, param_index)
                pl, g = _kernel_tensors(p, name)
                if live is not None:
                    pl = live.get(id(p), pl)
                if not (  # what the kernel relies on; _raise_grad_error says which failed
                    (pl.dtype is FLOAT32 or pl.dtype is BFLOAT16) and (g.dtype is FLOAT32 or g.dtype is pl.dtype)
                    and g.layout is STRIDED and g.shape == pl.shape and g.is_contiguous() and pl.is_contiguous()
                    and g.get_device() == pl.get_device()
                ):
                    _raise_grad_error(pl, g, name)
                if device is None:
                    device = pl.get_device()  # an int (-1 for CPU): cheaper than torch.device objects
                elif pl.get_device() != device:
                    _check_one_device([pl, kernel_params[0]], "PackedAdamW.step")
                state = self.state.get(p)
                counts.append(_check_live_state(p, pl, state, fmt, name) + 1 if state else 1)
                params.append(p)
                names.append(name)
                kernel_params.append(pl)
                kernel_grads.append(g)
                found.append(state)
            rows += [group_rows[group_index]] * (len(params) - first)
            group_of += [group_index] * (len(params) - first)
        kinds = [launch_kind(pl, g) for pl, g in zip(kernel_params, kernel_grads)]
        if len(set(kinds)) > 1:  # each launch kind's tensors side by side: their counter rows are one view
            order = sorted(range(len(kinds)), key=kinds.__getitem__)
            params, kernel_params, kernel_grads, found, names, counts, rows, group_of, kinds = (
                [column[i] for i in order]
                for column in (params, kernel_params, kernel_grads, found, names, counts, rows, group_of, kinds))
        stored = [state[key] if state else _dtensor.wrap_state(p, new_state(pl, fmt), fmt, name)
                  for p, pl, state, name in zip(params, kernel_params, found, names)]
        moments = [_dtensor.kernel_state(s) for s in stored]
        stored_lows = [None if not kind.split else state[LOW_HALF_KEY] if state else
                       _dtensor.wrap_low_half(p, new_low_half(pl))
                       for p, pl, state, kind in zip(params, kernel_params, found, kinds)]
        lows = [None if lo is None else _dtensor.kernel_low_half(lo) for lo in stored_lows]
        split = dict(kinds=kinds, lows=lows, stored_lows=stored_lows)
        if self.capturable and params:
            if device >= 0 and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "PackedAdamW(capturable=True): this step must check and (re)build its plan, which cannot happen "
                    "while a CUDA graph captures: take a few eager steps first (torch.cuda.graph's warm-up on a side "
                    "stream), and capture again after changing parameters, gradients' presence or the state")
            return self._full_capturable_step(params, kernel_params, found, stored, moments, counts, group_of,
                                              device, group_rows, split)
        counters = None
        if self.track_format and params:
            counters = torch.zeros((len(params), launch.COUNTER_ROW), dtype=torch.int64, device=kernel_params[0].device)
        rejected = adamw_step_(kernel_params, kernel_grads, moments, counts, rows, fmt, multi_tensor=self.multi_tensor,
                               count_nonfinite=self.check_nonfinite, check_inputs=False,  # checked above
                               counters=counters, track_format=self.track_format, lows=lows)
        states = []
        for p, state, tensor, low_half, count in zip(params, found, stored, stored_lows, counts):
            if not state:
                state = self.state[p]
                state[key] = tensor
                if low_half is not None:
                    state[LOW_HALF_KEY] = low_half
            state["step"] = count
            states.append(state)
        plan = None
        if params:
            plan = StepPlan(self, params, kernel_params, states, stored, moments, group_of, device, counters, **split)
        return plan, params, rejected

    def _full_capturable_step(self, params, kernel_params, found, stored, moments, counts, group_of, device,
                              group_rows, split: dict):
        """The checked full step of `capturable=True`: state entries whose step count is a
        device tensor, a `CapturableStepPlan`, and that plan's step (on the device)."""
        if device < 0:
            raise ValueError("capturable=True runs the step on a CUDA device; these parameters are on the CPU: "
                             "use capturable=False there")
        key = self.state_format.state_key
        states, inserted, old_steps = [], [], []
        try:
            for p, state, tensor, low_half, count in zip(params, found, stored, split["stored_lows"], counts):
                if not state:
                    state = self.state[p]
                    state[key] = tensor
                    if low_half is not None:
                        state[LOW_HALF_KEY] = low_half
                    inserted.append(p)
                old_steps.append(state.get("step"))
                state["step"] = count - 1  # the plan moves it to the device; its step counts it
                states.append(state)
            plan = CapturableStepPlan(self, params, kernel_params, states, stored, moments, group_of, device, **split)
            rejected = plan.step(self, group_rows)
            if rejected is None:
                raise RuntimeError("PackedAdamW: a capturable plan did not hold right after it was made; please "
                                   "report this")
        except BaseException:  # a failed step changes nothing
            for state, step in zip(states, old_steps):
                state["step"] = step
            for p in inserted:
                self.state.pop(p, None)
            raise
        return plan, params, rejected

    # ---- format health ------------------------------------------------------------------
    def _drop_plan(self, keep_counts: bool = True) -> None:
        """Forget the step plan; its format counts go to the per-parameter totals (or, when a
        loaded state starts a new record, away with every total)."""
        plan = self.__dict__.get("_plan")
        totals = self.__dict__.setdefault("_format_totals", {})
        if not keep_counts:
            totals.clear()
        elif plan is not None and plan.counters is not None and plan.tracked_steps:
            self._fold_counts(plan, totals)
        self._plan = None

    @staticmethod
    def _fold_counts(plan, totals: dict) -> None:
        """Adds a plan's counts to `totals` (id(param) -> [param, [6] int64 counts, element-steps]),
        on the device, and zeroes them."""
        n = len(plan.params)
        counts = plan.counters[:, 1:].reshape(n, len(launch.FORMAT_COUNTS), launch.FORMAT_SLOTS).sum(dim=2)
        for i, p in enumerate(plan.params):
            entry = totals.setdefault(id(p), [p, torch.zeros_like(counts[i]), 0])
            entry[1] += counts[i]
            entry[2] += plan.numels[i] * plan.tracked_steps
        plan.counters.zero_()
        plan.tracked_steps = 0

    def format_stats(self) -> dict:
        """Where the moments landed in their formats since the last call (counts reset on
        read), per parameter (its name when the groups carry `param_names`, else its
        position): `elements` (element-steps counted), `saturated_m`, `saturated_rms`,
        `flushed_m`, `flushed_rms`, `subnormal_m`, `subnormal_rms`, as FORMAT.md ("Format
        counts") defines them, over the steps made with `track_format` on (`elements` says
        how many element-steps that was); the step itself never waits for the GPU, this call
        does. Loading a state starts the counts afresh. Warns once per
        parameter whose saturated share passes `SATURATION_WARNING`, saying which bias to move."""
        totals = self.__dict__.setdefault("_format_totals", {})
        plan = self.__dict__.get("_plan")
        pending = totals or (plan is not None and plan.counters is not None and plan.tracked_steps)
        if not (self.track_format or pending):
            raise ValueError("format_stats() reads the counts of steps made with track_format on, and none was made "
                             "since the last read: pass PackedAdamW(..., track_format=True), or set "
                             "opt.track_format = True before the steps to count")
        if plan is not None and plan.counters is not None and plan.tracked_steps:
            self._fold_counts(plan, totals)
        stats = {}
        warned = self.__dict__.setdefault("_saturation_warned", set())
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                entry = totals.get(id(p))
                if entry is None or entry[0] is not p:
                    continue
                key = group["param_names"][pi] if group.get("param_names") else (gi, pi)
                counts = entry[1].cpu().tolist()
                stats[key] = {"elements": entry[2], **dict(zip(launch.FORMAT_COUNTS, counts))}
                if id(p) not in warned and entry[2]:
                    self._warn_saturation(_param_name(group, gi, pi), stats[key], warned, id(p))
        totals.clear()
        return stats

    def _warn_saturation(self, name: str, entry: dict, warned: set, key: int) -> None:
        fmt = self.state_format
        problems = []
        for moment, what, bias_name, bias, codec in (("m", "first moments", "m_bias", fmt.m_bias, fmt.formats[0]),
                                                      ("rms", "RMS values", "rms_bias", fmt.rms_bias, fmt.formats[1])):
            share = entry[f"saturated_{moment}"] / entry["elements"]
            if share > SATURATION_WARNING:
                hint = (f"lower {bias_name} (now {bias}; each step down doubles the largest value)"
                        if fmt.mode == "packed" else "use mode='packed' with a lower bias")
                problems.append(f"{share:.2%} of its {what} saturated at {codec.max_value:g}: {hint}")
        if problems:
            warned.add(key)
            warnings.warn(f"PackedAdamW: {name}: " + "; ".join(problems), RuntimeWarning, stacklevel=3)

    def _raise_if_rejected(self, params: list, rejected: list[int]) -> None:
        if not (self.check_nonfinite and any(rejected)):
            return
        counts_by_param = dict(zip(map(id, params), rejected))
        bad = [f"{_param_name(group, gi, pi)} ({counts_by_param[id(p)]} of {p.numel()} elements)"
               for gi, group in enumerate(self.param_groups) for pi, p in enumerate(group["params"])
               if counts_by_param.get(id(p))]
        raise NonFiniteGradientError(
            "PackedAdamW.step: non-finite values (NaN/Inf gradients, or a parameter or update that is not "
            "finite; for a bfloat16 parameter also a master past the bf16 range) in " + ", ".join(bad) +
            ". Those elements kept their parameter and state; the rest were "
            "updated. Find the source of the NaN/Inf, or use torch.amp.GradScaler / "
            "clip_grad_norm_(error_if_nonfinite=True) to skip such steps."
        )

    def _checked_row(self, group: dict, index: int) -> tuple:
        """The group's (lr, b1, b2, eps, weight_decay, maximize) as floats and a bool. Validity
        depends on the values alone, so rows already seen valid are not checked again (a
        scheduler changes lr)."""
        if self.capturable and not (isinstance(group.get("lr"), torch.Tensor) and group["lr"].numel() == 1):
            raise ValueError(f"param_groups[{index}]['lr'] is {group.get('lr')!r}: capturable=True needs a one-element "
                             "tensor lr on the parameters' device; change it in place (lr.fill_(x)), as LR "
                             "schedulers do")
        try:
            lr, (b1, b2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            maximize = group.get("maximize", False)
            # capturable: the lr stays on the device and is checked there (CapturableStepPlan)
            row = ("on the device" if self.capturable else float(lr), float(b1), float(b2), float(eps),
                   float(weight_decay), maximize)
        except (TypeError, ValueError, RuntimeError):
            row = None  # let the validation say what is wrong
        valid = self.__dict__.setdefault("_valid_rows", {})
        if row is None or row not in valid:
            _validate_hyperparams(group, index, check_lr=not self.capturable)
            if len(valid) > 64:
                valid.clear()
            valid[row] = True
        return row

    def _name_of(self, p) -> str:
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return _param_name(group, gi, pi)
        return "a parameter"

    @property
    def _state_key(self) -> str:
        return self.state_format.state_key

    # ---- saving and loading -------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_DICT_KEY] = {"version": STATE_DICT_VERSION, "format": self.state_format.identity}
        # torch.distributed.checkpoint keeps only "state" and "param_groups": each group
        # carries the identity too, so a sharded save is checked on load like a plain one.
        sd["param_groups"] = [{**group, GROUP_FORMAT_KEY: self.state_format.identity} for group in sd["param_groups"]]
        return sd

    def export_state(self) -> PortableState:
        """The moments and step counts in parameter order, for `packed_adamw.jax.import_state`
        (bf16 parameters add their low halves, which the JAX optimizer does not take)."""
        counts, moments, lows = [], [], []
        for p in (p for g in self.param_groups for p in g["params"]):
            if _dtensor.is_dtensor(p):
                raise ValueError(
                    "export_state: the parameters are DTensors (sharded); a PortableState holds whole tensors. "
                    "Save a sharded state with torch.distributed.checkpoint (docs/DISTRIBUTED.md)"
                )
            state = self.state.get(p) or {}
            counts.append(int(state["step"]) if state else 0)
            tensor = state[self._state_key] if state else new_state(p, self.state_format)
            moments.append(_to_numpy(tensor))
            if p.dtype is BFLOAT16:
                lows.append(_to_numpy(state[LOW_HALF_KEY]) if LOW_HALF_KEY in state else
                            np.zeros(p.shape, formats.LOW_HALF_DTYPE))
            else:
                lows.append(None)
        return PortableState(self.state_format.identity, counts, moments,
                             lows if any(low is not None for low in lows) else None)

    def import_state(self, portable: PortableState) -> None:
        """Replace the state with one exported from JAX (or torch); checks format, shapes, step
        counts, values and low halves (exactly the bf16 parameters have them) before changing
        anything."""
        params = [p for g in self.param_groups for p in g["params"]]
        if any(_dtensor.is_dtensor(p) for p in params):
            raise ValueError(
                "import_state: the parameters are DTensors (sharded); a PortableState holds whole tensors. "
                "Load a sharded state with torch.distributed.checkpoint (docs/DISTRIBUTED.md)"
            )
        portable.check(self.state_format, [tuple(p.shape) for p in params], [p.dtype is BFLOAT16 for p in params])
        lows = portable.low_halves or [None] * len(params)
        new = {}
        for i, (p, count, moments, low) in enumerate(zip(params, portable.counts, portable.moments, lows)):
            name = self._name_of(p)
            count = _checked_step_count(count, f"import_state: tensor {i} ({name})")
            if count == 0 and (low is None or not np.any(low)):
                new[p] = None  # as never stepped (a nonzero low half is kept: load_master_weights set it)
                continue
            array = np.array(moments, order="C", copy=True)  # keeps 0-d shapes (ascontiguousarray does not)
            tensor = torch.from_numpy(array.view(np.int32)).view(torch.uint32) if array.dtype == np.uint32 \
                else torch.from_numpy(array)
            _check_loaded_values(tensor, self.state_format, f"import_state: tensor {i} ({name})")
            new[p] = {"step": count, self._state_key: tensor.to(p.device)}
            if low is not None:
                new[p][LOW_HALF_KEY] = torch.from_numpy(np.array(low, order="C", copy=True)).to(p.device)
        self._drop_plan(keep_counts=False)
        for p, entry in new.items():
            if entry is None:
                self.state.pop(p, None)
            else:
                self.state[p] = entry

    # ---- FP32 masters of bf16 parameters ------------------------------------------------
    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 master weights in parameter order (param_groups flattened): for a bfloat16
        parameter a new float32 tensor joining its weight and low half exactly (FORMAT.md,
        "Split masters"; a DTensor laid out like the parameter when it is one), for a float32
        parameter the parameter itself. For saving or evaluating the model in FP32; on CUDA
        the join runs on host copies."""
        masters = []
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.dtype is not BFLOAT16:
                masters.append(p)
                continue
            low_half = (self.state.get(p) or {}).get(LOW_HALF_KEY)
            local_low = None if low_half is None else _dtensor.kernel_low_half(low_half)
            masters.append(_dtensor.like_param(p, join_master(_dtensor.local(p), local_low)))
        return masters

    @torch.no_grad()
    def load_master_weights(self, masters) -> None:
        """Set the parameters from FP32 master weights in parameter order (as `master_weights()`
        returns them, e.g. an FP32 model's parameters): a float32 parameter takes the value, a
        bfloat16 one its exact split (its weight the master rounded to nearest bf16, ties away
        from zero, and the low half in its optimizer state), so `master_weights()` gives the
        masters back bit for bit. Moments and step counts stay as they are (a parameter never
        stepped gets a fresh state holding its low half). Everything is checked before anything
        changes; masters without a finite bf16 weight (NaN, Inf, |M| > SPLIT_MASTER_MAX) are
        refused. Masters of DTensor parameters must be DTensors laid out like them."""
        params = [p for g in self.param_groups for p in g["params"]]
        masters = list(masters)
        if len(masters) != len(params):
            raise ValueError(f"load_master_weights: got {len(masters)} tensors for {len(params)} parameters; pass "
                             "one FP32 tensor per parameter, in parameter order (as master_weights() returns them)")
        locals_ = []
        for p, m in zip(params, masters):
            name = self._name_of(p)
            where = f"load_master_weights: the master for {name}"
            if not isinstance(m, torch.Tensor) or m.dtype is not FLOAT32 or tuple(m.shape) != tuple(p.shape):
                got = (m.dtype, tuple(m.shape)) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(f"{where} should be a float32 tensor of shape {tuple(p.shape)}, got {got}")
            layout = lambda t: (t.device_mesh, tuple(t.placements)) if _dtensor.is_dtensor(t) else None  # noqa: E731
            if layout(m) != layout(p):
                raise ValueError(f"{where} is {_dtensor.describe(m)} but the parameter is {_dtensor.describe(p)}; pass "
                                 "masters laid out like the parameters (distribute_tensor(t, p.device_mesh, "
                                 "p.placements) for a sharded one)")
            if p.dtype is BFLOAT16:
                outside = outside_split_domain(m)  # a DTensor's count is over every rank: all refuse together
                if outside:
                    raise ValueError(
                        f"{where} has {outside} of {m.numel()} values with no finite bf16 weight (NaN, Inf, or "
                        f"a magnitude above formats.SPLIT_MASTER_MAX = {formats.SPLIT_MASTER_MAX:.6g}): "
                        "a bfloat16 parameter cannot hold them; clip or repair those weights, or keep the parameter "
                        "float32"
                    )
                state = self.state.get(p)
                if state:
                    _check_live_low_half(p, _dtensor.local(p), state, name)
            locals_.append(_dtensor.local(m))
        for p, local in zip(params, locals_):
            if p.dtype is not BFLOAT16:
                _dtensor.local(p).copy_(local)
                continue
            state = self.state[p]
            if not state:  # never stepped: a fresh state (step 0) that keeps the low half
                state["step"] = 0
                state[self._state_key] = _dtensor.wrap_state(p, new_state(_dtensor.local(p), self.state_format),
                                                             self.state_format, self._name_of(p))
                state[LOW_HALF_KEY] = _dtensor.wrap_low_half(p, new_low_half(_dtensor.local(p)))
            split_master_(local, _dtensor.local(p), _dtensor.kernel_low_half(state[LOW_HALF_KEY]))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by `state_dict()` (also through torch.distributed.checkpoint).
        Everything is checked before anything changes: the format identity, the state
        layout of every parameter, step counts, and fp32 moments' values."""
        identity = self._saved_identity(state_dict)
        if identity != self.state_format.identity:
            raise ValueError(
                f"load_state_dict: the saved state has format {identity!r} but this optimizer uses "
                f"{self.state_format.identity!r}; construct PackedAdamW with the same mode, m_bias and rms_bias"
            )
        saved_params = [i for g in state_dict["param_groups"] for i in g["params"]]
        our_params = [p for g in self.param_groups for p in g["params"]]
        if len(saved_params) != len(our_params):
            raise ValueError(
                f"load_state_dict: the saved state has {len(saved_params)} parameters, this optimizer "
                f"{len(our_params)}; load it into an optimizer built over the same parameters"
            )
        fmt = self.state_format
        key = fmt.state_key
        loaded = {}
        for saved_id, p in zip(saved_params, our_params):
            entry = state_dict["state"].get(saved_id)
            if entry is None:
                continue
            where = f"load_state_dict: state of saved parameter {saved_id!r} (for {self._name_of(p)})"
            tensor = entry.get(key)
            _check_loaded_layout(tensor, p, fmt, key, where)
            count = _checked_step_count(entry.get("step"), where)
            _check_loaded_values(_dtensor.kernel_state(tensor), fmt, where)
            loaded[p] = (count, tensor, _checked_loaded_low_half(entry.get(LOW_HALF_KEY), p, where))
        self._drop_plan(keep_counts=False)
        groups = [{k: v for k, v in g.items() if k != GROUP_FORMAT_KEY} for g in state_dict["param_groups"]]
        super().load_state_dict({"state": state_dict["state"], "param_groups": groups})
        # torch casts all non-step state to a floating parameter's dtype, which would turn the
        # words (and low halves) into float values: put the saved tensors back, bits unchanged,
        # contiguous and on the parameter's device, with the step counts as checked ints.
        for p, (count, tensor, low_half) in loaded.items():
            state = self.state[p]
            state["step"] = count
            state[key] = _on_param_device(tensor, p)
            if low_half is not None:
                state[LOW_HALF_KEY] = _on_param_device(low_half, p)

    def _saved_identity(self, state_dict: dict) -> str:
        meta = state_dict.get(STATE_DICT_KEY)
        if meta is not None:
            if not isinstance(meta, dict) or "format" not in meta:
                raise ValueError(
                    f"load_state_dict: the {STATE_DICT_KEY!r} entry has no 'format' (got {meta!r}); the state_dict "
                    "was not written by PackedAdamW.state_dict() or was edited: save it again from the optimizer"
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
            "load_state_dict: this state_dict was not saved by PackedAdamW (no 'packed_adamw' entry and no "
            f"{GROUP_FORMAT_KEY!r} in its param groups); start this optimizer fresh instead of loading another "
            "optimizer's state"
        )


# ---- helpers ----------------------------------------------------------------------------------
_data_ptr = torch.Tensor.data_ptr


def _same_memory(a, b) -> bool:
    """`a` and `b` are one tensor's memory, laid out alike (a compiled program may hand the
    op another tensor object over a parameter's or gradient's storage)."""
    return a is b or (a is not None and b is not None and _data_ptr(a) == _data_ptr(b) and a.dtype is b.dtype
                      and a.shape == b.shape and a.stride() == b.stride())


def _kernel_tensors(p: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(local parameter, local gradient) for the kernel: a DTensor's shard, or the tensors."""
    g = p.grad
    if _dtensor.is_dtensor(p) != _dtensor.is_dtensor(g):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its gradient is {_dtensor.describe(g)}; "
                         "both must be DTensors (FSDP2) or both plain tensors")
    if _dtensor.is_dtensor(p) and (g.placements != p.placements or g.device_mesh != p.device_mesh):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its gradient is {_dtensor.describe(g)}; "
                         "redistribute the gradient like the parameter before step()")
    return _dtensor.local(p), _dtensor.local(g)


def _check_live_state(p, pl, state: dict, fmt: StateFormat, name: str) -> int:
    """The state a step is about to use must be what the kernel's raw addresses expect;
    returns its step count."""
    stored = state.get(fmt.state_key)
    count = state.get("step")
    if stored is None or not isinstance(stored, torch.Tensor):
        raise ValueError(f"{name}: its optimizer state has no {fmt.state_key!r} tensor (got {state!r}); "
                         "load a state saved by PackedAdamW with the same mode, or start fresh")
    if _dtensor.is_dtensor(p) != _dtensor.is_dtensor(stored):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its optimizer state is {_dtensor.describe(stored)}; "
                         "load sharded states with torch.distributed.checkpoint into the sharded model")
    moments = _dtensor.kernel_state(stored)
    if moments.get_device() != pl.get_device():
        raise ValueError(
            f"{name} is on {pl.device} but its optimizer state is on {moments.device}: "
            "move the model before creating the optimizer, or save the state_dict and load it into "
            "a new optimizer (load_state_dict moves the state to the parameters' device)"
        )
    expected_shape, expected_dtype = fmt.state_shape(pl.shape), (torch.float32 if fmt.mode == "fp32" else torch.uint32)
    if tuple(moments.shape) != expected_shape:
        raise ValueError(
            f"{name} has shape {tuple(pl.shape)} but its optimizer state has shape {tuple(moments.shape)}: the "
            "parameter was replaced after the optimizer stepped; build a new optimizer for the new parameter"
        )
    if moments.dtype != expected_dtype or not moments.is_contiguous():
        raise ValueError(
            f"{name}: its optimizer state is {moments.dtype}, contiguous={moments.is_contiguous()}; the step "
            f"writes a contiguous {expected_dtype} tensor in place: put one there (.contiguous()), or load the "
            "state with load_state_dict, which makes it so"
        )
    _check_live_low_half(p, pl, state, name)
    return _checked_step_count(count, name)


def _check_live_low_half(p, pl, state: dict, name: str) -> None:
    """A bf16 parameter's state holds its low half, laid out as the kernel writes it; an FP32
    parameter's holds none."""
    low_half = state.get(LOW_HALF_KEY)
    if pl.dtype is not BFLOAT16:
        if low_half is not None:
            raise ValueError(
                f"{name} is {pl.dtype} but its optimizer state holds a low half {LOW_HALF_KEY!r} (the rest of a "
                "bfloat16 parameter's FP32 master): the parameter was converted after the optimizer stepped. Keep "
                "its dtype, or move the weights with master_weights() / load_master_weights() into a new optimizer"
            )
        return
    if not isinstance(low_half, torch.Tensor):
        raise ValueError(
            f"{name} is bfloat16 but its optimizer state has no low half {LOW_HALF_KEY!r} (got {low_half!r}): it "
            "was made for a float32 parameter, or damaged. A state carries over only between parameters of the "
            "same dtype; to move a run between FP32 and bf16 parameters use master_weights() / "
            "load_master_weights() with a new optimizer"
        )
    if _dtensor.is_dtensor(p) != _dtensor.is_dtensor(low_half):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its low half {LOW_HALF_KEY!r} is "
                         f"{_dtensor.describe(low_half)}; load sharded states with torch.distributed.checkpoint")
    local = _dtensor.kernel_low_half(low_half)
    if (local.dtype != LOW_HALF_DTYPE or local.shape != pl.shape or not local.is_contiguous()
            or local.get_device() != pl.get_device()):
        raise ValueError(
            f"{name}: its low half {LOW_HALF_KEY!r} is {local.dtype} {tuple(local.shape)} on {local.device}, "
            f"contiguous={local.is_contiguous()}; the step writes a contiguous {LOW_HALF_DTYPE} tensor of the "
            f"parameter's shape {tuple(pl.shape)} on {pl.device} in place: load the state with load_state_dict, "
            "which makes it so"
        )


def _checked_step_count(count, where: str) -> int:
    """A saved or stored step count as an int in [0, MAX_STEP]: a one-element tensor or a
    whole float is taken as its value, fractions and bools are refused."""
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = count.item()
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if not isinstance(count, numbers.Integral) or isinstance(count, (bool, np.bool_)) or not 0 <= count <= MAX_STEP:
        raise ValueError(f"{where}: step count {count!r} must be a whole number in [0, {MAX_STEP}]; the state is "
                         "damaged or was edited: load an undamaged state, or start this parameter fresh")
    return int(count)


def _check_loaded_layout(tensor, p, fmt: StateFormat, key: str, where: str) -> None:
    expected_shape = fmt.state_shape(p.shape)
    if tensor is None or not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where} should hold {key!r} (a tensor of shape {expected_shape}), got "
                         f"{None if tensor is None else type(tensor).__name__}; the parameters or their order "
                         "differ from the saved run")
    if _dtensor.is_dtensor(p) != _dtensor.is_dtensor(tensor):
        raise ValueError(f"{where} is {_dtensor.describe(tensor)} but the parameter is {_dtensor.describe(p)}: a "
                         "sharded state loads into the sharded model through torch.distributed.checkpoint "
                         "(set_optimizer_state_dict), which also reshards it; see docs/DISTRIBUTED.md")
    dtype = _dtensor.state_dtype_for(p, fmt)
    if tensor.dtype != dtype or tuple(tensor.shape) != expected_shape:
        raise ValueError(
            f"{where} should hold {key!r} {dtype} of shape {expected_shape} (to match parameter of shape "
            f"{tuple(p.shape)}), got {(tensor.dtype, tuple(tensor.shape))}; the parameters or their order differ "
            "from the saved run"
        )


def _check_loaded_values(moments: torch.Tensor, fmt: StateFormat, where: str) -> None:
    """fp32 moments that are not finite, or a negative v, would make every element reject its
    update and freeze the parameter silently. (Every packed or fp16 word decodes finitely.)"""
    if fmt.mode != "fp32" or moments.numel() == 0:
        return
    m, v = moments[0], moments[1]
    bad_m = int((~torch.isfinite(m)).sum())
    bad_v = int((~torch.isfinite(v) | (v < 0)).sum())
    if bad_m or bad_v:
        raise ValueError(f"{where}: {bad_m} first moments are NaN/Inf and {bad_v} second moments are NaN, Inf or "
                         "negative; such a state would freeze those elements. Load an undamaged state")


def _checked_loaded_low_half(low_half, p, where: str):
    """A saved state's low half must be there exactly for a bf16 parameter, laid out as the
    stored state keeps it; returns it (None for an FP32 parameter)."""
    if p.dtype is not BFLOAT16:
        if low_half is not None:
            raise ValueError(
                f"{where} holds a low half {LOW_HALF_KEY!r}: it was saved from a bfloat16 parameter (a split FP32 "
                f"master), but this parameter is {p.dtype}. Load it into an optimizer over the same bfloat16 "
                "parameters; to move weights between bf16 and FP32 models use master_weights() / "
                "load_master_weights()"
            )
        return None
    if low_half is None:
        raise ValueError(
            f"{where} has no low half {LOW_HALF_KEY!r}: it was saved from a float32 parameter, but this parameter "
            "is bfloat16 (its FP32 master needs the low half). Load it into an optimizer over float32 parameters "
            "like the saved run's; to move weights between FP32 and bf16 models use master_weights() / "
            "load_master_weights()"
        )
    dtype, shape = _dtensor.low_half_layout(p)
    if not isinstance(low_half, torch.Tensor) or _dtensor.is_dtensor(low_half) != _dtensor.is_dtensor(p) \
            or low_half.dtype != dtype or tuple(low_half.shape) != shape:
        got = (low_half.dtype, tuple(low_half.shape), _dtensor.describe(low_half)) \
            if isinstance(low_half, torch.Tensor) else type(low_half).__name__
        raise ValueError(f"{where} should hold {LOW_HALF_KEY!r} {dtype} of shape {shape} "
                         f"({_dtensor.describe(p)}, like the parameter), got {got}; the parameters or their order "
                         "differ from the saved run")
    return low_half


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


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int32).numpy().view(np.uint32).copy() if t.dtype == torch.uint32 else t.numpy().copy()


def _check_one_device(params: list, where: str) -> None:
    devices = {_dtensor.local(p).device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: parameters are on several devices {sorted(map(str, devices))}; PackedAdamW updates one "
            "device: move the model with .to(device) first, or use one optimizer per device"
        )


def _param_name(group: dict, group_index: int, param_index: int) -> str:
    names = group.get("param_names")
    if names:
        return repr(names[param_index])
    return f"param_groups[{group_index}]['params'][{param_index}]"


def _plain(value, name: str):
    """A one-element tensor hyperparameter as a float (as torch.optim accepts); other values as they are."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: a tensor {name} must have one element, got shape {tuple(value.shape)}")
        return float(value)
    return value


def _plain_betas(betas):
    try:
        return tuple(_plain(b, f"beta at index {i}") for i, b in enumerate(betas))
    except TypeError:
        return betas  # not a pair: validate_hyperparams says so


def _check_maximize(value, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: maximize must be True or False")


def _validate_hyperparams(group: dict, index: int, check_lr: bool = True) -> None:
    try:
        validate_hyperparams(_plain(group["lr"], "lr") if check_lr else 0.0, _plain_betas(group["betas"]),
                             _plain(group["eps"], "eps"), _plain(group["weight_decay"], "weight_decay"))
        _check_maximize(group.get("maximize", False), "maximize")
    except (ValueError, TypeError) as e:
        raise type(e)(f"param_groups[{index}]: {e}") from None


def _validate_group(group: dict, index: int) -> None:
    _validate_hyperparams(group, index)
    for param_index, p in enumerate(group["params"]):
        name = _param_name(group, index, param_index)
        local = _dtensor.local(p)
        if p.dtype is torch.float16:
            raise TypeError(
                f"{name} has dtype torch.float16: PackedAdamW trains float32 or bfloat16 parameters (a bf16 one keeps "
                "an exact FP32 master: its bf16 weight plus a 2-byte low half in the optimizer state); convert it "
                "with .to(torch.bfloat16) or .float()"
            )
        if p.dtype not in (FLOAT32, BFLOAT16):
            raise TypeError(
                f"{name} has dtype {p.dtype}: PackedAdamW trains float32 or bfloat16 parameters; convert it with "
                ".float() or .to(torch.bfloat16)"
            )
        if not local.is_contiguous():
            raise ValueError(f"{name} is not contiguous: pass a contiguous parameter (create it with .contiguous())")
        if local.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {local.device}: PackedAdamW runs on CPU and CUDA devices")


def _raise_grad_error(p: torch.Tensor, g: torch.Tensor, name: str) -> None:
    if p.dtype not in (FLOAT32, BFLOAT16) or not p.is_contiguous():  # changed after add_param_group
        raise TypeError(f"{name} is now {p.dtype}, contiguous={p.is_contiguous()}: PackedAdamW trains contiguous "
                        "float32 or bfloat16 parameters")
    if g.is_sparse:
        raise RuntimeError(f"{name} has a sparse gradient: PackedAdamW does not support sparse gradients (use dense ones)")
    if g.is_complex():
        raise TypeError(f"{name} has a complex gradient: PackedAdamW supports real float32 and bfloat16 tensors only")
    if g.dtype not in (FLOAT32, p.dtype):
        allowed = "float32 or bfloat16" if p.dtype is BFLOAT16 else "float32"
        raise TypeError(f"{name}: gradient dtype {g.dtype} does not fit the parameter's {p.dtype}; gradients of "
                        f"{p.dtype} parameters must be {allowed}")
    if g.shape != p.shape:
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from the parameter's {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{name}: gradient is on {g.device} but the parameter is on {p.device}")
    raise ValueError(f"{name}: gradient is not contiguous; make it contiguous before step() (g.contiguous())")
