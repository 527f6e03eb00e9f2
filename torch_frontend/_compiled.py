"""A packed optimizer's `step()` under torch.compile: one opaque custom op per step
(docs/MULTI_TENSOR.md, "Compiled steps"). Every rule takes this one path: PackedAdamW,
PackedMuon and PackedMuonAdamW (docs/MUON.md, "Compiled steps").

Traced code (dynamo) only collects the parameters that have gradients and calls
`torch.ops.packed_adamw.step_` with them, their gradients, their positions in `param_groups` and
the optimizer's token. The op declares that it mutates the parameters and has a fake
implementation that does nothing, so the step is one node of the graph (`fullgraph=True` holds,
on CPU as on CUDA). At run time its real implementation runs the eager step of the optimizer the
token names (its `_update(live)`): hyperparameter checks, state creation, the step plan (or the
capturable plan), the launches or the numpy step; for Muon also Newton-Schulz, which stays out
of the graph because Inductor would change its bits (docs/MUON.md, "Compiled steps"). The
optimizer state (words or momentum codes, low halves, step counts) is never a graph input or
output: the compiled graph neither reads nor writes it, only the op does, so the state, its step
counts (ints, or device tensors with `capturable=True`) and `state_dict()` are the eager step's.
Nothing the traced code reads changes between steps, so a changing learning rate (a float or a
tensor) recompiles nothing. An optimizer takes part by having `_eager_update(live=None)` (its
eager step; `live` as `run` says) and `_update`, the same wrapped in `torch.compiler.disable`
(what compiled code and graph breaks call; the eager `step` calls `_eager_update` through
`eager_update`, sparing the wrapper's host time where dynamo hooks no frames),
`_note_param_lists()`, `check_nonfinite`, `capturable`, and `_compile_token = register(self)`.

Steps dynamo cannot trace run eagerly between graphs (a graph break whose reason names why,
which `fullgraph=True` refuses with): `check_nonfinite=True`, DTensor parameters, and a
gradient whose dtype or shape differs from its parameter's (asked at trace time, before any
parameter is traced: dynamo's own errors there do not say what is wrong).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from . import _dtensor

_OPTIMIZERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_BY_ID: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # id(optimizer) -> it
_TOKENS = itertools.count(1)


def register(optimizer) -> int:
    """A token naming `optimizer` for the op (custom ops take no Python objects). Held weakly:
    a compiled graph of an optimizer that was freed raises when called."""
    token = next(_TOKENS)
    _OPTIMIZERS[token] = optimizer
    _BY_ID[id(optimizer)] = optimizer
    return token


# cudagraph_unsafe: under `mode="reduce-overhead"` Inductor captures the graph partitions around
# the op, and the op runs between them. A step can allocate (state on the first step, plans when
# addresses change) and keep what it allocated, which a cudagraph tree's memory pool refuses;
# capturing the step itself is torch.cuda.graph's job, with capturable=True.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("packed_adamw::step_", mutates_args=("params",), tags=_TAGS)
def step_(params: list[torch.Tensor], grads: list[torch.Tensor], positions: list[int], optimizer: int) -> None:
    """One step of the packed optimizer registered as `optimizer`: `params[i]` (the
    parameter at flat position `positions[i]` of its `param_groups`, or the compiled program's
    copy of it) steps with gradient `grads[i]`."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError("packed_adamw::step_: the optimizer this compiled step was traced for no longer exists; "
                           "compile the step again for the new optimizer")
    run(opt, params, grads, positions)


@step_.register_fake
def _(params, grads, positions, optimizer) -> None:
    return None  # mutation only: nothing to describe


def run(opt, params: list, grads: list, positions: list[int]) -> None:
    """The run-time body of the op: `params[i]` is the parameter at flat position
    `positions[i]` of `param_groups` or the compiled program's copy of it, `grads[i]` its
    gradient (which the program assigns to `.grad` only when its graph ends). Runs the eager
    step, so bits, state and plans are the eager step's."""
    name = opt.optimizer_name
    lists = opt.__dict__.get("_param_lists", [])
    if len(lists) != len(opt.param_groups) or any(a is not g["params"] for a, g in zip(lists, opt.param_groups)):
        opt._note_param_lists()  # the next call traces the new lists (or finds them unchanged)
        raise RuntimeError(f"{name}: a param_groups[i]['params'] list was replaced after this step was "
                           "compiled, so the step was not taken: call the compiled step again (it retraces), "
                           "and add parameters through add_param_group")
    everything = [p for group in opt.param_groups for p in group["params"]]
    if len(params) != len(positions) or len(grads) != len(positions) or \
            any(not 0 <= i < len(everything) for i in positions):
        raise RuntimeError(f"{name}: a compiled step does not fit this optimizer's param_groups; "
                           "compile the step again after changing the parameter groups")
    live = None
    for i, tensor, grad in zip(positions, params, grads):
        p = everything[i]
        if not _same_memory(p.grad, grad):
            p.grad = grad  # what the program assigns when its graph ends: the step reads .grad
        if not _same_memory(p, tensor):
            live = {} if live is None else live
            live[id(p)] = tensor
    if live is not None and opt.capturable:
        raise RuntimeError(
            f"{name}(capturable=True) under torch.compile: the compiled program passed copies of the "
            "parameters instead of updating them in place (the 'aot_eager' backend does so), and a "
            "capturable plan steps the parameters' own memory: use the 'inductor' backend (the default), "
            "or capturable=False")
    opt._opt_called = True
    opt._update(live)


_data_ptr = torch.Tensor.data_ptr


def _same_memory(a, b) -> bool:
    """`a` and `b` are one tensor's memory, laid out alike (a compiled program may hand the
    op another tensor object over a parameter's or gradient's storage)."""
    return a is b or (a is not None and b is not None and _data_ptr(a) == _data_ptr(b) and a.dtype is b.dtype
                      and a.shape == b.shape and a.stride() == b.stride())


def traced_step(opt) -> None:
    """The body of a packed optimizer's `step()` while dynamo traces it: no attribute writes on the
    optimizer, no reads of tensor data, no hyperparameters read (the op reads them when it
    runs, so changing them recompiles nothing)."""
    if opt.check_nonfinite:
        # Raising after a step from inside a graph would skip the rest of the graph (its
        # copies back into mutated inputs included): this step runs between graphs.
        _eager_step_nonfinite(opt)
        return
    # Before any parameter is traced: dynamo fails on a tensor whose gradient differs from it in
    # dtype or shape with messages that do not name the parameter (a dtype "mismatch" it
    # ascribes to FSDP; a bare AssertionError for a gradient reshaped through `.data`).
    untraceable = _untraceable_gradient(id(opt))  # a constant while tracing (the token may be a SymInt)
    if untraceable == "dtype":
        _eager_step_grad_dtype(opt)
        return
    if untraceable == "shape":
        _eager_step_grad_shape(opt)
        return
    params, grads, positions, position = [], [], [], 0
    for group_params in opt.__dict__["_param_lists"]:  # not the group dicts: see _note_param_lists
        for p in group_params:
            if p.grad is not None:
                if _dtensor.is_dtensor(p):
                    _eager_step_dtensor(opt)
                    return
                params.append(p)
                grads.append(p.grad)
                positions.append(position)
            position += 1
    step_(params, grads, positions, opt._compile_token)


@torch.compiler.assume_constant_result
def _untraceable_gradient(optimizer_id: int) -> str | None:
    """Run (not traced) when dynamo traces a step, its result a constant of the graph:
    "dtype" or "shape" when a parameter's gradient differs from it so, which dynamo cannot
    trace, else None. The graph's guards on the gradients make a later change retrace."""
    opt = _BY_ID.get(optimizer_id)
    if opt is None:
        return None  # the op says so when it runs
    found = None
    for group in opt.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and g.dtype != p.dtype:
                found = "dtype"
            elif g is not None and g.shape != p.shape:
                return "shape"  # the eager step refuses it: it wins over a dtype that only breaks the graph
    return found


def _eager_step(reason: str):
    """The eager step as a graph break whose reason dynamo shows (and `fullgraph=True` refuses
    with); older torch releases take no reason."""
    def eager_step(opt) -> None:
        opt._update()
        opt._opt_called = True  # what torch's scheduler wrapper would set (step is marked unwrapped)

    try:
        return torch.compiler.disable(eager_step, reason=reason)
    except TypeError:
        return torch.compiler.disable(eager_step)


_eager_step_nonfinite = _eager_step(
    "check_nonfinite=True raises after a step, which a compiled graph cannot do: the step runs "
    "eagerly between graphs (a graph break). Use check_nonfinite=False to compile it with fullgraph=True")
_eager_step_grad_dtype = _eager_step(
    "A parameter's gradient has another dtype (a bfloat16 parameter's float32 gradient), which dynamo "
    "cannot trace: the step runs eagerly between graphs (a graph break), where a dtype that does not fit is refused "
    "naming the parameter. For fullgraph=True, give bf16 parameters bf16 gradients")
_eager_step_grad_shape = _eager_step(
    "A parameter's gradient has another shape (changed through .data?), which dynamo cannot trace: the "
    "step runs eagerly between graphs (a graph break), where it is refused naming the parameter. Give every "
    "gradient its parameter's shape")
_eager_step_dtensor = _eager_step(
    "DTensor (FSDP2) parameters step eagerly, between compiled graphs (a graph break)")


_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


def eager_update(opt) -> None:
    """The eager step from `step()` outside compilation: `opt._eager_update()` itself, sparing
    `torch.compiler.disable`'s wrapper (host time every step), unless dynamo still hooks the
    frames this one calls (a frame dynamo gave up on and runs eagerly: a `suppress_errors`
    fallback, a failing backend); then the disabled `opt._update()`, so dynamo never traces the
    step's internals."""
    if _eval_frame_callback is not None and _eval_frame_callback() is None:
        opt._eager_update()
    else:
        opt._update()


def optimizer_step(opt, closure):
    """`step(closure)` of a packed optimizer that runs its eager step through `eager_update(opt)`
    (PackedMuon, PackedMuonAdamW; PackedAdamW.step is the same): the closure re-evaluated with
    gradients on, then, under torch.compile, `traced_step` (the custom op), else the note LR
    schedulers read (see PackedAdamW.step) and the eager step. Returns the closure's loss."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if torch.compiler.is_compiling():
        traced_step(opt)
    else:
        opt._opt_called = True
        eager_update(opt)
    return loss
