"""The data layer: ``sources`` loads named datasets and local files, ``partition`` splits a dataset among
clients, ``partition_stats`` and ``partition_plots`` describe a partition, ``embeddings`` gives the sentence
vectors the clustered partition needs.  It depends on ``fedlm.config`` and ``fedlm.errors`` only."""
