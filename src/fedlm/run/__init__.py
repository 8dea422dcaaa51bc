"""One run from a config, and many under a grid.

``prepare`` builds data, partition, tokenizer, model and task; ``policy`` resolves what is global, local or
frozen; ``single`` drives the round engine and saves the run; ``evaluate`` scores global and client models;
``progress`` shows the run; ``grid`` expands grids and baselines and resumes them; ``downstream`` fine-tunes a
run's model; ``recorder`` writes the run directory and ``report`` its tables and plots.
"""
