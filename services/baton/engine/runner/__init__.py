"""Turns a scheduler step into one forward pass over a flat, unpadded batch."""

from baton.engine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
