"""A framework-neutral optimizer state, so a run can move between torch and JAX.

Tensors are listed in parameter order: torch's param_groups flattened, JAX's tree leaves.
Saved as safetensors, which torch, JAX and numpy all read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file, save_file

from .atomic_file import atomic_path
from .formats import StateFormat


@dataclass
class PortableState:
    format: str  # StateFormat.identity
    counts: list[int]  # each tensor's step count
    moments: list[np.ndarray]  # uint32 words shaped like the parameter, or float32 [2, *shape]

    def check(self, fmt: StateFormat, shapes: list[tuple[int, ...]]) -> None:
        """Raise ValueError unless this state fits parameters of `shapes` under `fmt`."""
        if self.format != fmt.identity:
            raise ValueError(
                f"portable state has format {self.format!r}, the optimizer {fmt.identity!r}: "
                "use the same mode, m_bias and rms_bias on both sides"
            )
        if len(self.moments) != len(shapes):
            raise ValueError(f"portable state holds {len(self.moments)} tensors, the parameters are {len(shapes)}")
        for i, (moments, shape) in enumerate(zip(self.moments, shapes)):
            expected = fmt.state_shape(shape)
            dtype = np.dtype(fmt.state_dtype)
            if moments.shape != expected or moments.dtype != dtype:
                raise ValueError(
                    f"portable state tensor {i} is {moments.dtype} {moments.shape}, expected {np.dtype(dtype)} "
                    f"{expected}: the parameters or their order differ"
                )

    def save(self, path) -> None:
        tensors = {f"moments.{i}": np.array(m, order="C") for i, m in enumerate(self.moments)}  # keeps 0-d shapes
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": self.format, "counts": json.dumps(self.counts)})

    @classmethod
    def load(cls, path) -> "PortableState":
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        counts = json.loads(metadata["counts"])
        return cls(metadata["format"], counts, [tensors[f"moments.{i}"] for i in range(len(counts))])
