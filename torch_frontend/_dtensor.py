"""How the optimizer state follows DTensor parameters (FSDP2's `fully_shard`, tensor parallel).

The step is elementwise, so each rank updates its local shard with the same kernel (numpy on
CPU) and no communication. The state of a DTensor parameter is a DTensor on the parameter's
mesh, so `state_dict()` is sharded like the model's and torch.distributed.checkpoint saves,
loads and reshards it:

- packed and fp16 words have the parameter's shape and placements. They are stored as
  **int32** DTensors holding the words' bits: torch.distributed's collectives do not carry
  uint32 (an all-gather over gloo, as in `full_tensor()`, fails with "Invalid scalar type"),
  while int32 travels everywhere. The kernel reads the local shard as a uint32 view, so the
  bits are the words' bits either way;
- fp32 moments are [2, *shape] float32; a parameter sharded on dim d has them sharded on d+1
  (the state entry's declared sharding, `StateEntry.sharded_axis`);
- a bf16 parameter's low half (FORMAT.md, "Split masters"; int16 in a plain state) is stored as
  an **int8** DTensor of shape [*shape, 2] holding the low halves' bytes: the collectives carry
  no int16 either, while a trailing pair dimension keeps every placement of the parameter's
  dims meaning the same. The kernel reads the local shard as its int16 view.
"""
from __future__ import annotations

import torch

from packed_adamw.core import StateFormat

from ._state import LOW_HALF_DTYPE, state_dtype

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch build without distributed support
    DTensor = None

SHARDED_WORDS_DTYPE = torch.int32
SHARDED_LOW_HALF_DTYPE = torch.int8  # two per low half, in a trailing dimension


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel works on: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def kernel_state(state: torch.Tensor) -> torch.Tensor:
    """The local state as the step reads it: sharded int32 words are viewed as uint32."""
    if is_dtensor(state):
        state = state.to_local()
        if state.dtype == SHARDED_WORDS_DTYPE:
            return state.view(torch.uint32)
    return state


def state_dtype_for(param: torch.Tensor, fmt: StateFormat) -> torch.dtype:
    """The dtype of the stored state of `param`."""
    plain = state_dtype(fmt)
    return SHARDED_WORDS_DTYPE if plain is torch.uint32 and is_dtensor(param) else plain


def wrap_state(param: torch.Tensor, local_state: torch.Tensor, fmt: StateFormat, name: str) -> torch.Tensor:
    """The stored state for `param` from its local state (the state entry's local shard:
    uint32 words, or fp32 mode's float32 [2, *local]): the local tensor itself for a plain
    parameter, otherwise a DTensor sharded as the entry declares (`StateEntry.sharding`: the
    parameter's placements, moved past the entry's leading axes)."""
    if not is_dtensor(param):
        return local_state
    entry = fmt.state_entry
    shape = entry.shape(param.shape)
    if state_dtype(fmt) is torch.uint32:
        local_state = local_state.view(SHARDED_WORDS_DTYPE)
    if not entry.leading:  # the parameter's shape: it follows any placement the parameter has
        return DTensor.from_local(local_state, param.device_mesh, param.placements, run_check=False, shape=shape,
                                  stride=param.stride())
    placements = []
    for placement in param.placements:
        if type(placement) is Shard:
            placements.append(Shard(entry.sharded_axis(placement.dim)))
        elif isinstance(placement, Replicate):
            placements.append(placement)
        else:
            leading = ", ".join(map(str, entry.leading))
            raise NotImplementedError(
                f"{name} is a DTensor with placement {placement}: mode={fmt.mode!r} keeps its state "
                f"({entry.key!r}) as one [{leading}, *shape] tensor and can follow Shard and Replicate placements "
                "only; use mode='packed', whose state has the parameter's shape and follows any placement"
            )
    leading_strides, inner = [], param.numel()  # the leading axes are outermost, laid out contiguously
    for size in reversed(entry.leading):
        leading_strides.insert(0, inner)
        inner *= size
    return DTensor.from_local(local_state, param.device_mesh, placements, run_check=False, shape=shape,
                              stride=(*leading_strides, *param.stride()))


def kernel_low_half(low_half: torch.Tensor) -> torch.Tensor:
    """The local int16 low half as the step reads it (a view: writes reach the stored state)."""
    if is_dtensor(low_half):
        local_pairs = low_half.to_local()
        if local_pairs.dtype == SHARDED_LOW_HALF_DTYPE:
            return local_pairs.view(torch.int16).squeeze(-1)
        return local_pairs
    return low_half


def low_half_layout(param: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of the stored low half of bf16 `param`."""
    if is_dtensor(param):
        return SHARDED_LOW_HALF_DTYPE, (*param.shape, 2)
    return LOW_HALF_DTYPE, tuple(param.shape)


def wrap_low_half(param: torch.Tensor, local_low_half: torch.Tensor) -> torch.Tensor:
    """The stored low half for `param` from its local int16 one: the tensor itself for a plain
    parameter; for a DTensor, int8 pairs on the parameter's mesh with its placements."""
    if not is_dtensor(param):
        return local_low_half
    pairs = local_low_half.unsqueeze(-1).view(SHARDED_LOW_HALF_DTYPE)
    stride = (*(2 * s for s in param.stride()), 1)
    return DTensor.from_local(pairs, param.device_mesh, param.placements, run_check=False,
                              shape=(*param.shape, 2), stride=stride)


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor of `param`'s layout from a local shard of it (a DTensor if `param` is one)."""
    if not is_dtensor(param):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def replicated(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A per-matrix state value of `param` (a 0-d tensor, Muon's packed exponent): itself for a
    plain parameter; for a DTensor, the same value on every rank, replicated on its mesh (never
    sharded: each rank's shard reads the whole matrix's value)."""
    if not is_dtensor(param):
        return local
    mesh = param.device_mesh
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False, shape=local.shape,
                              stride=local.stride())


def is_replicated_on(t, param: torch.Tensor) -> bool:
    """Whether `t` is laid out as `replicated` lays out a value of `param`."""
    if not is_dtensor(param):
        return not is_dtensor(t)
    return is_dtensor(t) and t.device_mesh == param.device_mesh and all(isinstance(pl, Replicate)
                                                                         for pl in t.placements)


def describe(t) -> str:
    if is_dtensor(t):
        return f"a DTensor on {t.device_mesh} with placements {tuple(t.placements)}"
    return "a plain tensor"
