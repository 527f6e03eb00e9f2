import pytest
import torch

from packed_adamw.tokenizer import VOCAB_SIZE
from packed_adamw.torch.gpt.model import GPT, PRESETS, GPTConfig


@pytest.mark.parametrize("name, count", [("reference", 11_550_240), ("tiny", 2_357_888), ("micro", 413_024)])
def test_preset_parameter_counts(name, count):
    config = GPTConfig.preset(name)
    assert config.vocab_size == VOCAB_SIZE
    assert GPT(config).num_parameters() == count


def test_head_is_tied_to_the_token_embedding():
    model = GPT(PRESETS["micro"])
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and not any("head" in name for name in names)


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    model = GPT(PRESETS["micro"])
    idx = torch.randint(0, VOCAB_SIZE, (3, 16))
    assert model(idx).shape == (3, 16, VOCAB_SIZE)
    _, loss = model(idx, idx)
    # At initialisation the prediction is close to uniform: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB_SIZE))).item()) < 0.5
    _, summed = model(idx, idx, reduction="sum")
    assert torch.allclose(summed, loss * idx.numel(), rtol=1e-5)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(PRESETS["micro"])
    idx = torch.randint(0, VOCAB_SIZE, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % VOCAB_SIZE
    with torch.no_grad():
        assert torch.allclose(model(idx)[0, :10], model(changed)[0, :10], atol=1e-6)
        assert not torch.allclose(model(idx)[0, 10:], model(changed)[0, 10:], atol=1e-6)


def test_too_long_input_and_bad_heads_are_refused():
    with pytest.raises(ValueError, match="exceeds the model's context 16"):
        GPT(PRESETS["micro"])(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown model preset"):
        GPTConfig.preset("huge")
