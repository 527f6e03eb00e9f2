"""Capturable steps on the GPU, eager and captured, against their peers in the same process:

    python benchmarks/bench_capturable.py

- PackedAdamW(capturable=True) on bench_step.py's lists: an eager step, a captured step whose
  graph reads the eager address table in place, and one whose gradients moved before the
  capture (the graph copies its table from pinned memory), each against fused AdamW
  `capturable=True` eager or captured the same way.
- PackedMuon(capturable=True) on d12's matrices, eager and captured, against PackedMuon without
  `capturable` (its host-derived scalar rows) eager.

First run on an H100 on 2026-12-07 (docs/results/GPU_TESTS.md, "from 21:54"). To compare two
trees, run it twice with each package first on PYTHONPATH (the first line says which ran). Times are CUDA-event
medians (bench_step.cuda_time_ms / captured_step_ms).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as B  # noqa: E402
import packed_adamw  # noqa: E402
from packed_adamw.torch import PackedAdamW, PackedMuon  # noqa: E402

D12_MATRICES = [(768, 768)] * 4 * 12 + [(3072, 768), (768, 3072)] * 12


def attempt(fn) -> float:
    """fn()'s time, or NaN with the error printed: an older tree may refuse a case (comparing trees)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark row reports, it does not stop the table
        print(f"  (failed: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def lr():
    return torch.tensor(1e-3, device="cuda")


def moved(opt) -> None:
    """Gradients elsewhere than the warm-up's, just before the capture."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = p.grad.clone()


def adamw_rows() -> None:
    print("| list | fused eager ms | packed eager ms (x) | fused captured ms | packed captured, table in place (x) | "
          "packed captured, table copied (x) |")
    print("|---|---|---|---|---|---|")
    for name, shapes in B.SHAPE_LISTS.items():
        fused_eager = B.torch_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=lr(), fused=True, capturable=True))
        packed_eager = B.torch_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True))
        fused = B.captured_step_ms(shapes, lambda p: torch.optim.AdamW(p, lr=lr(), fused=True, capturable=True))
        in_place = B.captured_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True))
        copied = attempt(lambda: B.captured_step_ms(shapes, lambda p: PackedAdamW(p, lr=lr(), capturable=True),
                                                    before_capture=moved))
        print(f"| {name} | {fused_eager:.4f} | {packed_eager:.4f} ({packed_eager / fused_eager:.3f}) | {fused:.4f} | "
              f"{in_place:.4f} ({in_place / fused:.3f}) | {copied:.4f} ({copied / fused:.3f}) |", flush=True)


def muon_rows(rounds: int = 2) -> None:
    print("| d12 matrices, round | PackedMuon eager ms | capturable eager ms (x) | capturable captured ms (x) |")
    print("|---|---|---|---|")
    for round_ in range(rounds):
        plain = B.torch_step_ms(D12_MATRICES, lambda p: PackedMuon(p, lr=0.02))
        eager = B.torch_step_ms(D12_MATRICES, lambda p: PackedMuon(p, lr=torch.tensor(0.02, device="cuda"),
                                                                   capturable=True))
        captured = B.captured_step_ms(D12_MATRICES, lambda p: PackedMuon(p, lr=torch.tensor(0.02, device="cuda"),
                                                                         capturable=True))
        print(f"| {round_ + 1} | {plain:.3f} | {eager:.3f} ({eager / plain:.3f}) | {captured:.3f} "
              f"({captured / plain:.3f}) |", flush=True)


if __name__ == "__main__":
    # packed_adamw is a namespace package (no __file__): its torch frontend says which tree runs
    print("package:", packed_adamw.torch.__file__, "torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    adamw_rows()
    muon_rows()
