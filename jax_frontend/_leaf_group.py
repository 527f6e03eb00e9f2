"""Launching many leaves at once through jax-triton: which leaves share a launch, and the
argument list of a rule's leaf-group kernel (core/adamw/kernel.py's `adamw_leaf_group_kernel`).

jax-triton passes buffers only as separate kernel arguments, never as a table of addresses
(docs/MULTI_TENSOR.md says why a table cannot work under jit), so the kernel has a fixed
number of slots, `launch.LEAF_GROUP_SLOTS`, for each of a leaf's buffers. A launch of fewer
leaves fills the other slots with one-element placeholders of the same dtypes, which no program
reads (the grid has a column per real leaf): every group size then compiles to the same kernel.

One launch takes leaves of one kind (FP32; bf16 with split masters and float32 gradients; the
same with bf16 gradients), as torch's multi-tensor launch (docs/FORMAT.md, "Split masters").
"""
from __future__ import annotations

import numpy as np

from packed_adamw.core import launch

# Leaves per launch: the kernel's slots. Each program selects its leaf's addresses from every
# slot, so its scalar work grows with this.
LEAVES_PER_LAUNCH = launch.LEAF_GROUP_SLOTS
# A slot's buffers in the kernel's argument order: every slot's inputs, then the leaf table,
# the scalars and the counter rows, then every slot's outputs, then the counter rows again
# (an output, aliased to the input where the launch counts).
SLOT_INPUTS = ("param", "lo", "grad", "state")
SLOT_OUTPUTS = ("out", "new_lo", "new_state")
TABLE_INPUT = LEAVES_PER_LAUNCH * len(SLOT_INPUTS)
COUNTERS_INPUT = TABLE_INPUT + 2
COUNTERS_OUTPUT = LEAVES_PER_LAUNCH * len(SLOT_OUTPUTS)


def leaf_groups(numels: list[int]) -> tuple[list[int], list[list[int]]]:
    """Splits leaves (by index) into solo launches and launches of `LEAVES_PER_LAUNCH` or fewer.

    Leaves of `launch.SOLO_ELEMENTS` or more launch alone (no selection to pay for); empty
    leaves are in neither. Grouped leaves are taken in order of size, so the leaves of one
    launch are alike and few of its programs (sized for the largest) idle."""
    solo = [i for i, n in enumerate(numels) if n >= launch.SOLO_ELEMENTS]
    shared = sorted((i for i, n in enumerate(numels) if 0 < n < launch.SOLO_ELEMENTS), key=lambda i: numels[i])
    return solo, [shared[k:k + LEAVES_PER_LAUNCH] for k in range(0, len(shared), LEAVES_PER_LAUNCH)]


def leaf_group_table(numels: list[int], rows: list[int]) -> np.ndarray:
    """The leaf-group kernel's table: every slot's size (0 past the launch's leaves), then its
    row of step scalars."""
    _check_group_size(len(numels))
    padding = [0] * (LEAVES_PER_LAUNCH - len(numels))
    return np.asarray([*numels, *padding, *rows, *padding], dtype=np.int64)


def input_index(leaf: int, buffer: str) -> int:
    """Where leaf `leaf`'s input `buffer` (one of SLOT_INPUTS) is among the kernel's arguments."""
    return leaf * len(SLOT_INPUTS) + SLOT_INPUTS.index(buffer)


def output_index(leaf: int, buffer: str) -> int:
    """Where leaf `leaf`'s output `buffer` (one of SLOT_OUTPUTS) is among the kernel's outputs."""
    return leaf * len(SLOT_OUTPUTS) + SLOT_OUTPUTS.index(buffer)


def fill_slots(per_leaf: list[tuple], placeholders: tuple) -> list:
    """The slots' arguments in order: each leaf's buffers (a tuple in SLOT_INPUTS' or
    SLOT_OUTPUTS' order), then `placeholders` for every slot past the last leaf. Placeholders
    of the leaves' dtypes keep the kernel's signature, and so its compiled code, the same for
    every group size."""
    _check_group_size(len(per_leaf))
    filled = [*per_leaf, *[placeholders] * (LEAVES_PER_LAUNCH - len(per_leaf))]
    return [buffer for slot in filled for buffer in slot]


def _check_group_size(n_leaves: int) -> None:
    if not 1 <= n_leaves <= LEAVES_PER_LAUNCH:
        raise ValueError(f"a leaf-group launch takes 1 to {LEAVES_PER_LAUNCH} leaves (n_leaves), got {n_leaves}; "
                         "split larger groups with leaf_groups")
