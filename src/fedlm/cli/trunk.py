"""`fedlm trunk serve`: a split config's trunk as a long-lived gRPC service for split-learning clients.

The cut, the activation precision and the trunk's gradient clipping come from the config (its ``split``
section and ``train.max_grad_norm``), and the backend from the same factory the round engine uses
(:meth:`fedlm.split.modes.TrunkChoice.backend`), so a served trunk trains as the simulated one does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedlm.errors import UserError


def trunk_serve(args: argparse.Namespace) -> int:
    """Check every file and option first (cheap), then build the model as its clients do and serve its trunk."""
    from fedlm.split.grpc_server import load_tokens

    tokens = load_tokens(args.tokens_file)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UserError("--tls-cert and --tls-key go together")
    tls = (read_pem(args.tls_cert, "--tls-cert"), read_pem(args.tls_key, "--tls-key")) if args.tls_cert else None
    if tls is None and not args.insecure:
        raise UserError("trunk serve needs --tls-cert and --tls-key (or --insecure on a trusted network)")
    client_ca = read_pem(args.client_ca, "--client-ca") if args.client_ca else None
    if client_ca is not None and tls is None:
        raise UserError("--client-ca needs --tls-cert and --tls-key")
    if (args.max_message_mb is not None and args.max_message_mb <= 0) or args.stream_timeout_s <= 0:
        raise UserError("--max-message-mb and --stream-timeout-s must be > 0")
    if args.max_sessions < 1 or not 1 <= args.max_sessions_per_client <= args.max_sessions:
        raise UserError(f"--max-sessions ({args.max_sessions}) must be >= 1 and --max-sessions-per-client "
                        f"({args.max_sessions_per_client}) from 1 to --max-sessions")

    from fedlm.config import load_config
    from fedlm.split.modes import TrunkChoice

    config = load_config(args.config)
    spec = config.split
    if spec is None:
        raise UserError(f"{args.config} has no split section: trunk serve takes the cut, activation_dtype and "
                        "trunk_mode from it")
    trunk = TrunkChoice.of(spec)
    if not trunk.mode.serves_alone:
        raise UserError(f"trunk serve runs one trunk that clients step in turn (split.trunk_mode: sequential); "
                        f"trunk_mode {spec.trunk_mode} needs the round engine (fedlm run, or Flower)")

    from fedlm.data.sources import resolve_data_dir
    from fedlm.federation.local_training import LocalSettings
    from fedlm.run.prepare import prepare
    from fedlm.split.grpc_server import serve_trunk
    from fedlm.split.parts import split_model

    model = prepare(config, resolve_data_dir(args.data_dir)).model.train()
    split = split_model(model, spec)
    settings = LocalSettings.from_config(config.train)
    backend = trunk.backend(split, settings, config.model.max_length)
    max_bytes = None if args.max_message_mb is None else int(args.max_message_mb * 2**20)  # None: the trunk's limits
    server = serve_trunk(backend, args.address, tokens=tokens, tls=tls, client_ca_pem=client_ca,
                         max_message_bytes=max_bytes, stream_timeout_s=args.stream_timeout_s,
                         max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client)
    clipping = "no clipping" if settings.max_grad_norm is None else f"gradient norm clipped at {settings.max_grad_norm}"
    print(f"trunk of {config.name} ({len(split.trunk.blocks)} blocks after {spec.bottom_blocks} client blocks, "
          f"activations in {spec.activation_dtype}, {clipping}) serving on port {server.port} (at most "
          f"{args.max_sessions} sessions, {args.max_sessions_per_client} per client); Ctrl-C stops")
    try:
        server.server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=5)
    return 0


def read_pem(path: str, option: str) -> bytes:
    """A PEM file's bytes; one-line UserError if it cannot be read or is not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise UserError(f"{option} {path}: {err.strerror}") from None
    if b"-----BEGIN " not in data:
        raise UserError(f"{option} {path} is not a PEM file")
    return data
