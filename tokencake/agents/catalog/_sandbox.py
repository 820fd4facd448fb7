"""A per-run working directory where catalog tools write, read, compile and test code.

Everything a model writes here is untrusted: paths are confined to the sandbox root, file sizes
are capped, and tests run in a separate Python process (``-I`` isolated mode) with a timeout and
a cap on captured output. Broken code is the normal case with small models, so compile errors,
failing tests and timeouts come back as :class:`TestReport` values, never as exceptions; only
misuse (a path escaping the root, a file too large) raises :class:`SandboxError`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import anyio

from tokencake.agents.catalog._harness import MARKER

MAX_FILE_BYTES = 512 * 1024
MAX_FILES = 200
MAX_OUTPUT_BYTES = 256 * 1024
_HARNESS = Path(__file__).with_name("_harness.py")
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")


class SandboxError(ValueError):
    """A request the sandbox refuses (bad path, too large); the message says why."""


@dataclass
class TestReport:
    """What one test run found. ``ok`` means: something was collected and nothing failed."""

    ok: bool
    passed: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    compile_errors: list[dict[str, str]] = field(default_factory=list)
    timed_out: bool = False
    returncode: int | None = None
    duration_s: float = 0.0
    output: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for prompts and logs."""
        if self.timed_out:
            return f"tests timed out after {self.duration_s:.1f}s"
        parts = [f"{len(self.passed)} passed", f"{len(self.failed)} failed", f"{len(self.errors)} errors"]
        if self.compile_errors:
            parts.append(f"{len(self.compile_errors)} files do not compile")
        if not self.files:
            parts.append("no test files")
        return ", ".join(parts)

    def problems(self, limit: int = 5) -> list[str]:
        """The first few failure messages (compile errors first), for a repair prompt."""
        items = [f"{e['path']}: {e['error']}" for e in self.compile_errors]
        items += [f"{e['test']}: {e['error']}" for e in self.failed + self.errors]
        return items[:limit]


class Sandbox:
    """A directory owned by one app run (created under the system temp dir unless ``root`` given)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, prefix: str = "tokencake-") -> None:
        if root is None:
            self.root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
        else:
            self.root = Path(root).resolve()
            self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Sandbox({str(self.root)!r})"

    # -- paths -------------------------------------------------------------------------------
    def resolve(self, rel: str) -> Path:
        """The absolute path of ``rel`` inside the sandbox; refuses anything that could escape."""
        if not isinstance(rel, str) or not rel.strip():
            raise SandboxError("file path must be a non-empty string")
        text = rel.strip().replace("\\", "/")
        while text.startswith("./"):
            text = text[2:]
        pure = PurePosixPath(text)
        if pure.is_absolute() or text.startswith("~"):
            raise SandboxError(f"path {rel!r} must be relative to the sandbox")
        parts = pure.parts
        if not parts or any(p in ("", ".", "..") or not _SAFE_PART.match(p) for p in parts):
            raise SandboxError(f"path {rel!r} is not allowed (use letters, digits, '_', '-', '.' and '/')")
        path = self.root.joinpath(*parts)
        if self.root not in path.resolve().parents:
            raise SandboxError(f"path {rel!r} leaves the sandbox")
        return path

    # -- files -------------------------------------------------------------------------------
    def write(self, rel: str, content: str) -> dict[str, Any]:
        """Write a text file (creating folders); returns ``{"path", "bytes"}``."""
        if not isinstance(content, str):
            raise SandboxError(f"content for {rel!r} must be text")
        data = content.encode("utf-8", errors="replace")
        if len(data) > MAX_FILE_BYTES:
            raise SandboxError(f"{rel!r} is {len(data)} bytes; the limit is {MAX_FILE_BYTES}")
        path = self.resolve(rel)
        if not path.exists() and len(self.files()) >= MAX_FILES:
            raise SandboxError(f"the sandbox already holds {MAX_FILES} files")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return {"path": path.relative_to(self.root).as_posix(), "bytes": len(data)}

    def read(self, rel: str, max_chars: int = 20_000) -> str:
        """Read a text file; raises :class:`SandboxError` when it does not exist."""
        path = self.resolve(rel)
        if not path.is_file():
            raise SandboxError(
                f"no file {rel!r} in the sandbox (files: {', '.join(self.files()[:20]) or 'none'})"
            )
        text = path.read_text(encoding="utf-8", errors="replace")
        return text if len(text) <= max_chars else text[:max_chars] + "\n... [truncated]"

    def exists(self, rel: str) -> bool:
        try:
            return self.resolve(rel).is_file()
        except SandboxError:
            return False

    def files(self) -> list[str]:
        """Relative paths of all files, sorted (caches and hidden entries skipped)."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
            for name in filenames:
                if not name.startswith(".") and not name.endswith(".pyc"):
                    out.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(out)

    def snapshot(self, suffixes: tuple[str, ...] = (".py", ".md", ".txt", ".json")) -> dict[str, str]:
        """``{path: text}`` of the text files, for prompts and staging copies."""
        return {rel: self.read(rel) for rel in self.files() if rel.endswith(suffixes)}

    def stage(self, files: dict[str, str]) -> Sandbox:
        """A scratch copy of this sandbox with ``files`` applied on top (for patch validation)."""
        staged = Sandbox(prefix="tokencake-stage-")
        shutil.copytree(
            self.root, staged.root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
        for rel, text in files.items():
            staged.write(rel, text)
        return staged

    def remove(self) -> None:
        """Delete the directory (used for scratch copies)."""
        shutil.rmtree(self.root, ignore_errors=True)

    # -- checks ------------------------------------------------------------------------------
    def compile_errors(self, paths: list[str] | None = None) -> list[dict[str, str]]:
        """Syntax-check Python files without running them."""
        errors = []
        for rel in paths if paths is not None else [f for f in self.files() if f.endswith(".py")]:
            try:
                source = self.read(rel, max_chars=MAX_FILE_BYTES)
                ast.parse(source, filename=rel)
            except SyntaxError as exc:
                errors.append({"path": rel, "error": f"line {exc.lineno}: {exc.msg}"})
            except (SandboxError, ValueError) as exc:
                errors.append({"path": rel, "error": str(exc)})
        return errors

    async def run_tests(self, files: list[str] | None = None, *, timeout: float = 30.0) -> TestReport:
        """Run ``test_*.py`` (or ``files``) in an isolated subprocess; never raises for bad code."""
        compile_errors = self.compile_errors()
        cmd = [sys.executable, "-I", "-B", str(_HARNESS), str(self.root), *(files or [])]
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
        started = time.monotonic()
        chunks: list[bytes] = []
        returncode: int | None = None
        timed_out = False
        with anyio.move_on_after(timeout) as scope:
            async with await anyio.open_process(
                cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT
            ) as proc:
                assert proc.stdout is not None
                size = 0
                async for chunk in proc.stdout:
                    if size < MAX_OUTPUT_BYTES:
                        chunks.append(chunk[: MAX_OUTPUT_BYTES - size])
                    size += len(chunk)  # keep draining so the child never blocks on a full pipe
                returncode = await proc.wait()
        if scope.cancelled_caught:
            timed_out = True
        duration = time.monotonic() - started
        raw = b"".join(chunks).decode("utf-8", errors="replace")
        report = TestReport(
            ok=False,
            compile_errors=compile_errors,
            timed_out=timed_out,
            returncode=returncode,
            duration_s=round(duration, 4),
        )
        result_line = next((ln for ln in raw.splitlines() if ln.startswith(MARKER)), None)
        report.output = "\n".join(ln for ln in raw.splitlines() if not ln.startswith(MARKER))[-4000:]
        if result_line is not None:
            try:
                data = json.loads(result_line[len(MARKER) :])
            except json.JSONDecodeError:
                data = None
            if isinstance(data, dict):
                report.passed = list(data.get("passed", []))
                report.failed = list(data.get("failed", []))
                report.errors = list(data.get("errors", []))
                report.files = list(data.get("files", []))
                report.output = (str(data.get("log", "")) + report.output)[-4000:]
        elif not timed_out:
            report.errors.append(
                {"test": "<harness>", "error": f"test process exited ({returncode}) without a result"}
            )
        report.ok = (
            not timed_out
            and bool(report.passed)
            and not report.failed
            and not report.errors
            and not report.compile_errors
        )
        return report


__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "Sandbox", "SandboxError", "TestReport"]
