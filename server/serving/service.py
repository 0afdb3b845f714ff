"""The model service every protocol runs through: the model cache, a micro-batcher per leader pipeline, the
thread pool that runs forward passes, and `infer` (admission, the pending count, the deadline, the model's errors
worded by the calling protocol; a model that fails to load is its protocol's 424)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hfport import set_num_threads_here
from hfport.errors import HfportError

from ..settings import Settings
from .admission import Answers, check_inputs
from .batching import Batcher, Timing
from .cache import ModelCache, ModelLoadError
from .records import ModelRecord


class ModelService:
    def __init__(self, settings: Settings, metrics: Any = None, trusted: Callable[[str], bool] | None = None):
        """`trusted(folder)`: whether a model folder is read as a whole, its files unchecked (ModelCache)."""
        self.settings = settings
        self.metrics = metrics  # server.metrics.Metrics, or None
        # each predict thread on its share of the cores (the process's intra-op threads divided among them): two
        # busy predict threads with the process's 2 threads each would put 4 OpenMP threads on 2 cores
        self.pool = ThreadPoolExecutor(settings.predict_threads, thread_name_prefix="hfport-predict",
                                       initializer=set_num_threads_here, initargs=(None, settings.predict_threads))
        self.cache = ModelCache(settings, metrics, trusted)
        self._batchers: dict[tuple[str, str], Batcher] = {}  # (model folder, task): a leader's one batcher
        self.pending = 0  # requests admitted and not answered yet (waiting for a model or in a call)

    @property
    def loaded(self) -> int:
        return len(self.cache)

    def load(self, record: ModelRecord) -> Any:
        """The loaded, warmed-up pipeline of `record` (blocking: start-up preloading, tests)."""
        return self.cache.get(record)

    async def get(self, record: ModelRecord) -> Any:
        """The loaded pipeline, loading it in the pool if needed."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.cache.get, record)

    def memory(self) -> dict[ModelRecord, int]:
        return self.cache.memory()

    def evict(self, name: str) -> None:
        self.cache.evict(name)

    async def predict(self, record: ModelRecord, items: list[Any], parameters: dict[str, Any]) -> list:
        return (await self.predict_timed(record, items, parameters))[0]

    async def predict_timed(self, record: ModelRecord, items: list[Any],
                            parameters: dict[str, Any]) -> tuple[list, Timing]:
        """The items' results through the micro-batcher of the record's leader (its own pipeline, or for an
        adapter its base's: requests for the base and any of its adapters, with any options, share forward
        passes), and where the request's time went."""
        pipe = await self.get(record)
        leader = getattr(pipe, "leader", None) or pipe
        key = (record.base or record.path, record.task)
        batcher = self._batchers.get(key)
        if batcher is None or batcher.pipe is not leader:  # first use, or the leader was evicted and reloaded
            batcher = self._batchers[key] = Batcher(leader, self.pool, self.settings,
                                                    record.name if leader is pipe else Path(key[0]).name,
                                                    self.metrics)
        return await batcher.submit(items, parameters, getattr(pipe, "adapter_name", None))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def infer(service: ModelService, record: ModelRecord, items: list[Any], params: dict[str, Any],
                answers: Answers, field: str = "inputs") -> tuple[list[Any], Timing]:
    """Run items through the record's pipeline, as every protocol does: admission (count, size, waiting requests),
    the deadline, the model's errors worded by `answers`. Failed items come back as ItemError, for the protocol to
    render in place or to fail the request with, in its own words."""
    settings = service.settings
    check_inputs(items, settings, answers, field)
    if service.pending >= settings.predict_max_pending:
        raise answers.overloaded.error(headers={"Retry-After": "1"}, pending=service.pending)
    service.pending += 1
    try:
        results, timing = await asyncio.wait_for(service.predict_timed(record, items, params),
                                                 settings.predict_timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise answers.timeout.error(seconds=settings.predict_timeout_s) from e
    except ModelLoadError as e:  # the native route loads here (TEI's and OpenAI's loaded in `served`)
        raise answers.unservable.error(model=record.name, reason=f"failed to load: {e}") from e
    except HfportError as e:
        raise answers.backend.error(model=record.name, error=e, error_kind=type(e).__name__) from e
    except (ValueError, TypeError) as e:  # options the pipeline refuses
        raise answers.options.error(error=e) from e
    finally:
        service.pending -= 1
    return results, timing
