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
  dims meaning the same. The kernel reads the local shard as its int16 view. Any 16-bit code
  entry (Muon's momentum codes) is stored so too;
- a per-matrix entry (Muon's packed exponent, shape ()) is replicated on the parameter's mesh.

`stored_layout`, `wrap_entry` and `kernel_entry` do this for any `StateEntry` (core/rule.py);
the functions after them are their readings for the entries the step code names.
"""
from __future__ import annotations

import torch

from packed_adamw.core import StateFormat
from packed_adamw.core.rule import LOW_HALF, StateEntry

from ._state import TORCH_DTYPES, state_dtype

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


# ---- any state entry ---------------------------------------------------------------------------
def stored_layout(param: torch.Tensor, entry: StateEntry) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of the stored `entry` of `param` (a DTensor's: its global shape)."""
    dtype, shape = TORCH_DTYPES[entry.dtype], entry.shape(param.shape)
    if is_dtensor(param) and not entry.per_matrix:
        if dtype is torch.int16:
            return SHARDED_LOW_HALF_DTYPE, (*shape, 2)
        if dtype is torch.uint32:
            return SHARDED_WORDS_DTYPE, shape
    return dtype, shape


def wrap_entry(param: torch.Tensor, local_entry: torch.Tensor, entry: StateEntry, name: str,
               mode: str = "") -> torch.Tensor:
    """The stored `entry` for `param` from its local tensor: the local tensor itself for a plain
    parameter; for a DTensor, a DTensor on the parameter's mesh as the module's docstring lays
    each dtype out (a per-matrix entry replicated; the others sharded as the entry declares,
    `StateEntry.sharding`: the parameter's placements, moved past the entry's leading axes).
    `mode` names the state format's mode in the refusal of a placement leading axes cannot follow."""
    if not is_dtensor(param):
        return local_entry
    if entry.per_matrix:
        mesh = param.device_mesh  # the same value on every rank: each shard reads the whole matrix's
        return DTensor.from_local(local_entry, mesh, [Replicate()] * mesh.ndim, run_check=False,
                                  shape=local_entry.shape, stride=local_entry.stride())
    if local_entry.dtype is torch.int16:  # collectives carry no int16: int8 pairs in a trailing axis
        pairs = local_entry.unsqueeze(-1).view(SHARDED_LOW_HALF_DTYPE)
        return DTensor.from_local(pairs, param.device_mesh, param.placements, run_check=False,
                                  shape=(*param.shape, 2), stride=(*(2 * s for s in param.stride()), 1))
    if local_entry.dtype is torch.uint32:  # nor uint32: the words' bits as int32
        local_entry = local_entry.view(SHARDED_WORDS_DTYPE)
    shape = entry.shape(param.shape)
    if not entry.leading:  # the parameter's shape: it follows any placement the parameter has
        return DTensor.from_local(local_entry, param.device_mesh, param.placements, run_check=False, shape=shape,
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
                f"{name} is a DTensor with placement {placement}: mode={mode!r} keeps its state "
                f"({entry.key!r}) as one [{leading}, *shape] tensor and can follow Shard and Replicate placements "
                "only; use mode='packed', whose state has the parameter's shape and follows any placement"
            )
    leading_strides, inner = [], param.numel()  # the leading axes are outermost, laid out contiguously
    for size in reversed(entry.leading):
        leading_strides.insert(0, inner)
        inner *= size
    return DTensor.from_local(local_entry, param.device_mesh, placements, run_check=False, shape=shape,
                              stride=(*leading_strides, *param.stride()))


def kernel_entry(stored: torch.Tensor, entry: StateEntry) -> torch.Tensor:
    """The local tensor the step reads and writes of a stored `entry` (a view: writes reach the
    stored state): a DTensor's int8 pairs as int16, its int32 words as uint32."""
    if not is_dtensor(stored):
        return stored
    local_part = stored.to_local()
    if local_part.dtype == SHARDED_LOW_HALF_DTYPE:
        return local_part.view(torch.int16).squeeze(-1)
    if local_part.dtype == SHARDED_WORDS_DTYPE and entry.dtype == "uint32":
        return local_part.view(torch.uint32)
    return local_part


def new_entries(param: torch.Tensor, fmt, name: str) -> dict[str, torch.Tensor]:
    """A parameter's state entries before its first step, for any rule's state format `fmt`
    (`fmt.param_entries`: its state entry, its per-matrix exponent, a bf16 parameter's low half):
    zeros, each stored as `wrap_entry` lays it out. Zero codes read as zero moments, an
    exponent 0 as no scale, a zero low half as a master equal to its bf16 weight."""
    local_param = local(param)
    entries = {}
    for entry in fmt.param_entries(param.dtype is torch.bfloat16):
        dtype = TORCH_DTYPES[entry.dtype]
        # uint32 made as int32 and viewed: torch fills uint32 on every device only from 2.3 on
        zeros = torch.zeros(entry.shape(local_param.shape), dtype=torch.int32 if dtype is torch.uint32 else dtype,
                            device=local_param.device)
        entries[entry.key] = wrap_entry(param, zeros.view(dtype), entry, name, getattr(fmt, "mode", ""))
    return entries


# ---- the entries the step code names ----------------------------------------------------------------
def kernel_state(state: torch.Tensor) -> torch.Tensor:
    """The local state entry of an elementwise rule's words or moments as the step reads it:
    sharded int32 words are viewed as uint32 (anything else as stored, so that the step's layout
    check names a damaged entry's dtype)."""
    if is_dtensor(state):
        state = state.to_local()
        if state.dtype == SHARDED_WORDS_DTYPE:
            return state.view(torch.uint32)
    return state


def state_dtype_for(param: torch.Tensor, fmt: StateFormat) -> torch.dtype:
    """The dtype of the stored state of `param`."""
    return stored_layout(param, fmt.state_entry)[0]


def wrap_state(param: torch.Tensor, local_state: torch.Tensor, fmt: StateFormat, name: str) -> torch.Tensor:
    """The stored state entry for `param` from its local state (`wrap_entry`)."""
    return wrap_entry(param, local_state, fmt.state_entry, name, fmt.mode)


def kernel_low_half(low_half: torch.Tensor) -> torch.Tensor:
    """The local int16 low half as the step reads it (a view: writes reach the stored state)."""
    return kernel_entry(low_half, LOW_HALF)


def low_half_layout(param: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of the stored low half of bf16 `param`."""
    return stored_layout(param, LOW_HALF)


def wrap_low_half(param: torch.Tensor, local_low_half: torch.Tensor) -> torch.Tensor:
    """The stored low half for `param` from its local int16 one (`wrap_entry`)."""
    return wrap_entry(param, local_low_half, LOW_HALF, "")


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor of `param`'s layout from a local shard of it (a DTensor if `param` is one)."""
    if not is_dtensor(param):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def replicated(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A per-matrix state value of `param` (a 0-d tensor, Muon's packed exponent): itself for a
    plain parameter; for a DTensor, the same value on every rank, replicated on its mesh."""
    return wrap_entry(param, local, _PER_MATRIX_READING, "")


_PER_MATRIX_READING = StateEntry("per_matrix", "int32", per_matrix=True)


def summed_over_shards(param: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A per-rank count summed over the ranks that hold different parts of `param` (a replica
    counts once), so that a check made on it (`check_nonfinite`, a loaded state's values) refuses
    on every rank or on none."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    placements = [Partial() if isinstance(pl, Shard) else Replicate() for pl in param.placements]
    return DTensor.from_local(count, param.device_mesh, placements, run_check=False).full_tensor()


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
