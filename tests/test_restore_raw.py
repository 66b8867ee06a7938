"""ckptd.restore from the daemon's memory reads the raw layout straight into the model's
tensors: the same state as the torch.save path, bit for bit, with the parameters' memory
kept; a header that does not fit the model or a torn body refused in one line."""
from __future__ import annotations

import io
import urllib.request

import pytest
import torch
from torch import nn

import ckptd
from ckptd.core.checkpoint import CheckpointError
from ckptd.core.formats import TrainerHyper, torch_doc
from ckptd.core.raw_layout import MEDIA_TYPE
from ckptd.live.memory_tier import MemoryTier
from ckptd.live.serve import HttpServer, Response
from ckptd.live.status import checkpoint_routes
from ckptd.recovery import _load_optimizer, _request, fetch
from ckptd.restore_raw import read_into_model
from ckptd.testing.synth import trainer_checkpoint

LR = 0.01


def _model(seed: int, width: int = 6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 3))


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=LR),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
}


def _trainer(kind: str, seed: int, width: int = 6):
    model = _model(seed, width)
    opt = OPTIMIZERS[kind](model.parameters())
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _trained(kind: str):
    """(model, optimizer, the lr the last step used), after 3 steps as _trainer's job."""
    model, opt, sched = _trainer(kind, 0)
    for _ in range(3):  # moments, momentum and the norm layer's running stats all move
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        used = opt.param_groups[0]["lr"]
        sched.step()
    return model, opt, used


@pytest.fixture(params=sorted(OPTIMIZERS))
def served(request, tmp_path):
    """(kind, URL of a server holding the trained state at iteration 2, torch.save file of it)."""
    model, opt, used = _trained(request.param)
    names = [n for n, _ in model.named_parameters()]
    m, o = trainer_checkpoint(model, opt, used)
    tier = MemoryTier()
    held = tier.commit(2, m, o)
    hyper = TrainerHyper(opt.state_dict()["param_groups"], None)
    routes = checkpoint_routes(tier, names, lambda held: hyper, None)
    srv = HttpServer(routes, "127.0.0.1", 0).start()
    path = tmp_path / "ckpt.pt"
    torch.save(torch_doc(held.checkpoint(), names, hyper), path)
    yield request.param, f"http://127.0.0.1:{srv.address[1]}", path
    srv.stop()


def _same(a, b):
    ma, oa, sa = a
    mb, ob, sb = b
    for (n, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), n
    da, db = oa.state_dict(), ob.state_dict()
    assert da["param_groups"] == db["param_groups"]
    assert da["state"].keys() == db["state"].keys()
    for i in da["state"]:
        for k, v in da["state"][i].items():
            assert v.dtype == db["state"][i][k].dtype and torch.equal(v, db["state"][i][k]), (i, k)
    assert sa.state_dict() == sb.state_dict()


def test_http_restore_is_bit_identical_to_the_file_and_in_place(served):
    kind, url, path = served
    mine = _trainer(kind, 1)
    ptrs = {n: t.data_ptr() for n, t in mine[0].state_dict().items()}
    r = ckptd.restore(mine[0], mine[1], url, scheduler=mine[2])
    assert r.iteration == 2 and r.step == 3 and r.bytes > 0 and r.buffers_not_restored == []
    assert {n: t.data_ptr() for n, t in mine[0].state_dict().items()} == ptrs  # read in place
    ref = _trainer(kind, 1)
    ckptd.restore(ref[0], ref[1], path, scheduler=ref[2])
    _same(mine, ref)
    staged = _trainer(kind, 1)
    ckptd.restore(staged[0], staged[1], url, scheduler=staged[2], all_or_nothing=True)
    _same(staged, ref)
    for m, o, s in (mine, ref):  # and both go on identically
        torch.manual_seed(5)
        o.zero_grad()
        m(torch.randn(8, 4)).square().sum().backward()
        o.step()
        s.step()
    _same(mine, ref)


def test_optimizer_adopts_the_tensors_read_without_a_copy(served):
    kind, url, _ = served
    model, opt, _ = _trainer(kind, 1)
    with _request(url, None, 10, MEDIA_TYPE) as (resp, where):
        ckpt, _, _ = read_into_model(resp, model, opt, where)
    named = ckpt["optimizer"]
    _load_optimizer(model, opt, ckpt, where, adopt=True)
    params = dict(model.named_parameters())
    read = [(params[n], k, t) for n, st in named["state"].items() for k, t in st.items()]
    assert read
    for p, k, t in read:
        assert opt.state[p][k].data_ptr() == t.data_ptr(), k


def test_a_header_that_does_not_fit_the_model_is_refused_with_the_model_unchanged(served):
    kind, url, _ = served
    model, opt, _ = _trainer(kind, 1, width=7)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        ckptd.restore(model, opt, url)
    msg = str(e.value)
    assert "\n" not in msg and "0.weight is float32[6, 4], the model's is float32[7, 4]" in msg
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert not opt.state


OTHER_OPTIMIZERS = {  # what each served state must not load into, and what its message names
    "adam": [(lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), "keeps ['momentum_buffer']"),
             (lambda ps: torch.optim.Adam(ps, lr=LR, amsgrad=True), "keeps ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']"),
             # a class whose step needs a closure: the probe's step failed and the check was skipped
             (lambda ps: torch.optim.LBFGS(ps, lr=LR), "this LBFGS (param group 0) keeps ['H_diag', 'd',")],
    "sgd_momentum": [(lambda ps: torch.optim.Adam(ps, lr=LR), "holds ['momentum_buffer']"),
                     (lambda ps: torch.optim.SGD(ps, lr=LR), "SGD {'momentum': 0")],
}


def test_the_state_of_another_optimizer_is_refused_with_the_model_unchanged(served):
    """Adam's moments into an SGD, a state without max_exp_avg_sq into an amsgrad Adam,
    momentum into a momentum-less SGD: torch's load_state_dict takes any keys without a
    word, and training would go on from a state that is not the checkpoint's. Refused
    before a byte reaches the model, from the daemon's raw layout and from a file alike."""
    kind, url, path = served
    for make, message in OTHER_OPTIMIZERS[kind]:
        for source in (url, path):
            model = _model(1)
            opt = make(model.parameters())
            before = {n: t.clone() for n, t in model.state_dict().items()}
            with pytest.raises(CheckpointError) as e:
                ckptd.restore(model, opt, source)
            msg = str(e.value)
            assert "\n" not in msg and message in msg and "another optimizer or setting" in msg, msg
            for n, t in model.state_dict().items():
                assert torch.equal(t, before[n]), (source, n)
            assert not opt.state
        ckptd.restore(_model(1), None, url)  # weights only: no optimizer to fit


def _cut_server(url: str, short: int):
    """A server answering /checkpoint with the raw body of `url` less its last `short`
    bytes, under the whole body's Content-Length: a connection torn mid-body."""
    req = urllib.request.Request(url + "/checkpoint", headers={"Accept": MEDIA_TYPE})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body, ctype = resp.read(), resp.headers["Content-Type"]
    route = lambda _, __: Response(200, iter([body[:-short]]), ctype, length=len(body),  # noqa: E731
                                   headers={"X-Ckptd-Iteration": "2"})
    return HttpServer({"/checkpoint": route}, "127.0.0.1", 0).start()


@pytest.mark.parametrize("all_or_nothing", [False, True])
def test_a_truncated_body_is_refused_in_one_line(served, all_or_nothing):
    kind, url, _ = served
    srv = _cut_server(url, 10)
    try:
        model, opt, _ = _trainer(kind, 1)
        before = {n: t.clone() for n, t in model.state_dict().items()}
        with pytest.raises(CheckpointError) as e:
            ckptd.restore(model, opt, f"http://127.0.0.1:{srv.address[1]}", all_or_nothing=all_or_nothing)
    finally:
        srv.stop()
    msg = str(e.value)
    assert "\n" not in msg and "bytes short in optimizer." in msg
    if all_or_nothing:
        assert "nothing in the model changed" in msg
        for n, t in model.state_dict().items():
            assert torch.equal(t, before[n]), n
    else:
        assert "partial state" in msg
    assert not opt.state  # the optimizer is loaded only after the whole body


def test_the_torch_save_response_is_still_the_default(served):
    kind, url, path = served
    with urllib.request.urlopen(url + "/checkpoint", timeout=10) as resp:
        assert resp.headers.get_content_type() == "application/octet-stream"
        doc = torch.load(io.BytesIO(resp.read()), weights_only=True)
    assert doc["step"] == 3 and "0.weight" in doc["model"]
    ckpt, n = fetch(url, None, None, 10)
    assert ckpt["iteration"] == 2 and n > 0


def test_a_daemon_without_the_raw_layout_still_restores(served):
    kind, url, path = served
    old = lambda _, __: Response(200, open(path, "rb").read(), "application/octet-stream",  # noqa: E731
                                 headers={"X-Ckptd-Iteration": "2"})
    srv = HttpServer({"/checkpoint": old}, "127.0.0.1", 0).start()
    try:
        mine = _trainer(kind, 1)
        ckptd.restore(mine[0], mine[1], f"http://127.0.0.1:{srv.address[1]}", scheduler=mine[2])
    finally:
        srv.stop()
    ref = _trainer(kind, 1)
    ckptd.restore(ref[0], ref[1], path, scheduler=ref[2])
    _same(mine, ref)


def test_weights_only_reads_past_the_optimizer_state(served):
    kind, url, path = served
    mine, ref = _model(1), _model(1)
    r = ckptd.restore(mine, None, url)
    ckptd.restore(ref, None, path)
    assert r.iteration == 2
    for (n, x), (_, y) in zip(mine.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(x, y), n
