"""Deprecated (1.1): the 1.0 module path core/numpy_step.py, kept so that 1.0 imports and objects pickled by
1.0 still load. Its names live in core/adamw/numpy_step.py; import them from there."""
import warnings

from .adamw.numpy_step import *  # noqa: F401,F403

warnings.warn(
    "packed_adamw.core.numpy_step is deprecated: import from packed_adamw.core.adamw.numpy_step",
    DeprecationWarning, stacklevel=2)
