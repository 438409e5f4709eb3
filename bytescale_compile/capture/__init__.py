"""Capture: the Dynamo backend, AOTAutograd wiring and our partition hook."""

from .backend import Backend, ShardingError

__all__ = ["Backend", "ShardingError"]
