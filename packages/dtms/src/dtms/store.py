"""Authenticated key-value store over TCP for rendezvous (``TCPStore``).

Wire format (no pickle, ever): every message is one frame
``u32 length | 32-byte HMAC-SHA256 | body``, where ``body = u32 header_len | JSON header | raw value``.
The MAC covers a per-connection session (server nonce + client nonce, exchanged when the
connection opens), the direction and a message counter, so a frame cannot be replayed on another
connection, reflected back, or replayed/reordered on the same one. Frames above ``max_message_bytes``
are refused before their body is read. The server binds to 127.0.0.1 unless given another address.

Hostile local peers (anyone who can connect, without the secret) cannot disable it: a connection is
*unauthenticated* until its first frame's MAC checks (the client sends a small ``ping`` at once); at most
``max_unauthenticated`` such connections are held (a new one evicts the oldest), each must authenticate within
``handshake_timeout`` seconds, and a frame announced before that may be at most ``PREAUTH_MAX_FRAME`` bytes, so
they cost bounded memory and descriptors. Every frame, once started, must arrive whole within the frame timeout
(a deadline for the frame, not per read), and the accept loop outlasts transient errors (EMFILE, ECONNABORTED).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time

SECRET_ENV = "BLUTRAIN_STORE_SECRET"
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024
_MAGIC = b"BLUSTOR1"
_NONCE = 16
_MAC = 32
PREAUTH_MAX_FRAME = 4096  # bytes a connection may announce before it has authenticated
DEFAULT_MAX_UNAUTHENTICATED = 64
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
# unauthenticated one-line refusals the server may send before closing a connection
_REFUSE_AUTH = b"!REFUSED:auth"
_REFUSE_SIZE = b"!REFUSED:size"


class StoreError(RuntimeError):
    """A store operation failed (refused, closed, or protocol error)."""


class StoreTimeout(StoreError, TimeoutError):
    """A store operation did not complete within its timeout."""


def _secret_bytes(secret: str | bytes | None) -> bytes:
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise StoreError(
            f"no store secret: pass secret= or set {SECRET_ENV} (blurun sets it for its ranks)"
        )
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (time.monotonic()) all of them by then, however slowly they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - len(buf)} of {n} bytes still missing at the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class _Session:
    """MAC state of one connection: nonces, direction and counters on both sides."""

    def __init__(self, secret: bytes, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        self.key = hmac.new(secret, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()
        self.send_dir = b"S" if is_server else b"C"
        self.recv_dir = b"C" if is_server else b"S"
        self.send_ctr = 0
        self.recv_ctr = 0

    def _mac(self, direction: bytes, ctr: int, body: bytes) -> bytes:
        return hmac.new(self.key, direction + struct.pack(">Q", ctr) + body, hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        mac = self._mac(self.send_dir, self.send_ctr, body)
        self.send_ctr += 1
        return struct.pack(">I", _MAC + len(body)) + mac + body

    def check(self, mac: bytes, body: bytes) -> bool:
        ok = hmac.compare_digest(mac, self._mac(self.recv_dir, self.recv_ctr, body))
        if ok:
            self.recv_ctr += 1
        return ok


def _encode(header: dict, value: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(h)) + h + value


def _decode(body: bytes) -> tuple[dict, bytes]:
    if len(body) < 4:
        raise StoreError("malformed store message (too short)")
    (hl,) = struct.unpack(">I", body[:4])
    if hl > len(body) - 4:
        raise StoreError("malformed store message (header length)")
    header = json.loads(body[4 : 4 + hl].decode())
    if not isinstance(header, dict):
        raise StoreError("malformed store message (header is not an object)")
    return header, body[4 + hl :]


def _as_bytes(value: bytes | bytearray | memoryview | str | int) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"store values are bytes or str (no pickle), got {type(value).__name__}")


class _Server:
    """Threaded server holding the key-value map; one thread per connection."""

    def __init__(self, host: str, port: int, secret: bytes, max_message: int, frame_timeout: float,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED):
        self.secret = secret
        self.max_message = max_message
        self.frame_timeout = frame_timeout
        self.handshake_timeout = float(handshake_timeout)
        self.max_unauthenticated = max(1, int(max_unauthenticated))
        self.pending: dict[socket.socket, float] = {}  # unauthenticated connections -> accept time
        self.pending_lock = threading.Lock()
        self.accept_errors = 0  # transient accept() failures survived (EMFILE, ...)
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise StoreError(f"store cannot listen on {host}:{port}: {e.strerror or e}") from e
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        self.conns: set[socket.socket] = set()
        self.thread = threading.Thread(target=self._accept_loop, name="dtms-store-accept", daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                self.accept_errors += 1  # out of descriptors, aborted handshake, ...: never the end of the store
                self._evict_oldest()  # frees a descriptor when unauthenticated peers hold them
                time.sleep(0.05)
                continue
            with self.pending_lock:
                if len(self.pending) >= self.max_unauthenticated:
                    self._evict_oldest(locked=True)
                self.pending[conn] = time.monotonic()
            self.conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), name="dtms-store-conn", daemon=True).start()
            except RuntimeError:  # no thread to spare: drop this connection, keep serving the others
                self._drop_conn(conn)

    def _evict_oldest(self, locked: bool = False) -> None:
        """Close the longest-waiting unauthenticated connection (its thread then ends)."""
        if not locked:
            with self.pending_lock:
                return self._evict_oldest(locked=True)
        if self.pending:
            oldest = min(self.pending, key=self.pending.__getitem__)
            del self.pending[oldest]
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _drop_conn(self, conn: socket.socket) -> None:
        with self.pending_lock:
            self.pending.pop(conn, None)
        self.conns.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_nonce = secrets.token_bytes(_NONCE)
            auth_by = time.monotonic() + self.handshake_timeout  # hello and a first authenticated frame by then
            conn.settimeout(self.handshake_timeout)
            conn.sendall(_MAGIC + server_nonce)
            hello = _recv_exact(conn, len(_MAGIC) + _NONCE, auth_by)
            if hello[: len(_MAGIC)] != _MAGIC:
                return
            sess = _Session(self.secret, server_nonce, hello[len(_MAGIC) :], is_server=True)
            authed = False
            while not self.closed:
                if authed:
                    conn.settimeout(None)  # idle between requests is fine once authenticated
                    head = _recv_exact(conn, 4)
                    deadline = time.monotonic() + self.frame_timeout  # the whole frame, not each read
                else:
                    head = _recv_exact(conn, 4, auth_by)
                    deadline = auth_by
                (n,) = struct.unpack(">I", head)
                limit = self.max_message + _MAC if authed else min(self.max_message + _MAC, PREAUTH_MAX_FRAME)
                if n > limit or n < _MAC:
                    conn.sendall(_REFUSE_SIZE + f":{n - _MAC}:{limit - _MAC}".encode())
                    return
                raw = _recv_exact(conn, n, deadline)
                if not sess.check(raw[:_MAC], raw[_MAC:]):
                    conn.sendall(_REFUSE_AUTH)
                    return
                if not authed:
                    authed = True
                    with self.pending_lock:
                        self.pending.pop(conn, None)
                header, value = _decode(raw[_MAC:])
                rh, rv = self._handle(header, value)
                body = _encode(rh, rv)
                conn.sendall(sess.seal(body))
        except (ConnectionError, OSError, ValueError, StoreError, struct.error):
            return
        finally:
            self._drop_conn(conn)

    def _handle(self, h: dict, value: bytes) -> tuple[dict, bytes]:
        try:
            return self._apply(h, value)
        except (KeyError, TypeError, ValueError) as e:  # a malformed (but authenticated) request
            return {"ok": False, "error": f"bad {h.get('op')!r} request: {type(e).__name__}: {e}"}, b""

    def _apply(self, h: dict, value: bytes) -> tuple[dict, bytes]:
        op, key = h.get("op"), h.get("key")
        if op == "ping":  # the client's first frame: authenticates the connection, costs nothing
            return {"ok": True}, b""
        if op in ("set", "get", "add", "compare_set", "delete") and (not isinstance(key, str) or not key):
            return {"ok": False, "error": f"{op}: key must be a non-empty string, got {key!r}"}, b""
        with self.cond:
            if op == "set":
                self.data[key] = value
                self.cond.notify_all()
                return {"ok": True}, b""
            if op == "get":
                if not self._wait_keys([key], h.get("timeout")):
                    return {"ok": False, "timeout": True}, b""
                return {"ok": True}, self.data[key]
            if op == "wait":
                if not self._wait_keys(h.get("keys", []), h.get("timeout")):
                    missing = [k for k in h.get("keys", []) if k not in self.data]
                    return {"ok": False, "timeout": True, "missing": missing}, b""
                return {"ok": True}, b""
            if op == "add":
                cur = int(self.data.get(key, b"0"))
                cur += int(h["delta"])
                self.data[key] = str(cur).encode()
                self.cond.notify_all()
                return {"ok": True, "value": cur}, b""
            if op == "compare_set":
                el = int(h["expected_len"])
                expected, desired = value[:el], value[el:]
                if (key not in self.data and expected == b"") or self.data.get(key) == expected:
                    self.data[key] = desired
                    self.cond.notify_all()
                return {"ok": True}, self.data.get(key, expected)
            if op == "check":
                return {"ok": True, "value": all(k in self.data for k in h.get("keys", []))}, b""
            if op == "delete":
                existed = self.data.pop(key, None) is not None
                return {"ok": True, "value": existed}, b""
            if op == "num_keys":
                return {"ok": True, "value": len(self.data)}, b""
        return {"ok": False, "error": f"unknown store op {op!r}"}, b""

    def _wait_keys(self, keys: list[str], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while not all(k in self.data for k in keys):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.cond.wait(left if left is not None else 1.0)
        return True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.cond:
            self.cond.notify_all()


class TCPStore:
    """Key-value rendezvous store; the server side (``is_server=True``) runs in a background thread.

    Every instance is also a client. Values are bytes (str is UTF-8 encoded); ``add`` keeps counters
    as decimal text, as in PyTorch's TCPStore.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        is_server: bool = False,
        secret: str | bytes | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        bind_host: str | None = None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
    ):
        self.host = host
        self.timeout = float(timeout)
        self.max_message_bytes = int(max_message_bytes)
        self._secret = _secret_bytes(secret)
        self._server: _Server | None = None
        if is_server:
            self._server = _Server(
                bind_host or host, port, self._secret, self.max_message_bytes, frame_timeout=self.timeout,
                handshake_timeout=handshake_timeout, max_unauthenticated=max_unauthenticated,
            )
            port = self._server.port
        if not port:
            raise StoreError("a store client needs the server's port (MASTER_PORT)")
        self.port = int(port)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sess: _Session | None = None

    # --- connection ---
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, self.timeout))
                break
            except OSError as e:  # server may not be up yet: retry until the timeout
                last = e
                if time.monotonic() >= deadline:
                    raise StoreTimeout(
                        f"store at {self.address} unreachable after {self.timeout:g}s: {last}"
                    ) from e
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise StoreError(f"store at {self.address} closed the connection during handshake") from e
        if hello[: len(_MAGIC)] != _MAGIC:
            sock.close()
            raise StoreError(f"{self.address} is not a BluTrain store (bad handshake)")
        client_nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + client_nonce)
        self._sock = sock
        self._sess = _Session(self._secret, hello[len(_MAGIC) :], client_nonce, is_server=False)
        self._exchange({"op": "ping"}, _encode({"op": "ping"}), None)  # authenticates the connection at once

    def _request(self, header: dict, value: bytes = b"", wait: float | None = None) -> tuple[dict, bytes]:
        body = _encode(header, value)
        if len(body) > self.max_message_bytes:
            raise StoreError(
                f"store message for {header.get('op')}({header.get('key')!r}) is {len(body)} bytes, "
                f"over the limit of {self.max_message_bytes} bytes (max_message_bytes)"
            )
        with self._lock:
            if self._sock is None:
                self._connect()
            return self._exchange(header, body, wait)

    def _exchange(self, header: dict, body: bytes, wait: float | None) -> tuple[dict, bytes]:
        """One request and its reply on the open connection (the caller holds the lock)."""
        sock, sess = self._sock, self._sess
        try:
            sock.settimeout(self.timeout + (wait or 0.0) + 5.0)
            sock.sendall(sess.seal(body))
            head = _recv_exact(sock, 4)
            if head == _REFUSE_AUTH[:4]:
                rest = sock.recv(256)
                self._drop()
                if (head + rest).startswith(_REFUSE_AUTH):
                    raise StoreError(
                        f"store at {self.address} refused the message: bad authentication "
                        f"(wrong {SECRET_ENV}?)"
                    )
                if (head + rest).startswith(_REFUSE_SIZE):
                    raise StoreError(f"store at {self.address} refused the message: too large")
                raise StoreError(f"store at {self.address} sent a malformed reply")
            (n,) = struct.unpack(">I", head)
            if n > self.max_message_bytes + _MAC or n < _MAC:
                self._drop()
                raise StoreError(f"store reply of {n} bytes exceeds limit {self.max_message_bytes}")
            raw = _recv_exact(sock, n)
        except TimeoutError as e:
            self._drop()
            raise StoreTimeout(f"store at {self.address} did not answer {header.get('op')}") from e
        except (ConnectionError, OSError) as e:
            self._drop()
            raise StoreError(f"store at {self.address} connection lost: {e}") from e
        if not sess.check(raw[:_MAC], raw[_MAC:]):
            self._drop()
            raise StoreError(f"reply from store at {self.address} failed authentication")
        return _decode(raw[_MAC:])

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self._sess = None, None

    @staticmethod
    def _check_key(key: str) -> str:
        if not isinstance(key, str) or not key:
            raise TypeError(f"store keys are non-empty str, got {key!r}")
        return key

    # --- operations ---
    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value`` (bytes or str), waking any waiter."""
        self._request({"op": "set", "key": self._check_key(key)}, _as_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Value of ``key``, waiting up to ``timeout`` (default: the store's) for it to be set."""
        t = self.timeout if timeout is None else float(timeout)
        h, v = self._request({"op": "get", "key": self._check_key(key), "timeout": t}, wait=t)
        if h.get("timeout"):
            raise StoreTimeout(f"store get({key!r}) timed out after {t:g}s waiting for key")
        self._raise(h)
        return v

    def add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the integer at ``key`` (0 when absent); returns the new value."""
        h, _ = self._request({"op": "add", "key": self._check_key(key), "delta": int(delta)})
        self._raise(h)
        return int(h["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it equals ``expected`` (or is absent and ``expected`` is empty).

        Returns the value after the operation, as PyTorch's ``compare_set`` does."""
        e, d = _as_bytes(expected), _as_bytes(desired)
        header = {"op": "compare_set", "key": self._check_key(key), "expected_len": len(e)}
        h, v = self._request(header, e + d)
        self._raise(h)
        return v

    def wait(self, keys: list[str] | str, timeout: float | None = None) -> None:
        """Block until every key in ``keys`` is set."""
        keys = [keys] if isinstance(keys, str) else [self._check_key(k) for k in keys]
        t = self.timeout if timeout is None else float(timeout)
        h, _ = self._request({"op": "wait", "keys": keys, "timeout": t}, wait=t)
        if h.get("timeout"):
            raise StoreTimeout(f"store wait({h.get('missing')!r}) timed out after {t:g}s waiting for keys")
        self._raise(h)

    def check(self, keys: list[str] | str) -> bool:
        """True when every key is set (no waiting)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        h, _ = self._request({"op": "check", "keys": keys})
        return bool(h["value"])

    def delete(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""
        h, _ = self._request({"op": "delete", "key": self._check_key(key)})
        return bool(h["value"])

    delete_key = delete  # PyTorch name

    def num_keys(self) -> int:
        """Number of keys held by the server."""
        h, _ = self._request({"op": "num_keys"})
        return int(h["value"])

    def _raise(self, h: dict) -> None:
        if not h.get("ok"):
            raise StoreError(f"store at {self.address}: {h.get('error', 'request failed')}")

    # --- server-side view (launcher use, no network) ---
    def local_items(self, prefix: str = "") -> dict[str, bytes]:
        """Snapshot of the server's keys under ``prefix`` (server instances only)."""
        if self._server is None:
            raise StoreError("local_items() is only available on the server instance")
        with self._server.cond:
            return {k: v for k, v in self._server.data.items() if k.startswith(prefix)}

    def close(self) -> None:
        """Close the client connection and, on the server instance, stop serving and free the port."""
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TCPStore({self.address}, server={self._server is not None})"
