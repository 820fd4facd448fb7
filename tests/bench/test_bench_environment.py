"""What a run records about the code and the machine."""


def test_results_record_the_commit_its_dirtiness_and_the_load(tmp_path, monkeypatch):
    from tokencake.bench import environment

    v = environment.versions()
    assert v["git_commit"] is None or len(v["git_commit"]) == 40
    assert v["git_dirty"] in (True, False, None)
    load = environment.loadavg()
    assert load is None or len(load) == 3
    # Outside a git checkout: None, not a crash.
    monkeypatch.setattr(environment, "_git", lambda *a: None)
    assert environment._git_dirty() is None and environment._git_commit() is None
