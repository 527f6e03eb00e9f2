"""benchmarks/d12_stack.py: a tiny run of the packed and reference stacks writes both rows, with
the bytes each stack's tensors must take; on CUDA also its peak memory (marked cuda)."""
from __future__ import annotations

import json

import pytest
import torch

from script_helpers import BENCHMARKS, import_script

TINY = ["--preset", "d4", "--vocab", "256", "--context", "64", "--d-model", "64", "--n-layers", "2",
        "--batch", "1", "--warmup", "1", "--steps", "2", "--lr-warmup", "1"]


@pytest.fixture(scope="module")
def bench():
    return import_script(BENCHMARKS / "d12_stack.py", "d12_stack_under_test")


def run(bench, tmp_path, device, stacks, extra=()):
    out, raw = tmp_path / "d12.md", tmp_path / "d12.json"
    assert bench.main(TINY + ["--device", device, "--stacks", *stacks, "--out", str(out), "--json", str(raw),
                              *extra]) == 0
    return out.read_text(), json.loads(raw.read_text())


def check_rows(table: str, measured: dict, stacks) -> None:
    for name in stacks:
        assert sum(line.startswith(f"| {name} |") for line in table.splitlines()) == 1, table
    packed, reference = measured["stacks"]["packed"], measured["stacks"]["reference"]
    n = packed["parameters"]
    assert reference["parameters"] == n
    # bf16 live weights and gradients against FP32 ones, measured from the tensors
    assert (packed["parameter_bytes"], packed["gradient_bytes"]) == (2 * n, 2 * n)
    assert (reference["parameter_bytes"], reference["gradient_bytes"]) == (4 * n, 4 * n)
    # the packed state (2-byte momentum, 4-byte AdamW moments, 2-byte low halves) is the smaller
    assert packed["training_state_bytes"] < reference["training_state_bytes"]
    assert measured["comparison"]["packed"]["smaller_state"]
    for r in (packed, reference):
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and len(r["losses"]) == 3
        assert r["tokens_per_s"] > 0 and r["optimizer_ms_median"] > 0


def test_a_tiny_cpu_run_writes_both_stacks(bench, tmp_path):
    """In two alternating rounds: a stack's row is its round of median tokens/s (the lower of two),
    and the ratio is given round by round as well."""
    table, measured = run(bench, tmp_path, "cpu", ["packed", "reference"], ["--rounds", "2"])
    check_rows(table, measured, ["packed", "reference"])
    stacks, compared = measured["stacks"], measured["comparison"]["packed"]
    for r in stacks.values():
        assert len(r["tokens_per_s_by_round"]) == 2 and r["tokens_per_s"] == min(r["tokens_per_s_by_round"])
    by_round = [p / q for p, q in zip(stacks["packed"]["tokens_per_s_by_round"],
                                      stacks["reference"]["tokens_per_s_by_round"])]
    assert compared["tokens_per_s_ratio_by_round"] == by_round
    assert "in 2 alternating rounds" in table and f"round by round {by_round[0]:.3f}x, {by_round[1]:.3f}x" in table
    # the same FP32 initialisation and batches: the first losses differ only by bf16 rounding
    first = [measured["stacks"][name]["first_loss"] for name in ("packed", "reference")]
    assert abs(first[0] - first[1]) < 0.05, first
    assert "peak_memory_bytes" not in measured["stacks"]["packed"]  # measured on CUDA only


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="do not make a model"):
        bench.main(["--preset", "d4", "--device", "cpu", "--d-model", "63"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_tiny_cuda_run_measures_peak_memory_of_every_stack(bench, tmp_path):
    stacks = list(bench.STACKS)
    table, measured = run(bench, tmp_path, "cuda", stacks)
    check_rows(table, measured, stacks)
    for r in measured["stacks"].values():
        assert r["peak_memory_bytes"] >= r["training_state_bytes"]


def test_fidelity_table_pairs_each_seed_with_the_reference():
    """benchmarks/d12_fidelity.py's table (issue 53's columns): the paired difference is the mean
    of per-seed differences, 'within' compares packed's mean with the reference's seed range, and
    runs of other trainer flags stay out of it."""
    fidelity = import_script(BENCHMARKS / "d12_fidelity.py", "d12_fidelity_under_test")
    flags = ["--preset", "d12"]

    def run(stack, seed, bpb, run_flags=flags, code="abc1234"):
        return {"stack": stack, "seed": seed, "flags": run_flags, "val_bpb": {"100": bpb + 0.5, "300": bpb},
                "tokens_per_s": 1000.0, "peak_memory_bytes": 2**30, "optimizer_state_bytes_per_parameter": 7.4,
                "code": code}

    record = {"runs": [run("reference", 0, 1.27), run("reference", 1, 1.26), run("reference", 2, 1.28),
                       run("packed", 0, 1.275), run("packed", 1, 1.27), run("packed", 2, 1.28),
                       run("packed", 3, 9.0, ["--preset", "d4"]), run("packed", 4, 9.0, code="old0000")]}
    text = fidelity.table(record, flags, {"abc1234"})
    packed = next(line for line in text.splitlines() if line.startswith("| packed"))
    cells = [c.strip() for c in packed.split("|")[1:-1]]
    assert cells[1] == "0,1,2" and cells[2] == "1.2750"           # seed 3 ran other flags, seed 4 other code
    assert cells[5].startswith("+0.0050 (seeds 0,1,2")          # (0.005 + 0.01 + 0) / 3
    assert cells[6] == "0.0200" and cells[7] == "yes"
    record["runs"][3]["val_bpb"]["300"] = 1.40
    packed = next(line for line in fidelity.table(record, flags, {"abc1234"}).splitlines() if line.startswith("| packed"))
    assert [c.strip() for c in packed.split("|")[1:-1]][7] == "no"
    reused = next(line for line in fidelity.table(record, flags, {"abc1234", "old0000"}).splitlines()
                  if line.startswith("| packed"))
    assert [c.strip() for c in reused.split("|")[1:-1]][1] == "0,1,2,4"  # --reuse names the earlier code


def test_a_compiled_cpu_run_compiles_once_and_reports_flops_but_no_mfu(bench, tmp_path):
    """--compile aot_eager on batches of different document counts (documents of 4 tokens on
    average): each stack compiles in its first step and never again, its losses are the eager
    run's bit for bit (AOT autograd's graphs run eagerly), and the JSON and table give nanochat's
    FLOPs per token with MFU null on the CPU (no peak is known for it)."""
    import dataclasses

    from packed_adamw.torch.gpt.chat_model import PRESETS, ChatGPT
    from packed_adamw.torch.gpt.telemetry import chat_flops_per_token

    def run_with(out, extra):
        out.mkdir()
        assert bench.main(TINY + ["--device", "cpu", "--stacks", "packed", "reference", "--out", str(out / "d12.md"),
                                  "--json", str(out / "d12.json"), *extra]) == 0
        return (out / "d12.md").read_text(), json.loads((out / "d12.json").read_text())

    short_documents = ["--mean-document", "4"]
    batches = bench.synthetic_batches(3, 1, 64, 256, 0, 4.0, 1.1)
    assert len({batch.cu_seqlens.numel() for batch in batches}) == 3
    _, eager = run_with(tmp_path / "eager", short_documents)
    table, compiled = run_with(tmp_path / "compiled", short_documents + ["--compile", "aot_eager"])
    assert compiled["meta"]["compile"] == "aot_eager" and eager["meta"]["compile"] is None
    for name in ("packed", "reference"):
        r = compiled["stacks"][name]
        assert r["compiled_graphs"] == r["compiled_graphs_after_first_step"] > 0, name
        assert r["losses"] == eager["stacks"][name]["losses"], name
        assert r["mfu"] is None and eager["stacks"][name]["compiled_graphs"] is None
    with torch.device("meta"):
        model = ChatGPT(dataclasses.replace(PRESETS["d4"], vocab_size=256, context=64, d_model=64, n_layers=2))
    assert compiled["meta"]["flops_per_token"] == chat_flops_per_token(model, 64) > 0
    assert compiled["meta"]["peak_flops_per_s"] is None
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| stack |"))
    column = [c.strip() for c in header.split("|")].index("MFU")
    for name in ("packed", "reference"):
        row = next(line for line in lines if line.startswith(f"| {name} |"))
        assert [c.strip() for c in row.split("|")][column] == "-", row


def test_profile_splits_each_stacks_time_by_part(bench, tmp_path):
    out, raw = tmp_path / "d12.md", tmp_path / "d12.json"
    assert bench.main(TINY + ["--device", "cpu", "--stacks", "packed", "--profile", "1", "--out", str(out),
                              "--json", str(raw)]) == 0
    prof = json.loads(raw.read_text())["stacks"]["packed"]["profile"]
    assert prof["steps"] == 1 and prof["wall_ms_per_step"] > 0
    # on the CPU the ops' own time: the model's matmuls are its largest part
    assert max(prof["device_ms_per_step"], key=prof["device_ms_per_step"].get) == "gemm", prof
    assert abs(sum(prof["device_ms_per_step"].values()) - prof["busy_ms_per_step"]) < 1e-6
    assert "- packed, profiled (1 steps" in out.read_text()
    # every optimizer kernel listed, whatever its rank: their sum is the optimizer part
    optimizer = prof["optimizer_kernels"]
    assert abs(sum(k["ms_per_step"] for k in optimizer) - prof["device_ms_per_step"].get("optimizer", 0.0)) < 1e-6
    assert (optimizer != []) == ("The optimizer part, every kernel:" in out.read_text())
    assert bench.kernel_part("ns_gemm_kernel") == "optimizer"
    assert bench.kernel_part("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert bench.kernel_part("flash_fwd_kernel") == "attention"


def test_profile_of_more_steps_than_the_run_took_cycles_its_batches(bench, tmp_path):
    """--profile past the timed steps' batches (one here) steps the run's batches again, last first,
    rather than indexing past them after every stack's timed run."""
    raw = tmp_path / "d12.json"
    args = list(TINY)
    args[args.index("--warmup") + 1], args[args.index("--steps") + 1] = "0", "1"
    assert bench.main(args + ["--device", "cpu", "--stacks", "packed", "--profile", "3", "--json", str(raw)]) == 0
    prof = json.loads(raw.read_text())["stacks"]["packed"]["profile"]
    assert prof["steps"] == 3 and prof["wall_ms_per_step"] > 0
