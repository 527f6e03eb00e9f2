"""Format health: window classes, bias suggestions, and `python -m packed_adamw.inspect`.

Window classes are checked against a recount by encoding each value (`MiniFloat.encode`)
and reading the code's fields; the classifier itself uses only the format's thresholds.
`--explain` is checked bit for bit against `core.adamw.numpy_step` (and the scalar authority).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from packed_adamw.core.adamw import authority
from packed_adamw.core.format_health import (
    DEFAULT_HIGH_QUANTILE,
    DEFAULT_LOW_QUANTILE,
    WINDOW_CLASSES,
    MagnitudeQuantiles,
    classify,
    log2_quantiles,
    magnitude_quantiles,
    state_format_from_identity,
    suggest_biases,
    suggest_state_biases,
    window_histogram,
)
from packed_adamw.core.muon.state_format import StateFormat as MuonFormat
from packed_adamw.core.muon.state_format import momentum_format
from packed_adamw.core.codecs import BIAS_RANGE, FP16
from packed_adamw.core.adamw.state_format import StateFormat, first_moment_format, rms_format, unpack_words
from packed_adamw.core.adamw.hyperparams import Hyperparams
from packed_adamw.core.adamw.numpy_step import adamw_step, apply_step, step_scalar_row
from packed_adamw.core.portable import PortableState
from packed_adamw.core.rules import RULES, RuleFormats, momentum_values
from packed_adamw.inspect import InspectError, load_state_file, walk_step
from packed_adamw.inspect.__main__ import main as inspect_main
from packed_adamw.torch import PackedAdamW, PackedMuon, PackedMuonAdamW, muon_param_groups
from muon_helpers import TinyModel, gradient, set_gradients
from test_training_state import Run, tape  # noqa: F401 (tape: the tiny run's fixture)

F32 = np.float32
FORMATS = [first_moment_format(15), rms_format(15), first_moment_format(3), rms_format(60), FP16]


def bits(x) -> int:
    return int(np.asarray(x, dtype=F32).view(np.uint32))


# ================================================================ window classes ====

def recount(values: np.ndarray, fmt) -> np.ndarray:
    """Window classes from the encoded code: its magnitude and exponent field."""
    codes = fmt.encode(np.abs(values)).astype(np.uint32)
    exponent = codes >> fmt.fraction_bits
    out = np.where(exponent == 0, WINDOW_CLASSES.index("subnormal"), WINDOW_CLASSES.index("normal"))
    out = np.where(np.abs(values) >= fmt.max_value, WINDOW_CLASSES.index("saturated"), out)
    assert (codes[np.abs(values) >= fmt.max_value] == fmt.max_magnitude_code).all()
    out = np.where(codes == 0, WINDOW_CLASSES.index("flushed"), out)
    return np.where(values == 0, WINDOW_CLASSES.index("zero"), out)


def spanning(fmt, rng, n=40_000) -> np.ndarray:
    """Signed values log-uniform from below half the smallest subnormal to past the maximum,
    plus each boundary and its float32 neighbours, zeros and infinities."""
    lo, hi = math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_value) + 3
    x = F32(np.exp2(rng.uniform(lo, hi, n))) * rng.choice(F32([-1, 1]), n)
    edges = F32([fmt.min_subnormal / 2, fmt.min_subnormal, fmt.min_normal - fmt.min_subnormal / 2, fmt.min_normal,
                 fmt.max_value, fmt.max_value - fmt.max_value * 2.0 ** -14])
    around = np.concatenate([edges, np.nextafter(edges, F32(0)), np.nextafter(edges, F32(np.inf))])
    return np.concatenate([x, around, -around, F32([0.0, -0.0, np.inf, -np.inf])])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.identity)
def test_window_classes_equal_a_recount_by_encoding(fmt):
    values = spanning(fmt, np.random.default_rng(fmt.bias))
    expected = recount(values, fmt)
    assert np.array_equal(classify(values, fmt), expected)
    counts = window_histogram(values, fmt)
    assert counts.total == values.size
    for index, name in enumerate(WINDOW_CLASSES):
        assert counts[name] == np.count_nonzero(expected == index), name
    assert min(counts[name] for name in ("saturated", "normal", "subnormal", "flushed", "zero")) > 0


def test_huge_values_saturate_tiny_ones_flush():
    fmt = rms_format(15)
    h = window_histogram(F32([1e30, np.inf, fmt.max_value, 3.0]), fmt)
    assert h["saturated"] == 4 and h.fraction("saturated") == 1.0
    tiny = F32([fmt.min_subnormal / 2, fmt.min_subnormal * 0.3, 1e-40, 1e-45])
    assert window_histogram(tiny, fmt)["flushed"] == 4 and (fmt.encode(tiny) == 0).all()
    just_above = np.nextafter(F32(fmt.min_subnormal / 2), F32(1))
    assert window_histogram([just_above], fmt)["subnormal"] == 1 and fmt.encode(just_above) == 1
    h = window_histogram(F32([0.0, -0.0, np.nan]), first_moment_format(15))
    assert (h["zero"], h["nan"], h["flushed"]) == (2, 1, 0)


# ================================================================ suggest_biases ====

def lognormal(rng, log2_median, log2_sigma, n=200_000):
    return F32(np.exp2(rng.normal(log2_median, log2_sigma, n)))


def assert_choice_holds(values, choice, fmt_at, low, high, headroom):
    """The sample's quantiles are normal (when feasible), nothing saturates, and the choice
    is the extreme the rule names."""
    magnitude = np.abs(values.astype(np.float64))
    q_low, q_high = np.quantile(magnitude[magnitude > 0], [low, high])
    fmt = fmt_at(choice.bias)
    assert window_histogram(values, fmt)["saturated"] == 0
    assert q_high * headroom <= fmt.max_value
    if choice.feasible:
        assert window_histogram([q_low, q_high], fmt)["normal"] == 2
        # the smallest such bias: one less leaves the low quantile subnormal
        assert choice.bias == 0 or classify([q_low], fmt_at(choice.bias - 1))[0] != WINDOW_CLASSES.index("normal")
        # the span's top still holds; one more breaks the headroom or saturates
        top, above = fmt_at(choice.span[1]), fmt_at(choice.span[1] + 1)
        assert choice.span[0] == choice.bias and q_high * headroom <= top.max_value
        assert window_histogram(values, top)["saturated"] == 0 and window_histogram([q_low], top)["normal"] == 1
        assert q_high * headroom > above.max_value or window_histogram(values, above)["saturated"] > 0
    else:
        assert classify([q_low], fmt)[0] != WINDOW_CLASSES.index("normal")
        # the largest bias without saturation: one more breaks the headroom or saturates
        above = fmt_at(choice.bias + 1)
        assert q_high * headroom > above.max_value or window_histogram(values, above)["saturated"] > 0


@pytest.mark.parametrize("m_log2,rms_log2,sigma", [(-18, -15, 2.0), (-8, -6, 1.5), (4, 5, 1.0), (-30, -27, 4.0)])
def test_suggested_biases_keep_quantiles_normal_and_nothing_saturated(m_log2, rms_log2, sigma):
    rng = np.random.default_rng(abs(m_log2))
    m = lognormal(rng, m_log2, sigma) * rng.choice(F32([-1, 1]), 200_000)
    rms = lognormal(rng, rms_log2, sigma)
    low, high, headroom = 0.01, 0.999999, 2.0
    suggestion = suggest_biases(m, rms, low=low, high=high, headroom=headroom)
    m_bias, rms_bias = suggestion
    assert (m_bias, rms_bias) == (suggestion.m.bias, suggestion.rms.bias)
    assert_choice_holds(m, suggestion.m, first_moment_format, low, high, headroom)
    assert_choice_holds(rms, suggestion.rms, rms_format, low, high, headroom)
    assert suggestion.m.sample["saturated"] == suggestion.rms.sample["saturated"] == 0


def test_wide_spread_prefers_avoiding_saturation():
    rng = np.random.default_rng(1)
    rms = lognormal(rng, -15, 6.0)  # about 36 binades between the quantiles: no window holds them
    choice = suggest_biases(rms, rms).rms
    assert not choice.feasible and choice.sample["saturated"] == 0 and choice.sample["flushed"] > 0
    assert_choice_holds(rms, choice, rms_format, 0.01, 0.999999, 2.0)


def test_suggestions_per_group_from_lists_and_from_quantiles():
    rng = np.random.default_rng(2)
    weights = [lognormal(rng, -16, 1.0, 1000), lognormal(rng, -17, 1.0, 3000)]
    biases = [lognormal(rng, -9, 1.0, 500)]
    per_group = suggest_biases({"weights": (weights, weights), "biases": (biases, biases)})
    assert per_group.keys() == {"weights", "biases"}
    assert per_group["weights"].m_bias > per_group["biases"].m_bias  # smaller moments, larger bias
    together = np.concatenate(weights)
    assert tuple(per_group["weights"]) == tuple(suggest_biases(together, together))
    q = magnitude_quantiles(together)
    only_quantiles = MagnitudeQuantiles(q.low, q.high, q.maximum, q.nonzero)
    assert tuple(suggest_biases(only_quantiles, only_quantiles)) == tuple(per_group["weights"])
    assert tuple(suggest_biases(np.zeros(10, F32), np.zeros(10, F32))) == (15, 15)


def test_zero_rms_drops_are_counted_from_paired_samples():
    m = F32([1e-3, 1e-3])
    rms = F32([1e-2, 1e-12])  # no bias keeps both: 1e-2 stays unsaturated, 1e-12 flushes
    suggestion = suggest_biases(m, rms, low=0.0, high=1.0)
    assert any("1 of 2 sampled elements" in note for note in suggestion.notes)


@pytest.mark.parametrize("fmt", [StateFormat(), StateFormat("packed", 18, 12), StateFormat("packed", 0, 100),
                                 StateFormat("fp16"), StateFormat("fp32"), MuonFormat(), MuonFormat("packed", 0),
                                 MuonFormat("packed", 100), MuonFormat("bf16"), MuonFormat("fp32")],
                         ids=lambda f: f.identity)
def test_identity_parses_back(fmt):
    """Every rule's identities (core/rules.py): the parsed format names its rule."""
    parsed = state_format_from_identity(fmt.identity)
    assert parsed == fmt and type(parsed) is type(fmt) and parsed.rule.name == fmt.rule.name


@pytest.mark.parametrize("bad", ["packed:m=SE4M11b15", "packed:m=SE4M11b15,rms=SE4M12b15", "packed:m=SE5M10b15,"
                                 "rms=UE4M12b15", "packed:m=SE4M11b101,rms=UE4M12b15", "fp16:m=SE5M10b16ieee,"
                                 "rms=SE5M10b16ieee", "fp64:m=f64,v=f64", "", "muon-packed:mu=SE5M10b101",
                                 "muon-packed:mu=SE4M11b15", "muon-bf16:mu=SE5M10b31", "muon-fp32:mu=f32,v=f32"])
def test_identity_parser_refuses_what_the_code_does_not_make(bad):
    with pytest.raises(ValueError):
        state_format_from_identity(bad)


def as_packed_codes(momenta: np.ndarray, bias: int) -> np.ndarray:
    """One matrix's momenta as Muon's packed step encodes them (MUON.md, "The exponent"), apart
    from the library: times 2^-s, s = floor(log2 max |m|) - 30 + bias (normal magnitudes)."""
    amax = np.abs(momenta).max()
    if amax == 0:
        return momenta
    scaled = np.ldexp(momenta, -(int(np.frexp(amax)[1]) - 1 - 30 + bias))
    assert scaled.dtype == F32
    return scaled


def test_muon_suggestion_says_no_bias_changes_its_codes():
    """Any rule's codes through suggest_state_biases: Muon's one code, E5M10, is kept relative to
    each matrix's power-of-two exponent, so every bias stores the same codes: no bias is chosen
    (the default is kept, saying why, with the values' quantiles)."""
    rng = np.random.default_rng(5)
    momenta = lognormal(rng, -14, 2.0, 50_000) * rng.choice(F32([-1, 1]), 50_000)
    codes = {bias: momentum_format(bias).encode(as_packed_codes(momenta, bias)) for bias in (0, 31, 40, 100)}
    assert all(np.array_equal(c, codes[31]) for c in codes.values())  # what makes the bias irrelevant
    suggestion = suggest_state_biases("muon", [momenta])
    (choice,) = suggestion.choices
    assert choice.bias == 31 and choice.bias_independent and choice.feasible and choice.span == BIAS_RANGE
    assert choice.sample is None and "every mu_bias stores the same codes" in choice.reason
    assert choice.quantiles == magnitude_quantiles(momenta)
    assert suggestion.state_format == MuonFormat("packed", choice.bias)
    assert suggestion.biases == {"mu_bias": choice.bias}
    assert suggestion.as_dict()["mu"]["bias"] == choice.bias and suggestion.as_dict()["mu"]["bias_independent"]
    assert suggestion.notes == ("muon's packed codes are relative to each matrix's power-of-two exponent: mu_bias "
                                "changes nothing, so no bias is suggested",)
    with pytest.raises(ValueError, match="one entry of values per code"):
        suggest_state_biases("muon", [momenta, momenta])


# ================================================================ --explain against the step ====

HYPERPARAMETERS = [dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2),
                   dict(lr=0.3, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)]


def random_elements(mode: str, rng, n: int):
    """(p, g, state) arrays: magnitudes over many binades, both signs, special gradients."""
    p = F32(np.exp2(rng.uniform(-30, 8, n))) * rng.choice(F32([-1, 1]), n)
    g = F32(np.exp2(rng.uniform(-40, 12, n))) * rng.choice(F32([-1, 1]), n)
    special = F32([np.nan, np.inf, -np.inf, 1e6, -3e4, 1e20, 0.0, -0.0, 3e38])
    g[: special.size] = special
    p[special.size] = -0.0
    p[special.size + 1] = 3.4e38  # near the float32 maximum
    if mode == "fp32":
        m = F32(np.exp2(rng.uniform(-30, 4, n))) * rng.choice(F32([-1, 1]), n)
        v = F32(np.exp2(rng.uniform(-60, 8, n)))
        state = np.stack([m, v])
    else:
        state = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        state[:4] = [0, 0x7FFF0000 | 0xFFFF, 0x00010000, 0x80000001]  # zero, maxima, RMS 0 beside m, -0 beside r
        state[6:8] = [0x00070000, 0x80050001]  # zero gradients: the RMS flushes, the zero-RMS rule drops m
    return p, g, state


@pytest.mark.parametrize("fmt", [StateFormat(), StateFormat("packed", 19, 21), StateFormat("fp16"),
                                 StateFormat("fp32")], ids=lambda f: f.identity)
def test_walk_equals_the_numpy_step_bit_for_bit(fmt):
    rng = np.random.default_rng(5)
    n = 150
    for hp_index, hp in enumerate(HYPERPARAMETERS):
        p, g, state = random_elements(fmt.mode, rng, n)
        count = [1, 7, 1000][hp_index]
        p_out, state_out, update = p.copy(), state.copy(), np.empty_like(p)
        adamw_step(p_out, g, state_out, count=count, hp=Hyperparams(**hp), fmt=fmt)
        adamw_step(p.copy(), g, state.copy(), count=count, hp=Hyperparams(**hp), fmt=fmt, update_out=update)
        saturated = rejected = 0
        for i in range(n):
            element_state = (float(state[0, i]), float(state[1, i])) if fmt.mode == "fp32" else int(state[i])
            walk = walk_step(float(p[i]), float(g[i]), element_state, count=count, fmt=fmt, **hp)
            assert f32_bits_of(walk.p_next) == bits(p_out[i]), (i, walk.as_dict())
            assert f32_bits_of(walk.update) == bits(update[i]), i
            if fmt.mode == "fp32":
                assert tuple(map(f32_bits_of, walk.state_next)) == (bits(state_out[0, i]), bits(state_out[1, i])), i
            else:
                assert walk.word_next == int(state_out[i]), i
                saturated += walk.fields["m_next"].kind == "maximum" or walk.fields["rms_next"].kind == "maximum"
            rejected += not walk.accepted
            expected = authority.adamw_element(float(p[i]), float(g[i]), element_state, count=count, mode=fmt.mode,
                                               m_bias=fmt.m_bias, rms_bias=fmt.rms_bias, **hp)
            assert (f32_bits_of(walk.p_next), walk.accepted) == (f32_bits_of(expected[0]), expected[3])
        assert rejected >= 3  # NaN, +Inf, -Inf gradients
        assert fmt.mode == "fp32" or saturated > 0


def test_walk_with_maximize_equals_the_step_on_negated_scalars():
    fmt, hp = StateFormat(), HYPERPARAMETERS[1]
    rng = np.random.default_rng(9)
    p, g, state = random_elements("packed", rng, 60)
    row = step_scalar_row(3, [hp[k] for k in ("lr", "b1", "b2", "eps", "weight_decay")], maximize=True)
    p_out, state_out = p.copy(), state.copy()
    apply_step(p_out, g, state_out, row, fmt=fmt)
    for i in range(p.size):
        walk = walk_step(float(p[i]), float(g[i]), int(state[i]), count=3, fmt=fmt, maximize=True, **hp)
        assert (f32_bits_of(walk.p_next), walk.word_next) == (bits(p_out[i]), int(state_out[i])), i


def f32_bits_of(x: float) -> int:
    return authority.f32_bits(x)


# ================================================================ the three file kinds ====

def trained_optimizer(mode="packed", m_bias=18, rms_bias=15, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    named = list(model.named_parameters())
    groups = [{"params": [(n, p) for n, p in named if p.dim() == 2], "weight_decay": 0.1},
              {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02}]
    opt = PackedAdamW(groups, lr=0.01, betas=(0.8, 0.99), mode=mode, m_bias=m_bias, rms_bias=rms_bias)
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 6)
        (model(x) ** 2).sum().mul(10.0 ** step).backward()
        opt.step()
    return model, opt


def report_of(path, capsys, *extra) -> dict:
    assert inspect_main([str(path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def expected_counts(opt, fmt: StateFormat, names) -> dict:
    """Per tensor: window counts of the optimizer's own state, decoded with MiniFloat.decode."""
    out = {}
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            s = opt.state[p][fmt.state_key].reshape(-1)
            if fmt.mode == "fp32":
                m, rms = s.reshape(2, -1)[0].numpy(), np.sqrt(s.reshape(2, -1)[1].numpy())
                m_fmt, r_fmt = first_moment_format(15), rms_format(15)
            else:
                m_codes, r_codes = unpack_words(s.view(torch.int32).numpy().view(np.uint32))
                m_fmt, r_fmt = fmt.formats
                m, rms = m_fmt.decode(m_codes), r_fmt.decode(r_codes)
            out[name] = (window_histogram(m, m_fmt).counts, window_histogram(rms, r_fmt).counts)
    assert sorted(out) == sorted(names)
    return out


def check_report(report, opt, fmt, step=2, groups=True):
    names = [t["name"] for t in report["tensors"]]
    assert report["identity"] == fmt.identity
    assert all(t["step"] == step for t in report["tensors"])
    for name, (m_counts, rms_counts) in expected_counts(opt, fmt, names).items():
        tensor = next(t for t in report["tensors"] if t["name"] == name)
        assert tensor["m"]["counts"] == m_counts and tensor["rms"]["counts"] == rms_counts, name
    assert report["total"]["elements"] == sum(p.numel() for g in opt.param_groups for p in g["params"])
    expected = {"all", "param group 0", "param group 1"} if groups else {"all"}
    assert expected == {k for k, v in report["suggestion"].items() if isinstance(v, dict)}


@pytest.mark.parametrize("int32_words", [False, True], ids=["uint32", "int32-view"])
def test_inspect_reads_a_torch_state_file(tmp_path, capsys, int32_words):
    _, opt = trained_optimizer()
    sd = opt.state_dict()
    if int32_words:
        for entry in sd["state"].values():
            entry["words"] = entry["words"].view(torch.int32)
    torch.save(sd, tmp_path / "opt.pt")
    report = report_of(tmp_path / "opt.pt", capsys, "--plot", str(tmp_path / "h.png"))
    assert report["kind"] == "torch state_dict" and report["stored"]
    assert [t["name"] for t in report["tensors"]] == ["0.weight", "1.weight", "0.bias", "1.bias"]
    check_report(report, opt, opt.state_format)
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["tensors"][0]["m"]["counts"]["saturated"] > 0  # the 10x gradients of step 2 at m_bias 18


def inspect_without_torch(path) -> dict:
    """`python -m packed_adamw.inspect PATH --json` in a process where torch, jax, matplotlib and
    triton cannot be imported (the portable reader's promise); returns its report."""
    code = textwrap.dedent(f"""
        import sys, runpy
        for name in ("torch", "jax", "matplotlib", "triton"):
            sys.modules[name] = None
        sys.argv = ["inspect", {str(path)!r}, "--json"]
        runpy.run_module("packed_adamw.inspect", run_name="__main__")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_inspect_reads_a_portable_state_without_torch(tmp_path):
    _, opt = trained_optimizer(mode="fp16")
    opt.export_state().save(tmp_path / "state.safetensors")
    report = inspect_without_torch(tmp_path / "state.safetensors")
    assert report["kind"] == "portable state" and report["identity"] == StateFormat("fp16").identity
    assert [t["name"] for t in report["tensors"]] == ["moments.0", "moments.1", "moments.2", "moments.3"]
    # PortableState lists tensors in param_groups order: group 0's weights, then group 1's biases
    renamed = {"moments.0": "0.weight", "moments.1": "1.weight", "moments.2": "0.bias", "moments.3": "1.bias"}
    for t in report["tensors"]:
        t["name"] = renamed[t["name"]]
    check_report(report, opt, opt.state_format, groups=False)


def write_trainer_checkpoint(path, model, opt):
    from packed_adamw.torch.gpt.checkpoint import save_training_state

    class Tape:
        def state_dict(self):
            return {"cursor": 0}

    mode = opt.state_format.mode if hasattr(opt, "state_format") else "mixed"  # PackedMuonAdamW: two rules
    save_training_state(path, model=model, optimizer=opt, tape=Tape(), config={"mode": mode},
                        trainer={"step": 2})


def test_inspect_reads_a_trainer_checkpoint(tmp_path, capsys):
    model, opt = trained_optimizer(mode="fp32")
    write_trainer_checkpoint(tmp_path / "checkpoint.safetensors", model, opt)
    report = report_of(tmp_path, capsys)  # the run directory is accepted too
    assert report["kind"] == "trainer checkpoint" and report["trainer_step"] == 2 and not report["stored"]
    assert report["windows"]["m"]["format"] == "SE4M11b15"
    check_report(report, opt, opt.state_format)
    suggestion = report["suggestion"]["all"]
    assert suggestion["m"]["sample"]["counts"]["saturated"] == suggestion["rms"]["sample"]["counts"]["saturated"] == 0
    text_rc = inspect_main([str(tmp_path / "checkpoint.safetensors"), "--tensor", "1.bias"])
    text = capsys.readouterr().out
    assert text_rc == 0 and "1.bias  (3,)" in text and "0.weight" not in text and "suggested biases" in text


# ================================================================ --explain on files ====

def numpy_step_of(opt, name, flat, grad, param, fmt, **hp_override):
    """The numpy step of one element, with the optimizer's state and its group's hyperparameters."""
    for group in opt.param_groups:
        for n, p in zip(group["param_names"], group["params"]):
            if n != name:
                continue
            entry = opt.state[p]
            raw = entry[fmt.state_key]
            state = raw.reshape(2, -1)[:, flat:flat + 1].numpy().copy() if fmt.mode == "fp32" else \
                raw.reshape(-1).view(torch.int32).numpy().view(np.uint32)[flat:flat + 1].copy()
            hp = dict(lr=group["lr"], b1=group["betas"][0], b2=group["betas"][1], eps=group["eps"],
                      weight_decay=group["weight_decay"])
            hp.update(hp_override)
            p_arr = F32([param])
            adamw_step(p_arr, F32([grad]), state, count=entry["step"] + 1, hp=Hyperparams(**hp), fmt=fmt)
            return p_arr[0], state
    raise KeyError(name)


@pytest.mark.parametrize("mode", ["packed", "fp16", "fp32"])
def test_explain_on_a_torch_state_file_equals_the_numpy_step(tmp_path, capsys, mode):
    _, opt = trained_optimizer(mode=mode)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fmt = opt.state_format
    for element, flat, grad, param in (("0.weight[2,3]", 2 * 6 + 3, 0.037, -0.25), ("1.bias[1]", 1, float("nan"), 0.5),
                                       ("#2[-1]", 4, 3e5, 1.0), ("1.weight[7]", 7, -float("inf"), 2.0)):
        walk = report_of(tmp_path / "opt.pt", capsys, "--explain", element, f"--grad={grad!r}", f"--param={param!r}")
        name = walk["tensor"]
        assert walk["flat_index"] == flat
        p_next, state = numpy_step_of(opt, name, flat, grad, param, fmt)
        assert walk["p_next_bits"] == f"0x{bits(p_next):08X}", element
        if mode == "fp32":
            assert (walk["m_next_stored_bits"], walk["v_next_stored_bits"]) == (
                f"0x{bits(state[0, 0]):08X}", f"0x{bits(state[1, 0]):08X}")
        else:
            assert walk["word_next"] == f"0x{int(state[0]):08X}", element
        assert walk["accepted"] == math.isfinite(grad)
        assert walk["sources"]["lr"] == f"param group {0 if 'weight' in name else 1}"


def test_explain_reads_the_parameter_from_a_trainer_checkpoint(tmp_path, capsys):
    model, opt = trained_optimizer(mode="packed", m_bias=15, rms_bias=15)
    write_trainer_checkpoint(tmp_path / "checkpoint.safetensors", model, opt)
    path = tmp_path / "checkpoint.safetensors"
    walk = report_of(path, capsys, "--explain", "1.weight[2,4]", "--grad", "40.0", "--lr", "0.5")
    assert walk["sources"]["p"] == "the checkpoint's model weights" and walk["sources"]["lr"] == "--lr"
    param = float(dict(model.named_parameters())["1.weight"].detach().reshape(-1)[14])
    p_next, state = numpy_step_of(opt, "1.weight", 14, 40.0, param, opt.state_format, lr=0.5)
    assert walk["p_next_bits"] == f"0x{bits(p_next):08X}" and walk["word_next"] == f"0x{int(state[0]):08X}"
    assert walk["fields"]["m_next"]["kind"] == "maximum"  # (1 - 0.8) * 40 = 8 > 2: the first moment saturates
    assert inspect_main([str(path), "--explain", "1.weight[2,4]", "--grad", "40"]) == 0
    text = capsys.readouterr().out
    assert "m'" in text and "zero-RMS rule" in text and "saturated" in text


def test_explain_refuses_what_it_cannot_answer(tmp_path, capsys):
    _, opt = trained_optimizer()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    for argv, message in ((["--explain", "0.weight[1]"], "--grad"), (["--explain", "0.weight[1]", "--grad", "1"], "--param"),
                          (["--explain", "0.weight[99]", "--grad", "1", "--param", "0"], "outside"),
                          (["--explain", "nope[0]", "--grad", "1", "--param", "0"], "no tensor 'nope'")):
        assert inspect_main([str(tmp_path / "opt.pt"), *argv]) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "foreign.bin").write_bytes(b"not a state")
    assert inspect_main([str(tmp_path / "foreign.bin")]) == 2
    assert "neither safetensors nor a torch file" in capsys.readouterr().err


def test_load_state_file_names_and_steps(tmp_path):
    _, opt = trained_optimizer(steps=3)
    opt.export_state().save(tmp_path / "s.safetensors")
    state_file = load_state_file(tmp_path / "s.safetensors")
    assert [t.step for t in state_file.tensors] == [3, 3, 3, 3]
    assert state_file.find("#1").key == "moments.1" and state_file.find("moments.2").shape == (5,)
    assert state_file.state_format == opt.state_format
    assert PortableState.load(tmp_path / "s.safetensors").format == state_file.identity


def test_inspect_reads_a_torch_adamw_state_as_float32_moments(tmp_path, capsys):
    torch.manual_seed(1)
    layer = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        (layer(torch.randn(5, 4)) ** 2).sum().backward()
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "adamw.pt")
    report = report_of(tmp_path / "adamw.pt", capsys, "--m-bias", "12", "--rms-bias", "13")
    assert report["identity"] == "torch.optim.AdamW" and not report["stored"]
    assert [t["step"] for t in report["tensors"]] == [2, 2]
    for t, p in zip(report["tensors"], layer.parameters()):
        state = opt.state[p]
        m, rms = state["exp_avg"].numpy(), np.sqrt(state["exp_avg_sq"].numpy())
        assert t["m"]["counts"] == window_histogram(m, first_moment_format(12)).counts
        assert t["rms"]["counts"] == window_histogram(rms, rms_format(13)).counts
    assert inspect_main([str(tmp_path / "adamw.pt"), "--explain", "#0[0]", "--grad", "1", "--param", "0"]) == 2
    assert "torch.optim.AdamW" in capsys.readouterr().err


# ================================================================ Muon and combined states ====

def trained_muon(mode="packed", mu_bias=40, combined=False, steps=2):
    """PackedMuon over TinyModel's two block matrices, or PackedMuonAdamW over all of it (AdamW
    at m_bias 18), stepped on gradients over many binades (at mu_bias 40, largest code 2^-8, the
    momenta are past it: each matrix's exponent brings them into the code)."""
    torch.manual_seed(0)
    model = TinyModel()
    if combined:
        opt = PackedMuonAdamW(muon_param_groups(model), lr=0.02, mode=mode, mu_bias=mu_bias, m_bias=18, adamw_lr=0.01)
    else:
        opt = PackedMuon([("up.weight", model.up.weight), ("down.weight", model.down.weight)], lr=0.02, mode=mode,
                         mu_bias=mu_bias)
    rng = np.random.default_rng(3)
    for _ in range(steps):
        set_gradients(rng, model)
        opt.step()
    return model, opt


def momenta_of(opt, p, fmt: MuonFormat) -> np.ndarray:
    """One matrix's momenta as float32, decoded with MiniFloat.decode or torch's bf16 (packed:
    the codes' own values, relative to the matrix's exponent)."""
    stored = opt.state[p][fmt.state_key]
    if fmt.mode == "fp32":
        return stored.numpy()
    if fmt.mode == "bf16":
        return stored.view(torch.bfloat16).float().numpy()
    return fmt.code.decode(stored.numpy().view(np.uint16))


def momentum_values_of(opt, p, fmt: MuonFormat) -> np.ndarray:
    """One matrix's momentum values: packed codes times 2^mu_exponent (np.ldexp), else as stored."""
    momenta = momenta_of(opt, p, fmt)
    return np.ldexp(momenta, int(opt.state[p]["mu_exponent"])).astype(F32) if fmt.mode == "packed" else momenta


def check_rule_counts(report, opt, names=None, mu_window=None):
    """Each tensor's window counts in its rule's section against the optimizer's own state
    (Muon: `mu`; AdamW: `m` and `rms`, as check_report counts them); `names`: parameter name ->
    the name the file shows."""
    rules = opt.rules if hasattr(opt, "rules") else {"muon": opt}
    sections = {section["rule"]: section for section in report["sections"]}
    assert set(sections) == set(rules)
    for kind, rule in rules.items():
        fmt, section = rule.state_format, sections[kind]
        assert section["identity"] == fmt.identity and section["stored"] == (fmt.formats is not None)
        renamed = {shown: name for name, shown in (names or {}).items()}
        tensors = {renamed.get(t["name"], t["name"]): t for t in section["tensors"]}
        if kind == "adamw":
            for name, (m_counts, rms_counts) in expected_counts(rule, fmt, list(tensors)).items():
                assert tensors[name]["m"]["counts"] == m_counts and tensors[name]["rms"]["counts"] == rms_counts
            continue
        window = fmt.code if fmt.formats is not None else mu_window
        assert section["windows"]["mu"]["format"] == window.identity
        for group in rule.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                # the window counts the codes (relative to the matrix's exponent), the quantiles the values
                momenta, values = momenta_of(rule, p, fmt), momentum_values_of(rule, p, fmt)
                codes = momenta if fmt.formats is not None else as_packed_codes(momenta, window.bias)
                counts = window_histogram(codes, window).counts
                assert tensors[name]["mu"]["counts"] == counts and tensors[name]["step"] is None, name
                assert tensors[name]["mu"]["log2_quantiles"] == log2_quantiles(values), name
                exponent = int(rule.state[p]["mu_exponent"]) if fmt.mode == "packed" else \
                    int(np.frexp(np.abs(momenta).max())[1]) - 1 - 30 + window.bias
                assert tensors[name]["exponents"]["values"] == [exponent], name
        assert set(section["suggestion"]["all"]) >= {"mu_bias", "identity", "mu", "notes"}
        assert section["suggestion"]["bias_independent"] and section["suggestion"]["all"]["mu"]["bias_independent"]


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
def test_inspect_reads_a_muon_state_file(tmp_path, capsys, mode):
    """torch.save(PackedMuon.state_dict()): the rule comes from the recorded identity; packed
    codes count against their own window (relative to each matrix's exponent), bf16 and fp32
    momenta as the packed step would encode them in E5M10 at --mu-bias (scaled by the exponent it
    would choose); the quantiles are of the momenta; no bias is suggested."""
    _, opt = trained_muon(mode)
    torch.save(opt.state_dict(), tmp_path / "muon.pt")
    report = report_of(tmp_path / "muon.pt", capsys, "--mu-bias", "40", "--plot", str(tmp_path / "h.png"))
    assert report["identity"] == opt.state_format.identity and report["kind"] == "torch state_dict"
    assert [t["name"] for t in report["tensors"]] == ["up.weight", "down.weight"]
    assert report["groups"][0]["rule"] == "muon" and report["groups"][0]["momentum"] == 0.95
    check_rule_counts(report, opt, mu_window=momentum_format(40))
    # momenta past E5M10b40's largest value, about 2^-8: each matrix's exponent keeps them in the code
    assert max(q for t in report["tensors"] for q in t["mu"]["log2_quantiles"].values()) > -8
    assert report["total"]["mu"]["counts"]["saturated"] == 0
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert inspect_main([str(tmp_path / "muon.pt")]) == 0
    text = capsys.readouterr().out
    assert "up.weight  (9, 6)" in text and "|mu|" in text and "mu_bias=" not in text
    assert "relative to each matrix's exponent s" in text and "no bias suggested" in text
    # wider momenta at the default --mu-bias 31: the exponent the step would choose moves by the bias, 40 - 31
    assert ("exponent s = 2, stored (mu_exponent)" if mode == "packed" else "exponent s = -7, as the packed step "
            "would choose (muon-packed:mu=SE5M10b31:scale=pow2/matrix)") in text
    # one element's step needs its whole matrix: refused, saying why
    assert inspect_main([str(tmp_path / "muon.pt"), "--explain", "up.weight[2,3]", "--grad", "1", "--param", "0"]) == 2
    error = capsys.readouterr().err
    assert "up.weight" in error and "Newton-Schulz" in error and "whole (9, 6) matrix" in error


def test_inspect_reads_a_combined_state_file_per_rule(tmp_path, capsys):
    """PackedMuonAdamW's state_dict: each rule's report, its tensors and groups; an AdamW
    element's step is explained, bit for bit, a Muon element's refused."""
    model, opt = trained_muon(combined=True)
    torch.save(opt.state_dict(), tmp_path / "both.pt")
    report = report_of(tmp_path / "both.pt", capsys)
    assert report["identity"] == "mixed" and [s["rule"] for s in report["sections"]] == ["muon", "adamw"]
    check_rule_counts(report, opt)
    adamw = report["sections"][1]
    assert adamw["windows"]["m"]["format"] == "SE4M11b18" and set(adamw["suggestion"]["all"]) >= {"m_bias", "rms_bias"}
    assert [g["rule"] for g in report["groups"]] == ["muon", "adamw"] and report["groups"][1]["b2"] == 0.999
    assert [t["group"] for t in report["sections"][0]["tensors"]] == [0, 0, 0]
    assert inspect_main([str(tmp_path / "both.pt")]) == 0
    text = capsys.readouterr().out
    assert "rule muon, format muon-packed:mu=SE5M10b40:scale=pow2/matrix" in text
    assert "rule adamw, format packed:m=SE4M11b18" in text
    walk = report_of(tmp_path / "both.pt", capsys, "--explain", "norm.weight[4]", "--grad", "0.3", "--param", "0.5")
    p_next, state = numpy_step_of(opt, "norm.weight", 4, 0.3, 0.5, opt.rules["adamw"].state_format)
    assert walk["p_next_bits"] == f"0x{bits(p_next):08X}" and walk["word_next"] == f"0x{int(state[0]):08X}"
    assert walk["sources"]["lr"] == "param group 1"
    assert inspect_main([str(tmp_path / "both.pt"), "--explain", "head.weight[0]", "--grad", "1", "--param", "0"]) == 2
    assert "Newton-Schulz" in capsys.readouterr().err


def test_inspect_reads_muon_portable_states(tmp_path):
    """PackedMuon's export (counts None) in-process; PackedMuonAdamW's (format "mixed") with
    torch, jax and triton unimportable: the rules registry is core's."""
    _, muon = trained_muon(mode="bf16")
    muon.export_state().save(tmp_path / "muon.safetensors")
    state_file = load_state_file(tmp_path / "muon.safetensors")
    assert [t.step for t in state_file.tensors] == [None, None]
    assert state_file.state_format.identity == muon.state_format.identity  # bf16 mode's identity names no bias
    values = state_file.values(state_file.tensors[1])
    assert len(values) == 1 and np.array_equal(values[0], momenta_of(muon, muon.param_groups[0]["params"][1],
                                                                       muon.state_format))
    _, opt = trained_muon(combined=True)
    opt.export_state().save(tmp_path / "both.safetensors")
    report = inspect_without_torch(tmp_path / "both.safetensors")
    assert report["kind"] == "portable state" and report["identity"] == "mixed"
    names = [n for g in opt.param_groups for n in g["param_names"]]
    check_rule_counts(report, opt, names={name: f"moments.{i}" for i, name in enumerate(names)})
    assert [t["step"] for t in report["sections"][1]["tensors"]] == [2, 2, 2, 2]


def test_inspect_reads_a_chat_train_state(tape, tmp_path, capsys):
    """chat_train's state_stepNNNNNN.safetensors (PackedMuonAdamW over bf16 weights): both rules'
    reports, and an AdamW element explained from the state's FP32 master (weight and mantissa)."""
    run = Run(tape, torch.bfloat16)
    run.train(2)
    path = run.save(tmp_path)
    report = report_of(path, capsys)
    assert report["kind"] == "training state" and report["trainer_step"] == 2
    check_rule_counts(report, run.optimizer)
    names = [n for g in run.optimizer.param_groups for n in g["param_names"]]
    head = names.index("head.weight")
    master = run.optimizer.master_weights()[head].reshape(-1)[7].item()
    walk = report_of(path, capsys, "--explain", "head.weight[7]", "--grad", "0.01")
    assert walk["sources"]["p"] == "the training state's model weights" and walk["p_bits"] == f"0x{bits(master):08X}"
    adamw_format = run.optimizer.rules["adamw"].state_format
    p_next, state = numpy_step_of(run.optimizer, "head.weight", 7, 0.01, master, adamw_format)
    assert walk["p_next_bits"] == f"0x{bits(p_next):08X}" and walk["word_next"] == f"0x{int(state[0]):08X}"
    assert inspect_main([str(path), "--explain", "up.weight[0]", "--grad", "1"]) == 2
    assert "Newton-Schulz" in capsys.readouterr().err


def test_inspect_applies_each_matrixs_exponent_in_every_file_kind(tape, tmp_path):
    """Packed Muon's values are its codes' values times 2^s, s the matrix's exponent as each kind
    of file holds it: a torch state_dict's and a trainer checkpoint's `mu_exponent` entry, a
    PortableState's `exponents`, a chat_train training state's params/<name>/opt/mu_exponent."""
    model, opt = trained_muon(combined=True)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    write_trainer_checkpoint(tmp_path / "checkpoint.safetensors", model, opt)
    opt.export_state().save(tmp_path / "state.safetensors")
    run = Run(tape, torch.bfloat16)
    run.train(2)
    order = [n for g in opt.param_groups for n in g["param_names"]]
    files = [(tmp_path / "opt.pt", opt, str), (tmp_path / "checkpoint.safetensors", opt, str),
             (tmp_path / "state.safetensors", opt, lambda name: f"moments.{order.index(name)}"),
             (run.save(tmp_path / "run"), run.optimizer, str)]
    kinds = []
    for path, optimizer, shown in files:
        state_file = load_state_file(path)
        kinds.append(state_file.kind)
        muon = optimizer.rules["muon"]
        exponents = []
        for group in muon.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                tensor = state_file.find(shown(name))
                exponent = int(muon.state[p]["mu_exponent"])
                assert tensor.exponent.dtype == np.int32 and tensor.exponent.shape == () and \
                    int(tensor.exponent) == exponent, (path, name)
                (values,) = state_file.values(tensor)
                expected = momentum_values_of(muon, p, muon.state_format)
                assert np.array_equal(values.view(np.uint32), expected.view(np.uint32)), (path, name)
                exponents.append(exponent)
        assert any(exponents), path  # s = 0 everywhere would not tell applied from ignored
    assert kinds == ["torch state_dict", "trainer checkpoint", "portable state", "training state"]


def saved_before_the_exponents(opt) -> dict:
    """PackedMuon's state_dict as a packed state saved before the exponents: the legacy identity,
    no mu_exponent entries."""
    legacy, fmt = copy.deepcopy(opt.state_dict()), opt.state_format  # state_dict's entries are the optimizer's
    for group in legacy["param_groups"]:
        group["packed_adamw_format"] = fmt.legacy_identity
    legacy["packed_adamw"]["format"] = fmt.legacy_identity
    for entry in legacy["state"].values():
        del entry["mu_exponent"]
    return legacy


def test_inspect_reads_states_saved_before_the_exponents_and_refuses_a_missing_one(tmp_path):
    """A packed Muon state of the identity before the exponents has none: its codes read with s = 0,
    as PackedMuon loads it; a state of the current identity without its exponent, or the legacy one
    with an exponent, is refused naming the entry."""
    _, opt = trained_muon()
    legacy = saved_before_the_exponents(opt)
    fmt = opt.state_format
    torch.save(legacy, tmp_path / "legacy.pt")
    state_file = load_state_file(tmp_path / "legacy.pt")
    tensor = state_file.tensors[0]
    assert tensor.identity == fmt.legacy_identity and tensor.exponent is None
    codes = legacy["state"][0]["momentum_code"].numpy().view(np.uint16)
    assert np.array_equal(state_file.values(tensor)[0].view(np.uint32), fmt.code.decode(codes).view(np.uint32))
    opt.load_state_dict(legacy)  # the optimizer reads these codes with exponent 0 too
    assert int(opt.state[opt.param_groups[0]["params"][0]]["mu_exponent"]) == 0
    damaged = opt.state_dict()
    del damaged["state"][1]["mu_exponent"]
    torch.save(damaged, tmp_path / "missing.pt")
    with pytest.raises(InspectError, match=r"state\[1\]\['mu_exponent'\] \(down\.weight\) is missing: .*codes times "
                                           r"2\*\*mu_exponent"):
        load_state_file(tmp_path / "missing.pt")
    legacy["state"][1]["mu_exponent"] = torch.tensor(3, dtype=torch.int32)
    torch.save(legacy, tmp_path / "legacy-with-exponent.pt")
    with pytest.raises(InspectError, match=r"state\[1\]\['mu_exponent'\] \(down\.weight\): muon-packed:mu=SE5M10b40 "
                                           "keeps no per-matrix exponent"):
        load_state_file(tmp_path / "legacy-with-exponent.pt")


def test_inspect_refuses_an_exponent_no_step_stores_naming_the_tensor_and_the_range(tmp_path, capsys):
    """An edited exponent outside the range a step stores (at mu_bias 40, [-139, 137]) is
    refused when the file is read, naming the tensor, the value and the range (core's one
    check, `StateFormat.check_exponent`): in a torch state and in a PortableState."""
    _, opt = trained_muon()
    for exponent in (1000, -300, 200):
        edited = opt.state_dict()
        edited["state"][1]["mu_exponent"] = torch.tensor(exponent, dtype=torch.int32)
        torch.save(edited, tmp_path / "edited.pt")
        with pytest.raises(InspectError, match=rf"^state\[1\]\['mu_exponent'\] \(down\.weight\) is {exponent}, "
                                               r"outside the \[-139, 137\] a step stores with mu_bias 40"):
            load_state_file(tmp_path / "edited.pt")
    portable = opt.export_state()
    portable.exponents[1] = np.array(200, np.int32)
    portable.save(tmp_path / "edited.safetensors")
    assert inspect_main([str(tmp_path / "edited.safetensors")]) == 2
    assert r"exponent.1 (moments.1) is 200, outside the [-139, 137]" in capsys.readouterr().err


def test_the_header_of_a_state_saved_before_the_exponents_counts_saturation_in_the_fixed_window(tmp_path, capsys):
    """A legacy packed Muon state's codes were stored in the code's fixed window (s = 0), where a
    momentum past the largest code saturated: its section is not read as scaled per matrix (no
    "none saturates"), says what the state is, and counts the stored maximum as saturated."""
    _, opt = trained_muon()
    legacy = saved_before_the_exponents(opt)
    legacy["state"][0]["momentum_code"].view(-1)[:3] = 0x7FFF  # the largest code: a saturated momentum
    torch.save(legacy, tmp_path / "legacy.pt")
    report = report_of(tmp_path / "legacy.pt", capsys)
    assert report["sections"][0]["saved_without_exponents"] and not report["sections"][0]["scaled_per_matrix"]
    assert report["tensors"][0]["mu"]["counts"]["saturated"] == 3 and report["total"]["mu"]["counts"]["saturated"] == 3
    assert report["suggestion"]["bias_independent"]  # continued, it is scaled per matrix: still no bias to choose
    assert inspect_main([str(tmp_path / "legacy.pt")]) == 0
    header = capsys.readouterr().out.split("\nup.weight")[0]  # the section's lines before its first tensor
    assert "none saturates" not in header and "relative to each matrix's exponent" not in header
    assert "saved before the per-matrix exponents" in header and "fixed window" in header
    torch.save(opt.state_dict(), tmp_path / "today.pt")
    assert inspect_main([str(tmp_path / "today.pt")]) == 0
    assert "none saturates" in capsys.readouterr().out.split("\nup.weight")[0]


def test_muon_windows_count_the_flushes_and_subnormals_the_packed_step_counts(tmp_path, capsys):
    """One step on gradients over 50 binades: the largest |m'| of each matrix is one binade below
    the code's largest, so nothing saturates at any bias, and the smallest go subnormal or flush.
    An fp32-mode state, counted as the packed step would encode it, gives the packed step's own
    format counts; the packed state's codes give its subnormals (a flushed one reads as zero)."""
    reports, stats = {}, {}
    for mode in ("packed", "fp32"):
        torch.manual_seed(0)
        model = TinyModel()
        opt = PackedMuon([("up.weight", model.up.weight), ("down.weight", model.down.weight)], mode=mode,
                         mu_bias=40, track_format=mode == "packed")
        rng = np.random.default_rng(7)
        for p in (model.up.weight, model.down.weight):
            p.grad = gradient(rng, tuple(p.shape), -50, 0)
        opt.step()
        stats[mode] = opt.format_stats() if mode == "packed" else None
        torch.save(opt.state_dict(), tmp_path / f"{mode}.pt")
        reports[mode] = {t["name"]: t["mu"]["counts"] for t in report_of(tmp_path / f"{mode}.pt", capsys)["tensors"]}
    for name, counted in stats["packed"].items():
        wider, stored = reports["fp32"][name], reports["packed"][name]
        assert counted["saturated_mu"] == wider["saturated"] == stored["saturated"] == 0, name
        assert counted["flushed_mu"] == wider["flushed"] > 0 and stored["flushed"] == 0, name
        assert counted["subnormal_mu"] == wider["subnormal"] == stored["subnormal"] > 0, name
        assert stored["zero"] == wider["zero"] + wider["flushed"], name


def test_saved_format_counts_are_shown(tmp_path, capsys):
    """A state entry named by the rule's count names (Rule.count_names: `saturated_mu`, ...) is
    a saved format count: shown with the tensor, never taken for the state."""
    _, opt = trained_muon()
    sd = opt.state_dict()
    sd["state"][0].update(saturated_mu=torch.tensor(7), flushed_mu=0, subnormal_mu=torch.tensor(2))
    torch.save(sd, tmp_path / "muon.pt")
    report = report_of(tmp_path / "muon.pt", capsys)
    assert report["tensors"][0]["format_counts"] == {"saturated_mu": 7, "flushed_mu": 0, "subnormal_mu": 2}
    assert report["tensors"][1]["format_counts"] is None
    assert inspect_main([str(tmp_path / "muon.pt")]) == 0
    assert "saved format counts: saturated_mu 7, flushed_mu 0, subnormal_mu 2" in capsys.readouterr().out


def test_a_third_rule_plugs_in_through_the_registry(tmp_path, capsys, monkeypatch):
    """A rule is one entry of core/rules.py's RULES: its identities parse back and inspect
    reports its codes (here a stand-in: Muon's format and codes under another name)."""
    sign_rule = dataclasses.replace(MuonFormat().rule, name="sign")

    @dataclasses.dataclass(frozen=True)
    class SignFormat(MuonFormat):
        @property
        def identity(self) -> str:
            return "sign-" + super().identity

        @property
        def rule(self):
            return sign_rule

    monkeypatch.setitem(RULES, "sign", RuleFormats(sign_rule, SignFormat, ("packed", "fp32"), momentum_values))
    fmt = SignFormat("packed", 20)
    assert state_format_from_identity(fmt.identity) == fmt
    codes = np.arange(0, 2**16, 2**8, dtype=np.uint16).reshape(16, 16)
    PortableState(fmt.identity, [None], [codes], exponents=[np.array(3, np.int32)]).save(tmp_path / "sign.safetensors")
    report = report_of(tmp_path / "sign.safetensors", capsys)
    assert report["rule"] == "sign" and report["windows"]["mu"]["format"] == "SE5M10b20"
    assert report["tensors"][0]["mu"]["counts"] == window_histogram(fmt.code.decode(codes), fmt.code).counts
    assert report["tensors"][0]["exponents"]["values"] == [3]
    assert report["suggestion"]["all"]["identity"].startswith("sign-muon-packed:mu=SE5M10b")
    assert inspect_main([str(tmp_path / "sign.safetensors"), "--explain", "#0[3]", "--grad", "1", "--param", "0"]) == 2
    assert "Newton-Schulz" in capsys.readouterr().err  # its declaration has a matrix phase


# ================================================================ damaged states and run directories ====

def damaged_state_dicts():
    """(rule, mode, a saved state_dict with NaN and Inf written into one tensor's state, the
    optimizer that saved it, that tensor's name, (NaN, Inf) per code): states the optimizers
    refuse to load, which inspect must still report on."""
    for mode in ("fp32", "bf16"):
        _, opt = trained_muon(mode)
        sd = opt.state_dict()
        fmt = opt.state_format
        stored = sd["state"][0][fmt.state_key].clone()
        flat = stored.view(-1)
        if mode == "fp32":
            flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("inf")])
        else:  # bf16 codes with the exponent all ones: NaN, +Inf, -Inf
            flat[:4] = torch.tensor([0x7FC0, 0x7F80, 0xFF80 - 2**16, 0x7F80], dtype=torch.int16)
        sd["state"][0][fmt.state_key] = stored
        yield "muon", mode, sd, opt, "up.weight", {"mu": (1, 3)}
    _, opt = trained_optimizer(mode="fp32")
    sd = opt.state_dict()
    moments = sd["state"][0]["moments"].clone()
    moments[0].view(-1)[0] = float("inf")  # an Inf first moment: once "even bias 0 saturates"
    moments[1].view(-1)[1] = -1.0  # a negative v: its RMS, sqrt(v), is NaN
    moments[1].view(-1)[2] = float("nan")
    sd["state"][0]["moments"] = moments
    yield "adamw", "fp32", sd, opt, "0.weight", {"m": (0, 1), "rms": (2, 0)}


def test_inspect_reports_nonfinite_values_first_and_leaves_them_out(tmp_path, capsys):
    """W3: a state holding NaN or Inf (which the optimizers refuse to load) is still reported:
    NaN and Inf counted per tensor and code, shown first naming the tensor, and left out of the
    window counts, quantiles and bias suggestions."""
    for rule, mode, sd, opt, name, expected in damaged_state_dicts():
        path = tmp_path / f"{rule}-{mode}.pt"
        torch.save(sd, path)
        with pytest.raises(ValueError, match="NaN"):  # the refusal the report announces
            opt.load_state_dict(sd)
        report = report_of(path, capsys, "--mu-bias", "40", "--m-bias", "15", "--rms-bias", "15")
        (damaged,) = report["nonfinite"]
        assert damaged["name"] == name and damaged["key"].endswith(f"[{opt.state_format.state_key!r}]")
        assert {suffix: (c["nan"], c["inf"]) for suffix, c in damaged["codes"].items()} == expected
        left_out = 3 if rule == "adamw" else 4  # elements with NaN or Inf in any code
        assert damaged["left_out"] == left_out
        assert "refuse" in report["nonfinite_note"] and "load_state_dict" in report["nonfinite_note"]
        state_file = load_state_file(path)

        def finite(tensor):  # each code's values at the elements whose every code is finite
            values = [x.ravel() for x in state_file.values(tensor)]
            return [x[np.logical_and.reduce([np.isfinite(y) for y in values])] for x in values]

        windows = [momentum_format(40)] if rule == "muon" else [first_moment_format(15), rms_format(15)]
        codes = [c["suffix"] for c in report["codes"]]
        for t in report["tensors"]:
            assert t["left_out"] == (left_out if t["name"] == name else 0)
            for suffix, x, window in zip(codes, finite(state_file.find(t["name"])), windows):
                encoded = as_packed_codes(x, 40) if rule == "muon" else x  # scaled by the finite ones' exponent
                assert t[suffix]["counts"] == window_histogram(encoded, window).counts and t[suffix]["total"] == x.size
        per_code = list(zip(*(finite(t) for t in state_file.tensors)))
        suggested = suggest_state_biases(rule, [list(xs) for xs in per_code]).biases
        assert {k: report["suggestion"]["all"][k] for k in suggested} == suggested
        for suffix in codes:
            choice = report["suggestion"]["all"][suffix]
            assert "even bias" not in choice["reason"] and math.isfinite(choice["maximum"])
        assert inspect_main([str(path)]) == 0
        text = capsys.readouterr().out
        head = text[:text.index(f"rule {rule},")]  # what comes before the statistics
        assert f"{name} (" in head and "NaN" in head and "Inf" in head and "refuse to load it" in head


def test_magnitude_statistics_refuse_nan_and_inf_counting_each():
    """The library's own statistics refuse what has no place in a window, counting NaN and Inf
    apart (an Inf used to give a suggestion 'even bias 0 saturates')."""
    with pytest.raises(ValueError, match=r"1 NaN and 2 Inf"):
        magnitude_quantiles(F32([1.0, np.nan, np.inf, -np.inf]))
    with pytest.raises(ValueError, match=r"0 NaN and 1 Inf"):
        suggest_biases(F32([1e-3, np.inf]), F32([1e-3, 1e-3]))


def test_inspect_reads_a_chat_train_run_directory(tape, tmp_path, capsys):
    """W13: a chat_train run directory holds state_stepNNNNNN.safetensors files: the newest is
    read, and the report says which (and which others there are); a directory with neither a
    trainer checkpoint nor a training state is refused, saying what it looks for."""
    run = Run(tape, torch.bfloat16)
    run.train(1)
    run.save(tmp_path)
    run.train(1)
    newest = run.save(tmp_path)
    (tmp_path / "log.jsonl").write_text("")
    report = report_of(tmp_path, capsys)
    assert report["path"] == str(newest) and report["kind"] == "training state" and report["trainer_step"] == 2
    assert "state_step000002.safetensors" in report["chosen"] and "state_step000001.safetensors" in report["chosen"]
    assert inspect_main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "newest of 2 training states" in text and "state_step000001.safetensors" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert inspect_main([str(empty)]) == 2
    error = capsys.readouterr().err
    assert "checkpoint.safetensors" in error and "state_stepNNNNNN.safetensors" in error
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")  # two trainers' files: which one is meant is asked
    assert inspect_main([str(tmp_path)]) == 2
    assert "pass the file to read" in capsys.readouterr().err
