"""Moving a packed_adamw state: `export_state` / `import_state` (PortableState, to and from torch's
PackedAdamW) and `master_weights` / `load_master_weights` (the FP32 masters of bf16 leaves).
Their names are packed_adamw.jax's and transform.py's; the state types are `_states.py`'s."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from packed_adamw.core import StateFormat
from packed_adamw.core.codecs import SPLIT_MASTER_MAX
from packed_adamw.core.portable import PortableState
from packed_adamw.core.rule import MAX_STEP_COUNT, StateLayout

from . import _masters
from ._hyperparams import _as_step_count, _is_step_count
from ._masters import FLOAT32
from ._sharding import state_spec
from ._states import PackedAdamWState, PackedMuonState, _check_low_halves, _is_ours, _leaf_name, _split_flags, \
    _zero_format_counts, state_format

# ---- PortableState ------------------------------------------------------------------------------
def _export_format(mode, m_bias, rms_bias) -> StateLayout:
    """The state format the words hold: AdamW's named by `mode` and the biases (`state_format`),
    or another rule's format object (a `packed_rule` transform's `fmt`), taken as it is; a rule
    with a matrix phase (Muon) has no `packed_rule` state, and its packed momenta need their
    per-matrix exponents, which a packed_rule state does not hold."""
    if isinstance(mode, StateLayout) and not isinstance(mode, StateFormat):
        if mode.rule.matrix_phase:
            raise ValueError(f"{mode.identity} is rule {mode.rule.name!r}'s format, which steps whole matrices: its "
                             "state is no packed_rule state; move a packed_muon state with export_muon_state / "
                             "import_muon_state (packed_adamw.jax.muon)")
        if m_bias is not None or rms_bias is not None:
            raise ValueError(f"m_bias / rms_bias are AdamW's biases; {type(mode).__name__} holds its own format: "
                             "leave them out")
        return mode
    return state_format(mode, m_bias, rms_bias)


def export_state(state: PackedAdamWState, mode: str | StateFormat | StateLayout, *,
                 m_bias: int | None = None, rms_bias: int | None = None) -> PortableState:
    """The state in leaf order, for `PackedAdamW.import_state`. `mode` (and biases, or a
    `StateFormat`; for another rule's `packed_rule`, its state format) must be the transform's:
    the words do not say which format they hold, and the export records it for the importer to
    check. The low halves of bfloat16 leaves go with it (torch's bf16 parameters take them).
    Format counts are not exported."""
    if not isinstance(state, PackedAdamWState):
        raise TypeError(f"export_state: the state is a {type(state).__name__}; pass the state of packed_adamw "
                        "(or of packed_rule; packed_muon's with export_muon_state)")
    fmt = _export_format(mode, m_bias, rms_bias)
    leaves, treedef = jax.tree_util.tree_flatten(state.moments)
    count = exported_count(state.count, "export_state")
    lows = None
    if state.low_halves is not None:
        lows = [None if lo is None else np.array(lo) for lo in treedef.flatten_up_to(state.low_halves)]
        lows = lows if any(lo is not None for lo in lows) else None
    return PortableState(fmt.identity, [count] * len(leaves), [np.array(leaf) for leaf in leaves], lows)


def exported_count(count, name: str, what: str = "") -> int:
    """A state's count as the export writes it, refused (naming `what`, "AdamW half's ") where it is
    not one every import takes: an export is checked as its import will be, so no file is written
    that cannot be read back."""
    if not _is_step_count(count):
        raise ValueError(f"{name}: the state's {what}step count is {_as_step_count(count)!r}, which is not a step "
                         f"count (a whole number from 0 to {MAX_STEP_COUNT}), so no import would take the file: "
                         "the state is damaged; export one restored from a checkpoint")
    return int(_as_step_count(count))


def _placed_like(moments: np.ndarray, param, fmt: StateFormat | None):
    """An imported state leaf on the devices of its (concrete) parameter, sharded alike (the
    moments for `fmt`; with `fmt=None`, an array of the parameter's shape: a low half)."""
    sharding = getattr(param, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (np.ndim(param) - len(sharding.spec))
        spec = spec if fmt is None else state_spec(spec, fmt)
        return jax.device_put(moments, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec)))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(moments, sharding)
    return jnp.asarray(moments)


def import_state(portable: PortableState, params, mode: str | StateFormat | StateLayout = "packed", *,
                 m_bias: int | None = None,
                 rms_bias: int | None = None,
                 track_format: bool = False):
    """A `PackedAdamWState` for `params` from an exported torch (or JAX) state, placed (and
    sharded) as the parameters are; with `track_format=True` for a transform built so, its
    format counts starting at zero (as torch's do on a load). With bfloat16 leaves it holds
    their low halves: exactly the bfloat16 leaves must have one in the export (torch's bf16
    parameters).

    JAX keeps one step count for all leaves, so every tensor must have taken the same steps:
    a whole number from 0 to `MAX_STEP_COUNT` (2**31 - 2; core/rule.py says why), refused
    otherwise. `mode` as `export_state` takes it.
    """
    fmt = _export_format(mode, m_bias, rms_bias)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    split = _split_flags(params)
    portable.check(fmt, [tuple(jnp.shape(leaf)) for leaf in leaves], split)
    counts = [_as_step_count(c) for c in portable.counts]  # a 0-d integer array (a state's count) as its int
    if len(set(counts)) > 1:
        raise ValueError(
            f"import_state: the tensors have different step counts {sorted(set(counts))}; the JAX "
            "state has one count, so export from an optimizer whose parameters all stepped together"
        )
    count = counts[0] if counts else 0
    if not _is_step_count(count):
        raise ValueError(
            f"import_state: the state's tensors took {count!r} steps, which is not a step count (a whole number from 0 "
            f"to {MAX_STEP_COUNT}): the file was edited or damaged, or (at 2**31 - 1, where the int32 count stops) its "
            "run took every step a state can; import an undamaged state, or start these parameters from init()")
    if track_format and fmt.formats is None:  # (AdamW's fp32 mode)
        raise ValueError(f"import_state: track_format=True counts 16-bit codes; fp32 mode has none ({fmt.identity})")
    count = jnp.asarray(count, jnp.int32)
    moments = treedef.unflatten([_placed_like(m, p, fmt) for m, p in zip(portable.moments, leaves)])
    counts = _zero_format_counts(len(leaves), fmt.rule.count_names) if track_format else None
    lows = None
    if any(split):
        lows = treedef.unflatten([None if lo is None else _placed_like(lo, p, None)
                                  for lo, p in zip(portable.low_halves, leaves)])
    return PackedAdamWState(count, moments, lows, counts)



# ---------------------------------------------------------------------------------------------
# FP32 masters of bfloat16 leaves
# ---------------------------------------------------------------------------------------------
def _the_packed_state(state, what: str):
    """The one packed_adamw state inside an optax state (itself, a chain's, inject_hyperparams')."""

    is_muon = lambda x: isinstance(x, PackedMuonState)  # noqa: E731
    if any(is_muon(x) for x in jax.tree_util.tree_leaves(state, is_leaf=is_muon)):
        # Its AdamW half's state is a packed_adamw state of the AdamW leaves only: read with every
        # parameter, a Muon leaf's low half (in PackedMuonState.low_halves) would be missed or misread.
        raise ValueError(f"{what}: the state is packed_muon's (PackedMuonState), which {what} does not read yet; "
                         "its bfloat16 Muon leaves' low halves are PackedMuonState.low_halves (export_muon_state "
                         "carries them with the rest of the state)")
    found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_ours) if _is_ours(x)]
    if len(found) != 1:
        raise ValueError(f"{what}: the state holds {len(found)} packed_adamw states; pass a packed_adamw state or an "
                         "optax state (a chain's, inject_hyperparams') that holds exactly one")
    return found[0]


def _checked_lows(what: str, params, state) -> list:
    treedef = jax.tree_util.tree_structure(params)
    try:
        return _check_low_halves(state, treedef, params, _split_flags(params))
    except ValueError as e:
        raise ValueError(f"{what}: {str(e).removeprefix('packed_adamw: ')}") from None


def master_weights(params, state):
    """The FP32 master weights, in the parameters' tree: for a bfloat16 leaf its weight joined
    with its low half from the state (docs/FORMAT.md, "Split masters"), a new float32 array
    laid out as the leaf; a float32 leaf as it is. The twin of torch's
    `PackedAdamW.master_weights()`: for saving or evaluating the model in FP32.

    `state` is the packed_adamw state (or an optax state holding exactly one). Works under
    `jax.jit`; an elementwise bit operation, so each device joins its own shards."""
    lows = _checked_lows("master_weights", params, _the_packed_state(state, "master_weights"))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef.unflatten([p if lo is None else _masters.read(p, lo) for p, lo in zip(leaves, lows)])


def load_master_weights(masters, params, state):
    """`(params, state)` holding the FP32 `masters` (a float32 tree of the parameters' shapes,
    as `master_weights` returns it or an FP32 model's parameters): a float32 leaf takes its
    master, a bfloat16 leaf the master's exact split (its weight the master rounded to the
    nearest bf16, ties away from zero, its low half in the returned state), so
    `master_weights` gives the masters back bit for bit. Moments, counts and format counts are
    kept. The twin of torch's `PackedAdamW.load_master_weights`.

    To start bf16 training from FP32 masters: `params = jax.tree.map(lambda m: m.astype(jnp.bfloat16), masters)`
    (for the leaves meant to be bf16), `state = tx.init(params)`, then
    `params, state = load_master_weights(masters, params, state)`.

    `state` is the packed_adamw state or an optax state holding exactly one (replaced in it).
    Non-finite masters (NaN, Inf), and for a bfloat16 leaf masters with no finite bf16 weight
    (|M| > SPLIT_MASTER_MAX), are refused, naming the leaf, before anything changes, when their
    values are known (outside jit); under `jax.jit` they are not checked.
    The masters are placed as the parameters are."""
    ours = _the_packed_state(state, "load_master_weights")
    lows = _checked_lows("load_master_weights", params, ours)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    try:
        master_leaves = treedef.flatten_up_to(masters)
    except (ValueError, TypeError) as e:
        raise ValueError(f"load_master_weights: the masters do not have the parameters' tree ({e}); pass one float32 "
                         "array per parameter leaf, in the parameters' tree") from None
    paths = [_leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    # Every master is checked before any is placed or split: a refusal changes nothing.
    for path, p, m, lo in zip(paths, leaves, master_leaves, lows):
        where = f"load_master_weights: the master of leaf {path}"
        if jnp.result_type(m) != FLOAT32 or tuple(jnp.shape(m)) != tuple(jnp.shape(p)):
            raise ValueError(f"{where} is {jnp.result_type(m)} {jnp.shape(m)}; expected float32 {jnp.shape(p)}")
        if isinstance(m, jax.core.Tracer):
            continue
        if lo is None:  # a float32 leaf holds any float32, but a NaN or Inf weight is no weight to train
            bad = int(jnp.count_nonzero(~jnp.isfinite(m)))
            if bad:
                raise ValueError(
                    f"{where} has {bad} of {int(np.prod(jnp.shape(m)))} values that are NaN or Inf: a master must be "
                    "finite; repair those weights (or reload them from a checkpoint taken before they diverged)")
            continue
        outside = int(jnp.count_nonzero(_masters.outside_domain(m)))
        if outside:
            raise ValueError(
                f"{where} has {outside} of {int(np.prod(jnp.shape(m)))} values with no finite bf16 weight (NaN, "
                f"Inf, or a magnitude above codecs.SPLIT_MASTER_MAX = {SPLIT_MASTER_MAX:.6g}): a bfloat16 leaf "
                "cannot hold them; clip or repair those weights, or keep the leaf float32")
    new_params, new_lows = [], []
    for p, m, lo in zip(leaves, master_leaves, lows):
        m = _placed_like_param(m, p)
        if lo is None:
            new_params.append(m)
            new_lows.append(None)
            continue
        w, low = _masters.split(m)
        new_params.append(w)
        new_lows.append(low)
    new_state = ours if ours.low_halves is None else ours._replace(low_halves=treedef.unflatten(new_lows))
    replaced = jax.tree_util.tree_map(lambda x: new_state if x is ours else x, state, is_leaf=_is_ours)
    return treedef.unflatten(new_params), replaced


def _placed_like_param(x, param):
    """A concrete array on its parameter's devices and sharding (no-op for traced arrays)."""
    sharding = getattr(param, "sharding", None)
    if isinstance(x, jax.core.Tracer) or isinstance(param, jax.core.Tracer) or sharding is None:
        return x
    return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)
