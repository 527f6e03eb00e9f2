"""`PackedAdamW`: torch.optim.AdamW with one uint32 word of state per FP32 parameter.

The class validates its options, holds the hyperparameters and the state, and asks the rest
of the frontend to do the work: `_engine.py` steps (one route: a step plan and its run) and
keeps the format counts, `_checks.py` makes the checks, `_persistence.py` saves, loads and
moves the state and the FP32 masters, `_compiled.py` is the step under torch.compile.
"""
from __future__ import annotations

import warnings

import torch
from torch.optim import Optimizer

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat
from packed_adamw.core.portable import PortableState
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

from . import _checks, _compiled, _engine, _persistence
from .functional import ADAMW_LAUNCH
from ._checks import MAX_STEP, STEP_LIMIT  # noqa: F401  (public names of this module)
from ._engine import SATURATION_WARNING, NonFiniteGradientError  # noqa: F401
from ._persistence import GROUP_FORMAT_KEY, STATE_DICT_KEY, STATE_DICT_VERSION  # noqa: F401


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
    word holds no running maximum). A parameter group sets its own `lr`, `betas`, `eps`,
    `weight_decay` and `maximize`; one that sets an option of the optimizer (`mode`, a bias, a
    switch) or a torch option to what PackedAdamW does not do (`amsgrad=True`,
    `decoupled_weight_decay=False`, ...) is refused naming it, when added and when a
    state_dict's groups load (torch's keys at their defaults, as torch.optim.AdamW's groups
    hold them, are accepted). `capturable=True` (CUDA, a tensor `lr`) keeps the step
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

    rule_launch = ADAMW_LAUNCH  # what the shared step machinery (_engine, _plan, _launch) launches
    # The optimizer's options a group cannot set (`_checks.check_group_options`), each the
    # constructor's option of the same name.
    group_options = {key: key for key in ("mode", "m_bias", "rms_bias", "multi_tensor", "check_nonfinite",
                                          "capturable", "track_format")}

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
        _checks.check_adamw_flags(amsgrad=amsgrad, foreach=foreach, fused=fused, differentiable=differentiable)
        self.state_format = StateFormat(mode, m_bias, rms_bias)
        _checks.check_capturable(capturable, lr, check_nonfinite=check_nonfinite, multi_tensor=multi_tensor)
        self.multi_tensor = multi_tensor
        self.check_nonfinite = check_nonfinite
        self.capturable = capturable
        self.track_format = track_format  # checked against the mode and capturable (the property)
        _checks.check_hyperparams(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize),
                                  self.rule_launch.rule, check_lr=not capturable)
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
        _checks.check_track_format(value, self.state_format, self.__dict__.get("capturable", False))
        self._track_format = value

    def __getstate__(self) -> dict:
        # torch.optim keeps only defaults, state and param_groups; a copy needs the format too.
        state = {**super().__getstate__(), "state_format": self.state_format, "multi_tensor": self.multi_tensor,
                 "check_nonfinite": self.check_nonfinite, "track_format": self.track_format,
                 "capturable": self.capturable, "format_counts": _engine.pickled_counts(self)}
        return _persistence.words_as_int32(self, state)

    def __setstate__(self, state: dict) -> None:
        as_int32 = state.pop("_words_pickled_as_int32", False)
        # torch's load_state_dict calls this with only "state" and "param_groups": keep the
        # options already set; an older pickle without them gets the defaults.
        state.setdefault("capturable", self.__dict__.get("capturable", False))
        # The switch lives behind the property (`_track_format`); a pickle carries it by name.
        state["_track_format"] = bool(state.pop("track_format", self.__dict__.get("_track_format", False)))
        counts = state.pop("format_counts", None)  # the counts not read yet travel by value (id(param) keys do not)
        super().__setstate__(state)
        self._note_param_lists()
        _engine.restore_pickled_counts(self, counts)
        if "_compile_token" not in self.__dict__:  # a copy or an unpickled optimizer (load_state_dict keeps it)
            self._compile_token = _compiled.register(self)
        if as_int32:
            _persistence.words_from_int32(self)

    # ---- parameter groups -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        with warnings.catch_warnings():  # torch's warning about a repeated parameter: refused below instead
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        try:  # a refused group must not stay behind
            index = _checks.shown_group_index(self, len(self.param_groups) - 1)  # as messages name it
            self._check_group_options(self.param_groups[-1], f"param_groups[{index}]")
            _checks.check_listed_once(self.param_groups[-1], index)
            _checks.validate_group(self.param_groups[-1], index, self.rule_launch.rule)
            _checks.check_one_device([p for g in self.param_groups for p in g["params"]], f"param_groups[{index}]")
        except Exception:
            self.param_groups.pop()
            raise
        self._note_param_lists()

    def _check_group_options(self, group: dict, where: str) -> None:
        """A group (added, or saved and about to load) holds no option of the optimizer's, nor a
        torch option set to what this optimizer does not do: `_checks.check_group_options`."""
        _checks.check_group_options(group, where, type(self).__name__, self.group_options,
                                    self.__dict__.get("capturable", False))

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
            _compiled.traced_step(self)  # one custom op that runs the eager step (docs/MULTI_TENSOR.md)
        else:
            self._opt_called = True  # for LR schedulers (see below)
            _compiled.eager_update(self)
        return loss

    # torch's LR schedulers replace `opt.step` by a wrapper that notes the call in
    # `opt._opt_called` (to warn when the scheduler steps first); dynamo refuses to trace that
    # wrapper, so `fullgraph=True` would fail for any optimizer with a scheduler. They skip
    # optimizers whose step is marked as wrapped already: the step notes the call itself
    # (under compile, when the op runs).
    step._wrapped_by_lr_sched = True

    def _eager_update(self, live: dict | None = None) -> None:
        """The eager step (`_engine.step`; `live` as it says)."""
        _engine.step(self, live)

    # The host-side plan and raw-address launches (or the numpy step on CPU) are not for dynamo
    # to trace: compiled code reaches them through the custom op (_compiled.py), or, where it
    # takes a graph break, through this disabled twin between graphs. `step` outside compilation
    # calls `_eager_update` itself (`_compiled.eager_update`): the disabling wrapper costs host
    # time every call (4 to 17 us of a 200 to 264 us step in two calls on an H100 host, torch
    # 2.11: benchmarks/investigations/eager_step_parts.py).
    @torch.compiler.disable
    def _update(self, live: dict | None = None) -> None:
        self._eager_update(live)

    # ---- format health ------------------------------------------------------------------
    def format_stats(self) -> dict:
        """Where the moments landed in their formats since the last call (counts reset on
        read), per parameter (its name when the groups carry `param_names`, else its
        position): `elements` (element-steps counted), `saturated_m`, `saturated_rms`,
        `flushed_m`, `flushed_rms`, `subnormal_m`, `subnormal_rms`, as FORMAT.md ("Format
        counts") defines them, over the steps made with `track_format` on (`elements` says
        how many element-steps that was); the step itself never waits for the GPU, this call
        does. The counts not read yet travel with a pickle or a copy of the optimizer (as the
        switch does); loading a state starts them afresh. With no counted step since the last
        read it returns {} while `track_format` is on, and raises while it is off (no step could
        have been counted). Warns once per parameter whose saturated share passes
        `SATURATION_WARNING`, saying which bias to move."""
        return _engine.format_stats(self, FORMAT_COUNTS)

    # ---- saving and loading -------------------------------------------------------------
    def state_dict(self) -> dict:
        return _persistence.with_identity(super().state_dict(), self.state_format.identity)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by `state_dict()` (also through torch.distributed.checkpoint).
        Everything is checked before anything changes: the format identity, the state
        layout of every parameter, step counts, and fp32 moments' values."""
        for_torch, loaded = _persistence.checked_load(self, state_dict)
        _engine.drop_plan(self, keep_counts=False)
        super().load_state_dict(for_torch)
        _persistence.restore_loaded(self, loaded)

    def export_state(self) -> PortableState:
        """The moments and step counts in parameter order, for `packed_adamw.jax.import_state`
        (bf16 parameters add their low halves, which the JAX optimizer does not take)."""
        return _persistence.export_state(self)

    def import_state(self, portable: PortableState) -> None:
        """Replace the state with one exported from JAX (or torch); checks format, shapes, step
        counts, values and low halves (exactly the bf16 parameters have them) before changing
        anything."""
        _persistence.import_state(self, portable)

    # ---- FP32 masters of bf16 parameters ------------------------------------------------
    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 master weights in parameter order (param_groups flattened): for a bfloat16
        parameter a new float32 tensor joining its weight and low half exactly (FORMAT.md,
        "Split masters"; a DTensor laid out like the parameter when it is one), for a float32
        parameter the parameter itself. For saving or evaluating the model in FP32; on CUDA
        the join runs on host copies."""
        return _persistence.master_weights(self)

    @torch.no_grad()
    def load_master_weights(self, masters) -> None:
        """Set the parameters from FP32 master weights in parameter order (as `master_weights()`
        returns them, e.g. an FP32 model's parameters): a float32 parameter takes the value, a
        bfloat16 one its exact split (its weight the master rounded to nearest bf16, ties away
        from zero, and the low half in its optimizer state), so `master_weights()` gives the
        masters back bit for bit. Moments and step counts stay as they are (a parameter never
        stepped gets a fresh state holding its low half). Everything is checked before anything
        changes; non-finite masters are refused, and for a bfloat16 parameter also masters
        without a finite bf16 weight (|M| > SPLIT_MASTER_MAX). Masters of DTensor parameters
        must be DTensors laid out like them."""
        _persistence.load_master_weights(self, masters)
