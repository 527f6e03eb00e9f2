"""The "chat" family: a nanochat-style GPT (learned from karpathy/nanochat's gpt.py).

Per block: the residual stream x is first remixed with the embedding x0 by two learned
per-layer scalars (x <- resid_lambda * x + x0_lambda * x0); then pre-norm attention and a
pre-norm MLP. Norms are parameter-free RMS norms. Attention: bias-free q/k/v/proj matrices,
rotary positions (base 100,000), QK-norm with a fixed 1.2 gain on q and k, and a sliding
window per layer from a pattern ("SSSL": short, short, short, long, tiled; the last layer is
always long; short = a quarter of the context rounded up to 128 tokens). On alternate layers
(the last one included) a value embedding of the tokens is added to v through a per-head gate,
3 * sigmoid(W x[:12]). MLP: ReLU^2, 4x wide, no biases. Around the stack: a normed token
embedding; a "smear" that adds a gated share of the previous token's embedding; a "backout"
that subtracts a learned share of the residual at the middle layer before the final norm; an
untied head whose logits are soft-capped at 15 (c * tanh(logits / c)).

Packed documents: `forward(idx, ..., cu_seqlens=...)` treats the rows of `idx` as documents
packed end to end (attention.py). No token sees another document: attention is masked per
document (and per window), rotary positions restart at each document, and the smear does not
reach across a document start. So a packed run equals each document run alone.

Precision. The residual stream, the norms, the scalars' products, the logits and the loss run
in float32 at least (float64 for a float64 model in tight tests). A model of bf16 (or fp16)
weights runs its forward under torch.autocast of that dtype, so that its matmuls and attention
take bf16 inputs while everything else stays in float32: the computation of an FP32 model
under bf16 autocast (chat_train's reference), with the weights rounded to bf16. `stream="param"`
keeps the earlier forward, everything in the weights' dtype (a bf16 residual stream), which
only the fidelity evidence runs (docs/results/D12_FIDELITY.md: it trained worse).

Compiled: `compile_chat_model(model)` is torch.compile(model) called as the model is, compiling
once for batches of any number of documents (it marks cu_seqlens's length dynamic);
`compiled_graph_count()` counts the graphs compiled so far, to show that none came later.

Presets (vocabulary 32,768, nanochat's; depth x 64 wide as nanochat sizes them):

    name  d_model  layers  heads x dim  context  parameters
    chat-tiny  64       2      1 x 64       128    6,389,802   (CPU tests of chat_train)
    d4        256       4      4 x 64       512   36,700,290
    d6        384       6      6 x 64       512   73,531,646
    d12       768      12     6 x 128      2048  286,261,730   (nanochat's d12)

d4 and d6 take nanochat's CPU head size (64) and sequence length (512). `dataclasses.replace(
preset, vocab_size=...)` gives a tiny-vocabulary model for tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from .attention import check_cu_seqlens, document_positions, packed_causal_attention

VALUE_GATE_CHANNELS = 12  # the value-embedding gate reads this many leading channels
SMEAR_CHANNELS = 24  # the smear gate reads this many leading channels
QK_GAIN = 1.2  # after QK-norm: sharper attention, split between q and k
WINDOW_TILE = 128  # the short window is rounded up to FlashAttention's tile


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    vocab_size: int = 32_768
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 6
    context: int = 2048
    window_pattern: str = "SSSL"  # S: short window, L: the whole context; tiled over the layers
    short_window: int | None = None  # None: a quarter of the context, rounded up to WINDOW_TILE
    rope_base: float = 100_000.0
    logit_softcap: float = 15.0

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of an even size "
                             "(rotary positions rotate pairs of channels)")
        if self.d_model < max(VALUE_GATE_CHANNELS, SMEAR_CHANNELS):
            raise ValueError(f"d_model={self.d_model} is below {SMEAR_CHANNELS}, the channels the smear gate reads")
        if not self.window_pattern or set(self.window_pattern.upper()) - set("SL"):
            raise ValueError(f"window_pattern={self.window_pattern!r}: use the letters S (short window) and L (long)")
        if self.short_window is not None and self.short_window < 0:
            raise ValueError(f"short_window={self.short_window} must be >= 0 tokens back, or None for the default")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window in tokens back (attention.py's `window`); None: the whole context."""
        short = self.short_window
        if short is None:
            short = -(-self.context // 4 // WINDOW_TILE) * WINDOW_TILE
        pattern = self.window_pattern.upper()
        windows = [short if pattern[i % len(pattern)] == "S" else None for i in range(self.n_layers)]
        windows[-1] = None
        return tuple(windows)

    def has_value_embedding(self, layer: int) -> bool:
        """Alternate layers, counted from the last (which always has one)."""
        return layer % 2 == (self.n_layers - 1) % 2


PRESETS = {
    "chat-tiny": ChatConfig(d_model=64, n_layers=2, n_heads=1, context=128),
    "d4": ChatConfig(d_model=256, n_layers=4, n_heads=4, context=512),
    "d6": ChatConfig(d_model=384, n_layers=6, n_heads=6, context=512),
    "d12": ChatConfig(d_model=768, n_layers=12, n_heads=6, context=2048),
}


STREAMS = ("float32", "param")


def widened(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least: the dtype of the residual stream."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def _linear(in_features: int, out_features: int) -> nn.Linear:
    # skip_init: the model draws every initial value itself (init_weights), in a fixed order.
    return skip_init(nn.Linear, in_features, out_features, bias=False, device=torch.get_default_device())


def _embedding(rows: int, width: int) -> nn.Embedding:
    return skip_init(nn.Embedding, rows, width, device=torch.get_default_device())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x (B, T, heads, head_dim): channel i pairs with i + head_dim/2."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ChatConfig, layer: int):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.q = _linear(config.d_model, config.d_model)
        self.k = _linear(config.d_model, config.d_model)
        self.v = _linear(config.d_model, config.d_model)
        self.proj = _linear(config.d_model, config.d_model)
        self.ve_gate = _linear(VALUE_GATE_CHANNELS, config.n_heads) if config.has_value_embedding(layer) else None

    def forward(self, x, value_embedding, cos, sin, cu_seqlens, window):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, self.n_heads, self.head_dim) for proj in (self.q, self.k, self.v))
        if value_embedding is not None:
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VALUE_GATE_CHANNELS]))  # (B, T, heads) in (0, 3)
            v = v + gate.unsqueeze(-1) * value_embedding.view(B, T, self.n_heads, self.head_dim)
        q, k = rms_norm(rotate(q, cos, sin)) * QK_GAIN, rms_norm(rotate(k, cos, sin)) * QK_GAIN
        y = packed_causal_attention(q, k, v, cu_seqlens, window)
        return self.proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ChatConfig):
        super().__init__()
        self.fc = _linear(config.d_model, 4 * config.d_model)
        self.proj = _linear(4 * config.d_model, config.d_model)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: ChatConfig, layer: int):
        super().__init__()
        self.window = config.layer_windows()[layer]
        self.attn = Attention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, value_embedding, cos, sin, cu_seqlens):
        x = x + self.attn(rms_norm(x), value_embedding, cos, sin, cu_seqlens, self.window)
        return x + self.mlp(rms_norm(x))


class ChatGPT(nn.Module):
    def __init__(self, config: ChatConfig, *, stream: str = "float32"):
        super().__init__()
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r}: one of {STREAMS} (float32: the residual stream in float32 "
                             "under the weights' autocast; param: everything in the weights' dtype)")
        self.config = config
        self.stream = stream
        d, V = config.d_model, config.vocab_size
        self.tok_emb = _embedding(V, d)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.value_embeds = nn.ModuleDict({str(i): _embedding(V, d) for i in range(config.n_layers)
                                           if config.has_value_embedding(i)})
        self.lm_head = _linear(d, V)
        self.resid_lambdas = nn.Parameter(torch.empty(config.n_layers))
        self.x0_lambdas = nn.Parameter(torch.empty(config.n_layers))
        self.smear_gate = _linear(SMEAR_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.empty(1))
        self.backout_lambda = nn.Parameter(torch.empty(1))
        # Rotary tables for positions 0 .. context-1, computed in float32 and cast to the
        # activations' dtype where used; not saved (persistent=False): the config fixes them.
        inv_freq = config.rope_base ** -(torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        angles = torch.outer(torch.arange(config.context, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """nanochat's initialisation, drawn from torch's global generator in this order:
        embedding N(0, 0.8); head N(0, 0.001); per block q, k, v ~ U(-s, s) with s =
        sqrt(3 / d_model) (the std of N(0, 1/d_model)), attention and MLP projections zero, the
        MLP's fc U(-0.4 s, 0.4 s); residual scalars from 1.15 down to 1.05 and x0 scalars from
        0.20 down to 0.05 over the layers; smear 0 (gate U(0, 0.02)); backout 0.2; value
        embeddings U(-s, s); value gates U(0, 0.02)."""
        config = self.config
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=0.8)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        s = math.sqrt(3.0 / config.d_model)
        for block in self.blocks:
            for matrix in (block.attn.q, block.attn.k, block.attn.v):
                nn.init.uniform_(matrix.weight, -s, s)
            nn.init.zeros_(block.attn.proj.weight)
            nn.init.uniform_(block.mlp.fc.weight, -0.4 * s, 0.4 * s)
            nn.init.zeros_(block.mlp.proj.weight)
        depth = torch.arange(config.n_layers, dtype=torch.float64) / max(config.n_layers - 1, 1)
        self.resid_lambdas.copy_(1.15 - 0.10 * depth)
        self.x0_lambdas.copy_(0.20 - 0.15 * depth)
        nn.init.zeros_(self.smear_lambda)
        nn.init.constant_(self.backout_lambda, 0.2)
        nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for table in self.value_embeds.values():
            nn.init.uniform_(table.weight, -s, s)
        for block in self.blocks:
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean", *,
                cu_seqlens: torch.Tensor | None = None):
        """Soft-capped logits (B, T, vocab) of `idx` (B, T); with `targets`, also the
        cross-entropy loss (nats; targets of -1 are ignored, as nanochat masks them).
        `cu_seqlens`: the packed documents' starts (attention.py); None: each row is one
        document."""
        # Before the autocast region: a compiled model's in-graph check that raises inside it would
        # leave autocast entered.
        check_inputs(self.config, idx, cu_seqlens)
        with self._mixed_precision(idx.device):
            return self._forward(idx, targets, reduction, cu_seqlens)

    def _mixed_precision(self, device: torch.device):
        """bf16 (fp16) weights: autocast to their dtype, so that matmuls and attention run in it
        while the float32 stream stays float32 (an outer autocast, the reference's, stays)."""
        dtype = self.tok_emb.weight.dtype
        if self.stream == "param" or dtype not in (torch.bfloat16, torch.float16):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def _forward(self, idx, targets, reduction, cu_seqlens):
        B, T = idx.shape
        stream = widened if self.stream == "float32" else (lambda t: t)
        x = rms_norm(stream(self.tok_emb(idx)))
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        first_of_document = None
        if cu_seqlens is not None:
            _, position = document_positions(cu_seqlens.to(idx.device), B * T)
            position = position.view(B, T)
            cos, sin = self.rope_cos[position], self.rope_sin[position]  # (B, T, head_dim/2)
            first_of_document = (position[:, 1:] == 0).unsqueeze(-1)
        cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)  # broadcast over heads

        # Smear: add a gated share of the previous token's embedding, never across a document start.
        gate = stream(self.smear_lambda) * torch.sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))
        previous = x[:, :-1]
        if first_of_document is not None:
            previous = previous.masked_fill(first_of_document, 0.0)
        x = torch.cat([x[:, :1], x[:, 1:] + gate * previous], dim=1)

        x0, backout_layer, x_backout = x, self.config.n_layers // 2, None
        for i, block in enumerate(self.blocks):
            x = stream(self.resid_lambdas[i]) * x + stream(self.x0_lambdas[i]) * x0
            table = self.value_embeds[str(i)] if str(i) in self.value_embeds else None
            x = block(x, None if table is None else stream(table(idx)), cos, sin, cu_seqlens)
            if i == backout_layer:
                x_backout = x
        x = rms_norm(x - stream(self.backout_lambda) * x_backout)

        logits = self.lm_head(x)
        # Soft cap and loss in float32 at least: bf16 logits would round the log-softmax to 8 bits.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        cap = self.config.logit_softcap
        logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
        return logits, loss

    # ---- the optimizer's split (nanochat's setup_optimizer) ----------------------------------
    def muon_adamw_groups(self, *, matrix_lr: float = 0.02, embedding_lr: float = 0.3, unembedding_lr: float = 0.008,
                          scalar_lr: float = 0.5, weight_decay: float = 0.28) -> list[dict]:
        """Param groups for `PackedMuonAdamW` (combined.py), split as nanochat splits them: the
        blocks' matrices (attention, MLP, value gates) to Muon, one group per shape; the token
        embedding, value embeddings, head and scalars to AdamW, each group with nanochat's lr,
        betas, eps and weight decay. The embedding and head lrs scale by (d_model / 768)^-0.5.
        The scalars' groups keep their AdamW state in fp32 mode (`mode="fp32"`, 8 bytes a
        parameter); the other groups take the optimizer's formats. Defaults are nanochat's
        base_train.py settings (lr scaling with the batch size is the caller's). Each group has
        `params`, `param_names`, `kind` and its options."""
        names = {id(p): name for name, p in self.named_parameters()}
        width_scale = (self.config.d_model / 768) ** -0.5

        def group(kind, params, **options):
            params = list(params)
            return {"params": params, "param_names": [names[id(p)] for p in params], "kind": kind, **options}

        def adamw(params, lr, betas, weight_decay, **state_format):
            return group("adamw", params, lr=lr, betas=betas, eps=1e-10, weight_decay=weight_decay, **state_format)

        # The scalars' gradients reach 2^3.9 on the d12 stack, where packed AdamW's RMS code (E4M12,
        # bias 15) tops out near 2: their RMS saturated and they took updates up to ~7x too large
        # (issue 53: replaying the reference's gradients, x0_lambdas moved 1.68 and backout_lambda 3.8
        # of the reference's movement away from it; 0 in fp32 mode). fp32 moments for these ~50
        # parameters (8 bytes each) closed the gap.
        scalar = {"mode": "fp32"}
        groups = [
            adamw(self.lm_head.parameters(), unembedding_lr * width_scale, (0.8, 0.96), 0.01),
            adamw(self.tok_emb.parameters(), embedding_lr * width_scale, (0.8, 0.995), 0.001),
            adamw(self.value_embeds.parameters(), embedding_lr * width_scale * 0.5, (0.8, 0.995), 0.01),
            adamw([self.resid_lambdas], scalar_lr * 0.01, (0.8, 0.95), 0.05, **scalar),
            adamw([self.x0_lambdas], scalar_lr, (0.96, 0.95), 0.0, **scalar),  # nanochat's higher beta1 for x0
            adamw([self.smear_gate.weight, self.smear_lambda, self.backout_lambda], 0.2, (0.8, 0.95), 0.0, **scalar),
        ]
        matrices = list(self.blocks.parameters())
        for shape in sorted({tuple(p.shape) for p in matrices}):
            groups.append(group("muon", (p for p in matrices if tuple(p.shape) == shape), lr=matrix_lr,
                                momentum=0.95, weight_decay=weight_decay))
        listed = sum(len(g["params"]) for g in groups)
        assert listed == len(names), f"the groups list {listed} parameters, the model has {len(names)}"
        return groups


def check_inputs(config: ChatConfig, idx: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> None:
    """Refuse token ids the model cannot take (ValueError): not (B, T), or T past the context;
    and a CPU `cu_seqlens` that does not describe whole documents (`check_cu_seqlens`)."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
        raise ValueError(f"idx must be a (batch, sequence) tensor of token ids, got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if idx.size(1) > config.context:
        raise ValueError(f"sequence length {idx.size(1)} exceeds the model's context {config.context}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, *idx.shape)


def compile_chat_model(model: nn.Module, backend="inductor"):
    """torch.compile(model, backend=backend) (a ChatGPT, or a wrapper taking its arguments), as a
    function called as the model is, that compiles once for batches of any document count: each
    call marks its cu_seqlens's length (documents + 1) dynamic before the compiled model sees it.
    (Otherwise dynamo specialises the first batch's length and compiles again for another.) The
    eager computation is unchanged: the same cu_seqlens, no padding. A backend that specialises
    the length anyway raises at the first compilation, naming it, instead of recompiling.

    A plain model compiles whole (`fullgraph=True`): anything in its forward that dynamo cannot
    trace raises instead of splitting the graph and running the rest eagerly (issue 55: a graph
    break at every layer left the stream, soft cap and loss eager, a third of the step). A DDP or
    FSDP2 model compiles as torch.compile does them (their hooks split the graph by design).
    The inputs are checked here, before the compiled model runs (`check_inputs`), so that a bad
    one raises the eager model's ValueError, not dynamo's report of it."""
    compiled = torch.compile(model, backend=backend, fullgraph=not _distributed_wrapper(model))
    config = getattr(getattr(model, "module", model), "config", None)  # DDP's inner model, or the model

    def forward(idx, targets=None, reduction="mean", *, cu_seqlens=None):
        if config is not None:
            check_inputs(config, idx, cu_seqlens)
        if cu_seqlens is not None:
            torch._dynamo.mark_dynamic(cu_seqlens, 0)
        return compiled(idx, targets, reduction, cu_seqlens=cu_seqlens)

    return forward


def _distributed_wrapper(model: nn.Module) -> bool:
    """Whether `model` is DDP or FSDP2's (whose hooks torch.compile splits the graph around)."""
    from torch.nn.parallel import DistributedDataParallel
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        FSDPModule = ()
    return isinstance(model, DistributedDataParallel) or isinstance(model, FSDPModule)


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one per frame it compiles
    again): read before and after a batch to see whether that batch compiled anything."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def chat_parameter_kind(name: str) -> str:
    """Telemetry's kind of a ChatGPT parameter (log.jsonl's "kinds")."""
    if name.startswith("tok_emb."):
        return "embedding"
    if name.startswith("value_embeds."):
        return "value_embedding"
    if name.startswith("lm_head."):
        return "head"
    if ".attn.ve_gate." in name:
        return "value_gate"
    if ".attn." in name:
        return "attention_" + name.split(".")[-2]  # attention_q, _k, _v, _proj
    if ".mlp." in name:
        return "mlp"
    return "scalar"  # resid/x0 lambdas, smear gate and lambda, backout lambda
