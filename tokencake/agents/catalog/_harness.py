"""Test runner executed in a subprocess inside a catalog sandbox (standard library only).

Usage: ``python -I -B _harness.py SANDBOX_DIR [TEST_FILE ...]``. It imports every ``test_*.py``
(or the given files), runs module-level ``test_*`` functions and ``unittest.TestCase`` classes,
and prints one JSON line prefixed with ``@@TOKENCAKE-RESULT@@``. Generated code is untrusted
and often broken, so every failure mode (import error, syntax error, exception, failing assert)
becomes a reported result instead of a crash of the harness. It does not depend on pytest so
that the catalog works with the runtime dependencies only.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import os
import sys
import traceback
import unittest
from contextlib import redirect_stderr, redirect_stdout

MARKER = "@@TOKENCAKE-RESULT@@"
_MAX_ERROR = 1500


def _short(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    tb = traceback.extract_tb(exc.__traceback__)
    # The innermost frame that is in the sandbox tells the model where it went wrong.
    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)), "")
    return (f"{where}: {text}" if where else text)[:_MAX_ERROR]


def _discover(root: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for name in sorted(filenames):
            if name.startswith("test_") and name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def _run_file(root: str, rel: str, results: dict[str, list]) -> None:
    path = os.path.join(root, rel)
    mod_name = "tc_test_" + rel[:-3].replace(os.sep, "_").replace("-", "_").replace(".", "_")
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            results["errors"].append({"test": rel, "error": "cannot load module"})
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    except BaseException as exc:  # a broken test file is a result, not a harness crash
        results["errors"].append({"test": rel, "error": _short(exc)})
        return
    finally:
        sys.path.remove(os.path.dirname(path))
    for name, obj in sorted(vars(module).items()):
        if name.startswith("test") and inspect.isfunction(obj) and obj.__module__ == mod_name:
            test_id = f"{rel}::{name}"
            try:
                params = inspect.signature(obj).parameters
                if any(p.default is inspect.Parameter.empty for p in params.values()):
                    raise TypeError("test functions must not need arguments (no fixtures here)")
                obj()
            except AssertionError as exc:
                results["failed"].append({"test": test_id, "error": _short(exc)})
            except BaseException as exc:
                results["errors"].append({"test": test_id, "error": _short(exc)})
            else:
                results["passed"].append(test_id)
        elif inspect.isclass(obj) and issubclass(obj, unittest.TestCase) and obj.__module__ == mod_name:
            suite = unittest.defaultTestLoader.loadTestsFromTestCase(obj)
            tests = list(_iter_tests(suite))  # running a suite drops its references to the tests
            outcome = unittest.TestResult()
            suite.run(outcome)
            bad = {id(t) for t, _ in outcome.failures + outcome.errors}
            for test, err in outcome.failures:
                results["failed"].append({"test": f"{rel}::{test.id()}", "error": err[-_MAX_ERROR:]})
            for test, err in outcome.errors:
                results["errors"].append({"test": f"{rel}::{test.id()}", "error": err[-_MAX_ERROR:]})
            for test in tests:
                if id(test) not in bad:
                    results["passed"].append(f"{rel}::{test.id()}")


def _iter_tests(suite: unittest.TestSuite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _iter_tests(item)
        else:
            yield item


def main(argv: list[str]) -> int:
    # Our own directory (the catalog package) must not shadow the sandbox's modules.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    root = os.path.abspath(argv[0])
    sys.path.insert(0, root)
    os.chdir(root)
    files = argv[1:] or _discover(root)
    results: dict[str, list] = {"passed": [], "failed": [], "errors": []}
    captured = io.StringIO()
    with redirect_stdout(captured), redirect_stderr(captured):
        for rel in files:
            _run_file(root, rel, results)
    report = {**results, "files": files, "log": captured.getvalue()[-4000:]}
    sys.stdout.write(MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
