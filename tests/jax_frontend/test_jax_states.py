"""The state types live in `_states.py` but keep the module paths pickles have always named
(`packed_adamw.jax.transform.PackedAdamWState`, `packed_adamw.jax.muon.PackedMuonState`): a pickle
written before the move loads, and one written now names the same paths."""
from __future__ import annotations

import base64
import pickle

import numpy as np

from packed_adamw.jax import muon, transform

# Written at e9e42dc, before the types moved (numpy leaves: the bytes do not depend on JAX's version).
# PackedAdamWState(count=3, moments={"w": arange(4) uint32}, low_halves=None,
#                  format_counts=FormatCounts(2, ones((1, 3, 2)) uint32))
ADAMW_PICKLE = (
    "gASVdAEAAAAAAACMGnBhY2tlZF9hZGFtdy5qYXgudHJhbnNmb3JtlIwQUGFja2VkQWRhbVdTdGF0ZZSTlCiMFm51bXB5Ll9jb3JlLm11bHRpYX"
    "JyYXmUjAZzY2FsYXKUk5SMBW51bXB5lIwFZHR5cGWUk5SMAmk0lImIh5RSlChLA4wBPJROTk5K/////0r/////SwB0lGJDBAMAAACUhpRSlH2U"
    "jAF3lGgDjAxfcmVjb25zdHJ1Y3SUk5RoBowHbmRhcnJheZSTlEsAhZRDAWKUh5RSlChLAUsEhZRoCIwCdTSUiYiHlFKUKEsDaAxOTk5K/////0"
    "r/////SwB0lGKJQxAAAAAAAQAAAAIAAAADAAAAlHSUYnNOaACMDEZvcm1hdENvdW50c5STlGgFaAtDBAIAAACUhpRSlGgUaBZLAIWUaBiHlFKU"
    "KEsBSwFLA0sCh5RoHolDGAEAAAABAAAAAQAAAAEAAAABAAAAAQAAAJR0lGKGlIGUdJSBlC4=")
# PackedMuonState(count=5, momentum={"m": arange(6) uint16 (2, 3)}, low_halves=None, adamw=<the state above>,
#                 exponents={"m": -4})
MUON_PICKLE = (
    "gASVHgIAAAAAAACMFXBhY2tlZF9hZGFtdy5qYXgubXVvbpSMD1BhY2tlZE11b25TdGF0ZZSTlCiMFm51bXB5Ll9jb3JlLm11bHRpYXJyYXmUjAZz"
    "Y2FsYXKUk5SMBW51bXB5lIwFZHR5cGWUk5SMAmk0lImIh5RSlChLA4wBPJROTk5K/////0r/////SwB0lGJDBAUAAACUhpRSlH2UjAFtlGgDjAxf"
    "cmVjb25zdHJ1Y3SUk5RoBowHbmRhcnJheZSTlEsAhZRDAWKUh5RSlChLAUsCSwOGlGgIjAJ1MpSJiIeUUpQoSwNoDE5OTkr/////Sv////9LAHSU"
    "YolDDAAAAQACAAMABAAFAJR0lGJzTowacGFja2VkX2FkYW13LmpheC50cmFuc2Zvcm2UjBBQYWNrZWRBZGFtV1N0YXRllJOUKGgFaAtDBAMAAACU"
    "hpRSlH2UjAF3lGgUaBZLAIWUaBiHlFKUKEsBSwSFlGgIjAJ1NJSJiIeUUpQoSwNoDE5OTkr/////Sv////9LAHSUYolDEAAAAAABAAAAAgAAAAMA"
    "AACUdJRic05oIowMRm9ybWF0Q291bnRzlJOUaAVoC0MEAgAAAJSGlFKUaBRoFksAhZRoGIeUUpQoSwFLAUsDSwKHlGgwiUMYAQAAAAEAAAABAAAA"
    "AQAAAAEAAAABAAAAlHSUYoaUgZR0lIGUfZRoEmgFaAtDBPz///+UhpRSlHN0lIGULg==")


def _assert_adamw_state(state):
    assert type(state) is transform.PackedAdamWState and type(state.format_counts) is transform.FormatCounts
    assert int(state.count) == 3 and state.low_halves is None
    np.testing.assert_array_equal(state.moments["w"], np.arange(4, dtype=np.uint32))
    assert int(state.format_counts.steps) == 2 and state.format_counts.counts.shape == (1, 3, 2)


def test_pickles_written_before_the_types_moved_load_as_the_same_types():
    _assert_adamw_state(pickle.loads(base64.b64decode(ADAMW_PICKLE)))
    state = pickle.loads(base64.b64decode(MUON_PICKLE))
    assert type(state) is muon.PackedMuonState and int(state.count) == 5 and int(state.exponents["m"]) == -4
    np.testing.assert_array_equal(state.momentum["m"], np.arange(6, dtype=np.uint16).reshape(2, 3))
    _assert_adamw_state(state.adamw)


def test_pickles_written_now_name_the_public_modules():
    state = pickle.loads(base64.b64decode(MUON_PICKLE))
    written = pickle.dumps(state, protocol=4)
    for module in (b"packed_adamw.jax.muon", b"packed_adamw.jax.transform"):
        assert module in written
    assert b"_states" not in written
