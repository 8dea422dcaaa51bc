"""The ServerApp's own gRPC service: a split run's trunk and the parameter relay, and how nodes reach it.

Its TLS files and client tokens come from the run config (``trunk-*`` keys); each job tells its node where
to dial and which CA to trust (:meth:`TrunkService.extra`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ConfigRecordValues, Context, UserConfigValue

from fedlm.errors import UserError
from fedlm.flower.messages import TRUNK_ADDRESS, TRUNK_CA
from fedlm.flower.run_config import setting
from fedlm.split.grpc_server import load_tokens


@dataclass(frozen=True)
class TrunkService:
    """How the ServerApp serves its own gRPC service, a split run's trunk and the parameter relay (run config
    keys ``trunk-*``): TLS is required, every client needs its token, and ``client_ca`` (optional) demands
    client certificates too."""

    listen: str
    address: str | None  # what nodes dial; None: this machine's name and the port it got
    cert: bytes
    key: bytes
    ca: bytes  # sent to the nodes so they can verify ``cert``
    tokens: dict[str, str]
    client_ca: bytes | None = None

    @classmethod
    def from_settings(cls, context: Context, defaults: Mapping[str, UserConfigValue]) -> TrunkService:
        def read(key: str, required: bool = True) -> bytes | None:
            value = setting(context, key, defaults)
            if value is None:
                if required:
                    raise UserError(f"the ServerApp serves its trunk / parameter relay over TLS: set the run "
                                    f"config key '{key}' (a PEM file), or relay=false for a FedAvg-family run")
                return None
            path = Path(str(value))
            if not path.is_file():
                raise UserError(f"run config {key}: file not found: {path}")
            return path.read_bytes()

        tokens = setting(context, "trunk-tokens", defaults)
        if tokens is None:
            raise UserError("the ServerApp's trunk / parameter relay needs client tokens: set the run config key "
                            "'trunk-tokens' (a YAML file of client id -> token)")
        cert, key = read("trunk-cert"), read("trunk-key")
        address = setting(context, "trunk-address", defaults)
        return cls(str(setting(context, "trunk-listen", defaults, "[::]:9100")),
                   None if address is None else str(address), cert, key, read("trunk-ca", False) or cert,
                   load_tokens(str(tokens)), read("trunk-client-ca", False))

    def extra(self, port: int) -> dict[str, ConfigRecordValues]:
        """What each job tells its node about the service: the address to dial (``address``, else this
        machine's name, or the loopback name it listens on, and the bound ``port``) and the CA's PEM."""
        host = self.listen.rsplit(":", 1)[0]
        local = host if host in ("localhost", "127.0.0.1", "[::1]") else socket.getfqdn()
        return {TRUNK_ADDRESS: self.address or f"{local}:{port}", TRUNK_CA: self.ca.decode()}
