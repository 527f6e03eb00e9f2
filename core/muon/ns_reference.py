"""core/muon/ns_kernel.py's Newton-Schulz in numpy, operation for operation, for tests.

Every rounding the kernels make is made here at the same place: the squares' partial sums
(one per NORM_BLOCK elements, zero-padded, summed as `np.sum` sums float32), the partials'
sum, the bf16 norm and eps, the bf16 quotient, and per product one float32 accumulator per
output tile, fed K block by K block (zero-padded tiles), the epilogue's scaled terms rounded
to float32 before their sum, the result rounded to bf16.

What it cannot mirror is how a GPU's tensor cores sum inside one block product; Triton's CPU
interpreter sums each block product with `np.matmul` (float32) and adds it to the accumulator,
and so does `block_product` here. So in the interpreter the kernels equal this reference bit
for bit (tests/core/test_muon_ns_triton.py); on a GPU they equal each other (torch and JAX launch
the same kernels), not this.
"""
from __future__ import annotations

import numpy as np

from . import ns_kernel
from .float32 import bf16_bits, bf16_values

F32 = np.float32


def _bf16(x) -> np.ndarray:
    return bf16_values(bf16_bits(np.asarray(x, F32)))


def block_product(a, b, blocks: dict, *, b_transposed: bool = False) -> np.ndarray:
    """a [M, K] @ b [K, N] (float32 holding bf16 values) accumulated as `ns_gemm_kernel`
    accumulates in the interpreter. With `b_transposed`, `b` is given as [N, K] and each tile
    is read as the kernel reads it (a transposed view of the loaded rows)."""
    bm, bn, bk = blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"]
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    out = np.zeros((m, n), F32)
    for i0 in range(0, m, bm):
        for j0 in range(0, n, bn):
            acc = np.zeros((bm, bn), F32)
            for k0 in range(0, k, bk):
                a_tile = np.zeros((bm, bk), F32)
                part = a[i0:i0 + bm, k0:k0 + bk]
                a_tile[:part.shape[0], :part.shape[1]] = part
                if b_transposed:
                    rows = np.zeros((bn, bk), F32)
                    part = b[j0:j0 + bn, k0:k0 + bk]
                    rows[:part.shape[0], :part.shape[1]] = part
                    b_tile = np.transpose(rows)
                else:
                    b_tile = np.zeros((bk, bn), F32)
                    part = b[k0:k0 + bk, j0:j0 + bn]
                    b_tile[:part.shape[0], :part.shape[1]] = part
                acc = np.matmul(a_tile, b_tile, dtype=F32) + acc
            block = acc[:min(bm, m - i0), :min(bn, n - j0)]
            out[i0:i0 + block.shape[0], j0:j0 + block.shape[1]] = block
    return out


def normalized(y, eps) -> np.ndarray:
    """bf16(Y / max(bf16(||Y||_F), bf16(f32(eps)))) as `ns_normalize_kernel` computes it."""
    flat = np.asarray(y, F32).reshape(-1)
    n_partials = -(-flat.size // ns_kernel.NORM_BLOCK)
    padded = np.zeros(n_partials * ns_kernel.NORM_BLOCK, F32)
    padded[:flat.size] = flat
    partials = np.array([np.sum(block * block) for block in padded.reshape(n_partials, -1)], F32)
    width = ns_kernel.PARTIALS_BLOCK
    acc = np.zeros(width, F32)
    for start in range(0, n_partials, width):
        chunk = np.zeros(width, F32)
        part = partials[start:start + width]
        chunk[:part.size] = part
        acc = acc + chunk
    norm = _bf16(np.sqrt(np.sum(acc)))
    norm = np.maximum(norm, _bf16(F32(eps)))
    with np.errstate(divide="ignore", invalid="ignore"):
        return _bf16(np.asarray(y, F32) / norm)


def newton_schulz_triton_reference(x, coefficients=(3.4445, -4.775, 2.0315), steps=5, eps=1e-7,
                                   blocks: dict | None = None) -> np.ndarray:
    """The Triton Newton-Schulz of one matrix `x` (bf16 bits as uint16/int16, or float32
    holding bf16 values), in `x`'s orientation, as bf16 bits (uint16). `blocks`: the tiles the
    kernels were launched with (default: ns_kernel's)."""
    blocks = ns_kernel.default_blocks() if blocks is None else blocks
    x = np.asarray(x)
    x = bf16_values(x) if x.dtype in (np.uint16, np.int16) else _bf16(x)
    tall = x.shape[0] > x.shape[1]
    y = normalized(x.T if tall else x, eps)
    a, b, c = ns_kernel.ns_scalars(coefficients, eps)[:3]
    for _ in range(steps):
        gram = _bf16(block_product(y, y, blocks, b_transposed=True))
        poly = _bf16(block_product(gram, gram, blocks) * c + gram * b)
        y = _bf16(block_product(poly, y, blocks) + y * a)
    return bf16_bits(y.T if tall else y)
