"""Several trainer sessions in one torchrun launch, for tests/gpt/test_train_distributed.py.

    python -m torch.distributed.run --nproc_per_node=N tests/train_sessions.py ARGS [--then ARGS ...]

Each ARGS is one `packed_adamw.torch.gpt.train.main(ARGS)` call, which must return 0. The
process group (gloo) is created here once and shared by the sessions, so a launch pays
torch's start-up once; the trainer uses a process group that exists and leaves it alone.
A resumed session belongs in a launch of its own (new processes), as under the real CLI.
"""
from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from packed_adamw.torch.gpt.train import main


def sessions(argv: list[str]) -> list[list[str]]:
    runs, current = [], []
    for arg in argv:
        if arg == "--then":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    return [*runs, current]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for args in sessions(sys.argv[1:]):
        code = main(args)
        if code != 0:  # (no teardown after a failure: a rank still in a collective would hang it)
            raise SystemExit(f"rank {dist.get_rank()}: session {args} returned {code}")
    # The sessions' models, optimizers and checkpoint writers (which hold the group) are freed while
    # the interpreter is whole, and no rank leaves while the other still communicates: once, under
    # load, a rank whose gloo threads outlived its sessions aborted at exit ("terminate called
    # without an active exception") after both runs had finished.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
