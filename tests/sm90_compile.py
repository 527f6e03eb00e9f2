"""Compiles the Muon GPU kernels (JAX's group kernels, torch's per-matrix and table kernels) and
AdamW's multi-tensor and leaf-group kernels, and the launch skeleton's entry points over the test
rule's block step, for
sm_90 (an H100/H200) without a GPU, through Triton's NVIDIA backend and its bundled ptxas; run
in a process of its own, without TRITON_INTERPRET (under it
`@triton.jit` gives interpreter functions, which do not compile). Prints one line a kernel
variant, then "compiled N". Used by tests/core/test_kernels_compile_for_sm90.py; also a quick check
before a GPU call: `python tests/sm90_compile.py`.

It checks that each variant compiles with the arguments' dtypes and the warps the JAX launchers
use, under whatever Triton is installed (3.9 on the CPU machines; the GPU image has 3.6, which
can be installed apart and put first on PYTHONPATH). It does not check what the code computes:
the interpreter tests do, and only a GPU run shows what the compiler made of it.
"""
import itertools
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_compile.py: unset TRITON_INTERPRET (interpreted kernels do not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from packed_adamw.core import launch  # noqa: E402
from packed_adamw.core.muon import kernel as mk  # noqa: E402
from packed_adamw.core.muon import ns_kernel  # noqa: E402
from packed_adamw.core.muon.state_format import StateFormat  # noqa: E402
from packed_adamw.jax import _muon_triton as mt  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SLOTS = mt.SLOTS


def compile_sm90(kernel, signature: dict, constants: dict, options: dict | None = None) -> str:
    """The kernel's PTX for sm_90, compiled as the launchers compile it (launch.COMPILE_OPTIONS).
    `signature` names every non-constexpr argument, `constants` every constexpr one; the
    signature is laid out in the kernel's own argument order (Triton matches it by position)."""
    names = kernel.arg_names
    if set(signature) | set(constants) != set(names) or set(signature) & set(constants):
        raise ValueError(f"{kernel.__name__}: the arguments named {sorted(set(signature) | set(constants))} "
                         f"are not the kernel's {names}")
    source = ASTSource(fn=kernel, signature={n: signature.get(n, "constexpr") for n in names},
                       constexprs=constants)
    ptx = triton.compile(source, target=SM90, options={**launch.COMPILE_OPTIONS, **(options or {})}).asm["ptx"]
    print(kernel.__name__, " ".join(f"{k}={v}" for k, v in sorted(constants.items())), flush=True)
    return ptx


def _slots(name: str, kind: str) -> dict:
    return {f"{name}_{i}": kind for i in range(SLOTS)}


def group_kernels() -> int:
    """Every variant of the JAX group kernels the launchers make: the three momentum modes, float32
    and bf16 gradients, both orientations, with and without Nesterov; float32 weights in place or
    writing the update, bf16 weights with low halves. The launch table is int32 (`group_table`)."""
    n = 0
    warps = {"num_warps": launch.GPU_NUM_WARPS}
    for mode in ("packed", "bf16", "fp32"):
        constants = StateFormat(mode, 31).kernel_constexprs(track_format=False)
        state = "*fp32" if mode == "fp32" else "*i16"
        for grad_bf16, tall, nesterov in itertools.product((False, True), (False, True), (False, True)):
            signature = {**_slots("grad", "*i16" if grad_bf16 else "*fp32"), **_slots("state", state),
                         **_slots("exponent", "*i32"), "table_ptr": "*i32", "scalars_ptr": "*fp32",
                         "x_in_ptr": "*i16", "counters_in_ptr": "*i32", "n_elements": "i32", "rows": "i32",
                         "cols": "i32", "x_ptr": "*i16", "counters_ptr": "*i32"}
            compile_sm90(mt.muon_momentum_group_kernel, signature, {
                "TALL": tall, **constants, "NESTEROV": nesterov, "GRAD_BF16": grad_bf16, "BLOCK": launch.GPU_BLOCK,
                "TILE": mk.TALL_TILE},
                warps)
            n += 1
        for (split, update), tall, grad_bf16 in itertools.product(((False, False), (False, True), (True, False)),
                                                                  (False, True), (False, True)):
            if grad_bf16 and not split:
                continue  # a float32 leaf takes float32 gradients
            weights = "*i16" if split else "*fp32"
            signature = {**_slots("param", weights), **_slots("lo", "*i16"),
                         **_slots("grad", "*i16" if grad_bf16 else "*fp32"), **_slots("state", state),
                         **_slots("exponent", "*i32"), "table_ptr": "*i32", "ortho_ptr": "*i16",
                         "scalars_ptr": "*fp32", "counters_in_ptr": "*i32", "n_elements": "i32", "rows": "i32",
                         "cols": "i32", **_slots("out", weights), **_slots("new_lo", "*i16"),
                         **_slots("new_state", state), **_slots("new_exponent", "*i32"), "counters_ptr": "*i32"}
            compile_sm90(mt.muon_weight_group_kernel, signature, {
                "TALL": tall, **constants, "GRAD_BF16": grad_bf16, "SPLIT": split, "UPDATE": update,
                "BLOCK": launch.GPU_BLOCK, "TILE": mk.TALL_TILE}, warps)
            n += 1
    return n


def torch_kernels() -> int:
    """Every variant of torch's phase kernels (core/muon/kernel.py): per matrix and per batch
    (table), momentum and weight phases, the weight phases' counting twins (packed mode), the
    three momentum modes, float32 and bf16 gradients, with and without maximize (and Nesterov for
    the momentum phase), float32 and split bf16 weights, at launch.GPU_BLOCK and PackedMuon's
    warps (Triton's default per matrix, launch.GPU_NUM_WARPS per batch); the refusal kernels at
    their REFUSE_BLOCK."""
    table_warps = {"num_warps": launch.GPU_NUM_WARPS}
    n = 0
    for mode in ("packed", "bf16", "fp32"):
        constants = StateFormat(mode, 31).kernel_constexprs(track_format=False)
        state = "*fp32" if mode == "fp32" else "*i16"
        for grad_bf16, maximize in itertools.product((False, True), (False, True)):
            grad = "*i16" if grad_bf16 else "*fp32"
            flags = {**constants, "MAXIMIZE": maximize, "GRAD_BF16": grad_bf16, "BLOCK": launch.GPU_BLOCK}
            for nesterov in (False, True):
                compile_sm90(mk.muon_momentum_kernel, {
                    "grad_ptr": grad, "state_ptr": state, "exponent_ptr": "*i32", "x_ptr": "*i16",
                    "scalars_ptr": "*fp32", "counters_ptr": "*i32", "n_elements": "i32"}, {**flags, "NESTEROV": nesterov})
                for tall in (False, True):
                    compile_sm90(mk.muon_momentum_table_kernel, {
                        "table_ptr": "*i64", "x_ptr": "*i16", "scalars_ptr": "*fp32", "counters_ptr": "*i32",
                        "rows": "i32", "cols": "i32"}, {**flags, "NESTEROV": nesterov, "TALL": tall, "TILE": mk.TALL_TILE},
                        table_warps)
                n += 3
            for split in (False, True) if not grad_bf16 else (True,):  # a float32 matrix takes float32 gradients
                weights = "*i16" if split else "*fp32"
                counting = (False, True) if mode == "packed" else (False,)
                for count in counting:
                    counts = {"counts_ptr": "*i64"} if count else {}
                    compile_sm90(mk.muon_weight_counting_kernel if count else mk.muon_weight_kernel, {
                        "param_ptr": weights, "lo_ptr": "*i16" if split else weights, "ortho_ptr": "*i16",
                        "grad_ptr": grad, "state_ptr": state, "exponent_ptr": "*i32", "scalars_ptr": "*fp32",
                        "counters_ptr": "*i32", **counts, "n_elements": "i32"}, {**flags, "SPLIT": split})
                    for tall in (False, True):
                        compile_sm90(mk.muon_weight_table_counting_kernel if count else mk.muon_weight_table_kernel, {
                            "table_ptr": "*i64", "ortho_ptr": "*i16", "scalars_ptr": "*fp32", "counters_ptr": "*i32",
                            **counts, "rows": "i32", "cols": "i32"}, {**flags, "SPLIT": split, "TALL": tall,
                                                                      "TILE": mk.TALL_TILE}, table_warps)
                    n += 3
    for kernel, signature in ((mk.muon_refuse_nonfinite_kernel, {"ortho_ptr": "*i16", "counters_ptr": "*i32",
                                                                 "n_elements": "i32"}),
                              (mk.muon_refuse_nonfinite_table_kernel, {"table_ptr": "*i64", "ortho_ptr": "*i16",
                                                                       "counters_ptr": "*i32", "rows": "i32",
                                                                       "cols": "i32"})):
        compile_sm90(kernel, signature, {"BLOCK": mk.REFUSE_BLOCK})
        n += 1
    return n


def scalars_and_newton_schulz() -> int:
    """The device step scalars (JAX's per matrix, STATIC: which of lr, momentum and weight decay
    are known numbers; with all three known the host computes the row, so 7 is never launched;
    torch's capturable rows) and each distinct
    launch of Newton-Schulz on d12's 768 x 3072 group: the norm's two kernels, the Gram matrix and
    the polynomial (mirrored), the product with the iterate."""
    n = 0
    for static in range(7):
        compile_sm90(mt.muon_scalars_kernel, {"row_ptr": "*fp32", "bits64_ptr": "*u32", "out_ptr": "*fp32"},
                     {"STATIC": static})
        n += 1
    compile_sm90(mk.muon_capturable_scalars_kernel,  # torch's capturable step: every matrix's row in one launch
                 {"lr_ptr": "*fp64", "group_index_ptr": "*i64", "momentum_ptr": "*fp64", "weight_decay_ptr": "*fp64",
                  "weight_decay32_ptr": "*fp64", "lr_ratio_ptr": "*fp64", "n_rows": "i32", "scalars_ptr": "*fp32",
                  "counters_ptr": "*i32"}, {"BLOCK_ROWS": launch.SCALAR_BLOCK_ROWS})
    n += 1
    names = {"x": "*bf16", "partials": "*fp32", "scalars": "*fp32", "y0": "*bf16", "y1": "*bf16",
             "gram": "*bf16", "poly": "*bf16"}
    arguments = {ns_kernel.ns_gemm_kernel: ("a_ptr", "b_ptr", "c_ptr", "scalars_ptr", "out_ptr"),
                 ns_kernel.ns_square_sums_kernel: ("y_ptr", "partials_ptr"),
                 ns_kernel.ns_normalize_kernel: ("y_ptr", "partials_ptr", "scalars_ptr", "out_ptr")}
    seen = set()
    for kernel, _, buffers, constants, options in ns_kernel.launch_plan(2, 768, 3072, 1, interpreting=False):
        key = (kernel, tuple(sorted(constants.items())))
        if key not in seen:
            seen.add(key)
            compile_sm90(kernel, {arg: names[b] for arg, b in zip(arguments[kernel], buffers)}, constants, options)
            n += 1
    return n


MULTI_TENSOR_SIGNATURE = {"pointers_ptr": "*i64", "block_tensor_ptr": "*i32", "block_index_ptr": "*i32",
                          "numels_ptr": "*i64", "scalar_rows_ptr": "*i32", "scalars_ptr": "*fp32",
                          "counters_ptr": "*i32", "n_tensors": "i32"}


def table_and_leaf_group(multi_tensor_kernel, leaf_group_kernel, flags: dict, state: str) -> int:
    """A rule's multi-tensor kernel (torch's pointer table) and leaf-group kernel (jax-triton's
    slots) with the format's `flags`, for float32 weights and for split bf16 weights with float32
    and bf16 gradients; `state`: the state buffers' type."""
    for split, grad_bf16 in ((False, False), (True, False), (True, True)):
        launch_flags = {**flags, "SPLIT": split, "GRAD_BF16": grad_bf16, "BLOCK": launch.GPU_BLOCK}
        compile_sm90(multi_tensor_kernel, MULTI_TENSOR_SIGNATURE, {**launch_flags, "ALIGNED": True})
        weights = "*u16" if split else "*fp32"
        buffers = {"param": weights, "out": weights, "lo": "*i16", "new_lo": "*i16",
                   "grad": "*bf16" if grad_bf16 else "*fp32", "state": state, "new_state": state}
        signature = {name: buffers[name.rsplit("_", 1)[0]] for name in leaf_group_kernel.arg_names
                     if name.rsplit("_", 1)[0] in buffers}
        signature.update({"leaf_table_ptr": "*i64", "scalars_ptr": "*fp32", "counters_ptr": "*i32",
                          "new_counters_ptr": "*i32"})
        compile_sm90(leaf_group_kernel, signature, {**launch_flags, "WRITE_UPDATE": not split})
    return 6


def adamw_kernels() -> int:
    """AdamW's multi-tensor kernel (torch's pointer table) and leaf-group kernel (jax-triton's
    slots), whose addressing is core's launch skeleton (core/kernel.py): packed and fp32 modes,
    float32 weights, and bf16 weights with split masters and float32 or bf16 gradients."""
    from packed_adamw.core.adamw import kernel as ak
    from packed_adamw.core.adamw.state_format import StateFormat as AdamWFormat

    n = 0
    for mode in ("packed", "fp32"):
        flags = {**AdamWFormat(mode).kernel_constexprs(track_format=False), "COUNT_NONFINITE": True,
                 "TRACK_FORMAT": False}
        n += table_and_leaf_group(ak.adamw_multi_tensor_kernel, ak.adamw_leaf_group_kernel, flags,
                                  "*fp32" if mode == "fp32" else "*u32")
    return n


def skeleton_kernels() -> int:
    """The launch skeleton's entry points (core/skeleton.py) over a rule other than AdamW's, the
    heavy ball of tests/test_custom_rule.py (the interpreter takes code the compiler refuses):
    multi-tensor and leaf-group launches of float32 weights and of split bf16 weights with float32
    and bf16 gradients, and the single-tensor ones, counting and not, one block a program and
    several."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from packed_adamw.core import skeleton
    import test_custom_rule as heavy_ball

    flags = {**heavy_ball.FMT.kernel_constexprs(track_format=True), "COUNT_NONFINITE": True, "TRACK_FORMAT": True}
    n = table_and_leaf_group(skeleton.multi_tensor_kernel, skeleton.leaf_group_kernel, flags, "*u16")
    flags["BLOCK"] = launch.GPU_BLOCK
    tensor = {"grad_ptr": "*fp32", "state_ptr": "*i16", "scalars_ptr": "*fp32", "counters_ptr": "*i32",
              "n_elements": "i32", "new_state_ptr": "*i16"}
    for blocks in (1, launch.COUNTING_BLOCKS_PER_PROGRAM):
        program_flags = {**flags, "BLOCKS_PER_PROGRAM": blocks, "LAYOUT": 0}
        compile_sm90(skeleton.tensor_kernel, {**tensor, "param_ptr": "*fp32", "out_ptr": "*fp32"},
                     {**program_flags, "WRITE_UPDATE": False})
        compile_sm90(skeleton.tensor_counting_kernel, {**tensor, "param_ptr": "*fp32", "out_ptr": "*fp32",
                                                       "new_counters_ptr": "*i32"}, {**program_flags, "WRITE_UPDATE": True})
        compile_sm90(skeleton.split_tensor_kernel, {**tensor, "weight_ptr": "*i16", "lo_ptr": "*i16",
                                                    "new_weight_ptr": "*i16", "new_lo_ptr": "*i16"}, program_flags)
        compile_sm90(skeleton.split_tensor_counting_kernel, {
            **tensor, "grad_ptr": "*bf16", "weight_ptr": "*i16", "lo_ptr": "*i16", "new_weight_ptr": "*i16",
            "new_lo_ptr": "*i16", "new_counters_ptr": "*i32"}, program_flags)
        n += 4
    return n


if __name__ == "__main__":
    if "nvidia" not in triton.backends.backends:
        sys.exit("sm90_compile.py: this Triton build has no NVIDIA backend")
    print(f"compiled {group_kernels() + torch_kernels() + scalars_and_newton_schulz() + adamw_kernels() + skeleton_kernels()}")
