"""Causal attention over packed documents, optionally within a sliding window.

A batch is B rows of T tokens; each row holds whole documents end to end. `cu_seqlens` (int32,
as FlashAttention's varlen kernels take it) lists where each document starts in the flattened
B*T tokens, then B*T: [0, s1, s2, ..., B*T]. Every row boundary (a multiple of T) is also a
document boundary, so no document spans two rows. A query attends to the keys of its own
document at or before it; with `window = W` only to itself and the W tokens before it (the
(W, 0) left/right window of FlashAttention and `varlen_attn`, which nanochat's window sizes
use too). `window=None` is unlimited.

On CUDA with bf16/fp16 tensors, `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) runs it
when this torch's signature can express the window (2.10 has `is_causal` only; 2.11 and later
take `window_size`). Elsewhere, and as the tests' reference, `scaled_dot_product_attention`
with the block-diagonal causal (and windowed) boolean mask.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10: the masked SDPA path serves every device
    varlen_attn = None

VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> None:
    """Refuse a `cu_seqlens` that does not describe whole documents packed into `batch` rows of
    `seq_len` tokens. Its values are read on the host: call it where the tensor is still on the
    CPU (the model checks CPU tensors itself; a CUDA one is checked for shape and dtype only,
    so that the forward pass does not wait for the device). While torch.compile traces the model
    a host read would break the graph, so a CPU tensor's values are checked inside it instead (one
    assertion, a RuntimeError naming the same conditions); `compile_chat_model` also checks them
    on the host first, with this function's ValueErrors."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of document starts (then the token count), got "
                         f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}"
                         f"{' of shape ' + str(tuple(cu_seqlens.shape)) if isinstance(cu_seqlens, torch.Tensor) else ''};"
                         " build it with torch.tensor(starts, dtype=torch.int32)")
    if cu_seqlens.numel() < batch + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries but a batch of {batch} rows needs at least "
                         f"{batch + 1}: every row boundary is a document boundary")
    if cu_seqlens.device.type != "cpu":
        return
    total = batch * seq_len
    if torch.compiler.is_compiling():
        row_starts = torch.arange(0, total + 1, seq_len, dtype=cu_seqlens.dtype)
        whole = ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (cu_seqlens[1:] > cu_seqlens[:-1]).all()
                 & torch.isin(row_starts, cu_seqlens).all())
        torch._assert_async(whole, f"cu_seqlens must run from 0 to {total} ({batch} x {seq_len}), strictly "
                            f"increasing, with every multiple of {seq_len} among its starts (whole documents)")
        return
    starts = cu_seqlens.tolist()
    if starts[0] != 0 or starts[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the batch's token count {batch} x {seq_len} = {total}, "
                         f"got {starts[0]} ... {starts[-1]}")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (every document has at least one token), got "
                         f"{starts}")
    missing = sorted(set(range(0, total + 1, seq_len)) - set(starts))
    if missing:
        raise ValueError(f"cu_seqlens lacks the row boundaries {missing[:8]}: a packed row holds whole documents, so "
                         f"every multiple of the row length {seq_len} must be a document start")


def document_positions(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within its document) of each of the `n_tokens` flattened tokens."""
    token = torch.arange(n_tokens, device=cu_seqlens.device, dtype=torch.int64)
    document = torch.searchsorted(cu_seqlens.to(torch.int64), token, right=True) - 1
    return document, token - cu_seqlens.to(torch.int64)[document]


def attention_mask(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int, window: int | None,
                   device: torch.device) -> torch.Tensor:
    """The boolean mask (True: attend) of shape (batch, 1, T, T): same document, causal, and
    within `window` tokens back when one is given."""
    query = torch.arange(seq_len, device=device)
    allowed = query[None, :] <= query[:, None]  # [query, key]
    if window is not None:
        allowed = allowed & (query[:, None] - query[None, :] <= window)
    if cu_seqlens is None:
        return allowed.expand(batch, 1, seq_len, seq_len)
    document, _ = document_positions(cu_seqlens.to(device), batch * seq_len)
    document = document.view(batch, seq_len)
    same_document = document[:, :, None] == document[:, None, :]
    return (allowed & same_document)[:, None]


# The device types that have an autocast (asking another, e.g. meta, whether autocast is on raises).
# Read once here: dynamo cannot trace `torch.amp.is_autocast_available`, and a call of it in the
# forward broke the compiled graph at every layer (issue 55), running the rest of the model eagerly.
def _autocast_device_types() -> frozenset:
    found = set()
    names = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu", "maia", "privateuseone",
             torch._C._get_privateuse1_backend_name())  # a renamed privateuse1 backend's tensors say its name
    for device_type in names:
        try:
            if torch.amp.is_autocast_available(device_type):
                found.add(device_type)
        except RuntimeError:  # a device type this torch does not know
            pass
    return frozenset(found)


AUTOCAST_DEVICE_TYPES = _autocast_device_types()

# What this torch's varlen_attn takes, read once (its keywords changed between 2.10 and 2.11).
_VARLEN_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


def _varlen_window_options(window: int | None) -> dict | None:
    """varlen_attn's keywords for causal attention with this window, or None where this
    torch's varlen_attn cannot express it (then the masked SDPA path runs)."""
    if "window_size" in _VARLEN_PARAMETERS:  # torch >= 2.11: (left, right); -1 is unlimited
        return {"window_size": (-1 if window is None else window, 0)}
    if window is None and "is_causal" in _VARLEN_PARAMETERS:  # torch 2.10: causal, no window
        return {"is_causal": True}
    return None


def uses_varlen(q: torch.Tensor, window: int | None) -> bool:
    """Whether `packed_causal_attention` runs varlen_attn for these tensors and this window."""
    return q.is_cuda and q.dtype in VARLEN_DTYPES and _varlen_window_options(window) is not None


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of q, k, v of shape (B, T, heads, head_dim) (FlashAttention's layout),
    within the documents `cu_seqlens` delimits (None: each row is one document) and `window`
    tokens back (None: unlimited). Returns (B, T, heads, head_dim); scale 1/sqrt(head_dim)."""
    B, T, H, D = q.shape
    if window is not None and window < 0:
        raise ValueError(f"window={window}: give the number of earlier tokens a query sees (>= 0), or None for "
                         "unlimited")
    if window is not None and window >= T - 1:
        window = None  # the window reaches every earlier token of the row: plain causal
    device_type = q.device.type
    if device_type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        # Autocast casts SDPA's inputs to its dtype but does not know varlen_attn, and an FP32
        # model's rotary tables make q and k float32: cast here, so that a model of FP32
        # parameters under autocast runs the same attention (kernel and dtype) as a bf16 model.
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if uses_varlen(q, window):
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
        # T bounds every document's length (no document spans two rows), so no host sync for the max.
        out = varlen_attn(q.reshape(B * T, H, D), k.reshape(B * T, H, D), v.reshape(B * T, H, D),
                          cu_seqlens.to(q.device), cu_seqlens.to(q.device), T, T, **_varlen_window_options(window))
        return out.view(B, T, H, D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim) for SDPA
    if cu_seqlens is None and window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(cu_seqlens, B, T, window, q.device))
    return out.transpose(1, 2)
