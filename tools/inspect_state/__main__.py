"""python -m packed_adamw.inspect PATH [--plot out.png] [--explain NAME[INDEX] --grad G ...]"""
from __future__ import annotations

import argparse
import json
import re
import sys

import numpy as np

from packed_adamw.core.format_health import DEFAULT_HEADROOM, DEFAULT_HIGH_QUANTILE, DEFAULT_LOW_QUANTILE
from packed_adamw.core.rules import RULES

from .explain import ELEMENT_WALKS
from .files import TORCH_OPTIMIZERS, InspectError, load_state_file
from .report import file_report, format_report, format_walk, plot_report

DESCRIPTION = """\
Where the optimizer's state sits in its format's window, per rule (AdamW's moments, Muon's
momenta) and tensor, and the exponent biases it suggests (Muon's codes are relative to each
matrix's exponent, shown per tensor: no bias changes them, and none is suggested); optionally
one element's step spelled out. PATH is a trainer checkpoint, a chat_train training state (or
the run directory of either: chat_train's newest state is read, and named), a torch optimizer
state file (torch.save(opt.state_dict(), path)) or a PortableState file. NaN and Inf values,
which no step stores, are counted per tensor and listed first, and left out of every statistic.
Guide: docs/FORMAT_HEALTH.md.

    python -m packed_adamw.inspect runs/tiny-fp32/checkpoint.safetensors --plot moments.png
    python -m packed_adamw.inspect opt.pt --explain 'blocks.0.attn.qkv.weight[3,7]' --grad 0.02
"""

# Without a param group in the file, hyperparameters fall back to PackedAdamW's defaults (the
# one rule with an element walk, explain.ELEMENT_WALKS).
FALLBACK_HYPERPARAMETERS = {"lr": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "maximize": False}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.inspect", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="trainer checkpoint, training state (or a run directory of either), torch "
                                     "optimizer state file or PortableState file")
    parser.add_argument("--tensor", action="append", default=[], metavar="NAME",
                        help="report (and plot) only these tensors (a name, #INDEX, or the key in the file); repeatable")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument("--plot", metavar="PNG", help="write histograms of log2|m| and log2 RMS with the window marked")
    window = parser.add_argument_group("the window for values kept wider than a code (fp32 modes, Muon's bf16 mode, "
                                       "torch.optim.AdamW and Muon)")
    for option, (rule, fmt, default) in bias_options().items():
        window.add_argument(f"--{option.replace('_', '-')}", type=int, default=default, dest=option,
                            help=f"{rule}'s {fmt.name} bias to count against (default {default})")
    suggest = parser.add_argument_group("bias suggestion (core.format_health.suggest_biases)")
    suggest.add_argument("--low", type=float, default=DEFAULT_LOW_QUANTILE,
                         help=f"quantile of nonzero magnitudes to keep normal (default {DEFAULT_LOW_QUANTILE})")
    suggest.add_argument("--high", type=float, default=DEFAULT_HIGH_QUANTILE,
                         help=f"quantile to keep HEADROOM below the maximum (default {DEFAULT_HIGH_QUANTILE})")
    suggest.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                         help=f"factor between the high quantile and the format's maximum (default {DEFAULT_HEADROOM:g})")
    explain = parser.add_argument_group("one element's step (--explain)")
    explain.add_argument("--explain", metavar="NAME[INDEX]",
                         help="the element: a tensor (name, #INDEX or key) and its index, flat [i] or per dimension [i,j]")
    explain.add_argument("--grad", type=float, help="the element's gradient (nan and inf accepted)")
    explain.add_argument("--param", type=float, help="the parameter's value (default: the checkpoint's model weight)")
    explain.add_argument("--step", type=int, help="the step count t of this step (default: the stored count + 1)")
    for name, help_name in (("lr", "lr"), ("b1", "b1"), ("b2", "b2"), ("eps", "eps"), ("weight-decay", "weight_decay")):
        explain.add_argument(f"--{name}", type=float, dest=help_name.replace("-", "_"),
                             help=f"{help_name} (default: the tensor's param group in the file)")
    return parser.parse_args(argv)


def bias_options() -> dict:
    """Every rule's codes' bias options (core/rules.py): option -> (rule, the code's format at
    its default bias, that bias)."""
    options = {}
    for entry in RULES.values():
        for i, code in enumerate(entry.rule.codes):
            bias = entry.default_bias(i)
            options.setdefault(code.bias_option, (entry.name, entry.code_format(i, bias), bias))
    return options


_ELEMENT = re.compile(r"(?P<name>[^\[\]]+)(?P<index>(\[[-+\d,\s]+\])+)")


def parse_element(text: str) -> tuple[str, list[int]]:
    match = _ELEMENT.fullmatch(text.strip())
    if match is None:
        raise InspectError(f"--explain {text!r}: give a tensor and an element, e.g. 'blocks.0.mlp.fc.weight[3,7]', "
                           "'#4[12]' or 'moments.0[5]'")
    numbers = re.findall(r"[-+]?\d+", match["index"])
    return match["name"].strip(), [int(n) for n in numbers]


def flat_index(index: list[int], shape: tuple[int, ...], where: str) -> int:
    size = int(np.prod(shape, dtype=np.int64))
    if len(index) == 1:
        i = index[0] + size if index[0] < 0 else index[0]
        if not 0 <= i < size:
            raise InspectError(f"{where}: index {index[0]} is outside the tensor's {size} elements (shape {shape})")
        return i
    if len(index) != len(shape):
        raise InspectError(f"{where}: {len(index)} indices for a tensor of shape {shape}; give one flat index or "
                           f"{len(shape)}")
    try:
        return int(np.ravel_multi_index(tuple(i % n if -n <= i < 0 else i for i, n in zip(index, shape)), shape))
    except ValueError:
        raise InspectError(f"{where}: index {index} is outside shape {shape}") from None


def explain(state_file, args) -> dict:
    name, index = parse_element(args.explain)
    tensor = state_file.find(name)
    where = f"--explain {args.explain}"
    if tensor.identity in TORCH_OPTIMIZERS:
        raise InspectError(f"{state_file.path} holds a {tensor.identity} state: its step is not packed-adamw's; "
                           "--explain reads the packed optimizers' states")
    rule = tensor.fmt.rule
    walk_step = ELEMENT_WALKS.get(rule.name)
    if walk_step is None and rule.matrix_phase:
        raise InspectError(f"{where}: {tensor.name} is stepped by {rule.name} (format {tensor.identity}), whose update "
                           f"is not elementwise: each step orthogonalises the whole {tensor.shape} matrix's momentum "
                           "with Newton-Schulz, so one element's update depends on every element of the matrix and "
                           "its gradient and cannot be spelled out alone (docs/MUON.md); --explain walks the "
                           f"elementwise steps of {', '.join(sorted(ELEMENT_WALKS))}")
    if walk_step is None:
        raise InspectError(f"{where}: {tensor.name} is stepped by {rule.name}, for which --explain has no element "
                           f"walk (it has {', '.join(sorted(ELEMENT_WALKS))})")
    if args.grad is None:
        raise InspectError("--explain needs the element's gradient: --grad VALUE")
    i = flat_index(index, tensor.shape, where)
    fmt = tensor.fmt
    if args.param is not None:
        p, p_source = args.param, "--param"
    elif tensor.param is not None:
        p, p_source = float(tensor.param.reshape(-1)[i]), state_file.weights
    else:
        raise InspectError(f"{where}: {state_file.kind} files hold no model weights; pass --param VALUE")
    group = state_file.groups[tensor.group] if tensor.group is not None else None
    hyper, sources = {}, {}
    for key in (*rule.hyperparam_fields, "maximize"):
        given = getattr(args, key, None)
        if given is not None:
            hyper[key], sources[key] = given, f"--{key.replace('_', '-')}"
        elif group is not None and key in group:
            hyper[key], sources[key] = group[key], f"param group {tensor.group}"
        else:
            hyper[key], sources[key] = FALLBACK_HYPERPARAMETERS[key], "PackedAdamW default (not in the file)"
    if args.step is None and tensor.step is None:
        raise InspectError(f"{where}: the file keeps no step count for {tensor.name}; pass --step T")
    count = args.step if args.step is not None else tensor.step + 1
    if fmt.mode == "fp32":
        state = (float(tensor.moments[0].reshape(-1)[i]), float(tensor.moments[1].reshape(-1)[i]))
    else:
        state = int(tensor.moments.reshape(-1)[i])
    walk = walk_step(p, args.grad, state, count=count, fmt=fmt, **hyper)
    multi = np.unravel_index(i, tensor.shape) if tensor.shape else ()
    result = walk.as_dict()
    result.update({"tensor": tensor.name, "flat_index": i, "index": [int(x) for x in multi],
                   "shape": list(tensor.shape), "stored_step": tensor.step, "sources": {"p": p_source, **sources},
                   "chosen": state_file.chosen})
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        state_file = load_state_file(args.path)  # a bad identity is refused here
        tensors = [state_file.find(name) for name in args.tensor] if args.tensor else state_file.tensors
        if args.explain:
            walk = explain(state_file, args)
            if args.json:
                print(json.dumps(walk, indent=1))
            else:
                header = [f"{state_file.path}: {state_file.kind}, format {walk['format']}",
                          *([f"read {state_file.chosen}"] if state_file.chosen else []),
                          f"element {walk['tensor']}{walk['index']} (flat {walk['flat_index']}) of shape "
                          f"{tuple(walk['shape'])}; stored step count {walk['stored_step']}, this step t = {walk['count']}",
                          "sources: " + ", ".join(f"{k} from {v}" for k, v in walk["sources"].items())]
                if "word" in walk:
                    header.append(f"word {walk['word']}")
                print(format_walk(walk, header))
            return 0
        report = file_report(state_file, tensors, biases={option: getattr(args, option) for option in bias_options()},
                             low=args.low, high=args.high, headroom=args.headroom)
        if args.plot:
            plot_report(state_file, tensors, report, args.plot)
        print(json.dumps(report, indent=1) if args.json else format_report(report))
        if args.plot and not args.json:
            print(f"\nplot written to {args.plot}")
        return 0
    except (InspectError, ValueError) as error:
        print(f"inspect: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
