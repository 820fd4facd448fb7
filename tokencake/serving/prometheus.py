"""Prometheus text exposition (vLLM's ``/metrics``), parsed by one label-aware parser.

:func:`parse_metrics` keeps every sample with its labels: ``{name: [(labels, value), ...]}``, what
``tokencake bench`` reads (deltas by label, histograms, replicas). :func:`parse_prometheus` is the
flat view ``Server.metrics()`` returns, derived from it.
"""

from __future__ import annotations

import re

__all__ = ["Metrics", "parse_metrics", "parse_prometheus"]

#: A sample line: name, optional ``{labels}``, value, optional timestamp.
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
#: The label-value escapes of the text format (``\\``, ``\"``, ``\n``).
_ESCAPE = re.compile(r"\\(.)")

#: name -> list of (labels, value), in the order the samples appear.
Metrics = dict[str, list[tuple[dict[str, str], float]]]

#: Labels the flat view drops, summing the values across them: one server, any engine count.
_SUMMED_LABELS = ("engine", "model_name")


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus exposition text into ``{name: [(labels, value), ...]}``.

    Comments, blank lines and lines that are not a sample with a numeric value are skipped; label
    values are unescaped; a trailing timestamp is ignored.
    """
    out: Metrics = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels_text, value_text = m.group(1), m.group(3), m.group(4)
        try:
            value = float(value_text)
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text or "")}
        out.setdefault(name, []).append((labels, value))
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Parse Prometheus text into ``{name or name{labels}: value}`` (the flat view of :func:`parse_metrics`).

    The ``engine`` and ``model_name`` labels are dropped (values summed across them) so callers can
    write ``m["vllm:prefix_cache_hits_total"]`` or
    ``m['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}']``; the other labels keep their
    order and text. ``*_created`` samples (creation timestamps, not measurements) are left out.
    """
    out: dict[str, float] = {}
    for name, series in parse_metrics(text).items():
        if name.endswith("_created"):
            continue
        for labels, value in series:
            kept = [f'{k}="{_escape(v)}"' for k, v in labels.items() if k not in _SUMMED_LABELS]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
            out[key] = out.get(key, 0.0) + value
    return out
