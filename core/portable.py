"""A framework-neutral optimizer state, so a run can move between torch and JAX.

Tensors are listed in parameter order: torch's param_groups flattened, JAX's tree leaves.
Saved as safetensors, which torch, JAX and numpy all read.

A bf16 parameter of the torch optimizer keeps its FP32 master split (FORMAT.md, "Split
masters"): its state adds an int16 low half, listed in `low_halves` (None for FP32 parameters,
and `low_halves` is None when every parameter is FP32). An importer that holds only FP32
parameters refuses a state with low halves (`check`), so no master is cut silently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file, save_file

from .atomic_file import atomic_path
from .adamw.state_format import StateFormat
from .codecs import LOW_HALF_DTYPE


@dataclass
class PortableState:
    format: str  # StateFormat.identity
    counts: list[int]  # each tensor's step count
    moments: list[np.ndarray]  # uint32 words shaped like the parameter, or float32 [2, *shape]
    low_halves: list[np.ndarray | None] | None = None  # int16 shaped like the parameter, for bf16 parameters

    def check(self, fmt: StateFormat, shapes: list[tuple[int, ...]], split: list[bool] | None = None) -> None:
        """Raise ValueError unless this state fits parameters of `shapes` under `fmt`; `split[i]`
        says parameter i is bf16 with a split master (None: every parameter is FP32)."""
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
        lows = self.low_halves if self.low_halves is not None else [None] * len(shapes)
        split = split if split is not None else [False] * len(shapes)
        if len(lows) != len(shapes):
            raise ValueError(f"portable state holds {len(lows)} low halves, the parameters are {len(shapes)}")
        for i, (low, shape, is_split) in enumerate(zip(lows, shapes, split)):
            if is_split and low is None:
                raise ValueError(
                    f"portable state tensor {i} has no low half: it was exported from an FP32 parameter, but "
                    f"parameter {i} is bf16 here; import it into FP32 parameters like the exporting run's"
                )
            if not is_split and low is not None:
                raise ValueError(
                    f"portable state tensor {i} has a low half (a bf16 parameter's split FP32 master), but "
                    f"parameter {i} is FP32 here; import it into a torch PackedAdamW over the same bf16 parameters"
                )
            if low is not None and (low.shape != tuple(shape) or low.dtype != np.dtype(LOW_HALF_DTYPE)):
                raise ValueError(f"portable state low half {i} is {low.dtype} {low.shape}, expected "
                                 f"{LOW_HALF_DTYPE} {tuple(shape)}: the parameters or their order differ")

    def save(self, path) -> None:
        tensors = {f"moments.{i}": np.array(m, order="C") for i, m in enumerate(self.moments)}  # keeps 0-d shapes
        for i, low in enumerate(self.low_halves or []):
            if low is not None:
                tensors[f"low_half.{i}"] = np.array(low, order="C")
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": self.format, "counts": json.dumps(self.counts)})

    @classmethod
    def load(cls, path) -> "PortableState":
        """Read a saved state; ValueError naming the file when it is damaged or not a PortableState."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
            tensors = load_file(str(path))
        except SafetensorError as error:
            raise ValueError(f"cannot read portable state {path}: {error}; it is truncated or corrupted: "
                             "export the state again") from error
        if not {"format", "counts"} <= metadata.keys():
            raise ValueError(f"{path} is a safetensors file but not a portable state (its metadata has no "
                             "'format' and 'counts'); pass a file written by PortableState.save")
        counts = json.loads(metadata["counts"])
        lows = [tensors.get(f"low_half.{i}") for i in range(len(counts))]
        return cls(metadata["format"], counts, [tensors[f"moments.{i}"] for i in range(len(counts))],
                   lows if any(low is not None for low in lows) else None)
