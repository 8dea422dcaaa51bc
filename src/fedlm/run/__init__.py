"""One run from a config, and many under a grid.

``prepare`` builds data, partition, tokenizer, model and task; ``policy`` resolves what is global, local or
frozen; ``placement`` is where the clients run (this process, or Flower's); ``single`` drives the round engine
and saves the run; ``checkpoint`` is the typed checkpoint a run resumes from; ``evaluate`` scores global and
client models; ``progress`` shows the run (the round observer); ``grid`` expands grids and baselines and resumes
them; ``downstream`` fine-tunes a run's model; ``recorder`` writes the run directory and ``report`` its tables
and plots.
"""
