"""The trainer's optimizers (`--optimizer`): one object per kind, which knows how to build it,
which settings it refuses, whether checkpoints can hold its state, what telemetry it offers
and how many bytes its state takes. The loop asks these objects and never names a kind.

Besides PackedAdamW and torch.optim.AdamW, the peers: other packages' low-memory AdamWs for
the comparison table (benchmarks/peers.py). None of them is a dependency of packed_adamw:
each is imported when chosen.

Muon + AdamW (docs/MUON.md): `muon` is torch.optim.Muon (FP32 momentum) on the block matrices
with torch's fused AdamW on the rest, the baseline; `packed-muon` is PackedMuonAdamW, its Muon
momentum in --muon-mode's format and its AdamW part in --mode's. Both split the parameters by
the model's own `optimizer_groups(config)` where it has one, else by `muon_param_groups`.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from packed_adamw.core import muon as muon_rules

from ..combined import PackedMuonAdamW, muon_param_groups
from ..optimizer import PackedAdamW
from .config import ConfigError, TrainConfig


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    """torch.optim.AdamW (the baseline), and what every kind shares."""

    name: str
    fused: bool = False  # torch AdamW's fused=True on CUDA (the foreach implementation on the CPU)
    # whether its state fits the trainer's safetensors checkpoints (plain tensors and JSON scalars)
    checkpoints: bool = True
    split_masters: bool = False  # bf16 parameters get exact FP32 masters (the others step the weights)
    # TrainConfig fields that this kind alone reads: part of its runs' trajectory (checkpoints)
    own_settings: tuple = ()
    # it steps with PackedAdamW (PackedMuonAdamW's AdamW rule), reading --mode, --m-bias and --rms-bias, and
    # counts its formats under --track-format
    packed_format: bool = False

    def check(self, config: TrainConfig) -> None:
        """Refuse the settings this kind cannot run with (ConfigError naming the option)."""

    def check_telemetry(self, config: TrainConfig) -> None:
        """Refuse telemetry this kind does not offer: only the packed optimizers' formats can be counted."""
        if config.log_moment_stats:
            raise ConfigError("--log-moment-stats needs --mode fp32 (it reads float32 moments)")
        if config.track_format and not self.packed_format:
            raise ConfigError(f"--track-format logs the packed optimizers' format counts, and --optimizer "
                              f"{config.optimizer} keeps none: use --optimizer packed-adamw (--mode packed or fp16) "
                              "or packed-muon")

    def run_name(self, config: TrainConfig) -> str:
        """What names the run's default --out directory."""
        return self.name

    def describe(self, config: TrainConfig) -> str:
        return f"optimizer {self.name}"

    def build(self, model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        common = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
        fused = self.fused and all(p.device.type == "cuda" for p in model.parameters())
        return torch.optim.AdamW(param_groups(model, config), **common, **({"fused": fused} if self.fused else {}))

    def start_masters(self, optimizer, model: torch.nn.Module, initial: dict[str, torch.Tensor] | None) -> None:
        """A fresh run's optimizer state from the FP32 initialisation; none here: torch AdamW on
        bf16 parameters has no masters and starts from the weights."""

    def trained_values(self, optimizer, model: torch.nn.Module, param_dtype: str) -> list[torch.Tensor]:
        """What a step moves (the smoke test compares them before and after)."""
        return [p.detach().clone() for p in model.parameters()]

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return optimizer_state_bytes(optimizer)


@dataclasses.dataclass(frozen=True)
class PackedAdamWKind(OptimizerKind):
    split_masters: bool = True
    packed_format: bool = True

    def check_telemetry(self, config: TrainConfig) -> None:
        if config.log_moment_stats and config.mode != "fp32":
            raise ConfigError("--log-moment-stats needs --mode fp32 (it reads float32 moments)")
        if config.track_format and config.mode == "fp32":
            raise ConfigError("--track-format counts where packed or fp16 codes saturate, flush or go subnormal, "
                              "and --mode fp32 stores float32 moments: use --mode packed or fp16, or "
                              "--log-moment-stats for what fp32 moments would do in the packed formats")

    def run_name(self, config: TrainConfig) -> str:
        return config.mode

    def describe(self, config: TrainConfig) -> str:
        return f"optimizer {self.name} mode {config.mode}"

    def build(self, model: torch.nn.Module, config: TrainConfig) -> PackedAdamW:
        return PackedAdamW(param_groups(model, config), lr=config.lr, betas=(config.beta1, config.beta2),
                           eps=config.eps, mode=config.mode, m_bias=config.m_bias, rms_bias=config.rms_bias,
                           track_format=config.track_format)

    def start_masters(self, optimizer: PackedAdamW, model: torch.nn.Module,
                      initial: dict[str, torch.Tensor] | None) -> None:
        """A fresh bf16 run: the split masters start at the exact FP32 initialisation (the
        weights stay its bf16 rounding, the low halves take the rest), as an FP32 run's
        parameters do."""
        if initial is None:
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

    def trained_values(self, optimizer: PackedAdamW, model: torch.nn.Module, param_dtype: str) -> list[torch.Tensor]:
        # a split run's step moves the masters, the weights may not
        return optimizer.master_weights() if param_dtype != "fp32" else super().trained_values(optimizer, model,
                                                                                                param_dtype)


@dataclasses.dataclass(frozen=True)
class Peer(OptimizerKind):
    """A low-memory AdamW of another package. torchao keeps its moments as tensor subclasses,
    which safetensors cannot hold, so its runs need --no-checkpoints (a run then restarts from
    step 0 rather than resuming)."""

    module: str = ""
    class_name: str = ""
    pip: str = ""  # what to run when the import fails
    options: tuple = ()  # (name, value) pairs for the constructor beyond lr, betas, eps, weight_decay
    fp32_weight_options: tuple = ()  # more pairs when the parameters are FP32 (--param-dtype fp32)

    def optimizer_class(self) -> type:
        """Imported now (ConfigError naming the pip command if absent)."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as error:
            raise ConfigError(f"--optimizer {self.name} needs the {self.module.split('.')[0]} package, which is "
                              f"not installed ({error}): {self.pip}") from None
        return getattr(module, self.class_name)

    def check(self, config: TrainConfig) -> None:
        self.optimizer_class()
        if config.checkpoints and not self.checkpoints:
            raise ConfigError(f"--optimizer {self.name} keeps its state in tensor subclasses, which the "
                              "trainer's safetensors checkpoints cannot hold: pass --no-checkpoints (the run "
                              "cannot then resume, and restarts from step 0)")
        if config.parallel != "none":
            raise ConfigError(f"--optimizer {self.name} runs in one process here: leave out --parallel")

    def build(self, model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        # The same groups without the names, which not every peer takes
        plain = [{**group, "params": [p for _, p in group["params"]]} for group in param_groups(model, config)]
        options = dict(self.options) | (dict(self.fp32_weight_options) if config.param_dtype == "fp32" else {})
        return self.optimizer_class()(plain, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                      **options)


class TorchMuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups with kind="muon" and torch.optim.AdamW for those with
    kind="adamw", stepped as one optimizer: its param_groups are the two optimizers' own group
    dicts (a learning-rate change reaches the one that steps the group) and the two share its
    state, so torch's state_dict and load_state_dict cover both."""

    def __init__(self, params, *, muon: dict, adamw: dict):
        self._options = {"muon": muon, "adamw": adamw}
        self._rules: dict[str, torch.optim.Optimizer] = {}
        super().__init__(params, {})

    def add_param_group(self, param_group: dict) -> None:
        kind = param_group.get("kind")
        if kind not in self._options:
            raise ValueError(f"param_groups[{len(self.param_groups)}] has kind={kind!r}: each group says which "
                             "rule steps it, 'muon' or 'adamw'")
        rule = self._rules.get(kind)
        if rule is None:
            rule = (torch.optim.Muon if kind == "muon" else torch.optim.AdamW)([param_group], **self._options[kind])
            rule.state = self.state  # one state: torch's state_dict packs every parameter's
            self._rules[kind] = rule
        else:
            rule.add_param_group(param_group)
        self.param_groups.append(rule.param_groups[-1])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for rule in self._rules.values():
            rule.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch's loader made new group dicts and a new state: the rules take them
        for kind, rule in self._rules.items():
            rule.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            rule.state = self.state


def muon_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """Muon's and AdamW's param groups (each with "kind"), AdamW's first (the log's "lr" is the
    first group's: the --lr schedule).

    The split is the model's own `model.optimizer_groups(config)` where it has that method (its
    groups are taken as they are, each option it leaves out at the kind's default), else
    `muon_param_groups(model)`: Muon for the block matrices with --weight-decay, AdamW for the
    embeddings (with --weight-decay) and the 1-D parameters (biases, LayerNorms: none), as the
    AdamW kinds decay. A Muon group's learning rate is the schedule's times
    `lr_scale` = --muon-lr / --lr (a group from the model keeps its own lr_scale)."""
    hook = getattr(model, "optimizer_groups", None)
    if callable(hook):
        groups = [dict(group) for group in hook(config)]
    else:
        groups = []
        for group in muon_param_groups(model):
            if group["kind"] == "muon":
                groups.append({**group, "weight_decay": config.weight_decay})
                continue
            pairs = list(zip(group["param_names"], group["params"]))
            for decayed, weight_decay in ((True, config.weight_decay), (False, 0.0)):
                chosen = [(n, p) for n, p in pairs if (p.dim() >= 2) == decayed]
                if chosen:
                    groups.append({"params": [p for _, p in chosen], "param_names": [n for n, _ in chosen],
                                   "kind": "adamw", "weight_decay": weight_decay})
    listed = [id(p) for group in groups for p in group["params"]]
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    where = f"{type(model).__name__}.optimizer_groups" if callable(hook) else "muon_param_groups"
    if any(group.get("kind") not in ("muon", "adamw") for group in groups):
        raise ConfigError(f"--optimizer {config.optimizer}: every group of {where} needs kind 'muon' or 'adamw', "
                          f"got {[group.get('kind') for group in groups]}")
    if len(listed) != len(set(listed)) or set(listed) != trained:
        raise ConfigError(f"--optimizer {config.optimizer}: the groups of {where} must list every trained "
                          f"parameter once ({len(listed)} listed, {len(set(listed))} distinct, {len(trained)} "
                          "trained)")
    for group in groups:
        if group["kind"] == "muon":
            group.setdefault("lr_scale", config.muon_lr / config.lr)
    return sorted(groups, key=lambda group: group["kind"] != "adamw")  # stable: each kind keeps its order


@dataclasses.dataclass(frozen=True)
class MuonKind(OptimizerKind):
    """torch.optim.Muon (FP32 momentum) for the block matrices and torch's AdamW (fused on CUDA)
    for the rest: the Muon rows' baseline."""

    own_settings: tuple = ("muon_lr", "muon_momentum")

    def check(self, config: TrainConfig) -> None:
        # each checked with the others at values Muon's rules accept, so the error names the one at fault
        for option, value, arguments in (("--muon-lr", config.muon_lr, (config.muon_lr, 0.95, 0.0, 1e-7)),
                                         ("--muon-momentum", config.muon_momentum,
                                          (0.02, config.muon_momentum, 0.0, 1e-7))):
            try:
                muon_rules.validate_hyperparams(*arguments)
            except ValueError as error:
                raise ConfigError(f"{option} {value}: {error}") from None
        if config.parallel == "fsdp":
            raise ConfigError(f"--optimizer {self.name}: Muon orthogonalises whole matrices, and FSDP2 shards "
                              "them: use --parallel ddp or none")

    def describe(self, config: TrainConfig) -> str:
        return f"optimizer {self.name} (Muon lr {config.muon_lr}, momentum {config.muon_momentum}; AdamW lr {config.lr})"

    def build(self, model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        fused = all(p.device.type == "cuda" for p in model.parameters())
        return TorchMuonAdamW(
            muon_groups(model, config),
            muon=dict(lr=config.muon_lr, weight_decay=config.weight_decay, momentum=config.muon_momentum),
            adamw=dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                       weight_decay=config.weight_decay, fused=fused))


@dataclasses.dataclass(frozen=True)
class PackedMuonKind(MuonKind):
    """PackedMuonAdamW: Muon's momentum in --muon-mode's format, AdamW's moments in --mode's (a
    group of the model's `optimizer_groups` that names its own `mode` or biases keeps them; its
    state bytes are measured, so they count each group's format); with --param-dtype bf16 every
    rule keeps exact FP32 split masters."""

    split_masters: bool = True
    own_settings: tuple = ("muon_lr", "muon_momentum", "muon_mode")
    packed_format: bool = True

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        if config.muon_mode not in muon_rules.MODES:
            raise ConfigError(f"--muon-mode {config.muon_mode}: choose one of {', '.join(muon_rules.MODES)} "
                              "(the Muon momentum's format)")

    def run_name(self, config: TrainConfig) -> str:
        return f"{self.name}-{config.muon_mode}"

    def describe(self, config: TrainConfig) -> str:
        return (f"optimizer {self.name} (Muon momentum {config.muon_mode}, lr {config.muon_lr}, momentum "
                f"{config.muon_momentum}; AdamW mode {config.mode}, lr {config.lr})")

    def build(self, model: torch.nn.Module, config: TrainConfig) -> PackedMuonAdamW:
        return PackedMuonAdamW(
            muon_groups(model, config), lr=config.muon_lr, weight_decay=config.weight_decay,
            momentum=config.muon_momentum, mode=config.muon_mode, adamw_lr=config.lr,
            adamw_betas=(config.beta1, config.beta2), adamw_eps=config.eps, adamw_weight_decay=config.weight_decay,
            adamw_mode=config.mode, m_bias=config.m_bias, rms_bias=config.rms_bias, track_format=config.track_format)

    def start_masters(self, optimizer: PackedMuonAdamW, model: torch.nn.Module,
                      initial: dict[str, torch.Tensor] | None) -> None:
        """As PackedAdamWKind's: each rule's split masters start at the FP32 initialisation (every
        rule optimizer of `rules`: one per kind and state format)."""
        if initial is None:
            return
        name_of = {id(p): name for name, p in model.named_parameters()}
        for rule in optimizer.rules.values():
            rule.load_master_weights([initial[name_of[id(p)]] for g in rule.param_groups for p in g["params"]])

    def trained_values(self, optimizer: PackedMuonAdamW, model: torch.nn.Module,
                       param_dtype: str) -> list[torch.Tensor]:
        return optimizer.master_weights() if param_dtype != "fp32" else super().trained_values(optimizer, model,
                                                                                                param_dtype)


_TORCHAO = "pip install torchao==0.18.0"
KINDS = (
    PackedAdamWKind("packed-adamw"),
    OptimizerKind("torch-adamw"),
    OptimizerKind("torch-adamw-fused", fused=True),
    MuonKind("muon"),
    PackedMuonKind("packed-muon"),
    # bitsandbytes: blockwise 8-bit moments for tensors of >= 4096 elements (its min_8bit_size), FP32 below
    Peer("bnb-adamw8bit", module="bitsandbytes.optim", class_name="AdamW8bit", pip="pip install bitsandbytes==0.50.2"),
    # torchao: blockwise quantized moments (tensor subclasses) for tensors of >= 4096 elements whose size
    # its block (256; 128 for 4-bit) divides, FP32 moments otherwise (the reference GPT's 12,095 x 288 embedding)
    Peer("torchao-adamw8bit", module="torchao.optim", class_name="AdamW8bit", pip=_TORCHAO, checkpoints=False),
    Peer("torchao-adamw4bit", module="torchao.optim", class_name="AdamW4bit", pip=_TORCHAO, checkpoints=False),
    Peer("torchao-adamwfp8", module="torchao.optim", class_name="AdamWFp8", pip=_TORCHAO, checkpoints=False),
    # FlashOptim: 8-bit moments; on bf16 parameters 24-bit masters (bf16 weight + int8 correction).
    # decouple_lr=False is torch AdamW's weight decay (param *= 1 - lr * weight_decay).
    Peer("flashoptim-adamw", module="flashoptim", class_name="FlashAdamW", pip="pip install flashoptim==0.1.4",
         options=(("decouple_lr", False),),
         # its default 24-bit masters refuse FP32 parameters, which need none
         fp32_weight_options=(("master_weight_bits", None),)),
)
OPTIMIZER_KINDS = {kind.name: kind for kind in KINDS}
OPTIMIZERS = tuple(OPTIMIZER_KINDS)
PEERS = {kind.name: kind for kind in KINDS if isinstance(kind, Peer)}


def optimizer_kind(name: str) -> OptimizerKind:
    """The kind `--optimizer name` chooses (ConfigError listing the choices for another name)."""
    if name not in OPTIMIZER_KINDS:
        raise ConfigError(f"--optimizer {name}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZER_KINDS[name]


def peer_class(name: str) -> type:
    """The optimizer class of peer `name`, imported now (ConfigError naming the pip command if absent)."""
    return PEERS[name].optimizer_class()


def param_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """Weight decay on matrices and embeddings, none on biases and LayerNorms; (name, parameter) pairs."""
    named = list(model.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate: the schedule's `lr` times the group's `lr_scale` (Muon's
    groups: --muon-lr / --lr; other groups have none)."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if isinstance(group["lr"], torch.Tensor):  # torchao's compiled step reads lr from a tensor it owns
            group["lr"].fill_(value)
        else:
            group["lr"] = value


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
