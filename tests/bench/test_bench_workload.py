import itertools
import json
import random
import statistics

import pytest

from tokencake.bench.workload import (
    SYNTHETIC_APP,
    LLMSettings,
    Workload,
    arrival_times,
    make_workload,
    parse_latency,
    pick_apps,
)


def _wl(**kw):
    base = dict(
        name="t",
        mix={SYNTHETIC_APP: 1.0},
        num_apps=8,
        arrival="poisson",
        rate=0.5,
        seed=7,
        app_params={SYNTHETIC_APP: {"turns": 2}},
    )
    base.update(kw)
    return make_workload(**base)


def test_same_seed_same_workload_and_json_round_trip():
    a, b = _wl(), _wl()
    assert a.to_dict() == b.to_dict()
    text = json.dumps(a.to_dict())
    assert Workload.from_dict(json.loads(text)) == a


def test_different_seed_changes_arrivals_and_app_seeds():
    a, b = _wl(seed=1), _wl(seed=2)
    assert [x.at_s for x in a.arrivals] != [x.at_s for x in b.arrivals]
    assert [x.params["seed"] for x in a.arrivals] != [x.params["seed"] for x in b.arrivals]


def test_each_arrival_has_its_own_seed_and_stable_run_id():
    wl = _wl()
    seeds = [a.params["seed"] for a in wl.arrivals]
    assert len(set(seeds)) == len(seeds)
    assert [a.run_id for a in wl.arrivals] == [f"t-{i:04d}" for i in range(8)]
    assert all(a.params["turns"] == 2 for a in wl.arrivals)


def test_poisson_mean_interarrival_matches_rate():
    times = arrival_times("poisson", 4000, 2.0, random.Random(0))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd == mean


def test_uniform_and_concurrent_arrivals():
    assert arrival_times("uniform", 4, 0.25, random.Random(0)) == [0.0, 4.0, 8.0, 12.0]
    assert arrival_times("concurrent", 3, None, random.Random(0)) == [0.0, 0.0, 0.0]
    wl = _wl(arrival="concurrent", concurrency=None, num_apps=5)
    assert wl.concurrency == 5 and wl.rate is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arrival="poisson", rate=None),
        dict(arrival="uniform", rate=0.0),
        dict(arrival="burst", rate=1.0),
        dict(num_apps=0),
        dict(latency="fast"),
        dict(latency="scaled:-1"),
        dict(mix={"a": 0.0}),
    ],
)
def test_bad_parameters_raise_clear_errors(kwargs):
    with pytest.raises(ValueError):
        _wl(**kwargs)


def test_parse_latency():
    assert parse_latency("paper") == ("paper", 1.0)
    assert parse_latency("real") == ("real", 1.0)
    assert parse_latency("scaled:0.25") == ("scaled", 0.25)


def test_mix_respects_weights():
    names = pick_apps({"a": 3.0, "b": 1.0, "c": 0.0}, 4000, random.Random(1))
    assert "c" not in names
    assert names.count("a") / len(names) == pytest.approx(0.75, abs=0.03)


def test_llm_overrides_force_greedy_and_ignore_eos():
    assert LLMSettings().overrides() == {"temperature": 0.0, "ignore_eos": True}
    assert LLMSettings(max_tokens=12).overrides()["max_tokens"] == 12
