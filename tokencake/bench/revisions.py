"""Systems whose server runs another git revision of tokencake: ``NAME@REV`` in ``--systems``.

``NAME@REV`` is system NAME whose vLLM server processes (watchdog, API server, engine core,
connector, scheduler class, tool-parser plug-in) import ``tokencake`` from git revision REV of
the checkout the running ``tokencake`` package lives in. The launcher (argv, environment), the
workload and the client stay the running code's, so ``NAME@REV`` and ``NAME`` differ only in
the code inside the server: before and after a change, measured in one run.

The revision's ``tokencake/`` directory (the package is all a server imports; the whole tree
also holds the stored benchmark data) is exported with ``git archive`` into
``<dir>/<commit>/``, once: an export is complete when its marker file exists, and never changes
afterwards, as its name is the full commit. No worktree, ref or index of the checkout changes.
The server's environment names that directory first on ``PYTHONPATH`` and sets
``PYTHONSAFEPATH=1``, since ``python -m`` would otherwise put the working directory (often a
checkout of the current code) ahead of it.

Where the launcher passes something the revision's tree cannot load, the server gets the nearest
equivalent and the results list the difference (:attr:`SourceTree.differences`): a tool-parser
plug-in module the tree lacks is replaced by the vLLM parser the plug-in's parser extends
(:data:`PLUGIN_BASE_PARSERS`), which reads the same format; without the plug-in vLLM would
refuse to start on the unknown parser name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokencake.serving.tool_calling import BUNDLED_PARSER

if TYPE_CHECKING:
    from tokencake.bench.systems import ServerConfig

#: The directory of the package a revision's server imports (all that is exported).
PACKAGE = "tokencake"
#: Written last into a finished export; an export without it is incomplete and redone.
COMPLETE_MARKER = ".complete"
#: A plug-in parser → the vLLM parser it extends (same output format), for trees without the plug-in.
PLUGIN_BASE_PARSERS: dict[str, str] = {BUNDLED_PARSER: "hermes"}
#: The API-server middleware of transparent mode (``Server(transparent=True)``, the default).
TRANSPARENT_MODULE = "tokencake.serving.transparent_asgi"
_PLUGIN_FLAG = "--tool-parser-plugin"
_PARSER_FLAG = "--tool-call-parser"


def split_name(raw: str) -> tuple[str, str | None]:
    """``"NAME@REV"`` → ``(NAME, REV)``; a name without ``@`` → ``(name, None)``."""
    name, at, rev = raw.partition("@")
    if at and not rev.strip():
        raise ValueError(f"system {raw!r}: nothing after '@' (NAME@REV: a git revision such as a commit)")
    return name, (rev.strip() if at else None)


def package_checkout() -> Path:
    """The top of the git checkout the running ``tokencake`` package lives in (ValueError if none)."""
    here = Path(__file__).resolve().parents[1]
    out = _git(here, "rev-parse", "--show-toplevel")
    if out is None:
        raise ValueError(f"NAME@REV needs the running tokencake ({here}) to be a git checkout; it is not")
    return Path(out)


def resolve_revision(rev: str, checkout: Path | None = None) -> str:
    """The full commit id of ``rev`` in ``checkout`` (default: :func:`package_checkout`)."""
    checkout = checkout or package_checkout()
    out = _git(checkout, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if not out:
        raise ValueError(f"unknown git revision {rev!r} in {checkout}")
    return out


def export_tree(commit: str, dest: Path, checkout: Path | None = None) -> Path:
    """``<dest>/<commit>``, holding the commit's ``tokencake/`` (exported now unless complete)."""
    checkout = checkout or package_checkout()
    root = dest / commit
    if (root / COMPLETE_MARKER).exists():
        return root
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}-", dir=dest))
    try:
        archive = subprocess.Popen(
            ["git", "-C", str(checkout), "archive", "--format=tar", commit, PACKAGE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert archive.stdout is not None
        untar = subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout, capture_output=True)
        archive.stdout.close()
        err = archive.stderr.read().decode(errors="replace") if archive.stderr else ""
        if archive.wait() != 0 or untar.returncode != 0:
            why = (err or untar.stderr.decode(errors="replace")).strip().splitlines()
            raise ValueError(f"cannot export {commit[:12]}'s {PACKAGE}/: {why[-1] if why else 'failed'}")
        (tmp / COMPLETE_MARKER).write_text(commit + "\n")
        if (root / COMPLETE_MARKER).exists():  # another run finished the same export meanwhile
            return root
        shutil.rmtree(root, ignore_errors=True)  # an incomplete export
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


@dataclass(frozen=True)
class SourceTree:
    """A revision's exported package, and how a server that imports it is started."""

    commit: str
    #: The directory named on ``PYTHONPATH`` (it holds ``tokencake/``).
    root: Path
    #: ``tool_call_parser`` for ``tokencake.serving.Server`` instead of the launcher's (None: the same).
    tool_call_parser: str | None = None
    #: False when the tree has no transparent-mode middleware (its server starts without it).
    transparent: bool = True
    #: What the server is started with unlike the same system of the running code, one line each.
    differences: tuple[str, ...] = ()

    def env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment entries for the server's processes: this tree first on ``PYTHONPATH``."""
        base = (os.environ if environ is None else environ).get("PYTHONPATH")
        path = str(self.root) if not base else f"{self.root}{os.pathsep}{base}"
        return {"PYTHONPATH": path, "PYTHONSAFEPATH": "1"}

    def has_module(self, dotted: str) -> bool:
        """Whether the tree holds module ``dotted`` (a file, or a package directory)."""
        path = self.root.joinpath(*dotted.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    def to_dict(self) -> dict[str, Any]:
        """The tree as a results file records it (its commit, and how its server was started)."""
        return {"commit": self.commit, "server_differences": list(self.differences)}


def prepare_source(
    commit: str, dest: Path, server: ServerConfig, *, checkout: Path | None = None
) -> SourceTree:
    """Export ``commit`` under ``dest`` and decide what its server needs beyond the launcher's flags:
    a vLLM parser in place of a tool-parser plug-in the tree lacks, and no transparent-mode
    middleware where the tree has none (each recorded as a difference)."""
    root = export_tree(commit, dest, checkout)
    probe = SourceTree(commit, root)
    parser, differences = None, []
    args = launcher_tool_args(server)
    if _PLUGIN_FLAG in args:
        plugin = args[args.index(_PLUGIN_FLAG) + 1]
        if not probe.has_module(plugin):
            wanted = args[args.index(_PARSER_FLAG) + 1] if _PARSER_FLAG in args else None
            parser = PLUGIN_BASE_PARSERS.get(wanted or "")
            if parser is None:
                raise ValueError(
                    f"commit {commit[:12]} has no {plugin} (tool-parser plug-in of {wanted!r}) and no "
                    "parser to serve in its place is known"
                )
            differences.append(
                f"{_PARSER_FLAG} {parser} without {_PLUGIN_FLAG}: commit {commit[:12]} has no {plugin}, "
                f"which registers {wanted!r} ({parser} with forced tool calls held to the schema); the "
                f"launcher gives the running code {_PLUGIN_FLAG} {plugin} {_PARSER_FLAG} {wanted}"
            )
    transparent = probe.has_module(TRANSPARENT_MODULE)
    if not transparent:
        differences.append(
            f"no transparent mode: commit {commit[:12]} has no {TRANSPARENT_MODULE} (the bench's "
            "clients send TokenCake metadata, which transparent mode passes through untouched)"
        )
    return SourceTree(
        commit, root, tool_call_parser=parser, transparent=transparent, differences=tuple(differences)
    )


def launcher_tool_args(server: ServerConfig) -> list[str]:
    """The tool-calling flags the launcher gives a server of this bench (the model resolved)."""
    from tokencake.serving.model import resolve_model
    from tokencake.serving.server_config import ServerConfig as Launcher

    launcher = Launcher(server.model, extra_args=server.extra_args)
    launcher.resolved = resolve_model(server.model)
    return launcher.tool_args()


def _git(cwd: Path, *args: str) -> str | None:
    """``git args`` in ``cwd``: its stripped output, or None when git fails or is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


__all__ = [
    "COMPLETE_MARKER",
    "PLUGIN_BASE_PARSERS",
    "SourceTree",
    "export_tree",
    "launcher_tool_args",
    "package_checkout",
    "prepare_source",
    "resolve_revision",
    "split_name",
]
