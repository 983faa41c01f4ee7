"""GARE core: model, psi, losses and checkpoint I/O (light), plus the trainer (training.fit, imported on demand)."""

__version__ = "0.1.0"
