"""fedlm across machines through Flower: the simulator's round engine as a Flower ServerApp and ClientApp.

``messages`` is the schema both sides speak (jobs and reports as Flower records), ``server`` the ServerApp
(the Flower executor, its secure variant, the split-learning trunk service), ``nodes`` which node serves
which client, ``secagg`` / ``secagg_mod`` the glue to Flower's SecAgg+ (server / node side), ``nodeapp``
the light ClientApp a SuperNode loads, ``worker`` the node's long-lived trainer it hands jobs to, ``client``
the training itself (also an in-process ClientApp), and ``localdeploy`` a deployment on one machine as
subprocesses. How to deploy them: ``deploy/flower/README.md``.
"""
