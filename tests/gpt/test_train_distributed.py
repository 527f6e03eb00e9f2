"""The trainer under torchrun (gloo, CPU): DDP and FSDP2 runs that resume bit-exactly, the
tape split across ranks, and sharded checkpoints that a crash never leaves half-written.

Two-rank runs are launched with torchrun over the loopback, bounded in time (the launch's
process group is killed if it overruns). Single-rank checks run in this process with a
torchrun-like environment (RANK=0, WORLD_SIZE=1), so the trainer sets up its own gloo group.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gpt_helpers import MICRO, assert_bitwise_equal, build_data
from torchrun_helpers import free_port as _free_port
from torchrun_helpers import torchrun as _torchrun
from packed_adamw.tokenizer.tape import TapeExhausted, TapeError, TapeReader
from packed_adamw.torch.gpt import checkpoint
from packed_adamw.torch.gpt.data import TapeShard
from packed_adamw.torch.gpt.train import main
from layout import TESTS

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SESSIONS = TESTS / "train_sessions.py"
TIMEOUT_S = 240
STEPS, STOP_AT = 6, 3
BATCH, CONTEXT = 4, 16  # MICRO's --batch-size and the micro preset's context


def torchrun(n_procs: int, *target: str) -> str:
    """Run `target` (a script and its arguments, or `-m module ...`) on n_procs gloo ranks."""
    return _torchrun(n_procs, *target, timeout_s=TIMEOUT_S)


def run_args(data: Path, out: Path, parallel: str, *extra) -> list[str]:
    return [*MICRO, "--data", str(data), "--max-steps", str(STEPS), "--parallel", parallel, "--out", str(out),
            *map(str, extra)]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def logged_steps(out: Path) -> list[int]:
    return sorted(json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines())


def dcp_contents(directory: Path, tmp_path: Path) -> dict:
    """Every entry of a DCP checkpoint as whole tensors / values, flattened to 'model/x', 'optim/state/x/words'."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{directory.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    flat = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}/")
        else:
            flat[prefix.rstrip("/")] = value

    walk(torch.load(target, weights_only=False), "")
    return flat


def assert_same_contents(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any(k.startswith("model/") for k in a) and any(k.endswith("/words") for k in a)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), key
        else:
            assert x == y, key


# ---- two ranks under torchrun -------------------------------------------------------------------

def torchrun_sessions(n_procs: int, *sessions: list[str]) -> str:
    """Trainer sessions one after the other in one launch (tests/train_sessions.py)."""
    return torchrun(n_procs, SESSIONS, *[arg for args in sessions for arg in ["--then", *args]][1:])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data_dir) -> Path:
    """Two launches of 2 ranks. The first: for DDP and FSDP2, an uninterrupted run of STEPS
    steps and the first session (to STOP_AT) of a split one (FSDP2 checkpointing every 2
    steps too). The second, in new processes: both split runs resumed to STEPS."""
    root, data = tmp_path_factory.mktemp("two_ranks"), data_dir
    fsdp = ("fsdp", "--checkpoint-every", 2)
    torchrun_sessions(2, run_args(data, root / "ddp-whole", "ddp"),
                      run_args(data, root / "ddp-split", "ddp", "--stop-at-step", STOP_AT),
                      run_args(data, root / "fsdp-whole", *fsdp),
                      run_args(data, root / "fsdp-split", *fsdp, "--stop-at-step", STOP_AT))
    for kind in ("ddp", "fsdp"):
        first = summary(root / f"{kind}-split")
        assert first["stopped_because"] == "stop_at_step" and first["step"] == STOP_AT
    assert checkpoint.read_sharded_manifest(root / "fsdp-split" / "checkpoint.dcp")["trainer"]["step"] == STOP_AT
    output = torchrun_sessions(2, run_args(data, root / "ddp-split", "ddp", "--resume", "auto"),
                               run_args(data, root / "fsdp-split", *fsdp, "--resume", "auto"))
    for kind, name in (("ddp", "checkpoint.safetensors"), ("fsdp", "checkpoint.dcp")):
        # printed once: by rank 0
        assert output.count(f"resumed from {root / f'{kind}-split' / name} at step {STOP_AT}") == 1, output[-3000:]
    return root


def test_ddp_on_two_ranks_resumed_under_torchrun_equals_the_uninterrupted_run_bitwise(two_ranks):
    """The final model and optimizer tensors (one file, written by rank 0) of the run resumed
    in new processes are bitwise those of the uninterrupted run."""
    split = two_ranks / "ddp-split"
    assert summary(split)["step"] == summary(two_ranks / "ddp-whole")["step"] == STEPS
    assert summary(split)["steps_this_session"] == STEPS - STOP_AT
    assert_bitwise_equal(two_ranks / "ddp-whole" / "checkpoint.safetensors", split / "checkpoint.safetensors")
    assert sorted(set(logged_steps(split))) == list(range(1, STEPS + 1))
    _, whole = checkpoint.read_checkpoint(two_ranks / "ddp-whole" / "checkpoint.safetensors")
    _, resumed = checkpoint.read_checkpoint(split / "checkpoint.safetensors")
    assert resumed["ranks"] == whole["ranks"] and resumed["config"] == whole["config"]
    assert whole["config"]["parallel"] == "ddp" and whole["config"]["world_size"] == 2


def test_fsdp2_on_two_ranks_resumed_under_torchrun_equals_the_uninterrupted_run_bitwise(two_ranks, tmp_path):
    """Sharded DCP checkpoints: the resumed run's final checkpoint holds the bits of the
    uninterrupted run's (every parameter, every word, every step count), and each run keeps
    only its latest checkpoint directory, published through the checkpoint.dcp link."""
    split, whole = two_ranks / "fsdp-split", two_ranks / "fsdp-whole"
    assert summary(split)["step"] == STEPS and summary(split)["steps_this_session"] == STEPS - STOP_AT
    assert_same_contents(dcp_contents(whole / "checkpoint.dcp", tmp_path),
                         dcp_contents(split / "checkpoint.dcp", tmp_path))
    a, b = (checkpoint.read_sharded_manifest(out / "checkpoint.dcp") for out in (whole, split))
    assert a["ranks"] == b["ranks"] and a["config"] == b["config"] and a["trainer"] == b["trainer"]
    assert a["world_size"] == 2 and a["config"]["parallel"] == "fsdp"
    assert sorted(a["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for out in (whole, split):
        link = out / "checkpoint.dcp"
        published = os.readlink(link).split("/")[-1]
        assert link.is_symlink() and [p.name for p in (out / "checkpoints").iterdir()] == [published]
    assert sorted(set(logged_steps(split))) == list(range(1, STEPS + 1))


def test_each_rank_reads_its_own_windows_and_saves_its_own_cursor(two_ranks):
    """Rank r starts at window r and moves W windows a step: after STEPS steps of 2 ranks its
    cursor is STEPS*2*B*T + r*B*T, saved per rank in both checkpoint kinds."""
    _, ddp = checkpoint.read_checkpoint(two_ranks / "ddp-whole" / "checkpoint.safetensors")
    fsdp = checkpoint.read_sharded_manifest(two_ranks / "fsdp-whole" / "checkpoint.dcp")
    window = BATCH * CONTEXT
    expected = [STEPS * 2 * window + rank * window for rank in (0, 1)]
    for ranks in (ddp["ranks"], fsdp["ranks"]):
        assert [entry["tape"]["cursor"] for entry in ranks] == expected
        assert [(entry["tape"]["rank"], entry["tape"]["world_size"]) for entry in ranks] == [(0, 2), (1, 2)]


# ---- the tape split ---------------------------------------------------------------------------------

def test_tape_shards_interleave_to_the_batches_of_one_reader(tmp_path):
    """Step s of 2 ranks with batch B reads exactly the tokens one reader with batch 2B reads
    at step s (rank r: the r-th half); both ranks stop at the same step; cursors restore."""
    data = build_data(tmp_path / "data", count=10, words=80)
    single = TapeReader(data / "train.tape")
    shards = [TapeShard(TapeReader(data / "train.tape"), rank, 2, BATCH, CONTEXT) for rank in (0, 1)]
    steps = shards[0].remaining_batches(BATCH, CONTEXT)
    assert steps == single.remaining_batches(2 * BATCH, CONTEXT) == shards[1].remaining_batches(BATCH, CONTEXT) > 2
    for _ in range(steps):
        x, y = single.next_batch(2 * BATCH, CONTEXT)
        parts = [shard.next_batch(BATCH, CONTEXT) for shard in shards]
        assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), y)
    for shard in shards:  # the last rank's window would not fit: every rank stops here
        with pytest.raises(TapeExhausted):
            shard.next_batch(BATCH, CONTEXT)
    assert shards[1].cursor - shards[0].cursor == BATCH * CONTEXT
    # A saved cursor restores on its own rank only.
    fresh = TapeShard(TapeReader(data / "train.tape"), 1, 2, BATCH, CONTEXT)
    fresh.load_state_dict(shards[1].state_dict())
    assert fresh.cursor == shards[1].cursor
    with pytest.raises(TapeError, match="rank=0, this rank has 1"):
        fresh.load_state_dict(shards[0].state_dict())
    with pytest.raises(TapeError, match="not a window of rank 1"):
        fresh.load_state_dict({**shards[1].state_dict(), "cursor": shards[1].cursor + 1})


# ---- settings -----------------------------------------------------------------------------------------

def test_torchrun_without_parallel_exits_2_saying_what_to_pass(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --parallel none (the default) cannot run as one of WORLD_SIZE=2" in error
    assert "--parallel ddp" in error and "--parallel fsdp" in error
    assert not (tmp_path / "out").exists()


def test_parallel_without_torchrun_exits_2_with_the_command_to_use(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--out", str(tmp_path / "out"), "--parallel", "fsdp"])
    assert exit_info.value.code == 2
    assert "torchrun --nproc_per_node=N -m packed_adamw.torch.gpt.train --parallel fsdp" in capsys.readouterr().err


# ---- one rank in this process ---------------------------------------------------------------------------

def _one_rank(monkeypatch):
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)

    def run(*args) -> int:
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        return main(list(map(str, args)))
    return run


@pytest.fixture
def one_rank(monkeypatch):
    """main(args) as rank 0 of 1 under a torchrun-like environment (a new rendezvous port per call)."""
    return _one_rank(monkeypatch)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def one_rank_fsdp_runs(tmp_path_factory, data_dir) -> tuple[list, Path]:
    """(settings, root): FSDP2 on one rank, uninterrupted to step 4 (root/whole) and stopped at 2 (root/first)."""
    root = tmp_path_factory.mktemp("one_rank")
    common = [*MICRO, "--data", data_dir, "--parallel", "fsdp", "--max-steps", 4]
    with pytest.MonkeyPatch.context() as patch:
        run = _one_rank(patch)
        assert run(*common, "--out", root / "whole") == 0
        assert run(*common, "--out", root / "first", "--stop-at-step", 2) == 0
    return common, root


@pytest.mark.parametrize("crash_in", ["dcp.save", "os.symlink"])
def test_a_crash_while_saving_leaves_the_previous_sharded_checkpoint_for_resume(
        tmp_path, one_rank_fsdp_runs, one_rank, capsys, crash_in):
    """A session that dies while writing its checkpoint (shards half-written, or the new
    directory complete but not yet published) leaves checkpoint.dcp on the previous one;
    resume continues from there, ends bitwise equal to an uninterrupted run, and removes
    what the crash left behind."""
    common, root = one_rank_fsdp_runs
    out, link = tmp_path / "out", tmp_path / "out" / "checkpoint.dcp"
    shutil.copytree(root / "first", out, symlinks=True)
    target, manifest = os.readlink(link), (link / "trainer.json").read_bytes()

    real_save = torch.distributed.checkpoint.save

    def crash_in_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half")
        raise OSError("No space left on device")

    def crash_before_publishing(*args):
        raise OSError("killed before the link was replaced")

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        if crash_in == "dcp.save":
            patch.setattr(torch.distributed.checkpoint, "save", crash_in_save)
        else:
            patch.setattr(os, "symlink", crash_before_publishing)
        assert one_rank(*common, "--out", out, "--resume", "auto") == 1  # a failed write ends the run, naming it
    assert f"error (rank 0): could not write {link}: " in capsys.readouterr().err
    assert os.readlink(link) == target and (link / "trainer.json").read_bytes() == manifest
    left_behind = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(left_behind) == 2  # the published checkpoint and the crashed session's directory

    capsys.readouterr()
    assert one_rank(*common, "--out", out, "--resume", "auto") == 0
    assert f"resumed from {link} at step 2" in capsys.readouterr().out
    assert_same_contents(dcp_contents(root / "whole" / "checkpoint.dcp", tmp_path), dcp_contents(link, tmp_path))
    assert [p.name for p in (out / "checkpoints").iterdir()] == [os.readlink(link).split("/")[-1]]


def test_sharded_checkpoints_refuse_damage_and_the_wrong_kind_of_run(tmp_path, data_dir, one_rank, capsys):
    common = [*MICRO, "--data", data_dir, "--max-steps", 3]
    out = tmp_path / "fsdp"
    assert one_rank(*common, "--parallel", "fsdp", "--out", out, "--stop-at-step", 2) == 0
    directory = (out / "checkpoint.dcp").resolve()
    capsys.readouterr()

    # Another kind of run into this --out, or resuming it from this checkpoint.
    assert one_rank(*common, "--parallel", "ddp", "--out", out, "--resume", "auto") == 2
    assert f"holds {out / 'checkpoint.dcp'}, the checkpoint of a --parallel fsdp run" in capsys.readouterr().err
    assert one_rank(*common, "--parallel", "ddp", "--out", tmp_path / "ddp", "--resume", out / "checkpoint.dcp") == 2
    assert "is a sharded checkpoint directory of a --parallel fsdp run" in capsys.readouterr().err

    # A damaged shard (same size, one byte changed) is named; the state is left alone.
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert one_rank(*common, "--parallel", "fsdp", "--out", out, "--resume", "auto") == 2
    assert "__0_0.distcp missing or not as written" in capsys.readouterr().err

    # An edited cursor fails trainer.json's checksum.
    manifest = directory / "trainer.json"
    manifest.write_text(manifest.read_text().replace('"cursor": 128', '"cursor": 192', 1))
    assert one_rank(*common, "--parallel", "fsdp", "--out", out, "--resume", "auto") == 2
    assert "trainer.json fails its checksum" in capsys.readouterr().err

    # A DCP directory without trainer.json (a save that never finished, or another program's).
    manifest.unlink()
    assert one_rank(*common, "--parallel", "fsdp", "--out", tmp_path / "other", "--resume", directory) == 2
    assert "without trainer.json" in capsys.readouterr().err


def test_ddp_rebuilds_its_buckets_before_the_first_step_of_every_session(monkeypatch, one_rank):
    """DDP lays out its gradient buckets anew after the first backward of a session; the
    trainer's warm-up backward makes that happen before the first real step, so resumed and
    uninterrupted runs reduce every step in the same buckets (with 3 ranks, a resume without
    it differed from the uninterrupted run in 31 of 56 tensors; with it, none)."""
    from packed_adamw.torch.gpt.distributed import ddp_rebuild_buckets
    from packed_adamw.torch.gpt.families import new_model

    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo")
    try:
        model = torch.nn.parallel.DistributedDataParallel(new_model("micro"))
        tokens = torch.zeros((2, CONTEXT), dtype=torch.long)
        ddp_rebuild_buckets(model, 2, CONTEXT, torch.device("cpu"))
        assert not model._has_rebuilt_buckets
        model(tokens, tokens)  # the first real step's forward
        assert model._has_rebuilt_buckets, "the first step of the session ran in the initial buckets"
        assert all(p.grad is None for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_one_rank_equals_the_single_process_run_bitwise(tmp_path, data_dir, one_rank):
    """With evaluation, fp32 moment statistics and checkpoints in the same steps (after a
    forward without backward FSDP2's root holds gathered parameters until the trainer
    reshards it): parameters, moments and statistics are the plain run's, bit for bit."""
    common = [*MICRO, "--data", data_dir, "--max-steps", 4, "--mode", "fp32", "--eval-every", 2,
              "--checkpoint-every", 2, "--log-moment-stats", "--moment-stats-every", 2]
    assert main([*map(str, common), "--out", str(tmp_path / "plain")]) == 0
    assert one_rank(*common, "--out", tmp_path / "fsdp", "--parallel", "fsdp") == 0
    sharded = dcp_contents(tmp_path / "fsdp" / "checkpoint.dcp", tmp_path)
    plain, metadata = checkpoint.read_checkpoint(tmp_path / "plain" / "checkpoint.safetensors")
    # optimizer/state/<index>: the index of the parameter in the param groups
    names = {name: index for group in metadata["optimizer"]["param_groups"]
             for index, name in zip(group["params"], group["param_names"])}
    assert len(names) == 28
    assert set(names) == {key.removeprefix("model/") for key in sharded if key.startswith("model/")}
    for name, index in names.items():
        for a, b in ((sharded[f"model/{name}"], plain[f"model/{name}"]),
                     (sharded[f"optim/state/{name}/moments"], plain[f"optimizer/state/{index}/moments"])):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    stats = [(tmp_path / out / "moment_stats.jsonl").read_text() for out in ("plain", "fsdp")]
    assert stats[0] == stats[1] and len(stats[0].splitlines()) == 2


def test_a_loss_that_turns_non_finite_on_one_rank_ends_every_rank_as_diverged(tmp_path, data_dir):
    """train.py's loss is each rank's own (its windows), so the divergence guard (loop.py) must
    decide on every rank's: rank 1 alone reads a NaN loss at step 2 here (its LossWatch is fed
    one), and both ranks end the run at that step with exit 1 and the same line, the summary
    saying it diverged. A rank that ended alone would wait in the summary's barrier while the
    others step on (mismatched collectives: a hang, or gloo's error; each rank here gives up after
    60 s, as torchrun's process group does not reach its workers)."""
    out = tmp_path / "out"
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text("import json, os, sys, threading\n"
                      "threading.Timer(60, os._exit, (3,)).start()  # a rank left waiting ends, failing the test\n"
                      "from packed_adamw.torch.gpt import telemetry\n"
                      "from packed_adamw.torch.gpt.train import main\n"
                      "observe = telemetry.LossWatch.observe\n"
                      "def nan_at_step_2(self, step, loss, grad_norm):\n"
                      "    observe(self, step, float('nan') if step == 2 else loss, grad_norm)\n"
                      "if os.environ['RANK'] == '1':\n    telemetry.LossWatch.observe = nan_at_step_2\n"
                      "status = main(json.loads(sys.argv[1]))\n"
                      "sys.stdout.flush(); sys.stderr.flush(); os._exit(0 if status == 1 else 4)\n")
    output = _torchrun(2, script, json.dumps(run_args(data_dir, out, "ddp", "--log-every", 1)), timeout_s=90)
    errors = [line for line in output.splitlines() if "error (rank" in line]
    assert len(errors) == 2 and all("the run diverged" in line and "at step 2" in line for line in errors), output
    assert summary(out)["stopped_because"] == "diverged" and summary(out)["step"] == 2


@pytest.mark.parametrize("parallel, released", [("ddp", True), ("none", False)])
def test_a_distributed_run_frees_what_build_made_before_it_ends_the_process_group(parallel, released, monkeypatch,
                                                                                   tmp_path):
    """DDP's reducer holds the process group in C++: freed after the group is destroyed, it ran
    the group's destructor with the GIL held, which deadlocked against a gloo worker thread that
    needed the GIL (loop.run's comment; gdb caught it under load). loop.run releases the recipe
    before `ranks.close()`, here on a run that ends at its start (as a refused one does)."""
    from types import SimpleNamespace

    from packed_adamw.torch.gpt import loop
    from packed_adamw.torch.gpt.distributed import Ranks

    seen = {}

    class Recipe(loop.Recipe):
        plan = SimpleNamespace(device="cpu", deterministic=False, parallel=parallel, out=tmp_path / "out")
        files = None

        def check(self):
            self.model = self.forward = torch.nn.Linear(2, 2)  # what build makes, as an attribute

    class Refused(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Refused

    recipe = Recipe()
    monkeypatch.setattr(loop, "resolve_device", lambda *args, **kwargs: torch.device("cpu"))
    monkeypatch.setattr(loop, "start_ranks", lambda parallel, device: Ranks(parallel, 0, 1 + (parallel != "none")))
    monkeypatch.setattr(loop, "claim", refuse)
    monkeypatch.setattr(Ranks, "close", lambda ranks: seen.setdefault("at close", sorted(vars(recipe))))
    with pytest.raises(Refused):
        loop.run(recipe)
    assert seen["at close"] == ([] if released else ["forward", "model"])
