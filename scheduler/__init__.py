"""The Podium scheduler: one per cluster; nodes, placement groups, workers.

Modules: ``core`` (pure placement), ``state`` (the in-memory state,
:class:`~podium.scheduler.state.ClusterModel`), ``store`` (SQLite persistence),
``service`` (the gRPC Scheduler service), ``http`` (/healthz, /v1/placement,
/metrics), ``server`` (``podium scheduler`` and :func:`~podium.scheduler.server.run_scheduler`),
``client`` (:class:`~podium.scheduler.client.SchedulerClient`). Nothing is imported
here, so ``import podium.scheduler.core`` stays free of gRPC.
"""
