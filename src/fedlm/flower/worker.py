"""A node's long-lived trainer: keeps the prepared experiment between Flower messages.

Started by the node's first ``train`` message (``fedlm.flower.nodeapp``), it listens on a Unix socket in a
directory only this user can enter, accepts only peers that know its key (``multiprocessing``'s HMAC
handshake), and answers each job with ``ClientRuntime.answer``, the code the in-process ClientApp runs. The
prepared data and model stay cached while the experiment and data directory stay the same. It exits after
``--idle-s`` seconds without a job.

    python -m fedlm.flower.worker --socket PATH --key PATH [--idle-s 900] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

from fedlm.federation.client_round import failure_reason
from fedlm.flower.client import ClientRuntime
from fedlm.flower.nodeapp import pack, unpack

log = logging.getLogger("fedlm")


class Worker:
    """Serves jobs one at a time; ``last_job`` lets the idle watch end the process."""

    def __init__(self, runtime: ClientRuntime | None = None) -> None:
        self.runtime = runtime or ClientRuntime()
        self.last_job = time.monotonic()
        self.busy = threading.Lock()

    def handle(self, connection: Connection) -> None:
        request = connection.recv()
        if request.get("status"):  # who is serving, how often it prepared an experiment, on how many threads
            connection.send({"pid": os.getpid(), "prepares": self.runtime.prepares,
                             "threads": torch.get_num_threads()})
            return
        started = time.monotonic()
        with self.busy:
            try:
                context = Context(run_id=0, node_id=0, node_config=request["node_config"], state=RecordDict(),
                                  run_config=request["run_config"])
                content = self.runtime.answer(unpack(request["content"]), context)
                answer = {"ok": True, "content": pack(content)}
            except Exception as exc:  # the client failed; the worker stays up for the next job
                log.debug("client training failed", exc_info=True)
                answer = {"ok": False, "reason": failure_reason(exc)}
            finally:
                self.last_job = time.monotonic()
        log.info("job answered in %.2fs (%s); %d preparations so far", self.last_job - started,
                 "ok" if answer["ok"] else answer["reason"], self.runtime.prepares)
        connection.send(answer)

    def serve(self, socket_path: Path, key: bytes, idle_s: float, parent_pid: int | None = None) -> None:
        socket_path.unlink(missing_ok=True)
        with Listener(str(socket_path), family="AF_UNIX", authkey=key) as listener:
            os.chmod(socket_path, 0o600)
            threading.Thread(target=self._exit_when_idle, args=(socket_path, idle_s, parent_pid),
                             daemon=True).start()
            while True:
                try:
                    connection = listener.accept()
                except OSError:  # a peer without the key, or one that hung up during the handshake
                    continue
                with connection:
                    try:
                        self.handle(connection)
                    except (EOFError, OSError):
                        log.warning("a ClientApp hung up before its answer")

    def _exit_when_idle(self, socket_path: Path, idle_s: float, parent_pid: int | None) -> None:
        """End the process after ``idle_s`` without a job, or once ``parent_pid`` (the SuperNode side) is gone."""
        while True:
            time.sleep(min(idle_s, 2.0))
            idle = time.monotonic() - self.last_job > idle_s
            if (idle or not _alive(parent_pid)) and self.busy.acquire(blocking=not idle):
                socket_path.unlink(missing_ok=True)
                os._exit(0)  # the accept loop holds no state worth unwinding


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--key", required=True, type=Path)
    parser.add_argument("--idle-s", type=float, default=900.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit once this process is gone")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own, every core)")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Worker().serve(args.socket, args.key.read_bytes(), args.idle_s, args.parent_pid)


if __name__ == "__main__":
    main()
