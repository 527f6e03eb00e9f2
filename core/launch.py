"""How to launch a rule's kernels, shared by the torch and JAX launchers (no framework imports).

Everything a launcher needs besides its arrays: the launch kinds, the constexpr arguments for
a state format, the block sizes, the counter rows and the compile options that keep the bits
exact. Nothing here knows a rule: a state format (e.g. core/adamw's StateFormat) supplies its
own constexprs (`kernel_constexprs`) and its state entry (`state_entry`).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

# Compiled: two 16-byte vectors per thread and buffer was fastest in an H200 sweep
# (docs/results/BENCHMARKS.md).
GPU_BLOCK = 512
GPU_NUM_WARPS = 2
# The multi-tensor launch: 256 elements and 2 warps a program, one vector of 16 bytes per thread
# and buffer: captured steps of the reference GPT, GPT-2 and 1.3B lists took 0.550x / 0.629x /
# 0.618x fused AdamW's against 0.580x / 0.642x / 0.619x at GPU_BLOCK (H200 sweep,
# docs/results/SWEEP.md): smaller programs finish the short lists' tails sooner.
MULTI_TENSOR_BLOCK = 256
MULTI_TENSOR_NUM_WARPS = 2
# Tensors this large get a launch of their own instead of a share of the multi-tensor launch:
# its table lookups cost about 8% on a 268M-element tensor (docs/results/BENCHMARKS.md), while the GPU
# time of one such tensor (over 80 us on an H200) hides the extra launch's host cost.
SOLO_ELEMENTS = 1 << 24
# A leaf-group kernel's slots (core/kernel.py's `leaf_slot`): jax-triton passes buffers only as
# separate kernel arguments, never as a table of addresses (docs/MULTI_TENSOR.md), so a kernel
# over several leaves has one argument per leaf and buffer, this many of each. A launch of fewer
# leaves fills the rest with placeholders that no program reads, so one compiled kernel serves
# every group size; larger groups are split.
LEAF_GROUP_SLOTS = 16
# Interpreted (CPU tests): per-program overhead dominates, so one program takes a lot.
INTERPRETER_BLOCK = 1 << 15  # below the format counts' 16-bit fields (kernel.py)
# step_scalars_kernel: rows (tensors or leaves) per program.
SCALAR_BLOCK_ROWS = 128
# Exact bits need every multiply and add rounded on its own.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_size() -> int:
    return INTERPRETER_BLOCK if interpreting() else GPU_BLOCK


def grid(n_elements: int, block: int) -> tuple[int]:
    return ((n_elements + block - 1) // block,)


class LaunchKind(NamedTuple):
    """What a multi-tensor launch compiles for; its tensors share it (docs/MULTI_TENSOR.md,
    "bf16 weights with split masters"): FP32 parameters; bf16 parameters with split masters and
    FP32 gradients; the same with bf16 gradients. Ordered as the launches are made."""

    split: bool  # bf16 weights with split masters (each with an int16 low half)
    grad_bf16: bool  # bf16 gradients (else float32)

    @property
    def sections(self) -> int:
        """Address sections in a multi-tensor table: parameters, gradients, states (and low halves)."""
        return 4 if self.split else 3


FP32_KIND = LaunchKind(False, False)
SPLIT_FP32_GRAD_KIND = LaunchKind(True, False)
SPLIT_BF16_GRAD_KIND = LaunchKind(True, True)
LAUNCH_KINDS = (FP32_KIND, SPLIT_FP32_GRAD_KIND, SPLIT_BF16_GRAD_KIND)


# Per-tensor counters the kernels can add to, one int64 row per tensor: the non-finite
# (rejected) count at NONFINITE_COLUMN, then each of a rule's format counts (at most
# MAX_FORMAT_COUNTS, its `count_names` order) in FORMAT_SLOTS slots (a program adds to slot
# program_id % FORMAT_SLOTS, so a large tensor's programs do not all contend for one address);
# a reader sums the slots. Definitions: FORMAT.md, "Format counts". Read rows with the helpers
# below rather than with these offsets.
NONFINITE_COLUMN = 0
MAX_FORMAT_COUNTS = 6  # the kernels' lane fields (core/kernel.py) hold six counts
FORMAT_SLOTS = 32
COUNTER_ROW = 1 + MAX_FORMAT_COUNTS * FORMAT_SLOTS


def format_count_columns(index: int) -> slice:
    """The columns of a counter row that hold format count `index`'s slots."""
    if not 0 <= index < MAX_FORMAT_COUNTS:
        raise IndexError(f"format count {index} is outside [0, {MAX_FORMAT_COUNTS})")
    start = NONFINITE_COLUMN + 1 + index * FORMAT_SLOTS
    return slice(start, start + FORMAT_SLOTS)


def first_slot_columns() -> slice:
    """Slot 0 of every format count: where a host-side step adds its counts."""
    return slice(NONFINITE_COLUMN + 1, COUNTER_ROW, FORMAT_SLOTS)


def nonfinite_counts(rows):
    """[tensors, COUNTER_ROW] counters -> each tensor's non-finite count (numpy, torch or jnp)."""
    return rows[:, NONFINITE_COLUMN]


def sum_counter_slots(rows):
    """[tensors, COUNTER_ROW] counters -> [tensors, MAX_FORMAT_COUNTS] format counts (numpy,
    torch or jnp arrays)."""
    return rows[:, NONFINITE_COLUMN + 1:].reshape(len(rows), MAX_FORMAT_COUNTS, FORMAT_SLOTS).sum(axis=2)


# A counting launch of a single-tensor kernel gives each program several blocks, so that its
# reductions and atomics are paid once for all of them, and runs more warps. How a program of
# several blocks lays them out is kernel._adamw_programs' LAYOUT. These are the shapes the H200
# timed fastest (docs/results/SWEEP.md records the sweeps); they are facts of the product, not
# settings: the launchers cache (torch) or trace (jax.jit) what `single_tensor_constants` gives.
COUNTING_BLOCKS_PER_PROGRAM = 16  # consecutive counting launches: fp32 mode, bf16 split non-finite only
LAID_OUT_BLOCKS_PER_PROGRAM = 8  # launches laid out once
COUNTING_NUM_WARPS = 4
LAYOUT_CONSECUTIVE = 0  # each block's addresses computed afresh (any mode)
LAYOUT_SHIFTED = 1  # pointers moved once to the program's first element, int32 offsets (not fp32 mode)
LAYOUT_PREFETCHED = 2  # SHIFTED, each block's loads issued before the block before it is stepped


def single_tensor_constants(fmt, *, write_update: bool, count_nonfinite: bool, block: int,
                            track_format: bool = False, split: bool = False) -> dict:
    """`kernel_constants` for `adamw_kernel` / `adamw_split_kernel`, with the blocks each
    program takes; launch them on `single_tensor_grid` with `single_tensor_warps`."""
    constants = kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block,
                                 track_format=track_format, split=split)
    counting = (count_nonfinite or track_format) and not interpreting()
    layout = LAYOUT_CONSECUTIVE
    if counting and track_format:  # (track_format: never fp32 mode) bf16 split: prefetching was slower
        layout = LAYOUT_SHIFTED if split else LAYOUT_PREFETCHED
    elif counting and not fmt.state_entry.leading and not split:  # non-finite counts only, one word per element
        # (fp32 mode's moments are never laid out; split weights' launch was never timed laid out)
        layout = LAYOUT_PREFETCHED
    constants["BLOCKS_PER_PROGRAM"] = (LAID_OUT_BLOCKS_PER_PROGRAM if layout != LAYOUT_CONSECUTIVE
                                       else COUNTING_BLOCKS_PER_PROGRAM if counting else 1)
    constants["LAYOUT"] = layout  # passed always: jax-triton fills in no default constexpr
    return constants


def single_tensor_grid(n_elements: int, constants: dict) -> tuple[int]:
    """The grid of `adamw_kernel` / `adamw_split_kernel` launched with `constants`."""
    return grid(n_elements, constants["BLOCK"] * constants.get("BLOCKS_PER_PROGRAM", 1))


def single_tensor_warps(constants: dict) -> int:
    return COUNTING_NUM_WARPS if constants.get("BLOCKS_PER_PROGRAM", 1) > 1 else GPU_NUM_WARPS


def kernel_constants(fmt, *, write_update: bool | None, count_nonfinite: bool, block: int,
                     track_format: bool = False, split: bool = False) -> dict:
    """The constexpr keyword arguments of a rule's single-tensor kernel (`adamw_kernel`) for the
    state format `fmt` (its `kernel_constexprs`), with `write_update=None`: for the multi-tensor
    kernel, which always works in place; `split=True` with `write_update=False`: for the split
    kernel, bf16 weights with split masters. `count_nonfinite` and `track_format` make the
    kernel add to the tensor's counter row."""
    constants = dict(
        **fmt.kernel_constexprs(track_format=track_format),
        WRITE_UPDATE=write_update, COUNT_NONFINITE=count_nonfinite, TRACK_FORMAT=track_format, BLOCK=block,
    )
    if write_update is None:  # the multi-tensor kernel, which takes SPLIT as an argument
        del constants["WRITE_UPDATE"]
        constants["SPLIT"] = split
    elif split:
        if write_update:
            raise ValueError("adamw_split_kernel writes the new weight: write_update must be False")
        del constants["WRITE_UPDATE"]
    return constants


def block_table(numels: list[int], block: int) -> tuple[np.ndarray, np.ndarray]:
    """For the multi-tensor kernel: each program's (tensor index, block index in that tensor)."""
    blocks = np.array([(n + block - 1) // block for n in numels], dtype=np.int64)
    block_tensor = np.repeat(np.arange(len(numels), dtype=np.int32), blocks)
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    block_index = (np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(starts, blocks)).astype(np.int32)
    return block_tensor, block_index
