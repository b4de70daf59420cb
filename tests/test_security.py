"""Security defaults (DESIGN.md property 7, issue 7 item 4): a private run directory and socket
files, loopback unless --listen says otherwise, ZeroMQ CURVE beyond loopback (a client without the
server's public key cannot submit), no pickle anywhere. The stand-in engine keeps these fast."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import stat
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ipc import codec
from ipc.addresses import FIXED_PORTS, PORTS_PER_ENGINE
from ipc.client import AsyncClient, Client, UnavailableError
from ipc.client.transport import tokenizer_addrs
from ipc.config import ClusterConfig
from ipc.salvage import salvage_fields
from procs.cli import build_parser, cluster_kwargs
from procs.cluster_setup import curve_overrides
from procs.launch_cluster import CURVE_PUBLIC_KEY_FILE, launch_cluster

REPO = Path(__file__).resolve().parents[1]
FAKE_ENGINE = "tests.procs.fake_engine:make"  # a stand-in engine: no model, echoes
DEADLINE_S = 30


def free_port_block(tokenizer_workers: int = 1, engines: int = 1) -> int:
    """A base port whose whole address plan (ClusterConfig.port_span ports) is free on loopback
    now."""
    rng = random.Random()
    span = FIXED_PORTS + PORTS_PER_ENGINE * engines + tokenizer_workers
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        offsets = range(span)
        try:
            socks = []
            for off in offsets:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no free block of ports")


def _wait_for(predicate, timeout_s: float = DEADLINE_S, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- files and permissions ----------------------------------------------------------------------


def test_run_dir_is_0700_and_socket_files_are_owner_only():
    with launch_cluster(None, tokenizer_workers=2, engine_factory=FAKE_ENGINE) as cluster:
        run_dir = Path(cluster.config.run_dir)
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        socks = sorted(run_dir.glob("*.sock"))
        assert {p.name for p in socks} >= {
            "client.sock",
            "engine-0.sock",
            "detokenizer.sock",
            "supervisor.sock",
            "tokenizer-0.sock",
            "tokenizer-1.sock",
        }
        for path in socks + [cluster.config.config_path]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path.name} is accessible to others: {oct(mode)}"
        assert cluster.curve_public_key is None  # ipc: the file system guards it
        with Client(cluster.client_addr) as client:
            assert client.submit("private", max_tokens=1).result(timeout=DEADLINE_S).ok
    assert not run_dir.exists()


# --- loopback by default, CURVE beyond it -------------------------------------------------------


def test_tcp_beyond_loopback_needs_curve_keys(tmp_path):
    with pytest.raises(ValueError, match="requires CURVE keys"):
        ClusterConfig.build("m", str(tmp_path), transport="tcp", host="0.0.0.0", base_port=5000)
    with pytest.raises(ValueError, match="no CURVE keys"):
        ClusterConfig.build("m", str(tmp_path), require_curve=True)
    with pytest.raises(ValueError, match="40-character"):
        ClusterConfig.build("m", str(tmp_path), curve_public_key="short", curve_secret_key="short")
    loopback = ClusterConfig.build("m", str(tmp_path), transport="tcp", base_port=5000)
    assert loopback.client_addr == "tcp://127.0.0.1:5000" and loopback.curve is None
    assert curve_overrides(dict(transport="tcp", host="127.0.0.1")) == {}


def test_listen_flag_switches_on_curve_and_keeps_internal_sockets_on_loopback(tmp_path):
    args = build_parser().parse_args(["launch", "--listen", "0.0.0.0", "--port", "5000"])
    kwargs = cluster_kwargs(args)
    assert (kwargs["transport"], kwargs["host"]) == ("tcp", "0.0.0.0")
    kwargs.update(curve_overrides(kwargs), engine_threads=1, tokenizer_threads=1)
    assert len(kwargs["curve_public_key"]) == len(kwargs["curve_secret_key"]) == 40
    config = ClusterConfig.build("m", str(tmp_path), **kwargs)
    assert config.curve is not None
    assert config.client_addr == "tcp://0.0.0.0:5000"
    assert config.tokenizer_addr(0) == "tcp://0.0.0.0:5006"
    for internal in (config.engine_addr(0), config.detokenizer_addr, config.supervisor_addr):
        assert internal.startswith("tcp://127.0.0.1:"), internal
    # A client that reached the cluster at a real address dials the tokenizers there too.
    assert tokenizer_addrs("tcp://10.1.2.3:5000", config.tokenizer_addrs) == ["tcp://10.1.2.3:5006"]
    with pytest.raises(SystemExit, match="--port"):
        cluster_kwargs(build_parser().parse_args(["launch", "--listen", "0.0.0.0"]))
    assert cluster_kwargs(build_parser().parse_args(["launch"]))["transport"] == "ipc"


@pytest.fixture(scope="module")
def curve_cluster():
    # The test can only listen on loopback, so CURVE is forced on as --listen would do.
    with launch_cluster(
        None,
        transport="tcp",
        host="127.0.0.1",
        base_port=free_port_block(1),
        require_curve=True,
        engine_factory=FAKE_ENGINE,
    ) as c:
        yield c


def test_curve_public_key_is_published(curve_cluster):
    key = curve_cluster.curve_public_key
    assert key and len(key) == 40
    key_file = Path(curve_cluster.config.run_dir) / CURVE_PUBLIC_KEY_FILE
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_client_with_the_key_is_served(curve_cluster):
    with Client(
        curve_cluster.client_addr,
        server_public_key=curve_cluster.curve_public_key,
        deadline_s=DEADLINE_S,
    ) as client:
        result = client.submit("secret handshake", max_tokens=3).result(timeout=DEADLINE_S)
        assert (result.text, result.finish_reason) == ("secret handshake", "length")

    async def with_async_client():
        async with AsyncClient(
            curve_cluster.client_addr, server_public_key=curve_cluster.curve_public_key
        ) as client:
            return await client.submit("async secret", max_tokens=2).result(timeout=DEADLINE_S)

    assert asyncio.run(with_async_client()).text == "async secret"


@pytest.mark.parametrize("key", [None, "wrong"])
def test_client_without_the_key_cannot_connect(curve_cluster, key):
    if key == "wrong":
        key = zmq.curve_keypair()[0]  # a well-formed key of some other server
    with pytest.raises(UnavailableError):
        Client(curve_cluster.client_addr, server_public_key=key, connect_timeout_s=1.0)


def _served(cluster) -> tuple[float, float]:
    tok, eng = cluster.worker_stats("tokenizer"), cluster.worker_stats("engine")
    return tok.get("served", 0) + tok.get("rejected", 0), eng.get("received", 0)


def test_plain_sockets_cannot_submit_or_reach_internal_sockets(curve_cluster):
    config = curve_cluster.config
    key = curve_cluster.curve_public_key
    with Client(config.client_addr, server_public_key=key, deadline_s=DEADLINE_S) as client:
        client.submit("warm up", max_tokens=1).result(timeout=DEADLINE_S)
        time.sleep(3 * config.heartbeat_interval_s)  # heartbeats sent after the warm-up ended
        before = _served(curve_cluster)
        assert before[0] >= 1 and before[1] >= 1
        # A plain (no CURVE) peer sends a well-formed request, attributed to the keyed client so
        # that any leak would show up there, to the tokenizer and straight to the engine.
        intruder_id = f"{client._core.client_id.decode()}:intruder"
        submit = msgpack.packb(
            {
                "kind": "submit",
                "request_id": intruder_id,
                "client_id": client._core.client_id,
                "sampling": {"max_tokens": 1},
                "prompt": "let me in",
            }
        )
        tokenized = msgpack.packb(
            {
                "kind": "tokenized",
                "request_id": intruder_id,
                "token_ids": b"\x05\x00\x00\x00",
                "sampling": {"max_tokens": 1},
                "meta": {
                    "request_id": intruder_id,
                    "client_id": client._core.client_id,
                    "prompt_tokens": 1,
                },
            }
        )
        ctx = zmq.Context()
        try:
            for addr, frame in (
                (config.tokenizer_addr(0), submit),
                (config.engine_addr(0), tokenized),
            ):
                push = ctx.socket(zmq.PUSH)
                push.connect(addr)
                push.send(frame, zmq.NOBLOCK)  # queued: the handshake never completes
                push.close(linger=500)
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(config.client_addr)
            dealer.send(msgpack.packb({"kind": "hello", "client_id": b"plain"}))
            assert not dealer.poll(1000), "a plain DEALER got an answer from a CURVE ROUTER"
            dealer.close(linger=0)
        finally:
            ctx.term()
        # The keyed client goes on being served; nothing of the intruder reached a worker.
        result = client.submit("after the intruder", max_tokens=2).result(timeout=DEADLINE_S)
        assert result.text == "after the"
        expected = (before[0] + 1, before[1] + 1)
        _wait_for(lambda: _served(curve_cluster) >= expected, what="the keyed request's stats")
        time.sleep(2 * config.heartbeat_interval_s)
        assert _served(curve_cluster) == expected
        assert f"{intruder_id}" not in client._core.records


# --- no pickle, bounded decoding ----------------------------------------------------------------


def test_no_pickle_anywhere():
    pattern = re.compile(
        r"\bpickle\b|\bcPickle\b|\bdill\b|recv_pyobj|send_pyobj|torch\.load\(|"
        r"\bmarshal\.loads?\b|yaml\.load\("
    )
    offenders = []
    for top in (
        "ipc",
        "procs",
        "runtime",
        "tokenizer_worker",
        "detok_worker",
        "engine_worker",
        "scripts",
    ):
        for path in (REPO / top).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if pattern.search(code) and "Nothing is ever pickled" not in line:
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    "frame",
    [
        b"\xdb\xff\xff\xff\xff" + b"x" * 16,  # a str claiming 4 GiB
        b"\xc6\xff\xff\xff\xff" + b"x" * 16,  # a bin claiming 4 GiB
        b"\xdd\xff\xff\xff\xff" + b"\x00" * 16,  # an array claiming 2**32-1 items
        b"\xdf\xff\xff\xff\xff" + b"\x00" * 16,  # a map claiming 2**32-1 entries
        b"\xd6\xff\x00\x00\x00\x00",  # an ext (timestamp): never accepted
    ],
    ids=["str", "bin", "array", "map", "ext"],
)
def test_decoding_refuses_huge_declared_lengths(frame):
    with pytest.raises(codec.DecodeError):
        codec.unpack_frame(frame)
    assert salvage_fields(frame, "request_id") == {}


def test_decoding_limits_hold_at_their_values(monkeypatch):
    monkeypatch.setattr(codec, "MAX_STR_BYTES", 8)
    monkeypatch.setattr(codec, "MAX_ARRAY_LEN", 4)
    monkeypatch.setattr(codec, "MAX_MAP_LEN", 2)
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 64)
    assert codec.unpack_frame(msgpack.packb("x" * 8)) == "x" * 8
    for too_big in ("x" * 9, [0] * 5, {"a": 1, "b": 2, "c": 3}, b"y" * 65):
        with pytest.raises(codec.DecodeError):
            codec.unpack_frame(msgpack.packb(too_big))


def test_supervised_http_frontend_works_under_curve():
    """The OpenAI frontend is a client of the cluster like any other: under CURVE it gets the
    public key from the supervisor (its handshake and its heartbeats would fail without it)."""
    import json
    import urllib.request

    with launch_cluster(
        None,
        transport="tcp",
        host="127.0.0.1",
        base_port=free_port_block(1),
        require_curve=True,
        http_port=0,
        engine_factory=FAKE_ENGINE,
    ) as cluster:
        assert cluster.http_url
        body = json.dumps(
            {"model": cluster.config.model_name, "prompt": "over curve", "max_tokens": 2}
        ).encode()
        request = urllib.request.Request(
            f"{cluster.http_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as reply:
            answer = json.loads(reply.read())
        assert answer["choices"][0]["text"] == "over curve"
        _wait_for(lambda: cluster.worker_stats("http"), what="the frontend's heartbeats")
