"""``benchmarks/rebootstrap.py``: a stored run's paired ratio is unchanged, its interval resampled by app."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "rebootstrap.py"
_spec = importlib.util.spec_from_file_location("rebootstrap", _PATH)
rebootstrap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rebootstrap)

_STORED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "stress-pop2-results.json"


def test_a_stored_run_keeps_its_ratio_and_gets_an_interval_by_app():
    results = json.loads(_STORED.read_text())  # trimmed: the apps' E2E are kept
    out = rebootstrap.rebootstrap(results)
    for point in ("hetero",):
        both = out[point]["tokencake/spatial-off"]
        assert both["stored"] == results["aggregate"][point]["paired"]["tokencake/spatial-off"]
        assert both["by_app"]["ratio"] == both["stored"]["ratio"]
        assert both["by_app"]["n_apps"] == 3 and both["by_app"]["n_pairs"] == both["stored"]["n_pairs"]
        lo, hi = both["by_app"]["ci95"]
        assert lo <= both["by_app"]["ratio"] <= hi
