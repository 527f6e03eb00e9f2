"""The numpy codecs (core/codecs.py) against the scalar authority (core/authority.py) and
against the rounding rules of docs/FORMAT.md, code by code; the rule declarations (core/rule.py,
core/adamw/rule.py) against what the state format, validation and launch layout do."""
from __future__ import annotations

import numpy as np
import pytest

from packed_adamw.core import FP16, StateFormat, first_moment_format, pack_words, rms_format, unpack_words
from packed_adamw.core import authority as A

F32 = np.float32
U32 = np.uint32
ALL_CODES = np.arange(1 << 16, dtype=np.uint32)
# Huge and non-finite inputs are deliberate; numpy and the interpreter warn on their overflow.
# (numpy codec, authority codec); biases: the default, a non-default one, and both ends of the range.
CODECS = {
    "E4M11b15": (first_moment_format(15), A.Codec(True, 4, 11, 15)),
    "E4M11b18": (first_moment_format(18), A.Codec(True, 4, 11, 18)),
    "E4M11b0": (first_moment_format(0), A.Codec(True, 4, 11, 0)),
    "E4M11b100": (first_moment_format(100), A.Codec(True, 4, 11, 100)),
    "E4M12b15": (rms_format(15), A.Codec(False, 4, 12, 15)),
    "E4M12b18": (rms_format(18), A.Codec(False, 4, 12, 18)),
    "E4M12b0": (rms_format(0), A.Codec(False, 4, 12, 0)),
    "E4M12b100": (rms_format(100), A.Codec(False, 4, 12, 100)),
    "FP16": (FP16, A.Codec(True, 5, 10, 15, ieee_specials=True)),
}


@pytest.fixture(params=list(CODECS), ids=list(CODECS))
def codec(request):
    return CODECS[request.param]


def bits(x):
    return np.ascontiguousarray(np.asarray(x, dtype=F32)).view(U32)


def finite_codes(fmt):
    """All codes that stand for numbers (FP16's Inf/NaN exponent excluded)."""
    if not fmt.ieee_specials:
        return ALL_CODES
    return ALL_CODES[(ALL_CODES & 0x7C00) != 0x7C00]




def authority_encode(auth, values):
    return np.fromiter((auth.encode(v) for v in np.asarray(values, F32).tolist()), U32, len(values))


def nonnegative_codes(fmt):
    """Codes of values >= 0 in increasing order: the magnitude codes up to the largest finite."""
    return np.arange(fmt.max_magnitude_code + 1, dtype=np.uint32)


# ------------------------------------------------------------------ decoding ----

def test_every_code_decodes_like_the_authority(codec):
    fmt, auth = codec
    codes = finite_codes(fmt)
    expected = np.array([auth.decode(int(c)) for c in codes], dtype=np.float64).astype(F32)
    np.testing.assert_array_equal(bits(fmt.decode(codes)), bits(expected))


def test_every_code_encodes_back_to_itself(codec):
    fmt, auth = codec
    codes = finite_codes(fmt)
    values = fmt.decode(codes)
    # -0 (sign bit alone) is never produced: zero is canonical code 0.
    canonical = np.where(codes == fmt.sign_bit, 0, codes) if fmt.signed else codes
    np.testing.assert_array_equal(fmt.encode(values).astype(U32), canonical)
    np.testing.assert_array_equal(authority_encode(auth, values), canonical)


def test_minus_zero_code_decodes_to_minus_zero():
    for fmt in (first_moment_format(15), FP16):
        assert bits(fmt.decode([0x8000]))[0] == 0x80000000


def test_fp16_special_codes_decode_to_inf_and_nan():
    specials = ALL_CODES[(ALL_CODES & 0x7C00) == 0x7C00]
    values = FP16.decode(specials)
    fraction_zero = (specials & 0x3FF) == 0
    assert np.all(np.isposinf(values[fraction_zero & (specials < 0x8000)]))
    assert np.all(np.isneginf(values[fraction_zero & (specials >= 0x8000)]))
    assert np.all(np.isnan(values[~fraction_zero]))
    assert fraction_zero.sum() == 2 and (~fraction_zero).sum() == 2 * 1023


def test_decoding_is_strictly_monotone(codec):
    fmt, _ = codec
    positive = fmt.decode(nonnegative_codes(fmt)).astype(np.float64)
    assert np.all(np.diff(positive) > 0)
    assert positive[0] == 0.0 and positive[-1] == fmt.max_value
    if fmt.signed:
        negative = fmt.decode(nonnegative_codes(fmt) | fmt.sign_bit).astype(np.float64)
        assert np.all(np.diff(negative) < 0)
        np.testing.assert_array_equal(negative, -positive)


def test_format_constants_match_the_spec_table():
    m, r = first_moment_format(), rms_format()
    assert m.max_value == 1.99951171875 and m.min_subnormal == 2.0**-25
    assert r.max_value == 1.999755859375 and r.min_subnormal == 2.0**-26
    assert FP16.max_value == 65504.0 and FP16.min_subnormal == 2.0**-24


# ------------------------------------------------------------------ rounding ----

def test_midpoints_between_adjacent_codes_round_to_even(codec):
    """Every exact midpoint (subnormal, normal and the subnormal->normal boundary) goes to the
    even code; one float32 ulp either side goes to the nearer code."""
    fmt, auth = codec
    codes = nonnegative_codes(fmt)
    values = fmt.decode(codes).astype(np.float64)
    mid = (values[:-1] + values[1:]) / 2
    mid32 = mid.astype(F32)
    assert np.array_equal(mid32.astype(np.float64), mid)  # exactly representable
    low, high = codes[:-1], codes[1:]
    even = np.where(low % 2 == 0, low, high)
    got = fmt.encode(mid32).astype(U32)
    np.testing.assert_array_equal(got, even)
    np.testing.assert_array_equal(fmt.encode(np.nextafter(mid32, F32(0))).astype(U32), low)
    np.testing.assert_array_equal(fmt.encode(np.nextafter(mid32, F32(np.inf))).astype(U32), high)
    # The boundary pair is in there; check it by name so a range mistake cannot hide it.
    boundary = (1 << fmt.fraction_bits) - 1  # largest subnormal code
    assert values[boundary + 1] == fmt.min_normal
    stride = max(1, len(mid32) // 4000)  # the authority, on a spread of midpoints
    sample = np.r_[np.arange(0, len(mid32), stride), boundary - 1, boundary, boundary + 1]
    np.testing.assert_array_equal(authority_encode(auth, mid32[sample]), even[sample])
    if fmt.signed:  # ties to even on the magnitude, sign restored
        neg = fmt.encode(-mid32[1:]).astype(U32)
        np.testing.assert_array_equal(neg, even[1:] | fmt.sign_bit)


def test_largest_value_and_beyond_saturate(codec):
    fmt, auth = codec
    top = F32(fmt.max_value)
    beyond = np.array([top, np.nextafter(top, F32(np.inf)), top * F32(1.5), top * F32(2.0),
                       F32(3.4028235e38), F32(np.inf)], F32)
    expected = np.full(beyond.shape, fmt.max_magnitude_code, U32)
    np.testing.assert_array_equal(fmt.encode(beyond).astype(U32), expected)
    np.testing.assert_array_equal(authority_encode(auth, beyond), expected)
    if fmt.signed:
        np.testing.assert_array_equal(fmt.encode(-beyond).astype(U32), expected | fmt.sign_bit)


def test_fp16_saturates_where_ieee_would_round_to_inf():
    # IEEE rounds [65520, inf) to Inf; the spec saturates at 65504 instead.
    values = np.array([65504.0, 65519.0, 65520.0, 65536.0, 1e6], F32)
    np.testing.assert_array_equal(FP16.encode(values), np.full(5, 0x7BFF, np.uint16))
    np.testing.assert_array_equal(FP16.encode(-values), np.full(5, 0xFBFF, np.uint16))


def test_smallest_subnormal_and_its_half(codec):
    fmt, auth = codec
    s = F32(fmt.min_subnormal)
    cases = {
        s: 1,
        s / F32(2): 0,  # exactly half: tie to even is 0
        np.nextafter(s / F32(2), F32(np.inf)): 1,  # just above half rounds up
        np.nextafter(s / F32(2), F32(0)): 0,
        s * F32(1.5): 2,  # tie between 1 and 2
        s * F32(2.5): 2,  # tie between 2 and 3
        F32(0.0): 0,
        F32(-0.0): 0,
    }
    values = np.array(list(cases), F32)
    expected = np.array(list(cases.values()), U32)
    np.testing.assert_array_equal(fmt.encode(values).astype(U32), expected)
    np.testing.assert_array_equal(authority_encode(auth, values), expected)


def test_tiny_negatives_round_to_code_zero_not_minus_zero():
    for fmt in (first_moment_format(15), first_moment_format(18), FP16):
        s = F32(fmt.min_subnormal)
        tiny = np.array([-0.0, -s / F32(2), -s / F32(3), -F32(1e-45)], F32)
        np.testing.assert_array_equal(fmt.encode(tiny), np.zeros(4, np.uint16))


def test_minus_zero_into_unsigned_format_is_code_zero():
    assert rms_format().encode(np.array([-0.0], F32))[0] == 0


def test_nan_is_refused(codec):
    fmt, auth = codec
    with pytest.raises(ValueError, match="NaN"):
        fmt.encode(np.array([1.0, np.nan], F32))
    with pytest.raises(ValueError):
        auth.encode(float("nan"))


def test_negative_values_into_unsigned_format_are_refused():
    with pytest.raises(ValueError, match="unsigned"):
        rms_format().encode(np.array([0.5, -1e-3], F32))


def test_decode_refuses_codes_wider_than_16_bits():
    with pytest.raises(ValueError):
        first_moment_format().decode(np.array([0x10000], U32))


def random_finite_float32(rng, n, fmt):
    """Half random bit patterns (every float32 magnitude), half log-uniform around the format."""
    patterns = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32).view(F32)
    patterns = patterns[np.isfinite(patterns)]
    lo, hi = np.log2(fmt.min_subnormal) - 4, np.log2(fmt.max_value) + 4
    near = (np.exp2(rng.uniform(lo, hi, n)) * rng.uniform(1, 2, n)).astype(F32)
    near *= rng.choice(np.array([-1, 1], F32), n)
    values = np.concatenate([patterns, near])
    return values if fmt.signed else np.abs(values)


def test_numpy_encode_agrees_with_authority_on_random_values(codec):
    fmt, auth = codec
    values = random_finite_float32(np.random.default_rng(20261129), 150_000, fmt)
    assert values.size >= 200_000
    expected = authority_encode(auth, values)
    got = fmt.encode(values).astype(U32)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, f"{bad.size} differ, e.g. {values[bad[:3]]!r}: {got[bad[:3]]} vs {expected[bad[:3]]}"


# ------------------------------------------------------------------- words ----

def test_pack_unpack_round_trip():
    rng = np.random.default_rng(1)
    m = rng.integers(0, 1 << 16, 10_000).astype(np.uint16)
    r = rng.integers(0, 1 << 16, 10_000).astype(np.uint16)
    words = pack_words(m, r)
    assert words.dtype == np.uint32
    m2, r2 = unpack_words(words)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(r2, r)
    np.testing.assert_array_equal(pack_words(*unpack_words(words)), words)


def test_first_moment_is_the_high_half():
    assert int(pack_words(np.array([0x1234]), np.array([0xABCD]))[0]) == 0x1234ABCD


# ------------------------------------------------------------- state format ----

def test_identity_strings_are_distinct_and_documented():
    formats = [StateFormat("packed"), StateFormat("packed", m_bias=18), StateFormat("packed", rms_bias=18),
               StateFormat("packed", 18, 18), StateFormat("fp16"), StateFormat("fp32")]
    identities = [f.identity for f in formats]
    assert len(set(identities)) == len(identities)
    assert StateFormat().identity == "packed:m=SE4M11b15,rms=UE4M12b15"  # FORMAT.md's example
    assert StateFormat("packed", 18, 15) == StateFormat("packed", m_bias=18)


@pytest.mark.parametrize("mode", ["packed", "fp16", "fp32"])
def test_state_words_per_param(mode):
    assert StateFormat(mode).state_words_per_param == (2 if mode == "fp32" else 1)


def test_bad_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match="mode='fp8'"):
        StateFormat("fp8")


@pytest.mark.parametrize("kwargs,value", [({"m_bias": 101}, "101"), ({"rms_bias": -1}, "-1"), ({"m_bias": -5}, "-5")])
def test_bad_bias_is_refused(kwargs, value):
    with pytest.raises(ValueError, match=value):
        StateFormat("packed", **kwargs)


@pytest.mark.parametrize("name", ["m_bias", "rms_bias"])
def test_bad_bias_error_names_the_argument(name):
    with pytest.raises(ValueError, match=name):
        StateFormat("packed", **{name: 101})


@pytest.mark.parametrize("bias", [0, 100])
def test_bias_range_ends_are_accepted(bias):
    StateFormat("packed", m_bias=bias, rms_bias=bias)


# ------------------------------------------------------ authority edge cases ----

@pytest.mark.parametrize("name,sign", [("E4M11b15", 1.0), ("E4M11b15", -1.0), ("E4M12b15", 1.0),
                                       ("FP16", 1.0), ("FP16", -1.0)])
def test_authority_saturates_infinity(name, sign):
    fmt, auth = CODECS[name]
    expected = fmt.max_magnitude_code | (fmt.sign_bit if sign < 0 else 0)
    assert int(fmt.encode(np.array([sign * np.inf], F32))[0]) == expected  # numpy is right
    assert auth.encode(sign * float("inf")) == expected


@pytest.mark.parametrize("name", ["E4M11b0", "E4M12b0"])
def test_authority_encodes_top_binade_at_bias_0(name):
    fmt, auth = CODECS[name]
    codes = np.arange(fmt.max_exponent_code << fmt.fraction_bits, fmt.max_magnitude_code + 1, dtype=U32)
    values = fmt.decode(codes)
    np.testing.assert_array_equal(fmt.encode(values).astype(U32), codes)  # numpy is right
    np.testing.assert_array_equal(authority_encode(auth, values), codes)


# ---- the rule's declaration: one home for the state layout, the bounds, the counter row ----

@pytest.mark.parametrize("mode", ["packed", "fp16", "fp32"])
def test_state_layout_comes_from_the_rules_declaration(mode):
    from packed_adamw.core.adamw.rule import MOMENTS, WORDS

    fmt = StateFormat(mode)
    entry = MOMENTS if mode == "fp32" else WORDS
    assert fmt.state_entry is entry
    assert (fmt.state_key, fmt.state_dtype) == (("moments", "float32") if mode == "fp32" else ("words", "uint32"))
    assert fmt.state_shape((3, 4)) == ((2, 3, 4) if mode == "fp32" else (3, 4))
    assert fmt.flat_state_shape(5) == ((2, 5) if mode == "fp32" else (5,))
    assert fmt.state_bytes_per_param == (8 if mode == "fp32" else 4)
    assert (fmt.low_half_key, fmt.low_half_dtype, fmt.low_half_shape((3, 4))) == ("lo", "int16", (3, 4))
    assert fmt.split_state_bytes_per_param == fmt.state_bytes_per_param + 2


def test_state_entries_shard_past_their_leading_axes():
    from packed_adamw.core.adamw.rule import MOMENTS, WORDS
    from packed_adamw.core.rule import LOW_HALF

    assert MOMENTS.sharding(("data", None)) == (None, "data", None)
    assert MOMENTS.sharded_axis(0) == 1
    assert WORDS.sharding(("data", None)) == ("data", None) == LOW_HALF.sharding(("data", None))
    assert WORDS.sharded_axis(1) == 1


def test_adamw_declares_its_rows_and_counts():
    from packed_adamw.core import launch
    from packed_adamw.core.adamw import FORMAT_COUNTS, RULE, hyperparams

    assert RULE.hyperparam_fields == hyperparams.HPARAM_FIELDS and RULE.hyperparam_row == hyperparams.HPARAM_ROW
    assert RULE.scalar_fields == hyperparams.SCALAR_FIELDS and RULE.scalar_index == hyperparams.SCALAR_INDEX
    assert RULE.count_names == FORMAT_COUNTS and len(FORMAT_COUNTS) <= launch.MAX_FORMAT_COUNTS
    assert FORMAT_COUNTS == ("saturated_m", "saturated_rms", "flushed_m", "flushed_rms", "subnormal_m", "subnormal_rms")
    assert not RULE.matrix_phase
    # A parameter group (torch.optim.AdamW's keys) maps to the hyperparameter row.
    assert RULE.group_keys == ("lr", "betas", "eps", "weight_decay")
    assert RULE.group_row(1e-3, (0.9, 0.999), 1e-8, 0.1) == (1e-3, 0.9, 0.999, 1e-8, 0.1)
    # lr * weight_decay must be a finite float32 number: the host and the rows agree.
    for lr, wd, finite in ((1e19, 1e19, True), (1e20, 1e20, False)):
        with np.errstate(over="ignore"):  # the float32 product overflows to Inf: refused
            assert RULE.rows_valid(np.array([[lr, 0.9, 0.999, 1e-8, wd]], np.float32)).tolist() == [finite]
        assert RULE.field_holds(0, (lr, 0.9, 0.999, 1e-8, wd)) == finite  # the lr's own check reads the product
        if not finite:
            with pytest.raises(ValueError, match="overflows float32"):
                hyperparams.validate_hyperparams(lr, (0.9, 0.999), 1e-8, wd)


def test_adamw_declares_its_row_variants_and_refusal_words():
    """The JAX step's rows come from the rule: the group's row, and the row without weight decay
    for the leaves a mask leaves out; a refused row is explained in the host validation's words."""
    from packed_adamw.core.adamw import RULE, hyperparams
    from packed_adamw.core.rule import RowVariant, Rule

    row = RULE.group_row(1e-3, (0.9, 0.999), 1e-8, 0.1)
    assert RULE.row_group(*row) == (1e-3, (0.9, 0.999), 1e-8, 0.1)  # group_row's inverse
    assert RULE.variant_rows(row) == [row, (1e-3, 0.9, 0.999, 1e-8, 0.0)]
    assert (RULE.leaf_variant(True), RULE.leaf_variant(False)) == (0, 1)
    # The update reads the parameter through weight decay only, which the masked row zeroes.
    assert RULE.param_reading_fields(0) == ("weight_decay",) and RULE.param_reading_fields(1) == ()
    # Values stay as given (JAX passes traced ones): `number` converts, or not.
    marker = object()
    assert RULE.group_row(marker, (0.9, 0.999), 1e-8, 0.1, number=lambda x: x)[0] is marker
    for bad, message in (((1e-3, 1.0, 0.999, 1e-8, 0.1), "Invalid beta parameter at index 0"),
                         ((-1.0, 0.9, 0.999, 1e-8, 0.1), "Invalid learning rate: lr=-1.0"),
                         ((1e20, 0.9, 0.999, 1e-8, 1e20), "overflows float32")):
        with pytest.raises(ValueError, match=message) as raised:
            hyperparams.validate_hyperparams(*RULE.row_group(*bad))
        assert RULE.refusal_reason(bad) == str(raised.value)
    assert RULE.refusal_reason(row) == "[lr, b1, b2, eps, weight_decay] = [0.001, 0.9, 0.999, 1e-08, 0.1]"
    # A declaration that cannot serve a step is refused when it is made.
    fields = dict(name="r", hyperparam_fields=("lr",), scalar_fields=(), bounds={"lr": hyperparams.HPARAM_BOUNDS["lr"]})
    with pytest.raises(ValueError, match="first row variant"):
        Rule(**fields, row_variants=(RowVariant("off", zeroed=("lr",)),))
    with pytest.raises(ValueError, match="among"):
        Rule(**fields, row_variants=(RowVariant("on"), RowVariant("off", zeroed=("wd",))))
    with pytest.raises(ValueError, match="masked_variant"):
        Rule(**fields, masked_variant="group")
    with pytest.raises(ValueError, match="no masked row variant"):
        Rule(**fields).leaf_variant(False)
    assert Rule(**fields).param_reading_fields(0) is None  # undeclared: the update reads the parameter


_EDGES = [0.0, -0.0, -1e-30, 1e-30, float(np.nextafter(F32(1), F32(0))), 1.0, 1 - 1e-9, 2.0,
          1.1754943508222875e-38, 1e-39, 3.4028234663852886e38, 3.5e38, float("inf"), float("nan")]


@pytest.mark.parametrize("field", ["lr", "b1", "b2", "eps", "weight_decay"])
def test_validation_refuses_exactly_what_the_bounds_table_refuses(field):
    from packed_adamw.core.adamw import RULE
    from packed_adamw.core.adamw.hyperparams import HPARAM_BOUNDS, validate_hyperparams

    for value in _EDGES:
        row = {"lr": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, field: value}
        if field == "weight_decay":
            row["lr"] = 0.0  # lr * weight_decay stays finite: the bound alone decides
        with np.errstate(over="ignore"):  # 3.5e38 is Inf in float32, as the step sees it
            valid = bool(HPARAM_BOUNDS[field].holds(float(F32(value))))
        args = (row["lr"], (row["b1"], row["b2"]), row["eps"], row["weight_decay"])
        with np.errstate(over="ignore"):
            # The in-graph check (JAX) is the rule's rows_valid over float32 rows: same verdict.
            float32_row = np.array([[row[name] for name in RULE.hyperparam_fields]], np.float32)
            assert RULE.rows_valid(float32_row).tolist() == [valid], (field, value)
            # The host's check of one changed field (a scheduler's lr) gives the same verdict.
            assert RULE.field_holds(RULE.hyperparam_fields.index(field),
                                    [row[name] for name in RULE.hyperparam_fields]) == valid, (field, value)
            if valid:
                validate_hyperparams(*args)
            else:
                with pytest.raises(ValueError, match="Invalid"):
                    validate_hyperparams(*args)
    # The table serves arrays too (device-side checks are written from it).
    with np.errstate(over="ignore"):
        values = np.array(_EDGES, np.float32)
    expected = [bool(HPARAM_BOUNDS[field].holds(float(v))) for v in values]
    assert HPARAM_BOUNDS[field].holds(values).tolist() == expected


def test_counter_row_readers_agree_with_its_layout():
    from packed_adamw.core import kernel, launch

    rows = np.arange(2 * launch.COUNTER_ROW, dtype=np.int64).reshape(2, launch.COUNTER_ROW)
    sums = launch.sum_counter_slots(rows)
    for k in range(launch.MAX_FORMAT_COUNTS):
        np.testing.assert_array_equal(sums[:, k], rows[:, launch.format_count_columns(k)].sum(axis=1))
    np.testing.assert_array_equal(launch.nonfinite_counts(rows), rows[:, 0])
    first_slots = [launch.format_count_columns(k).start for k in range(launch.MAX_FORMAT_COUNTS)]
    assert list(range(launch.COUNTER_ROW))[launch.first_slot_columns()] == first_slots
    assert launch.format_count_columns(launch.MAX_FORMAT_COUNTS - 1).stop == launch.COUNTER_ROW
    with pytest.raises(IndexError, match="format count 6"):
        launch.format_count_columns(launch.MAX_FORMAT_COUNTS)
    # Every count has a lane field in the kernels' int32, and add_counts reduces them in pairs.
    assert launch.MAX_FORMAT_COUNTS * kernel.LANE_FIELD.value <= 32
    assert kernel.FORMAT_COUNT_PAIRS.value * 2 == launch.MAX_FORMAT_COUNTS


def test_launch_kinds_in_launch_order():
    from packed_adamw.core import launch

    assert launch.LAUNCH_KINDS == (launch.FP32_KIND, launch.SPLIT_FP32_GRAD_KIND, launch.SPLIT_BF16_GRAD_KIND)
    assert sorted(launch.LAUNCH_KINDS) == list(launch.LAUNCH_KINDS)
    assert [kind.sections for kind in launch.LAUNCH_KINDS] == [3, 4, 4]


@pytest.mark.parametrize("mode", ["packed", "fp16", "fp32"])
def test_kernel_constants_come_from_the_format(mode):
    from packed_adamw.core import launch

    fmt = StateFormat(mode)
    constants = launch.kernel_constants(fmt, write_update=True, count_nonfinite=False, block=512)
    if mode == "fp32":
        assert (constants["M_MAX"], constants["R_MAX"]) == (0, 0)
        with pytest.raises(ValueError, match="fp32 mode has none"):
            launch.kernel_constants(fmt, write_update=True, count_nonfinite=False, block=512, track_format=True)
    else:
        m_fmt, r_fmt = fmt.formats
        assert (constants["M_SIGNED"], constants["M_FRAC"], constants["M_BIAS"], constants["M_MAX"]) == (
            m_fmt.signed, m_fmt.fraction_bits, m_fmt.bias, m_fmt.max_magnitude_code)
        assert (constants["R_SIGNED"], constants["R_FRAC"], constants["R_BIAS"], constants["R_MAX"]) == (
            r_fmt.signed, r_fmt.fraction_bits, r_fmt.bias, r_fmt.max_magnitude_code)


def test_the_1_0_module_paths_still_load_pickles_and_imports_with_a_deprecation_warning():
    # 1.0 pickled StateFormat (and a pickled PackedAdamW holds one) under packed_adamw.core.formats.
    import importlib
    import pickle
    import sys

    from packed_adamw.core import adamw as core_adamw
    from packed_adamw.core.adamw import numpy_step
    from packed_adamw.core.adamw.state_format import StateFormat as home

    data = pickle.dumps(home(mode="packed", m_bias=12), protocol=2)
    assert b"packed_adamw.core.adamw.state_format" in data
    for name in ("formats", "numpy_step", "hyperparams"):
        sys.modules.pop(f"packed_adamw.core.{name}", None)
    with pytest.warns(DeprecationWarning, match="core.formats is deprecated"):
        loaded = pickle.loads(data.replace(b"packed_adamw.core.adamw.state_format", b"packed_adamw.core.formats"))
    assert loaded == home(mode="packed", m_bias=12) and type(loaded) is home
    with pytest.warns(DeprecationWarning, match="core.numpy_step is deprecated"):
        assert importlib.import_module("packed_adamw.core.numpy_step").apply_step is numpy_step.apply_step
    with pytest.warns(DeprecationWarning, match="core.hyperparams is deprecated"):
        old = importlib.import_module("packed_adamw.core.hyperparams")
    assert old.validate_hyperparams is core_adamw.validate_hyperparams and old.FLOAT32_MAX == 3.4028234663852886e38
