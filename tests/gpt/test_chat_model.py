"""The "chat" family (nanochat-style GPT, chat_model.py) and packed-document attention
(attention.py): the d12's parameter count and FLOPs per token, nanochat's initialisation, packed
runs equal to each document run alone, the window, the compiled model (once for any number of
documents), the Muon + AdamW split; on CUDA, varlen_attn against the masked-SDPA reference."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from packed_adamw.torch.combined import PackedMuonAdamW
from packed_adamw.torch.gpt.attention import attention_mask, packed_causal_attention, uses_varlen
from packed_adamw.torch.gpt.chat_model import (
    PRESETS, ChatConfig, ChatGPT, chat_parameter_kind, compile_chat_model, compiled_graph_count,
)
from packed_adamw.torch.gpt.families import family_of, new_model
from packed_adamw.torch.gpt.optimizers import optimizer_state_bytes
from packed_adamw.torch.gpt.telemetry import chat_flops_per_token

TINY_VOCAB = 61
# d4's shape with a tiny vocabulary and a 3-token short window, so that the short-window
# layers cut inside the test's documents.
SMALL = dataclasses.replace(PRESETS["d4"], vocab_size=TINY_VOCAB, short_window=3)
# Two rows of 16 tokens: documents of 5, 7 and 4 tokens, then 9 and 7.
ROW_LENGTH, DOCUMENTS = 16, ((5, 7, 4), (9, 7))


def cu_seqlens_of(documents) -> torch.Tensor:
    lengths = [n for row in documents for n in row]
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def perturbed_model(config: ChatConfig, dtype=torch.float64) -> ChatGPT:
    """nanochat's init zeroes the projections and the smear (attention would not reach the
    logits at all); noise on every parameter makes each part of the model matter."""
    torch.manual_seed(0)
    model = ChatGPT(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def test_d12_has_nanochats_286_261_730_parameters():
    with torch.device("meta"):  # shapes only: no memory, no initial values
        model = new_model("d12")
    assert family_of("d12").name == "chat" and isinstance(model, ChatGPT)
    assert model.num_parameters() == 286_261_730
    by_part = {}
    for name, p in model.named_parameters():
        part = name.split(".")[0]
        by_part[part] = by_part.get(part, 0) + p.numel()
    scalars = sum(by_part.pop(k) for k in ("resid_lambdas", "x0_lambdas", "smear_gate", "smear_lambda", "backout_lambda"))
    assert by_part == {"tok_emb": 32_768 * 768, "lm_head": 32_768 * 768, "value_embeds": 6 * 32_768 * 768,
                       "blocks": 12 * 12 * 768 * 768 + 6 * 6 * 12}  # 84,934,656 matrices + 432 value gates
    assert scalars == 50
    config = model.config
    assert (config.vocab_size, config.d_model, config.n_layers, config.n_heads, config.head_dim, config.context) == \
        (32_768, 768, 12, 6, 128, 2048)
    assert config.layer_windows() == (512, 512, 512, None) * 3  # SSSL; the last layer always long
    assert [i for i in range(12) if config.has_value_embedding(i)] == [1, 3, 5, 7, 9, 11]


def test_d12_flops_per_token_are_nanochats_estimate_counted_by_hand():
    """nanochat's estimate_flops: 6 x the weights of every matmul with the token stream (the
    nn.Linear weights: blocks, value and smear gates, head; not the token and value embeddings,
    which are lookups, nor the 26 scalars) + 12 x heads x head_dim x each layer's attention span,
    a short-window layer counted at its window (min(window, context))."""
    with torch.device("meta"):
        model = new_model("d12")
        full_windows = ChatGPT(dataclasses.replace(PRESETS["d12"], window_pattern="L"))
    matmul_weights = 12 * 12 * 768 * 768 + 6 * 12 * 6 + 24 + 768 * 32_768  # blocks, value gates, smear gate, head
    assert matmul_weights == 110_100_936 == model.num_parameters() - 7 * 32_768 * 768 - 26
    per_span = 12 * 6 * 128  # 12 x heads x head_dim
    assert chat_flops_per_token(model, 2048) == 6 * matmul_weights + per_span * (9 * 512 + 3 * 2048) == 759_696_048
    assert chat_flops_per_token(full_windows, 2048) == 6 * matmul_weights + per_span * 12 * 2048 == 887_098_032
    # rows shorter than the context: the long layers span the row, the short ones their window
    assert chat_flops_per_token(model, 1024) == 6 * matmul_weights + per_span * (9 * 512 + 3 * 1024)
    assert chat_flops_per_token(model, 256) == 6 * matmul_weights + per_span * 12 * 256


def test_initialisation_is_nanochats_and_drawn_from_the_global_generator():
    torch.manual_seed(1)
    first = ChatGPT(SMALL)
    torch.manual_seed(1)
    second = ChatGPT(SMALL)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    assert not torch.equal(ChatGPT(SMALL).tok_emb.weight, first.tok_emb.weight)  # the generator moved on
    s = math.sqrt(3 / SMALL.d_model)
    for block in first.blocks:
        assert not block.attn.proj.weight.any() and not block.mlp.proj.weight.any()
        assert block.attn.q.weight.abs().max() <= s and block.mlp.fc.weight.abs().max() <= 0.4 * s
    assert torch.allclose(first.resid_lambdas, torch.tensor([1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05]))
    assert torch.allclose(first.x0_lambdas, torch.tensor([0.20, 0.15, 0.10, 0.05]))
    assert first.smear_lambda.item() == 0 and first.backout_lambda.item() == pytest.approx(0.2)
    assert 0.7 < first.tok_emb.weight.std().item() < 0.9 and first.lm_head.weight.std().item() < 0.002


def explicit_attention(q, k, v, cu_seqlens, window):
    """Query by query: softmax over the keys of its document at most `window` tokens back."""
    B, T, H, D = q.shape
    flat = [t.reshape(B * T, H, D) for t in (q, k, v)]
    out = torch.empty_like(flat[0])
    starts = cu_seqlens.tolist()
    for a, b in zip(starts, starts[1:]):
        for i in range(a, b):
            lo = a if window is None else max(a, i - window)
            scores = torch.einsum("hd,khd->hk", flat[0][i], flat[1][lo:i + 1]) / math.sqrt(D)
            out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), flat[2][lo:i + 1])
    return out.view(B, T, H, D)


@pytest.mark.parametrize("window", [None, 0, 2, 6])
def test_masked_attention_equals_attention_query_by_query(window):
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, ROW_LENGTH, 3, 8, dtype=torch.float64) for _ in range(3))
    cu_seqlens = cu_seqlens_of(DOCUMENTS)
    rows = torch.arange(0, 3 * ROW_LENGTH, ROW_LENGTH, dtype=torch.int32)
    # float64 on both sides, different summation orders: 1e-12 is ~10^4 ulps of the O(1) outputs.
    for starts, given in ((cu_seqlens, cu_seqlens), (rows, None)):
        expected = explicit_attention(q, k, v, starts, window)
        torch.testing.assert_close(packed_causal_attention(q, k, v, given, window), expected, rtol=0, atol=1e-12)
    assert not uses_varlen(q, window)


def test_varlen_keywords_follow_this_torchs_signature(monkeypatch):
    from packed_adamw.torch.gpt import attention
    monkeypatch.setattr(attention, "_VARLEN_PARAMETERS", frozenset({"window_size", "return_aux", "scale"}))  # 2.11+
    assert attention._varlen_window_options(None) == {"window_size": (-1, 0)}
    assert attention._varlen_window_options(511) == {"window_size": (511, 0)}
    monkeypatch.setattr(attention, "_VARLEN_PARAMETERS", frozenset({"is_causal", "return_aux"}))  # 2.10
    assert attention._varlen_window_options(None) == {"is_causal": True}
    assert attention._varlen_window_options(511) is None  # the masked SDPA path runs it


def test_under_autocast_attention_runs_in_the_autocast_dtype(monkeypatch):
    """An FP32 model under autocast reaches attention with float32 q and k (its rotary tables):
    they are cast to the autocast dtype before the kernel is chosen, as autocast casts SDPA's
    inputs, so that on CUDA the varlen kernel (bf16/fp16 only) runs; the result is the bf16
    call's, bit for bit."""
    from packed_adamw.torch.gpt import attention
    seen = []
    monkeypatch.setattr(attention, "uses_varlen", lambda q, window: seen.append(q.dtype) or False)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, ROW_LENGTH, 3, 8) for _ in range(3))
    cu_seqlens = cu_seqlens_of(DOCUMENTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = packed_causal_attention(q, k, v, cu_seqlens, 2)
    expected = packed_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_seqlens, 2)
    assert seen == [torch.bfloat16, torch.bfloat16]  # the kernel choice saw the autocast dtype
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # a device without autocast (meta: shapes only, as memory estimates run the model) is not asked
    meta = torch.empty(2, ROW_LENGTH, 3, 8, device="meta")
    assert packed_causal_attention(meta, meta, meta, cu_seqlens.to("meta"), 2).shape == meta.shape


def test_the_mask_is_block_diagonal_causal_and_windowed():
    mask = attention_mask(cu_seqlens_of(DOCUMENTS), 2, ROW_LENGTH, 2, torch.device("cpu"))[0, 0]
    assert mask[4, 2] and mask[4, 4] and not mask[4, 1] and not mask[4, 5]  # 2 back, itself, not beyond, not ahead
    assert not mask[5, 4] and mask[5, 5] and mask[7, 5] and not mask[8, 5]  # the second document starts at 5


def test_packed_forward_and_backward_equal_each_document_alone():
    """A packed batch against each document run alone (float64): logits, the summed loss, and
    every parameter's gradient against the sum of the documents' gradients. The matmuls have
    other shapes (so other blockings and summation orders), so the bits may differ: measured
    1.4e-14 at most in the logits and 1.3e-14 of a gradient's largest entry; the tolerance,
    1e-11 relative / 1e-12 absolute, leaves ~100x of that, and is far below the 1e-2 and more
    that a token seeing another document makes (checked on the unpacked run)."""
    model = perturbed_model(SMALL)
    torch.manual_seed(3)
    idx = torch.randint(0, TINY_VOCAB, (2, ROW_LENGTH))
    targets = torch.randint(0, TINY_VOCAB, (2, ROW_LENGTH))
    cu_seqlens = cu_seqlens_of(DOCUMENTS)

    logits, loss = model(idx, targets, reduction="sum", cu_seqlens=cu_seqlens)
    loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    alone_logits, alone_loss = [], 0.0
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in lengths:
            doc_logits, doc_loss = model(idx[row:row + 1, start:start + n], targets[row:row + 1, start:start + n],
                                         reduction="sum")
            doc_loss.backward()  # gradients add up over the documents
            alone_logits.append(doc_logits[0])
            alone_loss = alone_loss + doc_loss
            start += n
    tolerance = dict(rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(logits.reshape(-1, TINY_VOCAB), torch.cat(alone_logits), **tolerance)
    torch.testing.assert_close(loss, alone_loss, **tolerance)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, **tolerance, msg=lambda m: f"{name}: {m}")
        assert p.grad.abs().max() > 0, f"{name} got no gradient"

    # The same rows unpacked: later documents see earlier ones, and the comparison fails loudly.
    with torch.no_grad():
        leaked = model(idx).reshape(-1, TINY_VOCAB)
    first_documents = torch.zeros(2 * ROW_LENGTH, dtype=torch.bool)
    first_documents[:5] = first_documents[ROW_LENGTH:ROW_LENGTH + 9] = True
    torch.testing.assert_close(leaked[first_documents], logits.detach().reshape(-1, TINY_VOCAB)[first_documents],
                               **tolerance)
    assert (leaked[~first_documents] - torch.cat(alone_logits).detach()[~first_documents]).abs().max() > 1e-2


def test_bf16_weights_run_the_fp32_reference_forward_on_their_values():
    """A bf16 model keeps its residual stream, norms and logits in float32 and runs its matmuls
    and attention in bf16 (issue 53: the bf16 stream trained worse): its logits and loss are the
    bits of an FP32 model holding the same values under bf16 autocast, which is how chat_train
    runs its reference. stream="param" keeps the earlier forward, a bf16 stream."""
    config = dataclasses.replace(PRESETS["chat-tiny"], vocab_size=96, context=16)
    reference = perturbed_model(config, torch.float32)
    with torch.no_grad():  # FP32 weights holding bf16 values
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    idx = torch.randint(0, config.vocab_size, (2, 16))
    cu = cu_seqlens_of(((5, 11), (16,)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_loss = reference(idx, idx, cu_seqlens=cu)

    streams = {}
    for stream in ("float32", "param"):
        model = ChatGPT(config, stream=stream)
        model.load_state_dict(reference.state_dict())
        for p in model.parameters():  # as chat_train makes bf16 weights: the rotary tables stay FP32
            p.data = p.data.to(torch.bfloat16)
        seen = []
        model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        logits, loss = model(idx, idx, cu_seqlens=cu)
        streams[stream] = seen[0]
        if stream == "float32":
            assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
        else:
            assert not torch.equal(logits, ref_logits)
    assert streams == {"float32": torch.float32, "param": torch.bfloat16}
    with pytest.raises(ValueError, match="stream="):
        ChatGPT(config, stream="bf16")


def test_a_compiled_model_compiles_once_for_any_number_of_documents():
    """compile_chat_model marks cu_seqlens's length (the batch's documents + 1) dynamic: batches of
    2 to 6 documents compile their graphs at the first batch and none after (plain torch.compile
    specialises the first length and compiles again for the next), and the compiled model's loss
    and every gradient equal the eager model's bit for bit (the backend runs dynamo's graphs
    eagerly and counts them), bf16 weights under the model's own autocast. The model is one graph
    (issue 55: an untraceable call in the attention split it at every layer and ran the rest of
    the forward eagerly), and a cu_seqlens the compiled model cannot read is still checked."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = dataclasses.replace(SMALL, n_layers=2, d_model=64, n_heads=2)
    eager, compiled_copy = perturbed_model(config, torch.bfloat16), perturbed_model(config, torch.bfloat16)
    compiled = compile_chat_model(compiled_copy, backend=counting_backend)
    counted = compiled_graph_count()
    torch.manual_seed(7)
    for documents in (((16,), (16,)), ((5, 7, 4), (9, 7)), ((3, 13), (16,)), ((2, 2, 2, 10), (1, 15))):
        idx = torch.randint(0, TINY_VOCAB, (2, ROW_LENGTH))
        results = [model(idx, idx, cu_seqlens=cu_seqlens_of(documents)) for model in (eager, compiled)]
        for _, loss in results:
            loss.backward()
        assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][0], results[1][0])
        for (name, a), b in zip(eager.named_parameters(), compiled_copy.parameters()):
            assert torch.equal(a.grad.view(torch.int16), b.grad.view(torch.int16)), name
            a.grad, b.grad = None, None
        if documents == ((16,), (16,)):
            first = len(graphs)
            assert first == 1 and compiled_graph_count() - counted == first
    assert len(graphs) == first and compiled_graph_count() - counted == first
    # Bad inputs raise the eager model's ValueErrors, before the compiled model runs (fullgraph
    # would otherwise wrap them in dynamo's report); a model compiled without the wrapper checks a
    # CPU cu_seqlens inside its graph (a host read would split it).
    idx = torch.randint(0, TINY_VOCAB, (2, ROW_LENGTH))
    not_whole = torch.tensor([0, 5, 2 * ROW_LENGTH], dtype=torch.int32)
    with pytest.raises(ValueError, match="row boundaries"):
        compiled(idx, idx, cu_seqlens=not_whole)
    for bad_idx, message in ((idx[0], "must be a \\(batch, sequence\\) tensor"),
                             (torch.zeros(1, config.context + 1, dtype=torch.int64), "exceeds the model's context")):
        with pytest.raises(ValueError, match=message):
            compiled(bad_idx, bad_idx)
    plainly_compiled = torch.compile(compiled_copy, backend=counting_backend)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to"):
        plainly_compiled(idx, idx, cu_seqlens=not_whole)


def test_a_short_window_layer_does_not_see_past_its_window():
    """With every layer but the last on a 3-token window (query and the 3 tokens before it),
    block 0's output at a position depends on no token beyond the window (and the smear's one
    step), read through a forward hook."""
    config = dataclasses.replace(SMALL, window_pattern="S")
    model = perturbed_model(config)
    seen = {}
    model.blocks[0].register_forward_hook(lambda module, args, out: seen.setdefault(len(seen), out))
    torch.manual_seed(4)
    idx = torch.randint(0, TINY_VOCAB, (1, ROW_LENGTH))
    changed = idx.clone()
    changed[0, 2] = (changed[0, 2] + 1) % TINY_VOCAB
    with torch.no_grad():
        model(idx), model(changed)
    difference = (seen[0] - seen[1]).abs().amax(-1)[0]
    # The smear carries token 2 into position 3's embedding; attention 3 tokens back carries
    # positions 2 and 3 on to 5 and 6; nothing reaches 7 or earlier positions.
    assert (difference[2:7] > 0).all() and not difference[:2].any() and not difference[7:].any()


def test_bad_cu_seqlens_are_refused_with_what_to_do():
    model = ChatGPT(SMALL)
    idx = torch.zeros(2, ROW_LENGTH, dtype=torch.long)
    with pytest.raises(ValueError, match="int32"):
        model(idx, cu_seqlens=cu_seqlens_of(DOCUMENTS).long())
    with pytest.raises(ValueError, match="row boundaries"):
        model(idx, cu_seqlens=torch.tensor([0, 10, 20, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="from 0 to"):
        model(idx, cu_seqlens=torch.tensor([0, 16, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match="strictly increasing"):
        model(idx, cu_seqlens=torch.tensor([0, 16, 16, 32], dtype=torch.int32))


def test_muon_adamw_groups_are_nanochats_split_and_step_in_packed_muon_adamw():
    torch.manual_seed(5)
    model = ChatGPT(SMALL)
    groups = model.muon_adamw_groups()
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each parameter once
    muon = [n for g in groups if g["kind"] == "muon" for n in g["param_names"]]
    assert sorted(muon) == sorted(n for n, _ in model.blocks.named_parameters(prefix="blocks"))
    scale = (256 / 768) ** -0.5
    adamw = [(g["param_names"][0], g["lr"], g["betas"], g["weight_decay"]) for g in groups if g["kind"] == "adamw"]
    assert adamw == [("lm_head.weight", 0.008 * scale, (0.8, 0.96), 0.01),
                     ("tok_emb.weight", 0.3 * scale, (0.8, 0.995), 0.001),
                     ("value_embeds.1.weight", 0.15 * scale, (0.8, 0.995), 0.01),
                     ("resid_lambdas", 0.005, (0.8, 0.95), 0.05), ("x0_lambdas", 0.5, (0.96, 0.95), 0.0),
                     ("smear_gate.weight", 0.2, (0.8, 0.95), 0.0)]
    assert all(g["lr"] == 0.02 and g["momentum"] == 0.95 and g["weight_decay"] == 0.28
               and len({p.shape for p in g["params"]}) == 1 for g in groups if g["kind"] == "muon")

    optimizer = PackedMuonAdamW(groups)
    idx = torch.randint(0, TINY_VOCAB, (1, 8))
    before = [p.detach().clone() for p in model.parameters()]
    model(idx, idx)[1].backward()
    optimizer.step()
    changed = {n for (n, p), b in zip(model.named_parameters(), before) if not torch.equal(p, b)}
    # Every parameter moved that must: a nonzero gradient, or weight decay in its group (it moves
    # even rows and matrices whose gradient is zero). None other moved: the smear gate (its
    # gradient is zero while the smear's lambda is, at its init), and the scale-invariant scalars
    # whose gradient happens to be exactly zero (the final rms_norm cancels every scale at init:
    # their gradient is rounding noise, zero or not depending on the draw), in groups without decay.
    decayed = {n for g in groups if g["weight_decay"] for n in g["param_names"]}
    must_move = {n for n, p in model.named_parameters() if n in decayed or bool(p.grad.ne(0).any())}
    assert "smear_gate.weight" not in must_move and len(must_move) >= len(before) - 3
    assert changed == must_move


SCALARS = ("resid_lambdas", "x0_lambdas", "smear_gate.weight", "smear_lambda", "backout_lambda")


def test_the_scalar_groups_keep_fp32_adamw_state_and_the_state_costs_what_each_format_does():
    """nanochat's scalars keep fp32 AdamW moments (issue 53: packed AdamW's RMS code saturated on
    their gradients), 8 bytes each (d12's 50: 400 bytes); the embeddings, value embeddings and
    head keep the optimizer's packed AdamW words (4 bytes), the matrices packed Muon codes (2
    bytes, and a 4-byte exponent per matrix). The state holds exactly that."""
    with torch.device("meta"):
        d12 = new_model("d12")
    own = {n: g["mode"] for g in d12.muon_adamw_groups() if "mode" in g for n in g["param_names"]}
    assert own == dict.fromkeys(SCALARS, "fp32")
    assert sum(p.numel() for n, p in d12.named_parameters() if n in own) == 50

    torch.manual_seed(6)
    model = ChatGPT(SMALL)
    groups = model.muon_adamw_groups()
    optimizer = PackedMuonAdamW(groups)
    idx = torch.randint(0, TINY_VOCAB, (1, 8))
    model(idx, idx)[1].backward()
    optimizer.step()
    assert sorted(optimizer.rules) == ["adamw", "adamw:fp32:m=f32,v=f32", "muon"]
    cost = {("adamw", "fp32"): lambda p: 8 * p.numel(), ("adamw", "packed"): lambda p: 4 * p.numel(),
            ("muon", "packed"): lambda p: 2 * p.numel() + 4}
    expected = {name: cost[g["kind"], optimizer.rules[optimizer.rule_key(g)].state_format.mode](p)
                for g in optimizer.param_groups for name, p in zip(g["param_names"], g["params"])}
    names = {id(p): n for n, p in model.named_parameters()}
    held = {names[id(p)]: sum(t.untyped_storage().nbytes() for t in state.values() if torch.is_tensor(t))
            for p, state in optimizer.state.items()}
    assert held == expected
    assert optimizer_state_bytes(optimizer) == sum(expected.values())
    assert sum(held[n] for n in SCALARS) == 8 * sum(p.numel() for n, p in model.named_parameters() if n in SCALARS)


def test_every_parameter_has_a_telemetry_kind():
    with torch.device("meta"):
        model = ChatGPT(PRESETS["d12"])
    kinds = {chat_parameter_kind(n) for n, _ in model.named_parameters()}
    assert kinds == {"embedding", "value_embedding", "head", "value_gate", "attention_q", "attention_k",
                     "attention_v", "attention_proj", "mlp", "scalar"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 511])
def test_cuda_varlen_attention_equals_the_masked_sdpa_reference(window):
    """bf16 varlen_attn against the masked SDPA (bf16) and both against a float32 masked SDPA,
    for 8 rows of 2,048 tokens, 6 heads of 128. Bits cannot match (other kernels, other
    summation orders in bf16): varlen's error against float32 must stay within 2x the bf16
    reference's own error plus 1e-3 (measured earlier on the H200, bf16 varlen vs bf16 masked
    SDPA: 7.8e-3 in the output, 6.3e-2 in dq)."""
    B, T, H, D = 8, 2048, 6, 128
    generator = torch.Generator().manual_seed(6)
    lengths = []
    for _ in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=generator)[:5].add(1).tolist())
        lengths += [b - a for a, b in zip([0] + cuts, cuts + [T])]
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, T, H, D, generator=generator).cuda() for _ in range(3))
    grad_out = torch.randn(B, T, H, D, generator=generator).cuda()
    if not uses_varlen(q.bfloat16(), window):
        pytest.skip(f"torch {torch.__version__}'s varlen_attn cannot run window={window} (2.10 has no window_size)")

    def run(dtype, reference):
        inputs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        mask = attention_mask(cu_seqlens, B, T, window, q.device)
        if reference:
            out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in inputs),
                                                                   attn_mask=mask).transpose(1, 2)
        else:
            out = packed_causal_attention(*inputs, cu_seqlens, window)
        out.backward(grad_out.to(dtype))
        return [out.float()] + [t.grad.float() for t in inputs]

    exact = run(torch.float32, reference=True)
    masked = run(torch.bfloat16, reference=True)
    varlen = run(torch.bfloat16, reference=False)
    for label, e, m, f in zip(("out", "dq", "dk", "dv"), exact, masked, varlen):
        masked_error, varlen_error = (m - e).abs().max().item(), (f - e).abs().max().item()
        print(f"window={window} {label}: |varlen - fp32| {varlen_error:.3e}, |masked bf16 - fp32| "
              f"{masked_error:.3e}, |varlen - masked| {(f - m).abs().max().item():.3e}")
        assert varlen_error <= 2 * masked_error + 1e-3, label
