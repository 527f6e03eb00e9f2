"""`PackedAdamW` against torch.optim's conventions and hostile-but-realistic input, in the
manner of torch's test/test_optim.py: flags configurations pass, maximize, tensor
hyperparameters, hooks, loading older or damaged states, pickling, failed steps."""
from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch

import torch_helpers as H
from packed_adamw.torch import PackedAdamW
from packed_adamw.torch.optimizer import GROUP_FORMAT_KEY, MAX_STEP, STATE_DICT_KEY

MODES = H.MODES


def make_params(seed=0, shapes=((300,), (13, 17), ())):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_grads(params, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale


def run(opt, params, seeds, scale=1.0):
    for seed in seeds:
        set_grads(params, seed, scale)
        opt.step()


def trained(mode="packed", steps=3, **kwargs):
    params = make_params(0)
    opt = PackedAdamW(params, lr=1e-2, weight_decay=0.1, mode=mode, **kwargs)
    run(opt, params, range(steps))
    return params, opt


def assert_same_run(params_a, opt_a, params_b, opt_b, what):
    for pa, pb in zip(params_a, params_b):
        H.assert_same_bits(pa, pb, f"{what}: params")
        H.assert_same_bits(H.state_tensor(opt_a, pa), H.state_tensor(opt_b, pb), f"{what}: state")
        assert opt_a.state[pa]["step"] == opt_b.state[pb]["step"]


# ============================================================ flags torch.optim.AdamW has ====

@pytest.mark.parametrize("flag,value", [("foreach", None), ("foreach", False), ("fused", None), ("fused", False),
                                        ("capturable", False), ("differentiable", False)])
def test_adamw_flags_asking_for_nothing_missing_are_accepted(flag, value):
    params, opt = trained()
    other = make_params(0)
    flagged = PackedAdamW(other, lr=1e-2, weight_decay=0.1, **{flag: value})
    run(flagged, other, range(3))
    assert_same_run(params, opt, other, flagged, f"{flag}={value}")


@pytest.mark.parametrize("flag", ["foreach", "fused", "differentiable"])
def test_adamw_flags_asking_for_something_else_are_refused_naming_the_flag(flag):
    with pytest.raises(ValueError, match=f"{flag}=True is not supported"):
        PackedAdamW(make_params(), **{flag: True})


def test_capturable_needs_a_tensor_lr_a_gpu_and_no_host_wait():
    with pytest.raises(ValueError, match="capturable=True needs the learning rate as a one-element tensor"):
        PackedAdamW(make_params(), lr=1e-3, capturable=True)
    with pytest.raises(ValueError, match="check_nonfinite=False"):
        PackedAdamW(make_params(), lr=torch.tensor(1e-3), capturable=True, check_nonfinite=True)
    params = make_params()
    opt = PackedAdamW(params, lr=torch.tensor(1e-3), capturable=True)
    set_grads(params, 0)
    with pytest.raises(ValueError, match="capturable=True runs the step on a CUDA device"):
        opt.step()
    assert not opt.state  # refused before any state was made
    opt.param_groups[0]["lr"] = 1e-3  # a float set later, as a float-lr scheduler would
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is 0.001: capturable=True needs"):
        opt.step()


def test_capturable_groups_each_get_their_own_lr_tensor_so_a_scheduler_sets_each():
    """A scheduler fills each group's lr tensor in place: groups sharing the default's one tensor
    would all take the last group's value. The first group that sets no lr holds the tensor
    given (filled in place, it sets that group's lr, as in torch.optim), each later one a copy."""
    params = make_params()
    lr = torch.tensor(1e-3)
    opt = PackedAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=lr, capturable=True)
    first, second = (group["lr"] for group in opt.param_groups)
    assert first is lr and second is not lr
    lr.fill_(2e-3)  # the user's own tensor reaches the first group, not the second
    assert (float(first), float(second)) == (float(np.float32(2e-3)), float(np.float32(1e-3)))
    lr.fill_(1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    assert (float(first), float(second)) == (float(np.float32(1e-3)), float(np.float32(5e-4)))
    assert schedule.get_last_lr() and float(lr) == float(np.float32(1e-3))  # the default stays as given


def test_a_load_keeps_the_first_groups_lr_the_tensor_given_and_one_tensor_for_both_kinds_is_refused():
    """torch's load copies the saved groups' values: the group that held the constructor's lr
    tensor holds it again, filled with the loaded lr, so the tensor the user keeps still steers
    the step after a resume. PackedMuonAdamW refuses one tensor for lr and adamw_lr (the kind
    whose groups come second would hold copies of it)."""
    from packed_adamw.torch import PackedMuonAdamW

    params = make_params()
    lr = torch.tensor(1e-3)
    opt = PackedAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=lr, capturable=True)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(4e-3)
    opt.load_state_dict(sd)
    first, second = (group["lr"] for group in opt.param_groups)
    assert first is lr and float(lr) == float(np.float32(4e-3)) and second is not lr
    lr.fill_(2e-3)
    assert float(opt.param_groups[0]["lr"]) == float(np.float32(2e-3))
    weights = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]
    with pytest.raises(ValueError, match="lr and adamw_lr are one tensor; give each kind its own"):
        PackedMuonAdamW([{"params": weights[:1], "kind": "muon"}, {"params": weights[1:], "kind": "adamw"}],
                        lr=lr, adamw_lr=lr, capturable=True)
    muon_lr, adamw_lr = torch.tensor(0.02), torch.tensor(1e-3)
    both = PackedMuonAdamW([{"params": weights[:1], "kind": "muon"}, {"params": weights[1:], "kind": "adamw"}],
                           lr=muon_lr, adamw_lr=adamw_lr, capturable=True)
    sd = both.state_dict()
    both.load_state_dict(sd)
    assert [group["lr"] is want for group, want in zip(both.param_groups, (muon_lr, adamw_lr))] == [True, True]


def test_muon_and_adamw_refuse_other_groups_and_states_alike_before_anything_changes():
    """PackedMuon and PackedAdamW through one loader check: other group sizes are refused before
    the pending format counts go; a state of the other rule, or of PackedMuonAdamW, is refused
    saying which optimizer saved it; a group of the other `kind` is refused when added (PackedMuon
    would orthogonalise an embedding PackedMuonAdamW's groups mark for AdamW)."""
    from packed_adamw.torch import PackedMuon, PackedMuonAdamW

    def stepped(cls, sizes, track_format=False, **options):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(sum(sizes))]
        opt = cls([{"params": params[:sizes[0]]}, {"params": params[sizes[0]:]}], track_format=track_format,
                  **options)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return opt

    for cls, options in ((PackedMuon, dict(lr=0.02)), (PackedAdamW, {})):
        saved = stepped(cls, (1, 2), **options).state_dict()
        opt = stepped(cls, (2, 1), track_format=True, **options)
        with pytest.raises(ValueError, match=r"parameter groups hold \[1, 2\] parameters, this optimizer's \[2, 1\]"):
            opt.load_state_dict(saved)
        assert len(opt.format_stats()) == 3, cls.__name__  # the counts made before the refused load
    muon, adamw = stepped(PackedMuon, (1, 1), lr=0.02), stepped(PackedAdamW, (1, 1))
    with pytest.raises(ValueError, match="^load_state_dict: .*saved by an optimizer of rule 'adamw', and PackedMuon "
                                         "steps rule 'muon'"):
        muon.load_state_dict(adamw.state_dict())
    weight = torch.nn.Parameter(torch.randn(4, 8))
    both = PackedMuonAdamW([{"params": [weight], "kind": "muon"}], lr=0.02)
    with pytest.raises(ValueError, match="saved by PackedMuonAdamW .*: load it into a PackedMuonAdamW"):
        muon.load_state_dict(both.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets kind='adamw', but PackedMuon steps every group "
                                         "with rule 'muon'"):
        PackedMuon([{"params": [weight], "kind": "adamw"}], lr=0.02)
    with pytest.raises(ValueError, match="sets kind='muon', but PackedAdamW steps every group with rule 'adamw'"):
        PackedAdamW([{"params": [weight], "kind": "muon"}])


@pytest.mark.parametrize("kind", ["PackedAdamW", "PackedMuon", "PackedMuonAdamW"])
def test_a_load_refuses_saved_groups_the_step_could_not_read_and_takes_an_empty_entry_as_not_stepped(kind):
    """torch's loader installs a saved group as it is: one missing a hyperparameter the step
    reads, or holding an invalid one, is refused naming the group and the key before anything
    changes (the next step would fail, the optimizer's own groups gone). An entry `{}` (torch's
    defaultdict makes one where the state was only read) loads as a parameter not yet stepped."""
    from packed_adamw.torch import PackedMuon, PackedMuonAdamW

    def built():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
        if kind == "PackedMuonAdamW":
            return PackedMuonAdamW([{"params": params, "kind": "muon"}], lr=0.02), params
        return {"PackedAdamW": PackedAdamW, "PackedMuon": PackedMuon}[kind](params, lr=0.02), params

    opt, params = built()
    params[0].grad = torch.randn(4, 3)
    opt.step()
    assert len(opt.state[params[1]]) == 0  # read, not stepped: torch's defaultdict keeps an entry {}
    saved = opt.state_dict()
    fresh, fresh_params = built()
    fresh.load_state_dict(copy.deepcopy(saved))
    assert not fresh.state[fresh_params[1]] and fresh.state[fresh_params[0]]
    key = "betas" if kind == "PackedAdamW" else "momentum"
    for edit, message in ((lambda g: g.pop(key), f"lacks '{key}', which every group of this optimizer holds"),
                          (lambda g: g.update(lr=float("nan")), "(lr=nan|is: nan)"),
                          (lambda g: g.update(weight_decay=-1.0), "weight.decay"),
                          (lambda g: g.update(maximize="yes"), "maximize must be True or False")):
        damaged = copy.deepcopy(saved)
        edit(damaged["param_groups"][0])
        before = copy.deepcopy(fresh.state_dict())
        with pytest.raises((ValueError, TypeError), match=f"^load_state_dict: saved param_groups\\[0\\]:? .*{message}"):
            fresh.load_state_dict(damaged)
        after = fresh.state_dict()
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(a, b) for e, f in zip(after["state"].values(), before["state"].values())
                   for a, b in zip(e.values(), f.values()) if isinstance(a, torch.Tensor))


def test_amsgrad_is_refused_saying_the_word_holds_no_third_moment():
    with pytest.raises(ValueError, match="amsgrad=True is not supported.*running maximum"):
        PackedAdamW(make_params(), amsgrad=True)
    PackedAdamW(make_params(), amsgrad=False)


# torch.optim.AdamW's group keys at their defaults (what its param_groups and state_dict hold).
TORCH_ADAMW_GROUP_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                                  fused=None, decoupled_weight_decay=True)


@pytest.mark.parametrize("key,value,message", [
    ("amsgrad", True, r": amsgrad=True is not supported: .*running maximum.*amsgrad=False"),
    ("decoupled_weight_decay", False, r": decoupled_weight_decay=False is not supported: .*decoupled"),
    ("differentiable", True, r": differentiable=True is not supported"),
    ("foreach", True, r": foreach=True is not supported"),
    ("fused", True, r": fused=True is not supported"),
    ("capturable", True, r" sets 'capturable': a group cannot have its own .*PackedAdamW\(\.\.\., capturable=\.\.\.\)"),
    ("mode", "fp32", r" sets 'mode': a group cannot have its own state format.*PackedAdamW\(\.\.\., mode=\.\.\.\)"),
    ("m_bias", 14, r" sets 'm_bias': .*PackedAdamW\(\.\.\., m_bias=\.\.\.\)"),
    ("track_format", True, r" sets 'track_format': .*PackedAdamW\(\.\.\., track_format=\.\.\.\)"),
    ("mu_bias", 30, r" sets 'mu_bias': PackedAdamW has no such option"),
])
def test_a_group_option_packed_adamw_would_ignore_is_refused_in_a_group_and_on_load(key, value, message):
    """A group's state format, step switch or unsupported torch option (amsgrad=True: its words
    hold no running maximum) would be stepped as the optimizer's, silently: refused naming the
    group and the key, whether given with the group or brought by a loaded state_dict."""
    params = make_params()
    with pytest.raises(ValueError, match=rf"^param_groups\[1\]{message}"):
        PackedAdamW([{"params": params[:1]}, {"params": params[1:], key: value}])
    opt = PackedAdamW([{"params": params[:1]}], lr=1e-2)
    with pytest.raises(ValueError, match=rf"^param_groups\[1\]{message}"):
        opt.add_param_group({"params": params[1:], key: value})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params[1:]})
    run(opt, params, range(2))
    saved = opt.state_dict()
    saved["param_groups"][1][key] = value
    before = H.snapshot(opt, params)
    with pytest.raises(ValueError, match=rf"^load_state_dict: saved param_groups\[1\]{message}"):
        opt.load_state_dict(saved)
    assert key not in opt.param_groups[1]
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after the refused load")


def test_the_keys_torch_puts_in_adamw_groups_at_their_defaults_are_accepted_and_change_no_bit():
    """Groups taken from a torch.optim.AdamW (amsgrad=False, foreach=None, ...) build, and a
    state_dict whose groups carry those keys loads: the run is the plain one's, bit for bit."""
    params, opt = trained()
    other = make_params(0)
    groups = [dict(g) for g in torch.optim.AdamW(other, lr=1e-2, weight_decay=0.1).param_groups]
    assert {k: groups[0][k] for k in TORCH_ADAMW_GROUP_DEFAULTS} == TORCH_ADAMW_GROUP_DEFAULTS
    from_torch = PackedAdamW(groups)
    run(from_torch, other, range(3))
    assert_same_run(params, opt, other, from_torch, "groups of torch.optim.AdamW")
    saved = opt.state_dict()
    saved["param_groups"] = [{**g, **TORCH_ADAMW_GROUP_DEFAULTS} for g in saved["param_groups"]]
    from_torch.load_state_dict(saved)
    run(opt, params, range(3, 5))
    run(from_torch, other, range(3, 5))
    assert_same_run(params, opt, other, from_torch, "a state_dict whose groups carry torch's defaults")


@pytest.mark.parametrize("mode", MODES)
def test_maximize_gives_the_bits_of_a_step_on_the_negated_gradient(mode):
    up, down = make_params(1), make_params(1)
    opt_up = PackedAdamW(up, lr=1e-2, weight_decay=0.1, mode=mode, maximize=True)
    opt_down = PackedAdamW(down, lr=1e-2, weight_decay=0.1, mode=mode)
    for seed in range(4):
        set_grads(up, seed)
        set_grads(down, seed)
        for p in down:
            p.grad.neg_()
        opt_up.step()
        opt_down.step()
    assert_same_run(up, opt_up, down, opt_down, "maximize vs negated gradient")
    assert opt_up.param_groups[0]["maximize"] is True


def test_maximize_is_per_group_and_climbs_a_quadratic():
    a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
    opt = PackedAdamW([{"params": [a], "maximize": True}, {"params": [b]}], lr=0.05, weight_decay=0.0)
    for _ in range(20):
        opt.zero_grad()
        ((a ** 2).sum() + (b ** 2).sum()).backward()
        opt.step()
    assert (a.detach() > 1.5).all() and (b.detach() < 0.5).all()


def test_maximize_must_be_a_bool():
    with pytest.raises(TypeError, match="maximize"):
        PackedAdamW(make_params(), maximize=1)


# ============================================================ tensor hyperparameters ====

@pytest.mark.parametrize("mode", MODES)
def test_betas_lr_eps_and_weight_decay_given_as_tensors_give_the_bits_of_floats(mode):
    params, opt = trained(mode)
    other = make_params(0)
    tensors = PackedAdamW(other, lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.999)),
                          eps=torch.tensor(1e-8), weight_decay=torch.tensor(0.1), mode=mode)
    run(tensors, other, range(3))
    assert_same_run(params, opt, other, tensors, "tensor hyperparameters")


@pytest.mark.parametrize("kwargs,start", [
    (dict(lr=-1.0), "Invalid learning rate: lr=-1.0"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: b1 (betas[0])=1.0 is not below 1"),
    (dict(betas=(0.9, -0.5)), "Invalid beta parameter at index 1: b2 (betas[1])=-0.5 is negative"),
    (dict(betas=(torch.tensor(1.5), 0.9)), "Invalid beta parameter at index 0: b1 (betas[0])=1.5 is not below 1"),
    (dict(eps=0.0), "Invalid epsilon value: eps=0.0"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: weight_decay=-0.1"),
    # an int past a float's range: refused by its bound (it raised a bare OverflowError)
    (dict(lr=10**400), "Invalid learning rate: lr=" + str(10**400)),
    (dict(betas=(0.9, -10**400)), "Invalid beta parameter at index 1: b2 (betas[1])=-" + str(10**400)),
])
def test_error_messages_begin_as_torch_adamw_s_and_say_which_rule_the_value_broke(kwargs, start):
    with pytest.raises(ValueError) as info:
        PackedAdamW(make_params(), **kwargs)
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize("bad_lr,start", [(float("nan"), "Invalid learning rate: lr=nan"),
                                          (-1e-3, "Invalid learning rate: lr=-0.001"),
                                          (1e37, "Invalid weight_decay value: lr * weight_decay"),
                                          (True, "Invalid learning rate: lr=True"),
                                          (10**400, "Invalid learning rate: lr=1000")])  # past a float's range
def test_a_scheduled_lr_that_turns_invalid_is_refused_after_valid_ones_and_nothing_changes(bad_lr, start):
    """Rows that differ from a validated one in their lr alone take the lr's own checks
    (Rule.field_holds), not the whole validation: a bad lr, or one of another type, is still
    refused with the validation's words, before anything changes."""
    params = make_params(0)
    opt = PackedAdamW(params, lr=1e-3, weight_decay=1e2)
    for step in range(3):
        opt.param_groups[0]["lr"] = 1e-3 / (step + 1)  # new lrs of a validated row
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = bad_lr
    with pytest.raises(ValueError) as info:
        opt.step()
    assert str(info.value).startswith(f"param_groups[0]: {start}"), str(info.value)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    assert opt.state_dict()["state"].keys() == before[1]["state"].keys()
    for key, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(entry[k], v) if isinstance(v, torch.Tensor) else entry[k] == v
                   for k, v in before[1]["state"][key].items())
    opt.param_groups[0]["lr"] = 1e-4  # a valid lr again steps
    opt.step()


def test_a_numpy_integer_lr_is_validated_whole_where_float_would_round_it_otherwise():
    """The lr-only checks read float(lr); an np.int64 rounds to float32 otherwise (directly),
    so such an lr takes the whole validation: lr * weight_decay just past float32's range is
    refused, as a fresh optimizer refuses it."""
    p = torch.nn.Parameter(torch.ones(3))
    weight_decay = float(np.float32((2 - 2 ** -23) * 2.0 ** 67))  # lr * wd = FLOAT32_MAX at lr = 2**60
    opt = PackedAdamW([p], lr=np.int64(1), weight_decay=weight_decay)
    p.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0]["lr"] = np.int64(2 ** 60 + 2 ** 36 + 1)  # float() rounds it down, float32 up
    with pytest.raises(ValueError, match="overflows float32"):
        opt.step()


def test_a_valid_beta_tensor_is_not_called_out_of_range():
    PackedAdamW(make_params(), betas=(torch.tensor(0.9), torch.tensor(0.95)))
    PackedAdamW(make_params(), betas=torch.tensor([0.9, 0.95]))  # one 1-D tensor, as torch.optim.AdamW takes
    PackedAdamW(make_params(), lr=torch.tensor([1e-3]))  # a one-element 1-D tensor is a number
    with pytest.raises(ValueError, match="b1 \\(betas\\[0\\]\\)=1.5 is not below 1"):
        PackedAdamW(make_params(), betas=torch.tensor([1.5, 0.95]))


def test_an_empty_parameter_list_is_refused_as_torch_does():
    with pytest.raises(ValueError, match="empty parameter list"):
        PackedAdamW([])


# ============================================================ hooks and schedulers ====

def test_step_pre_and_post_hooks_run_around_the_step():
    params = make_params()
    opt = PackedAdamW(params)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o.state.get(params[0], {}).get("step"))))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o.state[params[0]]["step"])))
    run(opt, params, [0, 1])
    assert seen == [("pre", None), ("post", 1), ("pre", 1), ("post", 2)]


def test_state_dict_and_load_state_dict_hooks_run():
    params, opt = trained()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd pre"))

    def post(o, sd):
        calls.append("sd post")
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1 and STATE_DICT_KEY in sd
    opt.load_state_dict(sd)
    assert calls == ["sd pre", "sd post", "load pre", "load post"]


@pytest.mark.parametrize("scheduler", ["StepLR", "ExponentialLR"])
def test_a_decreasing_lr_schedule_moves_the_parameters_less_each_step(scheduler):
    p = torch.nn.Parameter(torch.zeros(64))
    opt = PackedAdamW([p], lr=0.1, weight_decay=0.0)
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler == "StepLR"
             else torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
    moves = []
    for _ in range(4):
        before = p.detach().clone()
        p.grad = torch.ones(64)  # constant gradient: Adam's step is lr-sized
        opt.step()
        sched.step()
        moves.append(float((p.detach() - before).abs().max()))
    assert all(later < earlier for earlier, later in zip(moves, moves[1:])), moves


@pytest.mark.parametrize("mode", MODES)
def test_multi_tensor_and_per_tensor_steps_are_bitwise_equal(mode):
    """torch's foreach_matches_forloop: the two implementations, same bits."""
    params, opt = trained(mode, multi_tensor=True)
    other = make_params(0)
    per_tensor = PackedAdamW(other, lr=1e-2, weight_decay=0.1, mode=mode, multi_tensor=False)
    run(per_tensor, other, range(3))
    assert_same_run(params, opt, other, per_tensor, "multi_tensor vs per tensor")


# ============================================================ saving and loading ====

@pytest.mark.parametrize("mode", MODES)
def test_pickle_round_trips_after_a_step_and_continues_bit_for_bit(mode):
    params, opt = trained(mode)
    params2, opt2 = pickle.loads(pickle.dumps((params, opt)))
    assert opt2.state_format == opt.state_format
    run(opt, params, [7, 8])
    run(opt2, params2, [7, 8])
    assert_same_run(params, opt, params2, opt2, "pickled copy")
    assert H.state_tensor(opt2, params2[0]).dtype == H.state_tensor(opt, params[0]).dtype
    deep = copy.deepcopy(opt2)  # deepcopy takes the same path
    assert H.state_tensor(deep, deep.param_groups[0]["params"][0]).dtype == H.state_tensor(opt, params[0]).dtype


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_saved_and_loaded_weights_only_is_bitwise_equal(mode):
    params, opt = trained(mode)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = PackedAdamW(other, lr=1e-2, weight_decay=0.1, mode=mode)
    opt2.load_state_dict(loaded)
    run(opt, params, [5])
    run(opt2, other, [5])
    assert_same_run(params, opt, other, opt2, "weights_only round trip")


def test_a_state_dict_of_the_first_release_without_group_format_keys_loads():
    """torch's can_load_older_state_dict: 1.0.0 saved only the top-level entry."""
    params, opt = trained()
    sd = opt.state_dict()
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in (GROUP_FORMAT_KEY, "maximize")}
                          for g in sd["param_groups"]]
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = PackedAdamW(other, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(sd)
    run(opt, params, [5])
    run(opt2, other, [5])
    assert_same_run(params, opt, other, opt2, "older state dict")


@pytest.mark.parametrize("step", [torch.tensor(3.0), torch.tensor(3), 3.0, np.int64(3)])
def test_a_step_count_saved_as_a_tensor_or_whole_float_loads_as_an_int(step):
    """torch's load_nontensor_step, the other way round: torch's AdamW saves tensors."""
    params, opt = trained()
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry["step"] = step
    opt.load_state_dict(sd)
    assert all(type(opt.state[p]["step"]) is int and opt.state[p]["step"] == 3 for p in params)
    run(opt, params, [4])
    assert opt.state[params[0]]["step"] == 4


@pytest.mark.parametrize("step", [-5, 2.7, MAX_STEP + 1, True, "3", None])
def test_a_bad_saved_step_count_is_refused_on_load_and_nothing_changes(step):
    params, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    before = H.snapshot(opt, params)
    sd["state"][1]["step"] = step
    with pytest.raises(ValueError, match=r"saved parameter 1 .*step count"):
        opt.load_state_dict(sd)
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after a refused load")


def test_a_step_count_edited_out_of_range_is_refused_at_step_naming_the_parameter_and_counts_nothing():
    params, opt = trained()
    opt.state[params[1]]["step"] = 2**31 - 1
    set_grads(params, 9)
    before = H.snapshot(opt, params)
    for _ in range(2):  # a retry fails the same way and counts nothing
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*step count 2147483647"):
            opt.step()
        H.assert_same_snapshot(H.snapshot(opt, params), before, "after a refused step")
        assert opt.state[params[0]]["step"] == 3


def test_the_step_count_limit_is_named_when_it_is_reached_and_nothing_changes():
    """A state one step short of the limit loads and steps once; the next step is refused
    saying the limit (2**31 - 1 steps), not that the state was damaged."""
    params, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = MAX_STEP
    opt.load_state_dict(sd)
    run(opt, params, [4])
    assert all(opt.state[p]["step"] == 2**31 - 1 for p in params)
    set_grads(params, 5)
    before = H.snapshot(opt, params)
    with pytest.raises(ValueError, match=r"\['params'\]\[0\]: step count 2147483647 is the limit: a parameter steps "
                                         r"at most 2\*\*31 - 1") as info:
        opt.step()
    assert "damaged" not in str(info.value)
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after the limit was reached")
    # A saved state at the limit is refused on load with the same reason.
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"saved parameter 0 .*step count 2147483647 is the limit"):
        PackedAdamW(make_params(0), lr=1e-2, weight_decay=0.1).load_state_dict(sd)


def test_a_parameter_listed_twice_is_refused_naming_both_places():
    """torch.optim.AdamW warns and steps it twice per step; PackedAdamW refuses the list."""
    a, b = make_params(0)[:2]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        PackedAdamW([a, b, a])
    with pytest.raises(ValueError, match=r"'second' is the same tensor as 'first'"):
        PackedAdamW([("first", a), ("second", a)])
    opt = PackedAdamW([a])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] is the same tensor as "
                                         r"param_groups\[1\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [b, b]})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_a_step_inside_a_cuda_graph_capture_needs_capturable_and_changes_nothing(monkeypatch):
    """Refused before anything is launched, naming capturable=True (CUDA's own error would say
    only that an operation failed during capture). The capture is simulated: on CPU nothing
    else notices it."""
    params, opt = trained()
    set_grads(params, 9)
    before = H.snapshot(opt, params)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"built without capturable=True.*capturable=True\) to capture"):
        opt.step()
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after a refused step in a capture")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    opt.step()
    assert opt.state[params[0]]["step"] == 4


def test_a_state_dict_without_the_format_or_with_an_unknown_version_is_refused():
    params, opt = trained()
    sd = opt.state_dict()
    no_format = {**sd, STATE_DICT_KEY: {"version": 1}}
    with pytest.raises(ValueError, match="has no 'format'"):
        opt.load_state_dict(no_format)
    future = {**sd, STATE_DICT_KEY: {**sd[STATE_DICT_KEY], "version": 99}}
    with pytest.raises(ValueError, match="version 99 is not one this release reads"):
        opt.load_state_dict(future)


@pytest.mark.parametrize("mode", MODES)
def test_a_non_contiguous_loaded_state_is_made_contiguous_and_continues_bit_for_bit(mode):
    params, opt = trained(mode)
    sd = copy.deepcopy(opt.state_dict())
    key = H.state_key(mode)
    for entry in sd["state"].values():
        t = entry[key]
        if t.dim() >= 2:  # a transposed copy transposed back: same values, not contiguous
            entry[key] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert not entry[key].is_contiguous()
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = PackedAdamW(other, lr=1e-2, weight_decay=0.1, mode=mode)
    opt2.load_state_dict(sd)
    assert all(H.state_tensor(opt2, p).is_contiguous() for p in other)
    run(opt, params, [5, 6])
    run(opt2, other, [5, 6])
    assert_same_run(params, opt, other, opt2, "after loading a non-contiguous state")


@pytest.mark.parametrize("mode", MODES)
def test_a_non_contiguous_state_put_in_place_is_refused_naming_the_parameter(mode):
    params, opt = trained(mode)
    key = H.state_key(mode)
    t = opt.state[params[1]][key]
    opt.state[params[1]][key] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    set_grads(params, 9)
    before = H.snapshot(opt, params)
    with pytest.raises(ValueError, match=r"\['params'\]\[1\]: its optimizer state is .*contiguous=False"):
        opt.step()
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after a refused step")


@pytest.mark.parametrize("damage", ["nan m", "inf v", "negative v"])
def test_an_fp32_state_with_nan_moments_or_negative_v_is_refused_on_load(damage):
    params, opt = trained("fp32")
    sd = copy.deepcopy(opt.state_dict())
    moments = sd["state"][0]["moments"]
    if damage == "nan m":
        moments[0, 5] = float("nan")
    elif damage == "inf v":
        moments[1, 7] = float("inf")
    else:
        moments[1, 9] = -1e-6
    before = H.snapshot(opt, params)
    with pytest.raises(ValueError, match="saved parameter 0 .*would freeze those elements"):
        opt.load_state_dict(sd)
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after a refused load")


def test_import_state_refuses_a_bad_count_or_damaged_fp32_moments_before_changing_anything():
    params, opt = trained("fp32")
    portable = opt.export_state()
    before = H.snapshot(opt, params)
    bad_count = copy.deepcopy(portable)
    bad_count.counts[1] = -5
    with pytest.raises(ValueError, match="tensor 1 .*step count -5"):
        opt.import_state(bad_count)
    bad_values = copy.deepcopy(portable)
    bad_values.moments[2] = np.array([np.nan, 1.0], dtype=np.float32).reshape(2)
    with pytest.raises(ValueError, match="tensor 2 .*NaN"):
        opt.import_state(bad_values)
    H.assert_same_snapshot(H.snapshot(opt, params), before, "after refused imports")


def test_a_boolean_bias_is_refused():
    with pytest.raises(TypeError, match="m_bias=True: an exponent bias is an int"):
        PackedAdamW(make_params(), m_bias=True)


# ============================================================ torch.compile ====

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["train_step", "opt.step"])
def test_torch_compile_of_a_training_step_or_of_opt_step_gives_the_eager_bits(mode, what):
    """The step is a custom op inside the compiled graph (torch_frontend/_compiled.py): it must
    give eager's bits for the gradients it is given. (Inductor's forward and backward may round
    differently from eager's, so the eager optimizer is fed the compiled run's gradients.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    start = [p.detach().clone() for p in model.parameters()]
    opt = PackedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, mode=mode)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))

    def train_step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return grads

    if what == "train_step":
        step = torch.compile(train_step)
    else:
        opt_step = torch.compile(opt.step)

        def step():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt_step()
            return grads

    seen = [step() for _ in range(3)]
    eager_params = [torch.nn.Parameter(p.clone()) for p in start]
    eager = PackedAdamW(eager_params, lr=1e-2, weight_decay=0.1, mode=mode)
    for grads in seen:
        for p, g in zip(eager_params, grads):
            p.grad = g.clone()
        eager.step()
    assert_same_run(list(model.parameters()), opt, eager_params, eager, f"compiled {what}")


def test_load_state_dict_keeps_the_optimizer_s_own_options():
    """torch's load_state_dict goes through __setstate__ with only state and param groups."""
    params = make_params()
    opt = PackedAdamW(params, lr=torch.tensor(1e-3), capturable=True)
    tracked = PackedAdamW(make_params(), track_format=True, check_nonfinite=True, multi_tensor=False)
    sd = trained()[1].state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(1e-3)
    opt.load_state_dict(sd)
    tracked.load_state_dict(trained()[1].state_dict())
    assert opt.capturable and tracked.track_format and tracked.check_nonfinite and not tracked.multi_tensor
