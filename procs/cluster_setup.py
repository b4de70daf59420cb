"""Turning a launcher's arguments into a ClusterConfig: the model resolved, a private run
directory, the CPU budget, a port for the HTTP frontends and CURVE keys where needed."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import zmq

from ipc.config import LOOPBACK_HOSTS, ClusterConfig
from ipc.engine_roles import engine_mode_error
from ipc.sockets import check_curve_available
from procs.local_model import check_model, check_served_name
from procs.model_store import resolve_model
from procs.thread_budget import thread_budget


def free_tcp_port(host: str) -> int:
    """A port free right now, for frontends that must all bind the same one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_config(
    model: str | os.PathLike | None = None, run_dir: str | None = None, **overrides: Any
) -> tuple[ClusterConfig, bool]:
    """A ClusterConfig with the model resolved and checked, a private run dir and the thread
    budget filled in. Returns (config, whether the run dir was created here and is ours to
    remove). A model the engine could not serve raises ModelError before anything starts."""
    check_served_name(overrides.get("served_model_name"))
    disaggregate(overrides)
    model_path = str(
        resolve_model(model if model is not None else overrides.pop("model_path", None))
    )
    if not overrides.get("engine_factory"):  # a stand-in engine may need no model at all
        check_model(model_path)
    owns = run_dir is None or not Path(run_dir).exists()  # remove only what we created
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="splitserve-")  # mode 0700
    else:
        Path(run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    with_http = overrides.get("http_port") is not None
    engine_threads, tokenizer_threads = thread_budget(
        int(overrides.get("tokenizer_workers", 1)),
        engine_threads=int(overrides.pop("engine_threads", 0) or 0),
        tokenizer_threads=int(overrides.pop("tokenizer_threads", 0) or 0),
        http_workers=int(overrides.get("http_workers", 1)) if with_http else 0,
        engines=int(overrides.get("engines", 1)),
    )
    if overrides.get("http_port") == 0:
        # One concrete port up front: several frontends share it, and a restarted one keeps it.
        overrides["http_port"] = free_tcp_port(str(overrides.get("http_host", "127.0.0.1")))
    overrides.update(curve_overrides(overrides))
    config = ClusterConfig.build(
        model_path,
        run_dir,
        engine_threads=engine_threads,
        tokenizer_threads=tokenizer_threads,
        **overrides,
    )
    return config, owns


def disaggregate(overrides: dict[str, Any]) -> None:
    """--prefill-engines P --decode-engines D: P + D engines (ValueError if that is not one
    mode: --engines N as well, or one of the two missing)."""
    prefill = int(overrides.get("prefill_engines", 0) or 0)
    decode = int(overrides.get("decode_engines", 0) or 0)
    error = engine_mode_error(int(overrides.get("engines", 1)), prefill, decode)
    if error:
        raise ValueError(error)
    if prefill or decode:
        overrides["engines"] = prefill + decode


def curve_overrides(overrides: dict[str, Any]) -> dict[str, str]:
    """A fresh CURVE server key pair when the cluster listens beyond loopback (or require_curve
    asks for CURVE anyway) and none was given; every socket of the cluster then uses it."""
    if overrides.get("curve_secret_key"):
        return {}
    beyond_loopback = (
        overrides.get("transport") == "tcp"
        and overrides.get("host", "127.0.0.1") not in LOOPBACK_HOSTS
    )
    if not (beyond_loopback or overrides.get("require_curve")):
        return {}
    check_curve_available()
    public, secret = zmq.curve_keypair()
    return {"curve_public_key": public.decode("ascii"), "curve_secret_key": secret.decode("ascii")}
