"""Reading the optimizer state out of the four kinds of files packed-adamw writes.

- a trainer checkpoint (`torch_frontend/gpt/checkpoint.py`): safetensors with JSON metadata,
  read with `read_checkpoint` (its checksum is verified); it also holds the model weights;
- a training state of chat_train (`torch_frontend/gpt/training_state.py`,
  `state_stepNNNNNN.safetensors`), read with `read_state` (its checksum is verified); it holds
  the weights and their low halves too;
- a torch optimizer state file, `torch.save(opt.state_dict(), path)`, read with
  `torch.load(weights_only=True)`;
- a `PortableState` safetensors file (`core/portable.py`).

A run directory stands for its file: train.py's `checkpoint.safetensors`, or the newest of
chat_train's states (`StateFile.chosen` says which, and names the others).

torch is imported only for the first three. Each tensor's rule and format come from the
format identity the file records for it (its param group's, the state_dict's, the
PortableState's per tensor), looked up in core's registry of rules (`core/rules.py`), so a
state of several rules (PackedMuonAdamW) reads tensor by tensor, and no rule is named here.
A state of `torch.optim.AdamW` (exp_avg, exp_avg_sq) or `torch.optim.Muon` (momentum_buffer)
records no identity: each group is read as the fp32 mode of the rule whose hyperparameters it
holds, so its statistics can choose biases; it cannot be explained step by step.

A format that scales each matrix by a power of two (Muon's packed mode: `mu_exponent`, int32,
one per matrix) has its exponents read beside the codes: a torch state's and a trainer
checkpoint's entry, a training state's `params/<name>/opt/mu_exponent`, a PortableState's
`exponents`. A state saved before the exponents (its legacy identity) has none: its codes read
with exponent 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packed_adamw.core.codecs import read_master
from packed_adamw.core.format_health import encoded_values
from packed_adamw.core.portable import MIXED
from packed_adamw.core.rule import StateLayout
from packed_adamw.core.rules import RULES, code_values, state_format_from_identity

TORCH_ADAMW = "torch.optim.AdamW"  # `identity` of a torch.optim.AdamW state (no packed-adamw format)
TORCH_MUON = "torch.optim.Muon"  # ... and of torch.optim.Muon's
# torch's own optimizers, read as the fp32 mode of a rule: its float32 state under their keys
# (torch.optim.Muon's momentum_buffer is Muon's fp32 entry; AdamW's exp_avg and exp_avg_sq stack
# into fp32 mode's [2, *shape] moments)
TORCH_OPTIMIZERS = {TORCH_ADAMW: "adamw", TORCH_MUON: "muon"}
# Where a saved param group records its rule's format identity (torch_frontend/_persistence.py's
# GROUP_FORMAT_KEY, spelled here so that PortableState files read without torch)
GROUP_FORMAT_KEY = "packed_adamw_format"


class InspectError(ValueError):
    """A file that is not one of the four kinds, or a request the file cannot answer."""


@dataclass
class TensorState:
    """The state of one parameter tensor, in optimizer order."""

    index: int  # position in the optimizer's parameter order
    name: str  # the parameter's name when the file has one, else "#<index>"
    key: str  # where the state sits in the file
    step: int | None  # the step count stored with it (steps taken); None where the rule keeps none (Muon)
    # the state entry as its rule stores it: AdamW's uint32 words (packed, fp16) or float32 [2, *shape]
    # (m, v); Muon's uint16 momentum codes (packed, bf16) or float32 momenta
    moments: np.ndarray
    group: int | None = None  # index of its param group, when the file has groups
    # the parameter's values as float32, when the file holds the model: a bf16 weight with a low
    # half is its split FP32 master (the value the step reads), one without is the widened weight
    param: np.ndarray | None = None
    fmt: StateLayout | None = None  # its state format, of its rule (core/rules.py)
    identity: str | None = None  # the identity recorded for it (TORCH_ADAMW / TORCH_MUON: torch's own)
    # format counts saved with its state (entries named by its rule's `count_names`), if any
    format_counts: dict | None = None
    # a format scaled per matrix (Muon packed): each matrix's exponent s (int32, shaped like the
    # parameter's leading axes; () for one matrix), the values being codes times 2**s; None for
    # other formats and for a state saved before the exponents (read with s = 0)
    exponent: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        leading = len(self.fmt.state_entry.leading) if self.fmt is not None else int(self.moments.dtype == np.float32)
        return tuple(self.moments.shape[leading:])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def rule(self) -> str:
        return self.fmt.rule.name


@dataclass
class StateFile:
    path: Path
    kind: str  # "trainer checkpoint", "training state", "torch state_dict", "portable state"
    identity: str  # the format identity every tensor shares (or TORCH_ADAMW / TORCH_MUON), MIXED when they differ
    tensors: list[TensorState]
    groups: list[dict] = field(default_factory=list)  # per param group: its rule and hyperparameters
    trainer_step: int | None = None
    weights: str | None = None  # where `TensorState.param` comes from, for messages (None: no weights)
    chosen: str | None = None  # for a run directory given as PATH: which of its files was read, and why

    @property
    def state_format(self) -> StateLayout:
        """The one format of the file's tensors; a torch optimizer's state reads as its rule's fp32."""
        if self.identity == MIXED:
            found = ", ".join(dict.fromkeys(t.identity for t in self.tensors))
            raise InspectError(f"{self.path} holds tensors of several formats ({found}): each tensor's is its `fmt`")
        return _format_of(self.identity, self.path)

    def values(self, tensor: TensorState) -> tuple[np.ndarray, ...]:
        """Each code's values of one tensor (its rule's `codes` order: AdamW's m and RMS, Muon's
        momenta, codes times each matrix's 2**exponent) as float32 arrays shaped like the parameter."""
        return code_values(tensor.moments, tensor.fmt, tensor.exponent)

    def window_values(self, tensor: TensorState, packed: StateLayout, values=None) -> tuple[np.ndarray, ...]:
        """Each code's values as its window classifies them: stored codes' own values (relative
        to each matrix's exponent where the format scales per matrix), or values kept wider as
        the packed format `packed` would encode them (`format_health.encoded_values`: Muon's
        scaled by the exponent its step would choose). `values`: `values(tensor)`, if at hand."""
        if tensor.fmt.formats is not None:
            if tensor.exponent is None and values is not None:
                return values
            return code_values(tensor.moments, tensor.fmt)
        return tuple(encoded_values(x, packed) for x in (self.values(tensor) if values is None else values))

    def sections(self, tensors: list[TensorState] | None = None) -> list[tuple[str, list[TensorState]]]:
        """(identity, its tensors) for each format among `tensors` (default: all), in file order."""
        by_identity = {}
        for tensor in self.tensors if tensors is None else tensors:
            by_identity.setdefault(tensor.identity, []).append(tensor)
        return list(by_identity.items())

    def find(self, name: str) -> TensorState:
        """A tensor by parameter name, by "#<index>" or "<index>", or by its key in the file."""
        for tensor in self.tensors:
            if name in (tensor.name, tensor.key, f"#{tensor.index}", str(tensor.index)):
                return tensor
        listed = ", ".join(t.name for t in self.tensors[:8]) + (" ..." if len(self.tensors) > 8 else "")
        raise InspectError(f"{self.path} has no tensor {name!r}; it has {len(self.tensors)}: {listed}")


def load_state_file(path) -> StateFile:
    path = Path(path)
    chosen = None
    if path.is_dir():
        path, chosen = _run_directory_file(path)
    if not path.is_file():
        raise InspectError(f"{path} does not exist")
    state_file = _read_state_file(path)
    state_file.chosen = chosen
    return state_file


STATES_LISTED = 6  # of a chat_train run directory's older states, in the note saying which was read


def _run_directory_file(directory: Path) -> tuple[Path, str | None]:
    """The file to read in a run directory: train.py's checkpoint, or the newest of chat_train's
    state_stepNNNNNN.safetensors (with a note naming it and the others). The trainers' own
    names and listing (chat_train's `states_in`, which its resume and refusals use) decide."""
    try:
        from packed_adamw.torch.gpt.chat_train import states_in
        from packed_adamw.torch.gpt.checkpoint import CHECKPOINT_NAME
    except ImportError as error:
        raise InspectError(f"{directory} is a directory: reading a run directory's checkpoint or training states "
                           f"needs torch ({error})") from error
    checkpoint, states = directory / CHECKPOINT_NAME, states_in(directory)
    if checkpoint.is_file() and states:
        raise InspectError(f"{directory} holds both a trainer checkpoint ({CHECKPOINT_NAME}) and {len(states)} "
                           f"chat_train training states (the newest {states[-1].name}): pass the file to read")
    if checkpoint.is_file():
        return checkpoint, None
    if not states:
        raise InspectError(f"{directory} is a directory with neither a {CHECKPOINT_NAME} (train.py's run directory) "
                           "nor a state_stepNNNNNN.safetensors (chat_train's); sharded checkpoint directories are "
                           "not read. Pass a trainer checkpoint, a training state, a torch optimizer state file or a "
                           "PortableState file")
    newest, older = states[-1], [state.name for state in reversed(states[:-1])]
    if not older:
        return newest, f"{newest.name}, the one training state in {directory}"
    listed = ", ".join(older[:STATES_LISTED]) + (f" and {len(older) - STATES_LISTED} more"
                                                  if len(older) > STATES_LISTED else "")
    return newest, (f"{newest.name}, the newest of {len(states)} training states in {directory}; pass another "
                    f"to read it instead: {listed}")


def _read_state_file(path: Path) -> StateFile:
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
    if isinstance(file_format, str) and file_format.startswith("packed-adamw-training-state/"):
        return _training_state(path)
    raise InspectError(f"{path} is a safetensors file but neither a trainer checkpoint, a training state nor a "
                       f"PortableState (metadata format {file_format!r})")


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


def _format_of(identity: str, path) -> StateLayout:
    """The state format a recorded identity names (torch's own optimizers: their rule's fp32)."""
    if identity in TORCH_OPTIMIZERS:
        return RULES[TORCH_OPTIMIZERS[identity]].state_format("fp32")
    try:
        return state_format_from_identity(identity)
    except ValueError as error:
        raise InspectError(f"{path}: {error}") from None


def _stored_entry(array: np.ndarray, fmt: StateLayout, key: str) -> np.ndarray:
    """A state entry as its format lays it out: integer codes saved as a view of another
    integer type of their width (torch's int32 words, int16 codes) read as the same bits."""
    expected = np.dtype(fmt.state_dtype)
    if array.dtype != expected:
        if array.dtype.kind in "iu" and expected.kind in "iu" and array.dtype.itemsize == expected.itemsize:
            array = array.view(expected)
        else:
            raise InspectError(f"state entry {key!r} is {array.dtype}, expected {expected} (format {fmt.identity})")
    leading = fmt.state_entry.leading
    if tuple(array.shape[:len(leading)]) != leading:
        raise InspectError(f"state entry {key!r} has shape {array.shape}, expected {leading} before the parameter's "
                           f"axes (format {fmt.identity})")
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


def _stored_exponent(exponent, fmt: StateLayout, identity: str, moments: np.ndarray, where: str) -> np.ndarray | None:
    """A tensor's per-matrix exponents as its file holds them (`where`: their place in it, and the
    tensor), or None for a format that keeps none or a state saved before them
    (`saved_without_exponents`: read with exponent 0). Refused: one missing beside packed codes,
    or present where the format keeps none, or one no step stores (core's check,
    `StateFormat.check_exponent`: not the int32 of each matrix, or outside `exponent_range`). One
    under which a code decodes past float32's range is read: its NaN and Inf are reported."""
    entry = getattr(fmt, "exponent_entry", None)
    if entry is None or fmt.saved_without_exponents(identity):
        if exponent is not None:
            raise InspectError(f"{where}: {identity} keeps no per-matrix exponent, yet the file holds one; the file "
                               "was edited or damaged")
        return None
    leading = tuple(moments.shape[len(fmt.state_entry.leading):])[:-2]
    if exponent is None:
        raise InspectError(f"{where} is missing: {identity} keeps each matrix's momentum as its codes times "
                           f"2**{entry.key}, one per matrix; the file was edited or damaged")
    try:
        return fmt.check_exponent(np.asarray(exponent), where, shape=leading, remedy="the file was edited or damaged")
    except ValueError as error:
        raise InspectError(str(error)) from None


def _plain(x):
    return float(x.item() if hasattr(x, "item") else x)


def _group_hyperparameters(group: dict, fmt: StateLayout) -> dict:
    """A saved group's rule and hyperparameter row (its `hyperparam_fields`, through its rule's
    `group_row`), and maximize; a group missing one of its rule's keys gives the rule alone."""
    rule = fmt.rule
    try:
        row = rule.group_row(*(group[key] for key in rule.group_keys), number=_plain)
    except (KeyError, TypeError, ValueError):
        return {"rule": rule.name}
    return {"rule": rule.name, **dict(zip(rule.hyperparam_fields, row)), "maximize": bool(group.get("maximize", False))}


def _plain_step(step) -> int | None:
    return None if step is None else int(step.item() if hasattr(step, "item") else step)


def _saved_counts(entry: dict, fmt: StateLayout) -> dict | None:
    """Format counts saved in a parameter's state: its entries named by the rule's count names
    (`Rule.count_names`: saturated_mu, ...), as numbers or one-element tensors."""
    found = {name: int(np.asarray(entry[name])) for name in fmt.rule.count_names if name in entry}
    return found or None


def _group_identities(path, meta, param_groups: list, fallback: str | None = None) -> list[str]:
    """Each saved group's format identity: its own record, else the state_dict's (one string,
    or one per group kind: PackedMuonAdamW's), else `fallback`; a group with none is a torch
    optimizer's, named by the rule whose hyperparameters it holds."""
    top = meta.get("format") if isinstance(meta, dict) else None
    if meta and top is None:
        raise InspectError(f"{path}: the 'packed_adamw' entry has no format: {meta!r}")
    identities = []
    for index, group in enumerate(param_groups):
        identity = group.get(GROUP_FORMAT_KEY)
        if identity is None:
            identity = top.get(group.get("kind")) if isinstance(top, dict) else top
        identity = identity or fallback
        if identity is None:
            identity = next((name for name, rule in TORCH_OPTIMIZERS.items()
                             if set(RULES[rule].rule.group_keys) <= set(group)), None)
        if identity is None:
            raise InspectError(f"{path}: param group {index} records no format identity and holds the "
                               f"hyperparameters of no rule ({', '.join(sorted(group))})")
        identities.append(identity)
    return identities


def _from_optimizer_state(path, kind, identities: list[str], state: dict, param_groups: list,
                          params: dict | None, key_of, names: dict | None = None) -> StateFile:
    """Shared by torch state files, trainer checkpoints and training states: `state` maps a
    parameter index to its entries (numpy arrays, the step and other numbers), `param_groups`
    as saved, `identities` each group's format identity (`_group_identities`)."""
    formats = {identity: _format_of(identity, path) for identity in identities}
    groups, names, group_of = [], dict(names or {}), {}
    for g_index, (group, identity) in enumerate(zip(param_groups, identities)):
        groups.append(_group_hyperparameters(group, formats[identity]))
        group_names = group.get("param_names") or []
        for position, p_index in enumerate(group["params"]):
            group_of[p_index] = g_index
            if position < len(group_names):
                names.setdefault(p_index, group_names[position])
    tensors = []
    for p_index in sorted(state):
        entry = state[p_index]
        if p_index not in group_of:
            raise InspectError(f"{path}: state entry {p_index} belongs to no param group; the file is damaged")
        identity = identities[group_of[p_index]]
        fmt = formats[identity]
        if identity == TORCH_ADAMW:
            if "exp_avg" not in entry or "exp_avg_sq" not in entry:
                continue
            entry_key = "exp_avg"
            moments = np.stack([entry["exp_avg"].astype(np.float32), entry["exp_avg_sq"].astype(np.float32)])
        elif fmt.state_key in entry:
            entry_key = fmt.state_key
            moments = _stored_entry(entry[entry_key], fmt, entry_key)
        else:
            continue  # never stepped
        name = names.get(p_index, f"#{p_index}")
        param = params.get(name) if params else None
        if param is not None and fmt.low_half_key in entry:
            param = _split_master(param, entry[fmt.low_half_key])
        exponent_key = fmt.exponent_entry.key if getattr(fmt, "exponent_entry", None) is not None else None
        exponent_where = key_of(p_index, exponent_key or "exponent")
        exponent = _stored_exponent(entry.get(exponent_key) if exponent_key else None, fmt, identity, moments,
                                    exponent_where if name in exponent_where else f"{exponent_where} ({name})")
        tensors.append(TensorState(p_index, name, key_of(p_index, entry_key), _plain_step(entry.get("step")),
                                   moments, group_of[p_index], param, fmt, identity, _saved_counts(entry, fmt),
                                   exponent))
    found = list(dict.fromkeys(t.identity for t in tensors) or dict.fromkeys(identities))
    return StateFile(path, kind, found[0] if len(found) == 1 else MIXED, tensors, groups)


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
    identities = _group_identities(path, sd.get("packed_adamw"), sd["param_groups"])
    state = {int(i): {k: (_torch_numpy(v) if isinstance(v, torch.Tensor) and k != "step" else v)
                      for k, v in entry.items()} for i, entry in sd["state"].items()}
    return _from_optimizer_state(path, "torch state_dict", identities, state, sd["param_groups"], None,
                                 lambda i, key: f"state[{i}][{key!r}]")


def _trainer_checkpoint(path: Path) -> StateFile:
    from packed_adamw.torch.gpt.checkpoint import CheckpointError, read_checkpoint

    try:
        tensors, metadata = read_checkpoint(path)
    except CheckpointError as error:
        raise InspectError(str(error)) from error
    optimizer = metadata["optimizer"]
    identities = _group_identities(path, optimizer.get("packed_adamw"), optimizer["param_groups"],
                                   optimizer.get("format_identity"))
    state = {int(i): dict(entry) for i, entry in optimizer.get("scalar_state", {}).items()}
    for key, tensor in tensors.items():
        if key.startswith("optimizer/state/"):
            index, name = key.removeprefix("optimizer/state/").split("/")
            state.setdefault(int(index), {})[name] = tensor if name == "step" else _torch_numpy(tensor)
    params = {key.removeprefix("model/"): _torch_numpy(t) for key, t in tensors.items() if key.startswith("model/")}
    result = _from_optimizer_state(path, "trainer checkpoint", identities, state, optimizer["param_groups"], params,
                                   lambda i, key: f"optimizer/state/{i}/{key}")
    result.trainer_step = metadata.get("trainer", {}).get("step")
    result.weights = "the checkpoint's model weights"
    return result


def _training_state(path: Path) -> StateFile:
    """chat_train's state file: the optimizer's state_dict as training_state rebuilds it for a
    load (a bf16 weight's mantissa as its low half), each parameter named by its entry."""
    import torch

    from packed_adamw.torch.gpt.training_state import TrainingStateError, _optimizer_state_dict, read_state

    try:
        tensors, metadata = read_state(path)
        optimizer = metadata["optimizer"]
        sd = _optimizer_state_dict(tensors, optimizer)
        names = {int(index): entry["name"] for index, entry in optimizer["entries"].items()}
    except (TrainingStateError, KeyError) as error:
        raise InspectError(f"cannot read training state {path}: {error}") from error
    state = {int(i): {k: (_torch_numpy(v) if isinstance(v, torch.Tensor) and k != "step" else v)
                      for k, v in entry.items()} for i, entry in sd["state"].items()}
    params = {key[len("params/"):-len("/w")]: _torch_numpy(t) for key, t in tensors.items()
              if key.startswith("params/") and key.endswith("/w")}
    result = _from_optimizer_state(path, "training state", _group_identities(path, sd.get("packed_adamw"),
                                                                             sd["param_groups"]),
                                   state, sd["param_groups"], params, lambda i, key: f"params/{names[i]}/opt/{key}",
                                   names)
    result.trainer_step = metadata.get("step")
    result.weights = "the training state's model weights"
    return result


def _portable_file(path: Path) -> StateFile:
    from packed_adamw.core.portable import PortableState

    portable = PortableState.load(path)
    identities = portable.tensor_formats()
    formats = {identity: _format_of(identity, path) for identity in identities}
    tensors = []
    for i, (identity, count, moments) in enumerate(zip(identities, portable.counts, portable.moments)):
        key = f"moments.{i}"
        fmt = formats[identity]
        moments = _stored_entry(moments, fmt, key)
        saved = portable.exponents[i] if portable.exponents is not None and i < len(portable.exponents) else None
        exponent = _stored_exponent(saved, fmt, identity, moments, f"exponent.{i} ({key})")
        tensors.append(TensorState(i, key, key, _plain_step(count), moments, fmt=fmt, identity=identity,
                                   exponent=exponent))
    return StateFile(path, "portable state", portable.format, tensors)
