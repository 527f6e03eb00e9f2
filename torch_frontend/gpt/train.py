"""Train the reference GPT from a finite token tape, with exact-resume checkpoints.

    python -m packed_adamw.torch.gpt.train --demo                # tiny GPT on the embedded corpus, CPU
    python -m packed_adamw.torch.gpt.train --config reference --mode packed --device cuda \\
        --data runs/data/shakespeare --max-steps 5000 --batch-size 64
    python -m packed_adamw.torch.gpt.train ... --resume auto     # continue from <out>/checkpoint.safetensors
    python -m packed_adamw.torch.gpt.train ... --param-dtype bf16   # bf16 weights, PackedAdamW's split FP32 masters
    python -m packed_adamw.torch.gpt.train ... --optimizer torchao-adamw8bit --autocast bf16 --no-checkpoints
    python -m packed_adamw.torch.gpt.train --synthetic           # one update on random tokens (smoke test)
    torchrun --nproc_per_node=2 -m packed_adamw.torch.gpt.train --parallel fsdp ...   # or --parallel ddp

The tape is read front to back once (docs/TAPE.md); training ends when it runs out or after
--max-steps. The learning rate is a pure function of the step, there is no dropout, and the
checkpoint holds everything else (model, optimizer, tape cursor, RNG), so a resumed run
ends bit-identical to an uninterrupted one. SIGINT/SIGTERM finish the current step, write a
checkpoint and exit with code 0. Under torchrun, rank r of W reads every W-th batch window
of the tape (a step reads the tokens a single process with W times the batch would); DDP
checkpoints are one file, FSDP2 ones a torch.distributed.checkpoint directory. See
docs/TRAINING.md and docs/DISTRIBUTED.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from packed_adamw.core import StateFormat, first_moment_format, formats, launch, rms_format, validate_hyperparams
from packed_adamw.tokenizer import tokenizer_sha256
from packed_adamw.tokenizer.corpus import CorpusNotInstalledError, default_corpus_documents
from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader, build_split

from ..optimizer import PackedAdamW
from .checkpoint import (
    CHECKPOINT_NAME, MANIFEST_NAME, SHARDED_CHECKPOINT_NAME, CheckpointError, checkpoint_info, config_differences,
    load_sharded_training_state, load_training_state, save_replicated_training_state, save_sharded_training_state,
    save_training_state,
)
from .model import GPT, PRESETS, GPTConfig



@dataclasses.dataclass(frozen=True)
class Peer:
    """A low-memory AdamW of another package, for the comparison table (benchmarks/peers.py).

    None of them is a dependency of packed_adamw: each is imported when chosen. `checkpoints`:
    whether its state fits the trainer's safetensors checkpoints (plain tensors and JSON
    scalars); torchao keeps its moments as tensor subclasses, which safetensors cannot hold,
    so its runs need --no-checkpoints (a run then restarts from step 0 rather than resuming).
    """

    module: str
    class_name: str
    pip: str  # what to run when the import fails
    options: tuple = ()  # (name, value) pairs for the constructor beyond lr, betas, eps, weight_decay
    fp32_weight_options: tuple = ()  # more pairs when the parameters are FP32 (--param-dtype fp32)
    checkpoints: bool = True


PEERS = {
    # bitsandbytes: blockwise 8-bit moments for tensors of >= 4096 elements (its min_8bit_size), FP32 below
    "bnb-adamw8bit": Peer("bitsandbytes.optim", "AdamW8bit", "pip install bitsandbytes==0.50.2"),
    # torchao: blockwise quantized moments (tensor subclasses) for tensors of >= 4096 elements whose size
    # its block (256; 128 for 4-bit) divides, FP32 moments otherwise (the reference GPT's 12,095 x 288 embedding)
    "torchao-adamw8bit": Peer("torchao.optim", "AdamW8bit", "pip install torchao==0.18.0", checkpoints=False),
    "torchao-adamw4bit": Peer("torchao.optim", "AdamW4bit", "pip install torchao==0.18.0", checkpoints=False),
    "torchao-adamwfp8": Peer("torchao.optim", "AdamWFp8", "pip install torchao==0.18.0", checkpoints=False),
    # FlashOptim: 8-bit moments; on bf16 parameters 24-bit masters (bf16 weight + int8 correction).
    # decouple_lr=False is torch AdamW's weight decay (param *= 1 - lr * weight_decay).
    "flashoptim-adamw": Peer("flashoptim", "FlashAdamW", "pip install flashoptim==0.1.4",
                             options=(("decouple_lr", False),),
                             # its default 24-bit masters refuse FP32 parameters, which need none
                             fp32_weight_options=(("master_weight_bits", None),)),
}
# torch-adamw-fused: torch.optim.AdamW(fused=True) on CUDA (the foreach implementation on the CPU)
OPTIMIZERS = ("packed-adamw", "torch-adamw", "torch-adamw-fused", *PEERS)
# --param-dtype: what the model's parameters are. bf16 trains bf16 live weights (forward and
# backward in bf16, no autocast); PackedAdamW then keeps each one's exact FP32 master as the
# weight plus an int16 low half in its state (FORMAT.md, "Split masters").
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# --autocast: the forward and loss under torch.autocast in this dtype, with FP32 parameters
AUTOCAST = {"none": None, "bf16": torch.bfloat16}
PARALLEL = ("none", "ddp", "fsdp")
STOP_SIGNALS = (None, "SIGINT", "SIGTERM")  # agreed between ranks as an index (the largest wins)


class ConfigError(ValueError):
    """Settings that cannot work together."""


@dataclasses.dataclass
class TrainConfig:
    # -- what the run computes: recorded in the checkpoint and required equal on resume --
    config: str = "tiny"  # model preset (model.PRESETS)
    optimizer: str = "packed-adamw"  # or "torch-adamw", the torch.optim.AdamW baseline
    mode: str = "packed"  # PackedAdamW mode: packed | fp16 | fp32
    param_dtype: str = "fp32"  # or "bf16": bf16 live weights (with packed-adamw: split FP32 masters)
    autocast: str = "none"  # or "bf16": forward and loss under bf16 autocast, FP32 parameters
    m_bias: int = 15
    rms_bias: int = 15
    batch_size: int = 16
    max_steps: int = 500  # step budget, and the length of the cosine schedule
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on matrices and embeddings; biases and LayerNorms get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clipping; None (`--grad-clip none`): no clipping
    seed: int = 0
    parallel: str = "none"  # under torchrun: "ddp" or "fsdp" (FSDP2); batch_size is then per rank
    # -- how the run is carried out: free to change between sessions --
    data: str = "runs/data/shakespeare"
    build_data: bool = False  # build data/train.tape and val.tape from the embedded corpus if missing
    out: str = ""  # default runs/<config>-<mode or optimizer>
    device: str = "auto"
    resume: str = ""  # "", "auto" (resume if out/checkpoint exists), a checkpoint path or a run directory
    checkpoint_every: int = 100
    checkpoints: bool = True  # --no-checkpoints: write none (needed by optimizers whose state they cannot hold)
    stop_at_step: int = 0  # >0: write a checkpoint and stop at this step (the schedule keeps max_steps)
    eval_every: int = 100
    eval_batches: int = 8  # validation batches per evaluation; 0 = the whole validation tape
    log_every: int = 10
    log_moment_stats: bool = False  # fp32 mode: write moment_stats.jsonl every moment_stats_every steps
    moment_stats_every: int = 100
    moment_stats_biases: str = "12,15,18,21"
    # packed/fp16: "format" records in log.jsonl every log_every steps and format.png (counting
    # changes no bit of training, so it may be switched on or off between sessions)
    track_format: bool = False
    # "all": every step counts (a record covers the steps since the last); "logged": only the
    # logged steps count, so counting costs nothing on the others (a record covers its step)
    format_steps: str = "all"
    progress: bool = True
    deterministic: bool = True  # CUDA: deterministic kernels, without which resume is not bit-exact

    def trajectory(self) -> dict:
        """The settings that decide the bits of the result, with the model preset spelled out."""
        fields = ("optimizer", "mode", "param_dtype", "m_bias", "rms_bias", "batch_size", "max_steps", "lr",
                  "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed", "parallel")
        # Recorded only when on, so checkpoints made before --autocast existed stay resumable.
        autocast = {"autocast": self.autocast} if self.autocast != "none" else {}
        # The number of ranks decides which windows each rank reads and the global batch.
        return {"model": dataclasses.asdict(GPTConfig.preset(self.config)),
                **{name: getattr(self, name) for name in fields}, **autocast, "world_size": launched_world_size()}

    @property
    def out_dir(self) -> Path:
        name = self.mode if self.optimizer == "packed-adamw" else self.optimizer
        if self.param_dtype != "fp32":
            name += f"-{self.param_dtype}"
        if self.autocast != "none":
            name += f"-autocast-{self.autocast}"
        if self.parallel != "none":
            name += f"-{self.parallel}{launched_world_size()}"
        return Path(self.out or f"runs/{self.config}-{name}")

    @property
    def checkpoint_name(self) -> str:
        return SHARDED_CHECKPOINT_NAME if self.parallel == "fsdp" else CHECKPOINT_NAME


DEMO = dict(config="tiny", build_data=True, out="runs/demo", resume="auto")


# ---- ranks ----------------------------------------------------------------------------------

def _distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def launched_world_size() -> int:
    """The number of processes of this run: a process group's, torchrun's WORLD_SIZE, or 1."""
    if _distributed_ready():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclasses.dataclass
class Ranks:
    """This process's place in the run; rank 0 of 1 without --parallel."""

    parallel: str = "none"
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # the trainer created the process group (and destroys it at the end)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.parallel != "none"

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def agree(self, value: int, device: torch.device) -> int:
        """The largest of every rank's `value` (a signal seen by one rank stops them all)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def close(self) -> None:
        if self.owns_group and _distributed_ready():
            torch.distributed.destroy_process_group()


def start_ranks(config: TrainConfig, device: torch.device) -> Ranks:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU), or use one that exists."""
    if config.parallel == "none":
        return Ranks()
    owns = not _distributed_ready()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Ranks(config.parallel, torch.distributed.get_rank(), torch.distributed.get_world_size(), owns)


def wrap_model(model: GPT, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """DDP around the model, or FSDP2: each block, then the root (embeddings, tied head, final LayerNorm)."""
    if ranks.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if ranks.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (ranks.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a DTensor gathered (collective), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TapeShard:
    """Rank r of W reads windows r, r+W, r+2W, ... of the tape's consecutive B x T windows.

    Step s reads tokens [s*W*B*T, (s+1)*W*B*T + 1) of the tape: the tokens a single process
    with batch W*B reads at step s; rank r's share is their r-th B x T window. The cursor
    (saved per rank) is where this rank's next window starts, g + r*B*T for the run's
    position g; a step runs only while the last rank's window fits, so all ranks stop at
    the same step.
    """

    def __init__(self, reader: TapeReader, rank: int, world_size: int, batch_size: int, context: int):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.shape = (batch_size, context)
        self.window = batch_size * context
        self.cursor = rank * self.window
        self.path = reader.path

    def _check(self, batch_size: int, context: int) -> None:
        if (batch_size, context) != self.shape:
            raise ValueError(f"this shard serves batches of {self.shape}, not {(batch_size, context)}")

    @property
    def position(self) -> int:
        return self.cursor - self.rank * self.window

    def remaining_batches(self, batch_size: int, context: int) -> int:
        """Steps left for the whole run (the same on every rank)."""
        self._check(batch_size, context)
        return max(0, (self.reader.num_tokens - 1 - self.position) // (self.world_size * self.window))

    def next_batch(self, batch_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
        if self.remaining_batches(batch_size, context) == 0:
            raise TapeExhausted(
                f"{self.path}: {self.reader.num_tokens - self.position} tokens left after position {self.position}, "
                f"a step of {self.world_size} ranks x {batch_size}x{context} needs "
                f"{self.world_size * self.window + 1}; "
                "build the tape with more --passes or train fewer steps")
        self.reader.cursor = self.cursor
        batch = self.reader.next_batch(batch_size, context)
        self.cursor += self.world_size * self.window
        return batch

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "tape_header_sha256": self.reader.header.header_sha256,
                "path": str(self.path), "rank": self.rank, "world_size": self.world_size,
                "window_tokens": self.window}

    def load_state_dict(self, state: dict) -> None:
        # The tape's identity, as TapeReader checks it (the cursor itself is checked below).
        self.reader.load_state_dict({**state, "cursor": 0})
        for key, ours in (("rank", self.rank), ("world_size", self.world_size), ("window_tokens", self.window)):
            if state.get(key) != ours:
                raise TapeError(f"cursor state of {self.path} has {key}={state.get(key)!r}, this rank has {ours}; "
                                "resume with the number of processes and batch size the run started with")
        cursor = state["cursor"]
        position = cursor - self.rank * self.window if isinstance(cursor, int) else -1
        if not (0 <= position <= self.reader.num_tokens and position % (self.world_size * self.window) == 0):
            raise TapeError(f"cursor {cursor!r} is not a window of rank {self.rank} of {self.world_size} "
                            f"in {self.path} ({self.reader.num_tokens} tokens)")
        self.cursor = cursor


# ---- pieces of the loop ---------------------------------------------------------------------

def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at max_steps (step counts from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_model(config: TrainConfig, device: torch.device) -> tuple[GPT, dict[str, torch.Tensor] | None]:
    """The GPT initialised from `config.seed`, its parameters in `config.param_dtype`.

    The initialisation is always drawn in FP32 (the same values for every run of a seed). With
    `--param-dtype bf16` each parameter then becomes its FP32 value rounded to the nearest bf16
    by the split rule (ties away from zero; FORMAT.md, "Split masters"), the same live weights
    for PackedAdamW and torch AdamW, and the FP32 values are returned by parameter name (None
    for an FP32 run) for PackedAdamW to take as its masters (`start_masters`).
    """
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig.preset(config.config)).to(device)
    if config.param_dtype == "fp32":
        return model, None
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.to(PARAM_DTYPES[config.param_dtype])
    with torch.no_grad():
        for name, p in model.named_parameters():
            weight_bits, _ = formats.split_master(initial[name].cpu().numpy())
            p.copy_(torch.from_numpy(weight_bits.view(np.int16)).view(torch.bfloat16))
    return model, initial


def start_masters(optimizer: torch.optim.Optimizer, model: GPT, initial: dict[str, torch.Tensor] | None) -> None:
    """A fresh bf16 PackedAdamW run: the split masters start at the exact FP32 initialisation
    (the weights stay its bf16 rounding, the low halves take the rest), as an FP32 run's
    parameters do. torch AdamW on bf16 parameters has no masters: it starts from the weights."""
    if initial is None or not isinstance(optimizer, PackedAdamW):
        return
    name_of = {id(p): name for name, p in model.named_parameters()}  # FSDP2 replaced the parameters
    masters = []
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        value = initial[name_of[id(p)]]
        if hasattr(p, "device_mesh"):  # FSDP2: the master laid out like its DTensor parameter
            from torch.distributed.tensor import distribute_tensor
            value = distribute_tensor(value, p.device_mesh, p.placements)
        masters.append(value)
    optimizer.load_master_weights(masters)


def gradient_norm_(parameters, max_norm: float | None, param_dtype: str) -> torch.Tensor:
    """The global gradient norm, after clipping the gradients to `max_norm` (None: no clipping).

    FP32 gradients go through torch's clip_grad_norm_ / get_total_norm. bf16 gradients' norm
    is accumulated in float32 (torch's would be rounded to bf16, 8 significant bits); torch's
    clip_grads_with_norm_ then multiplies the float32 clipping factor into the bf16 gradients,
    each product computed in float32 and rounded once to bf16.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if param_dtype == "fp32":
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def make_optimizer(model: GPT, config: TrainConfig) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    common = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    if config.optimizer == "torch-adamw":
        return torch.optim.AdamW(groups, **common)
    if config.optimizer == "torch-adamw-fused":
        fused = all(p.device.type == "cuda" for _, p in named)
        return torch.optim.AdamW(groups, **common, fused=fused)
    if config.optimizer in PEERS:
        # The same groups without the names, which not every peer takes
        plain = [{**group, "params": [p for _, p in group["params"]]} for group in groups]
        peer = PEERS[config.optimizer]
        options = dict(peer.options) | (dict(peer.fp32_weight_options) if config.param_dtype == "fp32" else {})
        return peer_class(config.optimizer)(plain, **common, **options)
    return PackedAdamW(groups, **common, mode=config.mode, m_bias=config.m_bias, rms_bias=config.rms_bias,
                       track_format=config.track_format)


def peer_class(name: str) -> type:
    """The optimizer class of peer `name`, imported now (ConfigError naming the pip command if absent)."""
    import importlib
    peer = PEERS[name]
    try:
        module = importlib.import_module(peer.module)
    except ImportError as error:
        raise ConfigError(f"--optimizer {name} needs the {peer.module.split('.')[0]} package, which is not "
                          f"installed ({error}): {peer.pip}") from None
    return getattr(module, peer.class_name)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's compiled step reads lr from a tensor it owns
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def autocast_context(config: TrainConfig, device: torch.device):
    """--autocast bf16: torch.autocast around the forward and loss; otherwise nothing."""
    dtype = AUTOCAST[config.autocast]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state`, each storage counted once.

    Measured from the state itself, so it works on the CPU as on CUDA: a tensor subclass
    (torchao's quantized moments, a DTensor) counts the inner tensors of its
    `__tensor_flatten__`, recursively; any other holder of tensors (FlashOptim keeps its
    moments in a plain Python object) counts the tensors among its attributes. Scalars such
    as a step count held as a Python int count nothing.
    """
    storages, objects = set(), set()
    total = 0

    def visit(value) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
                names, _ = value.__tensor_flatten__()
                for name in names:
                    visit(getattr(value, name))
                return
            storage = value.untyped_storage()
            key = (value.device, storage.data_ptr(), storage.nbytes())
            if key not in storages:
                storages.add(key)
                total += storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif hasattr(value, "__dict__") and id(value) not in objects:
            objects.add(id(value))
            for item in vars(value).values():
                visit(item)

    for state in optimizer.state.values():
        visit(state)
    return total


def open_tapes(config: TrainConfig, ranks: "Ranks | None" = None) -> tuple[TapeReader, TapeReader]:
    """The training and validation tapes of --data, built from the embedded corpus when neither
    exists and --build-data is given. One tape without the other is refused, with or without
    --build-data: the two must be split from one corpus, so the missing one cannot be built
    alone, and building both would replace the user's file."""
    data = Path(config.data)
    train_path, val_path = data / "train.tape", data / "val.tape"
    main_rank = ranks is None or ranks.main
    present = [path for path in (train_path, val_path) if path.exists()]
    if ranks is not None:
        ranks.barrier()  # every rank has looked before one of them builds
    build_command = f"`python -m packed_adamw.tokenizer.tape build --out {data}`"
    if len(present) == 1:
        (kept,), missing = present, val_path if present == [train_path] else train_path
        raise TapeError(f"{missing} is missing ({data} holds {kept.name} alone); the tapes are split from one "
                        f"corpus, so neither is built without the other and {kept.name} is never replaced: build "
                        f"both from your corpus with {build_command} --text (or --parquet) FILES, or pass a --data "
                        "directory that holds both (or neither, with --build-data)")
    if not present:
        if not config.build_data:
            raise TapeError(f"no tapes in {data}: pass --build-data to build them from the embedded corpus, "
                            f"or build them with {build_command}")
        if main_rank:  # one rank builds them, the others wait below
            print(f"building {train_path} and {val_path} from the embedded corpus ...")
            build_split(default_corpus_documents(), data)
    if ranks is not None:
        ranks.barrier()
    sha = tokenizer_sha256()
    return TapeReader(train_path, tokenizer_sha256=sha), TapeReader(val_path, tokenizer_sha256=sha)


@torch.no_grad()
def validation_bpb(model: GPT, tape: TapeReader, batch_size: int, max_batches: int, device) -> float | None:
    """Bits per byte: summed token losses (nats) / (ln 2 * UTF-8 bytes of the target tokens).

    The model runs with the weights it trains with: under --param-dtype bf16 the bf16 live
    weights, not PackedAdamW's FP32 masters."""
    context = model.config.context
    nats, byte_count = 0.0, 0
    for index, (x, y) in enumerate(tape.iter_eval_batches(batch_size, context)):
        if index == max_batches > 0:
            break
        _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device), reduction="sum")
        nats += loss.item()
        byte_count += int(tape.token_byte_counts[y].sum())
    return nats / (math.log(2) * byte_count) if byte_count else None


class StopRequest:
    """SIGINT/SIGTERM set a flag that the loop checks between steps (handlers restored on exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        # Only set the flag: printing here could re-enter a stream tqdm is writing to.
        self.signal_name = signal.Signals(signum).name


def parameter_kind(name: str) -> str:
    if name.endswith(".bias"):
        return "bias"
    if "ln_" in name:
        return "layernorm"
    if "emb" in name:
        return "embedding"
    if ".attn." in name:
        return "attention_" + name.split(".")[-2]  # attention_qkv, attention_proj
    return "mlp"


def moment_stats(model: GPT, optimizer: PackedAdamW, step: int, biases: list[int]) -> dict:
    """Per kind of tensor: how much of |m| and sqrt(v) the packed formats would saturate or flush."""
    by_kind = collections.defaultdict(list)
    for name, p in model.named_parameters():
        by_kind[parameter_kind(name)].append(full(optimizer.state[p]["moments"]).reshape(2, -1).cpu().numpy())
    record = {"step": step, "kinds": {}}
    quantile_levels = [0.01, 0.1, 0.5, 0.9, 0.99]
    for kind, moments in sorted(by_kind.items()):
        m, v = np.concatenate(moments, axis=1).astype(np.float64)
        abs_m, rms = np.abs(m), np.sqrt(v)
        stats = {"elements": int(m.size)}
        for label, values in (("m", abs_m), ("rms", rms)):
            nonzero = values[values > 0]
            stats[f"log2_{label}_quantiles"] = dict(zip(map(str, quantile_levels), np.quantile(np.log2(nonzero), quantile_levels).tolist())) if nonzero.size else None
        for bias in biases:
            for label, values, fmt in (("m", abs_m, first_moment_format(bias)), ("rms", rms, rms_format(bias))):
                stats[f"{label}_bias{bias}"] = {
                    "saturate": float(np.mean(values > fmt.max_value)),
                    "subnormal": float(np.mean((values > 0) & (values < fmt.min_normal))),
                    # round-to-nearest-even sends values up to half the smallest subnormal to zero
                    "flush_to_zero": float(np.mean((values > 0) & (values <= fmt.min_subnormal / 2))),
                }
        record["kinds"][kind] = stats
    return record


FORMAT_RECORD = "format"  # the "record" entry of log.jsonl's format-count lines (--track-format)
FORMAT_STEPS = ("all", "logged")  # --format-steps: which steps --track-format counts


def is_log_step(step: int, config: TrainConfig) -> bool:
    """Whether the trainer logs step `step` (counted from 1): every log_every-th, and the first."""
    return step % config.log_every == 0 or step == 1


def format_record(optimizer: PackedAdamW, kinds: list[str], first_step: int, step: int, ranks: "Ranks",
                  device: torch.device) -> dict:
    """Per kind of tensor, the share of the element-steps of steps first_step..step whose new
    first moment or RMS saturated, flushed to zero or landed subnormal (FORMAT.md, "Format
    counts"), with the counts behind each share.

    `format_stats()` returns the counts since its previous call and the element-steps they
    cover (elements x steps counted), so a share is count / element_steps of this interval.
    Under FSDP2 each rank counts its own shard, so every rank calls this and the counts are
    summed over the ranks; DDP ranks step whole tensors with the same reduced gradients, so
    each rank's counts already are the whole tensors'.
    """
    fields = ("element_steps", *launch.FORMAT_COUNTS)
    row = {kind: index for index, kind in enumerate(kinds)}
    totals = torch.zeros((len(kinds), len(fields)), dtype=torch.int64)
    for name, entry in optimizer.format_stats().items():
        totals[row[parameter_kind(name)]] += torch.tensor([entry["elements"], *(entry[k] for k in fields[1:])])
    if ranks.parallel == "fsdp":
        totals = totals.to(device)  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(totals)
    record = {"record": FORMAT_RECORD, "step": step, "first_step": first_step, "kinds": {}}
    for kind, values in zip(kinds, totals.tolist()):
        element_steps, counts = values[0], dict(zip(fields[1:], values[1:]))
        shares = {k: n / element_steps if element_steps else None for k, n in counts.items()}
        record["kinds"][kind] = {"element_steps": element_steps, **shares, "counts": counts}
    return record


def log_records(log_path: Path, record: str | None = None) -> list[dict]:
    """The lines of log.jsonl of one kind: None for the step lines (loss, val_bpb, ...),
    FORMAT_RECORD for the format counts."""
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("record") == record]


def plot_format_log(log_path: Path, png_path: Path) -> None:
    """One panel per format count, one line per kind of tensor, shares on a log axis (a
    share of 0 leaves a gap). Each point is the share over the interval ending at its step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = log_records(log_path, FORMAT_RECORD)
    kinds = sorted({kind for r in records for kind in r["kinds"]})
    fig, axes = plt.subplots(3, 2, figsize=(10, 10), sharex=True)  # rows: event; columns: m, RMS
    for ax, count in zip(axes.flat, launch.FORMAT_COUNTS):
        drawn = False
        for kind in kinds:
            points = [(r["step"], r["kinds"][kind][count]) for r in records if kind in r["kinds"]]
            shares = [share if share else math.nan for _, share in points]
            drawn = drawn or not all(map(math.isnan, shares))
            ax.plot([s for s, _ in points], shares, marker=".", label=kind)
        if drawn:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "none counted", transform=ax.transAxes, ha="center", va="center", color="gray")
            ax.set_yticks([])
        ax.set(title=count, ylabel="share of element-steps")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(kinds) or 1)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_log(log_path: Path, png_path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = log_records(log_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_bpb"]) for r in records if r.get("val_bpb") is not None]
    fig, (ax_loss, ax_bpb) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax_loss.plot(*zip(*train))
    ax_loss.set(xlabel="step", ylabel="training loss (nats/token)", title="training loss")
    if val:
        ax_bpb.plot(*zip(*val), marker="o")
    ax_bpb.set(xlabel="step", ylabel="bits per byte", title="validation bpb")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def keep_records_up_to(path: Path, step: int) -> None:
    """Drop JSONL records after `step` and any line a crash cut short."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    path.write_text("".join(kept))


def finished(step: int, tape: TapeReader | TapeShard, config: TrainConfig, context: int) -> bool:
    """Whether a resumed run has nothing left to do (its summary then stands)."""
    return (step >= config.max_steps or 0 < config.stop_at_step <= step
            or tape.remaining_batches(config.batch_size, context) == 0)


def resolve_device(name: str, deterministic: bool, parallel: str = "none") -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if parallel != "none" and name == "cuda":  # one GPU per rank
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(name)
    if name.startswith("cuda") and deterministic:
        # Atomics (embedding backward) and cuBLAS's split reductions otherwise vary run to run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return torch.device(name)


def _check(option: str, value, check) -> None:
    """Run a check of packed_adamw.core (which raises ValueError) and name the option on failure."""
    try:
        check()
    except ValueError as error:
        raise ConfigError(f"{option} {value}: {error}") from None


def check_config(config: TrainConfig) -> None:
    """Refuse settings that cannot work, naming the option (ConfigError; the CLI exits 2).

    The optimizer's rules live in packed_adamw.core (validate_hyperparams, StateFormat): each
    value is checked there on its own, the others held at values those rules accept, so the
    error names the one option at fault. The same rules apply to the torch-adamw baseline.
    """
    if config.config not in PRESETS:
        raise ConfigError(f"--config {config.config}: unknown model preset; choose one of {sorted(PRESETS)}")
    if config.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {config.optimizer}: choose one of {', '.join(OPTIMIZERS)}")
    if config.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"--param-dtype {config.param_dtype}: choose one of {', '.join(PARAM_DTYPES)} "
                          "(bf16: bf16 weights, with PackedAdamW keeping exact FP32 masters)")
    if config.autocast not in AUTOCAST:
        raise ConfigError(f"--autocast {config.autocast}: choose one of {', '.join(AUTOCAST)}")
    if config.autocast != "none" and config.param_dtype != "fp32":
        raise ConfigError(f"--autocast {config.autocast} runs the forward of FP32 parameters in {config.autocast}; "
                          f"--param-dtype {config.param_dtype} parameters already run in {config.param_dtype}: "
                          "leave out one of the two")
    check_peer(config)
    lr_ok, betas_ok, eps_ok = 1e-3, (0.9, 0.95), 1e-8  # values the rules accept
    for option, value in (("--lr", config.lr), ("--min-lr", config.min_lr)):
        _check(option, value, lambda v=value: validate_hyperparams(v, betas_ok, eps_ok, 0.0))
    _check("--beta1", config.beta1, lambda: validate_hyperparams(lr_ok, (config.beta1, 0.95), eps_ok, 0.0))
    _check("--beta2", config.beta2, lambda: validate_hyperparams(lr_ok, (0.9, config.beta2), eps_ok, 0.0))
    _check("--eps", config.eps, lambda: validate_hyperparams(lr_ok, betas_ok, config.eps, 0.0))
    _check("--weight-decay", config.weight_decay,
           lambda: validate_hyperparams(lr_ok, betas_ok, eps_ok, config.weight_decay))
    for option, value in (("--lr", config.lr), ("--min-lr", config.min_lr)):  # lr * weight_decay
        _check(f"{option} {value} with --weight-decay", config.weight_decay,
               lambda v=value: validate_hyperparams(v, betas_ok, eps_ok, config.weight_decay))
    _check("--mode", config.mode, lambda: StateFormat(mode=config.mode))
    _check("--m-bias", config.m_bias, lambda: StateFormat(m_bias=config.m_bias))
    _check("--rms-bias", config.rms_bias, lambda: StateFormat(rms_bias=config.rms_bias))
    moment_stats_biases(config)
    if config.grad_clip is not None and not (math.isfinite(config.grad_clip) and config.grad_clip > 0):
        raise ConfigError(f"--grad-clip {config.grad_clip}: the clipping norm must be a finite number > 0 "
                          "(a negative one reverses the gradient, 0 zeroes it); pass --grad-clip none "
                          "to train without clipping")
    minimums = {"batch_size": 1, "max_steps": 1, "warmup_steps": 0, "log_every": 1, "moment_stats_every": 1,
                "checkpoint_every": 0, "stop_at_step": 0, "eval_every": 0, "eval_batches": 0}
    for name, minimum in minimums.items():
        if getattr(config, name) < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(config, name)}: must be at least {minimum}")
    if not config.checkpoints and config.stop_at_step:
        raise ConfigError(f"--stop-at-step {config.stop_at_step} stops to continue from its checkpoint, and "
                          "--no-checkpoints writes none: leave out one of the two")
    if not 0 <= config.seed < 2**64:
        raise ConfigError(f"--seed {config.seed}: must be in [0, 2**64)")
    if config.device != "auto":
        try:
            device = torch.device(config.device)
        except RuntimeError:
            raise ConfigError(f"--device {config.device}: not a device; use auto, cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {config.device}: the trainer runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {config.device}: CUDA is not available on this machine; "
                              "use --device cpu or auto")
    if config.log_moment_stats and (config.optimizer, config.mode) != ("packed-adamw", "fp32"):
        raise ConfigError("--log-moment-stats needs --mode fp32 (it reads float32 moments)")
    if config.track_format and config.optimizer != "packed-adamw":
        raise ConfigError(f"--track-format counts PackedAdamW's format events; --optimizer {config.optimizer} "
                          "has none: use --optimizer packed-adamw with --mode packed or fp16")
    if config.track_format and config.mode == "fp32":
        raise ConfigError("--track-format counts where packed or fp16 codes saturate, flush or go subnormal, and "
                          "--mode fp32 stores float32 moments: use --mode packed or fp16, or --log-moment-stats "
                          "for what fp32 moments would do in the packed formats")
    if config.format_steps not in FORMAT_STEPS:
        raise ConfigError(f"--format-steps {config.format_steps}: one of {', '.join(FORMAT_STEPS)}")
    if config.format_steps != "all" and not config.track_format:
        raise ConfigError(f"--format-steps {config.format_steps} says which steps --track-format counts: "
                          "add --track-format, or leave --format-steps out")
    check_parallel(config)


def check_peer(config: TrainConfig) -> None:
    """A peer optimizer (PEERS): its package importable, its state storable or checkpoints off."""
    if config.optimizer not in PEERS:
        return
    peer_class(config.optimizer)  # ConfigError with the pip command when the package is missing
    if config.checkpoints and not PEERS[config.optimizer].checkpoints:
        raise ConfigError(f"--optimizer {config.optimizer} keeps its state in tensor subclasses, which the "
                          "trainer's safetensors checkpoints cannot hold: pass --no-checkpoints (the run "
                          "cannot then resume, and restarts from step 0)")
    if config.parallel != "none":
        raise ConfigError(f"--optimizer {config.optimizer} runs in one process here: leave out --parallel")


def check_parallel(config: TrainConfig) -> None:
    if config.parallel not in PARALLEL:
        raise ConfigError(f"--parallel {config.parallel}: choose one of {', '.join(PARALLEL)}")
    world = launched_world_size()
    if config.parallel == "none":
        if world > 1:
            raise ConfigError(
                f"--parallel none (the default) cannot run as one of WORLD_SIZE={world} processes started by "
                "torchrun: pass --parallel ddp (every rank holds the whole model) or --parallel fsdp (FSDP2: "
                "parameters and optimizer state sharded across the ranks), or run without torchrun")
        return
    if not torch.distributed.is_available():
        raise ConfigError(f"--parallel {config.parallel}: this torch build has no torch.distributed")
    if not (under_torchrun() or _distributed_ready()):
        raise ConfigError(
            f"--parallel {config.parallel}: start the trainer with torchrun, which sets RANK, WORLD_SIZE and the "
            f"rendezvous: torchrun --nproc_per_node=N -m packed_adamw.torch.gpt.train --parallel {config.parallel} ...")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {config.device}: under torchrun each rank uses cuda:LOCAL_RANK (or the "
                          "CPU); pass --device auto, cuda or cpu")


def moment_stats_biases(config: TrainConfig) -> list[int]:
    try:
        biases = [int(b) for b in config.moment_stats_biases.split(",")]
        for bias in biases:
            StateFormat(m_bias=bias, rms_bias=bias)
    except ValueError as error:
        raise ConfigError(f"--moment-stats-biases {config.moment_stats_biases}: give comma-separated "
                          f"exponent biases such as 12,15,18,21 ({error})") from None
    return biases


def resume_source(config: TrainConfig, checkpoint_path: Path) -> Path | None:
    """The checkpoint to resume from: None (fresh start), out's own, a file, or a run directory's."""
    other = checkpoint_path.with_name(CHECKPOINT_NAME if config.parallel == "fsdp" else SHARDED_CHECKPOINT_NAME)
    if other.exists():  # logs and summary of one run per --out
        kind = "a --parallel fsdp run" if config.parallel != "fsdp" else "a run without --parallel fsdp"
        raise CheckpointError(f"--out {checkpoint_path.parent} holds {other}, the checkpoint of {kind}; this run "
                              f"writes {checkpoint_path.name}: choose another --out")
    if config.resume == "":
        if checkpoint_path.exists():
            raise CheckpointError(f"{checkpoint_path} already exists: pass --resume auto to continue that run, "
                                  "or choose another --out")
        return None
    if config.resume == "auto":
        return checkpoint_path if checkpoint_path.exists() else None
    path = Path(config.resume)
    if path.is_dir() and not ((path / MANIFEST_NAME).is_file() or (path / ".metadata").is_file()):
        # a run directory (not a DCP checkpoint directory): its checkpoint has one name
        name = config.checkpoint_name
        if not (path / name).exists():
            raise CheckpointError(f"--resume {path} is a directory without {name} (looked for {path / name}); "
                                  "pass a checkpoint or a run's --out directory")
        path = path / name
    return path


def refuse_to_replace_newer(checkpoint_path: Path, resume_path: Path, step: int, trajectory: dict) -> None:
    """Resuming another file into an --out whose checkpoint is newer (or of another run) would lose it."""
    if not checkpoint_path.exists() or (resume_path.exists() and checkpoint_path.samefile(resume_path)):
        return
    what_to_do = (f"continue it with --resume auto, resume {resume_path} into another --out, or move "
                  f"{checkpoint_path} away first")
    try:
        existing = checkpoint_info(checkpoint_path)
    except CheckpointError as error:
        raise CheckpointError(f"--out already holds {checkpoint_path}, which resuming {resume_path} would "
                              f"replace, and it cannot be read ({error}); move it away first, or resume "
                              "into another --out") from None
    existing_step = existing["step"]
    if existing_step > step:
        raise CheckpointError(f"{checkpoint_path} (step {existing_step}) is newer than {resume_path} (step {step}): "
                              f"resuming here would replace it; {what_to_do}")
    if config_differences(existing["config"], trajectory):
        raise CheckpointError(f"{checkpoint_path} belongs to another configuration than {resume_path}: resuming "
                              f"here would replace it; {what_to_do}")


# ---- the training run -----------------------------------------------------------------------

def train(config: TrainConfig) -> dict:
    """Run (or resume) training; returns the summary that is also written to summary.json.

    With --parallel ddp or fsdp every rank of the torchrun launch runs this; rank 0 alone
    prints, writes the log, the plot and the summary, and every rank returns the summary.
    """
    check_config(config)
    device = resolve_device(config.device, config.deterministic, config.parallel)
    ranks = start_ranks(config, device)
    try:
        return _train(config, device, ranks)
    finally:
        ranks.close()


def _train(config: TrainConfig, device: torch.device, ranks: Ranks) -> dict:
    say = print if ranks.main else (lambda *args, **kwargs: None)
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path, log_path = out / config.checkpoint_name, out / "log.jsonl"
    train_tape, val_tape = open_tapes(config, ranks)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the summary's peak_memory_bytes covers this session

    core, initial = build_model(config, device)  # the same weights on every rank
    # DDP wraps the GPT; fully_shard turns its parameters into DTensors in place (model is core)
    model = wrap_model(core, ranks, device)
    optimizer = make_optimizer(core, config)
    trajectory = config.trajectory()
    context = core.config.context
    if ranks.distributed:
        train_tape = TapeShard(train_tape, ranks.rank, ranks.world_size, config.batch_size, context)
    tokens_per_step = ranks.world_size * config.batch_size * context

    resume_path = resume_source(config, checkpoint_path)
    step = 0
    if resume_path is None:
        start_masters(optimizer, core, initial)
    else:
        common = dict(model=core, optimizer=optimizer, tape=train_tape, config=trajectory)
        if ranks.parallel == "fsdp":
            trainer_entry = load_sharded_training_state(resume_path, **common)
        else:
            trainer_entry = load_training_state(resume_path, **common, rank=ranks.rank if ranks.distributed else None)
        step = trainer_entry["step"]
        # before anything in --out is written or its logs trimmed
        refuse_to_replace_newer(checkpoint_path, resume_path, step, trajectory)
        say(f"resumed from {resume_path} at step {step}")
    # The logs cover steps up to the resume point; later lines came from a session that died
    # (the last of them possibly cut short by the crash).
    if ranks.main:
        for path in (log_path, out / "moment_stats.jsonl"):
            keep_records_up_to(path, step if resume_path else 0)
    summary_path = out / "summary.json"
    if resume_path is not None and summary_path.exists() and finished(step, train_tape, config, context):
        say(f"{resume_path} is a finished run; its summary:")
        return json.loads(summary_path.read_text())

    def save(reason: str) -> None:
        if not config.checkpoints:
            return
        common = dict(model=core, optimizer=optimizer, tape=train_tape, config=trajectory,
                      trainer={"step": step, "reason": reason})
        if ranks.parallel == "fsdp":
            save_sharded_training_state(out, **common)
        elif ranks.parallel == "ddp":
            save_replicated_training_state(checkpoint_path, **common)
        else:
            save_training_state(checkpoint_path, **common)

    parallel = f"; {ranks.parallel} on {ranks.world_size} ranks" if ranks.distributed else ""
    masters = " with split FP32 masters" if config.optimizer == "packed-adamw" else ""
    dtype = "" if config.param_dtype == "fp32" else f"; {config.param_dtype} parameters{masters}"
    say(f"model {config.config}: {core.num_parameters():,} parameters{dtype}; optimizer {config.optimizer}"
        f"{' mode ' + config.mode if config.optimizer == 'packed-adamw' else ''}; device {device}{parallel}; "
        f"{train_tape.remaining_batches(config.batch_size, context)} batches left on {train_tape.path}")
    if ranks.parallel == "ddp" and step < config.max_steps:
        ddp_rebuild_buckets(model, config.batch_size, context, device)
    moment_biases = moment_stats_biases(config)
    format_kinds = sorted({parameter_kind(name) for name, _ in core.named_parameters()})
    format_from = step + 1  # the first step the next format record covers
    recent_losses = collections.deque(maxlen=50)
    lowest_loss, loss_events = math.inf, []  # see LOSS_SPIKE
    fwd_bwd_times, optimizer_times, step_times = [], [], []
    val_bpb = None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bar = tqdm(total=config.max_steps, initial=step, disable=not (config.progress and ranks.main), unit="step")
    log_file = log_path.open("a") if ranks.main else contextlib.nullcontext()

    def evaluate() -> float | None:
        with autocast_context(config, device):  # the model as it trains
            bpb = validation_bpb(core, val_tape, config.batch_size, config.eval_batches, device)
        if ranks.parallel == "fsdp":
            # FSDP2's root keeps its parameters gathered after a forward (until the next
            # backward) and registers those: put the shards back before the statistics,
            # checkpoints and optimizer see the module's parameters again.
            core.reshard()
        return bpb

    def write_log(path_or_file, record: dict) -> None:
        if not ranks.main:
            return
        if isinstance(path_or_file, Path):
            with path_or_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
        else:
            path_or_file.write(json.dumps(record) + "\n")
            path_or_file.flush()

    def log_format_counts() -> None:  # on every rank: FSDP2 sums the shards' counts
        nonlocal format_from
        first_step = step if config.format_steps == "logged" else format_from  # logged: its step alone counted
        write_log(log, format_record(optimizer, format_kinds, first_step, step, ranks, device))
        format_from = step + 1

    with StopRequest() as stop, log_file as log:
        while True:
            if step >= config.max_steps:
                reason = "max_steps"
                break
            if 0 < config.stop_at_step <= step:
                reason = "stop_at_step"
                break
            signal_name = STOP_SIGNALS[ranks.agree(STOP_SIGNALS.index(stop.signal_name), device)]
            if signal_name:
                reason = signal_name
                if ranks.main:
                    print(f"\n{reason} received: {'writing a checkpoint and ' if config.checkpoints else ''}"
                          "stopping", file=sys.stderr)
                break
            try:
                x, y = train_tape.next_batch(config.batch_size, context)
            except TapeExhausted as exhausted:  # on every rank at the same step (TapeShard)
                reason = "tape_exhausted"
                say(f"\ntraining tape exhausted at step {step}: {exhausted}")
                break

            start = time.perf_counter()
            set_learning_rate(optimizer, learning_rate(step, config))
            with autocast_context(config, device):
                _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters the gradients: the mean over ranks
            grad_norm = gradient_norm_(model.parameters(), config.grad_clip, config.param_dtype)
            sync()
            after_backward = time.perf_counter()
            if config.track_format and config.format_steps == "logged":
                optimizer.track_format = is_log_step(step + 1, config)  # the others run uncounted
            optimizer.step()
            sync()
            end = time.perf_counter()
            step += 1

            recent_losses.append(loss.item())  # this rank's loss (its windows)
            event = loss_event(step, recent_losses[-1], float(full(grad_norm)), lowest_loss, config)
            if event:
                loss_events.append(event)
            if math.isfinite(recent_losses[-1]):
                lowest_loss = min(lowest_loss, recent_losses[-1])
            fwd_bwd_times.append(after_backward - start)
            optimizer_times.append(end - after_backward)
            step_times.append(end - start)
            record = None
            log_step = is_log_step(step, config)
            if log_step:
                record = {"step": step, "loss": recent_losses[-1], "lr": float(optimizer.param_groups[0]["lr"]),
                          "grad_norm": float(full(grad_norm)), "tokens_per_s": tokens_per_step / (end - start),
                          "fwd_bwd_ms": 1e3 * fwd_bwd_times[-1], "optimizer_ms": 1e3 * optimizer_times[-1]}
            if config.eval_every and step % config.eval_every == 0:
                val_bpb = evaluate()
                record = {**(record or {"step": step}), "val_bpb": val_bpb}
            if record:
                write_log(log, record)
            if config.track_format and log_step:
                log_format_counts()
            if config.log_moment_stats and step % config.moment_stats_every == 0:
                stats = moment_stats(core, optimizer, step, moment_biases)  # every rank: FSDP2 gathers
                write_log(out / "moment_stats.jsonl", stats)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save("periodic")
            bar.update(1)
            bar.set_postfix(loss=f"{recent_losses[-1]:.3f}", val_bpb=f"{val_bpb:.3f}" if val_bpb else "-")
        bar.close()

        save(reason)  # first: a signal's grace period may not outlast a validation pass
        if step_times and not (config.eval_every and step % config.eval_every == 0):
            val_bpb = evaluate()
            write_log(log, {"step": step, "val_bpb": val_bpb})
        if config.track_format and config.format_steps == "all" and format_from <= step:  # since the last record
            log_format_counts()

    # Medians skip the first steps' warm-up cost.
    steady = slice(min(5, len(step_times) - 1), None) if step_times else slice(None)
    median_ms = lambda times: 1e3 * statistics.median(times[steady]) if times else None  # noqa: E731
    summary = {
        "stopped_because": reason,
        "step": step,
        "steps_this_session": len(step_times),
        "parameters": core.num_parameters(),
        "final_train_loss_mean_last_50": statistics.fmean(recent_losses) if recent_losses else None,
        "val_bpb": val_bpb,
        "tokens_per_s": tokens_per_step * len(step_times) / sum(step_times) if step_times else None,
        # the same without the first steps (compilation, autotuning, allocator warm-up)
        "steady_tokens_per_s": (tokens_per_step * len(step_times[steady]) / sum(step_times[steady])
                                if step_times else None),
        "median_fwd_bwd_ms": median_ms(fwd_bwd_times),
        "median_optimizer_ms": median_ms(optimizer_times),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),  # this rank's (an FSDP2 shard's)
        # this session's steps only (the lowest loss is not checkpointed); the first LOSS_EVENTS_KEPT
        "loss_events": loss_events[:LOSS_EVENTS_KEPT], "loss_event_count": len(loss_events),
        "log": str(log_path), "plot": str(out / "loss.png"),
        "checkpoint": str(checkpoint_path) if config.checkpoints else None,
        "config": dataclasses.asdict(config),
    }
    if config.track_format:
        summary["format_plot"] = str(out / "format.png")
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if ranks.distributed:
        summary["world_size"] = ranks.world_size
    if ranks.main:
        plot_log(log_path, out / "loss.png")
        if config.track_format:
            plot_format_log(log_path, out / "format.png")
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    ranks.barrier()  # the summary is in place before any rank returns
    return summary


LOSS_SPIKE = 1.5  # a training loss above 1.5 x the lowest one so far, after warmup, is a spike
LOSS_EVENTS_KEPT = 100


def loss_event(step: int, loss: float, grad_norm: float, lowest_loss: float, config: TrainConfig) -> dict | None:
    """A record for the summary's loss_events when step `step` went wrong: a non-finite loss or
    gradient norm (any step), or after warmup a loss above LOSS_SPIKE x the lowest of the steps
    before it in this session (the schedule's warmup steps are left out: the loss falls fast there)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return {"step": step, "event": "non-finite", "loss": loss, "grad_norm": grad_norm}
    if step > config.warmup_steps and loss > LOSS_SPIKE * lowest_loss:
        return {"step": step, "event": "spike", "loss": loss, "lowest_loss": lowest_loss}
    return None


def ddp_rebuild_buckets(model, batch_size: int, context: int, device: torch.device) -> None:
    """One forward and backward whose gradients are dropped, before the session's first step.

    DDP all-reduces its first backward in buckets laid out by parameter order and then
    rebuilds them in the order the gradients became ready. A resumed session's first step
    would otherwise be reduced in other buckets than the same step of the uninterrupted
    run; with more than two ranks the order of the sums (and on NCCL the algorithm, chosen
    by message size) can then differ, and so could the bits. After this call every step of
    every session uses the rebuilt buckets. Parameters, optimizer state, tape cursor and
    RNG are untouched (the model has no dropout).
    """
    tokens = torch.zeros((batch_size, context), dtype=torch.long, device=device)
    model(tokens, tokens)[1].backward()
    model.zero_grad(set_to_none=True)


def synthetic_smoke(config: TrainConfig) -> dict:
    """One update on random tokens: checks the plumbing, not learning."""
    check_config(config)
    device = resolve_device(config.device, config.deterministic)
    model, initial = build_model(config, device)
    optimizer = make_optimizer(model, config)
    start_masters(optimizer, model, initial)
    tokens = torch.randint(0, model.config.vocab_size, (config.batch_size, model.config.context + 1), device=device)
    split = config.param_dtype != "fp32" and isinstance(optimizer, PackedAdamW)

    def trained_values() -> list[torch.Tensor]:  # a split run's step moves the masters, the weights may not
        return optimizer.master_weights() if split else [p.detach().clone() for p in model.parameters()]

    before = trained_values()
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    changed = sum(not torch.equal(a, b) for a, b in zip(before, trained_values()))
    # torch AdamW on bf16 weights drops every update below half a bf16 ulp (the baseline's
    # inexactness: a LayerNorm weight of 1.0 moves only for an update beyond 2**-9), so some
    # tensors may keep their weights; it must move at least one.
    inexact = config.param_dtype != "fp32" and not split
    return {"loss": loss.item(), "loss_finite": math.isfinite(loss.item()),
            "tensors_changed": changed, "tensors": len(before), "tensors_required": 1 if inexact else len(before)}


# ---- command line ---------------------------------------------------------------------------

def grad_clip_value(text: str) -> float | None:
    """`--grad-clip`: a number, or `none` for no clipping (the range is checked with the rest)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor `none`") from None


FLAG_HELP = {
    "optimizer": f"one of {', '.join(OPTIMIZERS)} (the peers are imported when chosen); ",
    "autocast": "bf16: forward and loss under torch.autocast(bfloat16) with FP32 parameters; ",
    "checkpoints": "write checkpoints (default); --no-checkpoints writes none, for optimizers whose state they "
                   "cannot hold (torchao's): the run cannot resume",
}


def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.torch.gpt.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--demo | --synthetic] [options]  (--help lists them)")
    parser.add_argument("--demo", action="store_true",
                        help="tiny GPT on the embedded corpus (builds the tape if needed), out runs/demo")
    parser.add_argument("--synthetic", action="store_true",
                        help="one update on random tokens, no corpus: a smoke test, not evidence of learning")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if field.name == "config":
            parser.add_argument(flag, choices=sorted(PRESETS), default=default, help="model preset")
        elif field.name == "grad_clip":
            parser.add_argument(flag, type=grad_clip_value, default=default, metavar="NORM|none",
                                help=f"global gradient-norm clipping, > 0, or none; default {default!r}")
        elif field.name == "format_steps":
            parser.add_argument(flag, choices=FORMAT_STEPS, default=default,
                                help="with --track-format: count every step (all) or only the logged ones "
                                     f"(logged: no counting cost on the others); default {default!r}")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=FLAG_HELP.get(field.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=FLAG_HELP.get(field.name, "") + f"default {default!r}")
    # Flags given explicitly override the demo's settings, which override the defaults.
    namespace = argparse.Namespace(**DEMO) if "--demo" in (sys.argv[1:] if argv is None else argv) else None
    args = parser.parse_args(argv, namespace)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        check_config(config)
        if args.synthetic and config.parallel != "none":
            raise ConfigError(f"--parallel {config.parallel}: --synthetic is one update in one process; "
                              "leave out --parallel")
    except ConfigError as error:
        parser.error(str(error))  # one line on stderr, exit code 2
    return config, args


def _rank() -> int:
    if _distributed_ready():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def main(argv=None) -> int:
    config, args = parse_args(argv)
    try:
        if args.synthetic:
            result = synthetic_smoke(config)
            print("SYNTHETIC SMOKE TEST (random tokens, one update): checks that the code runs, "
                  "NOT evidence of learning")
            print(json.dumps(result))
            return 0 if result["loss_finite"] and result["tensors_changed"] >= result["tensors_required"] else 1
        summary = train(config)
    except (CheckpointError, ConfigError, TapeError, CorpusNotInstalledError) as error:
        where = f" (rank {_rank()})" if config.parallel != "none" else ""
        print(f"error{where}: {error}", file=sys.stderr)
        return 2
    if _rank() != 0:
        return 0
    print(f"\nstopped because: {summary['stopped_because']} at step {summary['step']}")
    for key in ("final_train_loss_mean_last_50", "val_bpb", "tokens_per_s", "median_fwd_bwd_ms",
                "median_optimizer_ms", "log", "plot", "format_plot", "checkpoint"):
        if key not in summary:
            continue
        value = summary[key]
        print(f"  {key:30s} {value:.4f}" if isinstance(value, float) else f"  {key:30s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
