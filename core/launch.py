"""How to launch the kernel, shared by the torch and JAX launchers (no framework imports).

Everything a launcher needs besides its arrays: the constexpr arguments for a state format,
the block size and the compile options that keep the bits exact.
"""
from __future__ import annotations

import os

import numpy as np

from .formats import MODE_IDS, StateFormat

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


# Per-tensor counters the kernels can add to, one int64 row per tensor: the non-finite
# (rejected) count, then each format count of FORMAT_COUNTS in FORMAT_SLOTS slots (a program
# adds to slot program_id % FORMAT_SLOTS, so a large tensor's programs do not all contend for
# one address); a reader sums the slots. Definitions: FORMAT.md, "Format counts".
FORMAT_COUNTS = ("saturated_m", "saturated_rms", "flushed_m", "flushed_rms", "subnormal_m", "subnormal_rms")
FORMAT_SLOTS = 32
COUNTER_ROW = 1 + len(FORMAT_COUNTS) * FORMAT_SLOTS


def sum_counter_slots(rows: np.ndarray) -> np.ndarray:
    """[tensors, COUNTER_ROW] counters -> [tensors, len(FORMAT_COUNTS)] format counts."""
    return rows[:, 1:].reshape(len(rows), len(FORMAT_COUNTS), FORMAT_SLOTS).sum(axis=2)


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


def single_tensor_constants(fmt: StateFormat, *, write_update: bool, count_nonfinite: bool, block: int,
                            track_format: bool = False, split: bool = False) -> dict:
    """`kernel_constants` for `adamw_kernel` / `adamw_split_kernel`, with the blocks each
    program takes; launch them on `single_tensor_grid` with `single_tensor_warps`."""
    constants = kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block,
                                 track_format=track_format, split=split)
    counting = (count_nonfinite or track_format) and not interpreting()
    layout = LAYOUT_CONSECUTIVE
    if counting and track_format:  # (track_format: never fp32 mode) bf16 split: prefetching was slower
        layout = LAYOUT_SHIFTED if split else LAYOUT_PREFETCHED
    elif counting and fmt.mode != "fp32" and not split:  # non-finite counts only (split: never timed laid out)
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


def kernel_constants(fmt: StateFormat, *, write_update: bool | None, count_nonfinite: bool, block: int,
                     track_format: bool = False, split: bool = False) -> dict:
    """The constexpr keyword arguments of `adamw_kernel` for this state format
    (`write_update=None`: for `adamw_multi_tensor_kernel`, which always works in place;
    `split=True` with `write_update=False`: for `adamw_split_kernel`, bf16 weights with split
    masters). `count_nonfinite` and `track_format` make the kernel add to the tensor's
    counter row."""
    if track_format and fmt.mode == "fp32":
        raise ValueError("track_format counts packed or fp16 codes; fp32 mode has none")
    if fmt.mode == "fp32":
        m_fmt = r_fmt = None
    else:
        m_fmt, r_fmt = fmt.formats
    codec = lambda f: (  # noqa: E731
        (f.signed, f.fraction_bits, f.bias, f.max_magnitude_code) if f else (False, 0, 0, 0)
    )
    m_signed, m_frac, m_bias, m_max = codec(m_fmt)
    r_signed, r_frac, r_bias, r_max = codec(r_fmt)
    constants = dict(
        MODE=MODE_IDS[fmt.mode], WRITE_UPDATE=write_update, COUNT_NONFINITE=count_nonfinite, TRACK_FORMAT=track_format,
        M_SIGNED=m_signed, M_FRAC=m_frac, M_BIAS=m_bias, M_MAX=m_max,
        R_SIGNED=r_signed, R_FRAC=r_frac, R_BIAS=r_bias, R_MAX=r_max,
        BLOCK=block,
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
