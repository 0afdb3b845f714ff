"""GET /metrics in the Prometheus text format, from a registry owned by one app (several apps in one process, as
in tests, never share counters).

What is counted: requests by route template, model and status; requests waiting for a model (the queue); merged
batch sizes; time spent queued, tokenizing and in forward passes (histograms, seconds); loaded pipelines with their
weight memory; jobs by status (read from the store when scraped); the batch-token budget picked per model."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .schemas import ErrorBody

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ADAPTER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hfport_requests", "HTTP requests by route template, model and status code",
                                ["route", "model", "status"], registry=r)
        self.batch_size = Histogram("hfport_batch_size", "inputs merged into one pipeline call", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_adapters = Histogram("hfport_batch_adapters", "distinct adapters (the base counts as one) in "
                                        "one forward pass of a shared body",
                                        ["model"], buckets=ADAPTER_BUCKETS, registry=r)
        self.batch_tokens = Gauge("hfport_max_batch_tokens", "padded-token budget of a forward pass, per model",
                                  ["model"], registry=r)
        self.queue_time = Histogram("hfport_queue_duration_seconds", "time a request waited before its batch ran",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokenization_time = Histogram("hfport_tokenization_duration_seconds", "tokenizing a merged batch",
                                           ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("hfport_inference_duration_seconds", "forward passes of a merged batch",
                                        ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.request_time = Histogram("hfport_request_duration_seconds", "HTTP request handling, by route",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=r)

    def collect_from(self, app: FastAPI) -> None:
        """Gauges read from the app's state at scrape time: loaded models with their memory, jobs by status."""
        registry = self.registry

        class _State:
            def collect(self) -> Any:
                service = app.state.model_service
                queue = GaugeMetricFamily("hfport_queue_size", "inference requests waiting for or in a model call")
                queue.add_metric([], service.pending)
                yield queue
                models = GaugeMetricFamily("hfport_models_loaded", "pipelines in memory")
                models.add_metric([], service.loaded)
                yield models
                memory = GaugeMetricFamily("hfport_model_memory_bytes", "weight memory of a loaded pipeline",
                                           labels=["model", "task"])
                for record, nbytes in service.memory().items():
                    memory.add_metric([record.name, record.task], nbytes)
                yield memory
                jobs = GaugeMetricFamily("hfport_jobs", "jobs by status", labels=["status"])
                for status, n in app.state.store.count_by_status().items():
                    jobs.add_metric([status], n)
                yield jobs

        registry.register(_State())


def install(app: FastAPI, metrics: Metrics) -> None:
    """Count every request by its route template (not the raw path: ids would explode the label set)."""
    metrics.collect_from(app)

    @app.middleware("http")
    async def _count(request: Request, call_next: Any) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        template = getattr(route, "path", "unmatched")
        model = getattr(request.state, "model_name", "") or ""
        metrics.requests.labels(template, model, str(response.status_code)).inc()
        metrics.request_time.labels(template).observe(time.perf_counter() - start)
        return response


router = APIRouter(tags=["metrics"], responses={code: {"model": ErrorBody} for code in (401, 403)})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
