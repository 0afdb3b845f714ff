"""What every task pipeline shares: options, per-item errors, and batching under a token budget.

A call runs in four steps, each task filling in the parts marked (task):
  1. normalize: the call's inputs become a list of items, and whether the caller gave a single one (task).
  2. preprocess: each item becomes one or more Features, the token rows the model sees (task: preprocess, or
     preprocess_many for many at once). A bad item (empty text, no mask token, too long for the model, ...)
     becomes an error for that item only. The items sharing a pipeline and options go to its preprocess_many
     together: a task of texts tokenizes them in one tokenizer call (encode_many), which gives each the rows, and
     each bad one the error, of a call of its own.
  3. forward: every Feature of the call is sorted by length and packed into batches of at most `batch_size` rows
     and `max_batch_tokens` padded tokens (`pack_rows`); each batch runs through the model once (task: which outputs), or as row
     shards on worker threads (`row_shards`, shards.py); what the rows need of the outputs (device_outputs: e.g.
     pooled sentence vectors) comes to the host in one copy each, cut back to each row's own length, so a result
     never depends on its batch-mates.
  4. postprocess: each item's outputs become its result, in input order (task).
A caller that forms its own batches (the server packs the rows of concurrent requests into one forward pass) runs the
steps itself: `prepare` (1-2 for a list), `forward_rows` (3, one pass over exactly the rows it is given), `finish`
(4); `predict` is the three with `batches` between them.
Items that failed come back as an `ItemError` (message, error_type) in their place when the call gave a list; a
single input raises its error instead. The CLI and the HTTP API render an ItemError with its position in the list
as `{"error": "input i: ...", "error_type": ..., "index": i}` (ItemError.to_dict).

Adapters: `add_adapter(name, folder)` puts a LoRA adapter (PEFT's folder) over the pipeline's model without
reloading it; a call's `adapter=` (a name for every item, or a list with one name or None per item) picks each
item's adapter. Each item is prepared and read by its adapter's own pipeline (its tokenizer, head and labels); a
batch of rows with different adapters runs the shared body once, each row with its own LoRA update
(hfport.lora.AdapterSet), and each adapter's head on its own rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import HfportError, ItemError
from ..inference import for_inference
from ..lora import AdapterSet, LoraError
from ..modeling import PreTrainedEncoder, max_positions
from ..tokenizer import AutoTokenizer, PreTrainedTokenizer, TokenizerError, has_tokenizer_files
from . import shards
from .shards import check_row_shards

log = logging.getLogger("hfport")

DEFAULT_MAX_BATCH_TOKENS = 16384  # padded tokens per forward pass: bounds activation memory, not row count

class PipelineInputError(HfportError, ValueError):
    """One input the pipeline cannot answer; the message says which and why."""


class InputTooLongError(PipelineInputError):
    """An input with more tokens than the model takes (and no truncation asked for): its count and the limit, so a
    protocol can word the refusal in its own terms (its failed item's error_type is this class's name)."""

    def __init__(self, tokens: int, limit: int, hint: str):
        super().__init__(f"{tokens} tokens, but the model takes at most {limit}; {hint}")
        self.tokens, self.limit = tokens, limit


# one option, two spellings: transformers' pipelines say truncation=, TEI and sentence-transformers say truncate=;
# a pipeline takes either under the name it declares (its `defaults`)
TRUNCATION_SPELLINGS = {"truncate": "truncation", "truncation": "truncate"}


@dataclass(frozen=True)
class InvalidInput:
    """Stands in for an input its reader could not decode, so it keeps its place and gets its error."""

    reason: str


@dataclass
class Feature:
    """One row for the model: an item's tokens (an item with a long text or context may have several rows)."""

    item: int  # index of the input this row belongs to
    input_ids: list[int]
    attention_mask: list[int]
    token_type_ids: list[int] | None
    data: dict[str, Any] = field(default_factory=dict)  # what postprocess needs: offsets, encodings, masks
    outputs: dict[str, Tensor] = field(default_factory=dict)  # filled by the forward step, CPU float32
    pipe: Any = field(default=None, repr=False, compare=False)  # the pipeline of the row's adapter (None: the call's)
    error: Exception | None = field(default=None, repr=False, compare=False)  # set by the forward step if it failed


@dataclass
class Prepared:
    """A list of items made into rows for the model (Pipeline.prepare). Whoever batches runs `rows` in forward passes
    of its choosing (Pipeline.forward_rows) and then reads the results (Pipeline.finish)."""

    items: list[Any]
    members: list[tuple[Pipeline, dict[str, Any]]]  # each item's pipeline (its adapter's, else the call's), options
    rows: list[Feature]  # the rows of the items that did not fail, in item order
    failed: dict[int, Exception]  # item index -> why it failed before the model saw it


def check_text(text: Any, what: str = "text") -> str:
    if not isinstance(text, str):
        raise PipelineInputError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise PipelineInputError(f"{what} is empty or only whitespace")
    return text


class Pipeline:
    """Base class: a task model, its tokenizer, and the batching settings."""

    task: ClassVar[str]  # the canonical task name: its record (hfport/tasks/) names the model class to load
    model_task: ClassVar[str]  # the same name (the model's task is the pipeline's), kept for older callers

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "model_task" not in cls.__dict__:  # a pipeline over another task's model names that task itself
            cls.model_task = cls.task
    defaults: ClassVar[dict[str, Any]]  # call options and their defaults, as transformers names them
    token_outputs: ClassVar[tuple[str, ...]] = ()  # forward outputs with a token axis, cut to each row's length
    # pipeline() sets it where the folder lacks the task's head (loaded for its adapters, which bring theirs): every
    # call that would answer with this pipeline's own head raises it
    untrained_head: Exception | None = None

    def __init__(self, model: PreTrainedEncoder, tokenizer: PreTrainedTokenizer, *, batch_size: int | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, packed_linear: bool = True,
                 row_shards: str | int = "auto", **options: Any):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
        check_bool("packed_linear", packed_linear)
        # the model serves inference from here on: eval mode and the inference step (hfport/inference.py)
        self.packed_linear = packed_linear
        self.model = for_inference(model, packed_linear=self.packed_linear) if isinstance(model, nn.Module) \
            else model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.row_shards = check_row_shards(row_shards)  # a batch's rows split over worker threads (shards.py)
        self.options = self.check_options(options)  # pipeline-level defaults for every call
        self.max_positions = model_max_positions(model)
        self.adapters: dict[str, Pipeline] = {}  # adapter name -> its pipeline over this pipeline's body
        self.leader: Pipeline | None = None  # an adapter's pipeline: the one it was added to, which batches it
        self.adapter_name: str | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task={self.task!r}, model={self.model.family.model_type}, "
                f"device={self.model.device}, dtype={self.model.dtype}, batch_size={self.batch_size}, "
                f"packed_linear={self.packed_linear}, row_shards={self.row_shards!r})")

    # --- options ------------------------------------------------------------------------------------------

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = self.spelled(options)
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ValueError(f"{self.task}: unknown option(s) {unknown}; valid: {sorted(self.defaults)}")
        for name, value in options.items():
            if isinstance(self.defaults[name], bool):  # a switch (return_tensors, normalize...); None: its default
                check_bool(f"{self.task}: {name}", value, allow_none=True)
        return options

    def spelled(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with truncate/truncation under the spelling this pipeline declares; both spellings with two
        values is an error naming them."""
        out: dict[str, Any] = {}
        for key, value in options.items():
            name = key if key in self.defaults else TRUNCATION_SPELLINGS.get(key, key)
            if name in out and out[name] != value:
                other = next(k for k in options if k != key and (k == name or TRUNCATION_SPELLINGS.get(k) == name))
                raise ValueError(f"{self.task}: {other}={options[other]!r} and {key}={value!r} are one option "
                                 f"({name}) spelled two ways; give one")
            out[name] = value
        return out

    def resolve_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults < pipeline-level options < call options, then the task's own checks (given: what was set)."""
        options = self.check_options(options)
        given = {**self.options, **options}
        return self.validate({**self.defaults, **given}, given)

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        return opts

    # --- the steps a task fills in ------------------------------------------------------------------------

    single_input: tuple[type, ...] = (str,)  # what one input is; a list or tuple of them is a batch
    input_description = "a text or a list of texts"

    def normalize(self, inputs: Any, opts: dict[str, Any]) -> tuple[list[Any], bool]:
        """(items, whether the caller gave a single input)."""
        if isinstance(inputs, self.single_input):
            return [inputs], True
        if isinstance(inputs, (list, tuple)):
            return list(inputs), False
        raise ValueError(f"{self.task} takes {self.input_description}; got {type(inputs).__name__}")

    def sample_inputs(self, texts: list[str], pairs: list[tuple[str, str]]) -> list[Any]:
        """This task's inputs made of TEXTS and PAIRS (e.g. the int8 gate's judged ones, or a user's gate data): what
        dtype="auto-int8" times each int8 path on (export/int8_choice.py). Here the texts and the pairs' second
        halves (their passages); a task whose inputs are not plain texts makes its own."""
        return texts + [second for _, second in pairs]

    @classmethod
    def check_sample_options(cls, options: dict[str, Any]) -> None:
        """Raise where sample_inputs could not make calls of this task under pipeline()'s OPTIONS (a task whose calls
        need an option, such as zero-shot's candidate_labels): dtype="auto-int8" asks before it exports anything."""

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        """One item's rows (task); a task that overrides preprocess_many answers with `alone`."""
        raise NotImplementedError

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        """Each item's rows, or the exception that fails it alone, for items that share this pipeline and `opts`
        (task). Here one preprocess call per item; a task whose items are texts tokenized alike overrides it to
        tokenize them in one call (encode_items), which the fast tokenizer runs in parallel."""
        return [attempt(self.preprocess, item, opts) for item in items]

    def alone(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        """preprocess_many on ITEM alone, its error raised: the preprocess of a task whose preprocess_many is its
        own, so that one path prepares items (a text alone is tokenized by a call of its own)."""
        (rows,) = self.preprocess_many([item], opts)
        if isinstance(rows, Exception):
            raise rows
        return rows

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        """The task's outputs on a batch; encoder_outputs: the body's (hidden, pooled) on these rows when already
        computed (a mixed-adapter batch), handed to the model instead of running its body again."""
        raise NotImplementedError

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        raise NotImplementedError

    def assemble(self, results: list[Any], items: list[Any], single: bool, opts: dict[str, Any]) -> Any:
        return results[0] if single else results

    # --- the call -----------------------------------------------------------------------------------------

    def __call__(self, inputs: Any = None, *, adapter: Any = None, **options: Any) -> Any:
        opts = self.resolve_options(options)
        items, single = self.normalize(inputs, opts)
        results = self.run(items, opts, self.members(adapter, len(items), options))
        if single and isinstance(results[0], _Failed):
            raise results[0].error
        return self.assemble([r.item if isinstance(r, _Failed) else r for r in results], items, single, opts)

    def predict(self, items: list[Any], *, adapter: Any = None, **options: Any) -> list[Any]:
        """One result per item, in order, with list semantics for every task (no single-input unwrapping): a
        failed item is an ItemError. What the CLI calls (the server runs the steps: prepare, forward_rows, finish)."""
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"predict takes a list of inputs, got {type(items).__name__}")
        opts = self.resolve_options(options)
        members = self.members(adapter, len(items), options)
        return [r.item if isinstance(r, _Failed) else r for r in self.run(list(items), opts, members)]

    # --- adapters -----------------------------------------------------------------------------------------

    def add_adapter(self, name: str, folder: str | Any, tokenizer: Any = None) -> Pipeline:
        """Serve the LoRA adapter `folder` as `name` over this pipeline's model (not reloaded; a name added again is
        replaced). Its pipeline: the adapter's head, its tokenizer (its folder's, else this pipeline's)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        if not isinstance(self.model, PreTrainedEncoder):  # an ONNX graph is fixed: no LoRA layers to route through
            # a LoraError (a ValueError): the server answers it as a model that cannot load, not as a crash
            raise LoraError(f"adapter {name!r}: the {type(self.model).__name__} backend runs a fixed graph; serve "
                            "adapters on the torch backend")
        if tokenizer is None:
            tokenizer = folder if has_tokenizer_files(folder) else self.tokenizer
        if not isinstance(tokenizer, PreTrainedTokenizer):  # read first: a broken file leaves nothing installed
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        adapters = self.model.adapter_set
        created = adapters is None
        if created:
            adapters = AdapterSet(self.model)

        def build(model: PreTrainedEncoder) -> Pipeline:  # before the set installs the adapter (AdapterSet.load)
            return type(self)(model, tokenizer, batch_size=self.batch_size, max_batch_tokens=self.max_batch_tokens,
                              packed_linear=self.packed_linear, row_shards=self.row_shards, **self.options)

        try:
            member = adapters.load(name, folder, type(self.model), build)
        except BaseException:
            if created:  # the base as it was: no set of adapters
                self.model.adapter_set = None
            raise
        member.leader, member.adapter_name = self, name
        self.adapters = {**self.adapters, name: member}  # replaced, not edited: a call in flight keeps its view
        return member

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r}; adapters: {sorted(self.adapters)}")
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}
        self.model.adapter_set.remove(name)

    def members(self, adapter: Any, count: int, options: dict[str, Any]) -> list[tuple[Pipeline, dict]] | None:
        """Each item's pipeline and resolved options under `adapter=` (one name, or a list with a name or None per
        item; None: this pipeline's own model). None when no adapter is named."""
        names = None if adapter is None else list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * count
        if self.untrained_head is not None and (names is None or None in names):
            raise type(self.untrained_head)(f"{self.untrained_head} Its adapters bring their own heads: name one with "
                                            f"adapter= (adapters: {sorted(self.adapters)})")
        if names is None:
            return None
        if len(names) != count:
            raise ValueError(f"adapter: {len(names)} names for {count} inputs; give one name, or one per input")
        adapters, chosen = self.adapters, {}
        for name in dict.fromkeys(names):
            if name is not None and name not in adapters:
                raise ValueError(f"adapter {name!r} is not loaded; adapters: {sorted(adapters)}")
            pipe = self if name is None else adapters[name]
            chosen[name] = (pipe, pipe.resolve_options(options))
        return [chosen[name] for name in names]

    # --- the run ------------------------------------------------------------------------------------------

    def prepare(self, items: list[Any], *, adapter: Any = None, **options: Any) -> Prepared:
        """Steps 1-2 for a list of items, as predict runs them: options resolved (a bad option raises), each item made
        into its rows (a bad item fails alone)."""
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"prepare takes a list of inputs, got {type(items).__name__}")
        opts = self.resolve_options(options)
        return self.rows_of(list(items), self.members(adapter, len(items), options) or [(self, opts)] * len(items))

    def finish(self, prepared: Prepared) -> list[Any]:
        """Step 4, once every row of `prepared` went through forward_rows: one result per item, in order, a failed
        item an ItemError."""
        return [r.item if isinstance(r, _Failed) else r for r in self.outcomes(prepared)]

    def run(self, items: list[Any], opts: dict[str, Any],
            members: list[tuple[Pipeline, dict]] | None = None) -> list[Any]:
        """Results (or _Failed) in input order; `members`: each item's pipeline and options (None: this one's)."""
        prepared = self.rows_of(items, members or [(self, opts)] * len(items))
        for batch in self.batches(prepared.rows):
            self.forward_rows(batch)
        return self.outcomes(prepared)

    def rows_of(self, items: list[Any], members: list[tuple[Pipeline, dict]]) -> Prepared:
        """Each item's rows, by its own pipeline and options: the items sharing a pipeline and options prepared in one
        preprocess_many call. Any error while preparing one item fails that item only: expected ones
        (PipelineInputError, TokenizerError) quietly, anything else with its traceback logged."""
        failed: dict[int, Exception] = {}
        groups: dict[tuple[int, int], list[int]] = {}  # (pipeline, options) -> its items, in order
        for i, item in enumerate(items):
            if isinstance(item, InvalidInput):  # rejected before it got here (e.g. an unreadable line)
                failed[i] = PipelineInputError(item.reason)
            else:
                groups.setdefault((id(members[i][0]), id(members[i][1])), []).append(i)
        rows_by_item: dict[int, list[Feature]] = {}
        for indices in groups.values():
            pipe, popts = members[indices[0]]
            for i, rows in zip(indices, pipe.preprocess_many([items[i] for i in indices], popts)):
                if isinstance(rows, Exception):
                    failed[i] = self._item_error(i, rows)
                    continue
                try:
                    for row in rows:
                        row.item, row.pipe = i, pipe
                        pipe.check_length(row)
                    rows_by_item[i] = rows
                except Exception as e:  # noqa: BLE001 - one bad item must not sink the batch
                    failed[i] = self._item_error(i, e)
        features = [f for i in sorted(rows_by_item) if i not in failed for f in rows_by_item[i]]
        return Prepared(items, members, features, failed)

    def outcomes(self, prepared: Prepared) -> list[Any]:
        """Each item's result (or _Failed: its preprocess, a row's forward pass or its postprocess failed)."""
        failed = dict(prepared.failed)
        by_item: dict[int, list[Feature]] = {}
        for f in prepared.rows:
            by_item.setdefault(f.item, []).append(f)
            if f.error is not None:
                failed.setdefault(f.item, f.error)
        results: list[Any] = []
        for i, item in enumerate(prepared.items):
            pipe, popts = prepared.members[i]
            if i not in failed:
                try:
                    results.append(pipe.postprocess(item, by_item.get(i, []), popts))
                    continue
                except Exception as e:  # noqa: BLE001
                    failed[i] = self._item_error(i, e)
            error = failed[i]
            results.append(_Failed(error, ItemError(str(error), type(error).__name__)))
        return results

    def _item_error(self, index: int, error: Exception) -> Exception:
        if not isinstance(error, (PipelineInputError, TokenizerError)):
            log.warning("%s: input %d failed unexpectedly", self.task, index, exc_info=error)
        return error

    def check_length(self, row: Feature) -> None:
        n = len(row.input_ids)
        if self.max_positions is not None and n > self.max_positions:
            raise InputTooLongError(n, self.max_positions, self.too_long_hint())

    def too_long_hint(self) -> str:
        return "pass truncation=True (and max_length=...) to cut it"

    # --- batching -----------------------------------------------------------------------------------------

    def batches(self, features: list[Feature]) -> list[list[Feature]]:
        """A call's rows as its forward passes: pack_rows under this pipeline's batch_size and max_batch_tokens."""
        return pack_rows(features, self.max_batch_tokens, self.batch_size)

    def forward_rows(self, rows: list[Feature]) -> None:
        """Run `rows` as one forward pass, as given (the caller formed the batch: `batches` for a call, the server's
        batcher across requests); fills each row's outputs. A pass that fails is retried row by row, so one bad row
        fails alone (its `error`)."""
        try:
            self.forward_batch(rows)
        except (RuntimeError, IndexError, ValueError) as e:
            if len(rows) == 1:
                rows[0].error = PipelineInputError(f"the model failed on this input: {e}")
            else:
                log.warning("%s: a batch of %d rows failed (%s); retrying row by row", self.task, len(rows), e)
                for f in rows:
                    try:
                        self.forward_batch([f])
                    except (RuntimeError, IndexError, ValueError) as e:
                        f.error = PipelineInputError(f"the model failed on this input: {e}")

    @torch.no_grad()
    def forward_batch(self, batch: list[Feature]) -> None:
        """One forward pass over `batch`; rows of several adapters run the shared body once and each adapter's
        head on its own rows (the body's output on them handed to its model as `encoder_outputs`)."""
        pipes = {id(f.pipe or self): f.pipe or self for f in batch}
        if len(pipes) == 1:
            (pipe,) = pipes.values()
            parts = self.shard_parts(batch)
            if len(parts) == 1:
                self.scatter(batch, pipe.forward(*self.batch_tensors(batch)), pipe)
            else:  # each part a batch of its own on a worker thread (shards.py); its rows get its outputs
                shards.run([lambda part=part: self.scatter(part, pipe.forward(*self.batch_tensors(part)), pipe)
                            for part in parts])
            return
        # rows of one length sorted by adapter: each adapter's rows of a length, and so their tokens in the packed
        # layout, are one run, which an adapted layer computes with that adapter's rank only (nn/lora.py's
        # Segments). Length first: packed attention runs equal lengths together, and costs more cut finer
        batch = sorted(batch, key=lambda f: (-len(f.input_ids), (f.pipe or self).model.adapter_slot))
        ids, mask, types = self.batch_tensors(batch)
        slots = torch.tensor([(f.pipe or self).model.adapter_slot for f in batch], device=ids.device)  # (B,)
        hidden, pooled = self.model.adapter_set.run_body(slots, ids, mask, types)  # (B, T, C), (B, C) | None
        for pipe in pipes.values():
            rows = [r for r, f in enumerate(batch) if (f.pipe or self) is pipe]
            index = torch.tensor(rows, device=ids.device)  # (B_a,)
            sub = (ids.index_select(0, index), mask.index_select(0, index),
                   types.index_select(0, index) if types is not None else None)
            outputs = (hidden.index_select(0, index), pooled.index_select(0, index) if pooled is not None else None)
            self.scatter([batch[r] for r in rows], pipe.forward(*sub, encoder_outputs=outputs), pipe)

    def shard_parts(self, batch: list[Feature]) -> list[list[Feature]]:
        """The batch as the row shards `row_shards` asks for (shards.py): contiguous parts balanced by real tokens,
        or the whole batch in one part."""
        if (len(batch) < 2 or not isinstance(self.model, nn.Module) or self.model.device.type != "cpu"
                or shards.busy_thread()):  # CUDA runs a batch whole; ONNX graphs thread in onnxruntime
            return [batch]
        weights = [sum(f.attention_mask) for f in batch]  # real tokens per row
        parts = shards.shard_count(self.row_shards, len(batch), sum(weights), self.model.dtype)
        if parts < 2:
            return [batch]
        return [batch[a:b] for a, b in shards.split_rows(weights, parts)]

    def device_outputs(self, batch: list[Feature], outputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """What of a batch's forward outputs comes to the host: all of them here; a task whose rows need less
        reduces them on the model's device first (sentence embeddings: pooled (B, C) instead of (B, T, C))."""
        return outputs

    def scatter(self, batch: list[Feature], outputs: dict[str, Tensor], pipe: Pipeline) -> None:
        """Each row's outputs, cut back to its own length where they have a token axis. Each output (of what
        device_outputs keeps) comes to the host once for the batch (on a GPU, one copy and one wait per output, not
        one per row)."""
        host = {k: v.float().cpu() for k, v in pipe.device_outputs(batch, outputs).items()}
        for row, f in enumerate(batch):
            n = len(f.input_ids)
            f.outputs = {k: v[row, :n] if k in pipe.token_outputs else v[row] for k, v in host.items()}

    def batch_tensors(self, batch: list[Feature]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The batch's ids, attention mask and token types, (B, T) each, right-padded, on the model's device."""
        device = self.model.device
        t = max(len(f.input_ids) for f in batch)
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(batch), t), pad, dtype=torch.long)  # (B, T), right-padded
        mask = torch.zeros(len(batch), t, dtype=torch.long)  # (B, T)
        with_types = batch[0].token_type_ids is not None
        types = torch.zeros(len(batch), t, dtype=torch.long) if with_types else None  # (B, T)
        for row, f in enumerate(batch):
            n = len(f.input_ids)
            ids[row, :n] = torch.tensor(f.input_ids)
            mask[row, :n] = torch.tensor(f.attention_mask)
            if types is not None:
                types[row, :n] = torch.tensor(f.token_type_ids)
        # non_blocking: on a GPU the copies queue behind the work in flight instead of waiting for it
        return (ids.to(device, non_blocking=True), mask.to(device, non_blocking=True),
                types.to(device, non_blocking=True) if types is not None else None)

    # --- helpers for tasks --------------------------------------------------------------------------------

    def encode(self, *args: Any, **kwargs: Any) -> list[Feature]:
        """Tokenize one item into its rows (several when it overflows into windows)."""
        return self.features_of(self.tokenizer_call(self.tokenizer, *args, **kwargs), 1)[0]

    def encode_items(self, items: list[Any], text_of: Any, tokenizer: Any = None,
                     **kwargs: Any) -> list[list[Feature] | Exception]:
        """encode_many over `items`: text_of(item) gives an item's (text, pair or None), or raises for an item that
        is not one (its exception fails it alone)."""
        texts = [attempt(text_of, item) for item in items]
        good = [i for i, t in enumerate(texts) if not isinstance(t, Exception)]
        encoded = self.encode_many([texts[i][0] for i in good], [texts[i][1] for i in good], tokenizer, **kwargs)
        out: list[Any] = texts
        for i, rows in zip(good, encoded):
            out[i] = rows
        return out

    def encode_many(self, texts: list[str], pairs: list[str | None] | None = None, tokenizer: Any = None,
                    **kwargs: Any) -> list[list[Feature] | Exception]:
        """encode for each text (with its pair, if any): the same rows, from one tokenizer call for the texts alone
        and one for the pairs instead of one call per text. A batched call that fails is redone text by text, so
        only the text that fails gets its error (the one encode gives). `tokenizer`: another tokenizer than the
        pipeline's (a copy truncating on the other side)."""
        tokenizer = tokenizer or self.tokenizer
        pairs = pairs or [None] * len(texts)
        done: dict[int, list[Feature] | Exception] = {}
        # padding=True pads to a call's longest row: batched, a text would get padding it does not get alone
        if kwargs.get("padding") not in (True, "longest"):
            # the tokenizer takes an empty pair as none (`if text_pair`), so "" goes with the texts alone here too
            for paired in (False, True):
                call = [i for i, p in enumerate(pairs) if bool(p) == paired]
                if len(call) < 2:
                    continue
                args = [[texts[i] for i in call]] + ([[pairs[i] for i in call]] if paired else [])
                try:
                    enc = self.tokenizer_call(tokenizer, *args, **kwargs)
                except Exception:  # noqa: BLE001 - redone one by one below: the failing text gets its own error
                    continue
                done.update(zip(call, self.features_of(enc, len(call))))

        def one(i: int) -> list[Feature]:
            return self.features_of(self.tokenizer_call(tokenizer, texts[i], pairs[i], **kwargs), 1)[0]
        return [done[i] if i in done else attempt(one, i) for i in range(len(texts))]

    def tokenizer_call(self, tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        return tokenizer(*args, return_token_type_ids="token_type_ids" in tokenizer.model_input_names,
                         return_attention_mask=True, **kwargs)

    @staticmethod
    def features_of(enc: Any, count: int) -> list[list[Feature]]:
        """The rows of each of the `count` inputs of one tokenizer call (BatchEncoding `enc`), in input order."""
        if enc["input_ids"] and isinstance(enc["input_ids"][0], int):  # one input, one row: no batch axis
            enc = {k: [v] for k, v in enc.items()} | {"_encodings": enc.encodings}
        else:
            enc = dict(enc) | {"_encodings": enc.encodings}
        # overflowing windows: each row names its input; else row r is input r
        owners = enc.get("overflow_to_sample_mapping", range(len(enc["input_ids"])))
        out: list[list[Feature]] = [[] for _ in range(count)]
        for r, owner in enumerate(owners):
            data = {k: enc[k][r] for k in ("offset_mapping", "special_tokens_mask") if k in enc}
            data["encoding"] = enc["_encodings"][r]
            out[owner].append(Feature(item=-1, input_ids=enc["input_ids"][r], attention_mask=enc["attention_mask"][r],
                                      token_type_ids=enc["token_type_ids"][r] if "token_type_ids" in enc else None,
                                      data=data))
        return out


def attempt(fn: Any, *args: Any) -> Any:
    """fn(*args), or the exception it raised: one item's outcome, kept in its place among the others'."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the caller fails that item alone
        return e


def pack_rows(rows: list[Feature], max_tokens: int, max_rows: int | None = None) -> list[list[Feature]]:
    """Rows packed into forward passes: longest first; a pass stops at `max_rows` rows (None: no limit) or
    `max_tokens` padded tokens (rows x its longest row)."""
    order = sorted(rows, key=lambda f: len(f.input_ids), reverse=True)
    out: list[list[Feature]] = []
    for f in order:
        if out:
            batch = out[-1]
            count = len(batch) + 1
            padded = count * len(batch[0].input_ids)  # the first row is the batch's longest
            if (max_rows is None or count <= max_rows) and padded <= max_tokens:
                batch.append(f)
                continue
        out.append([f])
    return out


@dataclass
class _Failed:
    """Inside a call: the exception (raised for a single input) and the ItemError a list gets in its place."""

    error: Exception
    item: ItemError


def model_max_positions(model: PreTrainedEncoder) -> int | None:
    """How many tokens the model's absolute position table holds (None: no such limit)."""
    return max_positions(model.body)


def softmax_np(x: Any) -> Any:
    """transformers' numpy softmax over the last axis (max-shifted)."""
    shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def sigmoid_np(x: Any) -> Any:
    return 1.0 / (1.0 + np.exp(-x))


def check_bool(name: str, value: Any, allow_none: bool = False) -> None:
    """A switch must be a bool: a string such as "no" or "false" is truthy, and would turn it on."""
    if not (isinstance(value, bool) or (value is None and allow_none)):
        raise ValueError(f"{name}={value!r}: expected True or False{' (or None: the default)' if allow_none else ''}")


def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")

