"""The model cache: pipelines loaded once, warmed up, and kept in an LRU bounded by count and by weight memory,
keyed by ModelRecord.

Adapters mix: every model folder F is loaded once per task T as a *leader* pipeline (a plain record of F serves
through it), and every LoRA adapter over F (a record with base F) is added to that leader (Pipeline.add_adapter),
so the leader's batcher runs requests for the base and for any of its adapters in one forward pass. All leaders of
one folder share one body (hfport.lora.AdapterSet): loading or dropping an adapter never reloads the base."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from hfport import PreTrainedEncoder, packed_bytes, pipeline, tasks, tune_batch_tokens
from hfport.errors import HfportError
from hfport.lora import AdapterSet
from hfport.pipelines import refuse_untrained_head

from ..errors import ApiError
from ..security import confine_files
from ..settings import Settings
from .records import ModelRecord

log = logging.getLogger("hfport.server.serving")


def _bytes(t: Any) -> int:
    """A weight's bytes, with its packed inference copy once inference built one (hfport.packed_bytes)."""
    return t.numel() * t.element_size() + packed_bytes(t)


def weight_bytes(pipe: Any) -> int:
    """Memory held by a pipeline's model weights and buffers (and the packed copies of its Linear weights)."""
    model = pipe.model
    return sum(_bytes(t) for t in (*model.parameters(), *model.buffers()))


def total_weight_bytes(pipes: Iterable[Any]) -> int:
    """Memory held by the pipelines' weights together: a tensor several adapters share counts once."""
    seen: dict[int, int] = {}
    for pipe in pipes:
        for t in (*pipe.model.parameters(), *pipe.model.buffers()):
            seen[t.data_ptr()] = _bytes(t)
    return sum(seen.values())


def _group(record: ModelRecord) -> tuple[str, str]:
    """The leader a record is served by: (model folder, task); an adapter's is its base's."""
    return record.base or record.path, record.task


class ModelLoadError(Exception):
    """A registered model that failed to load for a reason outside hfport's own checks (an I/O error reading its
    files, a runtime's RuntimeError such as out of memory at warm-up): the protocol answers it as a model it cannot
    serve (424), naming the model and the cause; nothing of the failed load stays cached and the other models serve
    on. The original is `cause` (and __cause__)."""

    def __init__(self, record: ModelRecord, cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause} (loading {record.path})")
        self.record, self.cause = record, cause


class ModelCache:
    """Thread-safe: concurrent loads of one record wait for the first; the newest pipeline always stays."""

    def __init__(self, settings: Settings, metrics: Any = None, trusted: Callable[[str], bool] | None = None):
        self.settings = settings
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.trusted = trusted or (lambda folder: False)  # folders read as a whole, unchecked (`serve --model`)
        self.tuning: dict[ModelRecord, Any] = {}  # record -> hfport.embeddings.BatchTuning
        self._pipes: OrderedDict[ModelRecord, Any] = OrderedDict()
        self._sets: dict[str, AdapterSet] = {}  # model folder -> the body its leaders and adapters share
        self._leaders: dict[tuple[str, str], Any] = {}  # (model folder, task) -> the pipeline adapters join
        self._leader_tuning: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._loading: dict[Any, threading.Lock] = {}  # a record (or a base folder) -> the gate of its one load
        self._in_flight: Counter[tuple[str, str]] = Counter()  # leader -> loads of its records under way

    def __len__(self) -> int:
        return len(self._pipes)

    def records(self) -> list[ModelRecord]:
        """The cached records, least recently used first."""
        with self._lock:
            return list(self._pipes)

    def get(self, record: ModelRecord) -> Any:
        """The pipeline for `record`: from the cache, or loaded and warmed up once (concurrent callers wait). An
        adapter's pipeline belongs to its base's leader (pipe.leader), whose batcher serves it."""
        with self._lock:
            if record in self._pipes:
                self._pipes.move_to_end(record)
                return self._pipes[record]
            gate = self._loading.setdefault(record, threading.Lock())
        with gate:
            with self._lock:
                if record in self._pipes:
                    return self._pipes[record]
                self._in_flight[_group(record)] += 1
            try:
                pipe = self._load(record)
            except BaseException as e:
                with self._lock:  # what this load brought in (an adapter's base) and no cached record uses goes
                    self._landed(record)
                    self._forget(record)
                if not isinstance(e, Exception) or isinstance(e, (ApiError, HfportError)):
                    raise  # refusals worded already: a file outside the allowed dirs, a bad model or adapter
                # any other failure (I/O, a runtime's error) is this model's alone
                log.exception("loading model %s from %s failed", record.name, record.path)
                raise ModelLoadError(record, e) from e
            with self._lock:
                self._landed(record)
                self._pipes[record] = pipe
                self._evict_over_budget()
                self._loading.pop(record, None)
            return pipe

    def _load(self, record: ModelRecord) -> Any:
        """Load `record`'s pipeline: its leader (loaded once), then for an adapter its weights added to it."""
        key = _group(record)
        leader = self._leader(*key)
        if record.base:
            self._check_files(record.path)
        if not record.base:  # a base's leader may lack the task's head (its adapters bring theirs): not to answer
            refuse_untrained_head(leader.model, record.path, leader.task)
        # an adapter joins its base's leader (a name loaded again replaces its weights): nothing reloaded
        pipe = leader.add_adapter(record.name, record.path) if record.base else leader
        self.tuning[record] = self._leader_tuning[key]
        if self.metrics is not None:
            self.metrics.batch_tokens.labels(record.name).set(leader.max_batch_tokens)
        return pipe

    def _evict_over_budget(self) -> None:  # holding the lock
        """Evict least recently used models until the rest fit model_cache_mb. The unit is a leader with the adapters
        over it (one loaded model: evicting an adapter alone frees almost nothing and its next request would load it
        again, so 8 adapters over one base thrashed a cache of 4 pipelines)."""
        budget = self.settings.model_cache_mb * 2**20
        while True:
            groups = list(dict.fromkeys(_group(r) for r in reversed(self._pipes)))[::-1]  # by last use, oldest first
            if len(groups) <= 1 or total_weight_bytes(self._pipes.values()) <= budget:
                return
            for old in [r for r in self._pipes if _group(r) == groups[0]]:
                del self._pipes[old]
                log.info("model cache: evicted %s (%s)", old.name, old.task)
                self._forget(old)

    def _landed(self, record: ModelRecord) -> None:  # holding the lock
        """A load of `record` ended (cached or failed)."""
        key = _group(record)
        self._in_flight[key] -= 1
        if not self._in_flight[key]:
            del self._in_flight[key]

    def _forget(self, record: ModelRecord) -> None:  # holding the lock
        """Drop `record`'s leader once no cached record uses it and no load of one is under way (an adapter's weights
        stay with its leader until then: a request already waiting in the leader's batcher still finds them)."""
        key = _group(record)
        if self._in_flight[key] or any(_group(r) == key for r in self._pipes):
            return
        leader = self._leaders.pop(key, None)
        self._leader_tuning.pop(key, None)
        if leader is not None and not any(k[0] == key[0] for k in self._leaders):
            self._sets.pop(key[0], None)

    def _leader(self, folder: str, task: str) -> Any:
        """The pipeline of `folder` as `task`, loaded and warmed up once (concurrent callers wait); a second task
        over the same folder runs on the first one's body."""
        key = (folder, task)
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            leader = self._leaders.get(key)
            if leader is not None:
                return leader
            self._check_files(folder)
            shared = self._sets.get(folder)
            if shared is None:
                # auto-int8 stays on hfport's engine (int8_paths): a served folder shares its body with its other
                # tasks and serves adapters, which a graph export cannot
                leader = pipeline(task, model=folder, dtype=self.settings.predict_dtype, device=self.settings.device,
                                  int8_paths=("torch",), allow_untrained_head=True)
                if isinstance(leader.model, PreTrainedEncoder):  # an ONNX graph has no body to share
                    shared = AdapterSet(leader.model)
            else:  # its own head, the shared body (the copy of the body just read is dropped)
                model = tasks.get(task).model_class.from_pretrained(folder, dtype=shared.base.dtype,
                                                                     device=shared.base.device)
                leader = pipeline(task, model=shared.adopt(model, 0), tokenizer=folder)
            tuning = self._warm_up(folder, task, leader)
            # kept once warmed up: a load that fails on the way leaves nothing behind (the next try starts over)
            if shared is not None:
                self._sets.setdefault(folder, shared)
            self._leader_tuning[key] = tuning
            self._leaders[key] = leader
            return leader

    def _check_files(self, folder: str) -> None:
        """Every file a load reads (config, weights, vocab.txt, ...) lies inside the allowed dirs, not only the
        folder (server/security.py's confine_files, 403 otherwise), checked at each load: a link may appear after
        registration. A folder the operator named at start (`serve --model`) is read as a whole: it was chosen
        outside the API, and an HF cache snapshot's files are links into the cache's blobs."""
        if not self.trusted(folder):
            confine_files(folder, self.settings, "model folder")

    def _warm_up(self, folder: str, task: str, pipe: Any) -> Any:
        """A first forward pass before the model takes requests; forward passes at each budget of
        batch_token_budgets pick the pipeline's max_batch_tokens (hfport.embeddings.tune_batch_tokens); none: the
        pipeline's own, after one warm-up pass."""
        budgets = tuple(self.settings.batch_token_budgets) or (pipe.max_batch_tokens,)
        tuning = tune_batch_tokens(pipe, budgets)
        log.info("%s (%s): max_batch_tokens=%d; padded tokens/s by budget: %s%s", folder, task,
                 tuning.chosen, {b: round(t) for b, t in tuning.throughput.items()},
                 f"; skipped {tuning.skipped}" if tuning.skipped else "")
        return tuning

    def memory(self) -> dict[ModelRecord, int]:
        with self._lock:
            return {r: weight_bytes(p) for r, p in self._pipes.items()}

    def adapter_set(self, folder: str) -> AdapterSet | None:
        """The body shared by the leaders of `folder` and the adapters over it (None: not loaded)."""
        return self._sets.get(folder)

    def evict(self, name: str) -> None:
        """Drop every pipeline of the model `name` (unregistered: its folder may change); an adapter leaves its
        leader's table (the base stays loaded and keeps serving)."""
        with self._lock:
            for record in [r for r in self._pipes if r.name == name]:
                pipe = self._pipes.pop(record)
                leader = getattr(pipe, "leader", None)
                if leader is not None and name in leader.adapters:
                    leader.remove_adapter(name)
                self._forget(record)
