"""The ``tokencake`` command line.

Each command group lives in its own private module exposing ``register(subparsers)``; that
function adds its sub-commands and sets ``func(args) -> int`` on each parser. Modules are
imported lazily-tolerant so a partial install (no vLLM) still gives ``tokencake --version``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokencake._version import __version__

#: Command modules, in help order. Each must define ``register(subparsers) -> None``.
_COMMAND_MODULES = (
    "tokencake.cli._apps",  # apps, run, graph
    "tokencake.cli._serve",  # serve, stop, model
    "tokencake.cli._bench",  # bench
    "tokencake.cli._sim",  # sim
)


class CLIError(Exception):
    """An expected failure: printed as one line ``tokencake: error: ...``, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokencake",
        description="Agent SDK + vLLM KV offload/prefetch extension.",
    )
    parser.add_argument("--version", action="version", version=f"tokencake {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return int(func(args) or 0)
    except CLIError as exc:
        print(f"tokencake: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokencake: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
