"""``benchmarks/release.py``: the manifest fixes the set before any unit runs, refuses another serving
code, and a rerun continues where the last stopped, each round in its planned balanced order."""

import importlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))
try:
    release = importlib.import_module("release")
    plan = importlib.import_module("release_plan")
finally:
    sys.path.remove(str(_DIR))

from tokencake.bench.runner import run_bench  # noqa: E402

# FakeServer's events URL refuses connections, so the SDK warns once per run (expected here).
pytestmark = pytest.mark.filterwarnings("ignore:stall events are not reaching")

TINY = ("--apps", "2", "--turns", "2", "--context-tokens", "30", "--max-tokens", "5", "--tool-s", "0.01,0.02")
CONTROLS = ("baseline-priority", "tokencake", "tokencake-roomy")


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)


def _commit(root: Path) -> None:
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "change")


@pytest.fixture
def repo(tmp_path):
    """A checkout with a tokencake/ tree and docs that record seeds 11-13."""
    root = tmp_path / "repo"
    (root / "tokencake").mkdir(parents=True)
    (root / "tokencake" / "serving.py").write_text("X = 1\n")
    (root / "docs" / "bench").mkdir(parents=True)
    (root / "docs" / "bench" / "old-results.json").write_text(json.dumps({"config": {"order_seed": 11}}))
    (root / "docs" / "notes.md").write_text("drawn with seeds 12 and 13.\n")
    _git(root, "init", "-q")
    _commit(root)
    return root


def _tiny(chosen, draws):
    """Small workloads in the shape of the release's: a pressure one, the draws, no pressure."""
    w = plan.Workload
    out = [w("ci", "tiny ci", ("--preset", "ci", *TINY), CONTROLS)]
    for i, d in enumerate(draws):
        argv = ("--preset", "ci", *TINY, "--seed", str(d["knobs"]["seed"]))
        out.append(w(f"draw-{i + 1}", "tiny draw", argv, CONTROLS, dict(d)))
    out.append(w("no-pressure", "tiny", ("--preset", "ci", *TINY), plan.NO_PRESSURE, role="no-pressure"))
    return out


def _create(repo, out, **kw):
    return release.create(out, root=repo, rounds=3, draws=1, make_workloads=_tiny, **kw)


class SessionEnded(Exception):
    """The session ends mid-set (an interrupt, the machine taken back)."""


class Stub:
    """Stands in for run_bench: records each unit, returns a (valid unless told) results dict."""

    def __init__(self, check=None, valid=True):
        self.calls, self.check, self.valid = [], check, valid

    def __call__(self, config, *, rounds, log_dir, **_kw):
        if self.check:
            self.check()
        self.calls.append(f"{log_dir.name}#{rounds[0] + 1}")
        valid = self.valid if isinstance(self.valid, bool) else self.valid(len(self.calls))
        return {"valid": valid, "versions": {"git_commit": "abc"}, "warnings": ["w"], "points": []}


def test_seeds_are_fresh_and_recorded_before_any_unit_runs(repo, tmp_path):
    out = tmp_path / "set"
    bits = iter([11, 12, 13, 2**31 + 7])
    manifest = _create(repo, out, randbits=lambda _n: next(bits))
    assert manifest["seeds"]["draws"] == [2**31 + 7]  # 11-13 are recorded in docs/
    assert manifest["seeds"]["workload_seeds"][0] not in plan.used_seeds(repo)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["seeds"] == manifest["seeds"] and on_disk["done"] == {}

    def recorded():  # every unit finds the seeds already in the manifest on disk
        assert json.loads((out / "manifest.json").read_text())["seeds"]["draws"] == [2**31 + 7]

    stub = Stub(recorded)
    release.run(out, root=repo, bench=stub, log=lambda _s: None)
    assert len(stub.calls) == 9
    with pytest.raises(release.ReleaseError, match="created once"):
        _create(repo, out)


def test_the_manifest_refuses_a_changed_serving_code(repo, tmp_path):
    (repo / "tokencake" / "serving.py").write_text("X = 2\n")
    with pytest.raises(release.ReleaseError, match="uncommitted"):
        _create(repo, tmp_path / "dirty")
    _git(repo, "checkout", "--", "tokencake")
    out = tmp_path / "set"
    _create(repo, out)
    stub = Stub()
    (repo / "tokencake" / "new.py").write_text("")  # untracked, but the servers would import it
    with pytest.raises(release.ReleaseError, match="uncommitted"):
        release.run(out, root=repo, bench=stub, log=lambda _s: None)
    _commit(repo)
    with pytest.raises(release.ReleaseError, match="serving code differs"):
        release.run(out, root=repo, bench=stub, log=lambda _s: None)
    (repo / "tokencake" / "new.py").unlink()
    _commit(repo)  # the same tree again, at another commit
    (repo / "docs" / "notes.md").write_text("docs may change\n")
    _commit(repo)
    release.run(out, root=repo, bench=stub, only=["no-pressure"], log=lambda _s: None)
    assert stub.calls == ["no-pressure#1", "no-pressure#2", "no-pressure#3"]


def test_a_rerun_resumes_where_it_stopped_in_the_planned_balanced_orders(
    repo, tmp_path, fake_server, fake_vllm
):
    fake_server.make_backend = staticmethod(lambda server: fake_vllm(hit_fraction=0.5))
    out = tmp_path / "set"
    manifest = _create(repo, out)
    ran, stop_at = [], [4]

    def bench(config, **kw):
        if len(ran) in stop_at:
            stop_at.clear()
            raise SessionEnded
        ran.append(f"{kw['log_dir'].name}#{kw['rounds'][0] + 1}")
        return run_bench(
            config,
            server_cls=fake_server,
            transport=lambda: fake_server.instances[-1].backend.transport(),
            **kw,
        )

    with pytest.raises(SessionEnded):
        release.run(out, root=repo, bench=bench, log=lambda _s: None)
    first = json.loads((out / "manifest.json").read_text())
    assert list(first["done"]) == ["ci#1", "draw-1#1", "no-pressure#1", "ci#2"]
    release.run(out, root=repo, bench=bench, log=lambda _s: None)
    done = json.loads((out / "manifest.json").read_text())["done"]
    assert ran == [u["unit"] for u in manifest["units"]]  # in plan order, nothing twice
    assert list(done) == ran
    assert release.left(json.loads((out / "manifest.json").read_text())) == []
    for name, systems in (("ci", CONTROLS), ("no-pressure", plan.NO_PRESSURE)):
        orders = []
        for r in (1, 2, 3):
            results = json.loads((out / done[f"{name}#{r}"]["file"]).read_text())
            assert results["valid"] and results["rounds_run"] == [r]
            orders.append(results["system_orders"][0]["order"])
        assert orders == [u["order"] for u in manifest["units"] if u["workload"] == name]
        for position in range(len(systems)):  # a Latin square's rows, across the resumed rounds
            counts = Counter(o[position] for o in orders)
            assert max(counts.values()) - min(counts.get(s, 0) for s in systems) <= 1


def test_an_invalid_unit_is_kept_as_an_attempt_and_runs_again(repo, tmp_path):
    out = tmp_path / "set"
    _create(repo, out)
    release.run(out, root=repo, bench=Stub(valid=lambda n: n != 2), log=lambda _s: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "draw-1#1" not in manifest["done"] and len(manifest["done"]) == 8
    assert manifest["attempts"][0]["unit"] == "draw-1#1" and manifest["attempts"][0]["warnings"] == ["w"]
    assert (out / manifest["attempts"][0]["file"]).name == "round-1-attempt-1.json"
    again = Stub()
    release.run(out, root=repo, bench=again, log=lambda _s: None)
    assert again.calls == ["draw-1#1"]
    assert "9 of 9 units done" in release.status(json.loads((out / "manifest.json").read_text()), None)


def test_a_session_can_run_part_of_the_set_without_changing_it(repo, tmp_path):
    out = tmp_path / "set"
    manifest = _create(repo, out)
    with pytest.raises(release.ReleaseError, match="unknown workload"):
        release.run(out, root=repo, bench=Stub(), only=["nope"], log=lambda _s: None)
    lines = []
    priors = {"system": {}, "kind": {"ci": 1500.0}, "overhead": 1.0}
    stub = Stub()
    release.run(out, root=repo, bench=stub, hours=1.0, priors=priors, log=lines.append)
    assert stub.calls == [] and "past the 1 h budget" in lines[-1]  # 3 systems x 1,500 s > 1 h
    release.run(out, root=repo, bench=stub, only=["draw-1"], log=lines.append)
    after = json.loads((out / "manifest.json").read_text())
    assert sorted(after["done"]) == ["draw-1#1", "draw-1#2", "draw-1#3"]
    assert after["units"] == manifest["units"] and after["seeds"] == manifest["seeds"]


def test_status_says_what_is_left_and_how_long_it_takes(repo, tmp_path, capsys):
    out = tmp_path / "set"
    manifest = _create(repo, out)
    priors = {"system": {"ci:tokencake": 100.0}, "kind": {"ci": 200.0}, "overhead": 1.0}
    text = release.status(manifest, priors)
    # per round: ci 200 + 100 + 200 s, the draw 3 x 200 s (no stored draws: the kinds' median),
    # no-pressure 2 x 200 s; 3 rounds: 4,500 s
    assert "0 of 9 units done, 9 left: ~1.2 h (from the stored runs in docs/bench)" in text
    assert f"draw seeds {manifest['seeds']['draws'][0]}" in text
    assert release.main(["--status", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("release: error: no release set in ")


def test_a_run_that_stops_with_units_left_writes_no_table(repo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "set"
    _create(repo, out)
    summarized, real_run = [], release.run
    monkeypatch.setattr(release, "_summarize", lambda args: summarized.append(args) or 0)
    monkeypatch.setattr(
        release,
        "run",
        lambda out_, only, **kw: real_run(out_, root=repo, bench=Stub(), only=only, log=lambda _s: None),
    )
    assert release.main(["--out", str(out), "--workloads", "ci"]) == 0  # a budget stops it as well
    assert summarized == [] and "not complete" in capsys.readouterr().out
    assert release.main(["--out", str(out)]) == 0
    assert len(summarized) == 1


def test_a_change_only_where_no_measured_process_imports_keeps_the_set(repo, tmp_path):
    (repo / "tokencake" / "sim").mkdir()
    (repo / "tokencake" / "sim" / "model.py").write_text("Y = 1\n")
    _commit(repo)
    out = tmp_path / "set"
    _create(repo, out)
    (repo / "tokencake" / "sim" / "model.py").write_text("Y = 2\n")  # uncommitted: not measured
    stub = Stub()
    release.run(out, root=repo, bench=stub, only=["ci"], log=lambda _s: None)
    _commit(repo)
    release.run(out, root=repo, bench=stub, only=["draw-1"], log=lambda _s: None)
    done = json.loads((out / "manifest.json").read_text())["done"]
    assert len({d["tokencake_tree"] for d in done.values()}) == 2  # each unit records its tree
    (repo / "tokencake" / "serving.py").write_text("X = 3\n")
    _commit(repo)
    with pytest.raises(release.ReleaseError, match=r"tokencake/serving\.py"):
        release.run(out, root=repo, bench=stub, log=lambda _s: None)


def test_a_change_only_in_text_a_reader_sees_keeps_the_set(repo, tmp_path):
    cli = repo / "tokencake" / "cli.py"
    cli.write_text(
        '"""The CLI."""\nimport argparse\n\n\ndef parser():\n    """One."""\n'
        '    p = argparse.ArgumentParser(description="d")\n'
        '    p.add_argument("--n", type=int, default=1, help="a number")  # note\n    return p\n'
    )
    _commit(repo)
    out = tmp_path / "set"
    _create(repo, out)
    stub = Stub()
    source = cli.read_text()
    cli.write_text(
        source.replace('"""One."""', '"""Two."""')
        .replace('help="a number"', 'help="how many (e.g. 3)"')
        .replace('description="d"', 'description="e"')
        .replace("# note", "# other")
    )
    _commit(repo)
    release.run(out, root=repo, bench=stub, only=["ci"], log=lambda _s: None)
    cli.write_text(cli.read_text().replace("default=1", "default=2"))
    _commit(repo)
    with pytest.raises(release.ReleaseError, match=r"tokencake/cli\.py"):
        release.run(out, root=repo, bench=stub, log=lambda _s: None)


def test_no_measured_process_imports_what_the_set_may_change():
    """``release.UNMEASURED`` (the simulator) is imported only by itself, the ``tokencake sim``
    command and ``tokencake run --trace`` (which writes a simulator trace): not by the bench client
    (``run_bench``), the servers, the vLLM plug-ins or the apps."""
    import ast

    package = _DIR.parent / "tokencake"
    allowed = {package / "cli" / "_sim.py", package / "cli" / "_run.py"}
    unmeasured = tuple(p.removesuffix("/").replace("/", ".") for p in release.UNMEASURED)
    found = []
    for path in package.rglob("*.py"):
        rel = path.relative_to(_DIR.parent).as_posix()
        if rel.startswith(release.UNMEASURED) or path in allowed:
            continue
        parts = path.relative_to(_DIR.parent).with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = parts[: len(parts) - node.level] if node.level else ()
                names = [".".join([*base, node.module or ""]).strip(".")]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{rel}:{node.lineno}" for n in names if n.startswith(unmeasured)]
    assert not found, found
