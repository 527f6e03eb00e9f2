"""`PackedOptimizer`: what every packed torch optimizer is, whatever its rule.

torch.optim's `Optimizer` owns the groups, the state and `state_dict`'s packing; this base adds,
once for every rule (PackedAdamW, PackedMuon, and through them PackedMuonAdamW's groups): the
compiled step's hooks, pickling of the options torch's pickle leaves out, `add_param_group`'s
checks with a refused group taken back, the format identity in `state_dict` and its checked
load, the FP32 masters, `PortableState` export and import, the `track_format` switch, and the
name messages give (`optimizer_name`: the combined optimizer's for the rules inside it).

A rule's optimizer class says what differs, as class attributes and a few methods:

    rule_name          its name, the `kind` PackedMuonAdamW's groups give ("adamw", "muon")
    display_name       its name in messages ("AdamW", "Muon")
    state_format_class its state format (core), built from the constructor's `format_keys`
    torch_twin         the torch.optim class whose arguments it takes (named in messages)
    group_options      the optimizer's options a group cannot set (`_checks.check_group_options`)
    pickled_options    the options a pickle carries, each with the value an older pickle lacks
    counts_refusals    whether `track_format` counts refused steps (so every mode has counts)
    _check_new_group   its checks of a group just added (hyperparameters, parameters)
    _check_saved_hyperparams  its checks of a saved group about to load (the keys its step reads)
    _eager_update      its eager step
    _checked_load / _restore_loaded       its state's checks on load, and the tensors put back
    _fresh_entries     a parameter's state before its first step (for `load_master_weights`)
    _count_names       the names of its format counts
    _portable          the module that exports and imports its `PortableState`
"""
from __future__ import annotations

import warnings

import torch
from torch.optim import Optimizer

from . import _checks, _compiled, _engine, _persistence
from ._state import has_format_counts

_REQUIRED = object()  # an option every pickle of the class carries


def default_lr_for_group(param_groups: list, default_lr):
    """The lr a new capturable group that sets none takes: the default itself, a tensor the user
    holds (filled in place, it sets that group's lr, as in torch.optim), for the first such
    group; a copy of it for each later one, so that a scheduler filling each group's lr in place
    does not set another's (groups sharing one tensor would all take the last value written)."""
    if isinstance(default_lr, torch.Tensor) and any(group.get("lr") is default_lr for group in param_groups):
        return default_lr.clone()
    return default_lr


def groups_holding(param_groups: list, defaults: list) -> list:
    """(group index, tensor) for each group whose lr is one of the `defaults` lr tensors itself
    (`default_lr_for_group` gave it): what a load must keep linked."""
    return [(i, group["lr"]) for i, group in enumerate(param_groups)
            if isinstance(group.get("lr"), torch.Tensor) and any(group["lr"] is d for d in defaults)]


@torch.no_grad()
def relink_default_lrs(param_groups: list, held: list) -> None:
    """After torch's load (which copies the saved groups' values), each group that held a
    default lr tensor holds it again, filled with the loaded lr: the tensor the user keeps still
    sets that group's lr, as before the load."""
    for i, default in held:
        loaded = param_groups[i]["lr"]
        if loaded is not default:
            default.copy_(torch.as_tensor(loaded, dtype=default.dtype))
            param_groups[i]["lr"] = default


class PackedOptimizer(Optimizer):
    rule_name = ""
    display_name = ""
    state_format_class = None
    format_keys: tuple = ()
    torch_twin = ""
    group_options: dict = {}
    pickled_options: dict = {}
    counts_refusals = False

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self._compile_token = _compiled.register(self)  # names this optimizer to its compiled steps

    @property
    def optimizer_name(self) -> str:
        """The optimizer's name in messages: its class's, or, for a rule inside `PackedMuonAdamW`,
        the combined optimizer's (the one the user built and steps)."""
        return self.__dict__.get("_optimizer_name", type(self).__name__)

    # ---- the format counts' switch --------------------------------------------------------
    @property
    def track_format(self) -> bool:
        """Whether the steps made from now on count format events (`format_stats`). It may be
        switched between steps, for instance on only the steps a training loop logs: a step
        made with it off runs the uncounted launch and costs what an optimizer built without
        it costs, and the counts already made wait for `format_stats`."""
        return self.__dict__.get("_track_format", False)

    @track_format.setter
    def track_format(self, value: bool) -> None:
        _checks.check_track_format(value, self.state_format, self.__dict__.get("capturable", False),
                                   counts_refusals=self.counts_refusals)
        self._track_format = value

    def format_stats(self) -> dict:
        """The format counts of the steps made with `track_format` since the last call, reset on
        read, per parameter (its name when the groups carry `param_names`, else its position);
        the rule's class says which counts it keeps. The step itself never waits for the GPU,
        this call does. The counts not read yet travel with a pickle or a copy of the optimizer
        (as the switch does); loading a state starts them afresh. With no counted step since the
        last read it returns {} while `track_format` is on, and raises while it is off (no step
        could have been counted). Warns once per parameter whose saturated share passes
        `SATURATION_WARNING`."""
        return _engine.format_stats(self, self._count_names())

    @property
    def format_count_names(self) -> tuple[str, ...]:
        """The counts `format_stats` gives a counted parameter besides `elements`: `refused` where
        the rule refuses whole matrices (`counts_refusals`), then the rule's format counts where its
        state format has codes (none in AdamW's fp32 mode, Muon's bf16 and fp32 modes)."""
        codes = self._count_names() if has_format_counts(self.state_format) else ()
        return ((_engine.REFUSED_STAT,) if self.counts_refusals else ()) + tuple(codes)

    # ---- pickling: torch.optim keeps only defaults, state and param_groups ------------------
    def __getstate__(self) -> dict:
        options = {name: self.__dict__.get(name, default) for name, default in self.pickled_options.items()
                   if default is not _REQUIRED or name in self.__dict__}
        state = {**super().__getstate__(), **options, "track_format": self.track_format,
                 "format_counts": _engine.pickled_counts(self)}
        return _persistence.words_as_int32(self, state)  # uint32 words travel as int32 (torch unpickles no uint32)

    def __setstate__(self, state: dict) -> None:
        as_int32 = state.pop("_words_pickled_as_int32", False)
        # torch's load_state_dict calls this with only "state" and "param_groups": the options
        # already set stay; an older pickle without an option gets the value it stepped with.
        for name, default in self.pickled_options.items():
            if name in self.__dict__:
                state.setdefault(name, self.__dict__[name])
            elif default is not _REQUIRED:
                state.setdefault(name, default)
        # The switch lives behind the property (`_track_format`); a pickle carries it by name.
        state["_track_format"] = bool(state.pop("track_format", self.__dict__.get("_track_format", False)))
        counts = state.pop("format_counts", None)  # the counts not read yet travel by value (id(param) keys do not)
        super().__setstate__(state)
        self._unpickled()
        self._note_param_lists()
        _engine.restore_pickled_counts(self, counts)
        if "_compile_token" not in self.__dict__:  # a copy or an unpickled optimizer (load_state_dict keeps it)
            self._compile_token = _compiled.register(self)
        if as_int32:
            _persistence.words_from_int32(self)

    def _unpickled(self) -> None:
        """What a rule brings up to date in a state pickled by an older release."""

    # ---- parameter groups -------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        default_lr = self.defaults.get("lr")
        if self.__dict__.get("capturable") and isinstance(param_group, dict) and "lr" not in param_group:
            param_group = {**param_group, "lr": default_lr_for_group(self.param_groups, default_lr)}
        with warnings.catch_warnings():  # torch's warning about a repeated parameter: refused below instead
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        try:  # a refused group must not stay behind
            index = _checks.shown_group_index(self, len(self.param_groups) - 1)  # as messages name it
            group = self.param_groups[-1]
            self._check_group_options(group, f"param_groups[{index}]")
            _checks.check_listed_once(group, index, self.torch_twin)
            self._check_new_group(group, index)
            _checks.check_one_device([p for g in self.param_groups for p in g["params"]], f"param_groups[{index}]",
                                     self.optimizer_name)
        except Exception:
            self.param_groups.pop()
            raise
        self._note_param_lists()

    def _check_group_options(self, group: dict, where: str) -> None:
        """A group (added, or saved and about to load) holds no option of the optimizer's, nor a
        torch option set to what this optimizer does not do: `_checks.check_group_options`; and
        no `kind` but this rule's (a PackedMuonAdamW group of the other kind would be stepped by
        this rule: an embedding orthogonalised by PackedMuon)."""
        kind = group.get("kind")
        if kind is not None and self.rule_name and kind != self.rule_name:
            raise ValueError(f"{where} sets kind={kind!r}, but {self.optimizer_name} steps every group with rule "
                             f"{self.rule_name!r}; step kind={kind!r} groups with PackedMuonAdamW (whose groups say "
                             f"their rule), or leave them out of {self.optimizer_name}")
        _checks.check_group_options(group, where, self.optimizer_name, self.group_options,
                                    self.__dict__.get("capturable", False))

    def _check_saved_hyperparams(self, group: dict, where: str) -> None:
        """A saved group about to load (`where` names it) holds the hyperparameters its rule reads,
        valid as a group added must be: checked before anything changes, so no step after the
        load fails on them (the rule's class says which and how)."""
        raise NotImplementedError

    def _note_param_lists(self) -> None:
        """The groups' parameter lists, for compiled steps to iterate (`_compiled.traced_step`):
        dynamo reading the group dicts themselves guards on their hyperparameters (torch 2.11
        does), so a scheduler changing the lr would recompile the step."""
        self._param_lists = [group["params"] for group in self.param_groups]

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        return _compiled.optimizer_step(self, closure)

    # torch's LR schedulers replace `opt.step` by a wrapper that notes the call in
    # `opt._opt_called` (to warn when the scheduler steps first); dynamo refuses to trace that
    # wrapper, so `fullgraph=True` would fail for any optimizer with a scheduler. They skip
    # optimizers whose step is marked as wrapped already: the step notes the call itself
    # (`_compiled.optimizer_step`; under compile, when the op runs).
    step._wrapped_by_lr_sched = True

    def _eager_update(self, live: dict | None = None) -> None:
        raise NotImplementedError

    # The host-side plan and raw-address launches (or the numpy step on CPU) are not for dynamo
    # to trace: compiled code reaches them through the custom op (_compiled.py), or, where it
    # takes a graph break, through this disabled twin between graphs. `step` outside compilation
    # calls `_eager_update` itself (`_compiled.eager_update`): the disabling wrapper costs host
    # time every call (4 to 17 us of a 200 to 264 us step in two calls on an H100 host, torch
    # 2.11: benchmarks/investigations/eager_step_parts.py).
    @torch.compiler.disable
    def _update(self, live: dict | None = None) -> None:
        self._eager_update(live)

    # ---- saving and loading -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return _persistence.with_identity(super().state_dict(), self.state_format.identity)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by `state_dict()` (also through torch.distributed.checkpoint).
        Everything is checked before anything changes: the format identity, the groups' options,
        the state layout of every parameter, step counts and stored values; then torch loads,
        and the rule puts its tensors back bit for bit. The format counts start afresh. A group
        that held the constructor's lr tensor holds it still, filled with the loaded lr."""
        for_torch, loaded = self._checked_load(state_dict)
        _engine.drop_plan(self, keep_counts=False)
        held = groups_holding(self.param_groups, [self.defaults.get("lr")])
        super().load_state_dict(for_torch)
        relink_default_lrs(self.param_groups, held)
        self._restore_loaded(loaded)

    def export_state(self):
        """The state in parameter order as a `PortableState`, for the JAX frontend's import
        (bf16 parameters add their low halves)."""
        return self._portable().export_state(self)

    def import_state(self, portable) -> None:
        """Replace the state with one exported from JAX (or torch); format, shapes, step counts,
        values and low halves (exactly the bf16 parameters have them) are checked, naming the
        parameter, before anything changes."""
        self._portable().import_state(self, portable)

    # ---- FP32 masters of bf16 parameters --------------------------------------------------------
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
        masters back bit for bit. The rule's state and step counts stay as they are (a parameter
        never stepped gets a fresh state holding its low half). Everything is checked before
        anything changes; non-finite masters are refused, and for a bfloat16 parameter also
        masters without a finite bf16 weight (|M| > SPLIT_MASTER_MAX). Masters of DTensor
        parameters must be DTensors laid out like them."""
        _persistence.load_master_weights(self, masters, self._fresh_entries)
