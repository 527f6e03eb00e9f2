"""`_capture`, the capture machinery both capturable rules share, on the CPU: which table an
eager step and a capture get, what a capture takes for good, what the optimizer keeps alive and
never pickles. Its CUDA behaviour is in test_torch_cuda_graphs.py and test_muon_capturable.py."""
from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch

from packed_adamw.torch import PackedAdamW
from packed_adamw.torch import _capture


def table(length=3):
    return _capture.AddressTable(length, torch.device("cpu"), "PackedX")


def test_an_eager_step_uploads_the_table_only_when_an_address_changed():
    t = table()
    first = t.eager((1, 2, 3))
    first.fill_(-1)  # a repeated step must not write it again
    assert t.eager((1, 2, 3)) is first and first.tolist() == [-1, -1, -1]
    assert t.eager((4, 5, 6)) is first and first.tolist() == [4, 5, 6]  # no capture has it: written in place


def test_a_capture_of_the_eager_addresses_takes_that_table_and_the_next_eager_step_writes_another():
    t = table()
    eager = t.eager((1, 2, 3))
    captured, kept = t.captured((1, 2, 3))
    assert captured is eager and len(kept) == 1 and kept[0] is eager
    later = t.eager((7, 8, 9))
    assert later is not eager and later.tolist() == [7, 8, 9] and eager.tolist() == [1, 2, 3]
    assert t.eager((1, 2, 3)) is later  # the same words again: the new table is rewritten, never the taken one
    assert eager.tolist() == [1, 2, 3]


def test_a_capture_of_other_addresses_takes_a_spare_pair_and_leaves_the_eager_table_alone():
    t = table()
    eager = t.eager((1, 2, 3))
    # Spares are made by eager steps on CUDA only (pinned memory); laid here by hand.
    t.spares = [(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)) for _ in range(2)]
    first, kept = t.captured((4, 5, 6))
    assert [k.tolist() for k in kept] == [[4, 5, 6], [4, 5, 6]] and first is kept[1]
    second, _ = t.captured((7, 8, 9))
    assert second is not first and first.tolist() == [4, 5, 6] and not t.spares
    assert t.eager((1, 2, 3)) is eager and eager.tolist() == [1, 2, 3]


def test_a_capture_of_other_addresses_with_no_spare_left_is_refused_naming_the_optimizer_and_the_remedy():
    t = table()
    t.eager((1, 2, 3))
    with pytest.raises(RuntimeError, match=r"PackedX\(capturable=True\) under a CUDA graph capture: captures that "
                                           r".*took the 2 spares an eager step prepares since the last eager step.*"
                                           r"Take one eager step"):
        t.captured((4, 5, 6))
    assert t.eager((1, 2, 3)).tolist() == [1, 2, 3]


def test_what_captures_keep_lives_with_the_optimizer_once_each_and_travels_in_no_copy_or_pickle():
    p = torch.nn.Parameter(torch.ones(3))
    opt = PackedAdamW([p], lr=1e-3)
    a, b = torch.ones(2), torch.zeros(2)
    _capture.keep(opt, a, b)
    _capture.keep(opt, a)
    assert list(opt._captured.values()) == [a, b] and all(x is y for x, y in zip(opt._captured.values(), [a, b]))
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert "_captured" not in other.__dict__


def test_a_tensor_kept_by_its_storage_keeps_the_memory_after_its_data_is_swapped():
    """What a graph reads of a user's tensor (an lr, a parameter) is its memory: `lr.data = ...`
    keeps the object and lets the memory go unless the memory itself is kept."""
    opt = PackedAdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    lr = torch.tensor([0.5])
    address = lr.data_ptr()
    _capture.keep(opt, _capture.storage(lr))
    lr.data = torch.tensor([0.25])
    kept = [t for t in opt._captured.values() if t.data_ptr() == address]
    assert len(kept) == 1 and kept[0].tolist() == [0.5]


def test_can_capture_says_whether_a_capture_would_find_a_table():
    t = table()
    assert not t.can_capture((1, 2, 3))  # no eager step, no spare (CPU: none are made)
    t.eager((1, 2, 3))
    assert t.can_capture((1, 2, 3)) and not t.can_capture((4, 5, 6))
    t.spares = [(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))]
    assert t.can_capture((4, 5, 6))


def test_what_an_adamw_capture_keeps_is_its_plan_constants_table_and_the_memory_of_every_user_tensor():
    """CapturableStepPlan.captured_reads over a plan's fields (the plan itself needs CUDA): many-
    element parameters, words and a bf16 parameter's low half, a missing low half, an lr."""
    from packed_adamw.torch._plan import CapturableStepPlan

    params = [torch.ones(4), torch.ones(3, dtype=torch.bfloat16)]
    moments = [torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)]
    lows = [None, torch.zeros(3, dtype=torch.int16)]
    plan = SimpleNamespace(lr_tensors=[torch.tensor(0.1)], kernel_params=params, moments=moments, lows=lows,
                           hparams=torch.zeros(1, 5), b1_sign=torch.ones(2), lr_addresses=torch.zeros(1))
    table = torch.zeros(8, dtype=torch.int64)
    reads = CapturableStepPlan.captured_reads(plan, (table,))
    assert reads[:5] == [plan, plan.hparams, plan.b1_sign, plan.lr_addresses, table]
    users = [*plan.lr_tensors, *params, *moments, lows[1]]
    assert [t.data_ptr() for t in reads[5:]] == [t.data_ptr() for t in users]
    assert not any(r is u for r in reads[5:] for u in users)  # their memory, not the objects `.data` can move
