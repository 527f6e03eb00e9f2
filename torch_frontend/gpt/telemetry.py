"""What a run reports: log.jsonl's records, the moments' statistics and format counts, loss
events, step times, model FLOPs utilisation, and the plots drawn from the log (docs/TRAINING.md)."""
from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from packed_adamw.core import first_moment_format, rms_format
from packed_adamw.core.atomic_file import atomic_write
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

from .._engine import REFUSED_STAT
from ..optimizer import PackedAdamW
from .config import TrainConfig
from .distributed import Ranks, full


def moment_stats(model: torch.nn.Module, optimizer: PackedAdamW, step: int, biases: list[int],
                 parameter_kind: Callable[[str], str]) -> dict:
    """Per kind of tensor: how much of |m| and sqrt(v) the packed formats would saturate or flush."""
    by_kind = collections.defaultdict(list)
    for name, p in model.named_parameters():
        by_kind[parameter_kind(name)].append(full(optimizer.state[p]["moments"]).reshape(2, -1).cpu().numpy())
    record = {"step": step, "kinds": {}}
    quantile_levels = [0.01, 0.1, 0.5, 0.9, 0.99]
    for kind, moments in sorted(by_kind.items()):
        m, v = np.concatenate(moments, axis=1).astype(np.float64)
        abs_m, rms = np.abs(m), np.sqrt(v)
        stats = {"elements": int(m.size)}
        for label, values in (("m", abs_m), ("rms", rms)):
            nonzero = values[values > 0]
            quantiles = np.quantile(np.log2(nonzero), quantile_levels).tolist() if nonzero.size else None
            stats[f"log2_{label}_quantiles"] = dict(zip(map(str, quantile_levels), quantiles)) if quantiles else None
        for bias in biases:
            for label, values, fmt in (("m", abs_m, first_moment_format(bias)), ("rms", rms, rms_format(bias))):
                stats[f"{label}_bias{bias}"] = {
                    "saturate": float(np.mean(values > fmt.max_value)),
                    "subnormal": float(np.mean((values > 0) & (values < fmt.min_normal))),
                    # round-to-nearest-even sends values up to half the smallest subnormal to zero
                    "flush_to_zero": float(np.mean((values > 0) & (values <= fmt.min_subnormal / 2))),
                }
        record["kinds"][kind] = stats
    return record


FORMAT_RECORD = "format"  # the "record" entry of log.jsonl's format-count lines (--track-format)


def is_log_step(step: int, config: TrainConfig) -> bool:
    """Whether the trainer logs step `step` (counted from 1): every log_every-th, and the first."""
    return step % config.log_every == 0 or step == 1


def format_record(optimizer, kinds: list[str], count_names: tuple[str, ...], first_step: int, step: int,
                  ranks: Ranks, device: torch.device, parameter_kind: Callable[[str], str]) -> dict:
    """Per kind of tensor, the share of the element-steps of steps first_step..step whose new
    stored code (AdamW's first moment or RMS, Muon's momentum) saturated, flushed to zero or
    landed subnormal (FORMAT.md, "Format counts"; MUON.md), with the counts behind each share.

    `format_stats()` returns the counts since its previous call and the element-steps they
    cover (elements x steps counted), so a share is count / element_steps of this interval, over
    the elements of the kind's parameters that count it: None where none does (a Muon code's
    count of a kind that only AdamW steps). `count_names` are what the optimizer counts
    (its `format_count_names`); a count of refused matrices (`REFUSED_STAT`) is logged as a
    count alone. Under FSDP2 each rank counts its own shard, so every rank calls this and the
    counts are summed over the ranks; DDP ranks step whole tensors with the same reduced
    gradients, so each rank's counts already are the whole tensors'.
    """
    n = len(count_names)
    row = {kind: index for index, kind in enumerate(kinds)}
    # per kind: element_steps, then each count, then the element-steps of the parameters that count it
    totals = torch.zeros((len(kinds), 1 + 2 * n), dtype=torch.int64)
    for name, entry in optimizer.format_stats().items():
        counted = [k in entry for k in count_names]
        totals[row[parameter_kind(name)]] += torch.tensor(
            [entry["elements"], *(entry.get(k, 0) for k in count_names),
             *(entry["elements"] if c else 0 for c in counted)])
    if ranks.parallel == "fsdp":
        totals = totals.to(device)  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(totals)
    record = {"record": FORMAT_RECORD, "step": step, "first_step": first_step, "kinds": {}}
    for kind, values in zip(kinds, totals.tolist()):
        element_steps, counts, over = values[0], dict(zip(count_names, values[1:1 + n])), values[1 + n:]
        shares = {k: counts[k] / m if m else None for k, m in zip(count_names, over) if k != REFUSED_STAT}
        record["kinds"][kind] = {"element_steps": element_steps, **shares, "counts": counts}
    return record


def run_record(line: str) -> dict | None:
    """The record a line of a run's JSON-lines log holds: a JSON object with an integer "step",
    as the trainers write them; None for any other line (one a crash cut short, or one no run
    wrote). The one parser of the run's logs (run_directory.log_records, keep_records_up_to)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def log_records(log_path: Path, record: str | None = None) -> list[dict]:
    """The records of log.jsonl of one kind: None for the step lines (loss, val_bpb, ...),
    FORMAT_RECORD for the format counts."""
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return [r for r in map(run_record, lines) if r is not None and r.get("record") == record]


def format_panels(records: list[dict]) -> list[list[tuple[str, str]]]:
    """The format plot's panels, (count, unit) in rows of events (saturated, flushed, subnormal)
    and columns of codes, from every count any record names (AdamW's where none does); one panel
    of Muon's refused matrix-steps where the records count nothing else."""
    names = list(dict.fromkeys(k for r in records for entry in r["kinds"].values() for k in entry["counts"]))
    shares = [k for k in names if k != REFUSED_STAT] if names else list(FORMAT_COUNTS)
    if not shares:
        return [[(REFUSED_STAT, "refused matrix-steps")]]
    codes = list(dict.fromkeys(k.split("_", 1)[1] for k in shares))
    return [[(f"{event}_{code}", "share of element-steps") for code in codes]
            for event in dict.fromkeys(k.split("_", 1)[0] for k in shares)]


def plot_format_log(log_path: Path, png_path: Path) -> None:
    """One panel per format count (rows: saturated, flushed, subnormal; columns: the codes in the
    order the log names them: AdamW's m and RMS, Muon's mu), one line per kind of tensor, shares on
    a log axis (a share of 0 or null leaves a gap). Each point is the share over the interval
    ending at its step. A log whose records count only Muon's refused matrices (no codes: Muon's
    bf16 or fp32 momenta beside fp32 AdamW moments) gets one panel of those counts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = log_records(log_path, FORMAT_RECORD)
    kinds = sorted({kind for r in records for kind in r["kinds"]})
    panels = format_panels(records)
    fig, axes = plt.subplots(len(panels), len(panels[0]), figsize=(5 * len(panels[0]), 3.3 * len(panels) + 0.5),
                             sharex=True, squeeze=False)
    for (count, unit), ax in zip((panel for row in panels for panel in row), axes.flat):
        values = {kind: [(r["step"], r["kinds"][kind].get(count) if count != REFUSED_STAT else
                          r["kinds"][kind]["counts"].get(count)) for r in records if kind in r["kinds"]]
                  for kind in kinds}
        counted = any(v is not None for points in values.values() for _, v in points)
        positive = any(v for points in values.values() for _, v in points)
        for kind, points in values.items():
            ax.plot([s for s, _ in points], [v if v else math.nan for _, v in points], marker=".", label=kind)
        if positive and count != REFUSED_STAT:
            ax.set_yscale("log")
        elif not positive:
            ax.text(0.5, 0.5, "none in this run" if counted else "not counted", transform=ax.transAxes,
                    ha="center", va="center", color="gray")
            ax.set_yticks([])
        ax.set(title=count, ylabel=unit)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(kinds) or 1)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_log(log_path: Path, png_path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = log_records(log_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_bpb"]) for r in records if r.get("val_bpb") is not None]
    fig, (ax_loss, ax_bpb) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax_loss.plot(*zip(*train))
    ax_loss.set(xlabel="step", ylabel="training loss (nats/token)", title="training loss")
    if val:
        ax_bpb.plot(*zip(*val), marker="o")
    ax_bpb.set(xlabel="step", ylabel="bits per byte", title="validation bpb")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def keep_records_up_to(path: Path, step: int) -> None:
    """Drop JSONL records after `step` and any line that is not a record (`run_record`: one a
    crash cut short). The file is replaced atomically: a write that fails (a full disk) leaves
    the log as it was."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        record = run_record(line)
        if record is not None and record["step"] <= step:
            kept.append(line + "\n")
    atomic_write(path, "".join(kept).encode())


LOSS_SPIKE = 1.5  # a training loss above 1.5 x the lowest one so far, after warmup, is a spike
LOSS_EVENTS_KEPT = 100


def loss_event(step: int, loss: float, grad_norm: float, lowest_loss: float, config: TrainConfig) -> dict | None:
    """A record for the summary's loss_events when step `step` went wrong: a non-finite loss or
    gradient norm (any step), or after warmup a loss above LOSS_SPIKE x the lowest of the steps
    before it in this session (the schedule's warmup steps are left out: the loss falls fast there)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return {"step": step, "event": "non-finite", "loss": loss, "grad_norm": grad_norm}
    if step > config.warmup_steps and loss > LOSS_SPIKE * lowest_loss:
        return {"step": step, "event": "spike", "loss": loss, "lowest_loss": lowest_loss}
    return None


class LossWatch:
    """The session's training losses: the last 50 for the summary, and the loss events."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.recent = collections.deque(maxlen=50)
        self.lowest, self.events = math.inf, []  # see LOSS_SPIKE

    @property
    def last(self) -> float:
        return self.recent[-1]

    def observe(self, step: int, loss: float, grad_norm: float) -> None:
        self.recent.append(loss)
        event = loss_event(step, loss, grad_norm, self.lowest, self.config)
        if event:
            self.events.append(event)
        if math.isfinite(loss):
            self.lowest = min(self.lowest, loss)

    def recent_mean(self) -> float | None:
        return statistics.fmean(self.recent) if self.recent else None

    def summary(self) -> dict:
        # this session's steps only (the lowest loss is not checkpointed); the first LOSS_EVENTS_KEPT
        return {"loss_events": self.events[:LOSS_EVENTS_KEPT], "loss_event_count": len(self.events)}


class StepTimes:
    """Wall-clock times of the session's steps: forward and backward, optimizer, whole step."""

    def __init__(self):
        self.fwd_bwd, self.optimizer, self.step = [], [], []

    def add(self, start: float, after_backward: float, end: float) -> None:
        self.fwd_bwd.append(after_backward - start)
        self.optimizer.append(end - after_backward)
        self.step.append(end - start)

    def summary(self, tokens_per_step: int) -> dict:
        steps = self.step
        # Medians skip the first steps' warm-up cost.
        steady = slice(min(5, len(steps) - 1), None) if steps else slice(None)
        median_ms = lambda times: 1e3 * statistics.median(times[steady]) if times else None  # noqa: E731
        return {
            "tokens_per_s": tokens_per_step * len(steps) / sum(steps) if steps else None,
            # the same without the first steps (compilation, autotuning, allocator warm-up)
            "steady_tokens_per_s": tokens_per_step * len(steps[steady]) / sum(steps[steady]) if steps else None,
            "median_fwd_bwd_ms": median_ms(self.fwd_bwd),
            "median_optimizer_ms": median_ms(self.optimizer),
        }


# ---- model FLOPs utilisation (chat_train, benchmarks/d12_stack.py; docs/D12.md) -------------------
# Dense bf16 tensor-core peaks in FLOP/s, by torch.cuda.get_device_name: the names the project's
# GPUs report (docs/results). Other GPUs (the H100 PCIe and NVL, the H200 NVL have lower peaks)
# and the CPU report no MFU rather than a number of another device.
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H200": 989e12,  # H200 SXM
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` (FLOP/s) from PEAK_BF16_FLOPS, or None where it is not known."""
    if device.type != "cuda":
        return None
    return PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device))


def chat_flops_per_token(model: torch.nn.Module, context: int) -> int:
    """Training FLOPs per token of a chat-family model on rows of `context` tokens, nanochat's
    estimate (gpt.py's estimate_flops): 6 x the weights that multiply the token stream (every
    nn.Linear: the blocks' matrices, the value and smear gates, the head; not the token and value
    embeddings, which are looked up, nor the scalars) + 12 x heads x head_dim x the attention span
    of each layer: the row for a long layer, min(window, context) for a short-window one. As in
    nanochat (and PaLM's count) every query is counted at the full span, not the causal average,
    and document boundaries inside a packed row are not subtracted: a convention, so that MFU
    compares with nanochat's."""
    config = model.config
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    spans = sum(context if window is None else min(window, context) for window in config.layer_windows())
    return 6 * matmul_weights + 12 * config.n_heads * config.head_dim * spans


def model_flops_utilization(tokens_per_s: float | None, flops_per_token: int, peak_flops: float | None,
                            devices: int = 1) -> float | None:
    """tokens/s x FLOPs per token / (peak x devices): the share of the devices' peak the model's
    FLOPs use; None where the peak (or the rate) is not known."""
    if peak_flops is None or tokens_per_s is None:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * devices)


class RunLog:
    """log.jsonl, opened for appending on rank 0 (the other ranks' records are dropped)."""

    def __init__(self, path: Path, ranks: Ranks):
        self.path, self.main = path, ranks.main
        self.file = None

    def __enter__(self) -> "RunLog":
        if self.main:
            self.file = self.path.open("a")
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()

    def write(self, record: dict) -> None:
        if self.main:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def append_to(self, path: Path, record: dict) -> None:
        """A record in another JSONL file of the run (moment_stats.jsonl)."""
        if self.main:
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class FormatCounts:
    """--track-format's records in log.jsonl, written on every rank's call (FSDP2 sums the
    shards' counts): `optimizer` None for a run that counts nothing. A record covers the steps
    since the previous one; with `logged_only` only the steps `logs` names are counted, and a
    record covers its own step."""

    def __init__(self, optimizer, kinds: list[str], first_step: int, ranks: Ranks, device: torch.device,
                 parameter_kind: Callable[[str], str], *, logs: Callable[[int], bool], logged_only: bool = False):
        self.optimizer, self.kinds, self.logs, self.logged_only = optimizer, kinds, logs, logged_only
        self.count_names = () if optimizer is None else optimizer.format_count_names
        self.ranks, self.device, self.parameter_kind = ranks, device, parameter_kind
        self.first_step = first_step  # the first step the next record covers

    def before_step(self, step: int) -> None:
        """Count the coming step (step + 1) or not: logged_only counts only the steps it logs."""
        if self.optimizer is not None and self.logged_only:
            self.optimizer.track_format = self.logs(step + 1)  # the others run uncounted

    def after_step(self, step: int, log: RunLog) -> None:
        if self.optimizer is not None and self.logs(step):
            self._write(step, log)

    def finish(self, step: int, log: RunLog) -> None:
        """The steps since the last record, at the end of a session that counts every step."""
        if self.optimizer is not None and not self.logged_only and self.first_step <= step:
            self._write(step, log)

    def _write(self, step: int, log: RunLog) -> None:
        first = step if self.logged_only else self.first_step  # logged_only: its step alone counted
        log.write(format_record(self.optimizer, self.kinds, self.count_names, first, step, self.ranks, self.device,
                                self.parameter_kind))
        self.first_step = step + 1
