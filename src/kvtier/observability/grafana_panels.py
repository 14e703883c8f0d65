"""The building blocks of kvtier's Grafana dashboards (grafana-foundation-sdk builders): PromQL helpers
that name every metric through `kvtier.observability.catalog` (`metric` / `series` raise on a name the
catalog does not have, so a renamed metric breaks the build, not the dashboard), and the panel,
variable and dashboard builders with the house style (Prometheus data source variable, legends, units).
The dashboards themselves are in `dashboards.py`.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

from . import catalog

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
TAGS = ["kvtier"]
# Every query is scoped to the `namespace` and `cluster` variables: the scrape's target labels (the
# PodMonitor's `ray_io_cluster` is the RayCluster, so a zero-downtime upgrade's pending cluster stays apart)
SCOPE = 'namespace=~"$namespace", ray_io_cluster=~"$cluster"'


def metric(name: str) -> str:
    """A catalog metric name (KeyError if the catalog lacks it)."""
    return catalog.get(name).name


def series(name: str, part: str) -> str:
    """A catalog series name: series("ray_kvtier_eviction_round_seconds", "bucket")."""
    return catalog.series(name, part)


def scoped(*matchers: str) -> str:
    """A label selector within the dashboard's namespace and cluster: scoped('tier=~"$tier"')."""
    return "{" + ", ".join((SCOPE, *matchers)) + "}"


def rate(name: str, sel: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric(name)}{sel}[{RATE}]))"


def rate_or_zero(name: str, zero_like: str, sel: str = "", by: str = "") -> str:
    """rate, or 0 for every series of `zero_like` (a gauge with the same grouping) while the counter has
    never been incremented (Ray exports a counter only after its first increment): the panel shows a 0
    line instead of "No data"."""
    grouping = f" by ({by})" if by else ""
    return f"{rate(name, sel, by)} or (0 * sum{grouping} ({metric(zero_like)}{sel}))"


def quantile(q: float, name: str, sel: str = "", by: str = "") -> str:
    by = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({by}) (rate({series(name, 'bucket')}{sel}[{RATE}])))"


def mean(name: str, sel: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return (f"sum{grouping} (rate({series(name, 'sum')}{sel}[{RATE}])) / "
            f"sum{grouping} (rate({series(name, 'count')}{sel}[{RATE}]))")


# -- panels ------------------------------------------------------------------------------------------
class PanelIds:
    """Panel ids 1, 2, 3, ... in the order panels are built (stable JSON)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def target(ref: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref).expr(expr).legend_format(legend).range().datasource(DATASOURCE)


def timeseries_panel(pid: int, title: str, description: str, queries: list[tuple[str, str]], unit: str, *,
                w: int = 12, h: int = 8, min_val: float | None = 0, stack: bool = False) -> timeseries.Panel:
    panel = (
        timeseries.Panel().id(pid).title(title).description(description).datasource(DATASOURCE)
        .unit(unit).span(w).height(h).line_width(1).fill_opacity(10).show_points(cm.VisibilityMode.NEVER)
        .legend(cb.VizLegendOptions().show_legend(True).display_mode(cm.LegendDisplayMode.TABLE)
                .placement(cm.LegendPlacement.BOTTOM).calcs(["mean", "lastNotNull", "max"]))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if stack:
        panel = panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(target(chr(ord("A") + i), expr, legend))
    return panel


def stat_panel(pid: int, title: str, description: str, expr: str, legend: str, unit: str, *, w: int = 6,
          h: int = 4) -> stat.Panel:
    return (
        stat.Panel().id(pid).title(title).description(description).datasource(DATASOURCE).unit(unit)
        .span(w).height(h).graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(target("A", expr, legend))
    )


def heatmap_panel(pid: int, title: str, description: str, name: str, unit: str, selector: str, *, w: int = 12,
             h: int = 8) -> heatmap.Panel:
    expr = f"sum by (le) (increase({series(name, 'bucket')}{selector}[{RATE}]))"
    return (
        heatmap.Panel().id(pid).title(title).description(description).datasource(DATASOURCE)
        .span(w).height(h).calculate(False)
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges")
               .steps(64))
        .cell_values(heatmap.CellValues().unit("short")).show_tooltip().show_y_histogram().show_legend()
        .scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LINEAR))
        .with_target(prometheus.Dataquery().ref_id("A").expr(expr).legend_format("{{le}}")
                     .format(pm.PromQueryFormat.HEATMAP).range().datasource(DATASOURCE))
    )


def variables(scope_metric: str, *names: tuple[str, str, str]) -> list:
    """Data source, namespace and cluster (values of scope_metric, a series every target of the dashboard
    exports), then `names`: (name, label, query) query variables."""
    m = metric(scope_metric)
    scope = (("namespace", "Namespace", f"label_values({m}, namespace)"),
             ("cluster", "Ray cluster", f'label_values({m}{{namespace=~"$namespace"}}, ray_io_cluster)'))
    out: list = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")]
    for name, label, query in (*scope, *names):
        out.append(
            db.QueryVariable(name).label(label).query(query).datasource(DATASOURCE)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
        )
    return out


def base_dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title).uid(uid).description(description).tags(TAGS).editable()
        .refresh("30s").time("now-1h", "now").timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(db.DashboardLink("kvtier").type(dm.DashboardLinkType.DASHBOARDS).tags(TAGS).as_dropdown(True)
              .include_vars(True).keep_time(True))
    )

