"""Hugging Face models as fedlm uses them: ``build`` (families, checkpoints, tokenizers), ``presets`` (tiny /
small / base random-init configs), ``tokenizers`` (trained on a run's text), ``device`` (where and in what
precision a model computes), ``heads`` (task heads on hidden states) and ``cut`` (a model viewed as client
bottom / server trunk / client top, for split learning)."""
