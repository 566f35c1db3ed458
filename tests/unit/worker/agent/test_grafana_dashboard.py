"""deploy/grafana/podium-dashboard.json: a Grafana dashboard (panels, each with PromQL
targets) whose every query reads only metrics Podium exports, as the node agent's and the
scheduler's code declare them. (tests/cluster/test_method_metrics.py checks the same names
against a real scrape of both.)"""

from __future__ import annotations

from tests.support import dashboards


def _exported() -> set[str]:
    from podium.scheduler.service import Metrics
    from podium.worker.agent.metrics import FAMILIES

    scheduler = {family.name: family.type for family in Metrics().registry.collect()}
    return dashboards.exported_series(FAMILIES) | dashboards.exported_series(scheduler)


def test_the_metric_name_finder_reads_promql():
    names = dashboards.metric_names
    assert names('histogram_quantile(0.99, sum by (group, method, le) '
                 '(rate(podium_method_call_seconds_bucket{group=~"$group", method!="x"}[$__rate_interval])))'
                 ) == {"podium_method_call_seconds_bucket"}
    assert names("a_total / on (node) group_left (gpu) b + sum without (x) (c offset 5m) or vector(0)") == {
        "a_total", "b", "c"}
    assert names('count(up{job="by (x) rate(y)"} == 0)') == {"up"}
    assert names("rate(x[5m:1m]) > bool 2") == {"x"}


def test_the_dashboard_is_a_grafana_dashboard():
    dash = dashboards.load()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]  # the import asks for a data source
    panels = dash["panels"]
    assert panels and len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat") and panel["title"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "xywh") and grid["x"] + grid["w"] <= 24
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for expr in dashboards.queries(dash):
        for used in ("$group",):
            if used in expr:
                assert used[1:] in variables
    # (one page: nothing below the fourth row of 8)
    assert max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) <= 32


def test_the_dashboard_shows_what_it_promises():
    exprs = dashboards.queries(dashboards.load())
    text = "\n".join(exprs)
    for quantile in ("0.5", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile}, sum by (group, method, le) "
                                "(rate(podium_method_call_seconds_bucket") for e in exprs), quantile
    for shown in ("podium_method_call_seconds_count", "podium_method_received_bytes_total",
                  "podium_method_sent_bytes_total", "podium_worker_up", "podium_node_gpu_memory_used_bytes"):
        assert shown in text, shown


def test_every_query_reads_metrics_podium_exports():
    exported = _exported()
    assert "podium_method_call_seconds_bucket" in exported and "podium_scheduler_rpcs_total" in exported
    read = set()
    for expr in dashboards.queries(dashboards.load()):
        names = dashboards.metric_names(expr)
        assert names, f"a query that reads no metric: {expr}"
        read |= names
    assert read <= exported, f"not exported by Podium: {sorted(read - exported)}"
