"""What `python -m packed_adamw.inspect` prints: per rule's format, each tensor's codes against
the window of their format; the biases the file's values suggest; one element's step.

A format scaled per matrix (Muon's packed mode) keeps each matrix's codes relative to its
exponent s: the window classifies the codes' own values (m x 2^-s; the exponents the packed
step would choose, for values kept wider), the quantiles are of the values themselves (codes x
2^s), each tensor's exponents are shown, and no bias is suggested (every one stores the same
codes). A state saved before the exponents (its legacy identity) stored its codes in the code's
fixed window (s = 0): its section says so (`saved_without_exponents`), as it counts saturation."""
from __future__ import annotations

import math

import numpy as np

from packed_adamw.core.authority import f32_bits
from packed_adamw.core.format_health import (
    WINDOW_CLASSES,
    chosen_exponents,
    finite_elements,
    log2_quantiles,
    nonfinite_counts,
    scaled_per_matrix,
    suggest_state_biases,
    window_edges,
    window_histogram,
)
from packed_adamw.core.rules import rule_formats

from .files import TORCH_OPTIMIZERS, StateFile, TensorState

LOG2_LEVELS = (0.0, 0.01, 0.5, 0.99, 1.0)
# A report of one format has its section's keys at the top level too (the 1.x report's layout).
SECTION_KEYS = ("rule", "codes", "stored", "windows", "tensors", "total", "suggestion")


def packed_layout(fmt, biases: dict[str, int]):
    """The packed state format a state's codes are held in (its own), or, for values kept wider
    (float32 modes, Muon's bf16 momenta), the one they would be encoded into at `biases` (by
    bias option; a code not named keeps its default)."""
    if fmt.formats is not None:
        return fmt
    entry = rule_formats(fmt)
    return entry.packed(**{c.bias_option: biases[c.bias_option] for c in entry.rule.codes if c.bias_option in biases})


def windows(fmt, biases: dict[str, int]) -> tuple[tuple, bool]:
    """(each code's format, stored): the formats of `packed_layout`, and whether the state holds
    those codes."""
    return packed_layout(fmt, biases).formats, fmt.formats is not None


def exponents_report(tensor: TensorState, packed, values: tuple) -> dict | None:
    """A tensor's per-matrix exponents, where its rule's packed format scales each matrix: the
    stored ones (none in a state saved before them: 0), or those the packed step would choose
    for values kept wider; None for other rules."""
    if not scaled_per_matrix(packed):
        return None
    if tensor.fmt.formats is None:
        exponents, how = chosen_exponents(values[0], packed), f"as the packed step would choose ({packed.identity})"
    elif tensor.exponent is None:
        exponents = np.zeros(tensor.shape[:-2], np.int32)
        how = "none saved (a state written before the exponents): its codes read with 0"
    else:
        exponents, how = tensor.exponent, f"stored ({packed.exponent_entry.key})"
    flat = [int(e) for e in np.ravel(exponents)]
    return {"shape": list(np.shape(exponents)), "values": flat, "min": min(flat, default=None),
            "max": max(flat, default=None), "how": how}


def tensor_report(tensor: TensorState, values: tuple, codes, formats, window: tuple | None = None,
                  exponents: dict | None = None) -> dict:
    """One tensor's window classes per code over `window` (the values as encoded: default
    `values`) and log2 quantiles over `values`, both its finite elements (`finite_elements`);
    `left_out` counts the others; `exponents`: `exponents_report`'s."""
    window = values if window is None else window
    out = {"name": tensor.name, "index": tensor.index, "key": tensor.key, "shape": list(tensor.shape),
           "elements": tensor.size, "left_out": tensor.size - (values[0].size if values else tensor.size),
           "step": tensor.step, "group": tensor.group, "rule": tensor.rule, "identity": tensor.identity,
           "exponents": exponents}
    for code, fmt, x, w in zip(codes, formats, values, window):
        out[code.suffix] = {**window_histogram(w, fmt).as_dict(), "log2_quantiles": log2_quantiles(x, LOG2_LEVELS)}
    out["format_counts"] = tensor.format_counts
    return out


def nonfinite_report(tensors: list[TensorState], values: dict) -> list[dict]:
    """The tensors whose state holds NaN or Inf (which no step stores): per code, how many of
    each, and how many elements the statistics leave out. `values`: each tensor's code values
    by `id(tensor)`."""
    damaged = []
    for tensor in tensors:
        codes = rule_formats(tensor.fmt).rule.codes
        counts = {code.suffix: nonfinite_counts(x) for code, x in zip(codes, values[id(tensor)])}
        if any(c["nan"] or c["inf"] for c in counts.values()):
            finite = finite_elements(values[id(tensor)])
            damaged.append({"name": tensor.name, "index": tensor.index, "key": tensor.key, "rule": tensor.rule,
                            "identity": tensor.identity, "elements": tensor.size,
                            "left_out": tensor.size - finite[0].size, "codes": counts})
    return damaged


def nonfinite_note(state_file: StateFile, damaged: list[dict]) -> str | None:
    """What a state holding NaN or Inf means: who refuses it, and what the report does with them."""
    if not damaged:
        return None
    note = "these elements are left out of the window counts, quantiles and bias suggestions below"
    if all(d["identity"] in TORCH_OPTIMIZERS for d in damaged):
        return note + " (a torch.optim state: packed-adamw's steps did not write it)"
    refusals = {"training state": "; so do chat_train's --resume, its export (export_reference_layout) and "
                                  "the walkthrough (python -m packed_adamw.torch.gpt.walkthrough)",
                "trainer checkpoint": "; so does train.py's --resume"}.get(state_file.kind, "")
    return (f"No step stores NaN or Inf, so this state is damaged: PackedAdamW, PackedMuon and PackedMuonAdamW "
            f"refuse to load it (load_state_dict, import_state){refusals}. Continue from an earlier state, saved "
            f"before its values became non-finite; {note}")


def section_report(identity: str, tensors: list[TensorState], *, biases: dict, low: float, high: float,
                   headroom: float, values_of: dict, state_file: StateFile) -> dict:
    """One format's part of a report: its tensors, totals and suggestions (all, and per group),
    each over the finite elements only (`finite_elements`: NaN and Inf have no place in a
    window, and would push every suggested bias into saturation). `values_of`: each tensor's
    code values (`StateFile.values`) by `id(tensor)`; the windows classify them as encoded
    (`StateFile.window_values`), the quantiles and suggestions take them as they are."""
    fmt = tensors[0].fmt
    entry = rule_formats(fmt)
    codes = entry.rule.codes
    packed = packed_layout(fmt, biases)
    formats, stored = windows(fmt, biases)
    # A state saved before its rule's per-matrix exponents (Muon's legacy identity) stored its
    # codes in the code's fixed window (s = 0), where they could saturate: not scaled per matrix.
    legacy = bool(getattr(fmt, "saved_without_exponents", lambda _: False)(identity))
    scaled = scaled_per_matrix(packed)
    values, encoded, exponents = [], [], []
    for t in tensors:
        raw = values_of[id(t)]
        both = finite_elements((*raw, *state_file.window_values(t, packed, raw)))
        values.append(both[:len(codes)])
        encoded.append(both[len(codes):])
        exponents.append(exponents_report(t, packed, raw))
    per_code = [[v[i] for v in values] for i in range(len(codes))]
    section = {
        "rule": entry.name, "identity": identity, "stored": stored, "scaled_per_matrix": scaled and not legacy,
        "saved_without_exponents": legacy,
        "biases": {c.bias_option: getattr(packed, c.bias_option) for c in codes},
        "codes": [{"suffix": c.suffix, "holds": c.holds, "bias_option": c.bias_option} for c in codes],
        "windows": {c.suffix: {"format": f.identity, "max_value": f.max_value, "min_normal": f.min_normal,
                               "min_subnormal": f.min_subnormal, **window_edges(f)} for c, f in zip(codes, formats)},
        "tensors": [tensor_report(t, v, codes, formats, w, e) for t, v, w, e in zip(tensors, values, encoded,
                                                                                        exponents)],
        "total": {"elements": sum(t.size for t in tensors), "left_out": sum(t.size - v[0].size for t, v in
                                                                            zip(tensors, values) if v),
                  **{c.suffix: window_histogram(np.concatenate([w[i].ravel() for w in encoded]), f).as_dict()
                     for i, (c, f) in enumerate(zip(codes, formats))}},
    }
    suggestion = {"all": suggest_state_biases(entry.name, per_code, low=low, high=high, headroom=headroom).as_dict()}
    by_group = {}
    for t, v in zip(tensors, values):
        if t.group is not None:
            lists = by_group.setdefault(f"param group {t.group}", [[] for _ in codes])
            for i, x in enumerate(v):
                lists[i].append(x)
    if len(by_group) > 1:
        for name, s in suggest_state_biases(entry.name, by_group, low=low, high=high, headroom=headroom).items():
            suggestion[name] = s.as_dict()
    section["suggestion"] = {"low": low, "high": high, "headroom": headroom, "censored": stored,
                             "bias_independent": scaled, **suggestion}
    return section


def file_report(state_file: StateFile, tensors: list[TensorState], *, biases: dict, low: float, high: float,
                headroom: float) -> dict:
    """The report: one section per format among `tensors` (a PackedMuonAdamW state has Muon's
    and AdamW's), with the file's param groups; a file of one format also has its section's
    keys at the top level. `nonfinite` lists every tensor of the file (selected or not) whose
    state holds NaN or Inf, and `nonfinite_note` says what that means; `chosen` says which
    file of a run directory was read."""
    values = {id(t): state_file.values(t) for t in state_file.tensors}
    damaged = nonfinite_report(state_file.tensors, values)
    report = {"path": str(state_file.path), "kind": state_file.kind, "identity": state_file.identity,
              "trainer_step": state_file.trainer_step, "chosen": state_file.chosen, "groups": state_file.groups,
              "nonfinite": damaged, "nonfinite_note": nonfinite_note(state_file, damaged),
              "sections": [section_report(identity, part, biases=biases, low=low, high=high, headroom=headroom,
                                          values_of=values, state_file=state_file)
                           for identity, part in state_file.sections(tensors)]}
    if len(report["sections"]) == 1:
        report.update({key: report["sections"][0][key] for key in SECTION_KEYS})
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


def _quantile_line(q: dict | None, h: dict) -> str:
    if q is None:
        return "all zero" if h["total"] else "no finite value"
    labels = {"0.0": "min", "0.01": "1%", "0.5": "50%", "0.99": "99%", "1.0": "max"}
    return "log2|x| " + "  ".join(f"{labels.get(k, k)} {v:.2f}" for k, v in q.items())


def _label(code: dict) -> str:
    return f"|{code['suffix']}|"


def _format_section(section: dict) -> list[str]:
    w, codes = section["windows"], section["codes"]
    width = max(len(_label(c)) for c in codes)
    scaled = section.get("scaled_per_matrix", False)
    lines = [f"rule {section['rule']}, format {section['identity']}"]
    how = "stored in" if section["stored"] else "kept wider than the code; counted as they would be stored in"
    relative = "" if not scaled else ", relative to each matrix's exponent s" + (" (value = code x 2^s)"
                                                                                 if section["stored"] else "")
    for code in codes:
        x = w[code["suffix"]]
        lines.append(f"  {_label(code)} ({code['holds']}) {how} {x['format']}{relative}: max {x['max_value']!r} "
                     f"(2^{x['log2_max_value']:.4g}), min normal 2^{x['log2_min_normal']:.0f}, "
                     f"min subnormal 2^{x['log2_min_subnormal']:.0f}")
    if scaled:
        lines.append("  (the window counts the codes, value x 2^-s: the step puts each matrix's largest |value| one "
                     "binade below the largest code, so none saturates, and the smallest ones go subnormal or flush; "
                     + ("s as the packed step would choose it for each matrix; " if not section["stored"] else "")
                     + "the log2 quantiles are of the values themselves, codes x 2^s)")
    elif section.get("saved_without_exponents"):
        lines.append("  (a state saved before the per-matrix exponents: its codes were stored in the code's fixed "
                     "window, s = 0, so a value that saturated reads as the maximum and is counted saturated, one "
                     "that flushed reads as zero; loaded, it reads with s = 0, and each step then chooses each "
                     "matrix's)")
    elif section["stored"]:
        lines.append("  (stored codes: a value that flushed reads as zero, one that saturated as the maximum)")
    for t in section["tensors"]:
        lines.append("")
        group = f"  group {t['group']}" if t["group"] is not None else ""
        step = f"step {t['step']}" if t["step"] is not None else "no step count"
        lines.append(f"{t['name']}  {tuple(t['shape'])}  {t['elements']:,} elements  {step}{group}")
        if t.get("exponents"):
            lines.append(f"  {_exponents_line(t['exponents'])}")
        for code in codes:
            lines.append(f"  {_label(code):<{width}} {_classes_line(t[code['suffix']])}")
            lines.append(f"  {'':<{width}} {_quantile_line(t[code['suffix']]['log2_quantiles'], t[code['suffix']])}")
        if t["left_out"]:
            lines.append(f"  left out: {t['left_out']:,} elements holding NaN or Inf (listed first)")
        if t["format_counts"]:
            lines.append("  saved format counts: " + ", ".join(f"{k} {v:,}" for k, v in t["format_counts"].items()))
    total = section["total"]
    left_out = f" ({total['left_out']:,} left out: NaN or Inf)" if total["left_out"] else ""
    lines += ["", f"all {len(section['tensors'])} tensors of {section['identity']}, {total['elements']:,} elements"
                  + left_out]
    for code in codes:
        lines.append(f"  {_label(code):<{width}} {_classes_line(total[code['suffix']])}")
    s = section["suggestion"]
    if s.get("bias_independent"):
        lines += ["", "no bias suggested:"]
        lines += [f"  {code['suffix']}: {s['all'][code['suffix']]['reason']}" for code in codes]
        return lines
    lines += ["", f"suggested biases (quantiles {s['low']:g} and {s['high']:g} of nonzero magnitudes, "
                  f"headroom {s['headroom']:g}x)"]
    if s["censored"]:
        lines.append("  from stored values, which the format has already clamped and flushed: "
                     "collect float32 values (mode fp32) to decide")
    for name, choice in s.items():
        if not isinstance(choice, dict):
            continue
        chosen = " ".join(f"{c['bias_option']}={choice[c['bias_option']]}" for c in codes)
        lines.append(f"  {name}: {chosen}  ({choice['identity']})")
        for code in codes:
            c = choice[code["suffix"]]
            sample = c["sample"]
            at = (f"; sample at this bias: saturated {sample['fractions']['saturated']:.3g}, subnormal "
                  f"{sample['fractions']['subnormal']:.3g}, flushed {sample['fractions']['flushed']:.3g}"
                  if sample else "")
            lines.append(f"    {code['suffix']}: {c['reason']}{at}")
        for note in choice["notes"]:
            lines.append(f"    note: {note}")
    return lines


def _exponents_line(e: dict) -> str:
    count = len(e["values"])
    if count == 1:
        return f"exponent s = {e['values'][0]}, {e['how']}"
    return f"exponents s of {count} matrices {tuple(e['shape'])}: min {e['min']}, max {e['max']}, {e['how']}"


def format_report(report: dict) -> str:
    lines = [f"{report['path']}: {report['kind']}"
             + (f" at trainer step {report['trainer_step']}" if report["trainer_step"] is not None else ""),
             f"format {report['identity']}"]
    if report["chosen"]:
        lines.append(f"read {report['chosen']}")
    if report["nonfinite"]:
        damaged = len(report["nonfinite"])
        lines += ["", f"NaN or Inf in {damaged} tensor{'s' if damaged > 1 else ''}:"]
        for d in report["nonfinite"]:
            counts = ", ".join(f"|{suffix}| " + " and ".join(f"{c[kind]:,} {label}" for kind, label in
                                                               (("nan", "NaN"), ("inf", "Inf")) if c[kind])
                               for suffix, c in d["codes"].items() if c["nan"] or c["inf"])
            lines.append(f"  {d['name']} ({d['key']}, {d['rule']}): {counts}; {d['left_out']:,} of "
                         f"{d['elements']:,} elements left out")
        lines.append(report["nonfinite_note"])
    if not report["sections"]:
        lines.append("no optimizer state to report (no tensor was stepped, or none was selected)")
    for section in report["sections"]:
        lines += ["", *_format_section(section)]
    return "\n".join(lines)


# ---- the plot -------------------------------------------------------------------------------


def plot_report(state_file: StateFile, tensors: list[TensorState], report: dict, out_path) -> None:
    """Histograms of each code's log2 magnitudes over `tensors` as the window classifies them
    (a format scaled per matrix: the codes, value x 2^-s), one row per format (rule), the
    format's window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = report["sections"]
    columns = max((len(s["codes"]) for s in sections), default=1)
    fig, axes = plt.subplots(max(len(sections), 1), columns, figsize=(6 * columns, 4.5 * max(len(sections), 1)),
                             squeeze=False)
    for row, ((identity, part), section) in enumerate(zip(state_file.sections(tensors), sections)):
        packed = packed_layout(part[0].fmt, section["biases"])
        values = [state_file.window_values(t, packed) for t in part]  # as the window classifies them
        for column, code in enumerate(section["codes"]):
            ax, key, label = axes[row][column], code["suffix"], _label(code)
            flat = np.concatenate([v[column].ravel() for v in values])
            magnitude = np.abs(flat.astype(np.float64))
            nonzero = magnitude[(magnitude > 0) & np.isfinite(magnitude)]
            w = section["windows"][key]
            lo_edge, sub_edge, hi_edge = w["log2_min_subnormal"], w["log2_min_normal"], w["log2_max_value"]
            logs = np.log2(nonzero) if nonzero.size else np.zeros(0)
            left = math.floor(min(logs.min() if logs.size else lo_edge, lo_edge - 1)) - 1
            right = math.ceil(max(logs.max() if logs.size else hi_edge, hi_edge)) + 1
            h = section["total"][key]
            share = {name: f"{100 * h['fractions'][name]:.3g}%" for name in WINDOW_CLASSES}
            ax.axvspan(left, lo_edge - 1, color="tab:gray", alpha=0.25, label=f"flushed to 0: {share['flushed']}")
            ax.axvspan(lo_edge - 1, sub_edge, color="tab:orange", alpha=0.2, label=f"subnormal: {share['subnormal']}")
            ax.axvspan(hi_edge, right, color="tab:red", alpha=0.2, label=f"saturated: {share['saturated']}")
            for x in (lo_edge, sub_edge, hi_edge):
                ax.axvline(x, color="black", lw=0.8, ls="--")
            if logs.size:
                ax.hist(logs, bins=np.arange(left, right + 0.25, 0.25), color="tab:blue",
                        label=f"{label}, nonzero (normal: {share['normal']})")
            scaled = " x 2^-s (each matrix's codes)" if section.get("scaled_per_matrix") else ""
            ax.set(xlim=(left, right), xlabel=f"log2 {label}{scaled}", ylabel="elements",
                   title=f"{section['rule']}: {label} in {w['format']}" + ("" if section["stored"] else " (if stored)")
                   + f": {h['counts']['zero']:,} zero of {h['total']:,}")
            ax.set_yscale("log")
            ax.legend(fontsize=8, loc="upper left")
        for column in range(len(section["codes"]), columns):
            axes[row][column].axis("off")
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

