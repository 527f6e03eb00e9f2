"""What the walkthrough's stages share: the `Report` that prints them and counts their checks,
and what a state file restored (`Restored`). The forward and backward stages (walkthrough.py)
and the Muon step (walkthrough_muon.py) both take them."""
from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..combined import PackedMuonAdamW
    from .chat_model import ChatConfig, ChatGPT
    from .packed_data import PackedBatch
    from .schedules import ScheduleTables


class Report:
    """Prints the stages and collects the checks' results."""

    def __init__(self, out=None, quiet: bool = False):
        self.out, self.quiet = out or sys.stdout, quiet
        self.bitwise_passed = self.tolerance_passed = 0
        self.failures: list[str] = []

    def say(self, text: str = "") -> None:
        if not self.quiet:
            print(text, file=self.out)

    def show(self, name: str, t: torch.Tensor) -> None:
        values = t.detach().reshape(-1)[:4].double().tolist()
        norm = f"  norm {t.detach().double().norm().item():.6g}" if t.is_floating_point() else ""
        shown = ", ".join(f"{v:.6g}" for v in values)
        self.say(f"    {name:<30} {str(tuple(t.shape)):<15} {str(t.dtype).replace('torch.', ''):<8} "
                 f"[{shown}{', ...' if t.numel() > 4 else ''}]{norm}")

    def bitwise(self, stage: str, ours: torch.Tensor, theirs: torch.Tensor, against: str) -> bool:
        ours, theirs = torch.as_tensor(ours), torch.as_tensor(theirs)
        same = (ours.dtype == theirs.dtype and ours.shape == theirs.shape
                and torch.equal(bits(ours), bits(theirs.to(ours.device))))
        if same:
            self.bitwise_passed += 1
            self.say(f"      = {against}, bit for bit ({stage})")
            return True
        detail = (f"{ours.dtype} {tuple(ours.shape)} vs {theirs.dtype} {tuple(theirs.shape)}"
                  if ours.dtype != theirs.dtype or ours.shape != theirs.shape else
                  f"{int((bits(ours) != bits(theirs.to(ours.device))).sum())} of {ours.numel()} elements differ")
        return self._fail(f"{stage}: not bit for bit equal to {against} ({detail})")

    def within(self, stage: str, ours: torch.Tensor, theirs: torch.Tensor, tolerance: float, against: str,
               why: str, scale: float | None = None) -> bool:
        """Relative Frobenius distance |ours - theirs| / |theirs| <= tolerance (`scale` instead of
        |theirs| where that is the natural size of the errors, e.g. the sum of |terms| of a sum)."""
        a, b = ours.detach().double(), theirs.detach().double().to(ours.device)
        scale = b.norm().item() if scale is None else scale
        error = (a - b).norm().item() / scale if scale else (a - b).norm().item()
        exact = torch.equal(bits(ours), bits(theirs.to(ours.device).to(ours.dtype))) if ours.shape == theirs.shape \
            else False
        if error <= tolerance:
            self.tolerance_passed += 1
            self.say(f"      ~ {against}: relative error {error:.3g} <= {tolerance:g}"
                     f"{' (bit for bit here)' if exact else ''} ({why})")
            return True
        return self._fail(f"{stage}: relative error {error:.3g} against {against} exceeds {tolerance:g} ({why})")

    def _fail(self, message: str) -> bool:
        self.failures.append(message)
        print(f"      MISMATCH {message}", file=self.out)
        return False


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns (so -0.0 != +0.0 and NaNs compare by payload)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


@dataclasses.dataclass
class Restored:
    config: ChatConfig
    run_config: dict
    model: ChatGPT
    optimizer: PackedMuonAdamW
    tensors: dict  # the state file's tensors, on the CPU, as saved
    metadata: dict
    batch: PackedBatch  # on the device
    schedule: ScheduleTables
    t_step: int
    matrix: str  # the Muon matrix to step (resolve_matrix)
