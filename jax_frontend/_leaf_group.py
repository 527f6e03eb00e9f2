"""Launching many leaves at once through jax-triton: the leaf-group kernels and their policy.

jax-triton passes buffers only as separate kernel arguments, never as a table of addresses
(docs/MULTI_TENSOR.md says why a table cannot work under jit), so a launch over n leaves needs
a kernel with 5n buffer arguments. `leaf_group_kernel_2` below is that kernel for two leaves,
written out by hand as the readable model; `leaf_group_kernel(n)` writes its text for n leaves
(more buffers in the signature, one more block of selections per leaf) and compiles that in a
private namespace. The per-element work is core's `_adamw_block`, as in every other kernel.

bf16 leaves with split masters (docs/FORMAT.md, "Split masters") have their own model,
`split_leaf_group_kernel_2` (seven buffers a leaf: weight, low half, gradient, state and the
three new ones), generated for n leaves the same way; one launch takes leaves of one kind
(FP32; split with float32 gradients; split with bf16 gradients), as torch's multi-tensor launch.
"""
from __future__ import annotations

import functools
import inspect
import linecache

import numpy as np
import triton
import triton.language as tl

from packed_adamw.core import launch
from packed_adamw.core.kernel import COUNTER_ROW, add_counts as _add_counts
from packed_adamw.core.adamw.kernel import FP32_MODE, SCALAR_ROW, adamw_block as _adamw_block

# Leaves per launch. Each program selects its leaf's addresses from all of the launch's
# arguments, so its scalar work grows with this.
LEAVES_PER_LAUNCH = 16


def leaf_groups(numels: list[int]) -> tuple[list[int], list[list[int]]]:
    """Splits leaves (by index) into solo launches and launches of `LEAVES_PER_LAUNCH` or fewer.

    Leaves of `launch.SOLO_ELEMENTS` or more launch alone (no selection to pay for); empty
    leaves are in neither. Grouped leaves are taken in order of size, so the leaves of one
    launch are alike and few of its programs (sized for the largest) idle."""
    solo = [i for i, n in enumerate(numels) if n >= launch.SOLO_ELEMENTS]
    shared = sorted((i for i, n in enumerate(numels) if 0 < n < launch.SOLO_ELEMENTS), key=lambda i: numels[i])
    return solo, [shared[k:k + LEAVES_PER_LAUNCH] for k in range(0, len(shared), LEAVES_PER_LAUNCH)]


def leaf_group_table(numels: list[int], rows: list[int]) -> np.ndarray:
    """The leaf-group kernel's table: every leaf's size, then its row of step scalars."""
    return np.asarray([*numels, *rows], dtype=np.int64)


@triton.jit
def _leaf_group_program(
    param, grad, state, lo, out, new_state, new_lo, leaf_table_ptr, scalars_ptr, counters_ptr, leaf, n_leaves,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, leaf) of a leaf-group kernel: block i of that leaf, whose buffer addresses
    arrive as int64. The leaf table holds every leaf's size, then its scalar row. SPLIT: the
    leaf is a bf16 weight with its int16 low half `lo` (new ones to `out`, `new_lo`);
    otherwise `lo` and `new_lo` are unused. GRAD_BF16: the gradient is bf16."""
    n_elements = tl.load(leaf_table_ptr + leaf)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start < n_elements:  # a leaf smaller than the group's largest has idle programs
        scalars_ptr += tl.load(leaf_table_ptr + n_leaves + leaf) * SCALAR_ROW
        offsets = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        # jax-triton declares every buffer 16-byte aligned; the selection hides it from the compiler.
        if SPLIT:
            param_ptr = tl.multiple_of(param, 16).to(tl.pointer_type(tl.uint16))
            out_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.uint16))
            lo_ptr = tl.multiple_of(lo, 16).to(tl.pointer_type(tl.int16))
            new_lo_ptr = tl.multiple_of(new_lo, 16).to(tl.pointer_type(tl.int16))
        else:
            param_ptr = tl.multiple_of(param, 16).to(tl.pointer_type(tl.float32))
            out_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.float32))
            lo_ptr = param_ptr
            new_lo_ptr = out_ptr
        if GRAD_BF16:
            grad_ptr = tl.multiple_of(grad, 16).to(tl.pointer_type(tl.bfloat16))
        else:
            grad_ptr = tl.multiple_of(grad, 16).to(tl.pointer_type(tl.float32))
        if MODE == FP32_MODE:
            state_ptr = tl.multiple_of(state, 16).to(tl.pointer_type(tl.float32))
            new_state_ptr = tl.multiple_of(new_state, 16).to(tl.pointer_type(tl.float32))
        else:
            state_ptr = tl.multiple_of(state, 16).to(tl.pointer_type(tl.uint32))
            new_state_ptr = tl.multiple_of(new_state, 16).to(tl.pointer_type(tl.uint32))
        if start + BLOCK <= n_elements:
            rejected, format_lanes = _adamw_block(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, False, MODE, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT,
                M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
            )
        else:  # the leaf's last, partial block
            rejected, format_lanes = _adamw_block(
                param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, n_elements, True, MODE, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT,
                M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
            )
        _add_counts(counters_ptr + leaf * COUNTER_ROW, rejected, format_lanes, COUNT_NONFINITE, TRACK_FORMAT)


def leaf_group_kernel_2(
    param_0, grad_0, state_0, param_1, grad_1, state_1,
    leaf_table_ptr, scalars_ptr, counters_ptr,
    out_0, new_state_0, out_1, new_state_1,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    leaf = tl.program_id(1)
    param, grad, state = param_0.to(tl.int64), grad_0.to(tl.int64), state_0.to(tl.int64)
    out, new_state = out_0.to(tl.int64), new_state_0.to(tl.int64)
    param = tl.where(leaf == 1, param_1.to(tl.int64), param)
    grad = tl.where(leaf == 1, grad_1.to(tl.int64), grad)
    state = tl.where(leaf == 1, state_1.to(tl.int64), state)
    out = tl.where(leaf == 1, out_1.to(tl.int64), out)
    new_state = tl.where(leaf == 1, new_state_1.to(tl.int64), new_state)
    _leaf_group_program(
        param, grad, state, param, out, new_state, out, leaf_table_ptr, scalars_ptr, counters_ptr, leaf, 2,
        MODE, WRITE_UPDATE, False, False, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK,
    )


def split_leaf_group_kernel_2(
    weight_0, lo_0, grad_0, state_0, weight_1, lo_1, grad_1, state_1,
    leaf_table_ptr, scalars_ptr, counters_ptr,
    new_weight_0, new_lo_0, new_state_0, new_weight_1, new_lo_1, new_state_1,
    MODE: tl.constexpr, GRAD_BF16: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    leaf = tl.program_id(1)
    weight, lo, grad, state = weight_0.to(tl.int64), lo_0.to(tl.int64), grad_0.to(tl.int64), state_0.to(tl.int64)
    new_weight, new_lo, new_state = new_weight_0.to(tl.int64), new_lo_0.to(tl.int64), new_state_0.to(tl.int64)
    weight = tl.where(leaf == 1, weight_1.to(tl.int64), weight)
    lo = tl.where(leaf == 1, lo_1.to(tl.int64), lo)
    grad = tl.where(leaf == 1, grad_1.to(tl.int64), grad)
    state = tl.where(leaf == 1, state_1.to(tl.int64), state)
    new_weight = tl.where(leaf == 1, new_weight_1.to(tl.int64), new_weight)
    new_lo = tl.where(leaf == 1, new_lo_1.to(tl.int64), new_lo)
    new_state = tl.where(leaf == 1, new_state_1.to(tl.int64), new_state)
    _leaf_group_program(
        weight, grad, state, lo, new_weight, new_state, new_lo, leaf_table_ptr, scalars_ptr, counters_ptr, leaf, 2,
        MODE, False, True, GRAD_BF16, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK,
    )


def _signature_lines(n: int, split: bool = False) -> tuple[str, str]:
    if split:
        return (", ".join(f"weight_{i}, lo_{i}, grad_{i}, state_{i}" for i in range(n)),
                ", ".join(f"new_weight_{i}, new_lo_{i}, new_state_{i}" for i in range(n)))
    inputs = ", ".join(f"param_{i}, grad_{i}, state_{i}" for i in range(n))
    outputs = ", ".join(f"out_{i}, new_state_{i}" for i in range(n))
    return inputs, outputs


def _generated_source(n: int, counting: bool = False, split: bool = False) -> str:
    """`leaf_group_kernel_2`'s text (`split_leaf_group_kernel_2`'s with `split`) with n
    leaves: the signature lists every leaf's buffers, and one block of selections per leaf
    after the first. `counting`: the counter rows are an output too (`_with_counters_output`)."""
    model = inspect.getsource(split_leaf_group_kernel_2 if split else leaf_group_kernel_2)
    inputs_2, outputs_2 = _signature_lines(2, split)
    inputs, outputs = _signature_lines(n, split)
    first_select = model.index(f"    {'weight' if split else 'param'} = tl.where(leaf == 1")
    after_select = model.index("    _leaf_group_program(")
    select_1 = model[first_select:after_select]
    head, tail = model[:first_select], model[after_select:]
    head = head.replace("leaf_group_kernel_2(", f"leaf_group_kernel_{n}(").replace(inputs_2, inputs).replace(outputs_2, outputs)
    selects = "".join(select_1.replace("leaf == 1", f"leaf == {i}").replace("_1.to", f"_{i}.to") for i in range(1, n))
    source = head + selects + tail.replace("leaf, 2,", f"leaf, {n},")
    return _with_counters_output(source, n, "split_" if split else "") if counting else source


def _with_counters_output(source: str, n: int, prefix: str = "") -> str:
    """The kernel text whose last argument is the counter rows as an output: jax-triton passes
    every output, aliased ones too, after the inputs, so a launch that returns its counts
    (`counters` aliased to that output) needs the argument. Both name one buffer; the counts
    are added through the output's."""
    edits = ((f"def {prefix}leaf_group_kernel_{n}(", f"def {prefix}leaf_group_counting_kernel_{n}("),
             (f" new_state_{n - 1},\n", f" new_state_{n - 1}, new_counters,\n"),
             (f"scalars_ptr, counters_ptr, leaf, {n},", f"scalars_ptr, new_counters, leaf, {n},"))
    for old, new in edits:
        if source.count(old) != 1:  # the model changed: say where instead of compiling a wrong kernel
            raise AssertionError(f"leaf_group_kernel_2's text has {source.count(old)} copies of {old!r}, not one")
        source = source.replace(old, new)
    return source


@functools.cache
def leaf_group_kernel(n_leaves: int, counting: bool = False, split: bool = False):
    """The kernel for one launch over `n_leaves` separate leaves, in jax-triton's argument order:

        param_0, grad_0, state_0, ..., leaf_table, scalars, counters, out_0, new_state_0, ...

    on a grid (blocks of the largest leaf, n_leaves). Program (i, t) updates block i of leaf t
    with scalar row `leaf_table[n_leaves + t]`; `leaf_table[t]` is leaf t's size
    (`leaf_group_table`). Outputs as in core's `adamw_kernel`. With `counting` (launches with
    TRACK_FORMAT) one more output follows, `new_counters`: the counter rows (leaf t's at row
    t, launch.COUNTER_ROW wide), passed aliased to `counters`.

    `split`: bf16 leaves with split masters, as core's `adamw_split_kernel` takes them:

        weight_0, lo_0, grad_0, state_0, ..., leaf_table, scalars, counters,
        new_weight_0, new_lo_0, new_state_0, ...

    with the constants of `launch.kernel_constants(..., write_update=False, split=True)` plus
    GRAD_BF16 (every gradient of the launch bf16, else every one float32).
    """
    if not 1 <= n_leaves <= LEAVES_PER_LAUNCH:
        raise ValueError(f"leaf_group_kernel: n_leaves must be in [1, {LEAVES_PER_LAUNCH}], got {n_leaves}")
    source = _generated_source(n_leaves, counting, split)
    name = f"{'split_' if split else ''}leaf_group_{'counting_' if counting else ''}kernel_{n_leaves}"
    # Triton reads a kernel's source through `inspect`, which finds generated text in linecache.
    filename = f"<packed_adamw.jax {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"tl": tl, "_leaf_group_program": _leaf_group_program}
    exec(compile(source, filename, "exec"), namespace)  # a private namespace: nothing leaks here
    return triton.jit(namespace[name])
