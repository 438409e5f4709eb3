"""What every command shares: its errors (one line, status 2), the parser that raises them, the argparse types
that refuse a bad value while parsing, and the checks of an output path made before the work starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ..units import parse_size

__all__ = [
    "CLIError",
    "Parser",
    "Subparsers",
    "UsageError",
    "created",
    "int_at_least",
    "output_file",
    "output_folder",
    "seconds_at_least_0",
    "size",
    "sizes",
]

Subparsers = argparse._SubParsersAction
"""What `add_subparsers` returns: each command module's `register` adds its commands to it."""


class CLIError(Exception):
    """A command-line argument that cannot be used, with what to pass instead."""


class UsageError(CLIError):
    """An argument the parser refused; `prog` is the (sub)command that refused it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{message} (see {prog} --help)")
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """Argument errors reach `main` as exceptions, to be printed in one line like the commands' own
    (argparse would print the usage first and exit)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, refused while parsing, before any work."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def seconds_at_least_0(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def size(text: str) -> int:
    """An argparse type: one positive size such as 8K, 32M or 1000."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a size >= 1, got {text!r}")
    return value


def sizes(text: str) -> list[int]:
    """An argparse type: comma-separated positive sizes (256K,512K,1M)."""
    found = [size(t) for t in text.split(",") if t.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes such as 256K,1M, got {text!r}")
    return found


def output_file(path: str, option: str) -> Path:
    """Check a file the command writes before the work starts, so that a long run does not fail at its
    end: not an existing directory, not a read-only file, and a folder that exists or can be created."""
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"{option} {path} is a directory; give a file path")
    if target.exists() and not os.access(target, os.W_OK):
        raise CLIError(f"{option} {path} exists and is not writable")
    output_folder(target.parent, option, path)
    return target


def output_folder(folder: Path, option: str, path: str) -> None:
    """Check that `folder`, where `option` writes `path`, exists or can be created: its nearest existing
    ancestor is a writable directory. Nothing is created yet (`created`), so a refused run leaves no trace."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise CLIError(f"cannot write {option} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"cannot write {option} {path}: the folder {existing} is not writable")


def created(path: Path) -> Path:
    """`path`, with its missing parent folders created (checked by `output_file` before the work)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
