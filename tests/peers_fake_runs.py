"""Stand-ins for benchmarks/peers.py's one-run function, importable by its spawned processes."""
import json
import os
from pathlib import Path

from script_helpers import BENCHMARKS, import_script


def peers_module():
    return import_script(BENCHMARKS / "peers.py", "peers_for_fake_runs")


def crash_on_fp32(args, model, row, seed, out, sharing):
    """The fp32 row's process dies without a word (as a crash in a CUDA library would); the other
    rows write a result.json with the run's real trainer flags."""
    if row == "fp32":
        os._exit(3)
    peers = peers_module()
    result = {"model": model, "row": row, "seed": seed, "wall_s": 1.0, "runs_sharing_the_gpu": sharing,
              "trainer_argv": peers.trainer_argv(args, model, row, seed, out)}
    (Path(out) / "result.json").write_text(json.dumps(result))
