"""Stand-ins for benchmarks/peers.py's one-run function, importable by its spawned processes."""
import importlib.util
import json
import os
from pathlib import Path

PEERS_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


def peers_module():
    spec = importlib.util.spec_from_file_location("peers_for_fake_runs", PEERS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def crash_on_fp32(args, model, row, seed, out, sharing):
    """The fp32 row's process dies without a word (as a crash in a CUDA library would); the other
    rows write a result.json with the run's real trainer flags."""
    if row == "fp32":
        os._exit(3)
    peers = peers_module()
    result = {"model": model, "row": row, "seed": seed, "wall_s": 1.0, "runs_sharing_the_gpu": sharing,
              "trainer_argv": peers.trainer_argv(args, model, row, seed, out)}
    (Path(out) / "result.json").write_text(json.dumps(result))
