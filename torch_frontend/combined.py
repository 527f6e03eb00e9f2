"""`PackedMuonAdamW`: Muon for a model's block matrices and packed AdamW for the rest, as one
`torch.optim.Optimizer` (one step, one state_dict, one scheduler), and `muon_param_groups`, the
usual split of a model's parameters.

Each param group names its rule (`kind="muon"` or `kind="adamw"`). The combined optimizer holds
one `PackedMuon` and one `PackedAdamW` that share its group dicts and its state, so a scheduler
changing a group's lr reaches the rule that steps it, and each rule steps, checks, saves and
loads exactly as it does alone: the combined step has their bits.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from packed_adamw.core.adamw.state_format import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS
from packed_adamw.core.adamw.state_format import StateFormat as AdamWStateFormat
from packed_adamw.core.muon import DEFAULT_MU_BIAS

from . import _checks, _compiled, _engine, _persistence
from ._engine import NonFiniteGradientError
from ._state import has_format_counts
from . import muon as _muon
from .muon import PackedMuon
from .optimizer import PackedAdamW

KINDS = ("muon", "adamw")
# What a rule shares with the combined optimizer: its pickle leaves them out (`__getstate__`).
_SHARED_WITH_RULES = ("state", "param_groups", "_words_pickled_as_int32")


def muon_param_groups(model: torch.nn.Module, *, exclude: str | tuple[str, ...] = (), muon: dict | None = None,
                      adamw: dict | None = None) -> list[dict]:
    """The usual split: every 2-D weight -> Muon, except embeddings and the output head (an
    `nn.Embedding`'s weight, and any parameter one of whose names is in `exclude` or contains one
    of its entries); 1-D and 0-D parameters (norms, biases, scalars), embeddings and the head ->
    AdamW. Tied parameters are listed once (under their first name; any of their names may be
    excluded). Returns two groups (one if the other is empty), with `param_names`, `kind`, and
    the options in `muon` / `adamw` (e.g. each group's lr).
    For a head that is a plain `nn.Linear`, pass its name in `exclude` (exclude="lm_head", or a
    tuple of names). Every entry must match some parameter's name: one that matches none (a
    typo would send the head to Muon) is refused, and so is an exclusion that leaves Muon no
    matrix of a model that has some (exclude="weight" matches every one: Muon would never run)."""
    excluded_names = _exclude_entries(exclude)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    every_name = [name for names in names_of.values() for name in names]
    for entry in excluded_names:
        if not any(entry in name for name in every_name):
            shown = ", ".join(every_name[:12]) + (", ..." if len(every_name) > 12 else "")
            raise ValueError(f"muon_param_groups: exclude entry {entry!r} matches no parameter name of "
                             f"{type(model).__name__} ({shown}); pass the name of the parameters AdamW should "
                             "step (the head's), or a part of it")
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen, groups = set(), {"muon": ([], []), "adamw": ([], [])}
    matrices = []  # (name, the entries excluding it) of each weight Muon would step but for exclude
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        excluding = [entry for entry in excluded_names if any(entry in alias for alias in names_of[id(p)])]
        if p.dim() == 2 and id(p) not in embedding_weights:
            matrices.append((name, excluding))
        kind = "muon" if p.dim() == 2 and id(p) not in embedding_weights and not excluding else "adamw"
        groups[kind][0].append(p)
        groups[kind][1].append(name)
    if matrices and not groups["muon"][0]:
        _refuse_excluding_every_matrix(model, excluded_names, matrices)
    options = {"muon": dict(muon or {}), "adamw": dict(adamw or {})}
    return [{"params": params, "param_names": names, "kind": kind, **options[kind]}
            for kind, (params, names) in groups.items() if params]


def _refuse_excluding_every_matrix(model, entries: tuple[str, ...], matrices: list) -> None:
    """Entries match any part of a name, so a short one ("weight", ".") can match every matrix:
    every parameter would go to AdamW and Muon never run. Names the entry that matches them all,
    or the entries that together do."""
    alone = [entry for entry in entries if all(entry in excluding for _, excluding in matrices)]
    together = [entry for entry in entries if any(entry in excluding for _, excluding in matrices)]
    named = f"entry {alone[0]!r} matches" if alone else \
        f"entries {', '.join(map(repr, together))} together match"
    shown = ", ".join(repr(name) for name, _ in matrices[:8]) + (", ..." if len(matrices) > 8 else "")
    raise ValueError(f"muon_param_groups: exclude {named} every matrix Muon would step in {type(model).__name__} "
                     f"({shown}): an entry matches any part of a name, so every parameter would go to AdamW and "
                     "Muon would never run. Pass the names of the parameters AdamW should step (exclude='lm_head'), "
                     "or, for AdamW on every parameter, use PackedAdamW")


def _checked_track_format(value, adamw_format: AdamWStateFormat, capturable: bool) -> bool:
    """PackedMuonAdamW's `track_format` (checked as each rule's is): each rule counts what it
    can, Muon its refusals in every mode, AdamW its codes where its mode has some (fp32 mode
    stores float32 moments). Returns whether AdamW's rule counts."""
    _checks.check_track_format(value, adamw_format, capturable, counts_refusals=True)
    return value and has_format_counts(adamw_format)


def _exclude_entries(exclude) -> tuple[str, ...]:
    """`muon_param_groups`' exclude as a tuple of names: a string is one name (not its characters)."""
    entries = (exclude,) if isinstance(exclude, str) else exclude
    try:
        entries = tuple(entries)
    except TypeError:
        entries = None
    if entries is None or not all(isinstance(entry, str) for entry in entries):
        raise TypeError(f"muon_param_groups: exclude={exclude!r}: pass a parameter name (a str, e.g. "
                        "exclude='lm_head') or a tuple of names")
    if "" in entries:
        raise ValueError("muon_param_groups: exclude entry '' matches every parameter name, which would send every "
                         "parameter to AdamW; pass the names of the parameters AdamW should step")
    return entries


# PackedMuonAdamW's options that are not a group's: each rule keeps one state format for all its
# groups (its mode and biases: the state_dict records one identity per rule), and the step's own
# switches. A group holding one would be stepped with the optimizer's, silently: it is refused
# (`_checks.check_group_options`), naming the option that sets it (an AdamW group's mode: adamw_mode).
OPTIMIZER_OPTIONS = _checks.OPTIMIZER_OPTIONS
_GROUP_OPTIONS = {kind: {key: "adamw_mode" if kind == "adamw" and key == "mode" else key for key in OPTIMIZER_OPTIONS}
                  for kind in KINDS}
# The constructor's defaults for AdamW groups, and the key a group's own value has.
ADAMW_DEFAULTS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
                  "adamw_weight_decay": "weight_decay"}
RULE_NAMES = {"muon": "Muon", "adamw": "AdamW"}


class PackedMuonAdamW(Optimizer):
    """One optimizer over Muon groups and AdamW groups (`kind` in every group; see
    `muon_param_groups`). Muon's options (`lr`, `weight_decay`, `momentum`, `nesterov`,
    `ns_coefficients`, `eps`, `ns_steps`, `adjust_lr_fn`, `mode`, `mu_bias`, `batch_ns`, `ns_impl`)
    default to PackedMuon's, AdamW's (`adamw_lr`, `adamw_betas`, `adamw_eps`, `adamw_weight_decay`,
    `adamw_mode`, `m_bias`, `rms_bias`) to PackedAdamW's. A group's own hyperparameters win (a
    Muon group's `lr`, `weight_decay`, `momentum`, `nesterov`, `ns_coefficients`, `eps`,
    `ns_steps`, `adjust_lr_fn`, `maximize`; an AdamW group's `lr`, `betas`, `eps`,
    `weight_decay`, `maximize`); the state formats (`mode`, `mu_bias`, `adamw_mode`, `m_bias`,
    `rms_bias`: one per rule) and the step's switches are the optimizer's, and a group that sets
    one (or the other rule's option, or a torch option to what the rule does not do, as
    `amsgrad=True`) is refused, naming the key, when added and when a state_dict's groups load. The step,
    state_dict and load_state_dict are both rules', each rule's state with its format identity
    (every saved group records its rule's); a load checks both before anything changes.
    DTensor (FSDP2) parameters step as each rule steps them, and the state_dict shards with them
    (torch.distributed.checkpoint). Under `torch.compile` the step is one custom op, as
    PackedAdamW's and PackedMuon's are (`fullgraph=True` holds; the eager step's bits).
    `capturable=True` (CUDA; `lr` and `adamw_lr`, or every group's lr, one-element tensors on the
    device) makes both rules' steps capturable by `torch.cuda.graph`, as PackedMuon's and
    PackedAdamW's are. `track_format=True` counts both rules' steps (`format_stats`), each
    what it counts alone: Muon's refusals in every mode, AdamW's codes in adamw_mode 'packed' or
    'fp16' (fp32 mode stores float32 moments: its parameters have no entries). `master_weights()` and
    `load_master_weights()` are both rules' FP32 masters, in this optimizer's parameter order."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=_muon.DEFAULT_NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = _muon.DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None, *, mode: str = "packed",
                 mu_bias: int = DEFAULT_MU_BIAS, adamw_lr: float = 1e-3, adamw_betas=(0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 1e-2, adamw_mode: str = "packed",
                 m_bias: int = DEFAULT_M_BIAS, rms_bias: int = DEFAULT_RMS_BIAS, maximize: bool = False,
                 check_nonfinite: bool = False, multi_tensor: bool = True, capturable: bool = False,
                 batch_ns: bool | None = None, ns_impl: str = "auto", track_format: bool = False):
        _muon.check_options(type(self).__name__, capturable, batch_ns, ns_impl, lr=lr,
                            check_nonfinite=check_nonfinite)
        adamw_counts = False  # whether AdamW's rule counts too (Muon counts its refusals in every mode)
        if track_format is not False:  # checked before any group makes its rule
            adamw_counts = _checked_track_format(track_format, AdamWStateFormat(adamw_mode, m_bias, rms_bias),
                                                 capturable)
        if capturable and not (isinstance(adamw_lr, torch.Tensor) and adamw_lr.numel() == 1
                               and adamw_lr.is_floating_point()):
            raise ValueError(f"PackedMuonAdamW(capturable=True) needs adamw_lr as a one-element tensor on the "
                             f"parameters' device too, got adamw_lr={adamw_lr!r}; "
                             "adamw_lr=torch.tensor(3e-4, device='cuda')")
        self._check_nonfinite = check_nonfinite
        self.capturable = capturable
        self._rule_options = {
            "muon": dict(defaults=dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                       ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                       adjust_lr_fn=adjust_lr_fn, maximize=maximize),
                         options=dict(mode=mode, mu_bias=mu_bias, check_nonfinite=check_nonfinite,
                                      batch_ns=batch_ns, ns_impl=ns_impl, capturable=capturable,
                                      track_format=track_format)),
            "adamw": dict(defaults=dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                        weight_decay=adamw_weight_decay, maximize=maximize),
                          options=dict(mode=adamw_mode, m_bias=m_bias, rms_bias=rms_bias,
                                       check_nonfinite=check_nonfinite, multi_tensor=multi_tensor,
                                       capturable=capturable, track_format=adamw_counts)),
        }
        self._rules: dict[str, Optimizer] = {}
        super().__init__(params, {})
        self._compile_token = _compiled.register(self)  # names this optimizer to its compiled steps

    # ---- groups: each one belongs to its rule's optimizer, which validates it --------------------
    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError("PackedMuonAdamW takes param groups (dicts with 'params' and 'kind'), e.g. "
                            "muon_param_groups(model)")
        kind = param_group.get("kind")
        if kind not in KINDS:
            raise ValueError(f"param_groups[{len(self.param_groups)}] has kind={kind!r}: every group of "
                             f"PackedMuonAdamW says its rule, kind='muon' or kind='adamw' (muon_param_groups(model) "
                             "makes them)")
        self._check_group_options(param_group, f"param_groups[{len(self.param_groups)}]")
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        ours = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in ours for p in group["params"]):
            raise ValueError(f"param_groups[{len(self.param_groups)}] lists a parameter another group has: a "
                             "parameter belongs to one rule; list each parameter once")
        rule = self._rules.get(kind)
        # The rule's messages name the group by the index it is getting here.
        shown = [i for i, g in enumerate(self.param_groups) if g["kind"] == kind] + [len(self.param_groups)]
        try:
            default_lr = self._rule_options[kind]["defaults"]["lr"]
            if self.capturable and "lr" not in group and isinstance(default_lr, torch.Tensor):
                # A group of its own lr tensor, as PackedMuon gives one (schedulers fill each in place).
                group["lr"] = default_lr.clone()
            if rule is None:
                settings = self._rule_options[kind]
                group = {**settings["defaults"], **group}
                cls = PackedMuon if kind == "muon" else PackedAdamW
                rule = cls.__new__(cls)
                rule._shown_group_indices = shown  # before __init__, which checks the group
                rule.__init__([group], **settings["defaults"], **settings["options"])
                rule.state = self.state  # one state: torch's state_dict packs every parameter's
                self._rules[kind] = rule
            else:
                rule._shown_group_indices = shown
                rule.add_param_group(group)
            self.param_groups.append(rule.param_groups[-1])  # the same dict: schedulers reach the rule
        finally:
            self._note_param_lists()

    def _check_group_options(self, group: dict, where: str) -> None:
        """Refuses, for a group added or about to load (`where` names it), a key the group's rule
        would not read from it, naming it: an option of the optimizer's or an unsupported torch
        option (`_checks.check_group_options`, every optimizer's one check), the constructor's
        `adamw_*` defaults, the other rule's hyperparameters."""
        kind = group["kind"]
        other = "adamw" if kind == "muon" else "muon"
        others = set(self._rule_options[other]["defaults"]) - set(self._rule_options[kind]["defaults"])
        where = f"{where} (kind={kind!r})"
        _checks.check_group_options(group, where, type(self).__name__, _GROUP_OPTIONS[kind],
                                    self.__dict__.get("capturable", False))
        where = f"{where} sets {{key!r}}"
        for key in group:
            if key in ADAMW_DEFAULTS:
                raise ValueError(f"{where.format(key=key)}: {key} is the constructor's default for AdamW groups; a "
                                 f"group's own AdamW setting is {ADAMW_DEFAULTS[key]!r}")
            if key in others:
                raise ValueError(f"{where.format(key=key)}: {key} is an option of {RULE_NAMES[other]} groups, which "
                                 f"this {RULE_NAMES[kind]} group would ignore; remove it, or make the group "
                                 f"kind={other!r}")

    def _note_param_lists(self) -> None:
        """The groups' parameter lists, which compiled steps iterate (see PackedAdamW's), and
        each rule's group indices in this optimizer, which its messages name
        (`_checks.shown_group_index`): a rule's groups are this optimizer's of its kind, in order."""
        self._param_lists = [group["params"] for group in self.param_groups]
        for kind, rule in self.__dict__.get("_rules", {}).items():
            rule._shown_group_indices = [i for i, g in enumerate(self.param_groups) if g["kind"] == kind]

    @property
    def check_nonfinite(self) -> bool:
        """Whether a step may raise NonFiniteGradientError: set here (for both rules) or on a rule
        since. The compiled step reads it, to take such a step between graphs."""
        rules = self.__dict__.get("_rules", {}).values()
        return self.__dict__.get("_check_nonfinite", False) or any(rule.check_nonfinite for rule in rules)

    @check_nonfinite.setter
    def check_nonfinite(self, value: bool) -> None:
        self._check_nonfinite = value
        for settings in self._rule_options.values():
            settings["options"]["check_nonfinite"] = value
        for rule in self._rules.values():
            rule.check_nonfinite = value

    @property
    def track_format(self) -> bool:
        """Whether the steps made from now on are counted (`format_stats`): set here (for both
        rules, each counting what it can) or on a rule since; it may be switched between steps."""
        rules = self.__dict__.get("_rules", {})
        return any(rule.track_format for rule in rules.values()) or any(
            settings["options"]["track_format"] for kind, settings in self.__dict__.get("_rule_options", {}).items()
            if kind not in rules)

    @track_format.setter
    def track_format(self, value: bool) -> None:
        adamw = self._rule_options["adamw"]["options"]
        adamw_counts = _checked_track_format(value, AdamWStateFormat(adamw["mode"], adamw["m_bias"],
                                                                     adamw["rms_bias"]),
                                             self.__dict__.get("capturable", False))
        self._rule_options["muon"]["options"]["track_format"] = value
        adamw["track_format"] = adamw_counts
        for kind, rule in self._rules.items():
            rule.track_format = self._rule_options[kind]["options"]["track_format"]

    def format_stats(self) -> dict:
        """Both rules' `format_stats` in one dict, in this optimizer's parameter order (keys: a
        parameter's name, or its (group, position) here): Muon's entries as PackedMuon gives them
        (`refused`, `elements`, `saturated_mu`, ...), AdamW's as PackedAdamW (`elements`,
        `saturated_m`, ...; none in adamw_mode 'fp32', which has no codes to count). Counts since
        the last call, reset on read; as each rule's, they travel with a pickle or a copy, and
        with nothing counted since the last read the result is {} while `track_format` is on and
        an error while it is off."""
        counted = [rule for rule in self._rules.values() if _engine.counts_to_read(rule)]
        if not counted and not self.track_format:
            raise _engine.no_counts_error(type(self).__name__)
        merged = {}
        for rule in counted:
            merged.update(rule.format_stats())
        ordered = {}
        for gi, group in enumerate(self.param_groups):
            for pi in range(len(group["params"])):
                key = group["param_names"][pi] if group.get("param_names") else (gi, pi)
                if key in merged:
                    ordered[key] = merged.pop(key)
        return {**ordered, **merged}

    @property
    def rules(self) -> dict[str, Optimizer]:
        """The rule optimizers (kind -> PackedMuon / PackedAdamW) that step the groups."""
        return dict(self._rules)

    def __getstate__(self) -> dict:
        # The rules share this optimizer's groups and state: each travels without them (its own
        # pickle's other entries) and takes them back when unpickled. AdamW's uint32 words travel
        # as their int32 bits, which torch can unpickle (as PackedAdamW's own pickle does).
        rules = {kind: (type(rule), {k: v for k, v in rule.__getstate__().items() if k not in _SHARED_WITH_RULES})
                 for kind, rule in self._rules.items()}
        state = {**super().__getstate__(), "_rule_options": self._rule_options, "_rule_pickles": rules,
                 "_check_nonfinite": self.__dict__.get("_check_nonfinite", False),
                 "capturable": self.__dict__.get("capturable", False)}
        adamw = self._rules.get("adamw")
        return _persistence.words_as_int32(adamw, state) if adamw is not None else state

    def __setstate__(self, state: dict) -> None:
        as_int32 = state.pop("_words_pickled_as_int32", False)
        rule_pickles = state.pop("_rule_pickles", None)  # absent from torch's load_state_dict call
        super().__setstate__(state)
        self.__dict__.setdefault("_check_nonfinite", False)  # pickled before the attribute existed
        self.__dict__.setdefault("capturable", False)
        if rule_pickles is not None:
            self._rules = {}
            for kind, (cls, rule_state) in rule_pickles.items():
                rule = cls.__new__(cls)
                rule.__setstate__({**rule_state, "state": self.state,
                                   "param_groups": [g for g in self.param_groups if g["kind"] == kind]})
                self._rules[kind] = rule
        if as_int32:
            _persistence.words_from_int32(self._rules["adamw"])
        self._note_param_lists()
        if "_compile_token" not in self.__dict__:  # a copy or an unpickled optimizer
            self._compile_token = _compiled.register(self)

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        return _compiled.optimizer_step(self, closure)

    step._wrapped_by_lr_sched = True  # see PackedAdamW.step

    def _eager_update(self, live: dict | None = None) -> None:
        """Both rules' steps as one: Muon's checks (`muon.check_step`, which change nothing),
        then AdamW's whole step (which raises before changing anything), then Muon's phases on
        what was checked. So a step that raises anything but NonFiniteGradientError leaves both
        rules as they were. A rule that raises NonFiniteGradientError has stepped, and the other
        steps too before the error names what either refused. `live`: see `_compiled.run`."""
        muon, adamw = self._rules.get("muon"), self._rules.get("adamw")
        checked_muon = _muon.check_step(muon, live) if muon is not None else None
        errors = {}
        if adamw is not None:
            try:
                adamw._eager_update(live)
            except NonFiniteGradientError as e:  # raised after AdamW stepped: Muon steps too
                errors["adamw"] = str(e)
        if muon is not None:
            try:
                _muon.run_step(muon, checked_muon, live)
            except NonFiniteGradientError as e:
                errors["muon"] = str(e)
        if errors:
            raise NonFiniteGradientError("; ".join(errors[kind] for kind in self._rules if kind in errors))

    @torch.compiler.disable  # compiled code reaches the eager step through the custom op (_compiled.py)
    def _update(self, live: dict | None = None) -> None:
        self._eager_update(live)  # see PackedAdamW._update

    # ---- saving and loading -------------------------------------------------------------------
    def identities(self) -> dict[str, str]:
        return {kind: rule.state_format.identity for kind, rule in self._rules.items()}

    def state_dict(self) -> dict:
        sd = super().state_dict()
        identities = self.identities()
        sd[_persistence.STATE_DICT_KEY] = {"version": _persistence.STATE_DICT_VERSION, "format": identities}
        sd["param_groups"] = [{**g, _persistence.GROUP_FORMAT_KEY: identities[g["kind"]]} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Every group's rule and format identity, and each rule's state, are checked before
        anything changes; then torch loads, and each rule puts its codes back bit for bit."""
        saved_groups = state_dict.get("param_groups") or []
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the saved state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}; load it into an optimizer built over the same groups")
        identities = self.identities()
        saved_identities = {}  # per rule, the identity its saved groups carry (all the same)
        for i, (saved, ours) in enumerate(zip(saved_groups, self.param_groups)):
            if saved.get("kind") != ours["kind"]:
                raise ValueError(f"load_state_dict: saved param_groups[{i}] is kind={saved.get('kind')!r}, this "
                                 f"optimizer's is {ours['kind']!r}; build the optimizer with the saved run's groups")
            saved_identity = saved.get(_persistence.GROUP_FORMAT_KEY)
            fmt = self._rules[ours["kind"]].state_format
            # Muon's packed format also reads its states saved before the exponents (MUON.md).
            reads = fmt.reads(saved_identity) if hasattr(fmt, "reads") else saved_identity == fmt.identity
            if not reads or saved_identities.setdefault(ours["kind"], saved_identity) != saved_identity:
                raise ValueError(f"load_state_dict: saved param_groups[{i}] ({ours['kind']}) has format "
                                 f"{saved_identity!r} but this optimizer uses {identities[ours['kind']]!r}; "
                                 "construct it with the saved run's modes and biases")
            self._check_group_options(saved, f"load_state_dict: saved param_groups[{i}]")
        checked = {}
        for kind, rule in self._rules.items():
            part = {"state": state_dict["state"],
                    "param_groups": [g for g in saved_groups if g["kind"] == kind],
                    _persistence.STATE_DICT_KEY: {"version": _persistence.STATE_DICT_VERSION,
                                                  "format": saved_identities.get(kind, identities[kind])}}
            check = _muon.checked_load if kind == "muon" else _persistence.checked_load
            checked[kind] = check(rule, part)[1]
        groups = [{k: v for k, v in g.items() if k != _persistence.GROUP_FORMAT_KEY} for g in saved_groups]
        super().load_state_dict({"state": state_dict["state"], "param_groups": groups})
        self._bind_rules()
        for kind, loaded in checked.items():
            restore = _muon.restore_loaded if kind == "muon" else _persistence.restore_loaded
            restore(self._rules[kind], loaded)

    def _bind_rules(self) -> None:
        """torch's loader makes new group dicts and a new state: the rules take them."""
        self._note_param_lists()
        for kind, rule in self._rules.items():
            rule.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            rule.state = self.state
            rule.__dict__.pop("_valid_rows", None)
            rule.__dict__.pop("_kept_rows", None)
            rule._note_param_lists()
            if isinstance(rule, PackedAdamW):
                _engine.drop_plan(rule, keep_counts=False)
            else:
                _engine.forget_counts(rule)  # a loaded state starts the counts afresh, as drop_plan's for AdamW

    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 masters in this optimizer's parameter order (param_groups flattened), as
        PackedAdamW.master_weights gives them."""
        return _persistence.master_weights(self)

    @torch.no_grad()
    def load_master_weights(self, masters) -> None:
        """As PackedAdamW.load_master_weights, in this optimizer's parameter order (as
        `master_weights()` returns them): float32 parameters take the values, bf16 ones their
        exact split (weight and low half), both rules' states stay (a bf16 parameter never
        stepped gets its rule's first state, holding the low half). Everything is checked before
        anything changes."""
        kind_of = {id(p): g["kind"] for g in self.param_groups for p in g["params"]}

        def fresh_entries(p):
            rule = self._rules[kind_of[id(p)]]
            return _muon.fresh_entries(rule, p) if kind_of[id(p)] == "muon" else \
                _persistence.fresh_adamw_entries(rule, p)

        _persistence.load_master_weights(self, masters, fresh_entries)

    def export_state(self) -> "PortableState":
        """Both rules' states in parameter order as one `PortableState` (format "mixed", each
        tensor's identity in `formats`): Muon's momenta (count None), AdamW's words and counts,
        bf16 parameters' low halves. For `packed_adamw.jax.muon.import_muon_state`."""
        from . import _muon_portable

        return _muon_portable.export_state(self)

    def import_state(self, portable) -> None:
        """Replace both rules' states with an exported one (from JAX's packed_muon or torch);
        every tensor's format, shape, low half and values are checked, naming the parameter,
        before anything changes."""
        from . import _muon_portable

        _muon_portable.import_state(self, portable)
