"""benchmarks/kernel_instructions.py: the update kernel compiled for the H200 (sm_90) on this
machine, with Triton's bundled ptxas, and its hot path read from the SASS."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from script_helpers import BENCHMARKS

PROBE = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import kernel_instructions as K
options = dict(arch=90, block=512, warps=4, mode="packed")
found = {{kind: K.per_block(kind, **options) for kind in ("plain", "format counts")}}
found["registers"] = {{label: K.registers(*launch, arch=90, block=512, mode="packed") for label, *launch in K.LAUNCHES
                       if "counts" in label}}
found["prefetched memory"] = K.memory_instructions(*K.LAUNCHES_BY_LABEL["format counts, prefetched"], arch=90,
                                                   block=512, mode="packed")
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def per_block():
    triton = pytest.importorskip("triton")
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, tool)) for tool in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton has no bundled ptxas and cuobjdump")
    # Compiled, not interpreted: the suite's TRITON_INTERPRET=1 must not reach the compiler.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(benchmarks=str(BENCHMARKS))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_whole_block_moves_each_buffer_in_16_byte_vectors(per_block):
    # 512 elements on 128 threads: 4 float32 each, one 16-byte load of the parameter, gradient
    # and word, one 16-byte store of the parameter and word. A bounds mask the compiler cannot
    # prove uniform would split them into 4-byte accesses (kernel.py, `_adamw_block`).
    for kind, ops in per_block.items():
        if kind in ("registers", "prefetched memory"):
            continue
        assert ops.get("LDG.E.128", 0) == 3, (kind, ops)
        assert ops.get("STG.E.128", 0) == 2, (kind, ops)
        assert ops.get("LDG.E", 0) == 8 and ops.get("STG.E", 0) == 0, (kind, ops)  # the 8 step scalars


def test_format_counts_add_instructions_to_every_element(per_block):
    plain, counted = (sum(per_block[kind].values()) / 4 for kind in ("plain", "format counts"))
    assert 60 < plain < 160, plain  # decode, step, encode: about a hundred
    assert counted > plain + 6, (plain, counted)  # six counts an element are not free
    # Counted without predicates: 26.5 (triton 3.6) and 23.8 (3.9) more per element, where
    # predicates cost 38.5 and 53.8 (docs/results/SWEEP.md). A formulation that spills again fails.
    assert counted < plain + 30, (plain, counted)


def test_a_shifted_counting_program_needs_fewer_registers(per_block):
    # The premise of launch.LAYOUT_SHIFTED: 64-bit addresses computed once a program, not per
    # block and pointer, leave registers for more programs in flight (56 to 62 against 76 to 85 under
    # triton 3.6 and 3.9; docs/results/SWEEP.md).
    regs = per_block["registers"]
    for kind in ("format counts", "both counts"):
        assert regs[f"{kind}, shifted"] <= regs[f"{kind}, consecutive"] - 12, regs
    # the layout, not the number of blocks: consecutive programs of as many blocks keep theirs
    assert regs["format counts, shifted"] <= regs["format counts, consecutive, as many blocks as shifted"] - 12, regs


def test_a_prefetched_program_keeps_its_loads_16_bytes_wide(per_block):
    # The next block's loads take one flag for the whole block (kernel.py, LAYOUT_PREFETCHED), not
    # an element-wise bound: 16-byte loads of the first block before the loop and of the next one
    # in it, 16-byte stores of the block stepped; the partial last block's accesses are 4 bytes.
    ops = per_block["prefetched memory"]
    assert ops.get("LDG.E.128", 0) == 6 and ops.get("STG.E.128", 0) == 2, ops
