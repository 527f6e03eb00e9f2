"""benchmarks/learning_study.py: seeds, the page's numbers, and --merge, without training.

The trainer's `train` is replaced by a stand-in that writes a run's log (a real run takes minutes
on a GPU); its `parse_args` is the real one, so the flags the study passes are checked.
"""
import json
from pathlib import Path

import pytest

from script_helpers import BENCHMARKS, import_script

STUDY_SCRIPT = BENCHMARKS / "learning_study.py"
THIS_SESSION = {"date": "2027-01-02", "gpu": "Test GPU", "torch": "2.13.0", "triton": "3.9.0"}
EARLIER_SESSION = {"date": "2026-12-01", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0"}
STEPS = [30, 60, 90]


@pytest.fixture(scope="module")
def study():
    """benchmarks/learning_study.py imported as a module (benchmarks is not a package)."""
    return import_script(STUDY_SCRIPT, "learning_study_under_test")


@pytest.fixture(autouse=True)
def fixed_session(study, monkeypatch):
    """session() asks CUDA for the GPU's name; these tests run on CPU."""
    monkeypatch.setattr(study, "session", lambda: dict(THIS_SESSION))


def run(final_bpb, tokens_per_s=1000.0, optimizer_ms=1.0, stats=(), session=None, kept=False):
    """One seed's run as run_all returns it: the curve falls linearly to `final_bpb`."""
    log = [{"step": step, "loss": 5.0, "val_bpb": final_bpb + 0.1 * (len(STEPS) - 1 - i)}
           for i, step in enumerate(STEPS)]
    log.insert(1, {"step": 40, "loss": 5.0})  # a training-only record: not part of the curve
    r = {"summary": {"val_bpb": final_bpb, "tokens_per_s": tokens_per_s, "median_optimizer_ms": optimizer_ms},
         "log": log, "moment_stats": list(stats), "session": session or dict(THIS_SESSION)}
    return {**r, "kept": True} if kept else r


def table_row(page: str, name: str) -> list[str]:
    (line,) = [line for line in page.splitlines() if line.startswith(f"| {name} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def write(study, tmp_path, results):
    doc = tmp_path / "LEARNING_STUDY.md"
    study.write_report(results, doc, tmp_path / "learning_study.png", "python benchmarks/learning_study.py")
    return doc.read_text(), json.loads(doc.with_suffix(".json").read_text())


def test_table_gives_means_spreads_and_vs_fp32_from_the_means(study, tmp_path):
    stats = [{"step": 30, "kinds": {"first": 1}}, {"step": 90, "kinds": {"last": 2}}]
    packed, packed_bf16 = "packed (E4M11 + E4M12)", "packed, bf16 weights + split masters"
    results = {
        study.REFERENCE: {0: run(2.0, 900.0, 1.0, stats), 1: run(2.1, 1000.0, 2.0, [{"step": 30, "kinds": {}}]),
                          2: run(2.3, 1100.0, 3.0)},
        packed: {0: run(2.2, 2000.0, 0.5), 1: run(2.4, 4000.0, 1.5)},
        packed_bf16: {0: run(2.5)},
    }
    page, saved = write(study, tmp_path, results)

    reference_mean = (2.0 + 2.1 + 2.3) / 3
    assert table_row(page, study.REFERENCE) == [study.REFERENCE, f"{reference_mean:.4f}", "2.0000-2.3000", "3",
                                                "+0.00%", "1,000", "2.00"]
    assert table_row(page, packed) == [packed, "2.3000", "2.2000-2.4000", "2",
                                       f"{100 * (2.3 / reference_mean - 1):+.2f}%", "3,000", "1.00"]
    assert table_row(page, packed_bf16)[1:5] == ["2.5000", "-", "1", f"{100 * (2.5 / reference_mean - 1):+.2f}%"]
    # Several fp32 seeds: their spread stands for the noise, not the single-seed 1% rule.
    assert "1 to 3 seeds per row" in page
    assert f"span 0.3000 bpb ({100 * 0.3 / reference_mean:.2f}% of their mean)" in page
    assert "about 1%" not in page
    assert (f"- {packed_bf16}: 2.5000 [-] vs {packed}: 2.3000 [2.2000-2.4000] ({100 * (2.5 / 2.3 - 1):+.2f}%)"
            in page)
    # Moment stats from the reference row's seed 0 (its first and last records).
    assert '"first": 1' in page and '"last": 2' in page and "of seed 0" in page
    assert "kept from an earlier session" not in page
    # The JSON: per row, per seed, the curve without the training-only records.
    assert sorted(saved[study.REFERENCE]["seeds"]) == ["0", "1", "2"]
    seed_one = saved[packed]["seeds"]["1"]
    assert seed_one["summary"]["val_bpb"] == 2.4 and seed_one["session"] == THIS_SESSION
    assert [e["step"] for e in seed_one["val_curve"]] == STEPS
    assert saved[study.REFERENCE]["seeds"]["0"]["moment_stats"] == stats
    assert (tmp_path / "learning_study.png").stat().st_size > 0


def test_the_same_seeds_for_every_row_are_named(study, tmp_path):
    results = {study.REFERENCE: {0: run(2.0), 1: run(2.2)}, "fp16/fp16": {0: run(2.1), 1: run(2.1)}}
    page, _ = write(study, tmp_path, results)
    assert "in order, 2 seeds (0, 1), warmup" in page
    assert "span 0.2000 bpb (9.52% of their mean)" in page


def test_one_seed_keeps_the_one_percent_rule(study, tmp_path):
    results = {study.REFERENCE: {0: run(2.0)}, "fp16/fp16": {0: run(2.02)}}
    page, _ = write(study, tmp_path, results)
    assert "in order, one seed, warmup" in page
    assert "One seed and a short run: differences below about 1% are within noise." in page
    assert table_row(page, "fp16/fp16")[1:5] == ["2.0200", "-", "1", "+1.00%"]


def test_the_plotted_curve_is_the_mean_with_a_min_max_band(study):
    low, high = run(2.0), run(2.6)
    high["log"][2]["val_bpb"] = 1.0  # step 60: this seed is the lowest there
    steps, mean, lowest, highest = study.val_curve("fp16/fp16", {0: low, 1: high, 2: run(2.3)})
    assert steps == STEPS
    assert mean == pytest.approx([2.5, (2.1 + 1.0 + 2.4) / 3, 2.3])
    assert lowest == pytest.approx([2.2, 1.0, 2.0]) and highest == pytest.approx([2.8, 2.4, 2.6])


def test_seeds_evaluated_at_different_steps_are_refused(study, tmp_path):
    short = run(2.0)
    short["log"] = short["log"][:-1]
    with pytest.raises(ValueError, match=r"row 'fp16/fp16': seeds \[0, 1\] were evaluated at different steps"):
        write(study, tmp_path, {"fp16/fp16": {0: run(2.0), 1: short}})


def old_format_json(path: Path, rows: dict) -> None:
    """The single-seed study's JSON: summary, val_curve, moment_stats and session per row, no seeds."""
    path.write_text(json.dumps({name: {"summary": {"val_bpb": bpb, "tokens_per_s": 500.0, "median_optimizer_ms": 1.0},
                                       "val_curve": [{"step": s, "val_bpb": bpb} for s in STEPS],
                                       "moment_stats": [], "session": EARLIER_SESSION}
                                for name, bpb in rows.items()}))


def test_rows_of_the_single_seed_json_are_seed_0(study, tmp_path):
    path = tmp_path / "LEARNING_STUDY.json"
    old_format_json(path, {study.REFERENCE: 2.2, "fp16/fp16": 2.3, "a row no longer in RUNS": 9.0})
    kept = study.earlier_runs(path, skip={("fp16/fp16", 0)})
    assert list(kept) == [study.REFERENCE] and list(kept[study.REFERENCE]) == [0]
    assert kept[study.REFERENCE][0]["summary"]["val_bpb"] == 2.2
    assert kept[study.REFERENCE][0]["session"] == EARLIER_SESSION and kept[study.REFERENCE][0]["kept"]
    assert study.earlier_runs(tmp_path / "absent.json", skip=set()) == {}


@pytest.fixture
def fake_trainer(study, monkeypatch):
    """Replaces trainer.train: writes a log whose val bpb depends on the seed; records (out, seed)."""
    calls = []

    def train(config):
        calls.append((Path(config.out), config.seed))
        final_bpb = 2.0 + config.seed / 10
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        out.joinpath("log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in run(final_bpb)["log"]))
        return {"val_bpb": final_bpb, "tokens_per_s": 1000.0 * (1 + config.seed), "median_optimizer_ms": 1.0}

    monkeypatch.setattr(study.trainer, "train", train)
    return calls


def study_args(tmp_path, *args):
    return ["--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs"),
            "--out-doc", str(tmp_path / "docs" / "LEARNING_STUDY.md"), *args]


def test_each_seed_trains_with_its_seed_and_directory(study, tmp_path, fake_trainer):
    (tmp_path / "docs").mkdir()
    old_format_json(tmp_path / "docs" / "LEARNING_STUDY.json", {study.REFERENCE: 2.2})
    study.main(study_args(tmp_path, "--runs-only", "packed", "--seeds", "0", "3"))
    runs = tmp_path / "runs"
    assert fake_trainer == [(runs / "packed", 0), (runs / "packed-seed3", 3)]
    saved = json.loads((tmp_path / "docs" / "LEARNING_STUDY.json").read_text())
    assert list(saved) == ["packed (E4M11 + E4M12)"]  # without --merge the earlier rows are dropped
    assert saved["packed (E4M11 + E4M12)"]["seeds"]["3"]["summary"]["val_bpb"] == 2.3


def test_merge_keeps_the_other_seeds_and_the_other_rows(study, tmp_path, fake_trainer):
    docs = tmp_path / "docs"
    docs.mkdir()
    bf16 = "packed, bf16 weights + split masters"
    old_format_json(docs / "LEARNING_STUDY.json", {study.REFERENCE: 2.2, bf16: 2.05})

    study.main(study_args(tmp_path, "--runs-only", "packed-bf16", "--seeds", "1", "2", "--merge"))
    assert fake_trainer == [(tmp_path / "runs" / "packed-bf16-seed1", 1), (tmp_path / "runs" / "packed-bf16-seed2", 2)]
    saved = json.loads((docs / "LEARNING_STUDY.json").read_text())
    assert list(saved) == [study.REFERENCE, bf16]
    assert list(saved[study.REFERENCE]["seeds"]) == ["0"]
    assert {seed: r["summary"]["val_bpb"] for seed, r in saved[bf16]["seeds"].items()} == {"0": 2.05, "1": 2.1,
                                                                                          "2": 2.2}
    assert saved[bf16]["seeds"]["0"]["session"] == EARLIER_SESSION
    assert saved[bf16]["seeds"]["1"]["session"] == THIS_SESSION
    page = (docs / "LEARNING_STUDY.md").read_text()
    mean = (2.05 + 2.1 + 2.2) / 3
    assert table_row(page, bf16)[1:5] == [f"{mean:.4f}", "2.0500-2.2000", "3", f"{100 * (mean / 2.2 - 1):+.2f}%"]
    assert (f"- Row `{study.REFERENCE}`, seed 0: kept from an earlier session (2026-12-01, NVIDIA H200, "
            "torch 2.11.0+cu130) by `--merge`.") in page
    assert f"- Row `{bf16}`, seed 0: kept from an earlier session (2026-12-01" in page
    assert "seed 1" not in page.split("![validation bpb]")[0]  # seeds run now are not marked as kept
    assert "--seeds 1 2 --merge" in page

    # Running a seed again replaces it; the seeds not run now (from both sessions) stay.
    fake_trainer.clear()
    study.main(study_args(tmp_path, "--runs-only", "packed-bf16", "--seeds", "0", "--merge"))
    saved = json.loads((docs / "LEARNING_STUDY.json").read_text())
    assert {seed: r["summary"]["val_bpb"] for seed, r in saved[bf16]["seeds"].items()} == {"0": 2.0, "1": 2.1,
                                                                                          "2": 2.2}
    assert saved[bf16]["seeds"]["0"]["session"] == THIS_SESSION
    page = (docs / "LEARNING_STUDY.md").read_text()
    assert f"- Row `{bf16}`, seeds 1, 2: kept from an earlier session (2027-01-02, Test GPU" in page


def test_help_lists_seeds(study, capsys):
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--help"])
    assert exit_info.value.code == 0
    assert "--seeds K [K ...]" in capsys.readouterr().out


@pytest.mark.parametrize("seeds", [["1", "1"], ["-1"]])
def test_repeated_or_negative_seeds_are_refused(study, tmp_path, capsys, seeds, fake_trainer):
    with pytest.raises(SystemExit) as exit_info:
        study.main(study_args(tmp_path, "--seeds", *seeds))
    assert exit_info.value.code == 2
    assert "give distinct seeds >= 0" in capsys.readouterr().err
    assert fake_trainer == []
