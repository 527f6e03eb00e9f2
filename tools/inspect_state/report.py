"""What `python -m packed_adamw.inspect` prints: per tensor, the moments against the window of
their format; the biases the file's moments suggest; one element's step."""
from __future__ import annotations

import math

import numpy as np

from packed_adamw.core.authority import f32_bits
from packed_adamw.core.format_health import (
    WINDOW_CLASSES,
    log2_quantiles,
    suggest_biases,
    window_edges,
    window_histogram,
)
from packed_adamw.core.codecs import MiniFloat
from packed_adamw.core.adamw.state_format import first_moment_format, rms_format

from .files import StateFile, TensorState

LOG2_LEVELS = (0.0, 0.01, 0.5, 0.99, 1.0)


def windows(state_file: StateFile, m_bias: int, rms_bias: int) -> tuple[MiniFloat, MiniFloat, bool]:
    """(first-moment format, RMS format, stored): the formats the moments are held in, or, for
    float32 moments, the packed formats at the given biases that they would be encoded into."""
    formats = state_file.state_format.formats
    if formats is not None:
        return formats[0], formats[1], True
    return first_moment_format(m_bias), rms_format(rms_bias), False


def tensor_report(state_file: StateFile, tensor: TensorState, m_fmt: MiniFloat, r_fmt: MiniFloat) -> dict:
    m, rms = state_file.values(tensor)
    return {"name": tensor.name, "index": tensor.index, "key": tensor.key, "shape": list(tensor.shape),
            "elements": tensor.size, "step": tensor.step, "group": tensor.group,
            "m": {**window_histogram(m, m_fmt).as_dict(), "log2_quantiles": log2_quantiles(m, LOG2_LEVELS)},
            "rms": {**window_histogram(rms, r_fmt).as_dict(), "log2_quantiles": log2_quantiles(rms, LOG2_LEVELS)}}


def file_report(state_file: StateFile, tensors: list[TensorState], *, m_bias: int, rms_bias: int, low: float,
                high: float, headroom: float) -> dict:
    m_fmt, r_fmt, stored = windows(state_file, m_bias, rms_bias)
    values = [state_file.values(t) for t in tensors]
    m_all, rms_all = [v[0] for v in values], [v[1] for v in values]
    report = {
        "path": str(state_file.path), "kind": state_file.kind, "identity": state_file.identity,
        "trainer_step": state_file.trainer_step, "stored": stored,
        "windows": {"m": {"format": m_fmt.identity, "max_value": m_fmt.max_value, "min_normal": m_fmt.min_normal,
                          "min_subnormal": m_fmt.min_subnormal, **window_edges(m_fmt)},
                    "rms": {"format": r_fmt.identity, "max_value": r_fmt.max_value, "min_normal": r_fmt.min_normal,
                            "min_subnormal": r_fmt.min_subnormal, **window_edges(r_fmt)}},
        "tensors": [tensor_report(state_file, t, m_fmt, r_fmt) for t in tensors],
        "total": {"elements": sum(t.size for t in tensors),
                  "m": window_histogram(np.concatenate([x.ravel() for x in m_all]) if m_all else [], m_fmt).as_dict(),
                  "rms": window_histogram(np.concatenate([x.ravel() for x in rms_all]) if rms_all else [],
                                          r_fmt).as_dict()},
        "groups": state_file.groups,
    }
    if tensors:
        suggestion = {"all": suggest_biases(m_all, rms_all, low=low, high=high, headroom=headroom).as_dict()}
        by_group = {}
        for t, (m, rms) in zip(tensors, values):
            if t.group is not None:
                pair = by_group.setdefault(f"param group {t.group}", ([], []))
                pair[0].append(m)
                pair[1].append(rms)
        if len(by_group) > 1:
            for name, s in suggest_biases(by_group, low=low, high=high, headroom=headroom).items():
                suggestion[name] = s.as_dict()
        report["suggestion"] = {"low": low, "high": high, "headroom": headroom, "censored": stored, **suggestion}
    return report


# ---- text -----------------------------------------------------------------------------------


def _classes_line(h: dict) -> str:
    parts = []
    for name in WINDOW_CLASSES:
        count = h["counts"][name]
        if name == "nan" and not count:
            continue
        parts.append(f"{name} {count:,} ({100 * h['fractions'][name]:.3g}%)")
    return "  ".join(parts)


def _quantile_line(q: dict | None) -> str:
    if q is None:
        return "all zero"
    labels = {"0.0": "min", "0.01": "1%", "0.5": "50%", "0.99": "99%", "1.0": "max"}
    return "log2|x| " + "  ".join(f"{labels.get(k, k)} {v:.2f}" for k, v in q.items())


def format_report(report: dict) -> str:
    w = report["windows"]
    lines = [f"{report['path']}: {report['kind']}"
             + (f" at trainer step {report['trainer_step']}" if report["trainer_step"] is not None else ""),
             f"format {report['identity']}"]
    how = "stored in" if report["stored"] else "float32 moments; counted as they would be stored in"
    for label, key in (("|m|", "m"), ("RMS", "rms")):
        x = w[key]
        lines.append(f"  {label} {how} {x['format']}: max {x['max_value']!r} (2^{x['log2_max_value']:.4g}), "
                     f"min normal 2^{x['log2_min_normal']:.0f}, min subnormal 2^{x['log2_min_subnormal']:.0f}")
    if report["stored"]:
        lines.append("  (stored codes: a value that flushed reads as zero, one that saturated as the maximum)")
    for t in report["tensors"]:
        lines.append("")
        group = f"  group {t['group']}" if t["group"] is not None else ""
        lines.append(f"{t['name']}  {tuple(t['shape'])}  {t['elements']:,} elements  step {t['step']}{group}")
        for label, key in (("|m|", "m"), ("RMS", "rms")):
            lines.append(f"  {label:<4} {_classes_line(t[key])}")
            lines.append(f"       {_quantile_line(t[key]['log2_quantiles'])}")
    total = report["total"]
    lines += ["", f"all {len(report['tensors'])} tensors, {total['elements']:,} elements"]
    for label, key in (("|m|", "m"), ("RMS", "rms")):
        lines.append(f"  {label:<4} {_classes_line(total[key])}")
    s = report.get("suggestion")
    if s:
        lines += ["", f"suggested biases (quantiles {s['low']:g} and {s['high']:g} of nonzero magnitudes, "
                      f"headroom {s['headroom']:g}x)"]
        if s["censored"]:
            lines.append("  from stored values, which the format has already clamped and flushed: "
                         "collect float32 moments (mode fp32) to decide")
        for name, choice in s.items():
            if not isinstance(choice, dict):
                continue
            lines.append(f"  {name}: m_bias={choice['m_bias']} rms_bias={choice['rms_bias']}  ({choice['identity']})")
            for label, key in (("m", "m"), ("rms", "rms")):
                c = choice[key]
                sample = c["sample"]
                at = (f"; sample at this bias: saturated {sample['fractions']['saturated']:.3g}, subnormal "
                      f"{sample['fractions']['subnormal']:.3g}, flushed {sample['fractions']['flushed']:.3g}"
                      if sample else "")
                lines.append(f"    {label}: {c['reason']}{at}")
            for note in choice["notes"]:
                lines.append(f"    note: {note}")
    return "\n".join(lines)


# ---- the plot -------------------------------------------------------------------------------


def plot_report(state_file: StateFile, tensors: list[TensorState], report: dict, out_path) -> None:
    """Histograms of log2|m| and log2 RMS over `tensors`, the format's window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [state_file.values(t) for t in tensors]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label, column in ((axes[0], "m", "|m|", 0), (axes[1], "rms", "RMS", 1)):
        flat = np.concatenate([v[column].ravel() for v in values]) if values else np.zeros(0, np.float32)
        magnitude = np.abs(flat.astype(np.float64))
        nonzero = magnitude[(magnitude > 0) & np.isfinite(magnitude)]
        w = report["windows"][key]
        lo_edge, sub_edge, hi_edge = w["log2_min_subnormal"], w["log2_min_normal"], w["log2_max_value"]
        logs = np.log2(nonzero) if nonzero.size else np.zeros(0)
        left = math.floor(min(logs.min() if logs.size else lo_edge, lo_edge - 1)) - 1
        right = math.ceil(max(logs.max() if logs.size else hi_edge, hi_edge)) + 1
        h = report["total"][key]
        share = {name: f"{100 * h['fractions'][name]:.3g}%" for name in WINDOW_CLASSES}
        ax.axvspan(left, lo_edge - 1, color="tab:gray", alpha=0.25, label=f"flushed to 0: {share['flushed']}")
        ax.axvspan(lo_edge - 1, sub_edge, color="tab:orange", alpha=0.2, label=f"subnormal: {share['subnormal']}")
        ax.axvspan(hi_edge, right, color="tab:red", alpha=0.2, label=f"saturated: {share['saturated']}")
        for x in (lo_edge, sub_edge, hi_edge):
            ax.axvline(x, color="black", lw=0.8, ls="--")
        if logs.size:
            ax.hist(logs, bins=np.arange(left, right + 0.25, 0.25), color="tab:blue",
                    label=f"{label}, nonzero (normal: {share['normal']})")
        ax.set(xlim=(left, right), xlabel=f"log2 {label}", ylabel="elements",
               title=f"{label} in {w['format']}" + ("" if report["stored"] else " (if stored)")
               + f": {h['counts']['zero']:,} zero of {h['total']:,}")
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{report['path']} ({report['identity']}), {len(tensors)} tensors", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


# ---- one element ----------------------------------------------------------------------------


def _value(x) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x} (0x{x:X})"
    return f"{str(np.float32(x))}  [0x{f32_bits(x):08X}]"


def format_walk(walk_dict: dict, header: list[str]) -> str:
    lines = list(header)
    for key, title in (("m", "first moment"), ("rms", "RMS")):
        f = walk_dict["fields"].get(key)
        if f:
            sign = f"sign {f['sign']}, " if f["sign"] is not None else ""
            lines.append(f"  {title:<12} code {f['hex']} ({f['format']}): {sign}exponent {f['exponent']}, "
                         f"fraction {f['fraction']} -> {f['kind']}: {f['formula']} = {_value(f['value'])}")
    sections = (("inputs (float32)", "inputs"), ("step scalars (FORMAT.md, Step scalars)", "scalars"),
                ("the element, in FORMAT.md's order", "lines"))
    for title, key in sections:
        lines.append(title)
        width = max(len(x["name"]) for x in walk_dict[key])
        for x in walk_dict[key]:
            note = f"   # {x['note']}" if x["note"] else ""
            lines.append(f"  {x['name']:<{width}} = {x['expr']:<44} {_value(x['value'])}{note}")
    lines.append("result")
    if "word" in walk_dict:
        for key, title in (("m_next", "first moment"), ("rms_next", "RMS")):
            f = walk_dict["fields"][key]
            lines.append(f"  stored {title:<12} code {f['hex']} -> {f['kind']} {_value(f['value'])}")
        lines.append(f"  word {walk_dict['word']} -> {walk_dict['word_next']}")
    else:
        lines.append(f"  stored m {_value(walk_dict['m_next_stored'])}, v {_value(walk_dict['v_next_stored'])}")
    lines.append(f"  update u = {_value(walk_dict['update'])}")
    lines.append(f"  parameter {_value(walk_dict['p'])} -> {_value(walk_dict['p_next'])}"
                 + ("" if walk_dict["accepted"] else "   (rejected: unchanged)"))
    return "\n".join(lines)

