"""Control messages: workers report to the supervisor (ready, heartbeats, why they failed); the
supervisor tells the detokenizer, and through it every client, that a worker died or is back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.codec import message

# ---------------------------------------------------------------------------------------------
# supervisor -> detokenizer -> every client


NOTICE_DIED = "died"  # the worker exited (or was killed for silence); the supervisor restarts it
NOTICE_READY = "ready"  # its replacement reported ready


@message
@dataclass(slots=True)
class ClusterNotice:
    """A worker died or came back. The supervisor sends it to the detokenizer, which ends what
    it can itself (the engine died: every request it holds) and forwards one to each client with
    ``alive_ids`` set to that client's requests it knows are in the engine, so the client can end
    with an error exactly the requests that died with the worker. With several engine replicas
    it goes to the tokenizer workers too (a dead replica is out of their rotation until its
    "ready"), and one replica's death ends only its requests that had produced tokens: the
    detokenizer sets ``resend_unstarted``, and the client sends again every open request that
    is not in ``alive_ids`` and has produced nothing (as for a dead tokenizer worker)."""

    KIND = "notice"
    event: str
    role: str
    index: int
    pid: int = 0
    detail: str = ""  # e.g. "exited with code -9"
    alive_ids: list[str] = field(default_factory=list)
    resend_unstarted: bool = False


# ---------------------------------------------------------------------------------------------
# workers -> supervisor


@message
@dataclass(slots=True)
class WorkerReady:
    KIND = "ready"
    role: str
    index: int
    pid: int
    addresses: list[str] = field(default_factory=list)
    # The engine reports what it resolved from the model, so the supervisor can hand it to the
    # tokenizers (context-length checks) and the detokenizer (the ClientWelcome).
    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0


@message
@dataclass(slots=True)
class Heartbeat:
    KIND = "heartbeat"
    role: str
    index: int
    pid: int
    t: float
    stats: dict[str, float] = field(default_factory=dict)
    # Before its WorkerReady: the long start-up work it is alive in (e.g. building our int4
    # kernel), which the supervisor shows once; its start timeout counts silence, not this work
    doing: str = ""


# A worker's exit code when it refused to start for a reason its WorkerFailed names (a model it
# cannot serve, ...): starting it again would fail the same way, so the supervisor does not.
EXIT_STARTUP_REFUSED = 2


@message
@dataclass(slots=True)
class WorkerFailed:
    """A worker's last words, sent just before it exits: the one-line reason it stopped, so the
    supervisor can end a launch at once with it instead of a bare exit code. ``refused``: it
    refused to start (and exits with EXIT_STARTUP_REFUSED); else it crashed."""

    KIND = "failed"
    role: str
    index: int
    pid: int
    reason: str
    refused: bool = True
