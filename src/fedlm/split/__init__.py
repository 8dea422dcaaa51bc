"""Federated split learning (FedBERT, FL-GLM): clients train the model's bottom and top, a server the trunk.

The boundary, bottom up:

* ``wire``: named tensors <-> bytes (no pickle), precision casts;
* ``trunk``: the server's :class:`~fedlm.split.trunk.TrunkBackend` and the handling of one message;
  ``trunk_batching``: the client-batch trunk (FL-GLM);
* ``transport``: the client's side of the boundary, in process; ``grpc``: the same over gRPC + TLS
  (server, client, loopback); ``certs``: throwaway TLS material for loopback runs and tests;
* ``client``: a client's local training through a transport (alone, in lockstep, or on its own machine).

The protocol, each of the config's ``split`` choices an object with one job:

* ``parts``: who owns which parameters, and the client-part policies (share, average, average_bottom, local);
* ``modes``: the trunk modes (sequential, parallel, client_batch) and the one trunk factory;
* ``optimizer_state``: reset or carry optimizer state between turns;
* ``turns``: where the clients run (this process, or other machines through Flower);
* ``executor``: :class:`~fedlm.split.executor.SplitExecutor`, the round engine's executor coordinating them.
"""
