"""PortableState for packed_muon: `export_muon_state` and `import_muon_state`, a state moved
between torch's PackedMuon / PackedMuonAdamW and JAX (momenta in torch's [out, in] layout)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from packed_adamw.core.muon import DEFAULT_MU_BIAS, StateFormat
from packed_adamw.core.rule import MAX_STEP_COUNT as MAX_COUNT  # packed_adamw.jax.muon.MAX_COUNT

from ._hyperparams import _as_step_count, _is_step_count
from ._masters import BF16
from ._muon_state import MatrixView, _check_param_dtypes, _checked_exponents, _checked_lows, _checked_momenta, \
    leaf_views
from ._state_io import _placed_like, export_state as export_adamw_state, exported_count, \
    import_state as import_adamw_state
from ._states import PackedMuonState, state_format


def _portable_layout(params, mode, mu_bias, adam_mode, muon_weight_dimension_numbers):
    """What both directions read: leaves, treedef, paths, views, each leaf's format and
    whether it is a bfloat16 leaf."""
    fmt, adam_fmt = StateFormat(mode, mu_bias), state_format(adam_mode)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in flat]
    paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in flat]
    views = leaf_views(muon_weight_dimension_numbers, params)
    _check_param_dtypes(params, views)
    split = [jnp.result_type(p) == BF16 for p in leaves]
    return fmt, adam_fmt, leaves, treedef, paths, views, split


def _torch_layout(x, view: MatrixView, ndim: int) -> np.ndarray:
    """A Muon leaf's entry (momentum or low half) in torch's layout: the transpose of each
    [in, out] matrix, [batch, out, in], or [out, in] for a 2-D leaf (torch's parameter)."""
    matrices = np.asarray(view.to_matrices(x)).transpose(0, 2, 1)
    return np.ascontiguousarray(matrices[0] if ndim == 2 else matrices)


def _torch_shape(view: MatrixView, ndim: int) -> tuple[int, ...]:
    return view.torch_shape if ndim == 2 else (view.batch, *view.torch_shape)


def _leaf_layout(array: np.ndarray, view: MatrixView, ndim: int) -> np.ndarray:
    """`_torch_layout` undone: the leaf's own layout."""
    matrices = (array[None] if ndim == 2 else array).transpose(0, 2, 1)
    return np.asarray(view.from_matrices(jnp.asarray(matrices)))


def export_muon_state(state: PackedMuonState, params, *, mode: str = "packed", mu_bias: int = DEFAULT_MU_BIAS,
                      adam_mode: Any = "packed", muon_weight_dimension_numbers: Any = None):
    """`packed_muon`'s state as a `PortableState` in leaf order, for torch's
    `PackedMuonAdamW.import_state` (or `PackedMuon`'s, when every leaf is Muon's).

    `mode`, `mu_bias`, `adam_mode` and `muon_weight_dimension_numbers` must be the
    transform's (the state does not record them); `params` the parameters it steps. A Muon
    leaf's momentum (and a bfloat16 leaf's low half) is written in torch's layout: each
    [in, out] matrix transposed (MUON.md, "The layout"), with the count `state.count`; an
    AdamW leaf's tensor is `export_state`'s, with the AdamW half's count."""
    from packed_adamw.core.portable import PortableState

    fmt, adam_fmt, leaves, treedef, paths, views, split = _portable_layout(
        params, mode, mu_bias, adam_mode, muon_weight_dimension_numbers)
    if not isinstance(state, PackedMuonState):
        raise TypeError(f"export_muon_state: the state is a {type(state).__name__}; pass packed_muon's state")
    muon_count = exported_count(state.count, "export_muon_state", "Muon ")
    exported_count(state.adamw.inner_state.count, "export_muon_state", "AdamW half's ")
    momenta = _checked_momenta(state.momentum, treedef, leaves, views, paths, fmt)
    exponents = _checked_exponents(state.exponents, treedef, leaves, views, paths, fmt)
    lows = _checked_lows(state.low_halves, treedef, leaves, [s and v is not None for s, v in zip(split, views)],
                         paths)
    adamw = export_adamw_state(state.adamw.inner_state, adam_fmt)
    adamw_lows = iter(adamw.low_halves or [None] * len(adamw.moments))
    adamw_tensors = iter(zip(adamw.counts, adamw.moments))
    identities, counts, moments, low_list, exponent_list = [], [], [], [], []
    for leaf, view, momentum, exponent, low in zip(leaves, views, momenta, exponents, lows):
        if view is None:
            count, words = next(adamw_tensors)
            identities.append(adam_fmt.identity)
            counts.append(count)
            moments.append(words)
            low_list.append(next(adamw_lows))
            exponent_list.append(None)
            continue
        ndim = len(jnp.shape(leaf))
        identities.append(fmt.identity)
        counts.append(muon_count)
        moments.append(_torch_layout(momentum, view, ndim))
        low_list.append(None if low is None else _torch_layout(low, view, ndim))
        # one per matrix, in the torch layout's batch order ([batch] for a leaf of several)
        exponent_list.append(None if exponent is None else np.asarray(exponent).reshape(_torch_shape(view, ndim)[:-2]))
    exported = PortableState.of(identities, counts, moments, low_list, exponent_list)
    # import_muon_state's checks, here: a damaged state (an exponent out of range, a NaN momentum)
    # is refused naming its leaf, not written into a file that every import then refuses.
    fmts = [adam_fmt if v is None else fmt for v in views]
    exported.check_tensors(fmts, [tuple(np.shape(m)) for m in moments], split, paths)
    exported.check_muon_values(fmts, paths)
    return exported


def _common_count(counts, what: str) -> int | None:
    known = sorted({c for c in counts if c is not None})
    if len(known) > 1:
        raise ValueError(f"import_muon_state: the {what} tensors have different step counts {known}; the JAX state has "
                         "one count per rule, so export from an optimizer whose parameters all stepped together")
    if known and not _is_step_count(known[0]):
        raise ValueError(f"import_muon_state: the state's {what} tensors took {known[0]!r} steps, which is not a step "
                         f"count (a whole number from 0 to {MAX_COUNT}): the file was edited or damaged")
    return known[0] if known else None


def import_muon_state(portable, params, *, mode: str = "packed", mu_bias: int = DEFAULT_MU_BIAS,
                      adam_mode: Any = "packed", muon_weight_dimension_numbers: Any = None,
                      count: int | None = None) -> PackedMuonState:
    """A `PackedMuonState` for `params` from an exported torch (or JAX) state, placed (and
    sharded) as the parameters are. The transform's `mode`, `mu_bias`, `adam_mode` and
    `muon_weight_dimension_numbers` say each leaf's rule and format; every tensor is checked
    (format, shape in torch's layout for a Muon leaf, low half, values) naming its leaf.

    `count` (the steps taken, which a schedule reads): the Muon tensors' count when they have
    one (a JAX export), else the AdamW tensors' (torch steps both rules together), else this
    argument; a given `count` must agree with the state's. A count is a whole number from 0 to
    `MAX_COUNT` (2**31 - 2: the int32 count stops at 2**31 - 1, where a step would not move it)."""
    from packed_adamw.core.portable import PortableState

    if count is not None and not _is_step_count(count):
        raise ValueError(f"import_muon_state: count={count!r} is not a step count: pass the steps taken, a whole "
                         f"number from 0 to {MAX_COUNT} (a state at 2**31 - 1 could not step again), or leave it out "
                         "when the state's tensors carry their count")
    count = None if count is None else _as_step_count(count)  # a 0-d integer array (a state's count) as its int
    fmt, adam_fmt, leaves, treedef, paths, views, split = _portable_layout(
        params, mode, mu_bias, adam_mode, muon_weight_dimension_numbers)
    fmts = [adam_fmt if v is None else fmt for v in views]
    shapes = [tuple(jnp.shape(p)) if v is None else _torch_shape(v, len(jnp.shape(p))) for p, v in zip(leaves, views)]
    portable.check_tensors(fmts, shapes, split, paths)
    portable.check_muon_values(fmts, paths)
    muon_count = _common_count([c for c, v in zip(portable.counts, views) if v is not None], "Muon")
    adamw_count = _common_count([c for c, v in zip(portable.counts, views) if v is None], "AdamW")
    known = muon_count if muon_count is not None else adamw_count
    if count is not None and known is not None and count != known:
        raise ValueError(f"import_muon_state: count={count} but the state's tensors took {known} steps; leave count "
                         "out, or pass the state's")
    known = known if known is not None else count
    if known is None:
        if any(v is not None for v in views):
            raise ValueError("import_muon_state: the state has no step count (torch's Muon keeps none, and there are "
                             "no AdamW tensors): pass count=, the steps taken (a learning-rate schedule reads it)")
        known = 0
    lows = portable.low_halves or [None] * len(leaves)
    momentum, low_halves, exponents, adamw = [], [], [], {"counts": [], "moments": [], "lows": []}
    for i, (leaf, view, c, m, lo) in enumerate(zip(leaves, views, portable.counts, portable.moments, lows)):
        if view is None:
            momentum.append(optax.MaskedNode())
            low_halves.append(optax.MaskedNode())
            exponents.append(optax.MaskedNode())
            adamw["counts"].append(c)
            adamw["moments"].append(m)
            adamw["lows"].append(lo)
            continue
        ndim = len(jnp.shape(leaf))
        momentum.append(_placed_like(_leaf_layout(m, view, ndim), leaf, None))
        low_halves.append(optax.MaskedNode() if lo is None else _placed_like(_leaf_layout(lo, view, ndim), leaf, None))
        exponent = portable.muon_exponent(i, fmt)  # zeros for a state exported before the exponents
        exponents.append(None if exponent is None else _replicated_like(exponent.reshape(view.batch_shape), leaf))
    masked = treedef.unflatten([leaf if v is None else optax.MaskedNode() for leaf, v in zip(leaves, views)])
    has_low = any(lo is not None for lo in adamw["lows"])
    inner = import_adamw_state(PortableState(adam_fmt.identity, adamw["counts"], adamw["moments"],
                                             adamw["lows"] if has_low else None), masked, adam_fmt)
    if not adamw["counts"]:  # no AdamW leaf: its count kept in step with Muon's, as the transform keeps it
        inner = inner._replace(count=jnp.asarray(known, jnp.int32))
    muon_split = any(s and v is not None for s, v in zip(split, views))
    return PackedMuonState(jnp.asarray(known, jnp.int32), treedef.unflatten(momentum),
                           treedef.unflatten(low_halves) if muon_split else None,
                           optax.MaskedState(inner_state=inner),
                           treedef.unflatten(exponents) if fmt.exponent_entry is not None else None)


def _replicated_like(x: np.ndarray, param):
    """A per-matrix state array on the devices of its (concrete) parameter, whole on each."""
    sharding = getattr(param, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(x, sharding)
    return jnp.asarray(x)
