"""`PackedAdamW`: torch.optim.AdamW with one uint32 word of state per FP32 parameter."""
from __future__ import annotations

import numpy as np
import torch
from torch.optim import Optimizer

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat, validate_hyperparams
from packed_adamw.core.portable import PortableState

from packed_adamw.core.numpy_step import step_scalar_row

from .functional import StagingRing, adamw_step_, launch_step, launch_tables, new_state, scalar_table

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
        plan = self.__dict__.get("_plan")
        if plan is None or not self._planned_step(plan):
            self._plan = None  # a full step that raises must not leave an older plan behind
            self._plan = self._checked_step()
        return loss

    def _checked_step(self) -> "_StepPlan | None":
        """The full step: every check, state creation, then the update. Returns the plan that
        later steps reuse while nothing but gradients and hyperparameters changes."""
        # Check everything before changing anything: a step that raises leaves no trace.
        key, words_per_element = self._state_key, (2 if self.state_format.mode == "fp32" else 1)
        params, grads, found, rows, group_of = [], [], [], [], []
        device = None
        for group_index, group in enumerate(self.param_groups):
            row = self._checked_row(group, group_index)
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
            rows += [row] * (len(params) - first)
            group_of += [group_index] * (len(params) - first)
        states, counts = [], []
        for i, (p, state) in enumerate(zip(params, found)):
            if not state:
                state = found[i] = self.state[p]
                state["step"] = 0
                state[key] = new_state(p, self.state_format)
            state["step"] = count = state["step"] + 1
            states.append(state[key])
            counts.append(count)
        rejected = adamw_step_(params, grads, states, counts, rows, self.state_format, multi_tensor=self.multi_tensor,
                               count_nonfinite=self.check_nonfinite, check_inputs=False)  # checked above
        self._raise_if_rejected(params, rejected)
        return _StepPlan(self, params, found, states, group_of, device) if params else None

    def _planned_step(self, plan: "_StepPlan") -> bool:
        """The step of `_checked_step` at a fraction of its host cost, when the plan still
        holds: same parameters and storage, same state, gradients where they were. The checks
        the kernel's raw addresses need are still made every step. Returns False, having
        changed nothing, when the full step must run instead."""
        groups = self.param_groups
        if self.state is not plan.state or tuple(map(id, self.state.values())) != plan.state_ids:
            return False
        if (tuple(map(id, [p for group in groups for p in group["params"]])) != plan.param_ids
                or tuple(len(group["params"]) for group in groups) != plan.group_sizes):
            return False
        if any(p.grad is not None for p in plan.params_without_grad):
            return False
        key = self._state_key
        try:
            moments = [state[key] for state in plan.states]
            counts = [state["step"] + 1 for state in plan.states]
        except (KeyError, TypeError):
            return False
        if list(map(id, moments)) != plan.moment_ids:
            return False
        device, grads, grad_pointers = plan.device, [], []
        try:  # one pass, the cheapest checks first; a sparse gradient fails or raises
            for p, shape, address in zip(plan.params, plan.shapes, plan.param_pointers):
                g = p.grad
                if (g is None or g.dtype is not FLOAT32 or not g.is_contiguous() or g.shape != shape
                        or g.get_device() != device or _data_ptr(p) != address or p.dtype is not FLOAT32
                        or not p.is_contiguous()):
                    return False
                grads.append(g)
                grad_pointers.append(_data_ptr(g))
        except (RuntimeError, NotImplementedError):
            return False
        rows = [self._checked_row(group, index) for index, group in enumerate(groups)]
        if device >= 0 and self.multi_tensor:  # derived before anything changes: a bad count raises here
            if counts.count(counts[0]) == len(counts):  # one row per group
                scalars = np.asarray([step_scalar_row(counts[0], row) for row in rows], dtype=np.float32)
                tables = plan.group_tables
            else:
                scalars, scalar_rows = scalar_table(counts, [rows[i] for i in plan.group_of])
                tables = launch_tables(plan.numels, scalar_rows, plan.torch_device)
        for state, count in zip(plan.states, counts):
            state["step"] = count
        if device < 0 or not self.multi_tensor:
            rejected = adamw_step_(plan.params, grads, plan.moments, counts, [rows[i] for i in plan.group_of],
                                   self.state_format, multi_tensor=self.multi_tensor,
                                   count_nonfinite=self.check_nonfinite, check_inputs=False)
        else:  # CUDA: only the gradients' addresses and the scalars are new
            n, staging = len(counts), plan.staging
            pointers = staging.stage(scalars)
            pointers[:n] = plan.param_pointer_array
            pointers[n:2 * n] = grad_pointers
            pointers[2 * n:] = plan.moment_pointers
            aligned = plan.aligned and not (pointers[n:2 * n] & 15).any()
            rejected = launch_step(staging.send(), plan.params, grads, plan.moments, tables, self.state_format,
                                   self.check_nonfinite, aligned, plan.compiled)
            staging.launched()
        self._raise_if_rejected(plan.params, rejected)
        return True

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
        return "moments" if self.state_format.mode == "fp32" else "words"

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
        expected = {"fp32": ("moments", torch.float32)}.get(self.state_format.mode, ("words", torch.uint32))
        for saved_id, p in zip(saved_params, our_params):
            entry = state_dict["state"].get(saved_id)
            if entry is None:
                continue
            key, dtype = expected
            tensor = entry.get(key)
            shape = (2, *p.shape) if key == "moments" else tuple(p.shape)
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


class _StepPlan:
    """What a step can reuse: which parameters step, their addresses, shapes and state.
    Rebuilt by a full step whenever any of it changes."""

    def __init__(self, opt: PackedAdamW, params: list, states: list[dict], moments: list, group_of: list[int],
                 device: int):
        everything = [p for group in opt.param_groups for p in group["params"]]
        with_grad = set(map(id, params))
        self.state, self.state_ids = opt.state, tuple(map(id, opt.state.values()))
        self.param_ids = tuple(map(id, everything))
        self.group_sizes = tuple(len(group["params"]) for group in opt.param_groups)
        self.params_without_grad = [p for p in everything if id(p) not in with_grad]
        self.params, self.states, self.moments = params, states, moments
        self.moment_ids = list(map(id, moments))
        self.shapes = [p.shape for p in params]
        self.param_pointers = list(map(_data_ptr, params))
        self.param_pointer_array = np.array(self.param_pointers, dtype=np.int64)
        self.moment_pointers = np.array(list(map(_data_ptr, moments)), dtype=np.int64)
        self.aligned = not any(address & 15 for address in (*self.param_pointers, *self.moment_pointers.tolist()))
        self.numels = tuple(p.numel() for p in params)
        self.group_of = tuple(group_of)
        self.device, self.torch_device = device, params[0].device
        self.compiled = {}  # launch_step keeps the compiled multi-tensor kernel here
        if device >= 0 and opt.multi_tensor:
            self.staging = StagingRing(len(params), max(len(params), len(opt.param_groups)), self.torch_device)
            self.group_tables = launch_tables(self.numels, self.group_of, self.torch_device)


_data_ptr = torch.Tensor.data_ptr


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
