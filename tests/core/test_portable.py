"""PortableState files: a damaged or foreign file is refused naming the file (numpy only)."""
import numpy as np
import pytest
from safetensors.numpy import save_file

from packed_adamw.core.portable import PortableState


def saved_state(path):
    state = PortableState("packed:m=SE4M11b15,rms=UE4M12b15", [3, 3],
                          [np.arange(6, dtype=np.uint32).reshape(2, 3), np.arange(4, dtype=np.uint32)])
    state.save(path)
    return state


def test_a_saved_state_loads_back_bit_for_bit(tmp_path):
    state = saved_state(tmp_path / "s.safetensors")
    loaded = PortableState.load(tmp_path / "s.safetensors")
    assert (loaded.format, loaded.counts, loaded.low_halves) == (state.format, state.counts, None)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(loaded.moments, state.moments))


def test_a_truncated_state_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "s.safetensors"
    saved_state(path)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-5])  # the header intact, the last tensor cut short
    with pytest.raises(ValueError, match=f"cannot read portable state {truncated}: .*truncated or corrupted"):
        PortableState.load(truncated)
    truncated.write_bytes(path.read_bytes()[:20])  # the header cut short
    with pytest.raises(ValueError, match=f"cannot read portable state {truncated}: .*truncated or corrupted"):
        PortableState.load(truncated)


def test_another_safetensors_file_is_named_foreign(tmp_path):
    save_file({"x": np.zeros(2, dtype=np.float32)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.safetensors is a safetensors file but not a portable state"):
        PortableState.load(tmp_path / "model.safetensors")
