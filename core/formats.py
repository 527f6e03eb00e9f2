"""Deprecated (1.1): the 1.0 module path core/formats.py, kept so that 1.0 imports and objects pickled by
1.0 still load. Its names live in core/codecs.py (the generic codes, split masters) and core/adamw/state_format.py (AdamW's state format); import them from there."""
import warnings

from .adamw.state_format import *  # noqa: F401,F403
from .codecs import *  # noqa: F401,F403

warnings.warn(
    "packed_adamw.core.formats is deprecated: import from packed_adamw.core.codecs (codes, split masters) or packed_adamw.core.adamw.state_format (StateFormat)",
    DeprecationWarning, stacklevel=2)
