"""Reading the optimizer state out of the three kinds of files packed-adamw writes.

- a trainer checkpoint (`torch_frontend/gpt/checkpoint.py`): safetensors with JSON metadata,
  read with `read_checkpoint` (its checksum is verified); it also holds the model weights;
- a torch optimizer state file, `torch.save(opt.state_dict(), path)`, read with
  `torch.load(weights_only=True)`;
- a `PortableState` safetensors file (`core/portable.py`).

torch is imported only for the first two. A state of `torch.optim.AdamW` (exp_avg,
exp_avg_sq) reads as float32 moments too, so its statistics can choose biases; it has no
packed-adamw format identity and cannot be explained step by step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packed_adamw.core.format_health import moment_values, state_format_from_identity
from packed_adamw.core.adamw.state_format import StateFormat
from packed_adamw.core.codecs import read_master

TORCH_ADAMW = "torch.optim.AdamW"  # `identity` of a torch.optim.AdamW state (no packed-adamw format)


class InspectError(ValueError):
    """A file that is not one of the three kinds, or a request the file cannot answer."""


@dataclass
class TensorState:
    """The state of one parameter tensor, in optimizer order."""

    index: int  # position in the optimizer's parameter order
    name: str  # the parameter's name when the file has one, else "#<index>"
    key: str  # where the state sits in the file
    step: int  # the step count stored with it (steps taken)
    moments: np.ndarray  # uint32 words shaped like the parameter, or float32 [2, *shape] (m, v)
    group: int | None = None  # index of its param group, when the file has groups
    # the parameter's values as float32, when the file holds the model: a bf16 weight with a low
    # half is its split FP32 master (the value the step reads), one without is the widened weight
    param: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.moments.shape[1:]) if self.moments.dtype == np.float32 else tuple(self.moments.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class StateFile:
    path: Path
    kind: str  # "trainer checkpoint", "torch state_dict", "portable state"
    identity: str  # StateFormat.identity, or TORCH_ADAMW
    tensors: list[TensorState]
    groups: list[dict] = field(default_factory=list)  # hyperparameters per param group
    trainer_step: int | None = None

    @property
    def state_format(self) -> StateFormat:
        """The moments' format; a torch.optim.AdamW state reads as fp32."""
        return StateFormat("fp32") if self.identity == TORCH_ADAMW else state_format_from_identity(self.identity)

    def values(self, tensor: TensorState) -> tuple[np.ndarray, np.ndarray]:
        """(m, RMS) of one tensor as float32 arrays shaped like the parameter."""
        return moment_values(tensor.moments, self.state_format)

    def find(self, name: str) -> TensorState:
        """A tensor by parameter name, by "#<index>" or "<index>", or by its key in the file."""
        for tensor in self.tensors:
            if name in (tensor.name, tensor.key, f"#{tensor.index}", str(tensor.index)):
                return tensor
        listed = ", ".join(t.name for t in self.tensors[:8]) + (" ..." if len(self.tensors) > 8 else "")
        raise InspectError(f"{self.path} has no tensor {name!r}; it has {len(self.tensors)}: {listed}")


def load_state_file(path) -> StateFile:
    path = Path(path)
    if path.is_dir():
        candidate = path / "checkpoint.safetensors"
        if not candidate.is_file():
            raise InspectError(f"{path} is a directory without a checkpoint.safetensors (sharded checkpoint "
                               "directories are not read); pass a trainer checkpoint, a torch optimizer state "
                               "file or a PortableState file")
        path = candidate
    if not path.is_file():
        raise InspectError(f"{path} does not exist")
    metadata = _safetensors_metadata(path)
    if metadata is None:
        return _torch_state_file(path)
    if "counts" in metadata and "format" in metadata:
        return _portable_file(path)
    try:
        file_format = json.loads(metadata.get("format", "null"))
    except ValueError:
        file_format = metadata.get("format")
    if isinstance(file_format, str) and file_format.startswith("packed-adamw-gpt-checkpoint/"):
        return _trainer_checkpoint(path)
    raise InspectError(f"{path} is a safetensors file but neither a trainer checkpoint nor a PortableState "
                       f"(metadata format {file_format!r})")


def _safetensors_metadata(path: Path) -> dict | None:
    """The metadata of a safetensors file; None when the file is not safetensors."""
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":  # 8-byte header length, then the JSON header
        return None
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="numpy") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise InspectError(f"cannot read {path} as safetensors: {error}") from error


def _words_or_moments(array: np.ndarray, key: str) -> np.ndarray:
    if key == "words":
        if array.dtype == np.int32:  # int32 views of the words (pickled or sharded saves)
            array = array.view(np.uint32)
        if array.dtype != np.uint32:
            raise InspectError(f"state entry 'words' is {array.dtype}, expected uint32 words")
    elif array.dtype != np.float32:
        raise InspectError(f"state entry {key!r} is {array.dtype}, expected float32")
    return array


def _torch_numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy; bf16 (which numpy lacks) widened to float32, exactly."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.uint32:
        return tensor.contiguous().view(torch.int32).numpy().view(np.uint32).copy()
    if tensor.dtype == torch.bfloat16:
        return tensor.float().contiguous().numpy()
    return tensor.contiguous().numpy().copy()


def _split_master(weight: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The FP32 master a bf16 weight (widened to float32) and its int16 low half stand for."""
    weight_bits = (np.ascontiguousarray(weight, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return read_master(weight_bits, _low_half(lo))


def _low_half(lo: np.ndarray) -> np.ndarray:
    if lo.dtype != np.int16:
        raise InspectError(f"state entry 'lo' is {lo.dtype}, expected the int16 low halves of split masters")
    return lo


def _group_hyperparameters(group: dict) -> dict:
    def plain(x):
        return float(x.item() if hasattr(x, "item") else x)

    b1, b2 = group["betas"]
    return {"lr": plain(group["lr"]), "b1": plain(b1), "b2": plain(b2), "eps": plain(group["eps"]),
            "weight_decay": plain(group["weight_decay"]), "maximize": bool(group.get("maximize", False))}


def _plain_step(step) -> int:
    return int(step.item() if hasattr(step, "item") else step)


def _from_optimizer_state(path, kind, identity, state: dict, param_groups: list, params: dict | None,
                          key_of) -> StateFile:
    """Shared by torch state files and trainer checkpoints: `state` maps a parameter index to
    its entries (numpy arrays and the step), `param_groups` as saved."""
    groups, names, group_of = [], {}, {}
    for g_index, group in enumerate(param_groups):
        groups.append(_group_hyperparameters(group))
        group_names = group.get("param_names") or []
        for position, p_index in enumerate(group["params"]):
            group_of[p_index] = g_index
            if position < len(group_names):
                names[p_index] = group_names[position]
    tensors = []
    for p_index in sorted(state):
        entry = state[p_index]
        if "words" in entry or "moments" in entry:
            entry_key = "words" if "words" in entry else "moments"
            moments = _words_or_moments(entry[entry_key], entry_key)
        elif "exp_avg" in entry and "exp_avg_sq" in entry:
            entry_key = "exp_avg"
            moments = np.stack([entry["exp_avg"].astype(np.float32), entry["exp_avg_sq"].astype(np.float32)])
        else:
            continue
        name = names.get(p_index, f"#{p_index}")
        param = params.get(name) if params else None
        if param is not None and "lo" in entry:
            param = _split_master(param, entry["lo"])
        tensors.append(TensorState(p_index, name, key_of(p_index, entry_key), _plain_step(entry.get("step", 0)),
                                   moments, group_of.get(p_index), param))
    return StateFile(path, kind, identity, tensors, groups)


def _torch_state_file(path: Path) -> StateFile:
    try:
        import torch
    except ImportError:
        raise InspectError(f"{path} is not safetensors; reading a torch state file needs torch") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file that is not its own
        raise InspectError(f"{path} is neither safetensors nor a torch file that torch.load(weights_only=True) "
                           f"reads: {type(error).__name__}: {error}") from error
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise InspectError(f"{path} is a torch file but not an optimizer state_dict (no 'state' and 'param_groups')")
    identity = _identity(sd.get("packed_adamw"), sd["param_groups"], path)
    state = {int(i): {k: (_torch_numpy(v) if isinstance(v, torch.Tensor) and k != "step" else v)
                      for k, v in entry.items()} for i, entry in sd["state"].items()}
    return _from_optimizer_state(path, "torch state_dict", identity, state, sd["param_groups"], None,
                                 lambda i, key: f"state[{i}][{key!r}]")


def _identity(meta, param_groups, path) -> str:
    if isinstance(meta, dict) and "format" in meta:
        return meta["format"]
    found = {g.get("packed_adamw_format") for g in param_groups}
    if len(found) == 1 and None not in found:
        return found.pop()
    if not meta:
        return TORCH_ADAMW
    raise InspectError(f"{path}: the 'packed_adamw' entry has no format: {meta!r}")


def _trainer_checkpoint(path: Path) -> StateFile:
    from packed_adamw.torch.gpt.checkpoint import CheckpointError, read_checkpoint

    try:
        tensors, metadata = read_checkpoint(path)
    except CheckpointError as error:
        raise InspectError(str(error)) from error
    optimizer = metadata["optimizer"]
    identity = optimizer.get("format_identity") or (optimizer.get("packed_adamw") or {}).get("format") or TORCH_ADAMW
    state = {int(i): dict(entry) for i, entry in optimizer.get("scalar_state", {}).items()}
    for key, tensor in tensors.items():
        if key.startswith("optimizer/state/"):
            index, name = key.removeprefix("optimizer/state/").split("/")
            state.setdefault(int(index), {})[name] = tensor if name == "step" else _torch_numpy(tensor)
    params = {key.removeprefix("model/"): _torch_numpy(t) for key, t in tensors.items() if key.startswith("model/")}
    result = _from_optimizer_state(path, "trainer checkpoint", identity, state, optimizer["param_groups"], params,
                                   lambda i, key: f"optimizer/state/{i}/{key}")
    result.trainer_step = metadata.get("trainer", {}).get("step")
    return result


def _portable_file(path: Path) -> StateFile:
    from packed_adamw.core.portable import PortableState

    portable = PortableState.load(path)
    tensors = []
    for i, (count, moments) in enumerate(zip(portable.counts, portable.moments)):
        key = f"moments.{i}"
        tensors.append(TensorState(i, key, key, int(count), _words_or_moments(
            moments, "moments" if moments.dtype == np.float32 else "words")))
    return StateFile(path, "portable state", portable.format, tensors)
