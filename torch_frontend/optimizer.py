"""`PackedAdamW`: torch.optim.AdamW with one uint32 word of state per FP32 parameter; and
`ElementwiseOptimizer`, the optimizer of any elementwise rule, which PackedAdamW is written on.

The class validates its options, holds the hyperparameters and the state, and asks the rest
of the frontend to do the work: `_engine.py` steps (one route: a step plan and its run) and
keeps the format counts, `_checks.py` makes the checks, `_persistence.py` saves, loads and
moves the state and the FP32 masters, `_compiled.py` is the step under torch.compile.
"""
from __future__ import annotations

import torch

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat

from . import _checks, _engine, _persistence
from ._base import _REQUIRED, PackedOptimizer
from .functional import ADAMW_LAUNCH
from ._checks import MAX_STEP, STEP_LIMIT  # noqa: F401  (public names of this module)
from ._engine import SATURATION_WARNING, NonFiniteGradientError  # noqa: F401
from ._persistence import GROUP_FORMAT_KEY, STATE_DICT_KEY, STATE_DICT_VERSION  # noqa: F401


class ElementwiseOptimizer(PackedOptimizer):
    """The torch optimizer of an elementwise rule (docs/ARCHITECTURE.md, "How a rule plugs in"),
    naming none: a subclass gives its `rule_launch` (`_launch.RuleLaunch`: the rule's
    declaration, kernels, host step scalars and numpy step), its `state_format_class` and the
    constructor's `format_keys`, and calls `__init__` with its groups' defaults (the rule's
    `group_keys`, then `maximize`) and its state format. The step (`_engine`: checks, a step
    plan, the launches or the numpy step), saving and loading (`_persistence`), the compiled
    step, `capturable` steps and the format counts are the shared machinery's, as PackedAdamW's.

        class PackedHeavyBall(ElementwiseOptimizer):
            rule_launch = HEAVY_BALL_LAUNCH
            state_format_class = HeavyBallFormat
            format_keys = ("mu_bias",)

            def __init__(self, params, lr=1e-2, momentum=0.9, *, mu_bias=15, **options):
                super().__init__(params, dict(lr=lr, momentum=momentum, maximize=False),
                                 HeavyBallFormat(mu_bias=mu_bias), **options)
    """

    rule_launch = None  # the rule's `_launch.RuleLaunch`
    pickled_options = {"state_format": _REQUIRED, "multi_tensor": True, "check_nonfinite": False,
                       "capturable": False}
    # the optimizer's switches a group cannot set, besides its `format_keys` (`group_options`)
    switches = ("multi_tensor", "check_nonfinite", "capturable", "track_format")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        rule = cls.__dict__.get("rule_launch")
        if rule is not None:  # a rule class: what it must declare is checked now, not in its first step or load
            _check_rule_class(cls)
            for name, value in (("rule_name", rule.rule.name), ("display_name", rule.rule.name),
                                ("torch_twin", cls.__name__)):
                if not cls.__dict__.get(name):
                    setattr(cls, name, value)
        if cls.rule_launch is not None and "group_options" not in cls.__dict__ and (
                rule is not None or "format_keys" in cls.__dict__):  # what groups cannot set follows its format keys
            _check_rule_class(cls)
            cls.group_options = {key: key for key in (*cls.format_keys, *cls.switches)}

    def __init__(self, params, defaults: dict, state_format, *, multi_tensor: bool = True,
                 check_nonfinite: bool = False, track_format: bool = False, capturable: bool = False):
        """`defaults`: each of the rule's `group_keys` and `maximize`; `state_format`: an
        instance of `state_format_class`."""
        name = self.optimizer_name
        if self.rule_launch is None:
            raise TypeError(f"{name} sets no rule_launch: a class an optimizer is built from names its rule's "
                            "_launch.RuleLaunch as its class attribute rule_launch (as PackedAdamW's is "
                            "functional.ADAMW_LAUNCH)")
        if not isinstance(state_format, self.state_format_class):
            raise TypeError(f"{name}: state_format must be a {self.state_format_class.__name__} (its "
                            f"state_format_class), got {type(state_format).__name__}")
        if state_format.rule != self.rule_launch.rule:  # the launches would read another rule's rows and state
            raise TypeError(f"{name}: its rule_launch steps rule {self.rule_launch.rule.name!r} but its state "
                            f"format's rule is {state_format.rule.name!r}; give the RuleLaunch and the state format "
                            "of one rule")
        if self.rule_launch.uses_skeleton and "BLOCK_STEP" not in state_format.kernel_constexprs(track_format=False):
            # else the first CUDA launch fails inside Triton, naming neither the rule nor this class
            raise TypeError(f"{name}: its rule_launch launches the launch skeleton's kernels (core/skeleton.py; "
                            "RuleLaunch's default multi_tensor_kernel, single_tensor_kernel and split_kernel), which "
                            f"call the block step its state format names, but {type(state_format).__name__}"
                            ".kernel_constexprs names none: return packed_adamw.core.skeleton.constexprs(block_step, "
                            "format_fields, rule) from it, or name the rule's own kernels in its RuleLaunch")
        self.state_format = state_format
        lr = defaults.get(self.rule_launch.rule.group_keys[0])
        _checks.check_capturable(capturable, lr, check_nonfinite=check_nonfinite, multi_tensor=multi_tensor,
                                 optimizer=name)
        self.multi_tensor = multi_tensor
        self.check_nonfinite = check_nonfinite
        self.capturable = capturable
        self.track_format = track_format  # checked against the mode and capturable (the property)
        _checks.check_hyperparams(defaults, self.rule_launch.rule, check_lr=not capturable)
        super().__init__(params, self._group_defaults(defaults))

    def _group_defaults(self, defaults: dict) -> dict:
        """The validated defaults as the groups keep them."""
        return defaults

    def _check_new_group(self, group: dict, index: int) -> None:
        _checks.validate_group(group, index, self.rule_launch.rule, self.optimizer_name)

    def _check_saved_hyperparams(self, group: dict, where: str) -> None:
        rule = self.rule_launch.rule
        _checks.check_saved_group_holds(group, rule.group_keys, where)
        try:
            _checks.validate_rule_hyperparams(group, rule)
            _checks.check_maximize(group.get("maximize", False), "maximize")
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None

    def _eager_update(self, live: dict | None = None) -> None:
        """The eager step (`_engine.step`; `live` as it says)."""
        _engine.step(self, live)

    def _count_names(self) -> tuple:
        """The rule's format counts (`Rule.count_names`), after `elements`."""
        return self.rule_launch.rule.count_names

    def _checked_load(self, state_dict: dict) -> tuple[dict, dict]:
        return _persistence.checked_load(self, state_dict)

    def _restore_loaded(self, loaded: dict) -> None:
        _persistence.restore_loaded(self, loaded)

    def _fresh_entries(self, p: torch.Tensor) -> dict:
        return _persistence.fresh_state_entries(self, p)

    def _portable(self):
        return _persistence


def _check_rule_class(cls) -> None:
    """What a class of `ElementwiseOptimizer` naming a rule (`rule_launch`) must declare beside
    it, checked when the class is made: its state format class and its constructor's
    `format_keys` (which a group may not set, and which a refused load names)."""
    from ._launch import RuleLaunch
    from packed_adamw.core.rule import StateLayout

    name = cls.__name__
    if not isinstance(cls.rule_launch, RuleLaunch):
        raise TypeError(f"{name}.rule_launch must be a RuleLaunch (packed_adamw.torch.RuleLaunch: the rule, its "
                        f"kernels, its host step scalars and its numpy step), got {type(cls.rule_launch).__name__}")
    if not (isinstance(cls.state_format_class, type) and issubclass(cls.state_format_class, StateLayout)):
        raise TypeError(f"{name} sets no state_format_class: a rule class names its state format's class (a "
                        f"core.rule.StateLayout), got {cls.state_format_class!r}")
    if not any("format_keys" in vars(base) for base in cls.__mro__ if base is not PackedOptimizer):
        raise TypeError(f"{name} sets no format_keys: a rule class names the constructor's options that make its "
                        "state format (as PackedAdamW's ('mode', 'm_bias', 'rms_bias')); () if there are none")
    if not (isinstance(cls.format_keys, tuple) and all(isinstance(key, str) for key in cls.format_keys)):
        raise TypeError(f"{name}.format_keys must be a tuple of option names, got {cls.format_keys!r}")


class PackedAdamW(ElementwiseOptimizer):
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

    rule_name = "adamw"
    display_name = "AdamW"
    state_format_class = StateFormat
    format_keys = ("mode", "m_bias", "rms_bias")
    torch_twin = "torch.optim.AdamW"
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, StateFormat(mode, m_bias, rms_bias), multi_tensor=multi_tensor,
                         check_nonfinite=check_nonfinite, track_format=track_format, capturable=capturable)

    def _group_defaults(self, defaults: dict) -> dict:
        return {**defaults, "betas": tuple(defaults["betas"])}
