"""Fine-tuning: `finetune(config)` (the loop), `preflight(config)` (its checks, also run by the server before it
queues a job), `FinetuneConfig` and `resolve_config` (defaults < file < flags); the monitor's pieces the server reads
(metrics.jsonl reading and CSV, the resource sampler, the shared chart script)."""

from .config import FinetuneConfig, resolve_config
from .loop import finetune
from .monitor import PERF, ResourceSampler, charts_js, metrics_csv, read_metrics
from .preflight import Preflight, preflight

__all__ = ["PERF", "FinetuneConfig", "Preflight", "ResourceSampler", "charts_js", "finetune", "metrics_csv", "preflight",
           "read_metrics", "resolve_config"]
