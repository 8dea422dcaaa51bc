"""The ClientApp a SuperNode loads: light, and hands training to the node's long-lived worker.

A SuperNode (``--isolation subprocess``, Flower's default) starts a fresh ClientApp process for every
message. Importing fedlm's training stack and preparing the experiment (data, tokenizer, model) in each of
them made a deployed round 10-100x slower than the simulator's. This app imports only Flower and answers
``query`` itself; a ``train`` message goes, over a Unix socket, to a worker process on the same machine
(``fedlm.flower.worker``) that keeps the prepared experiment between messages (keyed by the experiment and
the data directory, one worker per partition id and data directory). The first message starts the worker;
it exits after ``worker-idle-s`` seconds without a job, or soon after the process that started the
ClientApp (the SuperNode's) is gone. Node config ``worker=false`` trains in the ClientApp
process instead (``fedlm.flower.client``), as before.

Flower's SecAgg+ mod runs here, around the worker's answer (``fedlm.flower.secagg_mod``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from fedlm.flower.run_config import truthy
from fedlm.flower.secagg_mod import secure_aggregation_mod

PARTITION_KEY = "partition-id"
DEFAULT_IDLE_S = 900.0
START_WAIT_S = 600.0  # a worker's first start imports torch and transformers: slow on a busy machine
Packed = tuple[str, dict[str, bytes]]  # a Flower object as its root id and deflated contents


def pack(record: RecordDict) -> Packed:
    """A RecordDict in Flower's own wire format (the bytes a SuperLink stores), for the worker socket."""
    return record.object_id, {oid: obj.deflate() for oid, obj in get_all_nested_objects(record).items()}


def unpack(packed: Packed) -> RecordDict:
    root, contents = packed
    return inflate_object_from_contents(root, contents)


def runtime_dir() -> Path:
    """A directory only this user can enter, for the workers' sockets, keys and logs."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    folder = Path(base) / f"fedlm-nodes-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder} must belong to this user with mode 0700")
    return folder


def worker_paths(partition: int, data_dir: str) -> tuple[Path, Path]:
    """The socket and key file of the worker for one partition id and data directory."""
    tag = hashlib.sha256(f"{partition}\0{Path(data_dir).resolve()}".encode()).hexdigest()[:12]
    folder = runtime_dir()  # a socket path has at most 107 bytes
    return folder / f"{partition}-{tag}.sock", folder / f"{partition}-{tag}.key"


def data_dir_of(context: Context) -> str:
    """Node config first (each machine has its own paths), then the run config."""
    return str(context.node_config.get("data-dir") or context.run_config.get("data-dir") or ".")


class WorkerLink:
    """This node's connection to its worker, starting the worker when none answers."""

    def __init__(self, socket_path: Path, key_path: Path, idle_s: float = DEFAULT_IDLE_S,
                 threads: int | None = None) -> None:
        self.socket_path, self.key_path, self.idle_s, self.threads = socket_path, key_path, idle_s, threads

    def connect(self) -> Connection:
        connection = self._try()
        if connection is not None:
            return connection
        with open(self.socket_path.with_suffix(".lock"), "w") as lock:  # one ClientApp starts it
            fcntl.flock(lock, fcntl.LOCK_EX)
            connection = self._try()
            if connection is None:
                process = self._start()
                connection = self._wait(process)
        return connection

    def _try(self) -> Connection | None:
        if not (self.socket_path.exists() and self.key_path.exists()):
            return None
        try:
            return Client(str(self.socket_path), family="AF_UNIX", authkey=self.key_path.read_bytes())
        except (OSError, EOFError):  # no listener (a stale socket), or a worker dying under the handshake
            return None

    def _start(self) -> subprocess.Popen:
        self.socket_path.unlink(missing_ok=True)
        self.key_path.unlink(missing_ok=True)
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(32))
        command = [sys.executable, "-m", "fedlm.flower.worker", "--socket", str(self.socket_path),
                   "--key", str(self.key_path), "--idle-s", str(self.idle_s), "--parent-pid", str(os.getppid())]
        if self.threads is not None:
            command += ["--threads", str(self.threads)]
        with open(self.socket_path.with_suffix(".log"), "ab") as log:  # the child keeps its own copy
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)

    def _wait(self, process: subprocess.Popen) -> Connection:
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            connection = self._try()
            if connection is not None:
                return connection
            if process.poll() is not None:
                raise RuntimeError(f"the node's worker exited with status {process.returncode}; see "
                                   f"{self.socket_path.with_suffix('.log')}")
            time.sleep(0.2)
        raise RuntimeError(f"the node's worker did not start within {START_WAIT_S:.0f}s")


def ask_worker(link: WorkerLink, content: RecordDict, context: Context) -> RecordDict | Error:
    """One job to the worker: the reply content, or the client's failure as a Flower error."""
    request: dict[str, Any] = {"content": pack(content), "node_config": dict(context.node_config),
                               "run_config": dict(context.run_config)}
    with link.connect() as connection:
        connection.send(request)
        try:
            answer = connection.recv()
        except (EOFError, OSError):
            return Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                         "exception: the node's worker stopped during the job (killed?); the next job restarts it")
    if answer["ok"]:
        return unpack(answer["content"])
    return Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, answer["reason"])


def worker_status(link: WorkerLink) -> dict[str, int]:
    """The running worker's pid, how many times it prepared an experiment (its cache's hits show here) and
    its torch threads."""
    with link.connect() as connection:
        connection.send({"status": True})
        return connection.recv()


def query(msg: Message, context: Context) -> Message:
    value = context.node_config.get(PARTITION_KEY)
    if value is None:
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "this SuperNode has no partition-id: start "
                             "it with --node-config 'partition-id=<i>'"), reply_to=msg)
    return Message(RecordDict({"node": ConfigRecord({PARTITION_KEY: int(value)})}), reply_to=msg)


def train(msg: Message, context: Context) -> Message:
    if not truthy(context.node_config.get("worker", True)):
        from fedlm.flower.client import in_process_runtime  # the heavy stack, only on request

        return in_process_runtime.train(msg, context)
    partition = context.node_config.get(PARTITION_KEY)
    if partition is None:
        return query(msg, context)  # the same one-line refusal
    socket_path, key_path = worker_paths(int(partition), data_dir_of(context))
    idle_s = float(context.node_config.get("worker-idle-s", DEFAULT_IDLE_S))
    threads = context.node_config.get("threads")
    if threads is not None and (not str(threads).isdigit() or int(threads) < 1):
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"node config threads={threads!r} is not a "
                             "positive integer: start the SuperNode with --node-config 'threads=<n>'"), reply_to=msg)
    link = WorkerLink(socket_path, key_path, idle_s, None if threads is None else int(threads))
    return Message(ask_worker(link, msg.content, context), reply_to=msg)


def build_node_app() -> ClientApp:
    app = ClientApp()
    app.query()(query)
    app.train(mods=[secure_aggregation_mod])(train)
    return app


client_app = build_node_app()
