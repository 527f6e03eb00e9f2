"""Instructions per element of the update kernel's hot path, from its SASS, on any machine.

    python benchmarks/investigations/kernel_instructions.py [--arch 90] [--block 512] [--warps 4] [--mode packed]

The update kernel runs near the H200's instruction-issue limit as well as its bandwidth, so
what counting adds per element shows in its time (docs/results/SWEEP.md). This compiles the
per-block work (`adamw_block` of core/adamw/kernel.py, a whole block, no bounds mask) for an NVIDIA target with
Triton's bundled ptxas, so it needs no GPU, and reports the static SASS instructions each
element costs: a wrapper of one block and one of two blocks unrolled, whose difference is one
block's instructions without the program's setup, reductions and atomics. Static counts
include the division and square-root slow paths, which run rarely; the differences between
launch kinds are what this measures. Times come only from the GPU sweep.

It also compiles the whole single-tensor kernel (`adamw_kernel`) of each counting launch and
reports its registers a thread, which bound how many programs an SM keeps in flight: the
consecutive layout and the layouts laid out once (`launch.LAYOUT_SHIFTED`, `LAYOUT_PREFETCHED`).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.adamw.kernel import adamw_block, adamw_kernel

KINDS = {"plain": (False, False), "nonfinite counts": (False, True), "format counts": (True, False),
         "both counts": (True, True)}


@triton.jit
def _blocks(param_ptr, grad_ptr, state_ptr, scalars_ptr, out_ptr, n_elements,
            MODE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
            M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
            R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
            BLOCK: tl.constexpr, UNROLLED: tl.constexpr):
    """UNROLLED whole blocks in place; every count the blocks return is summed and stored, so
    that the compiler keeps the counting work."""
    first = tl.program_id(0).to(tl.int64) * UNROLLED
    total = tl.zeros([BLOCK], tl.int32)
    for k in tl.static_range(UNROLLED):
        offsets = (first + k) * BLOCK + tl.arange(0, BLOCK)
        counts = adamw_block(param_ptr, grad_ptr, state_ptr, param_ptr, scalars_ptr, param_ptr, state_ptr, param_ptr,
                              offsets, n_elements, False, MODE, False, False, COUNT_NONFINITE, TRACK_FORMAT,
                              M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX)
        for i in tl.static_range(len(counts)):
            total += counts[i]
    tl.store(out_ptr + tl.arange(0, BLOCK), total)


def _sass_tool() -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.join(bin_dir, "cuobjdump")


def _cubin(fn, signature: dict, constants: dict, *, arch: int, warps: int) -> bytes:
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    compiled = triton.compile(ASTSource(fn, {**signature, **{name: "constexpr" for name in constants}},
                                        constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, **launch.COMPILE_OPTIONS})
    return compiled.asm["cubin"]


def opcodes(kind: str, unrolled: int, *, arch: int, block: int, warps: int, mode: str) -> list[str]:
    """The SASS opcodes of `_blocks` (NOPs dropped)."""
    track, nonfinite = KINDS[kind]
    constants = launch.kernel_constants(StateFormat(mode), write_update=False, count_nonfinite=nonfinite,
                                        block=block, track_format=track)
    constants.pop("WRITE_UPDATE")
    constants["UNROLLED"] = unrolled
    pointer_types = {"param_ptr": "*fp32", "grad_ptr": "*fp32", "state_ptr": "*i32", "scalars_ptr": "*fp32",
                     "out_ptr": "*i32"}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(_cubin(_blocks, {**pointer_types, "n_elements": "i32"}, constants, arch=arch, warps=warps))
        cubin.flush()
        listing = subprocess.run([_sass_tool(), "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in listing.splitlines():
        match = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if match and not match.group(2).startswith("NOP"):
            ops.append(match.group(2))
    return ops


# (label, track_format, count_nonfinite, blocks a program, launch.LAYOUT_*, warps)
_CONSECUTIVE, _SHIFTED, _PREFETCHED = launch.LAYOUT_CONSECUTIVE, launch.LAYOUT_SHIFTED, launch.LAYOUT_PREFETCHED
_WARPS, _LAID_OUT = launch.COUNTING_NUM_WARPS, launch.LAID_OUT_BLOCKS_PER_PROGRAM
LAUNCHES = [("uncounted (the default launch)", False, False, 1, _CONSECUTIVE, launch.GPU_NUM_WARPS),
            ("format counts, consecutive", True, False, launch.COUNTING_BLOCKS_PER_PROGRAM, _CONSECUTIVE, _WARPS),
            ("format counts, consecutive, as many blocks as shifted", True, False, _LAID_OUT, _CONSECUTIVE, _WARPS),
            ("format counts, shifted", True, False, _LAID_OUT, _SHIFTED, _WARPS),
            ("format counts, prefetched", True, False, _LAID_OUT, _PREFETCHED, _WARPS),
            ("nonfinite counts, consecutive", False, True, launch.COUNTING_BLOCKS_PER_PROGRAM, _CONSECUTIVE, _WARPS),
            ("nonfinite counts, prefetched (the check_nonfinite launch)", False, True, _LAID_OUT, _PREFETCHED, _WARPS),
            ("both counts, consecutive", True, True, launch.COUNTING_BLOCKS_PER_PROGRAM, _CONSECUTIVE, _WARPS),
            ("both counts, shifted", True, True, _LAID_OUT, _SHIFTED, _WARPS),
            ("both counts, prefetched", True, True, _LAID_OUT, _PREFETCHED, _WARPS)]
LAUNCHES_BY_LABEL = {label: kind for label, *kind in LAUNCHES}


def _launch_tool_output(flag: str, track: bool, nonfinite: bool, blocks: int, layout: int, warps: int, *,
                        arch: int, block: int, mode: str) -> str:
    """cuobjdump `flag` of `adamw_kernel` compiled for that launch."""
    constants = launch.kernel_constants(StateFormat(mode), write_update=False, count_nonfinite=nonfinite,
                                        block=block, track_format=track)
    constants["BLOCKS_PER_PROGRAM"], constants["LAYOUT"] = blocks, layout
    signature = {"param_ptr": "*fp32", "grad_ptr": "*fp32", "state_ptr": "*i32", "scalars_ptr": "*fp32",
                 "counters_ptr": "*i64", "n_elements": "i32", "out_ptr": "*fp32", "new_state_ptr": "*i32"}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(_cubin(adamw_kernel, signature, constants, arch=arch, warps=warps))
        cubin.flush()
        return subprocess.run([_sass_tool(), flag, cubin.name], capture_output=True, text=True, check=True).stdout


def registers(*launch_kind, **options) -> int:
    """Registers a thread of `adamw_kernel` for that launch (cuobjdump's resource usage)."""
    return int(re.search(r"REG:(\d+)", _launch_tool_output("-res-usage", *launch_kind, **options)).group(1))


def memory_instructions(*launch_kind, **options) -> dict[str, int]:
    """The global loads and stores of that launch's whole `adamw_kernel`, by opcode."""
    return dict(collections.Counter(re.findall(r"\b((?:LDG|STG)[A-Z0-9_.]*)",
                                               _launch_tool_output("-sass", *launch_kind, **options))))


def per_block(kind: str, **options) -> dict[str, int]:
    """One block's opcodes and how often each occurs: two unrolled blocks less one."""
    two, one = collections.Counter(opcodes(kind, 2, **options)), collections.Counter(opcodes(kind, 1, **options))
    return {op: two[op] - one[op] for op in set(two) | set(one)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 90 for the H200")
    parser.add_argument("--block", type=int, default=launch.GPU_BLOCK)
    parser.add_argument("--warps", type=int, default=launch.COUNTING_NUM_WARPS)
    parser.add_argument("--mode", default="packed", choices=("packed", "fp16"))
    args = parser.parse_args()
    options = dict(arch=args.arch, block=args.block, warps=args.warps, mode=args.mode)
    elements_per_thread = args.block // (32 * args.warps)
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.mode}, BLOCK {args.block}, {args.warps} warps "
          f"({elements_per_thread} elements a thread)\n")
    print("| launch | instructions / element | added to plain | largest additions (per element) |")
    print("|---|---|---|---|")
    plain = per_block("plain", **options)
    for kind in KINDS:
        ops = plain if kind == "plain" else per_block(kind, **options)
        added = {op: (ops.get(op, 0) - plain.get(op, 0)) / elements_per_thread for op in set(ops) | set(plain)}
        largest = ", ".join(f"{op} {n:+.1f}" for op, n in sorted(added.items(), key=lambda x: (-abs(x[1]), x[0]))[:4] if n)
        print(f"| {kind} | {sum(ops.values()) / elements_per_thread:.1f} | "
              f"{(sum(ops.values()) - sum(plain.values())) / elements_per_thread:+.1f} | {largest or '-'} |")
    print("\n| adamw_kernel launch | blocks a program | warps | registers a thread |")
    print("|---|---|---|---|")
    for label, track, nonfinite, blocks, layout, warps in LAUNCHES:
        regs = registers(track, nonfinite, blocks, layout, warps, arch=args.arch, block=args.block, mode=args.mode)
        print(f"| {label} | {blocks} | {warps} | {regs} |")


if __name__ == "__main__":
    main()
