"""The state types of `packed_adamw` and `packed_muon`, and what every reader of them shares: the
state format a transform is built with, the leaves' dtypes and names, the low halves of bfloat16
leaves, the zero format counts. The transforms (transform.py, muon.py) and the state's movers
(_state_io.py, _muon_portable.py) all read them here.

Each type keeps the module path it has always had (`packed_adamw.jax.transform.PackedAdamWState`,
`packed_adamw.jax.muon.PackedMuonState`), the public modules re-export it, so pickles made before
and after this module existed name the same classes. (So `inspect.getsource` does not find them:
it looks in the module they name. Their annotations name `jax` and `Any`, which both public
modules import, so `typing.get_type_hints` resolves there.)"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.core import DEFAULT_M_BIAS, DEFAULT_RMS_BIAS, StateFormat

from ._masters import BF16, FLOAT32, LOW_HALF

TRANSFORM_MODULE, MUON_MODULE = "packed_adamw.jax.transform", "packed_adamw.jax.muon"


class FormatCounts(NamedTuple):
    """The format counts of docs/FORMAT.md ("Format counts"), cumulative since `init` (or
    `import_state`). `steps`: the steps counted (int32; a step refused whole is not).
    `counts`: uint32 [n_leaves, len(FORMAT_COUNTS), 2], leaves in tree order, counts in
    `FORMAT_COUNTS` order, each a 64-bit total as its low and high 32 bits (exact without
    `jax_enable_x64`). Replicated on every device. `format_stats` reads them."""

    steps: jax.Array
    counts: jax.Array


class PackedAdamWState(NamedTuple):
    """The state of `packed_adamw` (and of the fused step): one type for every tree, as optax
    keeps one state type per transformation; the fields a tree does not use are None, which
    holds no arrays.

    `count`: steps taken (int32). `moments`: per leaf, uint32 words of the leaf's shape
    (packed, fp16) or float32 of shape [2, *shape] (fp32), sharded as the leaf is.
    `low_halves`: None when no leaf is bfloat16; otherwise the parameters' tree with, per
    bfloat16 leaf, the int16 low half of its exact FP32 master (docs/FORMAT.md, "Split
    masters"; the leaf's shape and sharding) and None per float32 leaf; `master_weights(params,
    state)` joins them with the weights. `format_counts`: the `FormatCounts` of a transform
    built with `track_format=True`, else None.

    A float32 tree's state thus holds exactly `count` and `moments` (plus the counts when
    tracked), with the key paths of the earlier per-feature types, so pytree checkpoints
    keyed by path and `PortableState`s load as before."""

    count: jax.Array
    moments: Any
    low_halves: Any = None
    format_counts: FormatCounts | None = None


class PackedMuonState(NamedTuple):
    """The state of `packed_muon`.

    `count`: steps taken (int32; a step refused for invalid hyperparameters does not count).
    `momentum`: the parameters' tree with, per Muon leaf, its momentum entry of the leaf's
    shape (uint16 codes in packed and bf16 modes: 2 bytes per parameter; float32 in fp32 mode)
    and `optax.MaskedNode()` per AdamW leaf. `low_halves`: None when no Muon leaf is bfloat16;
    else the tree with the int16 low half of each bfloat16 Muon leaf's FP32 master
    (docs/FORMAT.md, "Split masters") and MaskedNode elsewhere. `adamw`: the AdamW half's state
    (`optax.masked` around `packed_adamw`: its `inner_state` is a `PackedAdamWState` over the
    AdamW leaves). `exponents` (packed mode; None in bf16 and fp32 modes): the tree with each
    Muon leaf's int32 exponents, one per matrix (shape (): a 2-D leaf; its batch axes' for a
    leaf of several), the momentum of a code c being decode(c) * 2**exponent (MUON.md), and
    MaskedNode elsewhere. A packed state without them (made before they were kept: an unpickled
    one, or one built with four fields) is refused naming `exponents`; one made before them
    continues with `state._replace(exponents=tx.init(params).exponents)` (its codes read with
    exponent 0, the values they had: docs/MUON.md, "JAX / optax")."""

    count: jax.Array
    momentum: Any
    low_halves: Any
    adamw: Any
    exponents: Any = None


# The public modules' paths: pickles name these (see the module's docstring).
FormatCounts.__module__ = PackedAdamWState.__module__ = TRANSFORM_MODULE
PackedMuonState.__module__ = MUON_MODULE


def _is_ours(x) -> bool:
    return isinstance(x, PackedAdamWState)


def _zero_format_counts(n_leaves: int, count_names: tuple[str, ...]) -> FormatCounts:
    """No counts yet of `n_leaves` leaves, each of a rule's `count_names`."""
    return FormatCounts(steps=jnp.zeros([], jnp.int32),
                        counts=jnp.zeros((n_leaves, len(count_names), 2), jnp.uint32))


def state_format(mode: str | StateFormat = "packed", m_bias: int | None = None,
                 rms_bias: int | None = None) -> StateFormat:
    """The `StateFormat` named by `mode` (a mode string or a `StateFormat`) and the biases.

    The biases fix the layout of every state word, so they must be known before compilation.
    `optax.inject_hyperparams` turns numeric arguments into arrays and leaves other objects
    as they are: pass the biases inside a `StateFormat` (`mode=StateFormat("packed", 18, 18)`)
    to keep them static without `static_args`."""
    for name, bias in (("m_bias", m_bias), ("rms_bias", rms_bias)):
        if bias is not None and (isinstance(bias, (jax.Array, np.ndarray, bool, np.bool_))
                                 or not isinstance(bias, numbers.Integral)):
            raise TypeError(
                f"packed_adamw: {name}={bias!r} is not a Python int. The exponent biases fix the state "
                "format, so they must be known before compilation; optax.inject_hyperparams turns numeric "
                "arguments into arrays. Pass the biases in a format object instead, e.g. "
                f"mode=StateFormat('packed', m_bias=..., rms_bias=...) (from packed_adamw.core), or list "
                f"{name!r} in inject_hyperparams' static_args"
            )
    if isinstance(mode, StateFormat):
        for name, bias in (("m_bias", m_bias), ("rms_bias", rms_bias)):
            if bias is not None and bias != getattr(mode, name):
                raise ValueError(f"packed_adamw: {name}={bias} contradicts mode={mode!r}; give the biases once, "
                                 "in the StateFormat")
        return mode
    if not isinstance(mode, str):
        raise TypeError(f"packed_adamw: mode={mode!r} must be a mode name ('packed', 'fp16', 'fp32') or a "
                        "StateFormat")
    return StateFormat(mode, DEFAULT_M_BIAS if m_bias is None else m_bias,
                       DEFAULT_RMS_BIAS if rms_bias is None else rms_bias)


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _split_flags(params, what: str = "params", name: str = "packed_adamw") -> list[bool]:
    """Per leaf: True for a bfloat16 leaf (a split master), False for a float32 one; any
    other dtype is refused, naming the leaf."""
    flags = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if dtype == jnp.float16:
            raise TypeError(
                f"{what} leaf {_leaf_name(path)} has dtype float16: {name} trains float32 or bfloat16 "
                "parameters (a bfloat16 leaf keeps an exact FP32 master: its weight plus a 2-byte low half in the "
                "state); convert it with .astype(jnp.bfloat16) or .astype(jnp.float32)")
        if dtype not in (FLOAT32, BF16):
            raise TypeError(
                f"{what} leaf {_leaf_name(path)} has dtype {dtype}: {name} trains float32 or bfloat16 "
                "parameters; convert it with .astype(jnp.float32) or .astype(jnp.bfloat16)")
        flags.append(dtype == BF16)
    return flags


def _check_low_halves(state, treedef, params, split: list[bool], name: str = "packed_adamw") -> list:
    """packed_adamw's low halves per leaf (`checked_low_halves`), where the weights can also move
    through master_weights() / load_master_weights()."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return checked_low_halves(name, state.low_halves, treedef, [leaf for _, leaf in flat],
                              [_leaf_name(path) for path, _ in flat], split,
                              move="move the weights with master_weights() / load_master_weights() into a state built "
                                   "with init() over the new parameters")


def state_entries(name: str, entries: str, tree, treedef) -> list:
    """A state field's tree per leaf, or a refusal naming the field (`entries`: "momentum does")
    where it is not the parameters' tree."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: the state's {entries} not have the parameters' tree ({e}); build the state with "
                         "init() over the same parameters") from None


def checked_low_halves(name: str, low_halves, treedef, leaves: list, paths: list[str], split: list[bool], *,
                       move: str = "", rule: str = "") -> list:
    """The state's low halves per leaf (None where a leaf keeps none), checked against the leaves:
    exactly the `split` ones (the bfloat16 leaves whose FP32 master the state keeps) have one, int16
    of the leaf's shape. A tree marks a leaf without one by None (packed_adamw's) or
    `optax.MaskedNode` (packed_muon's, whose other leaves are the AdamW half's); `leaves` may hold
    None where only the state is checked. `move`: how else the user can go on, besides a state
    built with init() over these parameters; `rule`: the leaves' kind in the words ("Muon")."""
    fresh = "build the state with init() over these parameters"
    move = move or fresh
    if low_halves is None:
        if any(split):
            raise ValueError(
                f"{name}: params leaf {paths[split.index(True)]} is bfloat16 but the state has no low halves (it was "
                f"built for float32 parameters); {fresh}" + ("" if move == fresh else f", or {move}"))
        return [None] * len(split)
    lows = state_entries(name, "low halves do", low_halves, treedef)
    checked = []
    for path, p, lo, is_split in zip(paths, leaves, lows, split):
        has = not (lo is None or isinstance(lo, optax.MaskedNode))
        if is_split and not has:
            raise ValueError(
                f"{name}: params leaf {path} is bfloat16 but the state has no low half for it (it was built "
                f"for a float32 leaf); keep the leaf's dtype, or {move}")
        if not is_split and has:
            what = "that leaf keeps none here" if p is None else f"the leaf is {jnp.result_type(p)}" + (
                f", not a bfloat16 {rule} leaf" if rule else "")
            raise ValueError(
                f"{name}: the state holds a low half for params leaf {path} (a bfloat16 leaf's FP32 master) "
                f"but {what}; keep the leaf bfloat16, or {move}")
        if has and (tuple(jnp.shape(lo)) != tuple(jnp.shape(p)) or jnp.result_type(lo) != LOW_HALF):
            raise ValueError(f"{name}: the low half of leaf {path} is {jnp.result_type(lo)} {jnp.shape(lo)}, "
                             f"expected {LOW_HALF} {jnp.shape(p)}; build the state with init() over these parameters")
        checked.append(lo if has else None)
    return checked
