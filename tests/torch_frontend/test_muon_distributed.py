"""PackedMuonAdamW under FSDP2 on CPU (docs/MUON.md, "PyTorch"): 2 gloo ranks equal one process
bit for bit, and a DCP checkpoint resumes exactly in new processes resharded 2 -> 1 -> 2.

Each launch runs tests/muon_distributed_scenarios.py under torchrun (gloo over the loopback,
bounded in time; the process group of a launch is killed if it overruns).
"""
from __future__ import annotations


import pytest
import torch.distributed as dist
from torchrun_helpers import torchrun
from layout import TESTS

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SCENARIOS = TESTS / "muon_distributed_scenarios.py"
TIMEOUT_S = 240


def launch(n_procs: int, *args: str) -> None:
    # The scenario runs the kernels' step in Triton's interpreter too (CPU tensors).
    torchrun(n_procs, SCENARIOS, *args, timeout_s=TIMEOUT_S, extra_env={"TRITON_INTERPRET": "1"})


def test_fsdp2_muon_equals_one_process_and_dcp_resumes_resharded_two_to_one_and_back(tmp_path):
    """First launch (2 ranks): FSDP2 steps of PackedMuonAdamW (packed, bf16 and fp32 momenta;
    bf16 parameters with their masters; batch_ns; the kernels' step) equal a single-process run
    bit for bit, parameters and decoded state; the Muon state is DTensors laid out like the
    parameters; a NaN in one rank's shard refuses the whole matrix on both ranks. Then the DCP
    checkpoint taken at step 2 loads into 1 new process (resharded), continues to the
    uninterrupted run's bits, is saved again, and loads into 2 new processes: the same bits."""
    launch(2, "muon_fsdp_train", str(tmp_path))
    for run in ("fp32-packed", "fp32-bf16", "fp32-fp32", "bf16-packed", "fp32-packed-batch_ns"):
        assert (tmp_path / f"final-{run}.pt").is_file() and (tmp_path / f"ckpt-{run}-world2" / ".metadata").is_file()
    launch(1, "muon_fsdp_resume", str(tmp_path), "2")
    launch(2, "muon_fsdp_resume", str(tmp_path), "1")
