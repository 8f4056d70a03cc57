"""TCPStore: operations, blocking get, timeouts, authentication, size limits, replay, no pickle."""

import inspect
import json
import pickle
import socket
import struct
import threading
import time

import pytest
from dtms import store as store_mod
from dtms.store import StoreError, StoreTimeout, TCPStore

SECRET = "s3cret-for-tests"


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5.0)
    yield s
    s.close()


def client(server, **kw):
    return TCPStore("127.0.0.1", server.port, secret=kw.pop("secret", SECRET), timeout=kw.pop("timeout", 5.0), **kw)


def test_set_get_add_compare_set_delete(server):
    c = client(server)
    c.set("a", b"\x00\x01bytes")
    c.set("b", "text")
    assert c.get("a") == b"\x00\x01bytes" and server.get("b") == b"text"
    assert c.add("n", 5) == 5 and c.add("n", -2) == 3 and c.get("n") == b"3"
    assert c.compare_set("cs", "", "first") == b"first"  # absent + expected empty -> set
    assert c.compare_set("cs", "wrong", "second") == b"first"  # mismatch -> unchanged
    assert c.compare_set("cs", "first", "second") == b"second"
    assert c.check(["a", "b"]) and not c.check(["a", "zz"])
    assert c.num_keys() == 4
    assert c.delete("a") is True and c.delete("a") is False
    assert c.num_keys() == 3
    c.close()


def test_blocking_get_and_wait_across_threads(server):
    c = client(server)
    threading.Timer(0.2, lambda: client(server).set("late", "here")).start()
    t0 = time.monotonic()
    assert c.get("late", timeout=5) == b"here"
    assert 0.15 < time.monotonic() - t0 < 3
    threading.Timer(0.1, lambda: [client(server).set(k, "1") for k in ("w1", "w2")]).start()
    c.wait(["w1", "w2"], timeout=5)


def test_concurrent_add_is_atomic(server):
    def bump():
        c = client(server)
        for _ in range(50):
            c.add("ctr", 1)

    ts = [threading.Thread(target=bump) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert int(client(server).get("ctr")) == 200


def test_get_timeout_message(server):
    c = client(server)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"store get\('x'\) timed out after 0.3s waiting for key"):
        c.get("x", timeout=0.3)
    assert time.monotonic() - t0 < 2
    with pytest.raises(StoreTimeout, match=r"wait\(\['y'\]\) timed out"):
        c.wait(["y"], timeout=0.2)
    c.set("x", "fine")  # the connection is still usable after a timeout
    assert c.get("x") == b"fine"


def test_wrong_secret_refused(server):
    bad = client(server, secret="not-the-secret")
    with pytest.raises(StoreError, match=rf"store at 127.0.0.1:{server.port} refused the message: "
                                         r"bad authentication \(wrong BLUTRAIN_STORE_SECRET\?\)"):
        bad.set("k", "v")
    assert not client(server).check(["k"])


def test_oversized_messages_refused(server):
    c = client(server, max_message_bytes=1024)
    with pytest.raises(StoreError, match=r"over the limit of 1024 bytes"):
        c.set("big", b"x" * 2048)
    # a client allowing more than the server: the server refuses before reading the body
    small = TCPStore("127.0.0.1", 0, is_server=True, secret=SECRET, max_message_bytes=1000)
    try:
        greedy = TCPStore("127.0.0.1", small.port, secret=SECRET, max_message_bytes=10**6)
        with pytest.raises(StoreError, match="refused the message: too large"):
            greedy.set("big", b"x" * 5000)
        # a raw frame header announcing 100 MB is refused at once
        s = socket.create_connection(("127.0.0.1", small.port), timeout=5)
        s.recv(24)
        s.sendall(b"BLUSTOR1" + b"n" * 16 + struct.pack(">I", 100 * 2**20))
        assert s.recv(64).startswith(b"!REFUSED:size")
        s.close()
    finally:
        small.close()


def _raw_session(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = s.recv(24)
    cn = b"c" * 16
    s.sendall(b"BLUSTOR1" + cn)
    return s, store_mod._Session(SECRET.encode(), hello[8:], cn, is_server=False)


def test_replayed_frame_refused(server):
    s, sess = _raw_session(server.port)
    frame = sess.seal(store_mod._encode({"op": "set", "key": "r"}, b"v1"))
    s.sendall(frame)
    n = struct.unpack(">I", s.recv(4))[0]
    assert len(s.recv(n)) == n  # accepted once
    s.sendall(frame)  # same frame again: counter mismatch
    assert s.recv(64).startswith(b"!REFUSED:auth")
    s.close()
    s2, _ = _raw_session(server.port)  # on a new connection the nonces differ
    s2.sendall(frame)
    assert s2.recv(64).startswith(b"!REFUSED:auth")
    s2.close()


def test_no_pickle_values_are_opaque_bytes(server):
    assert "pickle" not in inspect.getsource(store_mod).replace("no pickle", "").replace("NO pickle", "")
    c = client(server)
    with pytest.raises(TypeError, match="no pickle"):
        c.set("obj", {"a": 1})
    blob = pickle.dumps({"evil": 1})
    c.set("p", blob)
    assert c.get("p") == blob  # stored and returned verbatim, never unpickled
    c.set("j", json.dumps({"a": [1, 2]}))
    assert json.loads(c.get("j")) == {"a": [1, 2]}


def test_binds_loopback_and_releases_port():
    s = TCPStore(port=0, is_server=True, secret=SECRET)
    assert s._server.sock.getsockname()[0] == "127.0.0.1"
    port = s.port
    client_ = TCPStore("127.0.0.1", port, secret=SECRET)
    client_.set("k", "v")
    s.close()
    s2 = TCPStore(port=port, is_server=True, secret=SECRET)  # rebinding right away works
    assert s2.port == port
    s2.close()
    client_.close()


def test_missing_secret_and_unreachable(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_STORE_SECRET", raising=False)
    with pytest.raises(StoreError, match="BLUTRAIN_STORE_SECRET"):
        TCPStore("127.0.0.1", 1234)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    c = TCPStore("127.0.0.1", port, secret=SECRET, timeout=0.3)
    with pytest.raises(StoreTimeout, match="unreachable after 0.3s"):
        c.set("k", "v")


def test_malformed_authenticated_requests_get_errors_not_crashes(server):
    c = client(server)
    with pytest.raises(StoreError, match="unknown store op 'explode'"):
        c._raise(c._request({"op": "explode"})[0])
    with pytest.raises(StoreError, match="key must be a non-empty string"):
        c._raise(c._request({"op": "set", "key": 5})[0])
    with pytest.raises(StoreError, match="bad 'add' request"):
        c._raise(c._request({"op": "add", "key": "k", "delta": "x"})[0])
    c.set("still", "alive")
    assert c.get("still") == b"alive"
