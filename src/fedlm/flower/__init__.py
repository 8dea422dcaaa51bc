"""fedlm across machines through Flower: the simulator's round engine as a Flower ServerApp and ClientApp.

``messages`` is the schema both sides speak (jobs and reports as Flower records), ``server`` the ServerApp
(node discovery, the Flower executor, the split-learning trunk service) and ``client`` the ClientApp (a
node's training). How to deploy them: ``deploy/flower/README.md``.
"""
