"""A framework-neutral optimizer state, so a run can move between torch and JAX.

Tensors are listed in parameter order: torch's param_groups flattened, JAX's tree leaves.
Saved as safetensors, which torch, JAX and numpy all read.

A bf16 parameter of the torch optimizer keeps its FP32 master split (FORMAT.md, "Split
masters"): its state adds an int16 low half, listed in `low_halves` (None for FP32 parameters,
and `low_halves` is None when every parameter is FP32). An importer that holds only FP32
parameters refuses a state with low halves (`check`), so no master is cut silently.

A state of several rules (torch's PackedMuonAdamW, JAX's packed_muon: Muon's momenta and
AdamW's words) has `format` MIXED and each tensor's identity in `formats`; the importers of one
rule refuse it. A Muon tensor holds its matrix in torch's [out, in] layout (JAX transposes on
export and import: docs/MUON.md, "The layout"), and its count is None where the exporter keeps
none (torch's Muon has no step count; JAX's packed_muon exports its `count`). A packed Muon
tensor's matrices each have an int32 exponent (their momentum is decode(code) * 2**exponent),
listed in `exponents` (shape (): one matrix; [batch] for a JAX leaf of several); a packed Muon
tensor of the identity before the exponents has none and reads with exponent 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file, save_file

from .atomic_file import atomic_path
from .adamw.state_format import StateFormat
from .codecs import LOW_HALF_DTYPE


MIXED = "mixed"  # `format` of a state whose tensors have several formats (`formats` lists them)


@dataclass
class PortableState:
    format: str  # StateFormat.identity of every tensor, or MIXED
    counts: list[int | None]  # each tensor's step count (None: the exporter keeps none, as torch's Muon)
    moments: list[np.ndarray]  # each tensor's state entry: AdamW's uint32 words or float32 [2, *shape],
    #                            Muon's uint16 codes or float32 momentum, shaped like the parameter
    low_halves: list[np.ndarray | None] | None = None  # int16 shaped like the parameter, for bf16 parameters
    formats: list[str] | None = None  # with format MIXED: each tensor's identity
    exponents: list[np.ndarray | None] | None = None  # int32 per matrix, for packed Muon tensors

    @classmethod
    def of(cls, identities: list[str], counts, moments, low_halves, exponents=None) -> "PortableState":
        """A state from per-tensor identities: one `format` when they agree, else MIXED with
        `formats`; `low_halves` and `exponents` None when no tensor has one."""
        lows = low_halves if any(low is not None for low in low_halves) else None
        exponents = exponents if exponents is not None and any(e is not None for e in exponents) else None
        if len(set(identities)) == 1:
            return cls(identities[0], list(counts), list(moments), lows, None, exponents)
        return cls(MIXED, list(counts), list(moments), lows, list(identities), exponents)

    def tensor_formats(self) -> list[str]:
        """Each tensor's format identity."""
        return list(self.formats) if self.format == MIXED else [self.format] * len(self.moments)

    def check(self, fmt: StateFormat, shapes: list[tuple[int, ...]], split: list[bool] | None = None) -> None:
        """Raise ValueError unless this state fits parameters of `shapes` under `fmt`; `split[i]`
        says parameter i is bf16 with a split master (None: every parameter is FP32)."""
        if self.format == MIXED:
            raise ValueError(
                f"portable state mixes formats {sorted(set(self.formats or []))} (Muon and AdamW tensors, exported "
                f"by PackedMuonAdamW or packed_muon), the optimizer has one, {fmt.identity!r}: import it into the "
                "combined optimizer (PackedMuonAdamW.import_state, packed_adamw.jax.muon.import_muon_state)"
            )
        if self.format != fmt.identity:
            raise ValueError(
                f"portable state has format {self.format!r}, the optimizer {fmt.identity!r}: "
                "use the same rule and the same mode and biases on both sides"
            )
        self.check_tensors([fmt] * len(shapes), shapes, split)

    def check_tensors(self, fmts: list, shapes: list[tuple[int, ...]], split: list[bool] | None = None,
                      names: list[str] | None = None) -> None:
        """`check` with a format per tensor (`fmts[i]`, a StateFormat of any rule) and the
        parameters' names for the messages."""
        def where(i):
            return f"portable state tensor {i}" + (f" ({names[i]})" if names is not None else "")

        if len(self.moments) != len(shapes) or len(self.counts) != len(shapes):
            raise ValueError(f"portable state holds {len(self.moments)} tensors and {len(self.counts)} counts, the "
                             f"parameters are {len(shapes)}: export from an optimizer over the same parameters")
        identities = self.tensor_formats()
        if len(identities) != len(shapes):
            raise ValueError(f"portable state lists {len(identities)} formats for {len(shapes)} tensors; the file was "
                             "edited or damaged: export the state again")
        for i, (identity, fmt) in enumerate(zip(identities, fmts)):
            if not _reads(fmt, identity):
                raise ValueError(
                    f"{where(i)} has format {identity!r}, the optimizer's {fmt.identity!r}: use the same rule (Muon "
                    "or AdamW) for this parameter and the same modes and biases on both sides"
                )
        for i, (moments, shape, fmt) in enumerate(zip(self.moments, shapes, fmts)):
            expected = fmt.state_shape(shape)
            dtype = np.dtype(fmt.state_dtype)
            if moments.shape != expected or moments.dtype != dtype:
                raise ValueError(
                    f"{where(i)} is {moments.dtype} {moments.shape}, expected {np.dtype(dtype)} "
                    f"{expected}: the parameters or their order differ"
                )
        self._check_exponents(identities, fmts, shapes, where)
        lows = self.low_halves if self.low_halves is not None else [None] * len(shapes)
        split = split if split is not None else [False] * len(shapes)
        if len(lows) != len(shapes):
            raise ValueError(f"portable state holds {len(lows)} low halves, the parameters are {len(shapes)}")
        for i, (low, shape, is_split) in enumerate(zip(lows, shapes, split)):
            if is_split and low is None:
                raise ValueError(
                    f"{where(i)} has no low half: it was exported from an FP32 parameter, but "
                    f"parameter {i} is bf16 here; import it into FP32 parameters like the exporting run's"
                )
            if not is_split and low is not None:
                raise ValueError(
                    f"{where(i)} has a low half (a bf16 parameter's split FP32 master), but "
                    f"parameter {i} is FP32 here; import it into a torch PackedAdamW over the same bf16 parameters"
                )
            if low is not None and (low.shape != tuple(shape) or low.dtype != np.dtype(LOW_HALF_DTYPE)):
                raise ValueError(f"portable state low half {i}" + (f" ({names[i]})" if names is not None else "")
                                 + f" is {low.dtype} {low.shape}, expected "
                                 f"{LOW_HALF_DTYPE} {tuple(shape)}: the parameters or their order differ")

    def _check_exponents(self, identities, fmts, shapes, where) -> None:
        """Exactly the packed Muon tensors of the current identity have exponents: int32, one
        per matrix (the parameter's shape less its last two axes), each one a step can store,
        none under which a code decodes past float32's range (`StateFormat.check_exponent`)."""
        exponents = self.exponents if self.exponents is not None else [None] * len(shapes)
        if len(exponents) != len(shapes):
            raise ValueError(f"portable state holds {len(exponents)} exponents, the parameters are {len(shapes)}; "
                             "the file was edited or damaged: export the state again")
        for i, (exponent, identity, fmt, shape) in enumerate(zip(exponents, identities, fmts, shapes)):
            entry = getattr(fmt, "exponent_entry", None)
            if entry is None or fmt.saved_without_exponents(identity):
                if exponent is not None:
                    raise ValueError(f"{where(i)} ({identity}) has an exponent, which its format does not keep; "
                                     "the file was edited or damaged: export the state again")
                continue
            expected = tuple(shape[:-2])
            if exponent is None:
                raise ValueError(f"{where(i)} ({identity}) needs its matrices' {entry.dtype} exponents of shape "
                                 f"{expected} (its momentum is the codes times 2**exponent), got none; the file "
                                 "was edited or damaged: export the state again")
            fmt.check_exponent(exponent, f"{where(i)} ({identity}): exponents[{i}]", shape=expected,
                               codes=self.moments[i], remedy="the file was edited or damaged: export the state again")

    def muon_exponent(self, i: int, fmt) -> np.ndarray | None:
        """After `check_tensors`: packed Muon tensor i's exponents (zeros for a tensor saved
        before them, which read with exponent 0), or None for a tensor of another format."""
        if getattr(fmt, "exponent_entry", None) is None:
            return None
        if self.exponents is not None and self.exponents[i] is not None:
            return self.exponents[i]
        return np.zeros(self.moments[i].shape[:-2], np.dtype(fmt.exponent_entry.dtype))

    def check_muon_values(self, fmts: list, names: list[str]) -> None:
        """After `check_tensors`: every Muon tensor's count is None or a whole number >= 0, and
        its momentum holds no NaN or Inf (fp32 values, bf16 codes; packed codes are numbers, and
        `check_tensors` refused an exponent under which one decodes past float32's range), as no
        step ever stores one (docs/MUON.md)."""
        # Here, not at the top: core/muon's package loads its Triton kernels, and a portable
        # state must stay readable without them (tools/format_health.py).
        from .muon.state_format import StateFormat as MuonStateFormat

        for i, (fmt, name) in enumerate(zip(fmts, names)):
            if not isinstance(fmt, MuonStateFormat):
                continue
            count = self.counts[i]
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise ValueError(f"portable state tensor {i} ({name}) has step count {count!r}: a Muon tensor's "
                                 "count is None or a whole number >= 0; the file was edited or damaged")
            if not fmt.momentum_finite(self.moments[i]):  # packed codes: checked with their exponents
                raise ValueError(f"portable state tensor {i} ({name}): the momentum holds NaN or Inf, which no step "
                                 "stores; this state cannot continue a run")

    def save(self, path) -> None:
        tensors = {f"moments.{i}": np.array(m, order="C") for i, m in enumerate(self.moments)}  # keeps 0-d shapes
        for i, low in enumerate(self.low_halves or []):
            if low is not None:
                tensors[f"low_half.{i}"] = np.array(low, order="C")
        for i, exponent in enumerate(self.exponents or []):
            if exponent is not None:
                tensors[f"exponent.{i}"] = np.array(exponent, order="C")
        metadata = {"format": self.format, "counts": json.dumps(self.counts)}
        if self.format == MIXED:
            metadata["formats"] = json.dumps(self.formats)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

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
        formats = json.loads(metadata["formats"]) if metadata["format"] == MIXED and "formats" in metadata else None
        if metadata["format"] == MIXED and formats is None:
            raise ValueError(f"{path} says its tensors mix formats but lists none ('formats' is missing from its "
                             "metadata); the file was edited or damaged: export the state again")
        lows = [tensors.get(f"low_half.{i}") for i in range(len(counts))]
        exponents = [tensors.get(f"exponent.{i}") for i in range(len(counts))]
        return cls(metadata["format"], counts, [tensors[f"moments.{i}"] for i in range(len(counts))],
                   lows if any(low is not None for low in lows) else None, formats,
                   exponents if any(e is not None for e in exponents) else None)


def _reads(fmt, identity: str) -> bool:
    """Whether a tensor saved with `identity` loads under `fmt`: its identity, or one it still
    reads (a Muon packed state saved before its exponents: `StateFormat.reads`)."""
    reads = getattr(fmt, "reads", None)
    return reads(identity) if reads is not None else identity == fmt.identity
