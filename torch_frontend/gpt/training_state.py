"""The entire training state of a packed-document run in one file, `state_stepNNNNNN.safetensors`,
and its export to the reference layout (update-direction moments).

Tensors (safetensors: no pickle, nothing executes on load):

    params/<name>/w                the live weight, as the model holds it (bf16 when the run has
                                   bf16 weights, else float32)
    params/<name>/mantissa         uint16, bf16 weights only: the low 16 bits of the FP32 master
                                   (the optimizer's int16 low half `lo`, viewed as uint16; FORMAT.md,
                                   "Split masters": lo's bits are the master's low 16 bits, and the
                                   weight is the master rounded to nearest, so master = join(w, lo),
                                   not (w << 16) | mantissa)
    params/<name>/opt/<key>        the optimizer's other state tensors of that parameter, as its
                                   state_dict gives them (PackedMuon: momentum_code int16 /
                                   momentum_buffer; PackedAdamW: words uint32 / moments float32)
    buffers/<name>                 the model's persistent buffers
    rng/torch_cpu, rng/cuda/<d>    torch generator states (uint8)
    batch/inputs, batch/targets,   the next unconsumed batch (the loader's `peek()`), so a reload
    batch/cu_seqlens               sees exactly the batch training would see next
    schedule/<table>               the run's schedule tables (float64, schedules.TABLE_NAMES)

Metadata (JSON strings): `format`, `step` (optimizer steps taken), `t_step` (the schedule row
the next step reads), `config` (the full run configuration, compared on load), `schedule`
(the ScheduleConfig), `code` (below), `loader` (the cursor), `optimizer` (class, each rule's
state format by its key in the optimizer's `rules` (a PackedMuonAdamW has one per kind and
state format), param_groups, per-parameter names, kinds, rule keys, state keys and non-tensor
state such as AdamW's step counts), and `sha256` over every tensor and every other metadata
entry. A state written before entries named their rule (one format per kind) reads as before.

The code: `code_identity()` records the SHA-256 of each Python source file that decides a
run's trajectory (the packages that train, packed_adamw.core, .torch, .tokenizer, less the files
named in NOT_TRAJECTORY_CODE: the walkthrough, the learned-position trainer, logging and tape
building), one hash over them all, and the git commit (and whether the work tree had changes)
when git can tell. Benchmarks and tools/ lie outside these packages. The sources themselves are
not stored: the per-file hashes say which files differ on load, the commit says where to find
them, and the state stays the size of the run's tensors. Load refuses a state written by other
code (listing the files that differ) unless `allow_code_change=True` (chat_train's
`--allow-code-change`); it always refuses another configuration, listing the fields that differ.

Writes are atomic (core/atomic_file.py, through checkpoint.py's helpers): a crash leaves the
previous file as it was. The export never writes over the state it reads (whatever the spelling
of the path: a symlink, '..'), replaces another existing file only with `overwrite=True`, and
refuses a state whose weights, masters or moments hold NaN or Inf, naming the tensors, before
anything is written; `load_state` refuses such a state before anything changes (`check_finite`
is that check, for the other readers too, such as the walkthrough).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from packed_adamw.core import __version__ as CODE_VERSION
from packed_adamw.core import codecs
from packed_adamw.core.rules import rule_formats, step_moments

from .checkpoint import CheckpointError, _atomic_save, _checkpoint_sha256, _torch_save_contents, config_differences
from .packed_data import PackedBatch
from .schedules import ScheduleTables

STATE_FORMAT = "packed-adamw-training-state/1"
EXPORT_FORMAT = "packed-adamw-reference-export/1"
LOW_HALF_KEY = codecs.LOW_HALF_KEY  # the optimizer's state entry stored as `mantissa`
CODE_PACKAGES = ("packed_adamw.core", "packed_adamw.torch", "packed_adamw.tokenizer")
# Files of CODE_PACKAGES that do not decide a training trajectory, so that editing them does not
# refuse every saved state. Everything else counts, new files included (core, the optimizers, the
# model, attention, packed data, schedules, the distributed set-up, this file, chat_train and its
# command line (chat_cli.py), loop.py (the loop both trainers run: which step runs with which
# batch, and when the run stops), tape.py, optimizers.py: its TorchMuonAdamW is chat_train's
# reference).
NOT_TRAJECTORY_CODE = {
    **{f"packed_adamw.torch/gpt/{name}.py": "explains a saved step; no trainer runs it"
       for name in ("walkthrough", "walkthrough_muon", "walkthrough_report")},
    "packed_adamw.torch/gpt/telemetry.py": "writes and trims log records",
    "packed_adamw.torch/gpt/run_directory.py": "locks and guards the run directory and its writes; decides no step",
    "packed_adamw.torch/gpt/checkpoint.py": "the learned-position trainer's checkpoints; the file helpers "
                                            "this module borrows read back checked",
    **{f"packed_adamw.torch/gpt/{name}.py": "the learned-position trainer"
       for name in ("train", "cli", "config", "run_identity", "data", "model", "families")},
    **{f"packed_adamw.tokenizer/{name}.py": "builds corpora, tokenizers and tapes; a run reads a finished tape, "
                                            "named in its config by the header's hash"
       for name in ("corpus", "large_corpus", "train_tokenizer")},
}
BATCH_KEYS = PackedBatch._fields


class TrainingStateError(CheckpointError):
    """A training state that cannot be used: unreadable, corrupted, or of another config or code."""


def state_file_name(step: int) -> str:
    return f"state_step{step:06d}.safetensors"


# ---- the code ----------------------------------------------------------------------------------
def code_identity(packages=CODE_PACKAGES, excluded=NOT_TRAJECTORY_CODE) -> dict:
    """{"sha256", "files": {name: sha256}, "git_commit", "git_dirty", "version"} of the packages'
    Python sources that decide a trajectory (all but `excluded`; module docstring)."""
    import importlib

    files, roots = {}, []
    for package in packages:
        root = Path(importlib.import_module(package).__file__).parent
        roots.append(root)
        for path in sorted(root.rglob("*.py")):
            name = f"{package}/{path.relative_to(root).as_posix()}"
            if name not in excluded:
                files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    commit, dirty = _git_state(roots)
    return {"sha256": digest, "files": files, "git_commit": commit, "git_dirty": dirty, "version": CODE_VERSION}


def _git_state(roots: list[Path]) -> tuple[str | None, bool | None]:
    """(commit, whether the packages' files differ from it), or (None, None) outside a checkout."""
    try:
        run = lambda *args: subprocess.run(["git", *args], cwd=roots[0], capture_output=True, text=True,  # noqa: E731
                                           timeout=10, check=True).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--", *map(str, roots)))
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def code_differences(saved: dict, current: dict, excluded=NOT_TRAJECTORY_CODE) -> list[str]:
    """One line per trajectory source file added, removed or changed between the saved code and
    this (files in `excluded` are passed over on both sides, so a state that recorded them, or
    code that records them, compares by the rest)."""
    a, b = ({k: v for k, v in side.get("files", {}).items() if k not in excluded} for side in (saved, current))
    lines = [f"{name}: {'only in the state' if name not in b else 'only in this code' if name not in a else 'changed'}"
             for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]
    if not a and not b and saved.get("sha256") != current.get("sha256"):  # no per-file hashes to compare
        lines.append(f"code hash {saved.get('sha256')} vs {current.get('sha256')}")
    return lines


# ---- saving ------------------------------------------------------------------------------------
def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its (first) name; tied parameters are one entry."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def optimizer_rules(optimizer) -> dict:
    """{key: rule optimizer}: a PackedMuonAdamW's `rules` (one per kind and state format: "muon"
    and "adamw" for its constructor's formats, "<kind>:<identity>" for a group's own), or a
    PackedMuon / PackedAdamW as its one rule, keyed by its kind. PackedMuon declares
    `rule_name = "muon"` (the attribute _muon_portable reads); the other packed rule,
    PackedAdamW, declares none."""
    if hasattr(optimizer, "rules"):
        return optimizer.rules
    if not hasattr(optimizer, "state_format"):
        raise TypeError(f"training_state stores the packed optimizers (PackedMuonAdamW, PackedMuon, PackedAdamW), "
                        f"not a {type(optimizer).__name__}")
    return {getattr(optimizer, "rule_name", "adamw"): optimizer}


def _optimizer_params(optimizer) -> list[tuple[torch.nn.Parameter, str, str]]:
    """(parameter, kind, the key of its rule in `_formats`) in state_dict index order."""
    rules = optimizer_rules(optimizer)
    if len(rules) == 1 and not hasattr(optimizer, "rule_key"):  # a single rule: its groups carry no kind
        (only,) = rules
        return [(p, only, only) for group in optimizer.param_groups for p in group["params"]]
    return [(p, group["kind"], optimizer.rule_key(group)) for group in optimizer.param_groups for p in group["params"]]


def _formats(optimizer) -> dict:
    """{rule key: the rule's state format fields}, for decoding the saved moments (each entry
    names its rule's key; a state written before groups had formats of their own names none,
    and its kind is the key)."""
    return {key: dataclasses.asdict(rule.state_format) for key, rule in optimizer_rules(optimizer).items()}


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        raise TypeError("training_state: a param group holds a tensor (a capturable lr?); the state file writes "
                        "hyperparameters as JSON: build the optimizer with float hyperparameters")
    return value


def _own(t: torch.Tensor) -> torch.Tensor:
    """A CPU contiguous tensor owning its storage (safetensors refuses tensors sharing one)."""
    t = t.detach().cpu().contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to write, each owning a storage no other of them shares: safetensors refuses
    two names over one storage (an FP32 weight and its master, which is the weight itself)."""
    owned, storages = {}, set()
    for key, t in tensors.items():
        t = _own(t)
        if t.nbytes and t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        owned[key] = t
    return owned


def save_state(path, *, model: torch.nn.Module, optimizer, loader, schedule: ScheduleTables, config: dict,
               step: int, t_step: int, code: dict | None = None) -> Path:
    """Write the entire training state to `path` atomically (layout: module docstring); returns
    the path. `loader`: a PackedDocumentLoader (its cursor and `peek()` are saved); `code`:
    `code_identity()` by default."""
    path = Path(path)
    names = _parameter_names(model)
    tensors, entries = {}, {}
    state_dict = optimizer.state_dict()
    params = _optimizer_params(optimizer)
    for index, (p, kind, rule) in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"save_state: optimizer parameter {index} is not a parameter of the model; "
                             "save the model the optimizer steps")
        name = names[id(p)]
        entry = state_dict["state"].get(index, {})
        tensor_keys = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor))
        entries[str(index)] = {"name": name, "kind": kind, "rule": rule, "tensors": tensor_keys,
                               "scalars": {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}}
        for key in tensor_keys:
            if key == LOW_HALF_KEY:
                tensors[f"params/{name}/mantissa"] = _own(entry[key]).view(torch.uint16)
            else:
                tensors[f"params/{name}/opt/{key}"] = _own(entry[key])
        if p.dtype == torch.bfloat16 and LOW_HALF_KEY not in entry:  # never stepped: the master is w
            tensors[f"params/{name}/mantissa"] = torch.zeros(p.shape, dtype=torch.uint16)
    for name, p in model.named_parameters():
        tensors[f"params/{name}/w"] = _own(p)
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in names:  # a persistent buffer (a tied parameter's other name is the parameter)
            tensors[f"buffers/{name}"] = _own(t)
    tensors["rng/torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        for device, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{device}"] = rng
    batch = loader.peek()
    for key in BATCH_KEYS:
        tensors[f"batch/{key}"] = _own(getattr(batch, key))
    tensors.update(schedule.to_tensors())
    tensors = _owned(tensors)
    metadata = {
        "format": STATE_FORMAT,
        "step": int(step),
        "t_step": int(t_step),
        "config": config,
        "schedule": schedule.config.to_dict(),
        "code": code if code is not None else code_identity(),
        "loader": loader.state_dict(),
        "optimizer": {
            "class": type(optimizer).__name__,
            "formats": _formats(optimizer),
            "param_groups": _jsonable(state_dict["param_groups"]),
            "extra": {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")},
            "entries": entries,
        },
    }
    metadata["sha256"] = _checkpoint_sha256(tensors, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save(tensors, {key: json.dumps(value) for key, value in metadata.items()}, path)
    return path


# ---- reading -----------------------------------------------------------------------------------
def read_state(path, expected_format: str = STATE_FORMAT) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on CPU, decoded metadata) of a state file, checked: its format and checksum."""
    path = Path(path)
    if not path.is_file():
        raise TrainingStateError(f"training state {path} does not exist" if not path.exists() else
                                 f"training state {path} is not a file; pass a {state_file_name(0)}-style file")
    pickled = _torch_save_contents(path)
    if pickled is not None:
        raise TrainingStateError(f"{path} appears to be {pickled}, not a training state; this project reads only "
                                 "safetensors states (a pickle can run code on load): pass a state_stepNNNNNN."
                                 "safetensors written by save_state")
    hint = "it is truncated or corrupted; use an older state or start a new run"
    try:
        with safe_open(path, framework="pt") as f:
            raw = f.metadata() or {}
            found = raw.get("format")
            if found != json.dumps(expected_format):
                raise TrainingStateError(f"{path} is a safetensors file of format {found!r}, not a training state "
                                         f"({expected_format!r}); pass a file written by save_state")
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = {key: json.loads(value) for key, value in raw.items()}
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, TrainingStateError):
            raise
        raise TrainingStateError(f"cannot read training state {path}: {error}; {hint}") from error
    if _checkpoint_sha256(tensors, metadata) != metadata.get("sha256"):
        raise TrainingStateError(f"training state {path} fails its checksum: {hint}")
    return tensors, metadata


@dataclasses.dataclass
class LoadedState:
    step: int
    t_step: int
    batch: PackedBatch  # the next unconsumed batch, as saved (equal to the restored loader's peek())
    schedule: ScheduleTables
    config: dict
    code: dict
    metadata: dict


def param_group_from_json(group: dict) -> dict:
    """A saved param group as the optimizer's state_dict gave it: JSON made its tuples (betas,
    ns_coefficients) lists; they become tuples again, nested ones too. "params" and
    "param_names" are lists in a state_dict and stay lists."""
    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    return {k: (v if k in ("params", "param_names") else tuples(v)) for k, v in group.items()}


def _optimizer_state_dict(tensors: dict, meta: dict) -> dict:
    groups = [param_group_from_json(group) for group in meta["param_groups"]]
    state = {}
    for index, entry in meta["entries"].items():
        if not entry["tensors"] and not entry["scalars"]:
            continue
        name, values = entry["name"], dict(entry["scalars"])
        for key in entry["tensors"]:
            values[key] = (tensors[f"params/{name}/mantissa"].view(torch.int16) if key == LOW_HALF_KEY
                           else tensors[f"params/{name}/opt/{key}"])
        state[int(index)] = values
    return {"state": state, "param_groups": groups, **meta["extra"]}


def load_state(path, *, model: torch.nn.Module, optimizer, loader, config: dict,
               schedule: ScheduleTables | None = None, code: dict | None = None,
               allow_code_change: bool = False) -> LoadedState:
    """Restore model, optimizer, loader cursor and RNG from a state file; returns the step
    counters, the saved next batch and the run's schedule tables (as saved).

    Refused, before anything changes, with the differences listed: another `config` (compared
    as JSON gives it back: a tuple equals its list); other trajectory code (`code`, default
    `code_identity()`) unless `allow_code_change` (then a warning); other schedule tables than
    `schedule` (when given); a loader whose restored cursor would not give the saved next batch
    bit for bit (another tape or packing); a model whose parameters or persistent buffers are
    not the saved ones' names, dtypes and shapes; weights, FP32 masters or decoded moments holding
    NaN or Inf (`check_finite`, naming the tensors); what the optimizer's load_state_dict refuses
    (formats, layouts, a non-finite momentum), as a TrainingStateError naming the file. CUDA
    generator states are restored for the devices visible here (a warning when the state holds
    more)."""
    path = Path(path)
    tensors, metadata = read_state(path)
    differences = config_differences(*(_as_json(c, path) for c in (metadata["config"], config)))
    if differences:
        raise TrainingStateError(f"training state {path} belongs to another configuration:\n  "
                                 + "\n  ".join(differences) + "\nrun with the state's configuration, or start anew")
    current_code = code if code is not None else code_identity()
    code_changes = code_differences(metadata["code"], current_code)
    if code_changes:
        message = (f"training state {path} was written by other code (commit {metadata['code'].get('git_commit')}, "
                   f"this is {current_code.get('git_commit')}):\n  " + "\n  ".join(code_changes))
        if not allow_code_change:
            raise TrainingStateError(message + "\nrun the code that wrote it, or pass --allow-code-change to continue "
                                     "with this code (the continuation may differ; from Python: "
                                     "allow_code_change=True)")
        warnings.warn(message + "\ncontinuing with this code (allow_code_change)", stacklevel=2)
    saved_schedule = ScheduleTables.from_tensors(metadata["schedule"], tensors)
    if schedule is not None:
        changed = saved_schedule.differences(schedule)
        if changed or saved_schedule.config != schedule.config:
            raise TrainingStateError(f"training state {path} has other schedule tables: "
                                     + "; ".join(changed or ["its ScheduleConfig differs"]))
    # A non-finite weight, master or moment would turn the run into NaN (or freeze a matrix):
    # refused naming the tensors, as the export and the walkthrough refuse them.
    check_finite(path, tensors, metadata, "resume an earlier state of the run (one written before its weights or "
                 "moments became non-finite), or start anew")
    batch = PackedBatch(*(tensors[f"batch/{key}"] for key in BATCH_KEYS))
    _check_loader(path, loader, metadata["loader"], batch)
    _check_model(path, model, tensors)
    cuda_states = _cuda_rng_states(path, tensors)

    model_state = {}
    names = {id(p): name for name, p in model.named_parameters()}  # first names, as saved
    for key, value in model.state_dict(keep_vars=True).items():
        model_state[key] = tensors[f"params/{names[id(value)]}/w"] if id(value) in names else tensors[f"buffers/{key}"]
    optimizer_state = _optimizer_state_dict(tensors, metadata["optimizer"])
    # The optimizer checks formats, layouts and values (PackedMuon: a non-finite momentum) before
    # it changes anything; the model's tensors and the generator states were checked above, so
    # nothing after this load can refuse.
    load_optimizer_state(path, optimizer, optimizer_state)
    model.load_state_dict(model_state)
    loader.load_state_dict(metadata["loader"])
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    return LoadedState(metadata["step"], metadata["t_step"], batch, saved_schedule, metadata["config"],
                       metadata["code"], metadata)


def load_optimizer_state(path, optimizer, optimizer_state: dict) -> None:
    """`optimizer.load_state_dict`, its refusal (which names the parameter) naming the file too."""
    try:
        optimizer.load_state_dict(optimizer_state)
    except TrainingStateError:
        raise
    except ValueError as error:
        raise TrainingStateError(f"training state {path}: {error}") from error


def _as_json(config: dict, path: Path):
    """The config as JSON gives it back (tuples become lists), so that the saved config, which
    went through JSON, and the live one compare by value."""
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as error:
        raise TrainingStateError(f"training state {path}: the run's config is not JSON ({error}); pass a config of "
                                 "dicts, lists, strings, numbers and None, as save_state wrote") from None


def _cuda_rng_states(path: Path, tensors: dict) -> list[torch.Tensor]:
    """The saved CUDA generator states to restore: none without CUDA here (a CPU continuation of a
    GPU run). Where fewer devices are visible than the state holds states (a run of 8 GPUs resumed
    on 2), those of the visible devices, with a warning: a state saves every visible device's
    generator, and the trainers draw no CUDA random numbers after the seeded initialisation."""
    states = [tensors[f"rng/cuda/{d}"] for d in range(sum(key.startswith("rng/cuda/") for key in tensors))]
    if not states or not torch.cuda.is_available():
        return []
    visible = torch.cuda.device_count()
    if len(states) > visible:
        warnings.warn(f"training state {path} holds the CUDA generator states of {len(states)} devices, this "
                      f"process sees {visible}: restoring those of devices 0 to {visible - 1} only", stacklevel=3)
    return states[:visible]


def _check_loader(path: Path, loader, state: dict, batch: PackedBatch) -> None:
    """The saved cursor, in this loader, must give the saved next batch; the loader is left as it was."""
    before = loader.state_dict()
    loader.load_state_dict(state)
    try:
        peeked = loader.peek()
    finally:
        loader.load_state_dict(before)
    for key, saved, ours in zip(BATCH_KEYS, batch, peeked):
        if saved.dtype != ours.dtype or saved.shape != ours.shape or not torch.equal(saved, ours):
            raise TrainingStateError(f"training state {path}: the loader's restored cursor gives another batch "
                                     f"than the saved next batch ({key} differs); the tape or the packing changed")


def _check_model(path: Path, model: torch.nn.Module, tensors: dict) -> None:
    """Every parameter and persistent buffer of the model is in the state with its dtype and
    shape, and the state holds no other (so model.load_state_dict cannot refuse after the
    optimizer's state is loaded)."""
    problems = []
    parameters = dict(model.named_parameters())  # first names of tied parameters, as saved
    ids = {id(p) for p in parameters.values()}
    buffers = {name: t for name, t in model.state_dict(keep_vars=True).items() if id(t) not in ids}
    for prefix, suffix, ours in (("params/", "/w", parameters), ("buffers/", "", buffers)):
        kind = "parameter" if prefix == "params/" else "buffer"
        for name, t in ours.items():
            saved = tensors.get(f"{prefix}{name}{suffix}")
            if saved is None:
                problems.append(f"{kind} {name}: not in the state")
            elif saved.dtype != t.dtype or saved.shape != t.shape:
                problems.append(f"{kind} {name}: saved {saved.dtype} {tuple(saved.shape)}, the model has {t.dtype} "
                                f"{tuple(t.shape)}")
        saved_names = {key[len(prefix):len(key) - len(suffix)] for key in tensors
                       if key.startswith(prefix) and key.endswith(suffix)}
        problems += [f"{kind} {name}: in the state, not in the model" for name in sorted(saved_names - ours.keys())]
    if problems:
        raise TrainingStateError(f"training state {path} does not fit this model:\n  " + "\n  ".join(problems)
                                 + "\nbuild the model the run that wrote it trained")


# ---- the reference layout ----------------------------------------------------------------------
SIGN_CONVENTION = (
    "first_mntm holds update directions: the negated loss-gradient moment (this project's optimizers "
    "store the moment of the loss gradient and apply w - lr * f(m); the reference seeds the backward "
    "with (onehot - probs) and applies w + update, so its first_mntm = -m). scnd_mntm (AdamW only) is "
    "the second moment v, sign-free. Zeros are +0.")


def _decoded_moments(entry: dict, tensors: dict, formats: dict, shape) -> dict[str, np.ndarray]:
    """{"first_mntm", "scnd_mntm" (a rule with a second moment: AdamW)} of one parameter,
    float32, reference signs, in the state format of its rule (`formats[entry["rule"]]`; its
    kind's in a state written before entries named their rule), read through core's registry of
    rules (`core/rules.py`: the moments as the rule's step reads them)."""
    name, kind = entry["name"], entry["kind"]
    fields = formats[entry.get("rule", kind)]
    fmt = rule_formats(kind).state_format(**fields)
    if not [k for k in entry["tensors"] if k != LOW_HALF_KEY]:  # never stepped: zero moments
        moments = [np.zeros(shape, np.float32)] * (2 if len(fmt.rule.codes) > 1 else 1)
    else:
        stored = tensors[f"params/{name}/opt/{fmt.state_key}"]
        # numpy takes no uint32 tensor: words as their int32 bits, which the registry reads as words
        state = (stored.view(torch.int32) if stored.dtype == torch.uint32 else stored).numpy()
        exponent = None
        if fmt.exponent_entry is not None:
            key = f"params/{name}/opt/{fmt.exponent_entry.key}"
            if key in tensors:  # absent: a state saved before them, read with 0
                # core's one check of a stored exponent (its range, and the codes it scales)
                exponent = fmt.check_exponent(tensors[key].numpy(), key, codes=state)
        moments = step_moments(state, fmt, exponent)
    names = ("first_mntm", "scnd_mntm")
    return {names[0]: (np.float32(0) - moments[0]).reshape(shape),
            **{names[1]: np.asarray(v, np.float32).reshape(shape) for v in moments[1:2]}}


def _reference_parameters(tensors: dict, optimizer_meta: dict):
    """Each parameter tensor of the export, from a state's tensors: (export key, tensor, the
    state's tensors it comes from), in the optimizer's order, then the weights it does not step."""
    covered = set()
    for entry in optimizer_meta["entries"].values():
        name = entry["name"]
        covered.add(name)
        w_key = f"params/{name}/w"
        w = tensors[w_key]
        yield w_key, w, w_key
        if w.dtype == torch.bfloat16:
            mantissa_key = f"params/{name}/mantissa"
            mantissa = tensors[mantissa_key]
            yield mantissa_key, mantissa, mantissa_key
            master = codecs.read_master(w.view(torch.int16).numpy(), mantissa.view(torch.int16).numpy())
            master_source = f"{w_key} with {mantissa_key} (its FP32 master)"
        else:
            master, master_source = w.float().numpy(), w_key
        yield f"params/{name}/master", torch.from_numpy(np.ascontiguousarray(master, np.float32)), master_source
        stored = [f"params/{name}/opt/{k}" for k in entry["tensors"] if k != LOW_HALF_KEY]
        moment_source = stored[0] if stored else f"params/{name} (never stepped: zero moments)"
        for key, array in _decoded_moments(entry, tensors, optimizer_meta["formats"], tuple(w.shape)).items():
            yield f"params/{name}/{key}", torch.from_numpy(np.ascontiguousarray(array, np.float32)), moment_source
    for key, t in tensors.items():  # parameters the optimizer does not step: weights only
        if key.startswith("params/") and key.endswith("/w") and key[len("params/"):-len("/w")] not in covered:
            yield key, t, key


def _refuse_nonfinite(path, parameters, remedy: str) -> None:
    """TrainingStateError naming each state tensor behind `parameters` ((key, tensor, source) as
    _reference_parameters gives them) that holds NaN or Inf, with `remedy`."""
    lines, named = [], set()
    for key, t, source in parameters:
        if source in named or not t.is_floating_point():
            continue
        # NaN and Inf reach the min or the max: one pass, many times quicker than isfinite (a d12
        # state holds 1.1 G values, which resuming it checks)
        if t.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            continue
        bad = t.numel() - int(torch.isfinite(t).sum())
        if bad:
            named.add(source)
            parameter = key[len("params/"):key.rindex("/")]  # params/<name>/<what>
            lines.append(f"{source}: {bad} of {t.numel()} values are NaN or Inf (parameter {parameter!r})")
    if lines:
        raise TrainingStateError(f"training state {path} holds NaN or Inf:\n  " + "\n  ".join(lines) + f"\n{remedy}")


def check_finite(path, tensors: dict, metadata: dict, remedy: str) -> None:
    """Refuse (TrainingStateError naming each tensor) a state whose weights, FP32 masters or
    decoded optimizer moments hold NaN or Inf, or whose stored Muon exponent no step stores;
    `remedy` says what to do instead."""
    _refuse_nonfinite(path, _checked_parameters(path, tensors, metadata, remedy), remedy)


def _checked_parameters(path, tensors: dict, metadata: dict, remedy: str):
    """_reference_parameters one tensor at a time (a d12 state's decoded moments are gigabytes),
    a stored exponent that core's check refuses turned into a TrainingStateError naming the file."""
    try:
        yield from _reference_parameters(tensors, metadata["optimizer"])
    except ValueError as error:  # a damaged exponent, named by core's check
        raise TrainingStateError(f"training state {path}: {error}; {remedy}") from None


def _check_export_path(state_path: Path, out_path: Path, overwrite: bool) -> None:
    """The export never replaces the state it reads (under any spelling of its path), replaces
    another existing file only when asked (`overwrite`, a bool: a string such as "no" is not a
    no), and goes where a file can be made."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"export_reference_layout: overwrite must be True or False, got {overwrite!r}")
    if not out_path.exists():
        existing = out_path.absolute().parent
        while not existing.exists() and not existing.is_symlink():
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(f"export_reference_layout: the output {out_path} lies under {existing}, which is "
                                     "not a directory; pass a path in a directory")
        return
    if state_path.exists() and os.path.samefile(state_path, out_path):
        raise ValueError(f"export_reference_layout: the output {out_path} is the training state it exports "
                         f"({state_path}); writing the export there would lose the state, which can no longer be "
                         "resumed: pass another output path")
    if out_path.is_dir():
        raise IsADirectoryError(f"export_reference_layout: the output {out_path} is a directory; pass a file path "
                                "such as export_stepNNNNNN.safetensors")
    if not overwrite:
        raise FileExistsError(f"export_reference_layout: {out_path} exists; pass another output path, or "
                              "overwrite=True to replace it")


def export_reference_layout(state_path, out_path, *, overwrite: bool = False) -> Path:
    """Write a state's parameters and decoded moments in the reference's layout and signs to
    `out_path` (safetensors, atomically); returns it.

        params/<name>/w            the live weight, as stored
        params/<name>/mantissa     uint16, bf16 weights: the low 16 bits of the FP32 master
        params/<name>/master       float32: the FP32 master (join of w and mantissa; w itself for
                                   an FP32 weight). Our w is the master rounded to nearest bf16,
                                   so (w << 16) | mantissa is NOT the master when mantissa >= 0x8000
        params/<name>/first_mntm   float32: -(first moment) (AdamW's m, Muon's momentum buffer), decoded
        params/<name>/scnd_mntm    float32: AdamW's second moment v = rms * rms (Muon has none)
        batch/inputs, batch/targets, batch/cu_seqlens, rng/..., schedule/...   copied

    Metadata: format, step, t_step, config, code, sign_convention (SIGN_CONVENTION), sha256 (as
    in a state: `read_state(out_path, EXPORT_FORMAT)` reads it back checked). A parameter
    the optimizer never stepped has zero moments.

    Refused before anything is written: an `out_path` that is the state itself (also through
    a symlink or another spelling of the path; ValueError, whatever `overwrite` says); an
    existing `out_path` unless `overwrite=True` (FileExistsError; `overwrite` other than a bool:
    TypeError); an `out_path` under a file (NotADirectoryError); a state whose weights, masters
    or moments hold NaN or Inf (TrainingStateError naming the state's tensors)."""
    state_path, out_path = Path(state_path), Path(out_path)
    _check_export_path(state_path, out_path, overwrite)
    tensors, metadata = read_state(state_path)
    remedy = ("nothing was written; export an earlier state of the run (one before its weights or moments became "
              "non-finite)")
    parameters = list(_checked_parameters(state_path, tensors, metadata, remedy))
    _refuse_nonfinite(state_path, parameters, remedy)
    out = {key: t for key, t in tensors.items() if key.startswith(("batch/", "rng/", "schedule/"))}
    out.update((key, t) for key, t, _ in parameters)
    out = _owned(out)
    export_metadata = {"format": EXPORT_FORMAT, "step": metadata["step"], "t_step": metadata["t_step"],
                       "config": metadata["config"], "code": metadata["code"], "sign_convention": SIGN_CONVENTION}
    export_metadata["sha256"] = _checkpoint_sha256(out, export_metadata)  # read_state(out, EXPORT_FORMAT) checks it
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save(out, {key: json.dumps(value) for key, value in export_metadata.items()}, out_path)
    return out_path
