"""Launches the single-tensor kernel's layouts of several blocks a program (interpreted) on
tensors whose last byte is the last one before an inaccessible page, so that a load past a
tensor's end faults (SIGSEGV) instead of reading a neighbour's memory unnoticed. Sentinels
catch writes past a tensor; only this catches reads, such as a prefetch of a block that is
not the program's. Run by tests/core/test_format_counts.py in a subprocess:

    TRITON_INTERPRET=1 python tests/guarded_reads.py launch    # prints "no read past a tensor"
    TRITON_INTERPRET=1 python tests/guarded_reads.py control   # reads one float past: must fault
"""
import ctypes
import mmap
import sys

import numpy as np
import torch

import kernel_harness as H
from packed_adamw.core import Hyperparams, StateFormat, launch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_regions = []  # the mappings stay alive as long as their tensors


def guarded(n: int, dtype: torch.dtype) -> torch.Tensor:
    """n elements ending right before a PROT_NONE page."""
    size = n * torch.empty((), dtype=dtype).element_size()
    pages = -(-size // mmap.PAGESIZE)
    region = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if _libc.mprotect(base + pages * mmap.PAGESIZE, mmap.PAGESIZE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    _regions.append(region)
    return torch.frombuffer(region, dtype=dtype, count=n, offset=pages * mmap.PAGESIZE - size)


def main(kind: str) -> None:
    if kind == "control":
        t = guarded(16, torch.float32)
        print(ctypes.c_float.from_address(t.data_ptr() + t.numel() * 4).value)
        return
    hp, rng = Hyperparams(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01), np.random.default_rng(0)
    for layout in (launch.LAYOUT_CONSECUTIVE, launch.LAYOUT_SHIFTED, launch.LAYOUT_PREFETCHED):
        # whole programs; whole blocks then a partial one; under a block (block 64, 4 blocks a program)
        for n in (4 * 64 * 3, 4 * 64 * 3 + 64 * 2 + 17, 5):
            p, g, words = guarded(n, torch.float32), guarded(n, torch.float32), guarded(n, torch.int32)
            p.copy_(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
            g.copy_(torch.from_numpy(rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)))
            words.zero_()
            # format counts, and non-finite counts alone (the check_nonfinite launch)
            for write_update, track_format in ((False, True), (True, True), (False, False)):
                H.launch_kernel(p, g, words, count=1, hp=hp, fmt=StateFormat("packed"), write_update=write_update,
                                block=64, track_format=track_format, blocks_per_program=4, layout=layout)
    print("no read past a tensor")


if __name__ == "__main__":
    main(sys.argv[1])
