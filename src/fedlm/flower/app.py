"""fedlm's Flower ServerApp: the simulator's round engine, with each sampled client's job sent to a node.

There is no second round loop: the ServerApp calls ``run_single`` with a :class:`FlowerPlacement`, so
sampling, aggregation, evaluation, records, checkpoints and the run directory are the simulator's. How to
deploy: ``deploy/flower/README.md``.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, UserConfigValue
from flwr.serverapp import Grid, ServerApp

from fedlm.config import dump_config, read_yaml, validate
from fedlm.errors import UserError
from fedlm.flower.executor import DEFAULT_REPLY_GRACE_S, DEFAULT_REPLY_TIMEOUT_S
from fedlm.flower.nodes import NodeDirectory, PromptGrid
from fedlm.flower.placement import FlowerPlacement, dispatch_wanted, relay_wanted, secure_settings
from fedlm.flower.run_config import setting, truthy
from fedlm.flower.trunk_service import TrunkService
from fedlm.run.prepare import num_clients_of
from fedlm.run.recorder import slug
from fedlm.run.single import run_single

DEFAULT_NODE_WAIT_S = 300.0


def build_server_app(**defaults: UserConfigValue) -> ServerApp:
    """The ServerApp; ``defaults`` (config, data-dir, run-dir, ...) fill run config keys left empty."""
    app = ServerApp()

    @app.main()
    def main(flower_grid: Grid, context: Context) -> None:
        grid: Grid = PromptGrid(flower_grid)  # type: ignore[assignment]
        path = setting(context, "config", defaults)
        if path is None:
            raise UserError("no experiment config: set the run config key 'config' to a YAML path")
        config = validate(read_yaml(Path(str(path))))
        run_dir = setting(context, "run-dir", defaults, str(Path(config.output_dir) / slug(config.name)))
        wait_s = float(setting(context, "node-wait-s", defaults, DEFAULT_NODE_WAIT_S))
        timeout_s = float(setting(context, "reply-timeout-s", defaults, DEFAULT_REPLY_TIMEOUT_S))
        grace_s = float(setting(context, "reply-grace-s", defaults, DEFAULT_REPLY_GRACE_S))
        nodes = NodeDirectory(grid, num_clients_of(config))
        nodes.discover(wait_s)
        secure = secure_settings(context, defaults, config)
        relay = relay_wanted(context, defaults, config, secure)
        print(f"[{config.name}] parameters travel " + ("on fedlm's relay (gRPC + TLS, a token per client), beside "
                                                       "Flower's messages" if relay else "in Flower's messages"),
              flush=True)
        service = TrunkService.from_settings(context, defaults) if relay or config.split is not None else None
        dispatch = config.split is not None and dispatch_wanted(context, defaults, flower_grid)
        placement = FlowerPlacement(grid, nodes, dump_config(config), timeout_s, grace_s, secure=secure,
                                    service=service, relay=relay, dispatch=dispatch)
        resume = truthy(setting(context, "resume", defaults, False))  # a killed ServerApp, run again
        run_single(config, Path(str(setting(context, "data-dir", defaults, "."))), Path(str(run_dir)),
                   resume=resume, placement=placement)

    return app


server_app = build_server_app()
