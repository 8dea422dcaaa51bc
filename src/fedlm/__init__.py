"""fedlm: federated and split learning for language models.

The packages are layers; each imports only from the layers below it (``lint-imports`` checks this):

    cli          the ``fedlm`` command
    flower       deployment: Flower ServerApp / ClientApp and their messages
    run          one run from a config: prepare, policy, placement (where clients run), evaluate, progress (the
                 round observer), single run, checkpoint, grid, downstream, run directory
    split        split learning: model parts and parts policies, setup (the split section resolved once), client
                 side, trunk (+ batching trunk), modes (hooks around a turn), executor (owns the turns), transports
    federation   the core: the one round engine, executors and their observer, typed round records, strategies
                 (configure, aggregate as reports arrive, account), privacy, codecs, named tensors, sharing,
                 local training, a client's round, client-state store, in-process executor
    tasks        training objectives (masked / causal LM, classification, regression)
    data, models datasets and partitions; Hugging Face models, presets, tokenizers, cutting a model
    config, metrics, errors   the typed config, scores, and the one-line user error
"""

__version__ = "0.1.0"
