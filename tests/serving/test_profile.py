from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencake.serving.profile import CPU_S_PER_TOKEN, PrefillProfile, profile_path


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_prior_then_the_first_prefill_step_then_an_ewma() -> None:
    p = PrefillProfile(min_tokens=100, alpha=0.5)
    assert p.s_per_token == CPU_S_PER_TOKEN
    p.observe_step(50, 10.0)  # a decode-sized step says nothing about prefill
    assert p.s_per_token == CPU_S_PER_TOKEN
    p.observe_step(1000, 2.0)
    assert p.s_per_token == pytest.approx(0.002)
    p.observe_step(1000, 4.0)
    assert p.s_per_token == pytest.approx(0.003)
    assert p.recompute_s(500) == pytest.approx(1.5)
    for bad in (float("nan"), 0.0, -1.0):
        p.observe_step(1000, bad)
    assert p.s_per_token == pytest.approx(0.003)


def test_saved_and_loaded_per_model_and_hardware(tmp_path: Path) -> None:
    path = profile_path(tmp_path, "/models/Smol LM2", "cpu2-x86_64-float32")
    assert path.parent == tmp_path and " " not in path.name and "/" not in path.name
    clock = Clock()
    p = PrefillProfile(path=path, min_tokens=1, save_every_s=60, clock=clock)
    assert not p.maybe_save({"d2h": 1e9})  # nothing learned yet
    p.observe_step(100, 0.5)
    assert not p.maybe_save({"d2h": 1e9})  # too soon
    clock.t = 61
    assert p.maybe_save({"d2h": 2e9, "h2d": 3e9})
    again = PrefillProfile(path=path)
    assert again.s_per_token == pytest.approx(0.005)
    assert again.bandwidths == {"d2h": 2e9, "h2d": 3e9}
    # A loaded profile is refined, not replaced, by the next sample.
    again.observe_step(1000, 1000 * 0.015)
    assert 0.005 < again.s_per_token < 0.015


def test_a_corrupt_profile_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    assert PrefillProfile(path=path).s_per_token == CPU_S_PER_TOKEN
    path.write_text(json.dumps({"s_per_token": -3, "bandwidths": {"d2h": "fast", "h2d": 5e9}}))
    p = PrefillProfile(path=path)
    assert p.s_per_token == CPU_S_PER_TOKEN and p.bandwidths == {"h2d": 5e9}


def test_an_unwritable_path_is_logged_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = PrefillProfile(path=blocker / "sub" / "p.json", min_tokens=1)
    p.observe_step(10, 1.0)
    assert not p.maybe_save(force=True)
