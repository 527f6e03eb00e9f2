"""Training checkpoints: the whole state of a run in one `.safetensors` file.

Tensors are stored as tensors, with their own dtypes (PackedAdamW's uint32 words stay uint32):

    model/<name>                    model parameters
    optimizer/state/<i>/<key>       optimizer state tensors of parameter i (PackedAdamW's
                                    "words" / "moments"; torch AdamW's "step", "exp_avg", "exp_avg_sq")
    rng/torch_cpu, rng/cuda/<d>     random generator states

Everything else is JSON in the safetensors metadata: the run configuration, the trainer's
position (step), the tape cursor, the optimizer's param_groups, non-tensor state (PackedAdamW's
per-parameter step counts) and format identity, the code
version, and a SHA-256 over all tensor bytes that detects corruption. The file is written
through `packed_adamw.core.atomic_file` (temporary file, fsync, rename, fsync of the
directory), so a crash mid-write leaves the previous checkpoint intact. Loading uses
`safe_open` only: no pickle, nothing executes.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from packed_adamw.core import __version__ as CODE_VERSION
from packed_adamw.core.atomic_file import atomic_path

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "packed-adamw-gpt-checkpoint/2"  # 2: the checksum covers the metadata too


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, corrupted, or from another configuration."""


def save_training_state(path, *, model, optimizer, tape, config: dict, trainer: dict) -> None:
    """Write the run's complete state to `path` atomically."""
    tensors = {f"model/{name}": t for name, t in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    scalar_state = {}  # PackedAdamW keeps its step count as a Python int
    for index, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/state/{index}/{key}"] = value
            else:
                scalar_state.setdefault(str(index), {})[key] = value
    tensors["rng/torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{device}"] = state
    tensors = {key: t.detach().cpu().contiguous() for key, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "code_version": CODE_VERSION,
        "config": config,
        "trainer": trainer,
        "tape": tape.state_dict(),
        "optimizer": {
            "class": type(optimizer).__name__,
            "format_identity": getattr(getattr(optimizer, "state_format", None), "identity", None),
            # everything of the state_dict except the tensors: param_groups and PackedAdamW's identity entry
            **{key: value for key, value in optimizer_state.items() if key != "state"},
            "scalar_state": scalar_state,
        },
    }
    metadata["sha256"] = _checkpoint_sha256(tensors, metadata)
    _atomic_save(tensors, {key: json.dumps(value) for key, value in metadata.items()}, Path(path))


def _atomic_save(tensors: dict, metadata: dict, path: Path) -> None:
    with atomic_path(path) as tmp_path:
        save_file(tensors, tmp_path, metadata=metadata)


def _checkpoint_sha256(tensors: dict[str, torch.Tensor], metadata: dict) -> str:
    """Covers every tensor and every metadata entry (step, cursor, counts, config) but itself."""
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key]
        digest.update(f"{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
        # Hash raw bytes; numpy has no view for every torch dtype, so go through uint8.
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


FORMAT_FAMILY = FORMAT.rsplit("/", 1)[0] + "/"


def read_checkpoint(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on CPU, decoded metadata) of a checkpoint file, checked for corruption."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file; pass the file "
                              f"({path / CHECKPOINT_NAME} in a run directory the trainer wrote)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    hint = "it is truncated or corrupted; resume from an older copy or start a new run"
    try:
        with safe_open(path, framework="pt") as f:
            raw_metadata = f.metadata() or {}
            # The format first: a foreign file (another program's safetensors) is named as such,
            # not as damaged, and its tensors are not loaded.
            _check_format(path, raw_metadata.get("format"))
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = {key: json.loads(value) for key, value in raw_metadata.items()}
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"cannot read checkpoint {path}: {error}; {hint}") from error
    if _checkpoint_sha256(tensors, metadata) != metadata.get("sha256"):
        raise CheckpointError(f"checkpoint {path} fails its checksum: {hint}")
    return tensors, metadata


def _check_format(path: Path, raw_format: str | None) -> None:
    """Refuse a safetensors file that is not a trainer checkpoint of this format version."""
    try:
        found = json.loads(raw_format) if raw_format is not None else None
    except ValueError:
        found = raw_format  # e.g. {"format": "pt"} of a Hugging Face model file
    if found == FORMAT:
        return
    if isinstance(found, str) and found.startswith(FORMAT_FAMILY):
        raise CheckpointError(f"{path} is a packed-adamw trainer checkpoint of format {found!r}, this code "
                              f"reads {FORMAT!r}; resume it with the packed_adamw version that wrote it")
    raise CheckpointError(f"{path} is a safetensors file but not a packed-adamw trainer checkpoint "
                          f"(metadata format {found!r}, expected {FORMAT!r}); pass the "
                          f"{CHECKPOINT_NAME} the trainer wrote")


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """One line per field that differs, nested dicts flattened as `model.d_model`."""
    lines = []
    for key in sorted(saved.keys() | current.keys()):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"checkpoint was made with {prefix}{key}={a!r}, this run has {prefix}{key}={b!r}")
    return lines


def load_training_state(path, *, model, optimizer, tape, config: dict) -> dict:
    """Restore model, optimizer, tape cursor and RNG from `path`; returns the trainer entry.

    `config` holds the settings that determine the run's trajectory; every one must equal
    the checkpoint's, or CheckpointError lists those that differ.
    """
    tensors, metadata = read_checkpoint(path)
    differences = config_differences(metadata["config"], config)
    if differences:
        raise CheckpointError(
            f"checkpoint {path} belongs to another configuration:\n  " + "\n  ".join(differences)
            + "\nrerun with the checkpoint's settings, or train into a new --out directory"
        )
    if metadata["code_version"] != CODE_VERSION:
        warnings.warn(f"checkpoint {path} was written by packed_adamw {metadata['code_version']}, "
                      f"this is {CODE_VERSION}: the continuation may not match bit for bit")

    model.load_state_dict({key.removeprefix("model/"): t for key, t in tensors.items() if key.startswith("model/")})

    optimizer_state = dict(metadata["optimizer"])
    for key in ("class", "format_identity", "scalar_state"):
        optimizer_state.pop(key)
    for group in optimizer_state["param_groups"]:
        group["betas"] = tuple(group["betas"])  # JSON made the tuple a list
    optimizer_state["state"] = {int(index): dict(entry) for index, entry in metadata["optimizer"]["scalar_state"].items()}
    for key, t in tensors.items():
        if key.startswith("optimizer/state/"):
            index, name = key.removeprefix("optimizer/state/").split("/")
            optimizer_state["state"].setdefault(int(index), {})[name] = t
    optimizer.load_state_dict(optimizer_state)  # PackedAdamW keeps the uint32 words' bits

    tape.load_state_dict(metadata["tape"])
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda_states = [tensors[f"rng/cuda/{d}"] for d in range(sum(k.startswith("rng/cuda/") for k in tensors))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return metadata["trainer"]
