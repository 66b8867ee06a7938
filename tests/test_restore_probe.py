"""ckptd.restore against bad sources: every refusal is one CheckpointError line naming the
file or URL, and leaves the model, optimizer and scheduler exactly as they were."""
from __future__ import annotations

import copy
import io
import json
import os
import socket
import threading

import pytest
import torch
from torch import nn

import ckptd
from ckptd.core.checkpoint import CheckpointError, save_checkpoint
from ckptd.core.raw_layout import MEDIA_TYPE, new_digest
from ckptd.live.memory_tier import MemoryTier
from ckptd.testing.synth import trainer_checkpoint

LR = 0.01


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _fresh():
    model = _model()
    return model, torch.optim.Adam(model.parameters(), lr=LR)


@pytest.fixture(scope="module")
def trained():
    model, opt = _fresh()
    torch.manual_seed(1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
    return model, opt


def _snapshot(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict())


def _refused(source, match: str, model=None, opt=None, scheduler=None, **kw) -> str:
    """restore() refuses `source` in one line containing `match`, nothing changed."""
    if model is None:
        model, opt = _fresh()
    before = _snapshot(model, opt)
    sched_before = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    with pytest.raises(CheckpointError) as e:
        ckptd.restore(model, opt, source, scheduler=scheduler, timeout=5, **kw)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    after = _snapshot(model, opt)
    assert after[1] == before[1]
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    if scheduler is not None:
        assert scheduler.state_dict() == sched_before
    return msg


def _save(path, doc):
    torch.save(doc, path)
    return path


def _doc(trained, **changes):
    model, opt = trained
    doc = {"model": model.state_dict(), "optimizer": copy.deepcopy(opt.state_dict()), "step": 2}
    doc.update(changes)
    return doc


# -- a file --------------------------------------------------------------------------------
def test_weights_only_file_with_an_optimizer_leaves_the_model_untouched(trained, tmp_path):
    _refused(_save(tmp_path / "w.pt", {"model": trained[0].state_dict(), "step": 2}),
             "holds no optimizer state")


def test_an_optimizer_holding_a_foreign_tensor_is_refused_first(trained, tmp_path):
    model, opt = _fresh()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    msg = _refused(_save(tmp_path / "c.pt", _doc(trained)), "not a parameter of the model", model, opt)
    assert str(tmp_path) in msg


@pytest.mark.parametrize("change, match", [
    (lambda st: st.update(exp_avg=torch.zeros(3, 3)), "0.weight.exp_avg is float32[3, 3], the parameter's is float32[6, 4]"),
    (lambda st: st.update(exp_avg=st["exp_avg"].double()), "0.weight.exp_avg is float64[6, 4]"),
    (lambda st: st.update(step=torch.ones(1 << 10)), "0.weight.step is float32[1024]"),
])
@pytest.mark.parametrize("index", [0, 2])  # the first parameter's state, and another's
def test_optimizer_state_of_another_shape_or_dtype_is_refused(trained, tmp_path, change, match, index):
    doc = _doc(trained)
    if "step" in match:  # the first parameter's step is read as the steps done
        # (the checkpoint's own step check names another parameter's first: session 36)
        match = "1.weight.step is a tensor float32[1024], not a count" if index else "a tensor of 1024 elements, not a count"
    elif index:
        match = match.replace("0.weight", "1.weight").replace("[6, 4]", "[6]")
    change(doc["optimizer"]["state"][index])
    doc.pop("step")
    _refused(_save(tmp_path / "c.pt", doc), match)


@pytest.mark.parametrize("change, match", [
    (lambda d: d["optimizer"].update(param_groups=5), "optimizer.param_groups is an int 5"),
    (lambda d: d["optimizer"].update(param_groups=[5]), "not a list of dicts"),
    (lambda d: d["optimizer"]["param_groups"][0].update(params=5), "param_groups[0].params is an int 5"),
    (lambda d: d.update(ckptd={"param_names": 7}), "ckptd.param_names is 7"),
    (lambda d: [st.update(step=torch.tensor([1.0, 2.0])) for st in d["optimizer"]["state"].values()],
     "a tensor of 2 elements, not a count"),
    (lambda d: [st.update(step=torch.tensor(float("nan"))) for st in d["optimizer"]["state"].values()],
     "is nan, not a count"),
])
def test_a_malformed_trainer_file_is_one_line(trained, tmp_path, change, match):
    doc = _doc(trained)
    doc.pop("step")
    change(doc)
    _refused(_save(tmp_path / "c.pt", doc), match)


def test_a_file_torch_will_not_load_is_one_line(trained, tmp_path):
    import numpy as np
    _refused(_save(tmp_path / "c.pt", _doc(trained, extra=np.ones(3))), "Unsupported global")


def test_the_state_of_another_scheduler_is_refused_before_anything_changes(trained, tmp_path):
    model, opt = trained
    saved = torch.optim.lr_scheduler.StepLR(torch.optim.Adam(_model().parameters(), lr=LR), 2).state_dict()
    path = _save(tmp_path / "c.pt", _doc(trained, lr_scheduler=saved))
    m, o = _fresh()
    _refused(path, "lr_scheduler holds ['gamma', 'step_size']", m, o,
             torch.optim.lr_scheduler.CosineAnnealingLR(o, 10))
    path = _save(tmp_path / "d.pt", _doc(trained, lr_scheduler={**saved, "base_lrs": [LR, LR]}))
    m, o = _fresh()
    _refused(path, "lr_scheduler.base_lrs is a list of 2 item(s)", m, o, torch.optim.lr_scheduler.StepLR(o, 2))
    path = _save(tmp_path / "e.pt", _doc(trained, lr_scheduler=[3]))  # was ignored, the state rebuilt from steps
    m, o = _fresh()
    _refused(path, "lr_scheduler is a list of 1 item(s), not a scheduler's state_dict", m, o,
             torch.optim.lr_scheduler.StepLR(o, 2))


# -- a directory ---------------------------------------------------------------------------
def test_a_manifest_that_is_not_a_dict_or_lists_nothing_loadable_falls_back_to_the_files(trained, tmp_path):
    m, o = trainer_checkpoint(*trained, LR)
    save_checkpoint(tmp_path / "iter_000001.pt", 1, m, o)  # (2 steps taken: iteration 1)
    for text in ("[1, 2]", '{"checkpoints": [{"file": "gone.pt", "iteration": 9}]}'):
        (tmp_path / "manifest.json").write_text(text)
        model, opt = _fresh()
        assert ckptd.restore(model, opt, tmp_path).iteration == 1


def test_a_manifest_entry_naming_a_file_outside_the_directory_is_not_read(trained, tmp_path):
    """A newer checkpoint beside the directory, named by its manifest as ../: the
    manifest is refused and the directory's own files are scanned."""
    m, o = trainer_checkpoint(*trained, LR)
    (tmp_path / "ck").mkdir()
    save_checkpoint(tmp_path / "ck" / "iter_000001.pt", 1, m, o)  # (2 steps taken: iteration 1)
    save_checkpoint(tmp_path / "iter_000005.pt", 5, m, o)
    digest = "0" * 64
    for name in ("../iter_000005.pt", str(tmp_path / "iter_000005.pt")):
        (tmp_path / "ck" / "manifest.json").write_text(json.dumps(
            {"format": "ckptd-manifest/1", "checkpoints": [{"file": name, "iteration": 5, "sha256": digest}]}))
        model, opt = _fresh()
        assert ckptd.restore(model, opt, tmp_path / "ck").iteration == 1


def test_a_fifo_in_a_dcp_directory_is_refused_not_waited_on(trained, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": trained[0].state_dict()}, checkpoint_id=str(tmp_path / "c"))
    shard = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    shard.unlink()
    os.mkfifo(shard)
    done: list = []

    def attempt():
        model = _model()
        with pytest.raises(CheckpointError, match="not a regular file") as e:
            ckptd.restore(model, None, tmp_path / "c")
        done.append(str(e.value))
    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(20)
    assert done, "restore blocked on a FIFO"


def test_an_empty_source_is_refused():
    _refused("", "source is empty")


# -- a URL ---------------------------------------------------------------------------------
@pytest.fixture
def server():
    """serve(raw response bytes) -> URL of a loopback server answering every request so."""
    socks = []

    def serve(answer: bytes) -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        socks.append(s)

        def loop():
            while True:
                try:
                    c, _ = s.accept()
                except OSError:
                    return
                with c:
                    c.recv(65536)
                    try:
                        c.sendall(answer)
                    except OSError:
                        pass
        threading.Thread(target=loop, daemon=True).start()
        return f"http://127.0.0.1:{s.getsockname()[1]}"
    yield serve
    for s in socks:
        s.close()


def _http(body: bytes, ctype="application/octet-stream", length=None, status="200 OK") -> bytes:
    n = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {n}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("answer, match", [
    (_http(b"<html>sign in</html>", "text/html"), "Content-Type text/html): not loadable"),
    (_http(b"", length=10 ** 14), "Content-Length 100000000000000 is more than a checkpoint of this model"),
    (_http(b"oops\nsecond line", status="500 Internal Server Error"), "HTTP 500 Internal Server Error: oops second line"),
    (b"HTTP/1.1 302 Found\r\nLocation: /checkpoint\r\nContent-Length: 0\r\n\r\n", "HTTP 302"),
])
def test_a_bad_http_answer_is_one_line(server, answer, match):
    _refused(server(answer), match)


def test_a_torch_body_weights_only_with_an_optimizer_leaves_the_model_untouched(server, trained):
    buf = io.BytesIO()
    torch.save({"model": trained[0].state_dict(), "step": 2}, buf)
    _refused(server(_http(buf.getvalue())), "holds no optimizer state")


@pytest.fixture(scope="module")
def raw(trained):
    """(header dict, each tensor's bytes) of the daemon's raw layout of `trained`."""
    m, o = trainer_checkpoint(*trained, LR)
    held = MemoryTier().commit(1, m, o)
    head, parts = held.raw([n for n, _ in trained[0].named_parameters()], LR, None)
    return json.loads(head), [bytes(p) for p in parts]


def _raw_body(head: dict, parts: list[bytes]) -> bytes:
    return json.dumps(head).encode() + b"\n" + b"".join(parts)


def _digest(b: bytes) -> str:
    h = new_digest()
    h.update(b)
    return h.hexdigest()


def _entry(head, name):
    return next(i for i, e in enumerate(head["tensors"]) if e["name"] == name)


def test_the_raw_layout_restores(server, raw):
    model, opt = _fresh()
    assert ckptd.restore(model, opt, server(_http(_raw_body(*raw), MEDIA_TYPE))).iteration == 1


@pytest.mark.parametrize("change, match", [
    (lambda h, p: h.update(iteration="x"), "iteration 'x', not an integer >= -1"),
    (lambda h, p: h.update(iteration=-5), "iteration -5"),
    (lambda h, p: h.update(lr="fast"), "lr 'fast', not a number"),
    (lambda h, p: h["tensors"][0].update(name=5), "tensor name 5, not a string"),
    (lambda h, p: h["tensors"][0].update(bytes=96.0), "96.0 bytes"),
    (lambda h, p: h["tensors"][_entry(h, "optimizer.0.weight.step")].update(shape=[-1, -1], bytes=4),
     "not a list of sizes >= 0"),
    (lambda h, p: h["tensors"][_entry(h, "optimizer.0.weight.step")].update(shape=[1 << 20, 1 << 20],
                                                                            bytes=4 << 40),
     "0.weight.step is float32[1048576, 1048576]"),
])
def test_a_lying_raw_header_is_refused_before_the_model_changes(server, raw, change, match):
    head, parts = copy.deepcopy(raw[0]), list(raw[1])
    change(head, parts)
    _refused(server(_http(_raw_body(head, parts), MEDIA_TYPE)), match)


def test_a_duplicated_raw_entry_is_refused(server, raw):
    head, parts = copy.deepcopy(raw[0]), list(raw[1])
    i = _entry(head, "model.0.weight")
    other = bytes(len(parts[i]))
    head["tensors"].append({**head["tensors"][i], "blake2b": _digest(other)})
    parts.append(other)
    _refused(server(_http(_raw_body(head, parts), MEDIA_TYPE)), "model.0.weight is listed twice")


def test_raw_optimizer_state_of_another_shape_or_dtype_is_refused(server, raw):
    head, parts = copy.deepcopy(raw[0]), list(raw[1])
    i = _entry(head, "optimizer.0.weight.exp_avg")
    parts[i] = torch.frombuffer(bytearray(parts[i]), dtype=torch.float32).double().numpy().tobytes()
    head["tensors"][i].update(dtype="float64", bytes=len(parts[i]), blake2b=_digest(parts[i]))
    _refused(server(_http(_raw_body(head, parts), MEDIA_TYPE)), "0.weight.exp_avg is float64[6, 4]")
    head, parts = copy.deepcopy(raw[0]), list(raw[1])
    i = _entry(head, "optimizer.0.weight.step")
    parts[i] = bytes(12)
    head["tensors"][i].update(shape=[3], bytes=12, blake2b=_digest(parts[i]))
    _refused(server(_http(_raw_body(head, parts), MEDIA_TYPE)), "0.weight.step is float32[3]")


def test_a_raw_body_whose_length_differs_from_its_header_is_refused_first(server, raw):
    body = _raw_body(*raw)
    _refused(server(_http(body + b"junk", MEDIA_TYPE)), "the raw checkpoint header describes")
    _refused(server(_http(body[:-50], MEDIA_TYPE, length=len(body) - 50)), "nothing in the model changed")


def test_a_raw_restore_into_an_optimizer_with_a_foreign_tensor_changes_nothing(server, raw):
    model, opt = _fresh()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    _refused(server(_http(_raw_body(*raw), MEDIA_TYPE)), "not a parameter of the model", model, opt)


def test_a_redirect_to_another_origin_does_not_take_the_token_along(server):
    """urllib hands every header, Authorization included, to whatever host a redirect
    names: with a token, a redirect off the daemon's origin is refused, and the other
    host never hears from us; within the origin it is followed with the token."""
    heard = []
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(4)
    other.settimeout(5)

    def record():
        try:
            c, _ = other.accept()
        except OSError:
            return
        with c:
            heard.append(c.recv(65536))
            c.sendall(_http(b"<html>elsewhere</html>", "text/html"))
    threading.Thread(target=record, daemon=True).start()
    elsewhere = f"http://localhost:{other.getsockname()[1]}/checkpoint"  # another host name: another origin
    away = server(f"HTTP/1.1 302 Found\r\nLocation: {elsewhere}\r\nContent-Length: 0\r\n\r\n".encode())
    try:
        _refused(away, "another origin: not followed, the token would go with it", token="s3cret")
        assert heard == []
        _refused(away, "Content-Type text/html")  # no token: followed, and the page refused
        assert len(heard) == 1 and b"Authorization" not in heard[0]
    finally:
        other.close()


def test_param_groups_keep_their_own_lrs(tmp_path):
    """A checkpoint carries one lr, the first group's: restore scales every group's
    base lr by the same factor (as torch's schedulers do, and as `ckptd export` does),
    instead of giving each group the first group's lr."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                               {"params": model[1].parameters(), "lr": 0.01}], momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = build()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        sched.step()
    path = _save(tmp_path / "trainer.pt", {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                            "lr_scheduler": sched.state_dict(), "step": 2})
    fresh, fresh_opt, fresh_sched = build()
    ckptd.restore(fresh, fresh_opt, path, scheduler=fresh_sched)
    assert [g["lr"] for g in fresh_opt.param_groups] == pytest.approx([0.025, 0.0025])
    assert [g["lr"] for g in fresh_opt.param_groups] == pytest.approx([g["lr"] for g in opt.param_groups])


@pytest.mark.parametrize("answer, match", [
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n" + b"x" * 50_000,
     "the body (no Content-Length) goes on past 4096 bytes"),
    (_http(b"x" * 50_000), "Content-Length 50000 is more than a checkpoint of this model takes (4096 bytes"),
])
def test_a_body_larger_than_the_model_could_need_is_refused(server, monkeypatch, answer, match):
    """An HTTP body is bounded by what a checkpoint of the model can take
    (recovery.body_limit, a few times the model's state): an endless body, or a lying
    Content-Length, is refused instead of filling the trainer's memory."""
    import ckptd.recovery
    monkeypatch.setattr(ckptd.recovery, "body_limit", lambda model: 4096)
    _refused(server(answer), match)
