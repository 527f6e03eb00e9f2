"""The launch skeleton: every elementwise rule's Triton entry points, over the rule's block step.

A rule writes one Triton function, its block step, and its state format's `kernel_constexprs`
names it; these kernels lay the programs out, find each program's buffers and counter row, and
call it. The block step's contract (AdamW's `adamw_format_block`, tests/test_custom_rule.py's
heavy ball):

    BLOCK_STEP(param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr,
               new_lo_ptr, offsets, n_elements, MASKED, WRITE_UPDATE, SPLIT, COUNT_NONFINITE,
               TRACK_FORMAT, FORMAT) -> (rejected lanes, format-count lanes)

steps the block `offsets` of one tensor of `n_elements`: the weight (float32, or with SPLIT a
bf16 weight's bits as uint16 and its int16 low half at `lo_ptr`), the gradient (float32 or
bf16), the state; writes the new parameter, or with WRITE_UPDATE the update, to `out_ptr`, and
the new state; reads its step scalars at `scalars_ptr` (the tensor's row). `state_ptr` and
`new_state_ptr` arrive as pointers of whatever dtype the frontend holds (uint8 where the address
comes from a table or a leaf slot): the block step casts them to its state's element type. MASKED: the block crosses the tensor's
end (only then are loads and stores masked). It returns `rejected_lanes` and the format counts'
lane fields (core/kernel.py), zeros where not asked for. FORMAT is the rule's tuple of format
constexprs: read a field as `FIELD: tl.constexpr = FORMAT[i]` or pass `FORMAT[i]` on (a tuple
unpacking turns them into tensors, which the interpreter takes and the compiler refuses).

Entry points (their arguments are AdamW's, core/adamw/kernel.py, with BLOCK_STEP, FORMAT and
SCALAR_ROW, the rule's step-scalar row length, for AdamW's named format constexprs): one tensor
(`tensor_kernel`, `split_tensor_kernel` and their counting twins, the counter row an output as
well, for launchers that return their outputs), many tensors over torch's pointer table
(`multi_tensor_kernel`), up to 16 leaves as jax-triton passes them (`leaf_group_kernel`). The
frontends launch them as they launch AdamW's: a torch `RuleLaunch`'s kernel names default to
them, and `functional_kernels` gives the JAX frontend's set. AdamW's own entry points are built
on the same programs (`tensor_programs`, `multi_tensor_program`, `leaf_program`), except its
laid-out single-tensor programs (core/adamw/kernel.py).
"""
import triton
import triton.language as tl

from .kernel import (
    COUNT_FIELD_LIMIT,
    COUNTER_ROW,
    LEAF_GROUP_SLOTS,
    FunctionalKernels,
    add_counts,
    leaf_address,
    leaf_slot,
    leaf_weights,
    table_block,
    table_state,
    table_weights,
)


def constexprs(block_step, format_fields: tuple, rule) -> dict:
    """What a rule's state format returns from `kernel_constexprs` for these kernels: its block
    step, its format's constexprs (the tuple the block step reads as FORMAT) and the length of
    its step-scalar rows, the `Rule`'s (the launchers stage rows of that length: one home)."""
    return {"BLOCK_STEP": block_step, "FORMAT": tuple(format_fields), "SCALAR_ROW": rule.scalar_row}


# ---- the programs -------------------------------------------------------------------------------
@triton.jit
def tensor_programs(param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, counters_ptr, n_elements,
                    out_ptr, new_state_ptr, new_lo_ptr, BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr,
                    WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr, COUNT_NONFINITE: tl.constexpr,
                    TRACK_FORMAT: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    """One tensor: program i steps blocks [i * BLOCKS_PER_PROGRAM, (i + 1) * BLOCKS_PER_PROGRAM),
    so that a counting launch pays its one reduction and its atomics once for several blocks."""
    first = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM
    rejected = tl.zeros([BLOCK], tl.int32)
    format_lanes = tl.zeros([BLOCK], tl.int32)
    for k in tl.range(0, BLOCKS_PER_PROGRAM):
        start = (first + k) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n_elements:
            r, lanes = BLOCK_STEP(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, False, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
            )
        else:  # the tensor's last, partial block (or, in a program of several, one past the end)
            r, lanes = BLOCK_STEP(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, True, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
            )
        rejected += r
        format_lanes += lanes
    add_counts(counters_ptr, rejected, format_lanes, COUNT_NONFINITE, TRACK_FORMAT)


@triton.jit
def multi_tensor_program(pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, scalar_rows_ptr, scalars_ptr,
                         counters_ptr, n_tensors, BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr,
                         SCALAR_ROW: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr):
    """Program i of a multi-tensor launch, in place: block `block_index[i]` of tensor
    `block_tensor[i]` (torch's pointer table, core/kernel.py), with scalar row `scalar_rows[t]`."""
    tl.static_assert(BLOCK < COUNT_FIELD_LIMIT)  # the format counts' 16-bit fields
    t, start, offsets, n_elements = table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK, ALIGNED)
    param_ptr, lo_ptr, grad_ptr = table_weights(pointers_ptr, t, n_tensors, ALIGNED, SPLIT, GRAD_BF16)
    state_ptr = table_state(pointers_ptr, t, n_tensors, ALIGNED).to(tl.pointer_type(tl.uint8))
    scalars_ptr += tl.load(scalar_rows_ptr + t) * SCALAR_ROW
    if start + BLOCK <= n_elements:
        rejected, format_lanes = BLOCK_STEP(
            param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, param_ptr, state_ptr, lo_ptr,
            offsets, n_elements, False, False, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
        )
    else:  # the tensor's last, partial block
        rejected, format_lanes = BLOCK_STEP(
            param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, param_ptr, state_ptr, lo_ptr,
            offsets, n_elements, True, False, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
        )
    add_counts(counters_ptr + t * COUNTER_ROW, rejected, format_lanes, COUNT_NONFINITE, TRACK_FORMAT)


@triton.jit
def leaf_program(param, grad, state, lo, out, new_state, new_lo, leaf_table_ptr, scalars_ptr, counters_ptr, leaf,
                 BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr, SCALAR_ROW: tl.constexpr,
                 WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr,
                 COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, leaf) of a leaf-group launch: block i of that leaf, whose buffers arrive as
    int64 addresses (`leaf_slot`), with scalar row `leaf_table[LEAF_GROUP_SLOTS + leaf]`;
    `leaf_table[leaf]` is its size. SPLIT: a bf16 weight with its int16 low half `lo` (new ones
    to `out`, `new_lo`); otherwise `lo` and `new_lo` are unused."""
    n_elements = tl.load(leaf_table_ptr + leaf)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start < n_elements:  # a leaf smaller than the group's largest has idle programs
        scalars_ptr += tl.load(leaf_table_ptr + LEAF_GROUP_SLOTS + leaf) * SCALAR_ROW
        offsets = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        param_ptr, out_ptr, lo_ptr, new_lo_ptr, grad_ptr = leaf_weights(param, lo, out, new_lo, grad, SPLIT, GRAD_BF16)
        # cast here, once for both branches: cast in each, the selection compiles differently
        state_ptr = leaf_address(state).to(tl.pointer_type(tl.uint8))
        new_state_ptr = leaf_address(new_state).to(tl.pointer_type(tl.uint8))
        if start + BLOCK <= n_elements:
            rejected, format_lanes = BLOCK_STEP(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, False, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
            )
        else:  # the leaf's last, partial block
            rejected, format_lanes = BLOCK_STEP(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, True, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, FORMAT,
            )
        add_counts(counters_ptr + leaf * COUNTER_ROW, rejected, format_lanes, COUNT_NONFINITE, TRACK_FORMAT)


# ---- the entry points ---------------------------------------------------------------------------
# SCALAR_ROW is taken by every entry point (a rule's `kernel_constexprs` is passed whole) and
# read by those that index scalar rows; LAYOUT, a launch hint for AdamW's laid-out programs
# (launch.single_tensor_constants), is taken and not needed: these programs walk their blocks.
@triton.jit
def tensor_kernel(param_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements, out_ptr, new_state_ptr,
                  BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr, SCALAR_ROW: tl.constexpr,
                  WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0):
    """One float32 tensor on the grid `launch.single_tensor_grid`; `scalars_ptr` is its row. In
    place (torch): out_ptr is param_ptr, new_state_ptr state_ptr. Functional (jax-triton, which
    appends the outputs after the inputs): out_ptr gets the update (WRITE_UPDATE) or the new
    parameter, new_state_ptr a new state."""
    tensor_programs(param_ptr, grad_ptr, state_ptr, param_ptr, scalars_ptr, counters_ptr, n_elements, out_ptr,
                    new_state_ptr, out_ptr, BLOCK_STEP, FORMAT, WRITE_UPDATE, False, COUNT_NONFINITE, TRACK_FORMAT,
                    BLOCK, BLOCKS_PER_PROGRAM)


@triton.jit
def tensor_counting_kernel(param_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements, out_ptr,
                           new_state_ptr, new_counters_ptr, BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr,
                           SCALAR_ROW: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr,
                           TRACK_FORMAT: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1,
                           LAYOUT: tl.constexpr = 0):
    """`tensor_kernel` with its counter row as an output too (`new_counters_ptr`, the same buffer
    as `counters_ptr`), for a launcher that returns every output, aliased ones too."""
    tensor_programs(param_ptr, grad_ptr, state_ptr, param_ptr, scalars_ptr, new_counters_ptr, n_elements, out_ptr,
                    new_state_ptr, out_ptr, BLOCK_STEP, FORMAT, WRITE_UPDATE, False, COUNT_NONFINITE, TRACK_FORMAT,
                    BLOCK, BLOCKS_PER_PROGRAM)


@triton.jit
def split_tensor_kernel(weight_ptr, lo_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
                        new_weight_ptr, new_lo_ptr, new_state_ptr, BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr,
                        SCALAR_ROW: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0):
    """One bf16 tensor with its split master (FORMAT.md, "Split masters"): the weight and its
    int16 low half in, the new ones out (the same buffers in place); a bf16 or float32 gradient."""
    tensor_programs(weight_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, counters_ptr, n_elements, new_weight_ptr,
                    new_state_ptr, new_lo_ptr, BLOCK_STEP, FORMAT, False, True, COUNT_NONFINITE, TRACK_FORMAT, BLOCK,
                    BLOCKS_PER_PROGRAM)


@triton.jit
def split_tensor_counting_kernel(weight_ptr, lo_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
                                 new_weight_ptr, new_lo_ptr, new_state_ptr, new_counters_ptr,
                                 BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr, SCALAR_ROW: tl.constexpr,
                                 COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr, BLOCK: tl.constexpr,
                                 BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0):
    """`split_tensor_kernel` with its counter row as an output too (as `tensor_counting_kernel`)."""
    tensor_programs(weight_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, new_counters_ptr, n_elements, new_weight_ptr,
                    new_state_ptr, new_lo_ptr, BLOCK_STEP, FORMAT, False, True, COUNT_NONFINITE, TRACK_FORMAT, BLOCK,
                    BLOCKS_PER_PROGRAM)


@triton.jit
def multi_tensor_kernel(pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, scalar_rows_ptr, scalars_ptr,
                        counters_ptr, n_tensors, BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr,
                        SCALAR_ROW: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
                        BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr = False,
                        GRAD_BF16: tl.constexpr = False):
    """Many tensors in one launch, in place, over torch's pointer table (`multi_tensor_program`)."""
    multi_tensor_program(pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, scalar_rows_ptr, scalars_ptr,
                         counters_ptr, n_tensors, BLOCK_STEP, FORMAT, SCALAR_ROW, COUNT_NONFINITE, TRACK_FORMAT,
                         BLOCK, ALIGNED, SPLIT, GRAD_BF16)


@triton.jit
def leaf_group_kernel(
    param_0, lo_0, grad_0, state_0, param_1, lo_1, grad_1, state_1, param_2, lo_2, grad_2, state_2,
    param_3, lo_3, grad_3, state_3, param_4, lo_4, grad_4, state_4, param_5, lo_5, grad_5, state_5,
    param_6, lo_6, grad_6, state_6, param_7, lo_7, grad_7, state_7, param_8, lo_8, grad_8, state_8,
    param_9, lo_9, grad_9, state_9, param_10, lo_10, grad_10, state_10, param_11, lo_11, grad_11, state_11,
    param_12, lo_12, grad_12, state_12, param_13, lo_13, grad_13, state_13, param_14, lo_14, grad_14, state_14,
    param_15, lo_15, grad_15, state_15,
    leaf_table_ptr, scalars_ptr, counters_ptr,
    out_0, new_lo_0, new_state_0, out_1, new_lo_1, new_state_1, out_2, new_lo_2, new_state_2,
    out_3, new_lo_3, new_state_3, out_4, new_lo_4, new_state_4, out_5, new_lo_5, new_state_5,
    out_6, new_lo_6, new_state_6, out_7, new_lo_7, new_state_7, out_8, new_lo_8, new_state_8,
    out_9, new_lo_9, new_state_9, out_10, new_lo_10, new_state_10, out_11, new_lo_11, new_state_11,
    out_12, new_lo_12, new_state_12, out_13, new_lo_13, new_state_13, out_14, new_lo_14, new_state_14,
    out_15, new_lo_15, new_state_15,
    new_counters_ptr,
    BLOCK_STEP: tl.constexpr, FORMAT: tl.constexpr, SCALAR_ROW: tl.constexpr,
    WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Up to LEAF_GROUP_SLOTS leaves in one launch, as jax-triton passes them (every buffer an
    argument, the outputs after the inputs): leaf t's buffers are slot t of each kind, on a grid
    (blocks of the largest leaf, leaves); slots past the launch's leaves hold placeholders no
    program reads. The counts go to the rows at `new_counters_ptr`, the same buffer as
    `counters_ptr` (so that a launcher returning its outputs can alias the zeroed rows)."""
    leaf = tl.program_id(1)
    leaf_program(
        leaf_slot(leaf, param_0, param_1, param_2, param_3, param_4, param_5, param_6, param_7, param_8, param_9,
                  param_10, param_11, param_12, param_13, param_14, param_15),
        leaf_slot(leaf, grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7, grad_8, grad_9, grad_10,
                  grad_11, grad_12, grad_13, grad_14, grad_15),
        leaf_slot(leaf, state_0, state_1, state_2, state_3, state_4, state_5, state_6, state_7, state_8, state_9,
                  state_10, state_11, state_12, state_13, state_14, state_15),
        leaf_slot(leaf, lo_0, lo_1, lo_2, lo_3, lo_4, lo_5, lo_6, lo_7, lo_8, lo_9, lo_10, lo_11, lo_12, lo_13, lo_14,
                  lo_15),
        leaf_slot(leaf, out_0, out_1, out_2, out_3, out_4, out_5, out_6, out_7, out_8, out_9, out_10, out_11, out_12,
                  out_13, out_14, out_15),
        leaf_slot(leaf, new_state_0, new_state_1, new_state_2, new_state_3, new_state_4, new_state_5, new_state_6,
                  new_state_7, new_state_8, new_state_9, new_state_10, new_state_11, new_state_12, new_state_13,
                  new_state_14, new_state_15),
        leaf_slot(leaf, new_lo_0, new_lo_1, new_lo_2, new_lo_3, new_lo_4, new_lo_5, new_lo_6, new_lo_7, new_lo_8,
                  new_lo_9, new_lo_10, new_lo_11, new_lo_12, new_lo_13, new_lo_14, new_lo_15),
        leaf_table_ptr, scalars_ptr, new_counters_ptr, leaf,
        BLOCK_STEP, FORMAT, SCALAR_ROW, WRITE_UPDATE, SPLIT, GRAD_BF16, COUNT_NONFINITE, TRACK_FORMAT, BLOCK,
    )


def functional_kernels(step_scalars) -> FunctionalKernels:
    """The JAX frontend's entry points for a rule built on the skeleton, given its step-scalars
    kernel ([rows, hyperparameters] and [rows] counts -> [rows, step scalars])."""
    return FunctionalKernels(
        tensor=tensor_kernel, tensor_counting=tensor_counting_kernel, split_tensor=split_tensor_kernel,
        split_tensor_counting=split_tensor_counting_kernel, leaf_group=leaf_group_kernel, step_scalars=step_scalars,
    )
