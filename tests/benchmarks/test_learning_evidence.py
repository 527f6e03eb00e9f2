"""benchmarks/learning_evidence.py on the CPU: the micro preset, 2 steps a run, tapes of the
32,768-entry tokenizer; the runs are real trainer subprocesses, two at once. Where bitsandbytes
is not installed (the CPU machine), its row must come out as "not installed"."""
import importlib.util
import json

import pytest

from gpt_helpers import make_documents
from script_helpers import BENCHMARKS, import_script
from packed_adamw.tokenizer import LARGE_VOCAB_SIZE
from packed_adamw.tokenizer.tape import build_split

ROWS = ["adamw-fused", "packed-suggested", "muon", "packed-muon-bf16-weights", "bnb-adamw8bit"]


@pytest.fixture(scope="module")
def evidence():
    return import_script(BENCHMARKS / "learning_evidence.py", "learning_evidence_under_test")


def test_the_matrix_runs_writes_its_page_and_skips_recorded_runs(evidence, tmp_path, monkeypatch):
    data = tmp_path / "data"
    build_split(make_documents(12, 200), data, val_fraction=0.1, vocab_size=LARGE_VOCAB_SIZE)
    record, docs = tmp_path / "record.json", tmp_path / "docs"
    argv = ["--models", "micro", "--rows", *ROWS, "--seeds", "0", "--jobs", "2", "--evals", "2", "--eval-batches",
            "2", "--data", str(data), "--runs", str(tmp_path / "runs"), "--record", str(record),
            "--out-dir", str(docs)]
    assert evidence.main(argv) == 0

    kept = json.loads(record.read_text())
    biases = kept["probes"]["micro"]["biases"]
    ran = {run["row"]: run for run in kept["runs"]}
    bnb_installed = importlib.util.find_spec("bitsandbytes") is not None  # (on a GPU machine, maybe)
    expected = {"adamw-fused", "muon", "packed-muon-bf16-weights"} | (
        {"packed-suggested"} if tuple(biases) != evidence.DEFAULT_BIASES else set()) | (
        {"bnb-adamw8bit"} if bnb_installed else set())
    assert set(ran) == expected
    for row, run in ran.items():
        assert run["summary"]["step"] == 2 and run["summary"]["stopped_because"] == "max_steps"
        assert [step for step, _ in run["val_curve"]] == [1, 2]
        assert run["summary"]["parameters"] > LARGE_VOCAB_SIZE * 32  # the tied embedding follows the tapes
    if "packed-suggested" in ran:
        argv_items = evidence.flag_items(ran["packed-suggested"]["argv"])
        assert f"--m-bias {biases[0]}" in argv_items and f"--rms-bias {biases[1]}" in argv_items

    page = (docs / "LEARNING_EVIDENCE.md").read_text()
    assert "| torch AdamW(fused=True), FP32 weights (baseline) | 1 |" in page
    if not bnb_installed:
        assert "| bitsandbytes AdamW8bit | 0 | not installed: pip install bitsandbytes==0.50.2 |" in page
    muon_line = next(line for line in page.splitlines() if line.startswith("| PackedMuonAdamW, packed momentum, bf16"))
    paired = float(muon_line.split("|")[6].split()[0])
    assert paired == pytest.approx(ran["packed-muon-bf16-weights"]["summary"]["val_bpb"]
                                   - ran["muon"]["summary"]["val_bpb"], abs=1e-4)  # the page rounds to 4 places
    assert "Baseline's mean val bpb still falling at the last evaluation" in page
    assert (docs / "learning_evidence.png").stat().st_size > 0

    # A second call finds every run in the record: it starts none, and writes the same table.
    monkeypatch.setattr(evidence.Job, "start", lambda job: pytest.fail(f"{job.name} ran again"))
    assert evidence.main(argv) == 0
    assert json.loads(record.read_text())["runs"] == kept["runs"]
    assert ran["packed-muon-bf16-weights"]["muon_ns"] == evidence.muon_ns_now() and "muon_ns" not in ran["muon"]


def test_a_packed_muon_run_of_another_newton_schulz_is_not_reused(evidence, monkeypatch):
    """Runs recorded before the Newton-Schulz key existed took torch's matmuls per matrix: a
    packed-muon row runs again; other rows keep their runs. The page shows a row's old runs
    until one of today's Newton-Schulz exists, then only those."""
    monkeypatch.setattr(evidence, "muon_ns_now", lambda: evidence.MUON_NS)  # a GPU's, on any machine
    argv = ["--optimizer", "packed-muon"]
    runs = [{"model": "micro", "row": "packed-muon", "seed": 0, "argv": argv},
            {"model": "micro", "row": "muon", "seed": 0, "argv": argv}]
    record = {"runs": runs}
    assert evidence.recorded_run(record, "micro", "packed-muon", 0, argv) is None
    assert evidence.recorded_run(record, "micro", "muon", 0, argv) is runs[1]
    runs[0]["muon_ns"] = evidence.MUON_NS
    assert evidence.recorded_run(record, "micro", "packed-muon", 0, argv) is runs[0]
    old = [{"model": "micro", "row": "packed-muon", "seed": seed, "argv": argv} for seed in (1, 2)]
    record = {"runs": old}
    monkeypatch.setattr(evidence, "run_argv", lambda *args: argv)
    assert sorted(evidence.seeds_of(record, None, "micro", "packed-muon")) == [1, 2]
    record["runs"].append(runs[0])  # seed 0, today's Newton-Schulz
    assert sorted(evidence.seeds_of(record, None, "micro", "packed-muon")) == [0]
