"""PackedAdamW under torch.distributed on CPU: FSDP2 (DTensor parameters and state), DCP save,
exact resume in new processes with resharding 2 -> 1 -> 2, DDP and ZeRO-1.

Each test launches tests/distributed_scenarios.py under torchrun with gloo, over the loopback
only, bounded in time; the process group of every launch is killed if it overruns.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrun_helpers import torchrun
from layout import TESTS

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SCENARIOS = TESTS / "distributed_scenarios.py"
TIMEOUT_S = 180


def launch(n_procs: int, *args: str, device: str = "cpu") -> None:
    torchrun(n_procs, SCENARIOS, *args, timeout_s=TIMEOUT_S, extra_env={"SCENARIO_DEVICE": device})


@pytest.fixture(scope="module")
def trained_on_two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    launch(2, "fsdp_train", str(out))
    return out


def test_fsdp2_ddp_and_zero_on_two_ranks_equal_a_single_process_bit_for_bit(trained_on_two_ranks):
    """In the launch: FSDP2 parameters and words (every mode, uneven and empty shards) equal
    the single-process run; the state is DTensor on the parameters' mesh; FSDP2 with bf16
    mixed precision steps FP32 masters; DDP and ZeRO-1 ranks stay identical and equal it."""
    for mode in ("packed", "fp16", "fp32"):
        assert (trained_on_two_ranks / f"final-{mode}.pt").is_file()
        assert (trained_on_two_ranks / f"ckpt-{mode}-world2" / ".metadata").is_file()


def test_dcp_checkpoint_resumes_exactly_in_new_processes_resharded_two_to_one_and_back(trained_on_two_ranks):
    """Saved on 2 ranks at step 2, loaded into 1 new process, continued: the uninterrupted
    run's bits. Saved again there, loaded into 2 new processes, continued: the same bits.
    The one-process launch also checks that another format identity and a DTensor/plain
    mismatch are refused."""
    launch(1, "fsdp_resume", str(trained_on_two_ranks), "2")
    launch(2, "fsdp_resume", str(trained_on_two_ranks), "1")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fsdp2_on_one_rank_equals_the_plain_cuda_step_and_resumes_exactly(tmp_path):
    """The DTensor path with the compiled kernels (NCCL, world size 1): FSDP2, DDP and ZeRO-1
    steps equal the plain CUDA step bit for bit, and a DCP checkpoint resumes exactly."""
    launch(1, "fsdp_train", str(tmp_path), device="cuda")
    launch(1, "fsdp_resume", str(tmp_path), "1", device="cuda")


def test_a_torchrun_that_overruns_fails_in_bounded_time_and_leaves_no_worker(tmp_path):
    """The helper every torchrun test uses kills the workers too (torchrun starts them in sessions
    of their own): a worker that never ends must fail the test at its timeout, not hang pytest."""
    import threading

    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    outcome = {}

    def launch():
        try:
            torchrun(1, script, timeout_s=8)
        except BaseException as e:  # pytest.fail raises an outcome exception, not an Exception
            outcome["error"] = e

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "torchrun's helper still waits for a worker after its timeout"
    assert "did not finish in 8 s" in str(outcome.get("error")), outcome
    worker = next(int(line) for line in str(outcome["error"]).splitlines() if line.strip().isdigit())
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text().lower()
