"""The quick start in examples/ must keep working on the scripted model (the README runs it)."""

import importlib.util
import pathlib

QUICKSTART = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_runs_offline(capsys):
    spec = importlib.util.spec_from_file_location("tokencake_quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--scripted", "--city", "Lisbon"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "It is sunny, 22 °C, so dress for it. Then: Go for the tram 28 ride."
    table = "\n".join(out[2:])
    for node in ("forecaster", "scout", "planner", "total"):
        assert node in table
    # the two tool branches overlapped: the join started before their summed tool time elapsed
    planner_start = float(next(line for line in out if line.startswith("planner")).split()[2])
    assert planner_start < 0.5 + 0.8
