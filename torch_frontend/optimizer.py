"""`PackedAdamW`: torch.optim.AdamW with one uint32 word of state per FP32 parameter."""
from __future__ import annotations

import numpy as np
import torch
from torch.optim import Optimizer

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat, validate_hyperparams
from packed_adamw.core.portable import PortableState

from ._plan import StepPlan
from .functional import adamw_step_, new_state, state_dtype

STATE_DICT_KEY = "packed_adamw"  # the format identity travels in the state_dict under this key
STATE_DICT_VERSION = 1
FLOAT32, STRIDED = torch.float32, torch.strided


class NonFiniteGradientError(FloatingPointError):
    """Some gradient elements were NaN or Inf; those elements were left unchanged."""


class PackedAdamW(Optimizer):
    """AdamW whose two moments share one uint32 word per parameter (docs/FORMAT.md).

    Arguments are torch.optim.AdamW's, plus `mode`: "packed" (E4M11 first moment + E4M12
    RMS, 4 bytes/parameter), or the comparison modes "fp16" (IEEE half in both halves of the
    word, 4 bytes) and "fp32" (two float32 moments, 8 bytes). `m_bias` and `rms_bias` set
    the packed formats' exponent biases; the saved state records them. On CUDA,
    `multi_tensor=True` updates all tensors in one kernel launch (same bits as one launch per
    tensor, which `multi_tensor=False` selects).

    Parameters must be float32, contiguous and on one device. A gradient element that is NaN
    or Inf is skipped: that element's parameter and state stay unchanged, so no NaN or Inf is
    ever stored. With `check_nonfinite=True` the optimizer also raises
    `NonFiniteGradientError` after such a step, naming the parameters (on CUDA this costs a
    reduction and a wait for the GPU each step). To skip whole steps instead, use
    `torch.amp.GradScaler` or `clip_grad_norm_(..., error_if_nonfinite=True)`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        mode: str = "packed",
        *,
        m_bias: int = DEFAULT_M_BIAS,
        rms_bias: int = DEFAULT_RMS_BIAS,
        multi_tensor: bool = True,
        check_nonfinite: bool = False,
    ):
        self.state_format = StateFormat(mode, m_bias, rms_bias)
        self.multi_tensor = multi_tensor
        self.check_nonfinite = check_nonfinite
        validate_hyperparams(float(lr) if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr,
                             betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict:
        # torch.optim keeps only defaults, state and param_groups; a copy needs the format too.
        return {**super().__getstate__(), "state_format": self.state_format, "multi_tensor": self.multi_tensor,
                "check_nonfinite": self.check_nonfinite}

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

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rows = [self._checked_row(group, index) for index, group in enumerate(self.param_groups)]
        plan = self.__dict__.get("_plan")
        rejected = plan.step(self, rows) if plan is not None else None
        if rejected is None:
            self._plan = None  # a full step that raises must not leave an older plan behind
            self._plan, params, rejected = self._full_step(rows)
        else:
            params = plan.params
        self._raise_if_rejected(params, rejected)
        return loss

    def _full_step(self, group_rows: list) -> tuple["StepPlan | None", list, list[int]]:
        """Every check, then the update, then the new state entries. Returns the plan that
        later steps reuse while nothing but gradients and hyperparameters changes, the
        stepped parameters and their rejected counts. A step that raises changes nothing."""
        fmt = self.state_format
        key, words_per_element = fmt.state_key, fmt.state_words_per_param
        params, grads, found, rows, group_of = [], [], [], [], []
        device = None
        for group_index, group in enumerate(self.param_groups):
            first = len(params)
            for param_index, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if not (  # what the kernel relies on; _raise_grad_error says which failed
                    g.dtype is FLOAT32 and p.dtype is FLOAT32 and g.layout is STRIDED and g.shape == p.shape
                    and g.is_contiguous() and p.is_contiguous() and g.get_device() == p.get_device()
                ):
                    _raise_grad_error(p, _param_name(group, group_index, param_index))
                if device is None:
                    device = p.get_device()  # an int (-1 for CPU): cheaper than torch.device objects
                elif p.get_device() != device:
                    _check_one_device([p, params[0]], "PackedAdamW.step")
                state = self.state.get(p)
                if state:
                    moments = state[key]
                    if moments.get_device() != device or moments.numel() != words_per_element * p.numel():
                        _raise_state_error(p, moments, _param_name(group, group_index, param_index))
                params.append(p)
                grads.append(g)
                found.append(state)
            rows += [group_rows[group_index]] * (len(params) - first)
            group_of += [group_index] * (len(params) - first)
        moments = [state[key] if state else new_state(p, fmt) for p, state in zip(params, found)]
        counts = [state["step"] + 1 if state else 1 for state in found]
        rejected = adamw_step_(params, grads, moments, counts, rows, fmt, multi_tensor=self.multi_tensor,
                               count_nonfinite=self.check_nonfinite, check_inputs=False)  # checked above
        states = []
        for p, state, tensor, count in zip(params, found, moments, counts):
            if not state:
                state = self.state[p]
                state[key] = tensor
            state["step"] = count
            states.append(state)
        plan = StepPlan(self, params, states, moments, group_of, device) if params else None
        return plan, params, rejected

    def _raise_if_rejected(self, params: list, rejected: list[int]) -> None:
        if not (self.check_nonfinite and any(rejected)):
            return
        counts_by_param = dict(zip(map(id, params), rejected))
        bad = [f"{_param_name(group, gi, pi)} ({counts_by_param[id(p)]} of {p.numel()} elements)"
               for gi, group in enumerate(self.param_groups) for pi, p in enumerate(group["params"])
               if counts_by_param.get(id(p))]
        raise NonFiniteGradientError(
            "PackedAdamW.step: non-finite values (NaN/Inf gradients, or a parameter or update that is not "
            "finite) in " + ", ".join(bad) + ". Those elements kept their parameter and state; the rest were "
            "updated. Find the source of the NaN/Inf, or use torch.amp.GradScaler / "
            "clip_grad_norm_(error_if_nonfinite=True) to skip such steps."
        )

    def _checked_row(self, group: dict, index: int) -> tuple[float, ...]:
        """The group's (lr, b1, b2, eps, weight_decay) as floats. Validity depends on the
        values alone, so rows already seen valid are not checked again (a scheduler changes lr)."""
        try:
            lr, (b1, b2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            row = (float(lr), float(b1), float(b2), float(eps), float(weight_decay))
        except (TypeError, ValueError, RuntimeError):
            row = None  # let the validation say what is wrong
        valid = self.__dict__.setdefault("_valid_rows", {})
        if row is None or row not in valid:
            _validate_hyperparams(group, index)
            if len(valid) > 64:
                valid.clear()
            valid[row] = True
        return row

    @property
    def _state_key(self) -> str:
        return self.state_format.state_key

    # ---- saving and loading -------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_DICT_KEY] = {"version": STATE_DICT_VERSION, "format": self.state_format.identity}
        return sd

    def export_state(self) -> PortableState:
        """The moments and step counts in parameter order, for `packed_adamw.jax.import_state`."""
        counts, moments = [], []
        for p in (p for g in self.param_groups for p in g["params"]):
            state = self.state.get(p) or {}
            counts.append(int(state["step"]) if state else 0)
            tensor = state[self._state_key] if state else new_state(p, self.state_format)
            moments.append(_to_numpy(tensor))
        return PortableState(self.state_format.identity, counts, moments)

    def import_state(self, portable: PortableState) -> None:
        """Replace the state with one exported from JAX (or torch); checks format and shapes."""
        self._plan = None
        params = [p for g in self.param_groups for p in g["params"]]
        portable.check(self.state_format, [tuple(p.shape) for p in params])
        for p, count, moments in zip(params, portable.counts, portable.moments):
            if count == 0:
                self.state.pop(p, None)
                continue
            tensor = torch.from_numpy(moments.view(np.int32) if moments.dtype == np.uint32 else moments.copy())
            if moments.dtype == np.uint32:
                tensor = tensor.clone().view(torch.uint32)
            self.state[p] = {"step": count, self._state_key: tensor.to(p.device)}

    def load_state_dict(self, state_dict: dict) -> None:
        meta = state_dict.get(STATE_DICT_KEY)
        if meta is None:
            raise ValueError(
                "load_state_dict: this state_dict was not saved by PackedAdamW (no 'packed_adamw' entry); "
                "start this optimizer fresh instead of loading another optimizer's state"
            )
        if meta["format"] != self.state_format.identity:
            raise ValueError(
                f"load_state_dict: the saved state has format {meta['format']!r} but this optimizer uses "
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
        key, dtype = fmt.state_key, state_dtype(fmt)
        for saved_id, p in zip(saved_params, our_params):
            entry = state_dict["state"].get(saved_id)
            if entry is None:
                continue
            tensor = entry.get(key)
            shape = fmt.state_shape(p.shape)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                got = None if tensor is None else (tensor.dtype, tuple(tensor.shape))
                raise ValueError(
                    f"load_state_dict: state of saved parameter {saved_id} should hold {key!r} {dtype} of shape "
                    f"{shape} (to match parameter of shape {tuple(p.shape)}), got {got}; the parameters or their "
                    "order differ from the saved run"
                )
        self._plan = None
        super().load_state_dict({k: v for k, v in state_dict.items() if k != STATE_DICT_KEY})
        # torch casts all non-step state to a floating parameter's dtype, which would turn the
        # words into float32 values: put the saved words back, bits unchanged.
        for saved_id, p in zip(saved_params, our_params):
            entry = state_dict["state"].get(saved_id)
            if entry is None:
                continue
            state = self.state[p]
            state["step"] = int(entry["step"])
            if self._state_key == "words":
                state["words"] = entry["words"].to(p.device, copy=True)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int32).numpy().view(np.uint32).copy() if t.dtype == torch.uint32 else t.numpy().copy()


def _check_one_device(params: list, where: str) -> None:
    devices = {p.device for p in params}
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


def _validate_hyperparams(group: dict, index: int) -> None:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"param_groups[{index}]['lr'] must be a number or a one-element tensor")
        lr = float(lr)
    try:
        validate_hyperparams(lr, group["betas"], group["eps"], group["weight_decay"])
    except ValueError as e:
        raise ValueError(f"param_groups[{index}]: {e}") from None


def _validate_group(group: dict, index: int) -> None:
    _validate_hyperparams(group, index)
    for param_index, p in enumerate(group["params"]):
        name = _param_name(group, index, param_index)
        if p.dtype != torch.float32:
            raise TypeError(
                f"{name} has dtype {p.dtype}: this release of PackedAdamW trains float32 parameters only; "
                "keep FP32 master weights (e.g. torch.autocast for lower-precision compute)"
            )
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous: pass a contiguous parameter (create it with .contiguous())")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {p.device}: PackedAdamW runs on CPU and CUDA devices")


def _raise_state_error(p: torch.Tensor, moments: torch.Tensor, name: str) -> None:
    if moments.device != p.device:
        raise ValueError(
            f"{name} is on {p.device} but its optimizer state is on {moments.device}: "
            "move the model before creating the optimizer, or save the state_dict and load it into "
            "a new optimizer (load_state_dict moves the state to the parameters' device)"
        )
    raise ValueError(
        f"{name} has shape {tuple(p.shape)} but its optimizer state has shape {tuple(moments.shape)}: the "
        "parameter was replaced after the optimizer stepped; build a new optimizer for the new parameter"
    )


def _raise_grad_error(p: torch.Tensor, name: str) -> None:
    g = p.grad
    if p.dtype != torch.float32 or not p.is_contiguous():  # changed after add_param_group
        raise TypeError(f"{name} is now {p.dtype}, contiguous={p.is_contiguous()}: PackedAdamW trains contiguous float32 parameters")
    if g.is_sparse:
        raise RuntimeError(f"{name} has a sparse gradient: PackedAdamW does not support sparse gradients (use dense ones)")
    if g.is_complex():
        raise TypeError(f"{name} has a complex gradient: PackedAdamW supports real float32 tensors only")
    if g.dtype != p.dtype:
        raise TypeError(f"{name}: gradient dtype {g.dtype} differs from the parameter's {p.dtype}; gradients must be float32")
    if g.shape != p.shape:
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from the parameter's {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{name}: gradient is on {g.device} but the parameter is on {p.device}")
    raise ValueError(f"{name}: gradient is not contiguous; make it contiguous before step() (g.contiguous())")
