"""packed_adamw.inspect: look inside saved optimizer states (docs/FORMAT_HEALTH.md).

    python -m packed_adamw.inspect PATH [--plot out.png] [--json]
    python -m packed_adamw.inspect PATH --explain 'NAME[INDEX]' --grad G [--param P] [--lr ...]

PATH is a trainer checkpoint, a chat_train training state (or the run directory of either: the
newest state of chat_train's), a torch optimizer state file or a PortableState file, of any
rule (AdamW, Muon, both: each tensor's rule comes from the format identity the file records,
through core/rules.py). Reading a PortableState needs only numpy and safetensors; the other
three need torch, the plot matplotlib. NaN and Inf in a state (damaged: no step stores them)
are counted per tensor and listed first, and left out of the statistics.
"""
from .explain import Walk, walk_step
from .files import InspectError, StateFile, TensorState, load_state_file

__all__ = ["InspectError", "StateFile", "TensorState", "Walk", "load_state_file", "walk_step"]
