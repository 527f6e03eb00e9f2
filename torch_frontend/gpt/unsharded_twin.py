"""FSDP2 and the entire-state file: a run of sharded parameters saves and loads its training
state as one process's (training_state.py), through an unsharded twin of the model and its
optimizer on the CPU that rank 0 holds.

The optimizer state of a sharded parameter keeps its bits in the types the collectives carry
(torch_frontend/_dtensor.py): `whole_state_entry` and `sharded_state_entry` convert an entry
between that layout and a single process's."""
from __future__ import annotations

from collections.abc import Callable

import torch

from packed_adamw.core.muon.rule import MOMENTUM_EXPONENT
from packed_adamw.torch import _dtensor


def is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def like_param(value: torch.Tensor, param: torch.Tensor, placements=None) -> torch.Tensor:
    """A whole tensor laid out like `param`: its shard on this rank when `param` is a DTensor.
    Every rank holds the same whole tensor (one seed, one file), so each cuts its own shard
    (src_data_rank=None: no communication)."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import distribute_tensor
    local = param.to_local()
    return distribute_tensor(value.to(local.device).contiguous(), param.device_mesh,
                             placements if placements is not None else param.placements, src_data_rank=None)


def whole_state_entry(value):
    """An optimizer state entry of a sharded parameter as a single process holds it, on the CPU
    (collective: every rank gathers). Sharded entries keep their bits in types the collectives
    carry (_dtensor.py, muon.py): int8 pairs [*shape, 2] for the int16 low halves and Muon codes,
    int32 for the uint32 AdamW words; these are viewed back. A per-matrix entry (Muon's int32
    exponent, 0-d, replicated) is taken as it is."""
    if not is_dtensor(value):
        return value
    whole = value.full_tensor().cpu()
    if whole.dim() == 0:
        return whole
    if whole.dtype == _dtensor.SHARDED_LOW_HALF_DTYPE:
        return whole.view(torch.int16).squeeze(-1)
    if whole.dtype == _dtensor.SHARDED_WORDS_DTYPE:
        return whole.view(torch.uint32)
    return whole


def sharded_state_entry(key: str, value, param: torch.Tensor):
    """The inverse of whole_state_entry: a single process's state entry of `param`, as the
    sharded optimizer stores it (this rank's shard; a per-matrix entry replicated on its mesh)."""
    from torch.distributed.tensor import Shard
    if not isinstance(value, torch.Tensor) or not is_dtensor(param):
        return value
    if key == MOMENTUM_EXPONENT.key:
        return _dtensor.replicated(param, value.to(param.to_local().device))
    if value.dim() == 0:
        return value
    if value.dtype == torch.int16:
        return like_param(value.unsqueeze(-1).view(_dtensor.SHARDED_LOW_HALF_DTYPE), param)
    if value.dtype == torch.uint32:
        return like_param(value.view(_dtensor.SHARDED_WORDS_DTYPE), param)
    if value.dim() == param.dim() + 1:  # fp32 AdamW moments [2, *shape]: sharded one dimension further in
        return like_param(value, param, [Shard(pl.dim + 1) if type(pl) is Shard else pl for pl in param.placements])
    return like_param(value, param)


class UnshardedTwin:
    """Under FSDP2, a plain copy of the model and its optimizer on the CPU that holds the whole
    training state, for training_state.py to save and load as a single process's.

    Allocated on the meta device and materialised uninitialised, and under fork_rng: building
    it draws no random numbers (a state records the generators)."""

    def __init__(self, build_model: Callable[[], torch.nn.Module],
                 build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]):
        """`build_model()`: the model as the run builds it (its weights' dtype); called on the meta
        device. `build_optimizer(model)`: the run's optimizer over the CPU copy."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build_model()
        self.model = model.to_empty(device="cpu")
        self.optimizer = build_optimizer(self.model)

    @staticmethod
    def gather(twin: "UnshardedTwin | None", model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank gathers the sharded weights and optimizer state, tensor by
        tensor in the same order, and rank 0 loads them into its `twin` (the other ranks pass
        None and drop what they gathered)."""
        weights = {name: whole_state_entry(p.detach()) for name, p in model.named_parameters()}
        saved = optimizer.state_dict()
        state = {index: {key: whole_state_entry(v) for key, v in entry.items()}
                 for index, entry in saved["state"].items()}
        if twin is not None:
            twin.model.load_state_dict(weights)
            twin.optimizer.load_state_dict({**saved, "state": state})

    def scatter(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """This rank's shards of the twin's weights and optimizer state into the sharded model and
        optimizer (no communication: every rank's twin holds the same whole state)."""
        twin_names = [name for name, _ in self.model.named_parameters()]
        if twin_names != [name for name, _ in model.named_parameters()]:
            raise AssertionError("the sharded model and its unsharded twin list other parameters")
        with torch.no_grad():
            for (_, p), (_, whole) in zip(model.named_parameters(), self.model.named_parameters()):
                p.copy_(like_param(whole, p))
        saved = self.optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {index: {key: sharded_state_entry(key, v, params[index]) for key, v in entry.items()}
                 for index, entry in saved["state"].items()}
        optimizer.load_state_dict({**saved, "state": state})
