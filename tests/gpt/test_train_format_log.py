"""The trainer's --track-format: per kind of tensor, the shares of saturated, flushed and
subnormal moments in log.jsonl ("format" records), their plot, and that counting changes no
bit of training, alone, across a resume and under DDP / FSDP2."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt_helpers import MICRO, assert_bitwise_equal, build_data, run_train
from packed_adamw.core import StateFormat, launch
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT
from packed_adamw.torch import PackedAdamW
from packed_adamw.torch.gpt import checkpoint
from packed_adamw.torch.gpt.families import gpt_parameter_kind as parameter_kind
from packed_adamw.torch.gpt.model import GPT, GPTConfig
from packed_adamw.torch.gpt.train import ConfigError, TrainConfig, main, train
from packed_adamw.core.adamw.rule import FORMAT_COUNTS
from layout import TESTS

KINDS = {"embedding", "attention_qkv", "attention_proj", "mlp", "layernorm", "bias"}
STEPS, STOP_AT, LOG_EVERY = 6, 5, 2  # format records at steps 1, 2, 4 and (the session's end) 5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("data"))


def common(data_dir, *extra) -> list[str]:
    return [*MICRO, "--data", str(data_dir), "--max-steps", str(STEPS), "--stop-at-step", str(STOP_AT),
            "--log-every", str(LOG_EVERY), *map(str, extra)]


def format_records(out: Path) -> list[dict]:
    lines = (out / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("record") == "format"]


def micro_numels() -> dict[str, int]:
    numels = collections.Counter()
    for name, p in GPT(GPTConfig.preset("micro")).named_parameters():
        numels[parameter_kind(name)] += p.numel()
    return numels


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> tuple[Path, dict]:
    """(root, captured): packed and fp16 runs with and without --track-format, in this
    process; `captured[mode]` is every format_stats() result the tracked run read."""
    root = tmp_path_factory.mktemp("runs")
    captured = {}
    real = PackedAdamW.format_stats
    for mode in ("packed", "fp16"):
        reads = captured[mode] = []

        def recording(self):
            stats = real(self)
            reads.append(stats)
            return stats

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PackedAdamW, "format_stats", recording)
            assert main(common(data_dir, "--mode", mode, "--out", root / f"{mode}-tracked", "--track-format")) == 0
        assert main(common(data_dir, "--mode", mode, "--out", root / f"{mode}-plain")) == 0
    return root, captured


@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_format_records_are_the_optimizers_counts_per_kind_over_each_interval(runs, mode):
    root, captured = runs
    records = format_records(root / f"{mode}-tracked")
    assert [(r["first_step"], r["step"]) for r in records] == [(1, 1), (2, 2), (3, 4), (5, 5)]
    assert len(captured[mode]) == len(records)  # one read per record
    numels = micro_numels()
    seen = collections.Counter()
    for record, stats in zip(records, captured[mode]):
        assert set(record["kinds"]) == KINDS
        steps = record["step"] - record["first_step"] + 1
        # The recount: the read's per-parameter counts, summed by kind.
        expected = {kind: collections.Counter() for kind in KINDS}
        for name, entry in stats.items():
            expected[parameter_kind(name)].update(entry)
        for kind, entry in record["kinds"].items():
            assert entry["element_steps"] == expected[kind]["elements"] == numels[kind] * steps, kind
            for count in FORMAT_COUNTS:
                n = expected[kind][count]
                assert entry["counts"][count] == n
                assert entry[count] == n / entry["element_steps"] and 0 <= entry[count] <= 1, (kind, count)
                seen[count] += n
    # The micro model's moments do go subnormal and flush (the shares are not all 0).
    assert seen["subnormal_m"] > 0 and seen["subnormal_rms"] > 0 and seen["flushed_m"] > 0, seen


@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_the_last_steps_subnormal_shares_match_the_stored_words(runs, mode):
    """Independent of the counters: the record of the last step alone (step 5) counts as
    subnormal exactly the stored codes that decode below the smallest normal but not to 0."""
    out = runs[0] / f"{mode}-tracked"
    last = format_records(out)[-1]
    assert last["first_step"] == last["step"] == STOP_AT
    assert_subnormals_match_words(last, checkpoint_words(out / "checkpoint.safetensors"), mode)


def checkpoint_words(path: Path) -> dict[str, torch.Tensor]:
    """Parameter name -> the optimizer's words in a trainer checkpoint file."""
    tensors, metadata = checkpoint.read_checkpoint(path)
    return {name: tensors[f"optimizer/state/{index}/words"] for group in metadata["optimizer"]["param_groups"]
            for index, name in zip(group["params"], group["param_names"])}


def sharded_checkpoint_words(directory: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Parameter name -> the whole words of an FSDP2 (DCP) checkpoint, gathered from its shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(directory), str(tmp_path / "gathered.pt"))
    return {name: entry["words"] for name, entry in torch.load(tmp_path / "gathered.pt")["optim"]["state"].items()}


def assert_subnormals_match_words(record: dict, words_by_name: dict[str, torch.Tensor], mode: str) -> None:
    m_fmt, rms_fmt = StateFormat(mode).formats
    subnormal = collections.Counter()
    for name, tensor in words_by_name.items():
        words = tensor.reshape(-1).view(torch.int32).numpy().view(np.uint32)  # DCP keeps int32 views
        for label, code, fmt in (("m", words >> np.uint32(MOMENT_SHIFT), m_fmt),
                                 ("rms", words & np.uint32(0xFFFF), rms_fmt)):
            stored = np.abs(fmt.decode(code).astype(np.float64))
            subnormal[parameter_kind(name), label] += int(np.count_nonzero((stored != 0) & (stored < fmt.min_normal)))
    assert {kind for kind, _ in subnormal} == KINDS
    for kind, entry in record["kinds"].items():
        for label in ("m", "rms"):
            assert entry["counts"][f"subnormal_{label}"] == subnormal[kind, label], (kind, label)


@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_track_format_changes_no_bit_of_training(runs, mode):
    root = runs[0]
    assert_bitwise_equal(root / f"{mode}-tracked" / "checkpoint.safetensors",
                         root / f"{mode}-plain" / "checkpoint.safetensors")
    losses = [[(r["step"], r.get("loss"), r.get("val_bpb")) for r in map(json.loads, lines) if "record" not in r]
              for lines in ((root / f"{mode}-{run}" / "log.jsonl").read_text().splitlines()
                            for run in ("tracked", "plain"))]
    assert losses[0] == losses[1] and [s for s, _, _ in losses[0]] == [1, 2, 4, 5]
    assert not format_records(root / f"{mode}-plain")


def test_the_format_plot_is_written_next_to_the_loss_plot(runs):
    root = runs[0]
    for run, has_format_plot in (("packed-tracked", True), ("packed-plain", False)):
        summary = json.loads((root / run / "summary.json").read_text())
        assert (root / run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (root / run / "format.png").exists() == has_format_plot
        assert ("format_plot" in summary) == has_format_plot
    assert (root / "packed-tracked" / "format.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((root / "packed-tracked" / "summary.json").read_text())["config"]["track_format"] is True


def test_track_format_may_start_at_a_resume_and_the_records_continue_the_run(runs, data_dir, tmp_path):
    """--track-format is not part of the run's configuration: a run started without it and
    resumed with it (in a new process) ends with the uninterrupted tracked run's bits, and
    its records equal that run's for the steps after the resume. Records a dead session left
    past the checkpoint are dropped."""
    out = tmp_path / "split"
    assert main(common(data_dir, "--out", out, "--stop-at-step", 2)) == 0
    stale = {"record": "format", "step": 3, "first_step": 3, "kinds": {}}
    with (out / "log.jsonl").open("a") as log:  # as if a session had died after step 3
        log.write(json.dumps(stale) + "\n")
    run_train(*common(data_dir, "--out", out, "--resume", "auto", "--track-format"))
    whole = runs[0] / "packed-tracked"
    assert_bitwise_equal(whole / "checkpoint.safetensors", out / "checkpoint.safetensors")
    assert stale not in format_records(out)
    assert format_records(out) == [r for r in format_records(whole) if r["first_step"] > 2]
    assert [(r["first_step"], r["step"]) for r in format_records(out)] == [(3, 4), (5, 5)]


def test_format_steps_logged_counts_only_the_logged_steps(runs, data_dir, tmp_path):
    """--format-steps logged: a record per logged step, covering that step alone (the steps
    between run uncounted), the same records as the every-step run where that one's cover a
    single step, the stored words' subnormal counts at the last one, and the same losses."""
    out = tmp_path / "logged"
    assert main(common(data_dir, "--out", out, "--track-format", "--format-steps", "logged",
                       "--stop-at-step", 4)) == 0
    records = format_records(out)
    assert [(r["first_step"], r["step"]) for r in records] == [(1, 1), (2, 2), (4, 4)]
    numels = micro_numels()
    assert all(e["element_steps"] == numels[kind] for r in records for kind, e in r["kinds"].items())
    assert records[:2] == format_records(runs[0] / "packed-tracked")[:2]
    assert_subnormals_match_words(records[-1], checkpoint_words(out / "checkpoint.safetensors"), "packed")
    losses = [{r["step"]: r.get("loss") for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
               if "record" not in r and "loss" in r} for run in (out, runs[0] / "packed-plain")]
    assert losses[0] == {step: losses[1][step] for step in (1, 2, 4)}
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--out", str(tmp_path / "bad"), "--track-format", "--format-steps", "some"])
    assert exit_info.value.code == 2
    with pytest.raises(ConfigError, match="add --track-format"):
        train(TrainConfig(format_steps="logged", out=str(tmp_path / "untracked")))


@pytest.mark.parametrize("flags, message", [
    (["--mode", "fp32"], "--track-format counts where packed or fp16 codes saturate, flush or go subnormal, "
                         "and --mode fp32 stores float32 moments: use --mode packed or fp16"),
    (["--optimizer", "torch-adamw"], "--track-format logs the packed optimizers' format counts, and --optimizer "
                                     "torch-adamw keeps none"),
    (["--optimizer", "muon"], "--track-format logs the packed optimizers' format counts, and --optimizer muon keeps "
                              "none"),
])
def test_track_format_outside_packed_and_fp16_modes_exits_2_naming_the_option(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--out", str(out), "--track-format", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 2 and error[0].startswith("usage: ")  # a short usage line, then one error line
    assert error[-1].startswith("python -m packed_adamw.torch.gpt.train: error: " + message)
    assert not out.exists()
    with pytest.raises(ConfigError, match="--track-format"):
        train(TrainConfig(mode="fp32", track_format=True, out=str(tmp_path / "code")))


def test_packed_muon_logs_each_rules_counts_and_counting_changes_no_bit(data_dir, tmp_path):
    """--optimizer packed-muon --track-format: PackedMuonAdamW counts, and each record is its read's
    counts summed by kind, each share over the element-steps of the kind's parameters that count it:
    Muon's momentum code's over its matrices (None for a kind AdamW alone steps), AdamW's over its
    parameters; Muon's refused matrices a count alone. Counting changes no bit of the run, and
    format.png draws Muon's panels beside AdamW's."""
    from packed_adamw.torch import PackedMuonAdamW
    from packed_adamw.core.muon import FORMAT_COUNTS as MUON_COUNTS

    reads, real = [], PackedMuonAdamW.format_stats

    def recording(self):
        reads.append(real(self))
        return reads[-1]

    flags = ["--optimizer", "packed-muon"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PackedMuonAdamW, "format_stats", recording)
        assert main(common(data_dir, *flags, "--out", tmp_path / "tracked", "--track-format")) == 0
    assert main(common(data_dir, *flags, "--out", tmp_path / "plain")) == 0
    assert_bitwise_equal(tmp_path / "tracked" / "checkpoint.safetensors", tmp_path / "plain" / "checkpoint.safetensors")
    assert (tmp_path / "tracked" / "format.png").stat().st_size > 0
    records = format_records(tmp_path / "tracked")
    assert [(r["first_step"], r["step"]) for r in records] == [(1, 1), (2, 2), (3, 4), (5, 5)]
    assert len(reads) == len(records)
    names = ("refused", *MUON_COUNTS, *FORMAT_COUNTS)
    muon_kinds, adamw_only = set(), set()
    for record, stats in zip(records, reads):
        counts = {kind: collections.Counter() for kind in KINDS}
        over = {kind: collections.Counter() for kind in KINDS}  # the element-steps that count each name
        for name, entry in stats.items():
            kind = parameter_kind(name)
            counts[kind].update(entry)
            over[kind].update({k: entry["elements"] for k in entry if k != "elements"})
        for kind, entry in record["kinds"].items():
            assert entry["element_steps"] == counts[kind]["elements"] > 0, kind
            assert entry["counts"] == {k: counts[kind][k] for k in names}, kind
            assert "refused" not in entry
            for k in names[1:]:
                assert entry[k] == (counts[kind][k] / over[kind][k] if over[kind][k] else None), (kind, k)
            (muon_kinds if over[kind]["saturated_mu"] else adamw_only).add(kind)
    assert muon_kinds and adamw_only, (muon_kinds, adamw_only)  # both rules' kinds were logged
    assert sum(r["kinds"][kind]["counts"]["subnormal_m"] for r in records for kind in adamw_only) > 0


def test_the_format_plot_draws_every_count_any_record_names(tmp_path):
    """format.png's panels come from every record and kind, not the first kind of the first record
    (a review's case: a record of no kinds first, a kind without AdamW's counts first); a log that
    counts only Muon's refused matrices gets one panel of them; a log without records, AdamW's six."""
    from packed_adamw.core.muon import FORMAT_COUNTS as MUON_COUNTS
    from packed_adamw.torch.gpt.telemetry import format_panels, plot_format_log

    def record(step, **kinds):
        return {"record": "format", "step": step, "first_step": step, "kinds": {
            kind: {"element_steps": 10, **{k: n / 10 for k, n in counts.items() if k != "refused"}, "counts": counts}
            for kind, counts in kinds.items()}}

    muon = {"refused": 0, **{k: 1 for k in MUON_COUNTS}}
    adamw = {k: 2 for k in FORMAT_COUNTS}
    logs = {
        "mixed": [record(1), record(2, mlp=muon, embedding=adamw)],
        "refused only": [record(1, mlp={"refused": 1}), record(2, mlp={"refused": 0})],
        "none": [],
    }
    titles = {name: [count for row in format_panels(records) for count, _ in row] for name, records in logs.items()}
    assert sorted(titles["mixed"]) == sorted(MUON_COUNTS + FORMAT_COUNTS)
    assert len(format_panels(logs["mixed"])) == 3 and len(format_panels(logs["mixed"])[0]) == 3  # events x codes
    assert titles["refused only"] == ["refused"] and titles["none"] == list(FORMAT_COUNTS)
    for name, records in logs.items():
        log_path = tmp_path / f"{name}.jsonl"
        log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
        plot_format_log(log_path, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name


# ---- DDP and FSDP2 ------------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_rank_under_torchrun_logs_the_single_process_records(runs, data_dir, tmp_path, monkeypatch, parallel):
    """Rank 0 of 1 (a torchrun-like environment, in this process): the same bits, hence the
    same counts, as the plain run; the FSDP2 path sums its shard's counts over the group."""
    from torchrun_helpers import free_port

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("GLOO_SOCKET_IFNAME", "lo"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    out = tmp_path / parallel
    assert main(common(data_dir, "--out", out, "--parallel", parallel, "--track-format")) == 0
    assert format_records(out) == format_records(runs[0] / "packed-tracked")


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_two_ranks_log_the_counts_of_whole_tensors(data_dir, tmp_path):
    """2 gloo ranks under torchrun, DDP and FSDP2 in one launch (tests/train_sessions.py):
    each record covers every element of every tensor once (FSDP2's shards summed, DDP's
    replicas not), and the last step's subnormal counts are those of the stored words.
    (DDP's and FSDP2's reductions round differently, so their two runs differ in bits.)"""
    from torchrun_helpers import torchrun

    sessions = [common(data_dir, "--out", tmp_path / parallel, "--parallel", parallel, "--track-format")
                for parallel in ("ddp", "fsdp")]
    torchrun(2, TESTS / "train_sessions.py", *sessions[0], "--then", *sessions[1], timeout_s=240)
    numels = micro_numels()
    ddp, fsdp = format_records(tmp_path / "ddp"), format_records(tmp_path / "fsdp")
    for records in (ddp, fsdp):
        assert [(r["first_step"], r["step"]) for r in records] == [(1, 1), (2, 2), (3, 4), (5, 5)]
        for r in records:
            steps = r["step"] - r["first_step"] + 1
            assert {kind: e["element_steps"] for kind, e in r["kinds"].items()} == {
                kind: n * steps for kind, n in numels.items()}
    assert_subnormals_match_words(ddp[-1], checkpoint_words(tmp_path / "ddp" / "checkpoint.safetensors"), "packed")
    assert_subnormals_match_words(fsdp[-1], sharded_checkpoint_words(tmp_path / "fsdp" / "checkpoint.dcp", tmp_path),
                                  "packed")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_track_format_changes_no_bit_on_cuda(data_dir, tmp_path, mode):
    """The compiled kernel with counting on (a separate specialization) stores the same bits;
    new processes, so --deterministic's global switch stays out of this one."""
    for run, extra in (("tracked", ["--track-format"]), ("plain", [])):
        run_train(*common(data_dir, "--mode", mode, "--device", "cuda", "--out", tmp_path / run, *extra))
    assert_bitwise_equal(tmp_path / "tracked" / "checkpoint.safetensors", tmp_path / "plain" / "checkpoint.safetensors")
    records = format_records(tmp_path / "tracked")
    assert [(r["first_step"], r["step"]) for r in records] == [(1, 1), (2, 2), (3, 4), (5, 5)]
    assert_subnormals_match_words(records[-1], checkpoint_words(tmp_path / "tracked" / "checkpoint.safetensors"), mode)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_format_steps_logged_changes_no_bit_on_cuda(data_dir, tmp_path):
    """Counting launches on the logged steps, uncounted ones between (the plan kept): the
    plain run's bits, and one record per logged step, each of that step alone."""
    for run, extra in (("logged", ["--track-format", "--format-steps", "logged"]), ("plain", [])):
        run_train(*common(data_dir, "--device", "cuda", "--out", tmp_path / run, *extra))
    assert_bitwise_equal(tmp_path / "logged" / "checkpoint.safetensors", tmp_path / "plain" / "checkpoint.safetensors")
    assert [(r["first_step"], r["step"]) for r in format_records(tmp_path / "logged")] == [(1, 1), (2, 2), (4, 4)]
