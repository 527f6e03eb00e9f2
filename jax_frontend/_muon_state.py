"""packed_muon's leaves and state: which leaves are Muon's and each one's matrices
(`leaf_views`), the parameters' and gradients' dtypes, and each stored entry (momenta, per-matrix
exponents, low halves) checked as the step reads it, refused naming the leaf (muon.py steps;
_muon_portable.py moves states between torch and JAX)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from packed_adamw.core.muon import StateFormat

from ._masters import BF16, FLOAT32
from ._states import checked_low_halves, state_entries


# ---------------------------------------------------------------------------------------------
# Which leaves are Muon's, and each one's matrices
# ---------------------------------------------------------------------------------------------
def _is_spec(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def _axis(v) -> int | None:
    """v as an axis: an int, a numpy int or a 0-d integer array; None for anything else (a bool too)."""
    if isinstance(v, (bool, np.bool_)) or (hasattr(v, "dtype") and v.dtype == np.bool_):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _axes(value, ndim: int, what: str, path: str) -> tuple[int, ...]:
    """A MuonDimensionNumbers field (an axis or a tuple of axes) as axes in [0, ndim), refused naming
    the leaf where it is not one (a float, a bool, out of range)."""
    if isinstance(value, (numbers.Number, str, bytes)) or np.ndim(value) == 0:
        values = (value,)  # one axis (a float or a bool one is refused below)
    else:
        try:  # several: a tuple or list, a range, a numpy array (as optax.contrib.muon takes them)
            values = tuple(value)
        except TypeError:
            values = ()
    axes = [_axis(v) for v in values]
    if not axes or not all(a is not None and -ndim <= a < ndim for a in axes):
        raise ValueError(f"packed_muon: leaf {path} (rank {ndim}) has {what}={value!r}; give axes in "
                         f"[-{ndim}, {ndim})")
    return tuple(a % ndim for a in axes)


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """How one Muon leaf is read as matrices: its axes permuted to (batch..., reduction...,
    output...) and reshaped to [batch, rows, cols] in the leaf's [in, out] layout."""

    perm: tuple[int, ...]
    permuted_shape: tuple[int, ...]
    batch: int
    rows: int
    cols: int
    batch_ndim: int = 0  # the leaf's batch axes (the first of `perm`)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leaf's batch axes' sizes: the shape of its per-matrix state (() for a 2-D leaf)."""
        return self.permuted_shape[:self.batch_ndim]

    @property
    def torch_shape(self) -> tuple[int, int]:
        """The matrix in torch's [out, in] layout: what the learning-rate ratio reads."""
        return (self.cols, self.rows)

    def to_matrices(self, x):
        return jnp.transpose(x, self.perm).reshape(self.batch, self.rows, self.cols)

    def from_matrices(self, x):
        return jnp.transpose(x.reshape(self.permuted_shape), tuple(int(i) for i in np.argsort(self.perm)))


def _view_of(shape, spec: MuonDimensionNumbers, path: str) -> MatrixView:
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"packed_muon: leaf {path} has rank {ndim} but muon_weight_dimension_numbers gives it "
                         f"{spec}; Muon steps matrices (rank >= 2). Give it None to train it with AdamW")
    reduction = _axes(spec.reduction_axis, ndim, "reduction_axis", path)
    output = _axes(spec.output_axis, ndim, "output_axis", path)
    if set(reduction) & set(output) or len(set(reduction)) < len(reduction) or len(set(output)) < len(output):
        raise ValueError(f"packed_muon: leaf {path} has reduction axes {reduction} and output axes {output}; "
                         "each axis may be named once, in one of them")
    batch = tuple(i for i in range(ndim) if i not in reduction and i not in output)
    perm = batch + reduction + output
    size = lambda axes: math.prod(shape[i] for i in axes)  # noqa: E731
    return MatrixView(perm, tuple(shape[i] for i in perm), size(batch), size(reduction), size(output), len(batch))


def leaf_views(dim_numbers, tree) -> list[MatrixView | None]:
    """Per leaf of `tree` (in tree order): its MatrixView if it is a Muon leaf, else None.
    `dim_numbers`: None (every 2-D leaf is a [in, out] matrix), or a tree of
    MuonDimensionNumbers / None over the leaves (or a prefix of them), or a callable giving
    one from `tree`, as optax.contrib.muon's `muon_weight_dimension_numbers`."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in flat]
    shapes = [tuple(jnp.shape(leaf)) for _, leaf in flat]
    if dim_numbers is None:
        specs = [MuonDimensionNumbers() if len(s) == 2 else None for s in shapes]
    else:
        given = dim_numbers(tree) if callable(dim_numbers) else dim_numbers
        prefix, prefix_def = jax.tree_util.tree_flatten(given, is_leaf=_is_spec)
        if not all(_is_spec(x) for x in prefix):
            raise TypeError("packed_muon: muon_weight_dimension_numbers must hold MuonDimensionNumbers or None per "
                            f"leaf (or subtree), got {given!r}")
        try:
            subtrees = prefix_def.flatten_up_to(tree)
        except (ValueError, TypeError):
            raise ValueError(f"packed_muon: muon_weight_dimension_numbers has the tree {prefix_def}, which is neither "
                             f"the parameters' tree {jax.tree_util.tree_structure(tree)} nor a prefix of it; give "
                             "one MuonDimensionNumbers or None per leaf (or subtree)") from None
        specs = [spec for spec, sub in zip(prefix, subtrees) for _ in jax.tree_util.tree_leaves(sub)]
    return [None if spec is None else _view_of(shape, spec, path) for spec, shape, path in zip(specs, shapes, paths)]


def _like(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _check_param_dtypes(params, views) -> list[bool]:
    """Per leaf: whether it is a bfloat16 Muon leaf (a split master). Muon leaves must be
    float32 or bfloat16 (the AdamW half checks its own)."""
    split = []
    for (path, p), view in zip(jax.tree_util.tree_flatten_with_path(params)[0], views):
        dtype = jnp.result_type(p)
        if view is not None and dtype not in (FLOAT32, BF16):
            raise TypeError(f"packed_muon: params leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}: "
                            "Muon trains float32 or bfloat16 matrices (a bfloat16 one keeps an exact FP32 master); "
                            "convert it with .astype(jnp.float32) or .astype(jnp.bfloat16)")
        split.append(view is not None and dtype == BF16)
    return split


def _check_grads(grads, params, paths) -> None:
    """Each gradient has its parameter's shape (a gradient of another shape would step a matrix of
    that shape and return an update that reshapes the parameter)."""
    for g, p, path in zip(grads, params, paths):
        if jnp.shape(g) != jnp.shape(p):
            raise ValueError(f"packed_muon: grads leaf {path} has shape {jnp.shape(g)}, but its parameter has "
                             f"{jnp.shape(p)}; pass the gradient of that parameter")


def _check_grad_dtypes(grads, split, views, paths) -> None:
    for g, is_split, view, path in zip(grads, split, views, paths):
        dtype = jnp.result_type(g)
        if view is None or dtype == FLOAT32 or (is_split and dtype == BF16):
            continue
        allowed = "bfloat16 or float32 (a bfloat16 parameter)" if is_split else "float32 (a float32 parameter)"
        raise TypeError(f"packed_muon: grads leaf {path} has dtype {dtype}: Muon takes gradients of dtype {allowed}; "
                        "cast it with .astype(jnp.float32)")


def _checked_momenta(momentum, treedef, params, views, paths, fmt: StateFormat) -> list:
    entries = state_entries("packed_muon", "momentum does", momentum, treedef)
    for entry, p, view, path in zip(entries, params, views, paths):
        is_masked = isinstance(entry, optax.MaskedNode)
        if view is None and not is_masked:
            raise ValueError(f"packed_muon: the state holds a momentum for leaf {path}, which is not a Muon leaf here; "
                             "build the state with init() with the same muon_weight_dimension_numbers")
        if view is None:
            continue
        want = jax.ShapeDtypeStruct(fmt.state_shape(jnp.shape(p)), jnp.dtype(fmt.state_dtype))
        if is_masked or _like(entry) != want:
            got = "none" if is_masked else f"{jnp.result_type(entry)} {jnp.shape(entry)}"
            raise ValueError(f"packed_muon: the momentum of leaf {path} is {got}, expected {want.dtype} {want.shape} "
                             f"for {fmt.identity}; build the state with init() of a transform with the same mode and "
                             "mu_bias over the same parameters")
        if not _finite_momentum(entry, fmt):
            raise ValueError(f"packed_muon: the momentum of leaf {path} holds NaN or Inf, which no step stores (its "
                             "matrices would be refused at every step, their weights frozen); the state was edited or "
                             "damaged: restore it from a checkpoint")
    return entries


def _finite_momentum(entry, fmt: StateFormat) -> bool:
    """False where a concrete momentum holds NaN or Inf (core's `momentum_finite`, which the
    import checks too), on the array's device. Under jit the values are not known: such a matrix
    is refused at each step."""
    return isinstance(entry, jax.core.Tracer) or bool(fmt.momentum_finite(entry, jnp))


def _zero_exponents(leaves, treedef, views, fmt: StateFormat):
    """Packed mode's exponents before the first step (0 for each matrix of each Muon leaf,
    MaskedNode elsewhere); None in the other modes."""
    entry = fmt.exponent_entry
    if entry is None:
        return None
    return treedef.unflatten([optax.MaskedNode() if v is None else jnp.zeros(v.batch_shape, jnp.dtype(entry.dtype))
                              for v in views])


def _checked_exponents(exponents, treedef, params, views, paths, fmt: StateFormat) -> list:
    """Per leaf: its exponents (int32, the leaf's batch shape) for a Muon leaf in packed mode,
    else None. A packed state without exponents is refused: nothing in it tells one made before
    the exponents (whose codes read with 0) from one that lost them (its momenta off by 2**-s),
    so the message gives the line that continues the first kind."""
    entry = fmt.exponent_entry
    if entry is None:
        if exponents is not None:
            raise ValueError(f"packed_muon: the state holds exponents, which {fmt.identity} does not keep; build the "
                             "state with init() of a transform with the same mode")
        return [None] * len(views)
    if exponents is None:
        raise ValueError(
            f"packed_muon: the state's exponents are None, but mode {fmt.mode!r} keeps each Muon matrix's momentum as "
            f"its codes times 2**exponent ({fmt.identity}: PackedMuonState.exponents, which init() and "
            "import_muon_state make), so its codes cannot be read. A state of packed_muon(mode='bf16') has none "
            "either (its 16-bit entries are bf16 values, not these codes): step it with a mode='bf16' transform. A "
            "packed state made by a packed-adamw before the exponents (its codes read with exponent 0) continues "
            "with `state = state._replace(exponents=tx.init(params).exponents)`; a state that lost its exponents "
            "cannot (its momenta would be off by 2**-exponent): restore it whole, or carry it through "
            "export_muon_state and import_muon_state")
    entries = state_entries("packed_muon", "exponents do", exponents, treedef)
    checked = []
    for e, view, path in zip(entries, views, paths):
        is_masked = isinstance(e, optax.MaskedNode)
        if view is None:
            if not is_masked:
                raise ValueError(f"packed_muon: the state holds an exponent for leaf {path}, which is not a Muon leaf "
                                 "here; build the state with init() with the same muon_weight_dimension_numbers")
            checked.append(None)
            continue
        want = jax.ShapeDtypeStruct(view.batch_shape, jnp.dtype(entry.dtype))
        if is_masked or _like(e) != want:
            got = "none" if is_masked else f"{jnp.result_type(e)} {jnp.shape(e)}"
            raise ValueError(f"packed_muon: the exponents of leaf {path} are {got}, expected {want.dtype} {want.shape} "
                             f"(one per matrix, {fmt.identity}); build the state with init() over the same parameters")
        checked.append(e)
    return checked


def _checked_lows(low_halves, treedef, params, split, paths) -> list:
    """packed_muon's low halves per leaf (`_states.checked_low_halves`, packed_adamw's check)."""
    return checked_low_halves("packed_muon", low_halves, treedef, params, paths, split, rule="Muon")
