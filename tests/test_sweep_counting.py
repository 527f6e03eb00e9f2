"""benchmarks/sweep_counting.py --chosen: each data profile's launches compute the step its name
says (bits against core.numpy_step), and the table's ratios are each timing over the mean of the
uncounted timings around it (interpreted on CPU; the timer is replaced, the launches run)."""
import itertools

import numpy as np
import pytest
import torch

from kernel_harness import assert_same_bits, numpy_reference
from packed_adamw.core import Hyperparams, StateFormat, formats, launch
from script_helpers import BENCHMARKS, import_script

N = 1024  # two programs of launch.GPU_BLOCK, interpreted
HP = Hyperparams(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)  # sweep_counting.scalars_row's, step 3
FMT = StateFormat("packed")


@pytest.fixture(scope="module")
def sweep():
    pytest.importorskip("triton")
    paths = pytest.MonkeyPatch()
    paths.syspath_prepend(str(BENCHMARKS))  # its `from bench_step import ...`
    yield import_script(BENCHMARKS / "sweep_counting.py", "sweep_counting_under_test")
    paths.undo()


@pytest.fixture
def profiles(sweep, device):
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(N, device=device, generator=gen) * 0.02
    g = torch.randn(N, device=device, generator=gen) * 1e-3
    words = torch.randint(0, 2**31 - 1, (N,), dtype=torch.int32, device=device, generator=gen) & 0x3C003C00
    scalars = sweep.scalars_row(torch.device(device))
    counters = torch.zeros(launch.COUNTER_ROW, dtype=torch.int64, device=device)
    return sweep.data_profiles(p, words, g, scalars, counters), scalars, counters


def counting(split=False):
    return launch.single_tensor_constants(FMT, write_update=False, count_nonfinite=False, block=launch.GPU_BLOCK,
                                          track_format=True, split=split)


def host(t):
    return t.cpu().numpy()


def reference(p, g, words):
    """One packed step of FP32 weights by core.numpy_step: (new weights, new words)."""
    new_p, new_state, _ = numpy_reference(host(p), host(g), host(words).view(np.uint32), count=3, hp=HP, fmt=FMT)
    return new_p, new_state


def split_reference(w, lo, g16, words):
    """The same step of bf16 weights with split masters: (weight bits, low halves, new words)."""
    master = formats.read_master(host(w.view(torch.int16)), host(lo))
    new_master, new_state, _ = numpy_reference(master, host(g16.float()), host(words).view(np.uint32), count=3,
                                               hp=HP, fmt=FMT)
    return (*formats.split_master(new_master), new_state)


def check_fp32(profile, expected, what):
    assert_same_bits(host(profile.p_out), expected[0], f"{what}: weights")
    assert_same_bits(host(profile.words_out).view(np.uint32), expected[1], f"{what}: words")


def check_split(profile, expected, what):
    assert_same_bits(host(profile.w_out.view(torch.int16)).view(np.uint16), expected[0], f"{what}: bf16 weights")
    assert_same_bits(host(profile.lo_out), expected[1], f"{what}: low halves")
    assert_same_bits(host(profile.split_words_out).view(np.uint32), expected[2], f"{what}: words")


def test_the_same_inputs_every_launch_give_the_step_and_are_left_alone(sweep, profiles):
    profiles, scalars, counters = profiles
    for name, fixed in profiles.items():
        if "same inputs" not in name:
            continue
        inputs = [t.clone() for t in (fixed.p, fixed.words, fixed.w, fixed.lo)]
        expected = reference(fixed.p, fixed.grads[0], fixed.words)
        expected_split = split_reference(fixed.w, fixed.lo, fixed.grads16[0], fixed.words)
        for _ in range(2):  # again: the same step from the same inputs
            for out in (fixed.p_out, fixed.w_out):
                out.fill_(float("nan"))
            fixed.words_out.fill_(-1)
            fixed.lo_out.fill_(-1)
            fixed.launcher(counting(), 4, scalars, counters)()
            check_fp32(fixed, expected, name)
            fixed.launcher(counting(split=True), 4, scalars, counters, split=True)()
            check_split(fixed, expected_split, name)
        for before, now in zip(inputs, (fixed.p, fixed.words, fixed.w, fixed.lo)):
            assert torch.equal(before.view(torch.uint8), now.view(torch.uint8)), f"{name}: an input was written"


def test_in_place_each_launch_steps_the_last_state_with_the_next_gradient(sweep, profiles):
    profiles, scalars, counters = profiles
    stepped = profiles[f"after {sweep.TRAINED_STEPS} synthetic steps, stepped in place, four gradients in turn"]
    assert len(stepped.grads) == 4
    # the synthetic steps left first moments partly subnormal
    counters.zero_()
    probe = sweep.Profile(stepped.p, stepped.words, stepped.grads[:1], in_place=False)
    probe.launcher(counting(), 4, scalars, counters)()
    counts = dict(zip(launch.FORMAT_COUNTS, launch.sum_counter_slots(host(counters)[None])[0]))
    assert 0.02 * N < counts["subnormal_m"] < 0.3 * N
    split_words_before = stepped.split_words.clone()
    for k in range(5):  # the fifth launch takes the first gradient again
        expected = reference(stepped.p, stepped.grads[k % 4], stepped.words)
        stepped.launcher(counting(), 4, scalars, counters)()
        check_fp32(stepped, expected, f"launch {k}")
    # the split launches step a state of their own
    assert torch.equal(stepped.split_words, split_words_before)
    expected_split = split_reference(stepped.w, stepped.lo, stepped.grads16[5 % 4], stepped.split_words)
    stepped.launcher(counting(split=True), 4, scalars, counters, split=True)()
    check_split(stepped, expected_split, "split launch")


def timer_of(triples, rows_per_pass):
    """A stand-in for cuda_time_ms: runs the launch, then gives pass q's timings `triples[q]`
    (uncounted before, the row, uncounted after) for every row of that pass."""
    calls = itertools.count()

    def timed(fn):
        fn()
        k = next(calls)
        return triples[k // (3 * rows_per_pass) % len(triples)][k % 3]
    return timed


def test_each_ratio_is_a_timing_over_the_uncounted_timings_around_it(sweep, profiles, monkeypatch):
    profiles, scalars, counters = profiles
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "CPU (interpreted)")
    rows = ["format counts", "format and non-finite counts", "non-finite counts", "bf16 split, format counts",
            "bf16 split, non-finite counts"]
    # uncounted before, the row, uncounted after: 2 * 3 / (1 + 2) = 2
    monkeypatch.setattr(sweep, "timed", timer_of([(1.0, 3.0, 2.0)], len(rows)))
    text = sweep.chosen_launches(profiles, scalars, counters, passes=1)
    for name in profiles:
        assert f"## {name}" in text
    for row in rows:
        assert text.count(f"| {row} | 2.0000 | 2.0000 | 2.0000 |") == len(profiles), row
    assert "candidate" not in text
    # candidates join the same passes; the median and the range are over the passes (2, 1, 0.5)
    candidates = ["the uncounted launch itself (the noise)"] + [row for row, *_ in sweep.CANDIDATES]
    triples = [(1.0, 3.0, 2.0), (1.0, 1.0, 1.0), (2.0, 1.0, 2.0)]
    monkeypatch.setattr(sweep, "timed", timer_of(triples, len(rows) + len(candidates)))
    name = next(iter(profiles))
    text = sweep.chosen_launches({name: profiles[name]}, scalars, counters, passes=3, candidates=True)
    for row in rows + [f"candidate: {c}" for c in candidates]:
        line = next(line for line in text.splitlines() if line.startswith(f"| {row} |"))
        assert line == f"| {row} | 1.0000 | 0.5000 | 2.0000 |"


def test_profile_launches_each_row_once_inside_the_profiler_range(sweep, profiles, monkeypatch):
    """`--chosen --profile`: the uncounted launches and every row of `--chosen`, each compiled
    (launched once) before the profiler range and launched once inside it, in the listed order."""
    profiles, scalars, counters = profiles
    events = []

    class Cudart:
        def cudaProfilerStart(self):
            events.append("start")

        def cudaProfilerStop(self):
            events.append("stop")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    profile = list(profiles.values())[-1]
    launcher = profile.launcher

    def recording(constants, warps, scalars, counters, split=False):
        run = launcher(constants, warps, scalars, counters, split)

        def launched():
            events.append((tuple(sorted(constants.items())), warps, split))
            run()
        return launched

    monkeypatch.setattr(profile, "launcher", recording)
    words = profile.words.clone()
    names = sweep.profiled_launches(profile, scalars, counters, candidates=True)
    rows = sweep.launch_rows(candidates=True)
    assert names == ["the uncounted launch", "the uncounted split launch"] + [row for row, _ in rows]
    expected = [(tuple(sorted(c.items())), w, s) for _, (c, w, s) in
                [(None, sweep._library(False, False, False)), (None, sweep._library(True, False, False))] + rows]
    assert events == expected + ["start"] + expected + ["stop"]
    assert not torch.equal(profile.words, words)  # the launches ran: the in-place state moved on


def test_the_ncu_table_reads_each_launch_of_the_log_in_order(sweep):
    """`--ncu-table`: Nsight Compute's CSV log (base units) as a row per launch, named from the
    launch list in ID order; a log and a list of different lengths are refused."""
    units = {"gpu__time_duration.sum": "ns", "sm__cycles_elapsed.avg.per_second": "hz",
             "dram__throughput.avg.pct_of_peak_sustained_elapsed": "%", "sm__inst_executed.sum": "inst",
             "smsp__issue_active.avg.pct_of_peak_sustained_active": "%",
             "launch__registers_per_thread": "register/thread"}  # as ncu 2025.3 wrote them on the H200
    metrics = {"gpu__time_duration.sum": "1250000", "sm__cycles_elapsed.avg.per_second": "1950000000",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed": "89.15",
               "sm__inst_executed.sum": "2,560", "smsp__issue_active.avg.pct_of_peak_sustained_active": "52.44",
               "launch__registers_per_thread": "72"}
    assert set(metrics) == set(sweep.NCU_METRICS)
    head = '"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    log = ["==PROF== Connected to process 1", head]
    for launch_id in (1, 0):  # out of order in the log: rows follow the IDs
        for name, value in metrics.items():
            value = value if launch_id == 0 else str(2 * float(value.replace(",", "")))
            log.append(f'"{launch_id}","1","adamw_kernel","{name}","{units[name]}","{value}"')
    table = sweep.ncu_table("\n".join(log), ["uncounted", "format counts"], n_elements=1024)
    lines = table.splitlines()
    assert lines[0] == ("| launch | ms | SM clock, MHz | DRAM, % of peak | instructions an element | "
                        "issue slots busy, % | registers a thread |")
    assert lines[2] == "| uncounted | 1.250 | 1950 | 89.2 | 80.0 | 52.4 | 72 |"
    assert lines[3] == "| format counts | 2.500 | 3900 | 178.3 | 160.0 | 104.9 | 144 |"
    with pytest.raises(ValueError, match="2 profiled launches, the launch list 3"):
        sweep.ncu_table("\n".join(log), ["a", "b", "c"], n_elements=1024)
    with pytest.raises(ValueError, match="--csv"):
        sweep.ncu_table("==PROF== no CSV here", ["a"], n_elements=1024)
    scaled = [line.replace('"ns"', '"ms"') for line in log]  # not base units: the factors would be wrong
    with pytest.raises(ValueError, match="--print-units base"):
        sweep.ncu_table("\n".join(scaled), ["uncounted", "format counts"], n_elements=1024)
    partial = [line for line in log if "launch__registers_per_thread" not in line or line.startswith('"1"')]
    with pytest.raises(ValueError, match=r"launch 0 of the log lacks \['launch__registers_per_thread'\]"):
        sweep.ncu_table("\n".join(partial), ["uncounted", "format counts"], n_elements=1024)


def test_the_clock_table_reads_each_ratio_against_the_clock_while_it_was_timed(sweep):
    """`--clock-table`: a ratio takes the mean clock of the busy samples inside its printed span
    (samples at idle power and outside the span do not count); rows gather their passes over the
    profiles; a ratio with no busy sample is counted apart."""
    smi = ["timestamp, clocks.sm [MHz], power.draw [W], clocks_event_reasons.active",
           "2026/12/02 15:00:00.050, 1980 MHz, 650.00 W, 0x4",
           "2026/12/02 15:00:00.150, 1900 MHz, 640.00 W, 0x4",
           "2026/12/02 15:00:00.250, 1200 MHz, 90.00 W, 0x0",  # idle: left out
           "2026/12/02 15:00:01.050, 1500 MHz, 700.00 W, 0x4",
           "2026/12/02 15:00:02.050, 1600 MHz, 700.00 W, 0x4",
           "2026/12/02 15:00:03.050, 1800 MHz, 700.00 W, 0x4"]
    day = "2026/12/02 15:00:0"
    progress = ["some other line"] + [  # the lines --chosen prints
        sweep.progress_line(profile, row, ratio, day + start, day + end) for profile, row, ratio, start, end in
        [("random codes", "format counts", 1.02, "0.000", "0.300"),
         ("after 30 steps", "format counts", 1.1, "1.000", "1.100"),
         ("after 30 steps", "format counts", 1.08, "2.000", "2.100"),
         ("after 30 steps", "non-finite counts", 1.01, "4.000", "4.100")]]
    table = sweep.clock_table("\n".join(progress), "\n".join(smi)).splitlines()
    assert table[2] == "| format counts | 3 (0) | 1,500 to 1,940 | 1.0200 to 1.1000 | -1.00 |"  # statistics.correlation: -0.9997
    assert table[3] == "| non-finite counts | 0 (1) | - | - | - |"
    assert len(table) == 4
    with pytest.raises(ValueError, match="no clock samples"):
        sweep.clock_table("\n".join(progress), "timestamp, clocks.sm [MHz]\n")
