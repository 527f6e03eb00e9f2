"""Transitional (issue 36): the names tools/inspect_state and the reference trainer still
import from here. Their homes: the generic codecs in core/codecs.py, AdamW's state format in
core/adamw/state_format.py. New code imports from those; this module goes once their import
lines are rewritten."""
from .codecs import (  # noqa: F401
    BIAS_RANGE,
    CODE_BITS,
    CODE_MAGNITUDE_MASK,
    CODE_MASK,
    CODE_SIGN_BIT,
    FP16,
    LOW_HALF_DTYPE,
    LOW_HALF_KEY,
    SPLIT_LO_SIGN,
    SPLIT_MASTER_MAX,
    SPLIT_MASTER_MAX_BITS,
    SPLIT_SIGN_BIT,
    MiniFloat,
    join_master,
    read_master,
    split_master,
)
from .adamw.state_format import (  # noqa: F401
    DEFAULT_M_BIAS,
    DEFAULT_RMS_BIAS,
    E4M11,
    E4M12,
    MODE_IDS,
    MODES,
    MOMENT_SHIFT,
    StateFormat,
    first_moment_format,
    pack_words,
    rms_format,
    unpack_words,
)
