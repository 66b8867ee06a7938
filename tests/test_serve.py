"""The daemon's HTTP server (ckptd.live.serve) and what it serves from the memory tier:
idle and slow clients cost no worker, excess connections are refused at once, a token
guards it off loopback, IPv6 listens, and /checkpoint restores a trainer exactly."""
from __future__ import annotations

import hashlib
import io
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch

import ckptd
from ckptd.core.checkpoint import CheckpointError
from ckptd.core.optim import torch_optimizer, torch_scheduler
from ckptd.core.plan import load_plan
from ckptd.live.daemon import ConfigError, Daemon, http_server, load_config
from ckptd.live.serve import HttpServer, Response
from ckptd.pipeline import file_source
from ckptd.testing.synth.model import build_model

from helpers import pcaps, synth

TOKEN = "s3cret-token-0123456789"


def get(port, path, token=None, host="127.0.0.1", timeout=5):
    req = urllib.request.Request(f"http://{host}:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, dict(r.headers), r.read()


def status_of(port, path, **kw):
    try:
        return get(port, path, **kw)[0]
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def server():
    calls = []

    def hello(arg, _):
        calls.append(arg)
        return Response(200, b"hello")
    srv = HttpServer({"/hello": hello, "/item/": hello}, "127.0.0.1", 0, max_connections=8,
                     read_timeout_s=1, workers=2).start()
    yield srv
    srv.stop()


def test_routes_and_errors(server):
    port = server.address[1]
    assert get(port, "/hello")[2] == b"hello"
    assert get(port, "/item/7")[2] == b"hello"
    assert status_of(port, "/nope") == 404
    s = socket.create_connection(server.address)
    s.sendall(b"POST /hello HTTP/1.1\r\n\r\n")
    assert s.recv(100).startswith(b"HTTP/1.1 405")
    s.close()


def _raw(address, request: bytes) -> bytes:
    """The whole answer to one raw request (the server closes each connection)."""
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_head_is_answered_without_a_body_whatever_the_answer(server):
    """The refusals (404 here; 400, 401, 403, 500 alike) sent their body to a HEAD too:
    RFC 9110 9.3.2, a client reading the next response met it."""
    for path, status in (("/hello", b"200"), ("/nope", b"404")):
        head, _, body = _raw(server.address, f"HEAD {path} HTTP/1.1\r\n\r\n".encode()).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status) and b"Content-Length: " in head and body == b"", (head, body)
    head, _, body = _raw(server.address, b"GET /nope HTTP/1.1\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404") and body.startswith(b"try ")


def test_excess_connections_are_refused_at_once_and_service_resumes(server):
    idle = [socket.create_connection(server.address) for _ in range(8)]
    time.sleep(0.3)
    t0 = time.monotonic()
    extra = socket.create_connection(server.address)
    extra.settimeout(2)
    assert extra.recv(100).startswith(b"HTTP/1.1 503")
    assert time.monotonic() - t0 < 0.9  # refused, not left to time out (1 s here)
    extra.close()
    for s in idle:
        s.close()
    time.sleep(0.3)
    assert get(server.address[1], "/hello")[2] == b"hello"
    assert server.refused == 1


def test_slowloris_is_cut_at_the_read_timeout_while_others_are_served(server):
    slow = socket.create_connection(server.address)
    slow.settimeout(3)
    t0 = time.monotonic()
    got = b""
    for ch in b"GET /hello HTTP/1.1\r\nHost: x\r\n":  # never ends the head
        try:
            slow.sendall(bytes([ch]))
        except OSError:
            break
        if time.monotonic() - t0 > 0.4:
            assert get(server.address[1], "/hello")[2] == b"hello"  # meanwhile: served
        time.sleep(0.05)
        if time.monotonic() - t0 > 2:
            break
    try:
        got = slow.recv(100)
    except OSError:
        pass
    assert got.startswith(b"HTTP/1.1 408") and 0.9 < time.monotonic() - t0 < 2.5
    assert server.timed_out == 1
    slow.close()


def test_token_required_refused_and_accepted():
    srv = HttpServer({"/hello": lambda _, __: Response(200, b"hi")}, "127.0.0.1", 0, token=TOKEN).start()
    try:
        port = srv.address[1]
        assert status_of(port, "/hello") == 401
        assert status_of(port, "/hello", token="wrong-token-0123456789") == 403
        assert get(port, "/hello", token=TOKEN)[2] == b"hi"
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110 11.1)
            req = urllib.request.Request(f"http://127.0.0.1:{port}/hello",
                                         headers={"Authorization": f"{scheme} {TOKEN}"})
            with urllib.request.urlopen(req, timeout=5) as r:
                assert r.read() == b"hi"
    finally:
        srv.stop()


def test_a_name_for_loopback_needs_no_token_and_a_dotted_non_address_is_refused(run, tmp_path):
    from ckptd.live.serve import is_loopback
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and not is_loopback("10.1.2.3")
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("::ffff:10.1.2.3")  # IPv4's, mapped
    # a name that does not resolve: it said "not a loopback address: set token_file"
    with pytest.raises(ConfigError, match=r"^listen nosuchhost.invalid:0: the host name nosuchhost.invalid "
                                          r"does not resolve$"):
        http_server(load_config(_config(run, tmp_path, listen="nosuchhost.invalid:0")), {})
    srv = http_server(load_config(_config(run, tmp_path, listen="localhost:0")), {})
    srv.stop()
    for bad in ("999.1.1.1:0", "127.1:0"):
        with pytest.raises(ConfigError, match="is not an IPv4 address"):
            load_config(_config(run, tmp_path, listen=bad))


# -- the daemon -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=5, mirrors=1)
    return d


def _config(d, tmp_path, listen="127.0.0.1:0", **extra):
    cfg = tmp_path / "ckptd.yaml"
    lines = [f"plan: {d / 'plan.json'}", f"init: {d / 'init.pt'}", f"out: {tmp_path / 'ck'}",
             f"listen: '{listen}'", "interfaces:", "  - {name: mirror0, ifname: m0}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_non_loopback_listen_needs_a_token(run, tmp_path):
    cfg = load_config(_config(run, tmp_path, listen="0.0.0.0:0"))
    with pytest.raises(ConfigError, match=r"listen 0\.0\.0\.0:0 is not a loopback address: set token_file"):
        Daemon(cfg).run(source=iter(()), install_signals=False)
    (tmp_path / "tok").write_text("short\n")
    with pytest.raises(ConfigError, match="token_file.*at least 16"):
        load_config(_config(run, tmp_path, listen="0.0.0.0:0", token_file=tmp_path / "tok"))
    (tmp_path / "tok").write_text(TOKEN + "\n")
    cfg = load_config(_config(run, tmp_path, listen="0.0.0.0:0", token_file=tmp_path / "tok"))
    srv = http_server(cfg, {"/x": lambda _, __: Response(200, b"x")})
    try:
        assert status_of(srv.address[1], "/x") == 401
        assert get(srv.address[1], "/x", token=TOKEN)[2] == b"x"
    finally:
        srv.stop()


def test_ipv6_loopback_listen(run, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    cfg = load_config(_config(run, tmp_path, listen="[::1]:0"))
    srv = http_server(cfg, {"/x": lambda _, __: Response(200, b"six")})
    try:
        assert srv.address[0] == "::1"
        assert get(srv.address[1], "/x", host="[::1]")[2] == b"six"
    finally:
        srv.stop()
    # and the daemon itself on [::1] (http.server's IPv4-only server used to crash here)
    daemon = Daemon(cfg)
    seen = {}

    def source():
        seen["status"] = json.loads(get(daemon.address[1], "/status", host="[::1]")[2])
        yield from ()
    assert daemon.run(source=source(), install_signals=False) == 0
    assert seen["status"]["state"] == "running"


def test_daemon_serves_1000_idle_connections_commits_and_restores_exactly(run, tmp_path):
    """1000 idle clients are held open while the pipeline commits and /status and
    /checkpoint keep answering; the checkpoint served restores a trainer bit for bit."""
    daemon = Daemon(load_config(_config(run, tmp_path, read_timeout_s=60)))
    frames = list(file_source(pcaps(run), []))
    seen = {}

    def source():
        yield from frames[: len(frames) // 3]
        port = daemon.address[1]
        seen["idle"] = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
        seen["before"] = json.loads(get(port, "/status")[2])["last_committed"]
        yield from frames[len(frames) // 3:]
        # every iteration but the last has committed (the last waits for the end of input)
        for _ in range(100):
            if daemon.memory.iterations()[-1:] == [3]:
                break
            time.sleep(0.05)
        st = json.loads(get(port, "/status")[2])
        seen["after"] = st["last_committed"]
        seen["status"] = st
        seen["latest"] = get(port, "/checkpoint")
        seen["previous"] = get(port, "/checkpoint/2")
        seen["gone"] = status_of(port, "/checkpoint/0")
        seen["open"] = daemon.server.open

    assert daemon.run(source=source(), install_signals=False) == 0
    for s in seen.pop("idle"):
        s.close()
    assert seen["before"] < seen["after"] == 3
    assert seen["open"] >= 1000  # the idle ones were still open, not dropped
    assert seen["gone"] == 404
    assert seen["status"]["memory"]["iterations"] == [2, 3]
    assert str(tmp_path) not in json.dumps(seen["status"])  # no absolute paths by default
    for want, (code, headers, body) in ((3, seen["latest"]), (2, seen["previous"])):
        assert code == 200 and int(headers["X-Ckptd-Iteration"]) == want
        assert headers["X-Ckptd-SHA256"] == hashlib.sha256(body).hexdigest()
        doc = torch.load(io.BytesIO(body), weights_only=True)
        assert doc["step"] == want + 1


def _trainer(run):
    plan = load_plan(run / "plan.json")
    model = build_model("tiny", 0)
    opt = torch_optimizer(plan.optimizer, list(model.named_parameters()))
    return model, opt, torch_scheduler(plan.optimizer, opt)


def test_restore_from_the_daemon_url_equals_the_trainers_own_state(run, tmp_path):
    (tmp_path / "tok").write_text(TOKEN)
    daemon = Daemon(load_config(_config(run, tmp_path, token_file=tmp_path / "tok")))
    got = {}

    def source():
        yield from file_source(pcaps(run), [])
        for _ in range(100):
            if daemon.memory.iterations()[-1:] == [3]:
                break
            time.sleep(0.05)
        url = f"http://127.0.0.1:{daemon.address[1]}"
        with pytest.raises(CheckpointError, match="HTTP 401"):
            ckptd.restore(*_trainer(run)[:2], url)
        m, o, s = _trainer(run)
        got["r"] = ckptd.restore(m, o, url, scheduler=s, token=TOKEN)
        got["state"] = (m, o, s)

    assert daemon.run(source=source(), install_signals=False) == 0
    r = got["r"]
    assert r.iteration == 3 and r.bytes > 0
    # the same trainer restored from its own checkpoint file of that iteration
    ref = _trainer(run)
    ckptd.restore(ref[0], ref[1], run / "reference" / "iter_000003.pt", scheduler=ref[2])
    mine = got["state"]
    for (n, x), (_, y) in zip(mine[0].state_dict().items(), ref[0].state_dict().items()):
        assert torch.equal(x, y), n
    # and both continue identically: one more step from the same gradients
    for m, o, s in (mine, ref):
        torch.manual_seed(1)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        o.step()
        if s is not None:
            s.step()
    for p, q in zip(mine[0].parameters(), ref[0].parameters()):
        assert torch.equal(p, q)
        for k in mine[1].state[p]:
            assert torch.equal(mine[1].state[p][k], ref[1].state[q][k]), k
    assert mine[1].param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]


@pytest.mark.parametrize("key,value,message", [
    ("max_connections", 0, r"'max_connections' is 0; it must be in 1\.\."),
    ("read_timeout_s", "soon", r"'read_timeout_s' must be seconds"),
    ("http_workers", 1000, r"'http_workers' is 1000"),
    ("status_details", "'yes'", r"'status_details' must be true or false"),
    ("persist_every", 0, r"'persist_every' is 0"),
    ("persist_sync", 3, r"'persist_sync' must be true or false"),
    ("token_file", "/nonexistent/tok", r"token_file: cannot read /nonexistent/tok"),
    ("persist_url", "'://'", r"'persist_url' .* has no protocol"),
    ("persist_url", "file://ckpts", r"'persist_url' .* absolute path"),
    ("plan", "other.json", r"cannot read config: key 'plan' given twice \(line 7\)")])
def test_new_config_keys_are_checked(run, tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(_config(run, tmp_path, **{key: value}))
    assert "\n" not in str(e.value) and "ckptd.yaml" in str(e.value)
