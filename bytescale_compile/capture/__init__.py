"""Capture: the Dynamo backend, AOTAutograd wiring and our partition hook."""

from .backend import Backend

__all__ = ["Backend"]
