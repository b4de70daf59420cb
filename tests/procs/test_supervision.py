"""The supervisor's policy and watcher on their own: real child processes (short Python
programs), no cluster around them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from ipc.config import ClusterConfig
from ipc.messages import NOTICE_DIED, NOTICE_READY, ClusterNotice, WorkerReady
from procs.children import Child
from procs.supervision import ClusterStartError, Roster, SupervisionPolicy, Watcher


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _ready(child: Child) -> WorkerReady:
    return WorkerReady(role=child.role, index=child.index, pid=child.popen.pid, addresses=[])


@pytest.fixture
def config(tmp_path):
    def make(**knobs) -> ClusterConfig:
        return ClusterConfig.build(str(tmp_path), str(tmp_path), **knobs)

    return make


@pytest.fixture
def children():
    made: list[Child] = []

    def make(role: str, index: int, code: str = "import time; time.sleep(30)") -> Child:
        made.append(Child(role, index, _proc(code), last_seen=time.monotonic()))
        return made[-1]

    yield make
    for c in made:
        if c.popen.poll() is None:
            c.popen.kill()
        c.popen.wait()


def test_restarts_each_slot_up_to_max_restarts_then_says_why_it_stops(config, children):
    policy = SupervisionPolicy(config(max_restarts=2))
    a, b = children("tokenizer", 0), children("tokenizer", 1)
    assert policy.after_death(a) is None
    assert policy.after_death(a) is None
    assert "restarted 2 times" in (policy.after_death(a) or "")
    assert policy.after_death(b) is None  # slots count apart
    assert policy.restarts == {"tokenizer[0]": 2, "tokenizer[1]": 1}
    assert policy.after_death(b) is None
    stop_always = SupervisionPolicy(config(restart_policy="shutdown"))
    assert stop_always.after_death(a) == "restart_policy is shutdown"


def test_only_ready_children_past_the_hang_timeout_are_hung_and_only_once(config, children):
    policy = SupervisionPolicy(config(hang_timeout_s=5.0))
    loading, quiet, talking = children("engine", 0), children("tokenizer", 0), children("http", 0)
    now = time.monotonic()
    for c in (loading, quiet, talking):
        c.last_seen = now - 10
    quiet.ready, talking.ready = _ready(quiet), _ready(talking)
    talking.last_seen = now - 1
    assert [
        (c.name, "10.0 s" in why) for c, why in policy.hung([loading, quiet, talking], now)
    ] == [("tokenizer[0]", True)]
    quiet.killed_for = "hung"
    assert policy.hung([quiet], now) == []
    assert SupervisionPolicy(config()).hung([quiet], now + 1e6) == []  # 0: never


def test_silence_is_reported_once_until_the_child_speaks_again(config, children):
    from ipc.messages import Heartbeat

    policy = SupervisionPolicy(config(heartbeat_timeout_s=2.0))
    c = children("engine", 0)
    now = time.monotonic()
    assert policy.newly_silent([c], now) == []  # no heartbeat yet: never silent
    c.last_heartbeat = Heartbeat(role="engine", index=0, pid=c.popen.pid, t=now - 3)
    assert [(x.name, round(s)) for x, s in policy.newly_silent([c], now)] == [("engine[0]", 3)]
    assert policy.newly_silent([c], now + 1) == []
    c.last_heartbeat = Heartbeat(role="engine", index=0, pid=c.popen.pid, t=now + 1)
    assert policy.newly_silent([c], now + 1) == []
    assert len(policy.newly_silent([c], now + 4)) == 1


def test_the_watcher_notifies_restarts_and_stops_when_a_slot_is_out_of_restarts(
    tmp_path, config, children
):
    cfg = config(max_restarts=1)
    ctx = zmq.Context()
    roster = Roster(ctx, cfg)
    notices: list[ClusterNotice] = []
    stopped: list[bool] = []

    def respawn(dead: Child) -> Child:
        roster.children.remove(dead)
        new = children(dead.role, dead.index)
        new.restarted = True
        roster.children.append(new)
        return new

    watcher = Watcher(
        roster, SupervisionPolicy(cfg), notices.append, respawn, lambda: stopped.append(True)
    )
    try:
        dying = children("tokenizer", 0, "raise SystemExit(3)")
        roster.children.append(dying)
        dying.popen.wait()
        watcher.check(time.monotonic())
        assert [(n.event, n.role, n.index, n.detail) for n in notices] == [
            (NOTICE_DIED, "tokenizer", 0, "exited with code 3")
        ]
        (replacement,) = roster.children
        assert replacement is not dying and replacement.restarted and not stopped
        replacement.ready = _ready(replacement)
        watcher.check(time.monotonic())
        assert notices[-1].event == NOTICE_READY and notices[-1].pid == replacement.popen.pid
        assert not replacement.restarted
        replacement.popen.kill()
        replacement.popen.wait()
        watcher.check(time.monotonic())  # out of restarts: the cluster stops, and says why
        assert stopped == [True] and notices[-1].event == NOTICE_DIED
        assert watcher.failure is not None and watcher.failure.startswith("tokenizer[0] exited")
    finally:
        roster.close()
        ctx.term()


def test_a_dead_detokenizer_is_restarted_without_a_notice(config, children):
    cfg = config()
    ctx = zmq.Context()
    roster = Roster(ctx, cfg)
    notices: list[ClusterNotice] = []
    respawned: list[Child] = []

    def respawn(dead: Child) -> None:
        respawned.append(dead)  # the cluster is stopping: nothing is started
        return None

    watcher = Watcher(roster, SupervisionPolicy(cfg), notices.append, respawn, lambda: None)
    try:
        dead = children("detokenizer", 0, "pass")
        roster.children.append(dead)
        dead.popen.wait()
        watcher.check(time.monotonic())
        assert notices == [] and respawned == [dead]  # clients see their connection drop
    finally:
        roster.close()
        ctx.term()


def test_a_child_that_refuses_to_start_ends_the_wait_with_its_reason_and_is_not_restarted(
    config, children
):
    cfg = config()
    cfg.write()
    ctx = zmq.Context()
    roster = Roster(ctx, cfg)
    try:
        refusing = children(
            "engine",
            0,
            "import sys\n"
            "from ipc.config import ClusterConfig\n"
            "from runtime.supervisor_link import send_last_words\n"
            f"config = ClusterConfig.read({str(cfg.config_path)!r})\n"
            "send_last_words(config, 'engine', 0, 'tensor x has type IQ4_NL', refused=True)\n"
            "sys.exit(2)\n",
        )
        roster.children.append(refusing)
        t0 = time.monotonic()
        with pytest.raises(ClusterStartError, match=r"^engine\[0\]: tensor x has type IQ4_NL$"):
            roster.wait_ready([refusing], timeout_s=60)
        assert time.monotonic() - t0 < 30
        refusing.popen.wait()
        assert refusing.failed is not None and refusing.failed.refused
        assert (
            SupervisionPolicy(cfg).after_death(refusing) == "it refused to start, and would again"
        )
        silent = children("tokenizer", 0, "raise SystemExit(3)")
        with pytest.raises(ClusterStartError, match=r"tokenizer\[0\]: exited with code 3"):
            roster.wait_ready([silent], timeout_s=60)  # no last words: its exit code
    finally:
        roster.close()
        ctx.term()
