"""TCPStore against hostile local peers (no secret): idle and hello-only connections, trickled frames, large
unauthenticated frames and descriptor exhaustion never stop it from serving the ranks, each within seconds."""

import os
import socket
import struct
import subprocess
import sys
import time

import pytest
from dtms import store as store_mod
from dtms.store import TCPStore

SECRET = "s3cret-for-tests"


def _closed_within(sock, seconds):
    """Seconds until the server closed ``sock`` (reads b'' or a refusal then b''), or None past ``seconds``."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert s.recv(24)[:8] == b"BLUSTOR1"
    return s


def test_idle_unauthenticated_connections_are_bounded_and_evicted():
    srv = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5.0, handshake_timeout=30.0,
                   max_unauthenticated=16)
    idle = []
    try:
        for _ in range(100):  # never say hello: held at most 16 at a time, the oldest evicted
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        deadline = time.monotonic() + 5
        while len(srv._server.pending) > 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(srv._server.pending) <= 16
        t0 = time.monotonic()
        c = TCPStore("127.0.0.1", srv.port, secret=SECRET, timeout=5.0)
        c.set("k", "v")
        assert c.get("k") == b"v" and time.monotonic() - t0 < 2.0
        assert sum(_closed_within(s, 0.05) is not None for s in idle[:50]) >= 40  # the old ones were closed
        c.close()
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_hello_only_connection_dropped_at_the_handshake_deadline():
    srv = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5.0, handshake_timeout=0.5)
    try:
        s = _connect(srv.port)
        s.sendall(b"BLUSTOR1" + b"n" * 16)  # hello, then nothing
        took = _closed_within(s, 3.0)
        assert took is not None and took < 1.5
        s.close()
    finally:
        srv.close()


def test_trickled_frame_dropped_at_the_frame_deadline():
    """One byte every 0.3 s keeps each read under the 1 s timeout; the frame's deadline still ends it."""
    srv = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=1.0)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        hello = s.recv(24)
        cn = b"c" * 16
        s.sendall(b"BLUSTOR1" + cn)
        sess = store_mod._Session(SECRET.encode(), hello[8:], cn, is_server=False)
        s.sendall(sess.seal(store_mod._encode({"op": "ping"})))  # authenticated
        n = struct.unpack(">I", s.recv(4))[0]
        s.recv(n)
        frame = sess.seal(store_mod._encode({"op": "set", "key": "slow"}, b"x" * 64))
        t0 = time.monotonic()
        closed_at = None
        for b in frame:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed_at = time.monotonic() - t0
                break
            s.settimeout(0.3)
            try:
                if s.recv(64) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
            if time.monotonic() - t0 > 6:
                break
        assert closed_at is not None and closed_at < 2.5, closed_at
        s.close()
    finally:
        srv.close()


def test_large_frame_refused_before_authentication():
    srv = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5.0)
    try:
        s = _connect(srv.port)
        s.sendall(b"BLUSTOR1" + b"n" * 16 + struct.pack(">I", 1 << 20))  # 1 MiB: under the 16 MiB limit
        assert s.recv(64).startswith(b"!REFUSED:size")
        s.close()
        c = TCPStore("127.0.0.1", srv.port, secret=SECRET, timeout=5.0)
        c.set("big", b"x" * (2 << 20))  # an authenticated client may still send large values
        assert len(c.get("big")) == 2 << 20
        c.close()
    finally:
        srv.close()


_SERVER = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from dtms.store import TCPStore
s = TCPStore("127.0.0.1", 0, is_server=True, secret=os.environ["SECRET"], timeout=5.0, handshake_timeout=30.0,
             max_unauthenticated=1000)
print(s.port, flush=True)
sys.stdin.readline()
print(s._server.accept_errors, flush=True)
"""


def test_accept_loop_outlasts_descriptor_exhaustion():
    p = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "SECRET": SECRET})
    hold = []
    try:
        port = int(p.stdout.readline())
        for _ in range(80):  # more than the server's 48 descriptors
            hold.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        c = TCPStore("127.0.0.1", port, secret=SECRET, timeout=5.0)
        c.set("k", "v")  # served: the loop evicted idle peers instead of ending
        assert c.get("k") == b"v"
        c.close()
        p.stdin.write("\n")
        p.stdin.flush()
        assert int(p.stdout.readline()) > 0  # it did hit EMFILE and went on
    finally:
        for s in hold:
            s.close()
        p.kill()
        p.wait(10)
    assert p.returncode is not None


@pytest.mark.parametrize("n", [20])
def test_unauthenticated_memory_is_bounded(n):
    """``n`` peers announcing 16 MiB frames and sending 8 MiB each cost the server at most a few KiB each."""
    srv = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5.0)
    try:
        socks = []
        for _ in range(n):
            s = _connect(srv.port)
            s.sendall(b"BLUSTOR1" + b"n" * 16 + struct.pack(">I", 16 << 20))
            socks.append(s)
        refused = sum(s.recv(64).startswith(b"!REFUSED:size") for s in socks)
        assert refused == n  # refused on the announcement: no body is ever buffered
        for s in socks:
            s.close()
    finally:
        srv.close()
