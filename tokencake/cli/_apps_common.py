"""What ``tokencake apps``, ``run`` and ``graph`` share: building a catalog app from the command
line (``K=V`` pairs, parameter values), the one-line ``CLIError``, and a console fit for the output.

Every import beyond the standard library is deferred, so ``tokencake --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cli_error(message: str) -> Exception:
    """The ``CLIError`` to raise: printed as one ``tokencake: error:`` line, exit code 2."""
    from tokencake.cli import CLIError

    return CLIError(message)


def parse_pairs(items: Sequence[str], what: str) -> dict[str, str]:
    """``KEY=VALUE`` items as a dict (the last of a repeated key wins); ``what`` names the flag in errors."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise cli_error(f"{what} {item!r} must look like KEY=VALUE")
        out[key.strip()] = value
    return out


def param_value(text: str) -> Any:
    """A build parameter's value: int, float, bool (``true``/``false``), None (``none``/``null``) or text."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    return text


def build_app(name: str, params: dict[str, Any]) -> Any:
    """The catalog app ``name`` built with ``params``; an unknown app or a bad parameter is a CLIError."""
    from tokencake.agents import catalog

    try:
        return catalog.get_app(name, **params)
    except catalog.UnknownApp as exc:
        raise cli_error(str(exc.args[0])) from None
    except (TypeError, ValueError) as exc:
        raise cli_error(str(exc)) from None


def console_for(file: Any) -> Any:
    """A rich console writing to ``file``, plain (no escape codes, 120 columns) off a terminal."""
    from rich.console import Console

    terminal = bool(file.isatty()) if hasattr(file, "isatty") else False
    # Off a terminal: no colours, no cursor moves (even with FORCE_COLOR set), and a fixed width
    # so tables stay readable in logs and pipes.
    return Console(
        file=file,
        force_terminal=terminal,
        color_system="auto" if terminal else None,
        width=None if terminal else 120,
        highlight=False,
        soft_wrap=False,
    )


__all__ = ["build_app", "cli_error", "console_for", "param_value", "parse_pairs"]
