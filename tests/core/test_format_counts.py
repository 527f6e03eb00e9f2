"""Format telemetry: the kernel's and the numpy step's counts of saturated, flushed and
subnormal moments (FORMAT.md, "Format counts"), against a recount from the formats'
definitions, and `PackedAdamW(track_format=True).format_stats()`."""
from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kernel_harness as H
from packed_adamw.core import Hyperparams, StateFormat, launch
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT
from packed_adamw.core.adamw.numpy_step import apply_step, step_scalar_row
from packed_adamw.torch import PackedAdamW
from packed_adamw.core.adamw.rule import FORMAT_COUNTS
from layout import TESTS

COUNTED_MODES = ["packed", "fp16"]
HP = Hyperparams(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def recount(m_next, rms_next, new_words, accepted, fmt: StateFormat) -> np.ndarray:
    """The counts from the definitions, with float64 arithmetic and the codecs' decode only:
    saturated = beyond the largest value by half a unit in the last place or more (rounding
    would need a larger code), flushed = nonzero but stored as zero, subnormal = stored below
    the smallest normal but not zero."""
    m_fmt, r_fmt = fmt.formats
    out = np.zeros(6, np.int64)
    codes = (new_words >> np.uint32(MOMENT_SHIFT), new_words & np.uint32(0xFFFF))
    for k, (value, code, f) in enumerate(((m_next, codes[0], m_fmt), (rms_next, codes[1], r_fmt))):
        top = f.max_exponent_code - f.bias
        half_ulp = 2.0 ** (top - f.fraction_bits - 1)
        stored = np.abs(f.decode(code).astype(np.float64))
        magnitude = np.abs(value.astype(np.float64))
        out[k] = np.count_nonzero(accepted & (magnitude >= f.max_value + half_ulp))
        out[2 + k] = np.count_nonzero(accepted & (magnitude != 0) & (stored == 0))
        out[4 + k] = np.count_nonzero(accepted & (stored != 0) & (stored < f.min_normal))
    return out


@pytest.mark.parametrize("mode", COUNTED_MODES)
@pytest.mark.parametrize("n", [1, 4097, 3 * 65536 + 5])
def test_numpy_and_interpreted_kernel_counts_equal_a_recount_from_the_definitions(mode, n, device):
    fmt = StateFormat(mode)
    rng = np.random.default_rng(n)
    p, g, state = H.random_params(rng, n), H.random_grads(rng, n, fmt), H.random_state(rng, n, fmt)
    H.inject_nonfinite(rng, g)
    count = 3
    counts = np.zeros(6, np.int64)
    p_np, s_np = p.copy(), state.copy()
    apply_step(p_np, g.copy(), s_np, step_scalar_row(count, HP.as_float32_list()), fmt=fmt, format_counts_out=counts)
    k = H.run_kernel(p, g, state, count=count, hp=HP, fmt=fmt, device=device, track_format=True)
    H.assert_same_bits(k.state, s_np, "words with counting on")
    H.assert_same_bits(k.out, p_np, "params with counting on")
    np.testing.assert_array_equal(k.format_counts, counts)
    # The recount needs the unrounded moments and which elements the step accepted.
    from packed_adamw.core.adamw.hyperparams import SCALAR_FIELDS
    from packed_adamw.core.adamw.numpy_step import update_chunk

    scalars = dict(zip(SCALAR_FIELDS, step_scalar_row(count, HP.as_float32_list())))
    m_fmt, r_fmt = fmt.formats
    with np.errstate(all="ignore"):
        _, _, accepted = update_chunk(p, g, state, scalars, fmt)
        g0 = np.where(np.isfinite(g), g, np.float32(0))
        m = m_fmt.decode_table[state >> np.uint32(MOMENT_SHIFT)]
        rms = r_fmt.decode_table[state & np.uint32(0xFFFF)]
        m_next = scalars["b1"] * m + scalars["one_minus_b1"] * g0
        rms_next = np.sqrt(scalars["b2"] * (rms * rms) + scalars["one_minus_b2"] * (g0 * g0))
    np.testing.assert_array_equal(counts, recount(m_next, rms_next, s_np, accepted, fmt))
    if n > 1000:  # random spanning values saturate, flush and land subnormal somewhere
        assert (counts[:2] > 0).all() and (counts[2:4] > 0).all() and (counts[4:] > 0).all(), counts


LAYOUTS = {"consecutive": launch.LAYOUT_CONSECUTIVE, "shifted": launch.LAYOUT_SHIFTED,
           "prefetched": launch.LAYOUT_PREFETCHED}
LAID_OUT_ONCE = pytest.mark.parametrize("layout", [launch.LAYOUT_SHIFTED, launch.LAYOUT_PREFETCHED],
                                        ids=["shifted", "prefetched"])


@pytest.mark.parametrize("mode,layout", [("packed", "consecutive"), ("fp16", "consecutive"), ("packed", "shifted"),
                                         ("packed", "prefetched")])
def test_a_program_of_the_most_blocks_counts_every_element_without_carries(mode, layout, device):
    """A counting launch gives a program several blocks, and each lane adds one element a block
    into a field of kernel.LANE_FIELD bits per count: with a program of the most blocks allowed
    and every element in the same two counts, each field reaches its largest value, and the
    counts still equal the numpy step's (two full programs and a partial one), in either
    layout of a program."""
    from packed_adamw.core import kernel

    fmt = StateFormat(mode)
    block, blocks = 64, kernel.LANE_FIELD_LIMIT.value - 1
    n = 2 * block * blocks + 37
    # (gradient, the pair of FORMAT_COUNTS every element lands in) from zero moments, step 1
    for scale, pair in ((1e8, (0, 1)), (1e-12, (2, 3)), (1e-5, (4, 5))):
        p = np.ones(n, np.float32)
        g = np.full(n, scale, np.float32)
        words = np.zeros(n, np.uint32)
        expected = np.zeros(6, np.int64)
        p_np, s_np = p.copy(), words.copy()
        apply_step(p_np, g.copy(), s_np, step_scalar_row(1, HP.as_float32_list()), fmt=fmt, format_counts_out=expected)
        assert [expected[k] for k in pair] == [n, n], (scale, expected)
        k = H.run_kernel(p, g, words, count=1, hp=HP, fmt=fmt, device=device, block=block, track_format=True,
                         blocks_per_program=blocks, layout=LAYOUTS[layout])
        H.assert_same_bits(k.state, s_np, "words of a program of many blocks")
        np.testing.assert_array_equal(k.format_counts, expected)


@pytest.mark.parametrize("mode", COUNTED_MODES)
@pytest.mark.parametrize("blocks,n", [(4, 4 * 64 * 3), (4, 4 * 64 * 3 + 64 * 2 + 17), (3, 3 * 64 * 2 + 1), (4, 5),
                                      (1, 64 * 7 + 3)],
                         ids=["whole_programs", "whole_blocks_then_a_partial_one", "one_element_past", "under_a_block",
                              "one_block_a_program"])
@pytest.mark.parametrize("write_update", [False, True], ids=["in_place", "update"])
@pytest.mark.parametrize("layout,track_format", [(launch.LAYOUT_SHIFTED, True), (launch.LAYOUT_PREFETCHED, True),
                                                 (launch.LAYOUT_PREFETCHED, False)],
                         ids=["shifted", "prefetched", "prefetched_nonfinite_only"])
def test_laid_out_programs_give_the_numpy_bits_and_counts(mode, blocks, n, write_update, layout, track_format,
                                                          device):
    """The layouts of a counting launch (launch.LAYOUT_SHIFTED: pointers moved to the program's
    first element, whole blocks in a loop, then the partial one; LAYOUT_PREFETCHED: each whole
    block's loads issued a block early): the same bits and counts as the numpy step, with
    non-finite counts, with or without format counts (the check_nonfinite launch is prefetched),
    whatever the program's last block."""
    fmt = StateFormat(mode)
    rng = np.random.default_rng(n + blocks)
    p, g, state = H.random_params(rng, n), H.random_grads(rng, n, fmt), H.random_state(rng, n, fmt)
    H.inject_nonfinite(rng, g)
    counts, update = np.zeros(6, np.int64), np.empty_like(p)
    p_np, s_np = p.copy(), state.copy()
    rejected = apply_step(p_np, g.copy(), s_np, step_scalar_row(3, HP.as_float32_list()), fmt=fmt,
                          update_out=update if write_update else None, format_counts_out=counts)
    k = H.run_kernel(p, g, state, count=3, hp=HP, fmt=fmt, device=device, block=64, track_format=track_format,
                     blocks_per_program=blocks, layout=layout, write_update=write_update)
    H.assert_same_bits(k.state, s_np, "words of programs laid out once")
    H.assert_same_bits(k.out, update if write_update else p_np, "the update or params of programs laid out once")
    np.testing.assert_array_equal(k.format_counts, counts if track_format else np.zeros(6, np.int64))
    assert k.nonfinite == rejected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages through mmap and mprotect")
def test_programs_of_several_blocks_read_nothing_past_a_tensor():
    """Each layout of several blocks a program, interpreted, on tensors that end right before an
    inaccessible page (tests/guarded_reads.py): a load past the end, such as a prefetch of a
    block the program does not own, faults. The control shows that such a read does fault."""
    script = str(TESTS / "guarded_reads.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, script, "launch"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no read past a tensor" in done.stdout, (done.returncode, done.stderr[-2000:])
    control = subprocess.run([sys.executable, script, "control"], env=env, capture_output=True, text=True, timeout=60)
    assert control.returncode == -signal.SIGSEGV, (control.returncode, control.stdout, control.stderr[-2000:])


@pytest.mark.parametrize("mode", COUNTED_MODES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grad", "fp32_grad"])
@LAID_OUT_ONCE
def test_laid_out_split_programs_equal_consecutive_ones_and_write_nothing_past_the_tensor(mode, grad_dtype, layout,
                                                                                            device):
    """bf16 weights with split masters (adamw_split_kernel): a layout laid out once moves 2-byte
    pointers too. Its launch gives the consecutive layout's bits and counts (that layout is
    checked against the numpy split step in test_split_master.py), and the sentinels just past
    each tensor, in the same buffers, stay as they were."""
    from packed_adamw.core.adamw import kernel as K

    fmt, block, blocks, n, pad = StateFormat(mode), 64, 4, 3 * 4 * 64 + 2 * 64 + 9, 300
    rng = np.random.default_rng(5)
    master = (rng.standard_normal(n) * 0.1).astype(np.float32)
    weight_bits = (master.view(np.uint32) >> 16).astype(np.uint16)  # a bf16 weight, low half 0
    grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)).to(device)
    grad[::97] = float("inf")  # rejected elements, counted
    state = torch.from_numpy(H.random_state(rng, n, fmt).view(np.int32)).to(device)
    runs = []
    for laid_out in (launch.LAYOUT_CONSECUTIVE, layout):
        def padded(values, sentinel):
            buffer = torch.full((n + pad,), sentinel, dtype=values.dtype, device=device)
            buffer[:n] = values
            return buffer
        w = padded(torch.from_numpy(weight_bits.view(np.int16)).to(device), -7)
        lo, words = padded(torch.zeros(n, dtype=torch.int16, device=device), -7), padded(state, -7)
        counters = H.new_counters(1, device)
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=True, block=block,
                                                   track_format=True, split=True)
        constants["BLOCKS_PER_PROGRAM"], constants["LAYOUT"] = blocks, laid_out
        weight = w[:n].view(torch.bfloat16)
        K.adamw_split_kernel[launch.single_tensor_grid(n, constants)](
            weight, lo[:n], grad.to(grad_dtype), words[:n], H.kernel_step_scalars(HP, 2, device), counters, n,
            weight, lo[:n], words[:n], **constants, **H._compile_options())
        for buffer in (w, lo, words):
            assert (buffer[n:] == -7).all(), "a write past the tensor"
        runs.append((w[:n].cpu().numpy(), lo[:n].cpu().numpy(), words[:n].cpu().numpy(),
                     int(counters[0, 0]), launch.sum_counter_slots(counters.cpu().numpy())[0]))
    (w0, lo0, s0, rejected0, counts0), (w1, lo1, s1, rejected1, counts1) = runs
    assert np.array_equal(w0, w1) and np.array_equal(lo0, lo1) and np.array_equal(s0, s1)
    assert rejected0 == rejected1 == len(range(0, n, 97)) and np.array_equal(counts0, counts1)
    assert not np.array_equal(w0, weight_bits.view(np.int16))  # the step moved the weights


def test_counting_launches_take_their_timed_layouts(monkeypatch):
    """Compiled launches' layouts (launch.single_tensor_constants): format counts take the
    timed layouts, FP32 weights prefetched and bf16 split weights shifted; non-finite counts
    alone are prefetched with FP32 weights outside fp32 mode, and consecutive (16 blocks) in
    fp32 mode and on split weights; uncounted launches take one block, consecutive; the
    interpreter launches one block a program, consecutive."""
    def layout(split=False, mode="packed", **kinds):
        constants = launch.single_tensor_constants(StateFormat(mode), write_update=False, block=512, split=split,
                                                   **kinds)
        return constants["LAYOUT"], constants["BLOCKS_PER_PROGRAM"]

    monkeypatch.setattr(launch, "interpreting", lambda: True)
    interpreted = layout(count_nonfinite=True, track_format=True)
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # the compiled launches' constants
    for nonfinite in (False, True):
        assert layout(count_nonfinite=nonfinite, track_format=True) == (launch.LAYOUT_PREFETCHED,
                                                                         launch.LAID_OUT_BLOCKS_PER_PROGRAM)
        assert layout(split=True, count_nonfinite=nonfinite, track_format=True) == (launch.LAYOUT_SHIFTED,
                                                                                     launch.LAID_OUT_BLOCKS_PER_PROGRAM)
    laid_out, consecutive = ((launch.LAYOUT_PREFETCHED, launch.LAID_OUT_BLOCKS_PER_PROGRAM),
                             (launch.LAYOUT_CONSECUTIVE, launch.COUNTING_BLOCKS_PER_PROGRAM))
    for mode in ("packed", "fp16"):
        assert layout(mode=mode, count_nonfinite=True, track_format=False) == laid_out
        assert layout(mode=mode, split=True, count_nonfinite=True, track_format=False) == consecutive
    assert layout(mode="fp32", count_nonfinite=True, track_format=False) == consecutive
    assert layout(mode="fp32", split=True, count_nonfinite=True, track_format=False) == consecutive
    for mode in ("packed", "fp16", "fp32"):
        assert layout(mode=mode, count_nonfinite=False, track_format=False) == (launch.LAYOUT_CONSECUTIVE, 1)
    assert interpreted == (launch.LAYOUT_CONSECUTIVE, 1)


@LAID_OUT_ONCE
def test_laid_out_programs_refuse_fp32_mode(layout, device):
    # Those layouts serve packed and fp16 modes only (adamw/kernel.py, adamw_programs).
    n = 200
    with pytest.raises(Exception) as raised:
        H.run_kernel(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros((2, n), np.float32), count=1, hp=HP,
                     fmt=StateFormat("fp32"), device=device, block=64, blocks_per_program=4, layout=layout)
    messages, error = [], raised.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("serve packed and fp16 modes only" in m for m in messages), messages


def test_a_program_takes_fewer_blocks_than_its_lane_fields_can_count(device):
    from packed_adamw.core import kernel

    n = 64 * kernel.LANE_FIELD_LIMIT.value
    with pytest.raises(Exception) as raised:
        H.run_kernel(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.uint32), count=1, hp=HP,
                     fmt=StateFormat("packed"), device=device, block=64, track_format=True,
                     blocks_per_program=kernel.LANE_FIELD_LIMIT.value)
    # The interpreter raises the assertion itself; the compiler wraps it in its CompilationError.
    messages, error = [], raised.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("fewer blocks than its lane fields can count" in m for m in messages), messages


@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_huge_gradients_saturate_and_tiny_ones_flush(mode):
    fmt = StateFormat(mode)
    n = 1000
    words = np.zeros(n, np.uint32)
    for scale, saturated, flushed in ((1e8, True, False), (1e-12, False, True)):
        counts = np.zeros(6, np.int64)
        apply_step(np.ones(n, np.float32), np.full(n, scale, np.float32), words.copy(),
                   step_scalar_row(1, HP.as_float32_list()), fmt=fmt, format_counts_out=counts)
        sat_m, sat_rms, flush_m, flush_rms = counts[:4]
        assert (sat_m == n and sat_rms == n) == saturated, counts
        assert (flush_m == n and flush_rms == n) == flushed, counts


def _trained(track=True, steps=3, mode="packed", scale=1.0, **kwargs):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((300,), (13, 17), ())]
    opt = PackedAdamW([("a", params[0]), ("b", params[1]), ("c", params[2])], lr=1e-2, mode=mode,
                      track_format=track, **kwargs)
    grads = []
    for step in range(steps):
        step_grads = [torch.randn(p.shape, generator=gen) * scale for p in params]
        grads.append(step_grads)
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, opt, grads


def _numpy_counts(grads, mode: str, counted_steps) -> dict[str, np.ndarray]:
    """`_trained`'s steps through the numpy step; the counts of the steps in `counted_steps`."""
    fmt = StateFormat(mode)
    expected = {name: np.zeros(6, np.int64) for name in "abc"}
    ref = [p0.detach().clone() for p0 in _trained(track=False, steps=0, mode=mode)[0]]
    states = [np.zeros(max(p.numel(), 1) if p.dim() else 1, np.uint32) for p in ref]
    for step, step_grads in enumerate(grads, start=1):
        for name, p, g, s in zip("abc", ref, step_grads, states):
            counts = np.zeros(6, np.int64)
            apply_step(p.view(-1).numpy(), g.reshape(-1).numpy().copy(), s, step_scalar_row(step, [1e-2, 0.9, 0.999, 1e-8, 1e-2]),
                       fmt=fmt, format_counts_out=counts)
            if step in counted_steps:
                expected[name] += counts
    return expected


@pytest.mark.parametrize("mode", COUNTED_MODES)
def test_format_stats_are_the_numpy_counts_of_every_step_since_the_last_read(mode):
    params, opt, grads = _trained(mode=mode, steps=3)
    expected = _numpy_counts(grads, mode, counted_steps={1, 2, 3})
    stats = opt.format_stats()
    assert set(stats) == {"a", "b", "c"}
    for name, p in zip("abc", params):
        assert stats[name]["elements"] == 3 * p.numel()
        np.testing.assert_array_equal([stats[name][k] for k in FORMAT_COUNTS], expected[name])
    assert all(v == 0 for entry in opt.format_stats().values() for v in entry.values())  # reset on read


def test_a_state_of_other_groups_is_refused_before_pending_counts_are_dropped():
    params = [torch.nn.Parameter(torch.full((3,), float(i + 1))) for i in range(3)]
    saved = PackedAdamW([{"params": params[:1]}, {"params": params[1:]}], track_format=True).state_dict()
    opt = PackedAdamW([{"params": params[:2]}, {"params": params[2:]}], track_format=True)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    with pytest.raises(ValueError, match="parameter groups hold"):
        opt.load_state_dict(saved)
    assert all(entry["elements"] == 3 for entry in opt.format_stats().values())  # the step's counts are still there


def test_counts_survive_a_rebuilt_plan_and_a_loaded_state_starts_them_afresh():
    params, opt, _ = _trained(steps=2)
    before_rebuild = opt.format_stats()
    _, opt2, _ = _trained(steps=2)  # the same two steps, then a rebuild and a third step
    extra = torch.nn.Parameter(torch.ones(5))
    opt2.add_param_group({"params": [extra], "param_names": ["d"]})  # the next step makes a new plan
    gen = torch.Generator().manual_seed(77)
    grads = [torch.randn(p.shape, generator=gen) for p in opt2.param_groups[0]["params"]]
    twin_params, twin, _ = _trained(steps=2)  # a twin that takes the third step without a rebuild
    for p, q, g in zip(opt2.param_groups[0]["params"], twin_params, grads):
        p.grad, q.grad = g.clone(), g.clone()
    extra.grad = torch.ones(5)
    opt2.step()
    twin.step()
    rebuilt, straight = opt2.format_stats(), twin.format_stats()
    for name in "abc":
        assert rebuilt[name] == straight[name], name  # counts from before the rebuild were kept
        assert rebuilt[name]["elements"] == 3 * before_rebuild[name]["elements"] // 2
    assert rebuilt["d"]["elements"] == 5
    # Loading a state starts a new record: the counts of the steps before it are dropped.
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.format_stats() == {}


@pytest.mark.parametrize("first", [False, True], ids=["built_off", "built_on"])
def test_track_format_switched_between_steps_counts_only_the_steps_made_with_it_on(first):
    """Counting on sampled steps only (a training loop's logged ones): the counts are those of
    the steps made with the switch on, and the bits are those of an optimizer never counting."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((300,), (13, 17), ())]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = PackedAdamW([("a", params[0]), ("b", params[1]), ("c", params[2])], lr=1e-2, track_format=first)
    plain = PackedAdamW(twins, lr=1e-2)
    switch = [first, True, False, False, True, False]
    grads = []
    for step, on in enumerate(switch, start=1):
        opt.track_format = on
        step_grads = [torch.randn(p.shape, generator=gen) * 10.0 ** (step - 3) for p in params]
        grads.append(step_grads)
        for p, q, g in zip(params, twins, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
        if step == 3:
            assert not opt.track_format  # off, the counts of step 2 still wait to be read
    counted = {step for step, on in enumerate(switch, start=1) if on}
    expected = _numpy_counts(grads, "packed", counted)
    stats = opt.format_stats()
    for name, p in zip("abc", params):
        assert stats[name]["elements"] == len(counted) * p.numel()
        np.testing.assert_array_equal([stats[name][k] for k in FORMAT_COUNTS], expected[name])
    for p, q in zip(params, twins):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
        assert torch.equal(opt.state[p]["words"].view(torch.int32), plain.state[q]["words"].view(torch.int32))
    with pytest.raises(ValueError, match="none was made since the last read"):
        opt.format_stats()  # off, and nothing left to read


def test_the_track_format_switch_is_checked_and_travels_with_the_optimizer():
    opt = PackedAdamW([torch.nn.Parameter(torch.ones(3))])
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match="track_format="):
            opt.track_format = value
    fp32 = PackedAdamW([torch.nn.Parameter(torch.ones(3))], mode="fp32")
    with pytest.raises(ValueError, match="fp32 mode stores float32 moments"):
        fp32.track_format = True
    assert not fp32.track_format
    captured = PackedAdamW([torch.nn.Parameter(torch.ones(3))], lr=torch.tensor(1e-3), capturable=True)
    with pytest.raises(ValueError, match="capturable=True"):
        captured.track_format = True
    with pytest.raises(ValueError, match="capturable=True"):
        PackedAdamW([torch.nn.Parameter(torch.ones(3))], lr=torch.tensor(1e-3), capturable=True, track_format=True)
    opt.track_format = True
    assert copy.deepcopy(opt).track_format and pickle.loads(pickle.dumps(opt)).track_format
    opt.load_state_dict(PackedAdamW([torch.nn.Parameter(torch.ones(3))]).state_dict())
    assert opt.track_format  # an option of the optimizer, not of its state


def test_saturation_warns_once_per_parameter_naming_the_bias_to_move():
    _, opt, _ = _trained(scale=1e6, steps=2)
    with pytest.warns(RuntimeWarning) as record:
        opt.format_stats()
    messages = [str(w.message) for w in record]
    assert len(messages) == 3 and all("first moments saturated" in m and "lower m_bias (now 15" in m
                                      and "lower rms_bias" in m for m in messages), messages
    assert [m.split(":")[1].strip() for m in messages] == ["'a'", "'b'", "'c'"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.param_groups[0]["params"][0].grad = torch.full((300,), 1e6)
        opt.step()
        opt.format_stats()  # already warned for these parameters


def test_track_format_is_refused_in_fp32_and_format_stats_needs_it():
    with pytest.raises(ValueError, match="fp32 mode stores float32 moments"):
        PackedAdamW([torch.nn.Parameter(torch.ones(3))], mode="fp32", track_format=True)
    with pytest.raises(ValueError, match="track_format=True"):
        PackedAdamW([torch.nn.Parameter(torch.ones(3))]).format_stats()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["multi_tensor", "per_tensor"])
def test_cuda_format_stats_equal_cpu(multi_tensor):
    """Compiled counts (shared launch, a solo launch, per-tensor launches) equal the CPU ones."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(300,), (13, 17), (), (launch.SOLO_ELEMENTS + 3,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().clone().cuda()) for p in cpu]
    opt_cpu = PackedAdamW(cpu, lr=1e-2, track_format=True)
    opt_gpu = PackedAdamW(gpu, lr=1e-2, track_format=True, multi_tensor=multi_tensor, check_nonfinite=False)
    for step in range(3):
        for p, q in zip(cpu, gpu):
            g = torch.randn(p.shape, generator=gen) * 10.0 ** (step - 2)
            p.grad, q.grad = g, g.cuda()
        opt_cpu.step()
        opt_gpu.step()
    assert opt_gpu.format_stats() == opt_cpu.format_stats()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:PackedAdamW.*saturated:RuntimeWarning")  # gradients up to 100 saturate
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_weights", "bf16_weights"])
@pytest.mark.parametrize("multi_tensor", [True, False], ids=["multi_tensor", "per_tensor"])
def test_cuda_track_format_switched_between_steps_equals_cpu(multi_tensor, dtype, monkeypatch):
    """Sampled counting compiled: steps made with the switch off run the uncounted launches
    (shared, solo and per-tensor; split masters for bf16 weights), the counts are the CPU
    optimizer's over the counted steps, and every bit is a never-counting GPU optimizer's."""
    from packed_adamw.torch import _launch

    launched = []  # the track_format of every launch of the switched optimizer's current step
    for name in ("_launch_segment", "_launch_one"):  # both take track_format last
        def spy(*args, launcher=getattr(_launch, name)):
            launched.append(args[-1])
            return launcher(*args)
        monkeypatch.setattr(_launch, name, spy)
    gen = torch.Generator().manual_seed(8)
    shapes = [(300,), (13, 17), (), (launch.SOLO_ELEMENTS + 3,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    gpu, plain_gpu, every_gpu = ([torch.nn.Parameter(p.detach().clone().cuda()) for p in cpu] for _ in range(3))
    opt_cpu = PackedAdamW(cpu, lr=1e-2, track_format=True)
    opt_gpu = PackedAdamW(gpu, lr=1e-2, track_format=False, multi_tensor=multi_tensor)
    plain = PackedAdamW(plain_gpu, lr=1e-2, multi_tensor=multi_tensor)
    every_step = PackedAdamW(every_gpu, lr=1e-2, multi_tensor=multi_tensor, track_format=True)
    switch = [False, True, True, False, True]
    for step, on in enumerate(switch, start=1):
        opt_gpu.track_format = opt_cpu.track_format = on
        for p, q, r, e in zip(cpu, gpu, plain_gpu, every_gpu):
            g = (torch.randn(p.shape, generator=gen) * 10.0 ** (step - 3)).to(dtype)
            p.grad, q.grad, r.grad, e.grad = g, g.cuda(), g.cuda(), g.cuda()
        opt_cpu.step()
        plain.step()
        every_step.step()
        launched.clear()
        opt_gpu.step()
        assert launched and set(launched) == {on}, (step, launched)
    stats = opt_gpu.format_stats()
    assert stats == opt_cpu.format_stats()
    assert stats[(0, 3)]["elements"] == sum(switch) * cpu[3].numel()
    every = every_step.format_stats()
    for key in stats:  # the uncounted steps had something to count
        assert [stats[key][k] for k in FORMAT_COUNTS] != [every[key][k] for k in FORMAT_COUNTS], key
    as_bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int16: torch.int16,
               torch.uint32: torch.int32}
    for p, q, r in zip(cpu, gpu, plain_gpu):
        tensors = [(q, r, p)] + [(opt_gpu.state[q][key], plain.state[r][key], opt_cpu.state[p][key])
                                 for key in ("words", "lo") if key in opt_cpu.state[p]]
        assert len(tensors) == (3 if dtype == torch.bfloat16 else 2)
        for counted, uncounted, on_cpu in tensors:
            bits = counted.detach().cpu().view(as_bits[counted.dtype])
            assert torch.equal(bits, uncounted.detach().cpu().view(as_bits[counted.dtype]))
            assert torch.equal(bits, on_cpu.detach().view(as_bits[counted.dtype]))
