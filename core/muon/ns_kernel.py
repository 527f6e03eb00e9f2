"""Newton-Schulz in Triton (docs/MUON.md, "The Newton-Schulz phase"): one implementation that
torch (`PackedMuon(ns_impl="triton")`) and JAX (`packed_muon` on a GPU backend) both launch, so
the two give the same bits. Framework-free: the frontends allocate the buffers and make the
launches in the order `launch_plan` gives (core/muon/ns_reference.py mirrors it in numpy).

The matrices of one launch share one wide shape (k, n), k <= n, and sit in one contiguous
[B, k, n] bf16 buffer (a tall matrix enters transposed). Every product accumulates in float32
over K in BLOCK_K steps, in order, in one program per output tile (no split-K, no autotuning),
and every sum of the norm runs in a fixed order: the bits depend only on the shapes and the
constants below, never on the batch (a matrix's programs read only its own slot) or the run.
The shapes are constexprs, so torch's launcher and jax-triton compile the same specialisation.

Compile with launch.COMPILE_OPTIONS (`enable_fp_fusion=False`): each scaled term of an
epilogue is rounded to float32 before the sum, as the contract says. Conversions between bf16
and float32 are made on the bits (`_f32`, `_bf16`): Triton's CPU interpreter casts float32 to
bf16 by truncation, where a GPU rounds to nearest even. The GEMM epilogue on a GPU rounds by
the conversion instruction instead (`_bf16_by_instruction`, the same bits), because there the
integer form is paid on every output of every product.
"""
import numpy as np
import triton
import triton.language as tl

from .kernel import QUIET_NAN_BF16, _bf16_bits, _bf16_from_bits

# The tiles: facts of the bits, not tuning knobs (another tile shape sums in another order).
BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
GEMM_NUM_WARPS = 8
GEMM_NUM_STAGES = 3
# The norm: NORM_BLOCK elements per partial sum, the partials summed PARTIALS_BLOCK at a time.
NORM_BLOCK = 4096
PARTIALS_BLOCK = 1024
NORM_NUM_WARPS = 4
NORM_NUM_STAGES = 1

@triton.jit
def _f32(x):
    """bf16 -> float32, exactly."""
    return _bf16_from_bits(x.to(tl.int16, bitcast=True))


@triton.jit
def _bf16(x):
    """float32 -> bf16, to nearest even, on the bits (every NaN 0x7FC0: kernel._bf16_bits)."""
    return _bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_by_instruction(x):
    """`_bf16`'s bits on a GPU: the conversion instruction (IEEE round to nearest even, which is
    the bits' rounding for every finite value and for Inf) and a select giving NaN `_bf16`'s
    0x7FC0 (the instruction's NaN is the platform's). Several integer operations fewer an output
    than `_bf16`, which cost d12's Newton-Schulz 6% when its NaN select was added (MUON_NS.md).
    Never in the interpreter, which truncates; tests/torch_frontend/test_torch_muon.py checks the
    bits on CUDA."""
    bits = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.uint16, bitcast=True)
    return tl.where(x == x, bits, QUIET_NAN_BF16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


EPILOGUE_NONE = 0  # out = bf16(A @ B)                        the Gram matrix
EPILOGUE_POLYNOMIAL = 1  # out = bf16(f32(c * (A @ B)) + f32(b * C))    A = B = C = G
EPILOGUE_UPDATE = 2  # out = bf16((A @ B) + f32(a * C))             A = P, B = C = Y


@triton.jit
def ns_square_sums_kernel(y_ptr, partials_ptr, N_ELEMENTS: tl.constexpr, N_PARTIALS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Grid (N_PARTIALS, B): partial sum j of matrix z's squares (bf16 squares are exact in
    float32) into partials[z, j]."""
    z = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = _f32(tl.load(y_ptr + z * N_ELEMENTS + offsets, mask=offsets < N_ELEMENTS, other=0.0))
    tl.store(partials_ptr + z * N_PARTIALS + tl.program_id(0), tl.sum(y * y, axis=0))


@triton.jit
def ns_normalize_kernel(y_ptr, partials_ptr, scalars_ptr, out_ptr, N_ELEMENTS: tl.constexpr, N_PARTIALS: tl.constexpr,
                        BLOCK: tl.constexpr, PARTIALS: tl.constexpr):
    """Grid (N_PARTIALS, B): out = bf16(Y / max(bf16(sqrt(sum of squares)), bf16(eps))), each
    program dividing its block. Every program of a matrix sums that matrix's partials in the
    same order, so all of them divide by the same norm. `scalars`: `ns_scalars`' float32 row;
    its eps is rounded to bf16 here, as torch's bf16 clamp rounds it."""
    z = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([PARTIALS], tl.float32)
    for start in range(0, N_PARTIALS, PARTIALS):
        index = start + tl.arange(0, PARTIALS)
        acc += tl.load(partials_ptr + z * N_PARTIALS + index, mask=index < N_PARTIALS, other=0.0)
    norm = _f32(_bf16(tl.sqrt_rn(tl.sum(acc, axis=0))))
    eps = _f32(_bf16(tl.load(scalars_ptr + 3)))
    norm = tl.maximum(norm, eps)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < N_ELEMENTS
    y = _f32(tl.load(y_ptr + z * N_ELEMENTS + offsets, mask=in_bounds, other=0.0))
    tl.store(out_ptr + z * N_ELEMENTS + offsets, _bf16(tl.div_rn(y, norm + tl.zeros_like(y))), mask=in_bounds)


@triton.jit
def ns_gemm_kernel(a_ptr, b_ptr, c_ptr, scalars_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   B_IS_A_TRANSPOSED: tl.constexpr, SYMMETRIC: tl.constexpr,
                   EPILOGUE: tl.constexpr, INTERPRETER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Grid (tiles of [M, N], B): out[z] = the EPILOGUE of A[z] @ B[z] (bf16 [M, K] and [K, N],
    contiguous), accumulated in float32 over K in BLOCK_K steps in order. B_IS_A_TRANSPOSED:
    B is A^T read from `a_ptr` (the Gram matrix Y Y^T; `b_ptr` unused). `c_ptr`: the bf16
    [M, N] term of the epilogue, whose coefficients come from `scalars` (`ns_scalars`' row).
    INTERPRETER (Triton's CPU interpreter, never on a GPU): the operands go to tl.dot as float32
    (exact for bf16 values), as the interpreter's bf16 dot multiplies raw bits, and the epilogue
    rounds on the bits (`_bf16`).
    SYMMETRIC (the Gram matrix and the polynomial, both symmetric; square tiles): only the
    programs of tiles on or above the diagonal compute, and each stores its tile twice, the
    second time transposed below the diagonal. Element (j, i) of the full product sums the
    same exact bf16 products over K in the same order as element (i, j), so the mirror is the
    value the program of (j, i) would compute, at about 60% of the product's work."""
    z = tl.program_id(1).to(tl.int64)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // tiles_n
    pid_n = tl.program_id(0) % tiles_n
    if SYMMETRIC:
        tl.static_assert(BLOCK_M == BLOCK_N)
        tl.static_assert(M == N)
    if not SYMMETRIC or pid_m <= pid_n:
        _gemm_tile(a_ptr, b_ptr, c_ptr, scalars_ptr, out_ptr, z, pid_m, pid_n, M, N, K, B_IS_A_TRANSPOSED,
                   SYMMETRIC, EPILOGUE, INTERPRETER, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _gemm_tile(a_ptr, b_ptr, c_ptr, scalars_ptr, out_ptr, z, pid_m, pid_n, M: tl.constexpr, N: tl.constexpr,
               K: tl.constexpr, B_IS_A_TRANSPOSED: tl.constexpr, SYMMETRIC: tl.constexpr, EPILOGUE: tl.constexpr,
               INTERPRETER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`ns_gemm_kernel`'s tile (pid_m, pid_n) of matrix z."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + z * (M * K)
    b_base = b_ptr + z * (K * N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_base + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if B_IS_A_TRANSPOSED:
            b = tl.trans(tl.load(a_base + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                                 other=0.0))
        else:
            b = tl.load(b_base + kk[:, None] * N + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if INTERPRETER:
            acc = tl.dot(_f32(a), _f32(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out_offsets = z * (M * N) + rm[:, None] * N + rn[None, :]
    in_bounds = (rm[:, None] < M) & (rn[None, :] < N)
    if EPILOGUE == 1:  # b G + c (G G)
        c = _f32(tl.load(c_ptr + out_offsets, mask=in_bounds, other=0.0))
        acc = acc * tl.load(scalars_ptr + 2) + c * tl.load(scalars_ptr + 1)
    elif EPILOGUE == 2:  # a Y + P Y
        c = _f32(tl.load(c_ptr + out_offsets, mask=in_bounds, other=0.0))
        acc = acc + c * tl.load(scalars_ptr)
    if INTERPRETER:
        out = _bf16(acc)
    else:
        out = _bf16_by_instruction(acc)
    tl.store(out_ptr + out_offsets, out, mask=in_bounds)
    if SYMMETRIC and pid_m != pid_n:  # the mirror tile (pid_n, pid_m)
        tl.store(out_ptr + z * (M * N) + rn[:, None] * N + rm[None, :], tl.trans(out),
                 mask=(rn[:, None] < M) & (rm[None, :] < N))


def gemm_grid(m: int, n: int, batch: int, blocks: dict) -> tuple[int, int]:
    return (triton.cdiv(m, blocks["BLOCK_M"]) * triton.cdiv(n, blocks["BLOCK_N"]), batch)


def default_blocks() -> dict:
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}


def ns_scalars(coefficients, eps) -> np.ndarray:
    """The kernels' float32 row (a, b, c, eps), each rounded once from the number given."""
    a, b, c = coefficients
    return np.array([a, b, c, eps], np.float64).astype(np.float32)


def launch_plan(batch: int, k: int, n: int, steps: int, *, interpreting: bool,
                blocks: dict | None = None) -> list[tuple]:
    """The launches of one Newton-Schulz over a [batch, k, n] buffer (k <= n), in order, as
    (kernel, grid, buffers, constexprs, launch options). Buffer names: "x" the input, "scalars"
    `ns_scalars`' row (float32 [4]), "partials" float32 [batch, n_partials], "y0"/"y1" bf16 [batch, k, n] (the
    iterate, alternating: y0 after the normalisation), "gram"/"poly" bf16 [batch, k, k].
    `buffers` lists the kernel's pointer arguments in order; the last one is written. The
    result is `result_buffer(steps)`. `blocks` other than the default are for interpreter tests
    of the tiling only: the bits promised are those of the default tiles."""
    if not 0 < k <= n:
        raise ValueError(f"Newton-Schulz takes matrices in their wide orientation: got (k, n) = ({k}, {n}); "
                         "pass a tall matrix transposed, and no empty one")
    blocks = default_blocks() if blocks is None else dict(blocks)
    n_elements = k * n
    n_partials = triton.cdiv(n_elements, NORM_BLOCK)
    norm_options = {"num_warps": NORM_NUM_WARPS, "num_stages": NORM_NUM_STAGES}
    gemm_options = {"num_warps": GEMM_NUM_WARPS, "num_stages": GEMM_NUM_STAGES}
    norm_constants = {"N_ELEMENTS": n_elements, "N_PARTIALS": n_partials, "BLOCK": NORM_BLOCK}
    plan = [
        (ns_square_sums_kernel, (n_partials, batch), ("x", "partials"), norm_constants, norm_options),
        (ns_normalize_kernel, (n_partials, batch), ("x", "partials", "scalars", "y0"),
         {**norm_constants, "PARTIALS": PARTIALS_BLOCK}, norm_options),
    ]
    gemm = lambda **kw: {"INTERPRETER": bool(interpreting), **blocks, **kw}  # noqa: E731
    symmetric = blocks["BLOCK_M"] == blocks["BLOCK_N"]  # the k x k products mirror square tiles
    for step in range(steps):
        y, y_next = f"y{step % 2}", f"y{(step + 1) % 2}"
        plan += [
            (ns_gemm_kernel, gemm_grid(k, k, batch, blocks), (y, y, y, "scalars", "gram"),
             gemm(M=k, N=k, K=n, B_IS_A_TRANSPOSED=True, SYMMETRIC=symmetric, EPILOGUE=EPILOGUE_NONE), gemm_options),
            (ns_gemm_kernel, gemm_grid(k, k, batch, blocks), ("gram", "gram", "gram", "scalars", "poly"),
             gemm(M=k, N=k, K=k, B_IS_A_TRANSPOSED=False, SYMMETRIC=symmetric, EPILOGUE=EPILOGUE_POLYNOMIAL), gemm_options),
            (ns_gemm_kernel, gemm_grid(k, n, batch, blocks), ("poly", y, y, "scalars", y_next),
             gemm(M=k, N=n, K=k, B_IS_A_TRANSPOSED=False, SYMMETRIC=False, EPILOGUE=EPILOGUE_UPDATE), gemm_options),
        ]
    return plan


def result_buffer(steps: int) -> str:
    return f"y{steps % 2}"


def buffer_shapes(batch: int, k: int, n: int) -> dict:
    """Shape and dtype name of each scratch buffer `launch_plan` names (not "x" and "scalars")."""
    n_partials = triton.cdiv(k * n, NORM_BLOCK)
    return {"partials": ((batch, n_partials), "float32"), "y0": ((batch, k, n), "bfloat16"),
            "y1": ((batch, k, n), "bfloat16"), "gram": ((batch, k, k), "bfloat16"),
            "poly": ((batch, k, k), "bfloat16")}
