"""Observability: OpenTelemetry traces, Prometheus metrics, and `specdec traces` reading.

Modules: names (span/attribute names), tracing (providers, exporters), file_exporter
(OTLP/JSON lines), propagation (gRPC interceptors), round_tracer (request and round
spans), metrics (Prometheus), observe + service (what the services call), settings
(flags), reader + render (`specdec traces`). Import the submodule you need; this package
imports nothing so `specdec traces` stays free of torch and gRPC.
"""
