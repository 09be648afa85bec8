"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of the test S3 server (tests/_s3.py).

Clients are pointed at the proxy (``proxy.endpoint.endpoint_url``, ``.env``, ``.storage_options``) and sign their
requests for the proxy's host:port; the proxy forwards every request byte for byte (Host header included; only
``Expect: 100-continue``, which SigV4 does not sign, is dropped and answered by the proxy itself), over one
upstream connection per client connection, so keep-alive works on both sides. SeaweedFS checks the signature
against the Host header it receives, so signed requests pass through unchanged.

Faults are ``Fault`` rules set at run time (``set_faults``, thread-safe); the first rule matching a request (by
method and by whether it has a Range header) that fires decides what happens to it:

- ``drop``: close the client connection after reading the request head: no response, the body (if any) unsent.
- ``drop_response``: forward the whole request (the server acts on it: a PUT is stored), then close the client
  connection without a response: the ambiguous outcome of a lost response.
- ``status503`` / ``status500``: answer ``503 SlowDown`` / ``500 InternalError`` with an S3 XML error body; the
  request is not forwarded.
- ``truncate``: forward, send the response head unchanged and ``truncate_at`` bytes of the body, then close.
- ``stall``: a frozen server: read the request head, then neither forward nor answer it; the connection stays open
  (whatever the client sends is read and dropped) until the client gives up or the proxy closes.

A rule fires on the next ``count`` matching requests (``count=None``: on every one) or, with ``probability``,
on each matching request with that chance from a ``random.Random(seed)`` (``count`` then caps how often);
``after=n`` lets the first ``n`` matching requests through first (a fault on the n+1-th); ``path`` (a substring of
the request's path) narrows a rule to one object.
``stats()`` counts requests, request and response body bytes per method (bytes actually sent to the client) and
fired faults per kind; ``log()`` lists each request's method, path, Range header, status and bytes.
``control()`` gives a picklable :class:`ProxyControl` with the same calls for other processes (spawned ranks, a
writer in a subprocess), served on a loopback ``multiprocessing.connection`` listener with a random key.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import socket
import threading
from collections import Counter
from multiprocessing.connection import Client, Listener
from typing import Any, BinaryIO, Literal

from _s3 import S3Endpoint

SETTLE_S = 5  # how long stats() and log() wait for requests whose answer is sent to be counted
IO_TIMEOUT_S = 60  # per socket operation; also how long an idle keep-alive connection is kept
FaultKind = Literal["drop", "drop_response", "status503", "status500", "truncate", "stall"]
_ERRORS = {
    "status503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "status500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}


@dataclasses.dataclass
class Fault:
    """One fault rule; ``methods`` (e.g. ``{"GET"}``) and ``ranged`` (True/False) narrow which requests it hits."""

    kind: FaultKind
    count: int | None = 1
    probability: float | None = None
    methods: frozenset[str] | set[str] | None = None
    ranged: bool | None = None
    truncate_at: int = 0
    seed: int = 0
    after: int = 0
    path: str | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._passed = 0

    def fires(self, method: str, ranged: bool, path: str = "") -> bool:
        """Whether this rule hits the request (consuming one of ``count``); call under the proxy's lock."""
        if self.methods is not None and method not in self.methods:
            return False
        if self.path is not None and self.path not in path:
            return False
        if self.ranged is not None and self.ranged != ranged:
            return False
        if self.count is not None and self.count <= 0:
            return False
        if self._passed < self.after:
            self._passed += 1
            return False
        if self.probability is not None and self._rng.random() >= self.probability:
            return False
        if self.count is not None:
            self.count -= 1
        return True


@dataclasses.dataclass(frozen=True)
class ProxyStats:
    requests: dict[str, int]  # per method
    request_bytes: dict[str, int]  # request body bytes received from clients, per method
    response_bytes: dict[str, int]  # response body bytes sent to clients, per method
    faults: dict[str, int]  # fired faults per kind
    connections: int  # client connections accepted (fewer than requests: keep-alive at work)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    range: str | None
    status: int | None  # None: no response was sent (a drop)
    response_bytes: int
    fault: str | None


def _read_head(reader: BinaryIO) -> list[bytes] | None:
    """The request or status line and header lines (with their CRLFs); None at a clean end of stream."""
    lines: list[bytes] = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("stream ended inside a message head")
            return None
        if line in (b"\r\n", b"\n"):
            return lines
        lines.append(line)


def _headers(lines: list[bytes]) -> dict[str, str]:
    out = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _relay_body(
    reader: BinaryIO,
    headers: dict[str, str],
    sink: socket.socket | None,
    limit: int | None = None,
    until_eof: bool = False,
) -> int:
    """Copy one message body (Content-Length, chunked, or to EOF) to ``sink``; returns bytes read.

    ``limit`` stops sending after that many body bytes (the rest is still read, so the count is the full size).
    """
    sent = 0

    def emit(data: bytes) -> None:
        nonlocal sent
        if sink is not None:
            room = len(data) if limit is None else max(0, min(len(data), limit - sent))
            if room:
                sink.sendall(data[:room])
        sent += len(data)

    total = 0
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:  # raw chunk framing is forwarded; only chunk payloads are counted
            size_line = reader.readline(65537)
            emit(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = reader.readline(65537)
                    emit(line)
                    if line in (b"\r\n", b"\n", b""):
                        return total
            emit(_read_exact(reader, size + 2))
            total += size
    if "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining:
            data = _read_exact(reader, min(remaining, 1 << 16))
            emit(data)
            remaining -= len(data)
            total += len(data)
        return total
    while until_eof:
        data = reader.read1(1 << 16)  # type: ignore[attr-defined]
        if not data:
            break
        emit(data)
        total += len(data)
    return total


def _read_exact(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise ConnectionError("stream ended inside a message body")
    return data


class FaultProxy:
    """The proxy; ``start()`` binds a free port on 127.0.0.1 and serves from daemon threads until ``close()``."""

    def __init__(self, upstream: S3Endpoint):
        self.upstream = upstream
        host, _, port = upstream.endpoint_url.removeprefix("http://").partition(":")
        self._upstream_addr = (host, int(port))
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified when a request is counted
        self._in_flight = 0  # requests read but not yet counted (an answer may be sent before its count)
        self._faults: list[Fault] = []
        self._stats: dict[str, Counter[str]] = {}
        self._log: list[RequestRecord] = []
        self._connections: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.port = self._listener.getsockname()[1]
        self.endpoint = dataclasses.replace(upstream, endpoint_url=f"http://127.0.0.1:{self.port}")
        self._closed = threading.Event()
        self._control: Listener | None = None
        self._control_key = b""
        self.reset_stats()

    # What a test uses: the endpoint record's fields, faults and counters.
    @property
    def endpoint_url(self) -> str:
        return self.endpoint.endpoint_url

    @property
    def env(self) -> dict[str, str]:
        return self.endpoint.env

    @property
    def storage_options(self) -> dict:
        return self.endpoint.storage_options

    def url(self, prefix: str = "t") -> str:
        return self.endpoint.url(prefix)

    def set_faults(self, *faults: Fault) -> None:
        """Replace the rules (checked in order); ``set_faults()`` with none is ``clear()``."""
        with self._lock:
            self._faults = list(faults)

    def clear(self) -> None:
        self.set_faults()

    def stats(self) -> ProxyStats:
        """The counters, once every request already read is counted (a client can see an answer before it is)."""
        with self._lock:
            self._settled.wait_for(lambda: self._in_flight == 0, timeout=SETTLE_S)
            return ProxyStats(**{name: dict(c) for name, c in self._stats.items()}, connections=self._connections_seen)

    def log(self) -> list[RequestRecord]:
        with self._lock:
            self._settled.wait_for(lambda: self._in_flight == 0, timeout=SETTLE_S)
            return list(self._log)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {name: Counter() for name in ("requests", "request_bytes", "response_bytes", "faults")}
            self._log = []
            self._connections_seen = 0

    def control(self) -> ProxyControl:
        """A handle on this proxy for another process (started on first use; closed with the proxy)."""
        with self._lock:
            if self._control is None:
                self._control_key = os.urandom(16)
                self._control = Listener(("127.0.0.1", 0), authkey=self._control_key)
                threading.Thread(target=self._control_loop, args=(self._control,), daemon=True).start()
            return ProxyControl(self._control.address, self._control_key)

    def _control_loop(self, listener: Listener) -> None:
        calls = {"set_faults": self.set_faults, "stats": self.stats, "log": self.log, "reset_stats": self.reset_stats}
        while not self._closed.is_set():
            try:
                conn = listener.accept()
            except Exception:  # closed, or a client without the key
                if self._closed.is_set():
                    return
                continue
            with conn:
                try:
                    name, args = conn.recv()
                    conn.send(calls[name](*args))
                except (EOFError, OSError):
                    continue

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        if self._control is not None:
            self._control.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            _close(conn)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(IO_TIMEOUT_S)
            with self._lock:
                self._connections.add(conn)
                self._connections_seen += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _record(self, method: str, request_bytes: int, record: RequestRecord) -> None:
        with self._lock:
            self._stats["requests"][method] += 1
            self._stats["request_bytes"][method] += request_bytes
            self._stats["response_bytes"][method] += record.response_bytes
            if record.fault:
                self._stats["faults"][record.fault] += 1
            self._log.append(record)
            self._in_flight -= 1
            self._settled.notify_all()

    def _hold(self, client: socket.socket) -> None:
        """A frozen server's side of a connection: read and drop what the client sends, answer nothing, until the
        client closes it or the proxy closes."""
        while not self._closed.is_set():
            try:
                if not client.recv(1 << 16):
                    return
            except TimeoutError:
                continue

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        up_reader: BinaryIO | None = None
        reader: BinaryIO = client.makefile("rb")  # type: ignore[assignment]
        pending = False  # a request read and not yet counted
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                method, path = head[0].decode("latin-1").split(" ")[:2]
                headers = _headers(head)
                with self._lock:
                    fault = next((f for f in self._faults if f.fires(method, "range" in headers, path)), None)
                    self._in_flight += 1
                    pending = True
                kind = fault.kind if fault else None
                record = functools.partial(RequestRecord, method, path, headers.get("range"), fault=kind)
                if kind == "drop":
                    self._record(method, 0, record(None, 0))
                    pending = False
                    return
                if kind == "stall":
                    self._record(method, 0, record(None, 0))
                    pending = False
                    self._hold(client)
                    return
                expects = headers.get("expect", "").lower() == "100-continue"
                head = [line for line in head if not line.lower().startswith(b"expect:")]
                if kind in _ERRORS:
                    status, reason, code, message = _ERRORS[kind]  # type: ignore[index]
                    body = (
                        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                        f"</Message><Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>"
                    ).encode()
                    # With Expect: 100-continue the client has not sent its body: answer, then close.
                    n = 0 if expects else _relay_body(reader, headers, None)
                    close = "close" if expects else "keep-alive"
                    client.sendall(
                        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: {close}\r\n\r\n".encode()
                        + body
                    )
                    self._record(method, n, record(status, len(body)))
                    pending = False
                    if expects:
                        return
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self._upstream_addr, timeout=IO_TIMEOUT_S)
                    up_reader = upstream.makefile("rb")  # type: ignore[assignment]
                assert up_reader is not None
                if expects:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                upstream.sendall(b"".join(head) + b"\r\n")
                n = _relay_body(reader, headers, upstream)
                response = _read_head(up_reader)
                if response is None:
                    raise ConnectionError("the server closed the connection without a response")
                status = int(response[0].split()[1])
                if kind == "drop_response":
                    self._record(method, n, record(None, 0))
                    pending = False
                    return
                client.sendall(b"".join(response) + b"\r\n")
                resp_headers = _headers(response)
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                limit = fault.truncate_at if fault and kind == "truncate" else None
                sent = 0 if no_body else _relay_body(up_reader, resp_headers, client, limit, until_eof=True)
                if limit is not None:
                    sent = min(sent, limit)
                self._record(method, n, record(status, sent))
                pending = False
                if limit is not None or "close" in resp_headers.get("connection", "").lower():
                    return
                if not no_body and "content-length" not in resp_headers and "transfer-encoding" not in resp_headers:
                    return  # a body delimited by the end of the stream
        except (OSError, ValueError, ConnectionError):
            return  # a client or server gone, a timeout, or the proxy closing: drop this connection
        finally:
            with self._lock:
                self._connections.discard(client)
                self._in_flight -= pending
                self._settled.notify_all()
            _close(client)
            if upstream is not None:
                _close(upstream)


@dataclasses.dataclass(frozen=True)
class ProxyControl:
    """:meth:`FaultProxy.control`: ``set_faults``, ``clear``, ``stats``, ``log``, ``reset_stats`` from any process."""

    address: Any
    authkey: bytes

    def _call(self, name: str, *args: Any) -> Any:
        with Client(self.address, authkey=self.authkey) as conn:
            conn.send((name, args))
            return conn.recv()

    def set_faults(self, *faults: Fault) -> None:
        self._call("set_faults", *faults)

    def clear(self) -> None:
        self._call("set_faults")

    def stats(self) -> ProxyStats:
        return self._call("stats")

    def log(self) -> list[RequestRecord]:
        return self._call("log")

    def reset_stats(self) -> None:
        self._call("reset_stats")


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
