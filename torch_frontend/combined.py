"""`PackedMuonAdamW`: Muon for a model's block matrices and packed AdamW for the rest, as one
`torch.optim.Optimizer` (one step, one state_dict, one scheduler), and `muon_param_groups`, the
usual split of a model's parameters.

Each param group names its rule (`kind="muon"` or `kind="adamw"`) and may name its own state
format (that rule's `mode` and biases). The combined optimizer holds one `PackedMuon` or
`PackedAdamW` per (rule, state format) that shares its group dicts and its state, so a
scheduler changing a group's lr reaches the rule that steps it, and each rule steps, checks,
saves and loads exactly as it does alone: the combined step has their bits.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from packed_adamw.core.adamw.state_format import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS
from packed_adamw.core.adamw.state_format import StateFormat as AdamWStateFormat
from packed_adamw.core.muon import DEFAULT_MU_BIAS

from . import _checks, _compiled, _engine, _persistence
from ._base import PackedOptimizer, default_lr_for_group, groups_holding, relink_default_lrs
from ._engine import NonFiniteGradientError
from ._state import has_format_counts
from . import muon as _muon
from .muon import PackedMuon
from .optimizer import PackedAdamW

# The rule a group's `kind` names: its optimizer class, which says the rest (below).
RULE_CLASSES = {cls.rule_name: cls for cls in (PackedMuon, PackedAdamW)}
KINDS = tuple(RULE_CLASSES)
# A group's own state format: its rule's format options, named as PackedMuon and PackedAdamW name
# them (the constructor's `mode`, `mu_bias` and `adamw_mode`, `m_bias`, `rms_bias` are the defaults).
FORMAT_KEYS = {kind: cls.format_keys for kind, cls in RULE_CLASSES.items()}
FORMAT_CLASSES = {kind: cls.state_format_class for kind, cls in RULE_CLASSES.items()}
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


# PackedMuonAdamW's options that are not a group's: the step's switches. A group holding one would
# be stepped with the optimizer's, silently: it is refused (`_checks.check_group_options`), naming
# the option that sets it. A group's own state format (FORMAT_KEYS) is its rule's.
OPTIMIZER_OPTIONS = _checks.OPTIMIZER_OPTIONS
_GROUP_OPTIONS = {key: key for key in OPTIMIZER_OPTIONS}
# The constructor's defaults for AdamW groups, and the key a group's own value has.
ADAMW_DEFAULTS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
                  "adamw_weight_decay": "weight_decay", "adamw_mode": "mode"}
RULE_NAMES = {kind: cls.display_name for kind, cls in RULE_CLASSES.items()}


def _is_muon(rule) -> bool:
    return isinstance(rule, PackedMuon)


class PackedMuonAdamW(PackedOptimizer):
    """One optimizer over Muon groups and AdamW groups (`kind` in every group; see
    `muon_param_groups`). Muon's options (`lr`, `weight_decay`, `momentum`, `nesterov`,
    `ns_coefficients`, `eps`, `ns_steps`, `adjust_lr_fn`, `mode`, `mu_bias`, `batch_ns`, `ns_impl`)
    default to PackedMuon's, AdamW's (`adamw_lr`, `adamw_betas`, `adamw_eps`, `adamw_weight_decay`,
    `adamw_mode`, `m_bias`, `rms_bias`) to PackedAdamW's. A group's own entries win: its
    hyperparameters (a Muon group's `lr`, `weight_decay`, `momentum`, `nesterov`,
    `ns_coefficients`, `eps`, `ns_steps`, `adjust_lr_fn`, `maximize`; an AdamW group's `lr`,
    `betas`, `eps`, `weight_decay`, `maximize`) and its state format (a Muon group's `mode`,
    `mu_bias`; an AdamW group's `mode`, `m_bias`, `rms_bias`: PackedMuon's and PackedAdamW's
    names), so nanochat's scalars can keep fp32 AdamW moments beside packed embeddings. Each
    (rule, state format) is one rule optimizer (`rules`: "muon" and "adamw" for the
    constructor's formats, "adamw:<identity>" for another), stepped as it steps alone. The
    step's switches are the optimizer's, and a group that sets one (or the constructor's
    `adamw_*` name, the other rule's option, or a torch option to what the rule does not do, as
    `amsgrad=True`) is refused, naming the key, when added and when a state_dict's groups load.
    The step, state_dict and load_state_dict are all rules', every saved group recording its
    own format identity; a load checks each group's against the group it loads into, and every
    rule's state, before anything changes. DTensor (FSDP2) parameters step as each rule steps
    them, and the state_dict shards with them (torch.distributed.checkpoint). Under
    `torch.compile` the step is one custom op, as PackedAdamW's and PackedMuon's are
    (`fullgraph=True` holds; the eager step's bits). `capturable=True` (CUDA; `lr` and
    `adamw_lr`, or every group's lr, one-element tensors on the device) makes every rule's step
    capturable by `torch.cuda.graph`, as PackedMuon's and PackedAdamW's are.
    `track_format=True` counts every rule's steps (`format_stats`), each what it counts alone:
    Muon's refusals in every mode, AdamW's codes in mode 'packed' or 'fp16' (fp32 mode stores
    float32 moments: its parameters have no entries). `master_weights()` and
    `load_master_weights()` are every rule's FP32 masters, in this optimizer's parameter order."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=_muon.DEFAULT_NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = _muon.DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None, *, mode: str = "packed",
                 mu_bias: int = DEFAULT_MU_BIAS, adamw_lr: float = 1e-3, adamw_betas=(0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 1e-2, adamw_mode: str = "packed",
                 m_bias: int = DEFAULT_M_BIAS, rms_bias: int = DEFAULT_RMS_BIAS, maximize: bool = False,
                 check_nonfinite: bool = False, multi_tensor: bool = True, capturable: bool = False,
                 batch_ns: bool | None = None, ns_impl: str = "auto", track_format: bool = False):
        _muon.check_options(self.optimizer_name, capturable, batch_ns, ns_impl, lr=lr,
                            check_nonfinite=check_nonfinite)
        adamw_counts = False  # whether AdamW's rule counts too (Muon counts its refusals in every mode)
        if track_format is not False:  # checked before any group makes its rule
            adamw_counts = _checked_track_format(track_format, AdamWStateFormat(adamw_mode, m_bias, rms_bias),
                                                 capturable)
        if capturable and adamw_lr is lr:
            # the kind whose groups come second would get copies: filling the tensor would set one kind only
            raise ValueError("PackedMuonAdamW(capturable=True): lr and adamw_lr are one tensor; give each kind its own "
                             "(adamw_lr=lr.clone(), or another tensor), which the first group of that kind holds")
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
        # The AdamW groups' defaults are checked now, as Muon's are, whether or not an AdamW group comes yet.
        try:
            AdamWStateFormat(adamw_mode, m_bias, rms_bias)
            _checks.check_hyperparams(self._rule_options["adamw"]["defaults"], PackedAdamW.rule_launch.rule,
                                      check_lr=not capturable)
        except (ValueError, TypeError) as e:
            raise type(e)(f"PackedMuonAdamW: the AdamW groups' defaults (adamw_lr, adamw_betas, adamw_eps, "
                          f"adamw_weight_decay; adamw_mode, m_bias, rms_bias) refused: {e}") from None
        self._rules: dict[str, PackedOptimizer] = {}
        super().__init__(params, {})

    # ---- groups: each one belongs to the rule optimizer of its kind and format ---------------------
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
        if isinstance(params, set):  # torch.optim's own refusal: a set's order is not the model's
            raise TypeError(f"param_groups[{len(self.param_groups)}]['params'] is a set: optimizer parameters need "
                            "to be organized in ordered collections (the state_dict saves them by position), but "
                            "the ordering of tensors in sets will change between runs; pass a list")
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        ours = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in ours for p in group["params"]):
            raise ValueError(f"param_groups[{len(self.param_groups)}] lists a parameter another group has: a "
                             "parameter belongs to one rule; list each parameter once")
        key, fmt = self._key_for(group), self._format_of(group)
        rule = self._rules.get(key)
        # The rule's messages name the group by the index it is getting here.
        shown = [i for i, g in enumerate(self.param_groups) if self.rule_key(g) == key] + [len(self.param_groups)]
        # A rule optimizer alone refuses format keys in its groups (its format is all its groups'):
        # it checks the group without them, and the group dict keeps them, as given.
        own_format = {k: group.pop(k) for k in FORMAT_KEYS[kind] if k in group}
        try:
            default_lr = self._rule_options[kind]["defaults"]["lr"]
            if self.capturable and "lr" not in group:
                group["lr"] = default_lr_for_group(self.param_groups, default_lr)
            if rule is None:
                settings = self._rule_options[kind]
                group = {**settings["defaults"], **group}
                cls = RULE_CLASSES[kind]
                rule = cls.__new__(cls)
                rule._shown_group_indices = shown  # before __init__, which checks the group
                rule._optimizer_name = self.optimizer_name  # its messages name the optimizer the user steps
                rule.__init__([group], **settings["defaults"], **self._rule_settings(kind, fmt))
                rule.state = self.state  # one state: torch's state_dict packs every parameter's
                self._rules[key] = rule
            else:
                rule._shown_group_indices = shown
                rule.add_param_group(group)
            rule.param_groups[-1].update(own_format)
            self.param_groups.append(rule.param_groups[-1])  # the same dict: schedulers reach the rule
        finally:
            self._note_param_lists()

    def _check_group_options(self, group: dict, where: str) -> None:
        """Refuses, for a group added or about to load (`where` names it), a key the group's rule
        would not read from it, naming it: a step switch of the optimizer's or an unsupported torch
        option (`_checks.check_group_options`, every optimizer's one check), the constructor's
        `adamw_*` defaults, the other rule's hyperparameters and format keys, and a state format
        of its own that its rule refuses (mode='fp8', a bias out of range)."""
        kind = group["kind"]
        other = "adamw" if kind == "muon" else "muon"
        keys = lambda k: {*self._rule_options[k]["defaults"], *FORMAT_KEYS[k]}  # noqa: E731
        others = keys(other) - keys(kind)
        where = f"{where} (kind={kind!r})"
        shown = f"{where} sets {{key!r}}"
        for key in group:
            if key in ADAMW_DEFAULTS:
                raise ValueError(f"{shown.format(key=key)}: {key} is the constructor's default for AdamW groups; a "
                                 f"group's own AdamW setting is {ADAMW_DEFAULTS[key]!r}")
            if key in others:
                raise ValueError(f"{shown.format(key=key)}: {key} is an option of {RULE_NAMES[other]} groups, which "
                                 f"this {RULE_NAMES[kind]} group would ignore; remove it, or make the group "
                                 f"kind={other!r}")
        _checks.check_group_options(group, where, self.optimizer_name, _GROUP_OPTIONS,
                                    self.__dict__.get("capturable", False), own_format_keys=FORMAT_KEYS[kind])
        for key in FORMAT_KEYS[kind]:
            if key in group:
                try:
                    FORMAT_CLASSES[kind](**{key: group[key]})
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{shown.format(key=key)}: {e}") from None

    # ---- the rules: one per (kind, state format) --------------------------------------------------
    def _default_format(self, kind: str):
        """The constructor's state format for groups of `kind`."""
        options = self._rule_options[kind]["options"]
        return FORMAT_CLASSES[kind](**{key: options[key] for key in FORMAT_KEYS[kind]})

    def _format_of(self, group: dict):
        """A group's state format: its own entries, the constructor's for the others."""
        kind = group["kind"]
        options = self._rule_options[kind]["options"]
        return FORMAT_CLASSES[kind](**{key: group.get(key, options[key]) for key in FORMAT_KEYS[kind]})

    def _key_for(self, group: dict) -> str:
        """The key of the rule optimizer for a group of this kind and state format: its kind
        ("muon", "adamw") for the constructor's format, else "<kind>:<the format's identity>"."""
        kind = group["kind"]
        if not any(key in group for key in FORMAT_KEYS[kind]):
            return kind
        identity = self._format_of(group).identity
        return kind if identity == self._default_format(kind).identity else f"{kind}:{identity}"

    def rule_key(self, group: dict) -> str:
        """The key in `rules` of the rule optimizer that steps `group` (one of `param_groups`): its
        kind ("muon", "adamw") where the group keeps the constructor's state format, else
        "<kind>:<the format's identity>" (an AdamW group in fp32 mode: "adamw:fp32:m=f32,v=f32")."""
        for key, rule in self.__dict__.get("_rules", {}).items():
            if any(g is group for g in rule.param_groups):
                return key
        return self._key_for(group)  # a group no rule holds (yet)

    def _rule_keys(self) -> list[str]:
        """`rule_key` of every group, each checked: a group's own format entries must still name
        its rule's format (they are read when it is added; changed since, they would be saved
        beside a state of another format)."""
        keys = []
        for i, group in enumerate(self.param_groups):
            key = self.rule_key(group)
            try:
                named = self._key_for(group)
            except (TypeError, ValueError) as e:
                named = str(e)
            if named != key:
                own = ", ".join(f"{k}={group[k]!r}" for k in FORMAT_KEYS[group["kind"]] if k in group)
                raise ValueError(f"param_groups[{i}] sets {own} since it was added, but its state is kept in "
                                 f"{self._rules[key].state_format.identity!r}: a group's state format is fixed when "
                                 "it is added. Set its entries back, or move the run to a new optimizer over the "
                                 "groups (export_state / import_state, or master_weights)")
            keys.append(key)
        return keys

    def _rule_settings(self, kind: str, fmt) -> dict:
        """The options a rule optimizer of `kind` and state format `fmt` is built with: the
        constructor's, its format's fields, and whether it counts (`track_format` as set here:
        AdamW's rule counts where its mode has codes)."""
        options = {**self._rule_options[kind]["options"], **{key: getattr(fmt, key) for key in FORMAT_KEYS[kind]}}
        requested = self._rule_options["muon"]["options"]["track_format"]  # Muon's is the switch as set here
        options["track_format"] = requested if kind == "muon" else requested and has_format_counts(fmt)
        return options

    def _note_param_lists(self) -> None:
        """The groups' parameter lists, which compiled steps iterate (see PackedAdamW's), and
        each rule's group indices in this optimizer, which its messages name
        (`_checks.shown_group_index`): a rule's groups are this optimizer's of its kind and
        format, in order."""
        self._param_lists = [group["params"] for group in self.param_groups]
        rules = self.__dict__.get("_rules", {})
        if rules:
            keys = [self.rule_key(g) for g in self.param_groups]
            for key, rule in rules.items():
                rule._shown_group_indices = [i for i, k in enumerate(keys) if k == key]

    @property
    def check_nonfinite(self) -> bool:
        """Whether a step may raise NonFiniteGradientError: set here (for every rule) or on a rule
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
        """Whether the steps made from now on are counted (`format_stats`): set here (for every
        rule, each counting what it can) or on a rule since; it may be switched between steps."""
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
        for rule in self._rules.values():
            rule.track_format = value if _is_muon(rule) else value and has_format_counts(rule.state_format)

    @property
    def format_count_names(self) -> tuple[str, ...]:
        """Every rule's `format_count_names` (PackedMuon's, PackedAdamW's), each name once, in the
        order the rules were made."""
        return tuple(dict.fromkeys(name for rule in self._rules.values() for name in rule.format_count_names))

    def format_stats(self) -> dict:
        """Every rule's `format_stats` in one dict, in this optimizer's parameter order (keys: a
        parameter's name, or its (group, position) here): Muon's entries as PackedMuon gives them
        (`refused`, `elements`, `saturated_mu`, ...), AdamW's as PackedAdamW (`elements`,
        `saturated_m`, ...; none in AdamW's fp32 mode, which has no codes to count). Counts since
        the last call, reset on read; as each rule's, they travel with a pickle or a copy, and
        with nothing counted since the last read the result is {} while `track_format` is on and
        an error while it is off."""
        counted = [rule for rule in self._rules.values() if _engine.counts_to_read(rule)]
        if not counted and not self.track_format:
            raise _engine.no_counts_error(self.optimizer_name)
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
    def rules(self) -> dict[str, PackedOptimizer]:
        """The rule optimizers (PackedMuon / PackedAdamW) that step the groups, one per kind and
        state format: "muon" and "adamw" for the constructor's formats, "<kind>:<identity>" for a
        group's own (`rule_key(group)` says which steps a group)."""
        return dict(self._rules)

    def _adamw_formats(self) -> list:
        return [rule.state_format for rule in self._rules.values() if not _is_muon(rule)]

    def __getstate__(self) -> dict:
        # The rules share this optimizer's groups and state: each travels without them (its own
        # pickle's other entries) and takes them back when unpickled. AdamW's uint32 words travel
        # as their int32 bits, which torch can unpickle (as PackedAdamW's own pickle does).
        rules = {key: (type(rule), {k: v for k, v in rule.__getstate__().items() if k not in _SHARED_WITH_RULES})
                 for key, rule in self._rules.items()}
        # torch's own pickle, loader and state_dict: the rules hold the state formats the base's read
        state = {**Optimizer.__getstate__(self), "_rule_options": self._rule_options, "_rule_pickles": rules,
                 "_check_nonfinite": self.__dict__.get("_check_nonfinite", False),
                 "capturable": self.__dict__.get("capturable", False)}
        return _persistence.words_as_int32(self, state, self._adamw_formats())

    def __setstate__(self, state: dict) -> None:
        as_int32 = state.pop("_words_pickled_as_int32", False)
        rule_pickles = state.pop("_rule_pickles", None)  # absent from torch's load_state_dict call
        Optimizer.__setstate__(self, state)
        self.__dict__.setdefault("_check_nonfinite", False)  # pickled before the attribute existed
        self.__dict__.setdefault("capturable", False)
        if rule_pickles is not None:  # keyed by kind before groups had formats of their own: the same keys
            self._rules = {}
            keys = [self._key_for(g) for g in self.param_groups]
            for key, (cls, rule_state) in rule_pickles.items():
                rule = cls.__new__(cls)
                rule._optimizer_name = self.optimizer_name
                rule.__setstate__({**rule_state, "state": self.state,
                                   "param_groups": [g for g, k in zip(self.param_groups, keys) if k == key]})
                self._rules[key] = rule
        if as_int32:
            _persistence.words_from_int32(self, self._adamw_formats())
        self._note_param_lists()
        if "_compile_token" not in self.__dict__:  # a copy or an unpickled optimizer
            self._compile_token = _compiled.register(self)

    # ---- the step (`PackedOptimizer.step`) ----------------------------------------------------
    def _eager_update(self, live: dict | None = None) -> None:
        """Every rule's step as one: Muon's checks (`muon.check_step`, which change nothing),
        then each AdamW rule's whole step (which raises before changing anything; the rules after
        the first are checked before the first steps), then Muon's phases on what was checked.
        So a step that raises anything but NonFiniteGradientError leaves every rule as it was. A
        rule that raises NonFiniteGradientError has stepped, and the others step too before the
        error names what any refused. `live`: see `_compiled.run`."""
        checked_muon = {key: _muon.check_step(rule, live) for key, rule in self._rules.items() if _is_muon(rule)}
        adamw = [(key, rule) for key, rule in self._rules.items() if not _is_muon(rule)]
        for _, rule in adamw[1:]:
            _check_adamw_step(rule, live)
        errors = {}
        for key, rule in adamw:
            try:
                rule._eager_update(live)
            except NonFiniteGradientError as e:  # raised after the rule stepped: the others step too
                errors[key] = str(e)
        for key, checked in checked_muon.items():
            try:
                _muon.run_step(self._rules[key], checked, live)
            except NonFiniteGradientError as e:
                errors[key] = str(e)
        if errors:
            raise NonFiniteGradientError("; ".join(errors[key] for key in self._rules if key in errors))

    # ---- saving and loading -------------------------------------------------------------------
    def identities(self) -> dict[str, str]:
        """Each rule's format identity, by its key in `rules`."""
        return {key: rule.state_format.identity for key, rule in self._rules.items()}

    def state_dict(self) -> dict:
        sd = Optimizer.state_dict(self)
        identities = self.identities()
        sd[_persistence.STATE_DICT_KEY] = {"version": _persistence.STATE_DICT_VERSION, "format": identities}
        sd["param_groups"] = [{**saved, _persistence.GROUP_FORMAT_KEY: identities[key]}
                              for saved, key in zip(sd["param_groups"], self._rule_keys())]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Every group's rule and format identity (against the group it loads into), and each
        rule's state, are checked before anything changes; then torch loads, and each rule puts
        its codes back bit for bit. A state saved before groups had formats of their own (one
        per kind) loads as it did."""
        saved_groups = state_dict.get("param_groups") or []
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the saved state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}; load it into an optimizer built over the same groups")
        keys = self._rule_keys()
        saved_identities = {}  # per rule, the identity its saved groups carry (all the same)
        for i, (saved, ours, key) in enumerate(zip(saved_groups, self.param_groups, keys)):
            kind = ours["kind"]
            if saved.get("kind") != kind:
                raise ValueError(f"load_state_dict: saved param_groups[{i}] is kind={saved.get('kind')!r}, this "
                                 f"optimizer's is {kind!r}; build the optimizer with the saved run's groups")
            saved_identity = saved.get(_persistence.GROUP_FORMAT_KEY)
            fmt = self._rules[key].state_format
            # Muon's packed format also reads its states saved before the exponents (MUON.md).
            reads = fmt.reads(saved_identity) if hasattr(fmt, "reads") else saved_identity == fmt.identity
            if not reads or saved_identities.setdefault(key, saved_identity) != saved_identity:
                raise ValueError(f"load_state_dict: saved param_groups[{i}] ({kind}) has format {saved_identity!r} "
                                 f"but this optimizer's param_groups[{i}] uses {fmt.identity!r}; build it with the "
                                 "saved run's state formats (the constructor's modes and biases, and each group's own)")
            where = f"load_state_dict: saved param_groups[{i}]"
            self._check_group_options(saved, where)
            self._check_saved_format_keys(saved, fmt, f"{where} (kind={kind!r})", saved_identity)
        checked = {}
        for key, rule in self._rules.items():
            kind = "muon" if _is_muon(rule) else "adamw"
            part = {"state": state_dict["state"],
                    "param_groups": [_without(g, FORMAT_KEYS[kind]) for g, k in zip(saved_groups, keys) if k == key],
                    _persistence.STATE_DICT_KEY: {"version": _persistence.STATE_DICT_VERSION,
                                                  "format": saved_identities.get(key, rule.state_format.identity)}}
            checked[key] = rule._checked_load(part)[1]
        groups = [_with_own_format(_without(g, (_persistence.GROUP_FORMAT_KEY,)), ours)
                  for g, ours in zip(saved_groups, self.param_groups)]
        held = groups_holding(self.param_groups,
                              [options["defaults"]["lr"] for options in self._rule_options.values()])
        Optimizer.load_state_dict(self, {"state": state_dict["state"], "param_groups": groups})
        relink_default_lrs(self.param_groups, held)
        self._bind_rules(keys)
        for key, loaded in checked.items():
            self._rules[key]._restore_loaded(loaded)

    def _check_saved_format_keys(self, saved: dict, fmt, where: str, identity) -> None:
        """A saved group's own format entries must be the format its state was saved in (the
        identity it records, which `fmt`, its group's here, reads): otherwise it was edited."""
        kind = saved["kind"]
        fields = {key: getattr(fmt, key) for key in FORMAT_KEYS[kind]}
        for key in FORMAT_KEYS[kind]:
            if key in saved and FORMAT_CLASSES[kind](**{**fields, key: saved[key]}).identity != fmt.identity:
                raise ValueError(f"{where} sets {key!r}={saved[key]!r}, but its state was saved in format "
                                 f"{identity!r}; the state_dict was edited: save it again from the optimizer")

    def _bind_rules(self, keys: list[str]) -> None:
        """torch's loader makes new group dicts and a new state: the rules take them (group i
        the rule keys[i] names, as before the load)."""
        for key, rule in self._rules.items():
            rule.param_groups = [g for g, k in zip(self.param_groups, keys) if k == key]
            rule.state = self.state
            rule.__dict__.pop("_valid_rows", None)
            rule.__dict__.pop("_kept_rows", None)
            rule._note_param_lists()
            _engine.drop_plan(rule, keep_counts=False)  # a loaded state starts the counts afresh
        self._note_param_lists()

    # ---- masters and PortableState: `PackedOptimizer`'s, over every rule ------------------------
    def _fresh_entries(self, p: torch.Tensor) -> dict:
        """A parameter's state before its first step, as the rule of its group makes it."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        return self._rules[self.rule_key(group)]._fresh_entries(p)

    def _portable(self):
        """Every rule's state as one `PortableState` (format "mixed", each tensor's identity in
        `formats`): Muon's momenta (count None), AdamW's words and counts, bf16 parameters' low
        halves; for `packed_adamw.jax.muon.import_muon_state` and back."""
        from . import _muon_portable

        return _muon_portable


def _without(group: dict, keys) -> dict:
    return {k: v for k, v in group.items() if k not in keys}


def _with_own_format(saved: dict, ours: dict) -> dict:
    """A saved group as it loads into `ours`: with our group's own format entries (the saved
    ones name the same format, checked), where the saved group holds them (its order of keys
    kept: a state saved after a resume is the uninterrupted run's), else after its keys."""
    keys = FORMAT_KEYS[ours["kind"]]
    loaded = {k: ours[k] if k in keys else v for k, v in saved.items() if k not in keys or k in ours}
    loaded.update((k, ours[k]) for k in keys if k in ours and k not in loaded)
    return loaded


def _check_adamw_step(rule: PackedAdamW, live) -> None:
    """Raises what `rule`'s step would raise before changing anything (its hyperparameter rows,
    then its plan's checks, or a full step's where the plan no longer holds), changing nothing:
    a PackedMuonAdamW with several AdamW formats checks the later rules before the first steps.
    Not while a CUDA graph captures (a capture records launches, which a refusal discards)."""
    if _checks.capturing():
        return
    for index, group in enumerate(rule.param_groups):
        _engine.checked_row(rule, group, index)
    plan = rule.__dict__.get("_plan")
    if plan is None or live is not None or plan._gradients(rule) is None:
        _engine._check_step(rule, live)
