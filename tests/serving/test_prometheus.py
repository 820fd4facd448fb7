"""The one Prometheus parser: the label-aware samples and the flat view ``Server.metrics()`` returns."""

from __future__ import annotations

import textwrap

import tokencake.serving
from tokencake.serving.prometheus import parse_metrics, parse_prometheus

TEXT = textwrap.dedent(
    """\
    # HELP vllm:prefix_cache_hits_total hits
    # TYPE vllm:prefix_cache_hits_total counter
    vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
    vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
    vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 5.0
    vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 2.0
    vllm:info{version="a,b"} 1
    weird{a="x \\"q\\"",b="back\\\\slash\\nline"} 1e3
    stamped{a="x", b="y"} 4 1700000000000
    process_open_fds 12
    garbage line
    """
)


def test_the_samples_keep_their_labels_unescaped() -> None:
    m = parse_metrics(TEXT)
    assert m["vllm:prefix_cache_hits_total"] == [({"engine": "0", "model_name": "m"}, 128.0)]
    assert [v for _labels, v in m["vllm:prompt_tokens_by_source_total"]] == [5.0, 2.0]
    assert m["weird"] == [({"a": 'x "q"', "b": "back\\slash\nline"}, 1000.0)]
    assert m["stamped"] == [({"a": "x", "b": "y"}, 4.0)]  # a timestamp is not the value
    assert m["vllm:prefix_cache_hits_created"][0][1] == 1.7e9
    assert "garbage" not in m


def test_the_flat_view_sums_over_engines_and_drops_creation_times() -> None:
    m = parse_prometheus(TEXT)
    assert m["vllm:prefix_cache_hits_total"] == 128.0
    assert m['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 7.0
    assert m['vllm:info{version="a,b"}'] == 1.0
    # Label text as exposed: escapes kept, spaces after commas dropped.
    assert m['weird{a="x \\"q\\"",b="back\\\\slash\\nline"}'] == 1000.0
    assert m['stamped{a="x",b="y"}'] == 4.0
    assert m["process_open_fds"] == 12.0
    assert not any(k.endswith("_created") or "_created{" in k for k in m)
    assert len(m) == 6


def test_the_package_exports_the_flat_view() -> None:
    assert tokencake.serving.parse_prometheus is parse_prometheus
    assert "parse_prometheus" in tokencake.serving.__all__
