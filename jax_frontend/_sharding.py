"""Sharded parameters: every device steps its own shards, with no gather.

The step is elementwise per leaf, so a device holding a shard of a parameter, of its gradient
and of its state words can update that shard alone; the hyperparameter rows and the count are
replicated scalars. How the shards are handed to `_step.local_step` depends on what is known
when the step is traced:

- the shardings are known (concrete arrays, as in an eager `tx.update`, or traced arrays whose
  mesh axes are `Explicit`, JAX's sharding in types): `jax.shard_map` over the parameters'
  mesh, with each leaf's `PartitionSpec`. This works on every platform, the CPU callbacks
  included (a callback inside `shard_map` runs once per device, on that device's shards);
- the mesh axes are `Auto` (`jax.jit` with `in_shardings`, or sharded inputs without
  sharding in types): the shardings are decided by XLA after tracing, so on GPU the step is a
  `custom_partitioning` whose partition callback receives them and lowers the step on
  per-shard shapes. A host callback cannot be part of such a partition (XLA builds it as a
  separate module, whose callbacks the executable never registers), so on a CPU mesh with
  `Auto` axes the step runs unpartitioned: XLA gathers the leaves to one device, correct but
  not distributed (use `Explicit` axes to keep CPU meshes per shard);
- no mesh (the usual single-device case), or inside a `shard_map` that already made every
  mesh axis manual: the step is bound as it is. A mesh of one device takes the paths above
  (one shard per leaf), so a single GPU runs the sharded code too.

A state leaf shards as its state entry declares (`StateEntry.sharding`): a fp32-mode state is
[2, *shape], the parameter's sharding with an unsharded leading dimension. A bf16 leaf's low half (docs/FORMAT.md, "Split masters") has the parameter's shape
and sharding.

With `track_format` each device counts its own shards; the per-leaf counts are then summed
with a `psum` over the mesh axes that divide that leaf (one small all-reduce per distinct set
of axes, the step's only collective), so every device holds the totals, replicated like the
step count. Axes that replicate a leaf are not summed over: each replica counted the same
elements.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._step import StepConfig, StepOperands, StepResults, local_step, packed_adamw_step_p


def _spec_tuple(spec, ndim: int) -> tuple:
    entries = tuple(spec)[:ndim] if spec is not None else ()
    return entries + (None,) * (ndim - len(entries))


def state_spec(param_spec: tuple, fmt) -> tuple:
    """The state's spec for a parameter's spec, as the state entry declares it
    (`StateEntry.sharding`: fp32 mode's leading dimension unsharded)."""
    return fmt.state_entry.sharding(tuple(param_spec))


class _Placement:
    """Where a step's leaves are: a mesh (concrete or abstract), their specs and whether those
    are known at trace time."""

    def __init__(self, mesh, specs, known: bool, axis_names: frozenset):
        self.mesh, self.specs, self.known, self.axis_names = mesh, specs, known, axis_names

    @property
    def platform(self) -> str | None:
        device = getattr(self.mesh.abstract_mesh, "abstract_device", None)
        return getattr(device, "platform", None)


def _leaf_mesh(x):
    """(mesh, spec tuple, known) of one leaf, or None where it is on one device or not sharded."""
    ndim = len(jax.numpy.shape(x))
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty:
            return None
        if all(t == AxisType.Manual for t in mesh.axis_types):
            return None  # inside a shard_map over every axis: the arrays are already shards
        known = all(mesh.shape[a] == 1 or t == AxisType.Explicit
                    for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
        return mesh, _spec_tuple(sharding.spec, ndim), known
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return sharding.mesh, _spec_tuple(sharding.spec, ndim), True
    return None


def placement(params) -> _Placement | None:
    """The mesh the parameters are sharded over, or None for a step on one device."""
    found = [(i, _leaf_mesh(p)) for i, p in enumerate(params)]
    found = [(i, m) for i, m in found if m is not None]
    if not found:
        return None
    meshes = {m[0].abstract_mesh for _, m in found}
    if len(meshes) > 1:
        raise ValueError(
            f"packed_adamw: the parameters are sharded over {len(meshes)} different meshes "
            f"({sorted(map(str, meshes))}); put every parameter on one mesh"
        )
    mesh = found[0][1][0]
    specs = [tuple([None] * len(jax.numpy.shape(p))) for p in params]
    for i, (_, spec, _) in found:
        specs[i] = spec
    known = all(k for _, (_, _, k) in found)
    free = frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
    return _Placement(mesh, specs, known, free)


def reshard_to(x, mesh, spec: tuple):
    """x with `spec` on `mesh` where sharding in types says otherwise (a user's gradients laid
    out unlike the parameters); a no-op otherwise."""
    ndim = len(spec)
    if isinstance(x, jax.core.Tracer):
        typed = getattr(jax.typeof(x), "sharding", None)
        explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
        if explicit and typed is not None and _spec_tuple(typed.spec, ndim) != spec:
            return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*spec)))
        return x
    # A concrete array laid out otherwise (replicated gradients, an uncommitted array) is moved
    # to the specs first: an eager shard_map refuses inputs whose sharding differs from them.
    target = NamedSharding(mesh, PartitionSpec(*spec))
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh
                                     and _spec_tuple(sharding.spec, ndim) == spec):
        return jax.device_put(x, target)
    return x


def on_whole_leaves(where: _Placement, fn, arrays: list, n_outputs: int) -> tuple:
    """`fn(*arrays)` on whole arrays, for a step that needs whole leaves (Muon's Newton-Schulz,
    its refusal of a matrix whole) over leaves sharded as `where` says: the arrays are gathered
    (resharded to replicated: XLA's all-gathers), every device runs `fn` on the whole arrays
    inside a `shard_map` (a host callback runs per device there, on that device's copy), and
    its `n_outputs` results come back replicated (`_whole_leaf_step` lays each out again). The bits are
    one device's: the same operations on the same whole arrays."""
    mesh, replicated = where.mesh, PartitionSpec()
    whole = [reshard_to(x, mesh, (None,) * x.ndim) for x in arrays]
    return jax.shard_map(fn, mesh=mesh, axis_names=where.axis_names, check_vma=False,
                         in_specs=(replicated,) * len(whole), out_specs=(replicated,) * n_outputs)(*whole)


def _whole_leaf_step(operands: StepOperands, where: _Placement, *, config: StepConfig) -> StepResults:
    """`_step.local_step` of a rule with a matrix phase (Muon's Newton-Schulz needs whole matrices,
    and a matrix is refused whole) over sharded leaves: on whole leaves on every device
    (`on_whole_leaves`), each result then laid out as its leaf's parameter is (each device keeps
    its part; a state as its entry shards, `state_spec`) and the exponents, one per matrix, whole
    on every device. The bits are one device's step."""
    def per_device(*flat):
        return tuple(local_step(StepOperands.of(flat, config), config=config).flat(config))

    none = [None] * config.n_leaves
    n_results = len(StepResults(none, none, none, None, none).flat(config))
    results = StepResults.of(on_whole_leaves(where, per_device, operands.flat(config), n_results), config)
    mesh, specs = where.mesh, where.specs
    placed = lambda xs, spec_of: [x if x is None else reshard_to(x, mesh, spec_of(j, x))  # noqa: E731
                                  for j, x in enumerate(xs)]
    return StepResults(placed(results.outs, lambda j, x: specs[j]),
                       placed(results.states, lambda j, x: state_spec(specs[j], config.fmt)),
                       placed(results.lows, lambda j, x: specs[j]), results.counts,
                       placed(results.exponents, lambda j, x: (None,) * x.ndim))


def _dividing_axes(spec: tuple, axis_names) -> tuple:
    """The mesh axes among `axis_names` that divide a leaf of this spec, in spec order."""
    axes = []
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None and axis in axis_names:
                axes.append(axis)
    return tuple(axes)


def summed_over_shards(counts, specs, axis_names):
    """Per-leaf counts of this device's shards -> the leaves' totals, on every device: leaf i's
    row summed over the axes that divide it (`_dividing_axes`), one psum per distinct set."""
    by_axes: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        by_axes.setdefault(_dividing_axes(spec, axis_names), []).append(i)
    if list(by_axes) == [()]:
        return counts  # no leaf is divided: every device counted whole leaves
    total = jnp.zeros_like(counts)
    for axes, leaves in by_axes.items():
        part = jnp.where(np.isin(np.arange(len(specs)), leaves)[:, None], counts, jnp.zeros_like(counts))
        total = total + (jax.lax.psum(part, axes) if axes else part)
    return total


def sharded_step(operands: StepOperands, *, config: StepConfig) -> StepResults:
    """`_step.local_step` over the leaves, one device's shards at a time where sharded, with
    the format counts (`config.track_format`) summed over the shards."""
    where = placement(operands.params)
    if where is None:
        return local_step(operands, config=config)
    if config.fmt.rule.matrix_phase:
        return _whole_leaf_step(operands, where, config=config)
    if not where.known:
        if where.platform == "gpu":
            return partitioned_step(operands, config=config)
        # gathered (see above): the step sees whole leaves, so its counts are the totals
        return local_step(operands, config=config)
    mesh, fmt = where.mesh, config.fmt
    p_specs = [PartitionSpec(*s) for s in where.specs]
    s_specs = [PartitionSpec(*state_spec(s, fmt)) for s in where.specs]
    # Gradients, states and low halves laid out otherwise are moved to their parameter's layout.
    def resharded(arrays, specs):
        return [x if x is None else reshard_to(x, mesh, tuple(spec)) for x, spec in zip(arrays, specs)]

    operands = StepOperands(list(operands.params), resharded(operands.grads, p_specs),
                            resharded(operands.states, s_specs), resharded(operands.lows, p_specs),
                            operands.hparams, operands.count)
    mapped = _mapped(config, mesh, tuple(p_specs), tuple(s_specs), where.axis_names)
    return StepResults.of(mapped(*operands.flat(config)), config)


@functools.lru_cache(maxsize=128)
def _mapped(config: StepConfig, mesh, p_specs: tuple, s_specs: tuple, axis_names: frozenset):
    """The shard_map of the step over its flat operands, jitted and cached: an eager step over
    the same layout then compiles once (an eager shard_map lowers its body again on every
    call); under an outer jit it is inlined."""

    def per_device(*flat):
        results = local_step(StepOperands.of(flat, config), config=config)
        if config.track_format:
            results.counts = summed_over_shards(results.counts, [tuple(s) for s in p_specs], axis_names)
        return tuple(results.flat(config))

    replicated = PartitionSpec()
    p_specs, s_specs = list(p_specs), list(s_specs)  # a low half is laid out as its parameter
    in_specs = StepOperands(p_specs, p_specs, s_specs, p_specs, replicated, replicated).flat(config)
    out_specs = StepResults(p_specs, s_specs, p_specs, replicated).flat(config)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, axis_names=axis_names, check_vma=False,
                                 in_specs=tuple(in_specs), out_specs=tuple(out_specs)))


# ---------------------------------------------------------------------------------------------
# Auto mesh axes on GPU: custom_partitioning
# ---------------------------------------------------------------------------------------------
def _factor_rule(ranks: tuple[int, ...], config: StepConfig) -> tuple[str, tuple[str, ...]]:
    """The Shardy sharding rule: leaf i's parameter, gradient, state and low half (a split
    leaf's) and their outputs share the factors of the parameter's dimensions; a fp32 state's
    leading dimension, the hyperparameter rows and the format counts stay replicated."""
    leading = len(config.fmt.state_entry.leading)  # the state's axes before the parameter's (fp32 mode: 1)
    dims = [[f"l{i}d{k}" for k in range(r)] for i, r in enumerate(ranks)]
    lead = [[f"l{i}m{k}" for k in range(leading)] for i in range(len(ranks))]
    param = [" ".join(d) for d in dims]
    state = [" ".join(lead[i] + d) for i, d in enumerate(dims)]
    operands = StepOperands(param, param, state, param, "hr hc", "").flat(config)
    results = StepResults(param, state, param, "cl cc").flat(config)
    # Listed in order of first appearance, as Shardy wants them.
    replicated = (tuple(f for factors in lead for f in factors) + ("hr", "hc")
                  + (("cl", "cc") if config.track_format else ()))
    return ", ".join(operands) + " -> " + ", ".join(results), replicated


@functools.lru_cache(maxsize=128)
def _partitioned(config: StepConfig, ranks: tuple[int, ...], body=None):
    """A custom_partitioning of the step for leaves of these ranks (cached: one per layout).

    `body(*args, config=...)` runs on one device's shards; the default binds the step
    primitive (a test passes a plain function to check the partitioning on CPU). With
    `track_format` its last result, the counts of the shards, is summed over the shards.
    """
    from jax.experimental.custom_partitioning import custom_partitioning

    n, fmt = len(ranks), config.fmt
    run = body or (lambda *args, config: packed_adamw_step_p.bind(*args, config=config))

    def per_shard(p_shardings, mesh):
        def step(*flat):
            if not config.track_format:
                return tuple(run(*flat, config=config))
            results = StepResults.of(run(*flat, config=config), config)
            specs = [tuple(s.spec) for s in p_shardings]  # full rank: `shardings` below
            results.counts = summed_over_shards(results.counts, specs, frozenset(mesh.axis_names))
            return tuple(results.flat(config))
        return step

    def shardings(mesh, arg_shapes):
        """(operand shardings, result shardings): each leaf follows its parameter's sharding;
        hyperparameters and counts are replicated."""
        p_sh = []
        for shape in arg_shapes[:n]:
            sharding = shape.sharding
            spec = _spec_tuple(sharding.spec, len(shape.shape))
            p_sh.append(NamedSharding(sharding.mesh, PartitionSpec(*spec)))
        s_sh = [NamedSharding(s.mesh, PartitionSpec(*state_spec(tuple(s.spec), fmt))) for s in p_sh]
        rep = NamedSharding(p_sh[0].mesh if p_sh else mesh, PartitionSpec())
        return (p_sh, StepOperands(p_sh, p_sh, s_sh, p_sh, rep, rep).flat(config),
                StepResults(p_sh, s_sh, p_sh, rep).flat(config))

    def partition(mesh, arg_shapes, result_shape):
        p_sh, operand_sh, result_sh = shardings(mesh, arg_shapes)
        return mesh, per_shard(p_sh, mesh), tuple(result_sh), tuple(operand_sh)

    def infer(mesh, arg_shapes, result_shape):
        return tuple(shardings(mesh, arg_shapes)[2])

    def step(*flat):  # unpartitioned (one device)
        return tuple(run(*flat, config=config))

    partitioned = custom_partitioning(step)
    rule, replicated_factors = _factor_rule(ranks, config)
    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer,
                              sharding_rule=rule, need_replication_factors=replicated_factors)
    return partitioned


def partitioned_step(operands: StepOperands, *, config: StepConfig, body=None) -> StepResults:
    """As `_step.local_step`, through `_partitioned`, the counts (`config.track_format`)
    summed over the shards."""
    ranks = tuple(len(jax.numpy.shape(p)) for p in operands.params)
    return StepResults.of(_partitioned(config, ranks, body)(*operands.flat(config)), config)
