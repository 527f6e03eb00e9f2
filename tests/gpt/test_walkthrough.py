"""The walkthrough (gpt/walkthrough.py): on a tiny chat model trained two steps with bf16 weights
and PackedMuonAdamW, every stage of the last layer's forward, the hand backward and one Muon
step agrees with the model, autograd and the optimizer; a corrupted momentum word is reported."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import numpy as np
import pytest
import torch

from packed_adamw.core.muon import E5M10
from packed_adamw.core.muon.float32 import floor_log2, ldexp32
from packed_adamw.torch.combined import PackedMuonAdamW
from packed_adamw.torch.gpt import walkthrough, walkthrough_muon, walkthrough_report
from packed_adamw.torch.gpt.chat_model import PRESETS, ChatGPT
from packed_adamw.torch.gpt.packed_data import PackedBatch, cu_seqlens_of
from packed_adamw.torch.gpt.schedules import ScheduleConfig, apply_schedule, build_schedule
from packed_adamw.torch.gpt.training_state import save_state, state_file_name

# d4's layout, narrow: 4 layers of 64 channels, 4 heads of 16; a 61-token vocabulary.
MODEL = {"preset": "d4", "vocab_size": 61, "d_model": 64, "n_heads": 4}
BOS, ROWS, CONTEXT = 0, 2, 24


class FixedBatches:
    """A loader over prepared packed batches (save_state reads peek() and state_dict())."""

    def __init__(self, batches):
        self.batches, self.cursor = batches, 0

    def peek(self) -> PackedBatch:
        return PackedBatch(*(t.clone() for t in self.batches[self.cursor]))

    def next_batch(self) -> PackedBatch:
        batch = self.peek()
        self.cursor += 1
        return batch

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}


def packed_batch(generator) -> PackedBatch:
    rows = torch.randint(1, MODEL["vocab_size"], (ROWS, CONTEXT + 1), generator=generator)
    rows[:, 0] = BOS
    rows[0, 9] = rows[0, 17] = rows[1, 12] = BOS  # documents of 9, 8, 7 and 12, 12 tokens
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    targets[1, 5] = -1  # an ignored target
    return PackedBatch(inputs, targets, cu_seqlens_of(inputs, BOS))


def train_and_save(directory, device: str = "cpu", steps: int = 2, dtype=torch.bfloat16, run_config=None,
                   schedule_steps: int = 10, optimizer_options=None, edit=None):
    """`edit(model, optimizer)`, if given, runs after the training and before the save."""
    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS[MODEL["preset"]], **{k: v for k, v in MODEL.items() if k != "preset"})
    model = ChatGPT(config).to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    optimizer = PackedMuonAdamW(model.muon_adamw_groups(weight_decay=0.2), **(optimizer_options or {}))
    generator = torch.Generator().manual_seed(1)
    loader = FixedBatches([packed_batch(generator) for _ in range(steps + 1)])
    schedule = build_schedule(ScheduleConfig(num_steps=schedule_steps, warmup_steps=2, momentum_warmup_steps=4,
                                             weight_decay=0.2))
    for t in range(steps):
        batch = loader.next_batch()
        apply_schedule(optimizer, schedule, t)
        _, loss = model(batch.inputs.to(device), batch.targets.to(device), cu_seqlens=batch.cu_seqlens.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if edit is not None:
        edit(model, optimizer)
    return save_state(directory / state_file_name(steps), model=model, optimizer=optimizer, loader=loader,
                      schedule=schedule, config=run_config or {"model": MODEL, "param_dtype": "bf16"}, step=steps,
                      t_step=steps)


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    return train_and_save(tmp_path_factory.mktemp("walkthrough"))


def run(path, *args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = walkthrough.main([str(path), *args])
    return code, out.getvalue()


def test_walkthrough_agrees_with_model_autograd_and_optimizer(state_path):
    code, text = run(state_path)
    assert code == 0, text
    assert "0 failed" in text
    for stage in ("block output", "the model's logits", "core's E5M10 encoder", "the optimizer's newton_schulz",
                  "autograd in float64", "the model's autograd in torch.bfloat16"):
        assert stage in text, stage
    # The Muon stages are all bitwise: no tolerance line after "3. one Muon step".
    muon_part = text.split("3. one Muon step")[1]
    assert "relative error" not in muon_part and muon_part.count("bit for bit") >= 12
    code, text = run(state_path, "--matrix", "attn.q", "--rows", "1")
    assert code == 0 and "Muon step on blocks.3.attn.q.weight" in text and "the first 1 of the saved 2" in text, text


def no_forward(*args, **kwargs):
    raise AssertionError("the model's forward ran before the walkthrough checked its arguments and the state")


def test_arguments_are_checked_before_the_forward(state_path, monkeypatch, capsys):
    """--matrix and --rows are checked against the state before any forward or backward: exit 2,
    naming the flag and what it accepts."""
    monkeypatch.setattr(walkthrough, "run_model", no_forward)
    for args, message in ((["--matrix", "attn.z"], r"--matrix 'attn.z' names no Muon matrix of the state; give a part "
                                                   r"of the last block's \(attn.k, attn.proj, attn.q, attn.v, "
                                                   r"attn.ve_gate, mlp.fc, mlp.proj\) or a full name of a Muon "
                                                   r"matrix \(blocks.0.attn.k.weight, \.\.\., "
                                                   r"blocks.3.mlp.proj.weight, 26 in all\)"),
                          (["--matrix", "weight"], r"--matrix 'weight' names more than one Muon matrix "
                                                   r"\['blocks.3.attn.k.weight', "),
                          (["--rows", "3"], r"--rows 3: the saved batch has 2 rows; pass 1 to 2"),
                          (["--rows", "0"], r"--rows 0: the saved batch has 2 rows; pass 1 to 2")):
        code, _ = run(state_path, *args)
        error = capsys.readouterr().err
        assert code == 2 and re.search(message, error), (args, error)


def test_nonfinite_momentum_and_weight_are_named_before_the_step(tmp_path, monkeypatch, capsys):
    """A NaN momentum code (Muon's bf16 mode) and an Inf weight are named, the state's tensors,
    before the forward (not shown as a Newton-Schulz mismatch): exit 2."""
    def poison(model, optimizer):
        optimizer.state[model.blocks[-1].mlp.fc.weight]["momentum_code"].view(-1)[5] = 0x7FC0  # a bf16 quiet NaN
        with torch.no_grad():
            model.blocks[0].attn.q.weight[1, 2] = float("inf")

    path = train_and_save(tmp_path, steps=1, optimizer_options={"mode": "bf16"}, edit=poison)
    monkeypatch.setattr(walkthrough, "run_model", no_forward)
    code, _ = run(path)
    error = capsys.readouterr().err
    assert code == 2, error
    assert re.search(r"(?s)holds NaN or Inf.*params/blocks.0.attn.q.weight/w: 1 of 4096 values.*"
                     r"params/blocks.3.mlp.fc.weight/opt/momentum_code: 1 of 16384 values", error), error


def test_the_final_state_says_which_state_to_walk_through(tmp_path, monkeypatch, capsys):
    """A finished run's last state has no next step (no schedule row): refused before the forward,
    saying which states the walkthrough takes and how chat_train writes them."""
    path = train_and_save(tmp_path, steps=1, schedule_steps=1)
    monkeypatch.setattr(walkthrough, "run_model", no_forward)
    code, _ = run(path)
    error = capsys.readouterr().err
    assert code == 2 and re.search(r"(?s)t_step 1.*schedule's 1 steps.*no next step.*a mid-run state.*"
                                   r"chat_train --save-every K.*--stop-at STEP", error), error


@pytest.mark.parametrize("key, index, flip, stage", [
    ("momentum_code", 5, 0x0400, "loaded momentum"),  # one exponent bit of one word
    ("mu_exponent", 0, 4, "loaded exponent"),  # the matrix's power-of-two exponent, 16x off
])
def test_corrupted_momentum_word_is_reported(state_path, monkeypatch, key, index, flip, stage):
    """The optimizer's copy of the momentum (a word, or the matrix's exponent) gets flipped after
    the load: the walkthrough, which decodes the file's words under the file's exponent, must
    disagree with the loaded state and the optimizer's step."""
    restore = walkthrough.restore

    def corrupted(*args, **kwargs):
        restored = restore(*args, **kwargs)
        p = restored.model.blocks[-1].mlp.fc.weight
        restored.optimizer.state[p][key].view(-1)[index] ^= flip
        return restored

    monkeypatch.setattr(walkthrough, "restore", corrupted)
    code, text = run(state_path)
    assert code == 1
    assert f"MISMATCH {stage}: not bit for bit equal to the file's (1 of" in text
    assert "MISMATCH new momentum" in text and "FAILED" in text


def test_bit_level_codecs_match_the_contract():
    """The walkthrough's E5M10 decode/encode, split masters, ldexp and floor(log2) against core's,
    on every code and on values around every binade edge, zeros, subnormals and saturation."""
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    decoded = walkthrough_muon.decode_e5m10(codes, 31)
    assert np.array_equal(decoded.numpy().view(np.uint32), E5M10.decode_table.view(np.uint32))
    rng = np.random.default_rng(0)
    values = np.concatenate([E5M10.decode_table, rng.standard_normal(20000).astype(np.float32)
                             * np.float32(2.0) ** rng.integers(-45, 3, 20000).astype(np.float32),
                             np.float32([0.0, -0.0, 3.0, -1e30, 2.0 ** -41, 1.5 * 2.0 ** -41, 2.0 ** -30])])
    values = np.concatenate([values, np.nextafter(values, np.float32(np.inf)), np.nextafter(values, np.float32(0))])
    ours = walkthrough_muon.encode_e5m10(torch.from_numpy(values), 31).numpy().view(np.uint16)
    assert np.array_equal(ours, E5M10.encode_unchecked(values).astype(np.uint16))
    masters = torch.from_numpy(values)
    w, lo = walkthrough_muon.split_master(masters)
    assert torch.equal(walkthrough_muon.join_master(w, lo).view(torch.int32), masters.view(torch.int32))
    # The per-matrix exponent: ldexp's two products (a subnormal result rounds, odd and negative
    # n halve unevenly) and floor(log2 amax) from the bits, subnormal amax included.
    decoded = E5M10.decode_table
    for n in (-252, -177, -149, -40, -1, 0, 1, 27, 148, 254):
        ours = walkthrough_muon.ldexp(torch.from_numpy(decoded), n).numpy()
        assert np.array_equal(ours.view(np.uint32), ldexp32(decoded, n).view(np.uint32)), n
    magnitudes = np.abs(values[np.isfinite(values) & (values != 0)])[::97]
    magnitudes = np.concatenate([magnitudes, np.float32([2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -126 - 2.0 ** -149,
                                                         2.0 ** -126, np.finfo(np.float32).max])])
    assert [walkthrough_muon.floor_log2(torch.tensor(a)) for a in magnitudes] == [floor_log2(a) for a in magnitudes]


def test_wrong_rotation_and_edited_schedule_are_reported(state_path, monkeypatch):
    """The spelled-out rotation is checked against the model's own, stage by stage; the saved
    schedule row against the row the saved ScheduleConfig gives."""
    def swapped(x, cos, sin):  # the pairs turned the other way
        return walkthrough.chat_model.rotate(x, cos, -sin)

    restore = walkthrough.restore

    def edited(*args, **kwargs):
        restored = restore(*args, **kwargs)
        restored.schedule.tables["lr_multiplier"][restored.t_step] *= 0.5
        return restored

    monkeypatch.setattr(walkthrough, "rotate", swapped)
    monkeypatch.setattr(walkthrough, "restore", edited)
    code, text = run(state_path, "--rows", "1")
    assert code == 1
    assert "MISMATCH rotated q: not bit for bit equal to the model's chat_model.rotate" in text
    assert "MISMATCH rotated k" in text
    assert "MISMATCH schedule row: not bit for bit equal to the row schedules.build_schedule computes" in text
    assert walkthrough.chat_model.rotate.__name__ == "rotate"  # the model's own again


def test_a_newton_schulz_output_that_is_not_finite_is_refused_as_the_optimizer_refuses_it(state_path, monkeypatch):
    """Muon groups whose coefficients overflow (1e20 each, which validation passes) make O
    non-finite: the walkthrough says the matrix is refused and agrees with the optimizer, which
    keeps the momentum and exponent (it had spelled out a stored momentum the optimizer no
    longer writes)."""
    restore = walkthrough.restore

    def overflowing(*args, **kwargs):
        restored = restore(*args, **kwargs)
        for group in restored.optimizer.param_groups:
            if group.get("kind") == "muon":
                group["ns_coefficients"] = (1e20, 1e20, 1e20)
        return restored

    monkeypatch.setattr(walkthrough, "restore", overflowing)
    code, text = run(state_path, "--rows", "1")
    assert code == 0 and "MISMATCH" not in text, text
    assert "the matrix is refused (a non-finite gradient, momentum, Newton-Schulz input or output)" in text


def test_explicit_rms_norm_is_a_tolerance_check_where_bits_agree():
    """Equal bits here do not make the formula bitwise: another kernel may sum in another order."""
    report = walkthrough_report.Report(io.StringIO())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    walkthrough.rms_norm(x, report, "x")
    assert (report.bitwise_passed, report.tolerance_passed, report.failures) == (0, 1, [])
    assert "(bit for bit here)" in report.out.getvalue()


def test_fp32_states(tmp_path):
    """FP32 weights: walked through on the CPU, where chat_train runs them in FP32; refused for
    CUDA, where chat_train runs them under bf16 autocast. A grad_clip in a config (chat_train
    writes none, and clips nothing) changes nothing."""
    path = train_and_save(tmp_path, dtype=torch.float32,
                          run_config={"model": MODEL, "param_dtype": "fp32", "grad_clip": 1e-6})
    code, text = run(path, "--rows", "1")
    assert code == 0 and "0 failed" in text and "weights torch.float32" in text, text
    assert "clip" not in text
    with pytest.raises(walkthrough.TrainingStateError, match="fp32 weights.*bf16 autocast on cuda.*--device cpu"):
        walkthrough.restore(path, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_walkthrough_on_cuda(tmp_path):
    """The Triton momentum and weight kernels and varlen_attn (bf16 on CUDA) against the spelled-out
    stages on the same device."""
    path = train_and_save(tmp_path, device="cuda")
    code, text = run(path, "--device", "cuda")
    assert code == 0, text
