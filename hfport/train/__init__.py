"""Fine-tuning: `finetune(config)` (the loop), `preflight(config)` (its checks, also run by the server before it
queues a job), `FinetuneConfig` and `resolve_config` (defaults < file < flags)."""

from .config import FinetuneConfig, resolve_config
from .loop import finetune
from .preflight import Preflight, preflight

__all__ = ["FinetuneConfig", "Preflight", "finetune", "preflight", "resolve_config"]
