"""Federated split learning (FedBERT, FL-GLM): clients train the model's bottom and top, a server the trunk.

The boundary, bottom up:

* ``wire``: named tensors <-> bytes (no pickle), precision casts;
* ``trunk``: the server's :class:`~fedlm.split.trunk.TrunkBackend` and the handling of one message;
  ``trunk_batching``: the client-batch trunk (FL-GLM);
* ``transport``: the client's side of the boundary, in process; over gRPC + TLS, ``envelope`` (the messages),
  ``grpc_server`` (the trunk served) and ``grpc_client`` (a client's session, the simulator's loopback);
  ``certs``: throwaway TLS material for loopback runs and tests;
* ``client``: a client's local training through a transport (alone, in lockstep, or on its own machine).

The protocol, each of the config's ``split`` choices an object with one job:

* ``parts``: who owns which parameters, and the parts policies (share, average, average_bottom, local);
* ``modes``: the trunk modes (sequential, parallel, client_batch) and the one trunk factory;
* ``optimizer_state``: reset or carry optimizer state between turns;
* ``turns``: where the clients run (this process, or other machines through Flower);
* ``setup``: the ``split`` section resolved once per run: each choice's class, the model cut and its parts;
* ``executor``: :class:`~fedlm.split.executor.SplitExecutor`, the round engine's executor, which runs the turns
  and calls the mode's, parts policy's and optimizer state's hooks around each.
"""
