"""Just enough PromQL lexing to list the metric names and label names an expression reads.

Used to check that dashboards and alerts read catalog metrics only (`check`). Not a parser: it strips
strings, range/subquery brackets, grouping clauses and label matchers, then every identifier that is
not a function, keyword or Grafana variable is a metric name.
"""

from __future__ import annotations

import re

from . import catalog

FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "max_over_time", "min_over_time", "minute",
    "month", "predict_linear", "present_over_time", "quantile_over_time", "rate", "resets", "round",
    "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time",
    "time", "timestamp", "vector", "year",
    # aggregation operators
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # Grafana template functions (variable queries)
    "label_values", "label_names", "metrics", "query_result",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")
_IDENT = re.compile(r"(?<![A-Za-z0-9_.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_LABEL_IN_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)")


def _lex(expr: str) -> tuple[str, set[str]]:
    """The expression with strings, ranges, matchers and grouping lists removed, and the label names seen."""
    labels: set[str] = set()
    text = _VARIABLE.sub(" ", _STRING.sub('""', expr))
    text = _RANGE.sub(" ", text)
    for m in _GROUPING.finditer(text):
        labels.update(x.strip() for x in m.group(2).split(",") if x.strip())
    text = _GROUPING.sub(" ", text)
    for m in _MATCHERS.finditer(text):
        labels.update(name for name, _op in _LABEL_IN_MATCHER.findall(m.group(1)))
    text = _MATCHERS.sub(" ", text)
    return text, labels


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (`rate(x_total[5m])` -> {"x_total"})."""
    text, _ = _lex(expr)
    names = set()
    for m in _IDENT.finditer(text):
        ident, call = m.group(1), m.group(2)
        if call or ident.lower() in KEYWORDS or ident in FUNCTIONS:
            continue
        names.add(ident)
    return names


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(series name, label names it matches on) for every selector: `rate(x{a="1"}[5m]) / y` ->
    [("x", {"a"}), ("y", set())]."""
    text = _VARIABLE.sub(" ", _STRING.sub('""', expr))
    text = _GROUPING.sub(" ", _RANGE.sub(" ", text))
    out = []
    for m in re.finditer(r"(?<![A-Za-z0-9_.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?", text):
        ident, matchers, call = m.groups()
        if call or ident.lower() in KEYWORDS or ident in FUNCTIONS:
            continue
        out.append((ident, {name for name, _op in _LABEL_IN_MATCHER.findall(matchers or "")}))
    return out


def label_names(expr: str) -> set[str]:
    """Label names an expression matches on or groups by."""
    return _lex(expr)[1]


def label_values_arguments(expr: str) -> tuple[str | None, str | None]:
    """Grafana's `label_values(metric, label)` -> (metric, label); (None, label) for `label_values(label)`."""
    m = re.fullmatch(r"\s*label_values\(\s*(?:(.*)\s*,\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", expr)
    if not m:
        return None, None
    return (m.group(1).strip() if m.group(1) else None), m.group(2)


def check(expr: str) -> list[str]:
    """Problems with an expression: metric names outside the catalog, labels no selected metric has."""
    problems = []
    metrics = metric_names(expr)
    if not metrics:
        problems.append(f"no metric selected in {expr!r}")
    known = [catalog.SERIES[n] for n in metrics if n in catalog.SERIES]
    for name in sorted(metrics - set(catalog.SERIES)):
        problems.append(f"{name!r} is not a catalog series (in {expr!r})")
    allowed = set(catalog.RAY_LABELS) | set(catalog.TARGET_LABELS)
    for m in known:
        allowed |= set(m.all_labels)
    for label in sorted(label_names(expr) - allowed):
        problems.append(f"label {label!r} is not a label of {sorted(x.name for x in known)} (in {expr!r})")
    return problems
