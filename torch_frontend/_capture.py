"""What every capturable rule's step shares with CUDA graphs: a captured step reads its device
tensors by address at every replay, so nothing it read may be freed or written for another
purpose afterwards.

- `AddressTable`: a step's table of buffer addresses on the device. Eager steps upload it when
  an address changes; a capture reads it in place when it holds the captured addresses, and
  otherwise copies the addresses at every replay from a pinned host table of its own. Either
  way the capture takes those tables for good, and later eager steps write other ones.
- `keep`: what a capture read lives as long as the optimizer (torch.optim has no call that
  releases a capture; `torch.cuda.graph`'s pool keeps only the graph's own allocations).
- `refusal`: the one message of a step that must make something a capture cannot make.

AdamW's `_plan.CapturableStepPlan` and Muon's `_muon_capturable.DevicePlan` use all three; a
new rule's capturable plan does the same (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import torch

SPARES = 2  # captures in a row of gradients the last eager step did not step (each takes a pair)


def refusal(optimizer: str, why: str) -> str:
    """The refusal of a step under capture that must make or change what the graph reads."""
    return (f"{optimizer}(capturable=True) under a CUDA graph capture: {why} since the last eager step, and a "
            "capture cannot build what the step reads on the device. Take one eager step first (torch.cuda.graph's "
            "warm-up on a side stream does), and capture again after changing parameters, gradients, state or "
            "hyperparameters other than lr")


def keep(opt, *objects) -> None:
    """Keeps `objects` (tensors, or a plan holding them) alive as long as `opt`: a captured
    graph reads them at every replay. Not pickled or copied (torch.optim's pickle holds only
    defaults, state and param_groups), so a copy of the optimizer keeps none. A tensor the user
    holds too (a parameter, an lr) is passed as `storage(t)`: `t.data = ...` would release the
    storage the graph reads while the object lives on."""
    kept = opt.__dict__.setdefault("_captured", {})  # id -> object: holding it keeps its id unique
    for obj in objects:
        kept.setdefault(id(obj), obj)


def storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor that holds `t`'s memory whatever later happens to `t` itself (`.data` swapped)."""
    return t.detach()


class AddressTable:
    """One step's device table of `length` int64 addresses, for steps that may be captured.

    Eager: `eager(words)` returns the table, uploaded (a blocking copy, so the host buffer is
    free when it returns) only when the words changed. Under capture: `captured(words)` returns
    the eager table itself when it holds these words, and takes it (the next eager step uploads
    into a new one); otherwise a spare pair, a pinned host table and a device table, that the
    graph copies from at every replay. Spares are made by eager steps, outside any capture:
    pinning memory under a capture fails on some torch builds, and a device tensor allocated
    there comes from the graph's private pool, which torch.compile's CUDA graph trees manage as
    if only the graph's outputs outlived it. An eager step prepares `SPARES` pairs; a capture
    with none left is refused (`refusal`), before it has recorded anything of the table."""

    def __init__(self, length: int, device: torch.device, owner: str):
        self.length, self.device, self.owner = length, device, owner
        self.table: torch.Tensor | None = None
        self.words: tuple | None = None  # what `table` holds
        self.spares: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.refill()

    def refill(self) -> None:
        """Tops the spares up (eager steps only)."""
        while self.device.type == "cuda" and len(self.spares) < SPARES:
            self.spares.append((torch.empty(self.length, dtype=torch.int64, pin_memory=True),
                                torch.empty(self.length, dtype=torch.int64, device=self.device)))

    def eager(self, words: tuple) -> torch.Tensor:
        if words != self.words or self.table is None:
            if self.table is None:
                self.table = torch.empty(self.length, dtype=torch.int64, device=self.device)
            self.table.copy_(torch.tensor(words, dtype=torch.int64))
            self.words = words
        self.refill()
        return self.table

    def can_capture(self, words: tuple) -> bool:
        """Whether `captured(words)` would find a table."""
        return (self.table is not None and tuple(words) == self.words) or bool(self.spares)

    def check_capture(self, words: tuple) -> None:
        """`captured(words)`'s refusal, for a step to make before it records anything."""
        if not self.can_capture(words):  # a pair made here would pin memory under the capture: it would fail
            raise RuntimeError(refusal(self.owner, f"captures that could not read the eager address table took the "
                                                   f"{SPARES} spares an eager step prepares"))

    def captured(self, words: tuple) -> tuple[torch.Tensor, tuple]:
        """(the table the graph reads, what it must keep)."""
        if self.table is not None and words == self.words:
            table, self.table, self.words = self.table, None, None
            return table, (table,)
        self.check_capture(words)
        host, table = self.spares.pop()
        host.copy_(torch.tensor(words, dtype=torch.int64))
        table.copy_(host, non_blocking=True)  # captured: each replay reads `host`, never written again
        return table, (host, table)
