"""Deprecated (1.1): the 1.0 module path core/hyperparams.py, kept so that 1.0 imports and objects pickled by
1.0 still load. Its names live in core/adamw/hyperparams.py (FLOAT32_MAX and FLOAT32_TINY: core/codecs.py); import them from there."""
import warnings

from .adamw.hyperparams import *  # noqa: F401,F403
from .codecs import FLOAT32_MAX, FLOAT32_TINY  # noqa: F401

warnings.warn(
    "packed_adamw.core.hyperparams is deprecated: import from packed_adamw.core.adamw.hyperparams",
    DeprecationWarning, stacklevel=2)
