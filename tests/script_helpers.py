"""Importing the repository's scripts (benchmarks/ is not a package) in tests."""
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_script(path: Path, name: str):
    """The script at `path` as a module named `name`, registered in sys.modules (its dataclasses
    and pickled functions look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
