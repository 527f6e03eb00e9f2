"""The checks `PackedAdamW` makes: of its options and parameter groups, of each step's
tensors and stored state (what the kernel's raw addresses rely on), of saved states before they
load, and of FP32 masters. Each raises an error that names the parameter and says what to do;
none changes anything."""
from __future__ import annotations

import numbers

import numpy as np
import torch

from packed_adamw.core import StateFormat, codecs as formats
from packed_adamw.core.rule import MAX_STEP_COUNT as MAX_STEP

from . import _dtensor
from ._state import LOW_HALF_DTYPE, LOW_HALF_KEY, STEP_KEY, has_format_counts, state_dtype
from .functional import nonfinite_count, outside_split_domain

FLOAT32, BFLOAT16, STRIDED = torch.float32, torch.bfloat16, torch.strided
# The step scalars' powers b**t need the count t below 2**31 (FORMAT.md): a parameter steps at
# most STEP_LIMIT times, and a state may hold a count up to MAX_STEP, one step short of it.
STEP_LIMIT = MAX_STEP + 1  # core/rule.py's MAX_STEP_COUNT: the one home of the number, for both frontends


def capturing() -> bool:
    """Whether a CUDA graph captures on the current stream (a capture needs CUDA initialized,
    and a CPU-only torch build cannot ask)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def kernel_tensors(p: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(local parameter, local gradient) for the kernel: a DTensor's shard, or the tensors."""
    g = p.grad
    if _dtensor.is_dtensor(p) != _dtensor.is_dtensor(g):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its gradient is {_dtensor.describe(g)}; "
                         "both must be DTensors (FSDP2) or both plain tensors")
    if _dtensor.is_dtensor(p) and (g.placements != p.placements or g.device_mesh != p.device_mesh):
        raise ValueError(f"{name} is {_dtensor.describe(p)} but its gradient is {_dtensor.describe(g)}; "
                         "redistribute the gradient like the parameter before step()")
    return _dtensor.local(p), _dtensor.local(g)


def check_live_state(p, pl, state: dict, fmt: StateFormat, name: str, optimizer: str = "PackedAdamW") -> int:
    """The state a step is about to use must be what the kernel's raw addresses expect;
    returns its step count. `optimizer`: the class the messages name."""
    stored = state.get(fmt.state_key)
    count = state.get(STEP_KEY)
    if stored is None or not isinstance(stored, torch.Tensor):
        raise ValueError(f"{name}: its optimizer state has no {fmt.state_key!r} tensor (got {state!r}); "
                         f"load a state saved by {optimizer} with the same state format, or start fresh")
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
    expected_shape, expected_dtype = fmt.state_shape(pl.shape), state_dtype(fmt)
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
    check_live_low_half(p, pl, state, name)
    return checked_step_count(count, name)


def check_live_low_half(p, pl, state: dict, name: str) -> None:
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


def checked_step_count(count, where: str) -> int:
    """A saved or stored step count as an int in [0, MAX_STEP]: a one-element tensor or a
    whole float is taken as its value, fractions and bools are refused."""
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = count.item()
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if isinstance(count, numbers.Integral) and not isinstance(count, (bool, np.bool_)) and count == STEP_LIMIT:
        raise ValueError(f"{where}: step count {count} is the limit: a parameter steps at most 2**31 - 1 = "
                         f"{STEP_LIMIT} times (the step scalars' powers need the count below 2**31), so it cannot "
                         "step again. To train it further, give it a fresh state (its moments and count restart)")
    if not isinstance(count, numbers.Integral) or isinstance(count, (bool, np.bool_)) or not 0 <= count <= MAX_STEP:
        raise ValueError(f"{where}: step count {count!r} must be a whole number in [0, {MAX_STEP}]; the state is "
                         "damaged or was edited: load an undamaged state, or start this parameter fresh")
    return int(count)


def check_loaded_layout(tensor, p, fmt: StateFormat, key: str, where: str) -> None:
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


def check_loaded_values(moments: torch.Tensor, fmt: StateFormat, where: str) -> None:
    """fp32 moments that are not finite, or a negative v, would make every element reject its
    update and freeze the parameter silently. (Every packed or fp16 word decodes finitely.)
    A float32 state of another rule is its own layout, not AdamW's [m, v]: any value in it
    that is not finite is refused."""
    if state_dtype(fmt) is not FLOAT32 or moments.numel() == 0:
        return
    if not isinstance(fmt, StateFormat):
        bad = int((~torch.isfinite(moments)).sum())
        if bad:
            raise ValueError(f"{where}: {bad} values are NaN or Inf in its float32 {fmt.state_key!r}; such a state "
                             "would freeze those elements. Load an undamaged state")
        return
    m, v = moments[0], moments[1]
    bad_m = int((~torch.isfinite(m)).sum())
    bad_v = int((~torch.isfinite(v) | (v < 0)).sum())
    if bad_m or bad_v:
        raise ValueError(f"{where}: {bad_m} first moments are NaN/Inf and {bad_v} second moments are NaN, Inf or "
                         "negative; such a state would freeze those elements. Load an undamaged state")


def checked_loaded_low_half(low_half, p, where: str):
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


def check_one_device(params: list, where: str, optimizer: str = "PackedAdamW") -> None:
    devices = {_dtensor.local(p).device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: parameters are on several devices {sorted(map(str, devices))}; {optimizer} updates one "
            "device: move the model with .to(device) first, or use one optimizer per device"
        )


def shown_group_index(opt, index: int) -> int:
    """The index a message gives `opt`'s param group `index`: where the user holds it. A rule
    optimizer inside PackedMuonAdamW numbers its groups among the combined optimizer's
    (`_shown_group_indices`, which the combined one keeps)."""
    shown = opt.__dict__.get("_shown_group_indices")
    return shown[index] if shown is not None and index < len(shown) else index


def param_name(group: dict, group_index: int, param_index: int) -> str:
    names = group.get("param_names")
    if names:
        return repr(names[param_index])
    return f"param_groups[{group_index}]['params'][{param_index}]"


def plain(value, name: str):
    """A one-element tensor hyperparameter as a float (as torch.optim accepts); other values as they are."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: a tensor {name} must have one element, got shape {tuple(value.shape)}")
        return float(value)
    return value


def plain_group_value(value, key: str):
    """A parameter group's hyperparameter as the rule's validation takes it: a one-element
    tensor as a float, a tuple or list (betas) with its one-element tensors as floats; any
    other value as it is (the validation says what is wrong with it)."""
    if isinstance(value, (tuple, list)) or (isinstance(value, torch.Tensor) and value.dim() == 1
                                              and value.numel() > 1):
        # betas as a 1-D tensor iterates into its elements, as torch.optim reads it (a one-element
        # tensor, lr=torch.tensor([1e-3]), is a number)
        return tuple(plain(v, f"{key}[{i}]") for i, v in enumerate(value))
    return plain(value, key)


def check_maximize(value, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: maximize must be True or False")


def validate_rule_hyperparams(values, rule, *, check_lr: bool = True) -> None:
    """The rule's own validation (`Rule.validate`, written from its bounds) of the values of
    its `group_keys` in `values` (a parameter group, or the constructor's defaults). Without
    `check_lr` the learning rate (the first key) is left out: a capturable one is checked on
    the device."""
    plain_values = [plain_group_value(values[key], key) for key in rule.group_keys]
    if not check_lr:
        plain_values[0] = 0.0
    rule.validate(*plain_values)


def check_saved_group_holds(group: dict, keys, where: str) -> None:
    """A saved group about to replace one of the optimizer's holds every key its step reads
    (torch's loader installs the saved dict as it is, so a missing one would fail the next step)."""
    missing = [key for key in keys if key not in group]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(map(repr, missing))}, which every group of this optimizer holds "
                         "and its step reads: the state was edited or saved by another optimizer; load the "
                         "optimizer's own state_dict()")


def validate_group_hyperparams(group: dict, index: int, rule, check_lr: bool = True) -> None:
    try:
        validate_rule_hyperparams(group, rule, check_lr=check_lr)
        check_maximize(group.get("maximize", False), "maximize")
    except (ValueError, TypeError) as e:
        raise type(e)(f"param_groups[{index}]: {e}") from None


def check_listed_once(group: dict, index: int, torch_twin: str = "torch.optim.AdamW") -> None:
    """A parameter listed twice in a group is refused: `torch_twin`, the torch optimizer whose
    arguments the caller takes (torch.optim.AdamW, torch.optim.Muon), steps it twice (and warns
    that this will become an error), a step plan would step it once."""
    first = {}
    for param_index, p in enumerate(group["params"]):
        earlier = first.setdefault(id(p), param_index)
        if earlier != param_index:
            raise ValueError(
                f"{param_name(group, index, param_index)} is the same tensor as "
                f"{param_name(group, index, earlier)}: a parameter may be listed once in an optimizer "
                f"({torch_twin} would step it twice per step and warns that this will become an error); "
                "list each parameter once"
            )


def validate_group(group: dict, index: int, rule, optimizer: str = "PackedAdamW") -> None:
    """A group just added: its hyperparameters (`rule`'s) and its parameters; `optimizer`, the
    class the messages name."""
    validate_group_hyperparams(group, index, rule)
    for param_index, p in enumerate(group["params"]):
        name = param_name(group, index, param_index)
        local = _dtensor.local(p)
        if p.dtype is torch.float16:
            raise TypeError(
                f"{name} has dtype torch.float16: {optimizer} trains float32 or bfloat16 parameters (a bf16 one keeps "
                "an exact FP32 master: its bf16 weight plus a 2-byte low half in the optimizer state); convert it "
                "with .to(torch.bfloat16) or .float()"
            )
        if p.dtype not in (FLOAT32, BFLOAT16):
            raise TypeError(
                f"{name} has dtype {p.dtype}: {optimizer} trains float32 or bfloat16 parameters; convert it with "
                ".float() or .to(torch.bfloat16)"
            )
        if not local.is_contiguous():
            raise ValueError(f"{name} is not contiguous: pass a contiguous parameter (create it with .contiguous())")
        if local.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {local.device}: {optimizer} runs on CPU and CUDA devices")


def raise_grad_error(p: torch.Tensor, g: torch.Tensor, name: str, optimizer: str = "PackedAdamW") -> None:
    if p.dtype not in (FLOAT32, BFLOAT16) or not p.is_contiguous():  # changed after add_param_group
        raise TypeError(f"{name} is now {p.dtype}, contiguous={p.is_contiguous()}: {optimizer} trains contiguous "
                        "float32 or bfloat16 parameters")
    if g.is_sparse:
        raise RuntimeError(f"{name} has a sparse gradient: {optimizer} does not support sparse gradients (use dense "
                           "ones)")
    if g.is_complex():
        raise TypeError(f"{name} has a complex gradient: {optimizer} supports real float32 and bfloat16 tensors only")
    if g.dtype not in (FLOAT32, p.dtype):
        allowed = "float32 or bfloat16" if p.dtype is BFLOAT16 else "float32"
        raise TypeError(f"{name}: gradient dtype {g.dtype} does not fit the parameter's {p.dtype}; gradients of "
                        f"{p.dtype} parameters must be {allowed}")
    if g.shape != p.shape:
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from the parameter's {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{name}: gradient is on {g.device} but the parameter is on {p.device}")
    raise ValueError(f"{name}: gradient is not contiguous; make it contiguous before step() (g.contiguous())")


# ---- the optimizer's options --------------------------------------------------------------
# torch.optim's options that torch puts in its optimizers' groups (AdamW's), with the values that
# ask for nothing this project lacks (torch's defaults), and why another is refused. Refused as
# the constructor's keywords and as a group's keys alike (`check_group_options`): a group holding
# another would be stepped without it, silently.
_KERNELS = ("the packed optimizers always run their own kernels (PackedAdamW's multi_tensor=True: one launch for "
            "all tensors on CUDA)")
TORCH_OPTIONS = {
    "amsgrad": ((False, None), "AMSGrad keeps the running maximum of v as a third moment, and PackedAdamW's one word "
                "per parameter holds only m and sqrt(v); pass amsgrad=False or leave it out, or use "
                "torch.optim.AdamW(amsgrad=True)"),
    "decoupled_weight_decay": ((True,), "the weight decay is decoupled, p * (1 - lr * weight_decay), as "
                               "torch.optim.AdamW's and Muon's; pass decoupled_weight_decay=True or leave it out (for "
                               "Adam's L2 penalty use torch.optim.Adam)"),
    "foreach": ((None, False), f"{_KERNELS}; pass foreach=None or False, or leave it out"),
    "fused": ((None, False), f"{_KERNELS}; pass fused=None or False, or leave it out"),
    "differentiable": ((None, False), "the step is not differentiable (its state is rounded to 16-bit codes); pass "
                       "differentiable=False or leave it out"),
}
# The options of the project's optimizers that are the optimizer's, not a group's: its state format
# (PackedAdamW and PackedMuon keep one for all their groups, the state_dict records one identity;
# a PackedMuonAdamW group may set its own rule's, `own_format_keys`) and the switches of its step.
# A group holding one would be stepped with the optimizer's, silently.
FORMAT_OPTIONS = ("mode", "mu_bias", "adamw_mode", "m_bias", "rms_bias")
OPTIMIZER_OPTIONS = (*FORMAT_OPTIONS, "check_nonfinite", "multi_tensor", "capturable", "batch_ns", "ns_impl",
                     "track_format")
_SWITCHES = tuple(key for key in OPTIMIZER_OPTIONS if key not in FORMAT_OPTIONS)


def _asks_nothing_missing(value, accepted: tuple) -> bool:
    return any(value is a or (isinstance(value, (bool, int, np.bool_)) and value == a) for a in accepted)


def torch_option_refusal(key: str, value) -> str | None:
    """Why torch's option `key` cannot be `value` here (None when it asks for nothing missing)."""
    accepted, why = TORCH_OPTIONS[key]
    return None if _asks_nothing_missing(value, accepted) else f"{key}={value!r} is not supported: {why}"


def check_adamw_flags(*, amsgrad, foreach, fused, differentiable) -> None:
    """torch.optim.AdamW's flags: those asking for nothing PackedAdamW lacks are accepted."""
    for key, value in (("amsgrad", amsgrad), ("foreach", foreach), ("fused", fused),
                       ("differentiable", differentiable)):
        refusal = torch_option_refusal(key, value)
        if refusal:
            raise ValueError(refusal)


def check_group_options(group: dict, where: str, optimizer: str, options: dict, capturable: bool,
                        own_format_keys: tuple[str, ...] = ()) -> None:
    """The one check of what a parameter group may hold besides its hyperparameters, for every
    optimizer of the project, when a group is added and when a state_dict's groups are loaded:
    refuses, naming the group (`where`), the key and the option to use, a state-format key or
    step switch (`OPTIMIZER_OPTIONS`; `options` maps those of `optimizer` to its constructor's
    option) and a torch option set to what the project does not do (`TORCH_OPTIONS`). The keys
    of `own_format_keys` pass: a PackedMuonAdamW group's own state format, whose values its
    caller checks. torch's keys at their defaults pass (a group taken from torch.optim.AdamW
    holds capturable=False, accepted where the optimizer is not capturable either)."""
    for key, value in group.items():
        if key == "capturable" and isinstance(value, bool) and value == capturable:
            continue
        # `options` may name a format option of a rule outside the project (an ElementwiseOptimizer's format_keys)
        if (key in OPTIMIZER_OPTIONS or key in options) and key not in own_format_keys:
            option = options.get(key)
            if option is None:
                raise ValueError(f"{where} sets {key!r}: {optimizer} has no such option (it is another packed "
                                 "optimizer's state format or step switch), and a group sets none; remove it")
            if key not in _SWITCHES:
                listed = FORMAT_OPTIONS if key in FORMAT_OPTIONS else (*FORMAT_OPTIONS, key)
                raise ValueError(
                    f"{where} sets {key!r}: a group cannot have its own state format ({', '.join(listed)}); "
                    f"{optimizer} keeps one for all its groups. Pass it to the optimizer, {optimizer}(..., "
                    f"{option}=...), or step these parameters with an optimizer of their own (PackedMuonAdamW's "
                    "groups may each keep their own mode and biases)")
            switches = ", ".join(_SWITCHES)
            raise ValueError(
                f"{where} sets {key!r}: a group cannot have its own step switches ({switches}); {optimizer} keeps one "
                f"for all its groups. Pass it to the optimizer, {optimizer}(..., {option}=...), or step these "
                "parameters with an optimizer of their own")
        if key in TORCH_OPTIONS:
            refusal = torch_option_refusal(key, value)
            if refusal:
                raise ValueError(f"{where}: {refusal}")


def check_capturable(capturable, lr, *, check_nonfinite: bool, multi_tensor: bool,
                     optimizer: str = "PackedAdamW") -> None:
    if capturable not in (True, False):
        raise ValueError(f"capturable={capturable!r}: pass True or False")
    if capturable and (check_nonfinite or not multi_tensor):
        raise ValueError("capturable=True keeps every step on the GPU: it needs multi_tensor=True and "
                         "check_nonfinite=False (counting non-finite elements waits for the GPU)")
    if capturable and not (isinstance(lr, torch.Tensor) and lr.numel() == 1):
        raise ValueError(
            "capturable=True needs the learning rate as a one-element tensor on the parameters' device "
            f"({optimizer}(..., lr=torch.tensor(1e-3, device='cuda'), capturable=True)): a captured graph "
            "reads that tensor at every replay, and LR schedulers update it in place; a Python float lr "
            "would be frozen into the graph"
        )


def check_hyperparams(defaults: dict, rule, *, check_lr: bool) -> None:
    """The constructor's defaults (a capturable lr is checked on the device, at each step)."""
    check_maximize(defaults.get("maximize", False), "maximize")
    validate_rule_hyperparams(defaults, rule, check_lr=check_lr)


def check_track_format(value, fmt: StateFormat, capturable: bool, *, counts_refusals: bool = False) -> None:
    """`track_format`'s value for an optimizer of state format `fmt`. A rule that refuses whole
    matrices (`counts_refusals`: Muon, and PackedMuonAdamW, whose AdamW rule then counts only
    where its mode has codes) counts them in every mode; otherwise a mode without codes has
    nothing to count."""
    if not isinstance(value, bool):
        raise TypeError(f"track_format={value!r}: pass True or False")
    if value and not has_format_counts(fmt) and not counts_refusals:
        raise ValueError("track_format=True counts where packed or fp16 codes saturate, flush or go subnormal; "
                         "fp32 mode stores float32 moments: use mode='packed' or 'fp16'")
    if value and capturable:
        raise ValueError("track_format=True with capturable=True: a captured step's replays are not counted "
                         "on the host; count with an eager optimizer (capturable=False)")


# ---- FP32 masters ---------------------------------------------------------------------------
def checked_masters(params: list, masters: list, names: list[str], states) -> list[torch.Tensor]:
    """`load_master_weights`' checks: one float32 master per parameter, of its shape and layout,
    finite, and for a bfloat16 parameter with a finite bf16 weight (|M| <= SPLIT_MASTER_MAX)
    beside a low half laid out as the step writes it. Returns the masters' local tensors."""
    if len(masters) != len(params):
        raise ValueError(f"load_master_weights: got {len(masters)} tensors for {len(params)} parameters; pass "
                         "one FP32 tensor per parameter, in parameter order (as master_weights() returns them)")
    locals_ = []
    for p, m, name in zip(params, masters, names):
        where = f"load_master_weights: the master for {name}"
        if not isinstance(m, torch.Tensor) or m.dtype is not FLOAT32 or tuple(m.shape) != tuple(p.shape):
            got = (m.dtype, tuple(m.shape)) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{where} should be a float32 tensor of shape {tuple(p.shape)}, got {got}")
        layout = lambda t: (t.device_mesh, tuple(t.placements)) if _dtensor.is_dtensor(t) else None  # noqa: E731
        if layout(m) != layout(p):
            raise ValueError(f"{where} is {_dtensor.describe(m)} but the parameter is {_dtensor.describe(p)}; pass "
                             "masters laid out like the parameters (distribute_tensor(t, p.device_mesh, "
                             "p.placements) for a sharded one)")
        if p.dtype is not BFLOAT16:
            bad = nonfinite_count(m)  # a DTensor's count is over every rank: all refuse together
            if bad:
                raise ValueError(f"{where} has {bad} of {m.numel()} values that are NaN or Inf: a weight "
                                 "must be finite (no step would ever change such an element); repair those "
                                 "weights first")
        else:
            outside = outside_split_domain(m)  # a DTensor's count is over every rank: all refuse together
            if outside:
                raise ValueError(
                    f"{where} has {outside} of {m.numel()} values with no finite bf16 weight (NaN, Inf, or "
                    f"a magnitude above codecs.SPLIT_MASTER_MAX = {formats.SPLIT_MASTER_MAX:.6g}): "
                    "a bfloat16 parameter cannot hold them; clip or repair those weights, or keep the parameter "
                    "float32"
                )
            state = states.get(p)
            if state:
                check_live_low_half(p, _dtensor.local(p), state, name)
        locals_.append(_dtensor.local(m))
    return locals_


def type_signature(value):
    """What a cached validity verdict must also match besides equal values: each value's type
    (and a tensor's dtype and device), element by element in tuples and lists (betas)."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(type_signature(v) for v in value))
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, value.device.type, value.dim())
    return type(value)
