"""One launch for many tensors gives the same bits as one launch per tensor and as numpy.

The interpreted kernel is checked here directly (CPU); on CUDA the torch frontend's two launch
paths are compared through `adamw_step_`.
"""
import numpy as np
import pytest
import torch

import kernel_harness as H
from packed_adamw.core import Hyperparams, StateFormat, launch

MODES = ["packed", "fp16", "fp32"]


def _tensors(rng, sizes, fmt):
    ps = [H.random_params(rng, n) for n in sizes]
    gs = [H.random_grads(rng, n, fmt) for n in sizes]
    H.inject_nonfinite(rng, gs[-2])
    states = [H.random_state(rng, n, fmt) for n in sizes]
    return ps, gs, states


def test_block_table_covers_every_block_once():
    sizes, block = [1, 7, 300, 256, 257, 3], 256
    block_tensor, block_index = launch.block_table(sizes, block)
    pairs = list(zip(block_tensor.tolist(), block_index.tolist()))
    expected = [(t, b) for t, n in enumerate(sizes) for b in range((n + block - 1) // block)]
    assert pairs == expected


@pytest.mark.parametrize("mode", MODES)
def test_interpreted_multi_tensor_kernel_equals_numpy_per_tensor(mode, device):
    from packed_adamw.core.kernel import adamw_multi_tensor_kernel, step_scalars_kernel

    fmt = StateFormat(mode)
    rng = np.random.default_rng(11)
    block = launch.block_size()
    sizes = [1, 7, block - 1, block, block + 1, 3]
    ps, gs, states = _tensors(rng, sizes, fmt)
    hps = [Hyperparams(lr=1e-3 * (i + 1), weight_decay=0.05 * i, b2=0.95 + 0.008 * i) for i in range(len(sizes))]
    counts = [1, 2, 3, 10, 1000, 2**31 - 1]
    expected = [H.numpy_reference(p, g, s, count=c, hp=hp, fmt=fmt) for p, g, s, c, hp in zip(ps, gs, states, counts, hps)]

    tp = [torch.from_numpy(p.copy()).to(device) for p in ps]
    tg = [torch.from_numpy(g).to(device) for g in gs]
    ts = [H._state_to_torch(s, fmt, device) for s in states]
    hparams = torch.tensor([hp.as_float32_list() for hp in hps], dtype=torch.float32, device=device)
    counts_t = torch.tensor(counts, dtype=torch.int32, device=device)
    scalars = torch.empty((len(sizes), 8), dtype=torch.float32, device=device)
    step_scalars_kernel[launch.grid(len(sizes), launch.SCALAR_BLOCK_ROWS)](
        hparams, counts_t, len(sizes), scalars, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **H._compile_options(False))
    block_tensor, block_index = launch.block_table(sizes, block)
    pointers = torch.tensor([t.data_ptr() for t in (*tp, *tg, *ts)], dtype=torch.int64, device=device)
    nonfinite = torch.zeros(len(sizes), dtype=torch.int32, device=device)
    adamw_multi_tensor_kernel[(len(block_tensor),)](
        pointers, torch.from_numpy(block_tensor).to(device), torch.from_numpy(block_index).to(device),
        torch.tensor(sizes, dtype=torch.int64, device=device), scalars, nonfinite, len(sizes), ALIGNED=False,
        **launch.kernel_constants(fmt, write_update=None, count_nonfinite=True, block=block), **H._compile_options())

    for i, (p_exp, s_exp, rejected) in enumerate(expected):
        H.assert_same_bits(tp[i].cpu().numpy(), p_exp, f"params of tensor {i}")
        H.assert_same_bits(H._state_to_numpy(ts[i], fmt), s_exp, f"state of tensor {i}")
    assert nonfinite.tolist() == [r for _, _, r in expected]
    assert sum(nonfinite.tolist()) > 0  # the injected NaN/Inf were seen


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_one_launch_equals_a_launch_per_tensor(mode):
    from packed_adamw.torch.functional import adamw_step_, new_state

    fmt = StateFormat(mode)
    rng = np.random.default_rng(12)
    sizes = [1, 7, 255, 256, 257, 3_000_001, 12095 * 256]
    ps, gs, _ = _tensors(rng, sizes, fmt)
    results = {}
    for multi in (True, False):
        params = [torch.from_numpy(p.copy()).cuda() for p in ps]
        grads = [torch.from_numpy(g).cuda() for g in gs]
        states = [new_state(p, fmt) for p in params]
        hparams = [tuple(Hyperparams(lr=1e-3 * (i + 1), weight_decay=0.1).as_float32_list()) for i in range(len(sizes))]
        for count in range(1, 4):
            rejected = adamw_step_(params, grads, states, [count] * len(sizes), hparams, fmt, multi_tensor=multi)
        results[multi] = ([p.cpu().numpy() for p in params], [H._state_to_numpy(s.view(torch.int32) if mode != "fp32" else s, fmt) for s in states], rejected)
    for i in range(len(sizes)):
        H.assert_same_bits(results[True][0][i], results[False][0][i], f"params {i}")
        H.assert_same_bits(results[True][1][i], results[False][1][i], f"state {i}")
    assert results[True][2] == results[False][2]
