"""The daemon's HTTP server: a few GET routes, hardened for a long-running process.

One selector thread accepts connections and reads their request heads without blocking;
a complete head goes to a fixed pool of worker threads, which answer and close (one
request per connection, `Connection: close`). So idle or slow clients cost a socket and
a buffer each, never a thread:

- at most `max_connections` are open at once; one more is answered 503 and closed at
  once, without reading it;
- a request head must arrive whole within `read_timeout_s` of the accept (a slowloris
  sending a byte a second is closed at the deadline, 408), and be at most 8 KiB with
  its blank line (431); its lines may end in CRLF or bare LF;
- a worker writes with the same timeout per send, so a client that stops reading
  frees its worker;
- with a `token`, every request needs `Authorization: Bearer <token>` (401 without it,
  403 for a wrong one), compared in constant time.

Routes map a path (or a prefix ending in "/") to a function of (the path past the prefix,
the request's headers by lower-case name) returning a Response whose body is bytes or an
iterable of bytes chunks (a checkpoint is sent in chunks).
"""
from __future__ import annotations

import collections
import hmac
import ipaddress
import re
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ckptd.threads import Thread, name_os_thread

MAX_HEAD = 8192  # bytes of a request head, its blank line included
# The blank line that ends a head. Lines may end in bare LF as well as CRLF (RFC 9112
# 2.2 allows a recipient to accept it): hand-typed netcat requests are answered, not
# left to time out.
_BLANK_LINE = re.compile(rb"\n\r?\n")
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Response:
    status: int = 200
    body: bytes | Iterable[bytes] = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict = field(default_factory=dict)
    length: int | None = None  # Content-Length for an iterable body


def text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode())


def resolve_listen(host: str, port: int) -> tuple[int, tuple]:
    """(address family, bind address) of a listen host: an IPv4 or IPv6 literal, or a
    name resolved to its first address."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    return family, addr


def is_loopback(host: str) -> bool:
    """A loopback address (::ffff:127.0.0.1 too: IPv6 says it is not one, it is IPv4's),
    or a name that resolves to loopback addresses only (localhost)."""
    try:
        return _loopback(host)
    except ValueError:
        pass
    addrs = resolved(host)
    return bool(addrs) and all(_loopback(a) for a in addrs)


def _loopback(addr: str) -> bool:
    a = ipaddress.ip_address(addr.split("%")[0])
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback


def resolved(host: str) -> set[str]:
    """The addresses a host name resolves to (none where it does not)."""
    import socket
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


class _Conn:
    __slots__ = ("sock", "buf", "deadline")

    def __init__(self, sock, deadline):
        self.sock, self.buf, self.deadline = sock, bytearray(), deadline


class HttpServer:
    def __init__(self, routes: dict[str, Callable[[str, dict], Response]], host: str, port: int,
                 token: str | None = None, workers: int = 8, max_connections: int = 1024,
                 read_timeout_s: float = 10.0, backlog: int = 128):
        self.routes, self.token = routes, token
        self.max_connections, self.read_timeout_s = max_connections, read_timeout_s
        family, addr = resolve_listen(host, port)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self.sock.bind(addr)
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.open = 0  # connections accepted and not yet closed (reading or in a worker)
        self.refused = 0
        self.timed_out = 0
        self._lock = threading.Lock()
        self._reading: collections.OrderedDict[int, _Conn] = collections.OrderedDict()  # by deadline
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-http",
                                        initializer=name_os_thread)
        self._stop = threading.Event()
        self.thread = Thread(target=self._loop, name="ckptd-accept", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self._stop.set()
        self.thread.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for c in list(self._reading.values()):
            c.sock.close()
        self._reading.clear()
        self._sel.close()
        self.sock.close()

    # -- the selector thread ---------------------------------------------------------
    def _loop(self):
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                if key.fileobj is self.sock:
                    self._accept()
                else:
                    self._read(key.data)
            self._expire(time.monotonic())

    def _accept(self):
        for _ in range(64):  # a burst, then back to the other sockets
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the backlog holds the rest for now (and
                time.sleep(0.05)  # the listener stays readable: do not spin on it)
                return
            with self._lock:
                full = self.open >= self.max_connections
                if not full:
                    self.open += 1
            if full:
                self.refused += 1
                _send_quietly(s, _head(503, "text/plain", 12) + b"server full\n")
                s.close()
                continue
            s.setblocking(False)
            c = _Conn(s, time.monotonic() + self.read_timeout_s)
            self._reading[s.fileno()] = c
            self._sel.register(s, selectors.EVENT_READ, c)

    def _read(self, c: _Conn):
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        # the blank line may straddle two recvs: search from just before the new data,
        # never the whole buffer again (a byte-a-second client must not cost quadratic time)
        start = max(0, len(c.buf) - 2)
        c.buf += data
        blank = _BLANK_LINE.search(c.buf, start)
        if blank is None and len(c.buf) <= MAX_HEAD:
            return  # more to come
        # the limit holds for the head with its blank line, however the recvs cut it
        if blank is None or blank.end() > MAX_HEAD:
            _send_quietly(c.sock, _head(431, "text/plain", 0))
            self._drop(c)
            return
        c.buf = c.buf[:blank.start()]  # the head's lines; anything after it is ignored
        self._sel.unregister(c.sock)
        del self._reading[c.sock.fileno()]
        self._pool.submit(self._answer, c)

    def _expire(self, now: float):
        while self._reading:
            fd, c = next(iter(self._reading.items()))
            if c.deadline > now:
                return  # deadlines grow in accept order
            self.timed_out += 1
            _send_quietly(c.sock, _head(408, "text/plain", 0))
            self._drop(c)

    def _drop(self, c: _Conn):
        self._sel.unregister(c.sock)
        self._reading.pop(c.sock.fileno(), None)
        self._close(c.sock)

    def _close(self, s):
        s.close()
        with self._lock:
            self.open -= 1

    # -- a worker ---------------------------------------------------------------------
    def _answer(self, c: _Conn):
        s = c.sock
        try:
            s.settimeout(self.read_timeout_s)  # per send: a client that stops reading is let go
            resp, head_only = self._respond(c.buf)
            s.sendall(_head(resp.status, resp.content_type,
                            len(resp.body) if isinstance(resp.body, bytes) else resp.length,
                            resp.headers))
            if head_only:
                return
            if isinstance(resp.body, bytes):
                s.sendall(resp.body)
            else:
                for chunk in resp.body:
                    s.sendall(chunk)
        except OSError:
            pass  # the client went away or stopped reading
        finally:
            self._close(s)

    def _respond(self, head: bytes) -> tuple[Response, bool]:
        """The response to a request head (its lines, without the blank line)."""
        lines = [line.removesuffix("\r") for line in head.decode("latin-1").split("\n")]
        if any("\r" in line for line in lines):  # RFC 9112 2.2: reject a bare CR
            return text(400, "bare CR in the request head"), False
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return text(400, "bad request line"), False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return text(405, "GET only"), False
        # a HEAD is answered without a body whatever the answer (the refusals below had one)
        return self._route(target, lines), method == "HEAD"

    def _route(self, target: str, lines: list[str]) -> Response:
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if self.token is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110 11.1)
                return text(401, "a bearer token is required (Authorization: Bearer ...)")
            if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), self.token.encode()):
                return text(403, "wrong token")
        path = target.split("?", 1)[0]
        route = self.routes.get(path)
        arg = ""
        if route is None:
            for prefix, fn in self.routes.items():
                if prefix.endswith("/") and path.startswith(prefix) and len(path) > len(prefix):
                    route, arg = fn, path[len(prefix):]
                    break
        if route is None:
            return text(404, "try " + ", ".join(sorted(self.routes)))
        try:
            return route(arg, headers)
        except Exception as e:  # a route's bug must not kill the worker
            return text(500, " ".join(str(e).split())[:300])


def _head(status: int, ctype: str, length: int | None, headers: dict | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, '')}", f"Content-Type: {ctype}",
             "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _send_quietly(s, data: bytes):
    try:
        s.send(data, socket.MSG_DONTWAIT)
    except OSError:
        pass
