"""fedlm: federated and split learning for language models."""

__version__ = "0.1.0"
