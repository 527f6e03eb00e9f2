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
    H.inject_nonfinite(rng, gs[-2 if len(gs) > 1 else 0])
    states = [H.random_state(rng, n, fmt) for n in sizes]
    return ps, gs, states


def test_the_fast_relaunch_is_used_on_checked_triton_releases_only_and_says_so_once_elsewhere(monkeypatch):
    """_Relaunch leans on Triton internals: on a release it was not checked on it stays off (the
    caller launches through Triton's usual path) and warns once per process."""
    import types
    import warnings

    from packed_adamw.torch import _launch

    assert _launch.triton_release("3.6.0") == (3, 6)
    assert _launch.triton_release("3.10.1+git1a2b3c4") == (3, 10)
    assert _launch.triton_release("unknown") == (0, 0)
    jit_fn = types.SimpleNamespace(arg_names=["x", "n", "BLOCK"])
    compiled = types.SimpleNamespace(run=None)
    monkeypatch.setattr(_launch._Relaunch, "warned", False)
    monkeypatch.setattr(_launch, "_triton_version", lambda: (3, 6))
    assert _launch._Relaunch.CHECKED_TRITON == ((3, 6),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = _launch._Relaunch.of(jit_fn, compiled, 2, {"BLOCK": 256})
    assert fast is not None and fast.constants == (256,)
    monkeypatch.setattr(_launch, "_triton_version", lambda: (3, 8))
    with pytest.warns(_launch.UncheckedTritonWarning, match=r"Triton 3.8 is not a release .*checked on \(3.6\)"):
        assert _launch._Relaunch.of(jit_fn, compiled, 2, {"BLOCK": 256}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert _launch._Relaunch.of(jit_fn, compiled, 2, {"BLOCK": 256}) is None


def test_block_table_covers_every_block_once():
    sizes, block = [1, 7, 300, 256, 257, 3], 256
    block_tensor, block_index = launch.block_table(sizes, block)
    pairs = list(zip(block_tensor.tolist(), block_index.tolist()))
    expected = [(t, b) for t, n in enumerate(sizes) for b in range((n + block - 1) // block)]
    assert pairs == expected


@pytest.mark.parametrize("mode", MODES)
def test_interpreted_multi_tensor_kernel_equals_numpy_per_tensor(mode, device):
    from packed_adamw.core.adamw.kernel import adamw_multi_tensor_kernel, step_scalars_kernel

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
    # Rows in reverse tensor order: each tensor must read the row the row table names.
    hparams = torch.tensor([hp.as_float32_list() for hp in hps[::-1]], dtype=torch.float32, device=device)
    counts_t = torch.tensor(counts[::-1], dtype=torch.int32, device=device)
    scalar_rows = torch.arange(len(sizes) - 1, -1, -1, dtype=torch.int32, device=device)
    scalars = torch.empty((len(sizes), 8), dtype=torch.float32, device=device)
    step_scalars_kernel[launch.grid(len(sizes), launch.SCALAR_BLOCK_ROWS)](
        hparams, counts_t, len(sizes), scalars, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **H._compile_options(False))
    block_tensor, block_index = launch.block_table(sizes, block)
    pointers = torch.tensor([t.data_ptr() for t in (*tp, *tg, *ts)], dtype=torch.int64, device=device)
    nonfinite = H.new_counters(len(sizes), device)
    adamw_multi_tensor_kernel[(len(block_tensor),)](
        pointers, torch.from_numpy(block_tensor).to(device), torch.from_numpy(block_index).to(device),
        torch.tensor(sizes, dtype=torch.int64, device=device), scalar_rows, scalars, nonfinite, len(sizes),
        ALIGNED=False,
        **launch.kernel_constants(fmt, write_update=None, count_nonfinite=True, block=block), **H._compile_options())

    for i, (p_exp, s_exp, rejected) in enumerate(expected):
        H.assert_same_bits(tp[i].cpu().numpy(), p_exp, f"params of tensor {i}")
        H.assert_same_bits(H._state_to_numpy(ts[i], fmt), s_exp, f"state of tensor {i}")
    assert nonfinite[:, 0].tolist() == [r for _, _, r in expected]
    assert sum(nonfinite[:, 0].tolist()) > 0  # the injected NaN/Inf were seen


def test_leaf_groups_cover_every_nonempty_leaf_once_in_size_order():
    from packed_adamw.jax._leaf_group import LEAVES_PER_LAUNCH, leaf_groups

    sizes = [5, 0, launch.SOLO_ELEMENTS, 3, *range(100, 100 + 2 * LEAVES_PER_LAUNCH), launch.SOLO_ELEMENTS - 1]
    solo, groups = leaf_groups(sizes)
    assert solo == [2]
    assert all(1 <= len(group) <= LEAVES_PER_LAUNCH for group in groups)
    grouped = [i for group in groups for i in group]
    assert sorted(grouped) == [i for i, n in enumerate(sizes) if 0 < n < launch.SOLO_ELEMENTS]
    assert [sizes[i] for i in grouped] == sorted(sizes[i] for i in grouped)


def test_leaf_group_launches_refuse_more_leaves_than_slots():
    from packed_adamw.jax._leaf_group import LEAVES_PER_LAUNCH, fill_slots, leaf_group_table

    with pytest.raises(ValueError, match="n_leaves"):
        leaf_group_table([1] * (LEAVES_PER_LAUNCH + 1), [0] * (LEAVES_PER_LAUNCH + 1))
    with pytest.raises(ValueError, match="n_leaves"):
        fill_slots([], (None,))


def test_leaf_group_kernel_has_a_slot_of_each_buffer_per_leaf_in_the_launchers_order():
    """The kernel's arguments are what the JAX launcher (`_leaf_group`'s indices) passes."""
    import inspect

    from packed_adamw.core.adamw.kernel import FUNCTIONAL_KERNELS
    from packed_adamw.jax import _leaf_group as LG

    params = inspect.signature(FUNCTIONAL_KERNELS.leaf_group.fn).parameters.values()
    buffers = [p.name for p in params if "constexpr" not in str(p.annotation)]
    slots = range(launch.LEAF_GROUP_SLOTS)
    assert buffers == [*(f"{b}_{i}" for i in slots for b in LG.SLOT_INPUTS), "leaf_table_ptr", "scalars_ptr",
                       "counters_ptr", *(f"{b}_{i}" for i in slots for b in LG.SLOT_OUTPUTS), "new_counters_ptr"]
    n_inputs = buffers.index("counters_ptr") + 1
    assert buffers[LG.COUNTERS_INPUT] == "counters_ptr" and buffers[n_inputs + LG.COUNTERS_OUTPUT] == "new_counters_ptr"
    assert buffers[LG.input_index(3, "grad")] == "grad_3"
    assert buffers[n_inputs + LG.output_index(3, "new_lo")] == "new_lo_3"


@pytest.mark.parametrize("write_update", [False, True], ids=["in_place", "update"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_leaves", [1, 2, 5])
def test_interpreted_leaf_group_kernel_equals_numpy_per_leaf(mode, write_update, n_leaves, device):
    """The jax-triton launch over separate leaves, called here with torch tensors in the same
    argument order: in place (the fused step) and writing updates (the transform)."""
    from packed_adamw.core.adamw.kernel import FUNCTIONAL_KERNELS
    from packed_adamw.jax._leaf_group import fill_slots, leaf_group_table

    fmt = StateFormat(mode)
    rng = np.random.default_rng(13)
    block = launch.block_size()
    sizes = [block + 1, 1, block, 7, block - 1][:n_leaves]
    ps, gs, states = _tensors(rng, sizes, fmt)
    hps = [Hyperparams(lr=1e-3, weight_decay=wd) for wd in (0.1, 0.0)]  # with and without decay
    rows = [0, 1, 0, 1, 1][:n_leaves]
    count = 7
    expected = [H.numpy_reference(p, g, s, count=count, hp=hps[r], fmt=fmt, write_update=write_update)
                for p, g, s, r in zip(ps, gs, states, rows)]

    tp = [torch.from_numpy(p.copy()).to(device) for p in ps]
    tg = [torch.from_numpy(g).to(device) for g in gs]
    ts = [H._state_to_torch(s, fmt, device) for s in states]
    scalars = torch.stack([H.kernel_step_scalars(hp, count, device) for hp in hps])
    outs = [torch.empty_like(p) for p in tp] if write_update else tp
    new_states = [torch.empty_like(s) for s in ts] if write_update else ts
    nonfinite = H.new_counters(len(sizes), device)
    table = torch.from_numpy(leaf_group_table(sizes, rows)).to(device)
    no_lo = torch.zeros(1, dtype=torch.int16, device=device)  # FP32 leaves: the low halves' slots unused
    placeholder = lambda t: torch.zeros(1, dtype=t.dtype, device=device)  # noqa: E731
    FUNCTIONAL_KERNELS.leaf_group[(launch.grid(max(sizes), block)[0], len(sizes))](
        *fill_slots(list(zip(tp, [no_lo] * len(sizes), tg, ts)), (placeholder(tp[0]), no_lo, placeholder(tg[0]),
                                                                  placeholder(ts[0]))),
        table, scalars, nonfinite,
        *fill_slots(list(zip(outs, [no_lo] * len(sizes), new_states)), (placeholder(tp[0]), no_lo, placeholder(ts[0]))),
        nonfinite,  # the counter rows as the kernel adds to them (jax-triton's output, aliased to the input)
        **launch.kernel_constants(fmt, write_update=None, count_nonfinite=True, block=block),
        WRITE_UPDATE=write_update, GRAD_BF16=False, **H._compile_options(),
    )
    for i, (out_exp, s_exp, rejected) in enumerate(expected):
        H.assert_same_bits(outs[i].cpu().numpy(), out_exp, f"{'updates' if write_update else 'params'} of leaf {i}")
        H.assert_same_bits(H._state_to_numpy(new_states[i], fmt), s_exp, f"state of leaf {i}")
    assert nonfinite[:, 0].tolist() == [r for _, _, r in expected]
    assert sum(nonfinite[:, 0].tolist()) > 0  # the injected NaN/Inf were seen


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
