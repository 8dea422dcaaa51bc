"""fedlm across machines through Flower: the simulator's round engine as a Flower ServerApp and ClientApp.

``messages`` is the schema both sides speak (jobs and reports as Flower records). Server side: ``app`` the
ServerApp (it calls ``run_single`` with ``placement``'s ``FlowerPlacement``, which also reads the run config's
secure aggregation / relay / dispatch choices), ``run_config`` reading run config keys, ``executor`` the
Flower executor (one message per job), ``secure_executor`` its SecAgg+ variant, ``split_clients`` split
learning's clients on the nodes, ``trunk_service`` the TLS settings of the ServerApp's own gRPC service (the
trunk, the ``relay`` of parameters), ``nodes`` which node serves which client. ``secagg`` / ``secagg_mod`` are
the glue to Flower's SecAgg+ (server / node side), ``nodeapp`` the light ClientApp a SuperNode loads,
``worker`` the node's long-lived trainer it hands jobs to, ``client`` the training itself (also an in-process
ClientApp), and ``localdeploy`` a deployment on one machine as subprocesses. How to deploy them:
``deploy/flower/README.md``.
"""
