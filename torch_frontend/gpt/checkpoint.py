"""Training checkpoints: the whole state of a run in one `.safetensors` file.

Tensors are stored as tensors, with their own dtypes (PackedAdamW's uint32 words stay uint32):

    model/<name>                    model parameters (float32, or bf16 live weights)
    optimizer/state/<i>/<key>       optimizer state tensors of parameter i (PackedAdamW's
                                    "words" / "moments", and "lo", the int16 low half of a bf16
                                    parameter's FP32 master; torch AdamW's "step", "exp_avg",
                                    "exp_avg_sq")
    rng/torch_cpu, rng/cuda/<d>     random generator states

Everything else is JSON in the safetensors metadata: the run configuration, the trainer's
position (step), the tape cursor, the optimizer's param_groups, non-tensor state (PackedAdamW's
per-parameter step counts) and format identity, the code
version, and a SHA-256 over all tensor bytes that detects corruption. The file is written
through `packed_adamw.core.atomic_file` (temporary file, fsync, rename, fsync of the
directory), so a crash mid-write leaves the previous checkpoint intact. Loading uses
`safe_open` only: no pickle, nothing executes.

Distributed runs (docs/DISTRIBUTED.md):

- `--parallel ddp`: every rank holds the same model and optimizer state, so rank 0 writes
  this single file (`save_replicated_training_state`), with each rank's tape cursor and RNG
  state gathered into the metadata entry `ranks`; every rank loads the file and takes its
  own entry.
- `--parallel fsdp`: `save_sharded_training_state` writes a torch.distributed.checkpoint
  (DCP) directory: model and optimizer state sharded as the ranks hold them
  (`get_state_dict` / `set_state_dict`), plus `trainer.json` (configuration, step, every
  rank's cursor and RNG state, the SHA-256 of every file, and a checksum of its own). The
  directory is written under a temporary name, renamed, and only then published by
  atomically replacing the symbolic link `checkpoint.dcp`, so resume never sees a partial
  checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from packed_adamw.core import __version__ as CODE_VERSION
from packed_adamw.core.atomic_file import _fsync_directory, atomic_path, atomic_write

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "packed-adamw-gpt-checkpoint/2"  # 2: the checksum covers the metadata too
SHARDED_CHECKPOINT_NAME = "checkpoint.dcp"  # a symbolic link to the latest directory in SHARDED_VERSIONS
SHARDED_VERSIONS = "checkpoints"
SHARDED_FORMAT = "packed-adamw-gpt-sharded-checkpoint/1"
MANIFEST_NAME = "trainer.json"
# Keys of the run configuration that older checkpoints lack (written before distributed
# training, before --param-dtype), with the value those runs had.
CONFIG_DEFAULTS = {"parallel": "none", "world_size": 1, "param_dtype": "fp32"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, corrupted, or from another configuration."""


def save_training_state(path, *, model, optimizer, tape, config: dict, trainer: dict,
                        ranks: list[dict] | None = None) -> None:
    """Write the run's complete state to `path` atomically (`ranks`: every rank's `rank_state`
    in a DDP run, whose model and optimizer state is that of every rank)."""
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
    if ranks is not None:
        metadata["ranks"] = ranks
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
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        raise CheckpointError(f"checkpoint {path} is a sharded checkpoint directory of a --parallel fsdp run; "
                              "resume it with --parallel fsdp under torchrun with as many processes as wrote it")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file; pass the file "
                              f"({path / CHECKPOINT_NAME} in a run directory the trainer wrote)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    torch_file = _torch_save_contents(path)
    if torch_file is not None:
        raise CheckpointError(f"{path} appears to be {torch_file}, not a trainer checkpoint: a checkpoint is the "
                              f"{CHECKPOINT_NAME} the trainer writes into --out (model, optimizer, tape cursor and "
                              "RNG together); pass that file or its run directory")
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


def _torch_save_contents(path: Path) -> str | None:
    """What a file written by torch.save holds, in words; None for any other file.

    torch.save writes a zip archive around a pickle (older versions: the bare pickle). The
    pickle's opcodes are listed, never run, so the file may come from anywhere."""
    import pickletools
    import zipfile

    with path.open("rb") as f:
        head = f.read(9)
    # A safetensors file: an 8-byte little-endian header length, then the JSON header. Its first
    # byte is 0x80 for 1 in 256 header lengths, so a pickle's PROTO opcode alone does not tell.
    if head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= path.stat().st_size - 8:
        return None
    if head.startswith(b"\x80"):  # a pickle's PROTO opcode
        return "a pickle file (torch.save's legacy format, or another program's)"
    if head[:4] != b"PK\x03\x04" or not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        pickles = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == "data.pkl"]
        if not pickles:
            return None
        strings = set()
        try:
            for _, argument, _ in pickletools.genops(archive.read(pickles[0])):
                if isinstance(argument, str):
                    strings.add(argument)
        except (ValueError, zipfile.BadZipFile):
            pass  # a damaged pickle: what was read so far still tells the kind
    if {"state", "param_groups"} <= strings:
        return "an optimizer state_dict saved with torch.save (torch.save(optimizer.state_dict(), path))"
    return "a file saved with torch.save (a zip archive around a pickle)"


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


def saved_config(metadata: dict) -> dict:
    """The run configuration a checkpoint records (with the keys older checkpoints lack)."""
    return {**CONFIG_DEFAULTS, **metadata["config"]}


def _check_config_and_version(path, metadata: dict, config: dict) -> None:
    differences = config_differences(saved_config(metadata), config)
    if differences:
        raise CheckpointError(
            f"checkpoint {path} belongs to another configuration:\n  " + "\n  ".join(differences)
            + "\nrerun with the checkpoint's settings, or train into a new --out directory"
        )
    if metadata["code_version"] != CODE_VERSION:
        warnings.warn(f"checkpoint {path} was written by packed_adamw {metadata['code_version']}, "
                      f"this is {CODE_VERSION}: the continuation may not match bit for bit")


def load_training_state(path, *, model, optimizer, tape, config: dict, rank: int | None = None) -> dict:
    """Restore model, optimizer, tape cursor and RNG from `path`; returns the trainer entry.

    `config` holds the settings that determine the run's trajectory; every one must equal
    the checkpoint's, or CheckpointError lists those that differ. In a DDP run, `rank`
    selects this process's tape cursor and RNG state from the checkpoint's `ranks`.
    """
    tensors, metadata = read_checkpoint(path)
    _check_config_and_version(path, metadata, config)

    model.load_state_dict({key.removeprefix("model/"): t for key, t in tensors.items() if key.startswith("model/")})

    optimizer_state = dict(metadata["optimizer"])
    for key in ("class", "format_identity", "scalar_state"):
        optimizer_state.pop(key)
    for group in optimizer_state["param_groups"]:
        for key in ("betas", "ns_coefficients"):  # JSON made the tuples lists (Muon's groups have no betas)
            if key in group:
                group[key] = tuple(group[key])
    optimizer_state["state"] = {int(index): dict(entry) for index, entry in metadata["optimizer"]["scalar_state"].items()}
    for key, t in tensors.items():
        if key.startswith("optimizer/state/"):
            index, name = key.removeprefix("optimizer/state/").split("/")
            optimizer_state["state"].setdefault(int(index), {})[name] = t
    optimizer.load_state_dict(optimizer_state)  # PackedAdamW keeps the uint32 words' bits

    if "ranks" in metadata:
        restore_rank_state(_rank_entry(path, metadata["ranks"], rank), tape)
        return metadata["trainer"]
    tape.load_state_dict(metadata["tape"])
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda_states = [tensors[f"rng/cuda/{d}"] for d in range(sum(k.startswith("rng/cuda/") for k in tensors))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return metadata["trainer"]


# ---- distributed runs -------------------------------------------------------------------------

def rank_state(tape) -> dict:
    """What differs between the ranks of a run: the tape cursor and the RNG states (hex)."""
    cuda = torch.cuda.get_rng_state().numpy().tobytes().hex() if torch.cuda.is_initialized() else None
    return {"tape": tape.state_dict(), "rng": {"torch_cpu": torch.get_rng_state().numpy().tobytes().hex(),
                                               "cuda": cuda}}


def restore_rank_state(entry: dict, tape) -> None:
    tape.load_state_dict(entry["tape"])
    as_tensor = lambda text: torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(as_tensor(entry["rng"]["torch_cpu"]))
    if entry["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(entry["rng"]["cuda"]))


def _rank_entry(path, ranks: list[dict], rank: int | None) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None or len(ranks) != world:
        raise CheckpointError(f"checkpoint {path} was written by {len(ranks)} ranks; resume it under torchrun "
                              f"with --nproc_per_node={len(ranks)} (this is {world} process(es))")
    return ranks[rank]


def _gather(obj) -> list:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def save_replicated_training_state(path, *, model, optimizer, tape, config: dict, trainer: dict) -> None:
    """DDP (collective): rank 0 writes the single-file checkpoint with every rank's cursor and RNG."""
    import torch.distributed as dist

    ranks = _gather(rank_state(tape))
    if dist.get_rank() == 0:
        save_training_state(path, model=model, optimizer=optimizer, tape=tape, config=config, trainer=trainer,
                            ranks=ranks)
    dist.barrier()  # every rank returns once the checkpoint is in place


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_sha256(manifest: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "sha256"},
                                     sort_keys=True).encode()).hexdigest()


def _hash_files(directory: Path, names: list[str]) -> dict:
    """{name: {"bytes", "sha256"}} of the files in `directory`, hashed by the ranks in turn (collective)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: {"bytes": (directory / name).stat().st_size, "sha256": _file_sha256(directory / name)}
            for name in names[rank::world] if (directory / name).is_file()}
    return {name: entry for part in _gather(mine) for name, entry in part.items()}


def save_sharded_training_state(run_dir, *, model, optimizer, tape, config: dict, trainer: dict) -> Path:
    """FSDP (collective): write a DCP checkpoint directory and publish it as run_dir/checkpoint.dcp.

    1. every rank writes its shards with `dcp.save` into run_dir/checkpoints/.tmp-<name>;
    2. the ranks hash those files; rank 0 adds trainer.json (atomically, last);
    3. rank 0 renames the directory to run_dir/checkpoints/<name>, then replaces the link
       run_dir/checkpoint.dcp by one to it (os.replace: atomic), fsyncing each directory;
    4. rank 0 removes the other entries of run_dir/checkpoints (older checkpoints, and
       temporary directories that a crash left behind, which nothing ever points to).

    A crash before step 3 leaves checkpoint.dcp pointing at the previous complete checkpoint.
    Returns the published directory.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    versions = run_dir / SHARDED_VERSIONS
    name = [f"step-{trainer['step']:08d}-{secrets.token_hex(4)}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    name = name[0]
    tmp = versions / f".tmp-{name}"
    if rank == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(tmp))
    ranks = _gather(rank_state(tape))
    names = [sorted(p.name for p in tmp.iterdir()) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    files = _hash_files(tmp, names[0])
    if rank == 0:
        manifest = {
            "format": SHARDED_FORMAT,
            "code_version": CODE_VERSION,
            "config": config,
            "trainer": trainer,
            "world_size": world,
            "optimizer": {"class": type(optimizer).__name__,
                          "format_identity": getattr(getattr(optimizer, "state_format", None), "identity", None)},
            "ranks": ranks,
            "files": files,
        }
        manifest["sha256"] = _manifest_sha256(manifest)
        atomic_write(tmp / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
        final = versions / name
        os.rename(tmp, final)
        _fsync_directory(versions)
        link = run_dir / SHARDED_CHECKPOINT_NAME
        new_link = run_dir / f".{SHARDED_CHECKPOINT_NAME}.{name}.tmp"
        os.symlink(Path(SHARDED_VERSIONS) / name, new_link)
        os.replace(new_link, link)
        _fsync_directory(run_dir)
        for entry in versions.iterdir():
            if entry.name != name:
                shutil.rmtree(entry, ignore_errors=True)
    dist.barrier()  # every rank returns once the checkpoint is published
    return versions / name


def read_sharded_manifest(path) -> dict:
    """trainer.json of a sharded checkpoint directory, checked (format, checksum); the data
    files are checked by `load_sharded_training_state`."""
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a single-file checkpoint (of a run without --parallel fsdp); "
                              "resume it with the --parallel it was written with (none or ddp)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not manifest_path.is_file():
        what = ("a torch.distributed.checkpoint directory without " + MANIFEST_NAME + ": not written by the "
                "trainer, or its write never finished") if (path / ".metadata").is_file() else "not a checkpoint"
        raise CheckpointError(f"checkpoint {path} is {what}; pass a {SHARDED_CHECKPOINT_NAME} the trainer wrote")
    hint = "it is truncated or corrupted; resume from an older copy or start a new run"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {manifest_path}: {error}; {hint}") from error
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != SHARDED_FORMAT:
        raise CheckpointError(f"{manifest_path} has format {found!r}, this code reads {SHARDED_FORMAT!r}; "
                              "resume it with the packed_adamw version that wrote it")
    if _manifest_sha256(manifest) != manifest.get("sha256"):
        raise CheckpointError(f"{manifest_path} fails its checksum: {hint}")
    return manifest


def load_sharded_training_state(path, *, model, optimizer, tape, config: dict) -> dict:
    """FSDP (collective): restore model and optimizer shards (resharded by DCP if need be), this
    rank's tape cursor and RNG from a sharded checkpoint directory; returns the trainer entry."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    manifest = read_sharded_manifest(path)
    _check_config_and_version(path, manifest, config)
    entry = _rank_entry(path, manifest["ranks"], dist.get_rank())
    files = manifest["files"]
    found = _hash_files(path, sorted(files))
    damaged = sorted(name for name in files if found.get(name) != files[name])
    if damaged:
        raise CheckpointError(f"checkpoint {path}: {', '.join(damaged)} missing or not as written (size or "
                              "SHA-256 differs from trainer.json); resume from an older copy or start a new run")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    # PackedAdamW.load_state_dict checks the format identity carried in every param group.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restore_rank_state(entry, tape)
    return manifest["trainer"]


def checkpoint_info(path) -> dict:
    """{"step", "config"} of a checkpoint of either kind (for the trainer's checks before resuming)."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST_NAME).exists():
        metadata = read_sharded_manifest(path)
    else:
        _, metadata = read_checkpoint(path)
    return {"step": metadata["trainer"]["step"], "config": saved_config(metadata)}


def save_run_state(path: Path, parallel: str, **state) -> None:
    """Write a run's checkpoint `path` as its --parallel writes it: one file (rank 0's under DDP,
    every rank's entry gathered) or, under FSDP2, a sharded directory published as `path` (the
    link in its run directory). Collective under torchrun."""
    if parallel == "fsdp":
        save_sharded_training_state(path.parent, **state)
    elif parallel == "ddp":
        save_replicated_training_state(path, **state)
    else:
        save_training_state(path, **state)


def load_run_state(path: Path, parallel: str, rank: int | None, **state) -> dict:
    """Restore a run from checkpoint `path` as its --parallel wrote it; returns the trainer entry
    (`rank`: this process's in a DDP run, whose file holds every rank's cursor and RNG state)."""
    if parallel == "fsdp":
        return load_sharded_training_state(path, **state)
    return load_training_state(path, **state, rank=rank)
