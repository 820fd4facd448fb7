"""Graph metadata, checked on the Code-Writer DAG of /work/shared/design/catalog-workloads.md.

The app is built by ``code_writer_app`` in conftest.py. The table gives 29 nodes (27 LLM,
2 local), 36 edges, max depth 17 and, per node, the output-token budget and the tool that
follows the LLM call. Edges not fixed by the table are chosen to match
those counts: a local ``start`` feeds ``architect_1``; both reviewers feed both revisers;
``reviewer_2`` also feeds ``external_eval``; the revisers join at ``user_confirm`` ("revision") and
``end`` joins ``test_node`` with ``external_eval`` ("final merge").

Node weight = output tokens x 0.02 s + tool predict_time, so (by hand):
    200 tok -> 4.00 s, 128 tok -> 2.56 s, 400 tok -> 8.00 s
    architect 4.00 | search 2.56+4.0 = 6.56 | judger 2.56+0.4 = 2.96   (x2 rounds: 27.04)
    file_write_plan 2.56+0.1 = 2.66                                        (cum. 29.70)
    programmer branch: validate 8+8 = 16, repair 8, code_write 2.66 = 26.66 (cum. 56.36)
    reviewer 4.00                                                          (cum. 60.36)
    reviser branch: validate 8+10 = 18, repair 8, revised_write 2.66 = 28.66 (cum. 89.02)
    user_confirm 2.56+3.5 = 6.06 (cum. 95.08), test_node 2.56+5.5 = 8.06 (cum. 103.14), end 0
    external_eval 2.56+4.5 = 7.06: its longest path is 60.36 + 7.06 = 67.42 -> slack 35.72
"""

import networkx as nx
import pytest

from tokencake.agents._graph import critical_path, cycle_text, graph_meta
from tokencake.events import priority_from_graph


def test_code_writer_shape_matches_the_published_counts(code_writer):
    app = code_writer
    graph = app.graph
    assert graph.number_of_nodes() == 29
    assert graph.number_of_edges() == 36
    kinds = [graph.nodes[n]["kind"] for n in graph]
    assert kinds.count("agent") == 27 and kinds.count("function") == 2
    assert max(app.meta(n).depth for n in graph) == 17


def test_code_writer_critical_path_and_length(code_writer):
    app = code_writer
    assert app.critical_path == [
        "start",
        "architect_1",
        "search_1",
        "judger_1",
        "architect_2",
        "search_2",
        "judger_2",
        "file_write_plan",
        "programmer_1_validate_patch",  # three equal programmer branches: first by name
        "programmer_1_repair",
        "code_write_1",
        "reviewer_1",
        "reviser_1_validate_patch",
        "reviser_1_repair",
        "revised_code_write_1",
        "user_confirm",
        "test_node",
        "end",
    ]
    assert app.critical_path_s == pytest.approx(103.14)
    assert app.weight("search_1") == pytest.approx(6.56)  # predict_time wins over the stages' sum
    assert app.weight("test_node") == pytest.approx(8.06)
    assert app.weight("end") == 0.0


def test_code_writer_per_node_metadata(code_writer):
    app = code_writer
    start, end = app.meta("start"), app.meta("end")
    assert (start.depth, start.remaining_depth) == (0, 17)
    assert (end.depth, end.remaining_depth) == (17, 0)
    assert end.in_degree == 2 and end.out_degree == 0
    fwp = app.meta("file_write_plan")
    assert (fwp.depth, fwp.remaining_depth, fwp.out_degree, fwp.fanout_width) == (7, 10, 3, 3)
    assert fwp.join_group is None
    pvp = app.meta("programmer_2_validate_patch")
    assert (pvp.depth, pvp.fanout_width, pvp.join_group) == (8, 3, "reviewer_1")
    assert app.meta("programmer_3_repair").join_group == "reviewer_1"
    rev2 = app.meta("reviewer_2")
    assert (rev2.depth, rev2.remaining_depth, rev2.in_degree, rev2.out_degree) == (11, 6, 3, 3)
    assert app.meta("reviser_2_repair").join_group == "user_confirm"
    assert app.meta("test_node").join_group == "end"

    ext = app.meta("external_eval")
    assert (ext.depth, ext.remaining_depth) == (12, 1)
    assert ext.join_group == "end"
    assert not ext.on_critical_path
    assert ext.slack_s == pytest.approx(35.72)
    assert priority_from_graph(ext) == 36
    # every other node lies on some longest path (the parallel branches are equally long)
    off = [n for n in app.graph if not app.meta(n).on_critical_path]
    assert off == ["external_eval"]
    for n in app.graph:
        assert app.meta(n).critical_path_s == pytest.approx(103.14)
        if n != "external_eval":
            assert app.meta(n).slack_s == 0.0
            assert priority_from_graph(app.meta(n)) == 0


def test_slack_and_ties_on_a_small_diamond():
    g = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    weights = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 1.0}
    path, length = critical_path(g, weights)
    assert path == ["a", "b", "d"] and length == 7.0
    metas = graph_meta(g, weights)
    assert metas["c"].slack_s == pytest.approx(3.0) and not metas["c"].on_critical_path
    assert metas["b"].on_critical_path and metas["b"].join_group == "d"
    assert metas["a"].fanout_width == 2 and metas["a"].join_group is None
    assert metas["d"].depth == 2 and metas["a"].remaining_depth == 2
    weights["c"] = 5.0  # a tie: the alphabetically first branch is reported
    assert critical_path(g, weights)[0] == ["a", "b", "d"]
    assert graph_meta(g, weights)["c"].on_critical_path


def test_independent_components_and_empty_graph():
    g = nx.DiGraph()
    g.add_nodes_from(["x", "y"])
    path, length = critical_path(g, {"x": 1.0, "y": 3.0})
    assert path == ["y"] and length == 3.0
    assert critical_path(nx.DiGraph(), {}) == ([], 0.0)
    assert cycle_text(g) is None
