"""sentence-embedding: one vector per text, pooled as the folder's sentence-transformers files say (Pooling, Normalize,
max_seq_length, prompts: hfport/formats/sentence_transformers.py's read_layout), as SentenceTransformer.encode
computes it. A folder without modules.json pools by mean and does not normalize (sentence-transformers' own default
for a bare transformers checkpoint). TEI's /embed and OpenAI's embeddings serve through this pipeline.

Per-token hidden states, unpooled, are feature-extraction's (pipelines/features.py), or output="tokens" here.

A batch pools on the model's device (SentenceEmbeddingPipeline.device_outputs), so the host gets (B, C) vectors, not
(B, T, C) states; only rows that need their states (output="tokens", a prompt left out of pooling) bring them over.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from ..formats.sentence_transformers import ST_POOLINGS, SentenceLayout, read_layout
from ..heads import pool
from .base import (Feature, InputTooLongError, Pipeline, PipelineInputError, attempt, check_bool, check_text,
                   positive_int)

POOLINGS = tuple(ST_POOLINGS.values())
DIRECTIONS = ("right", "left")
UNPOSITIONED = ("mean", "max", "mean_sqrt_len")  # the poolings over every token, which a prompt's tokens can skew


class TextEmbeddingPipeline(Pipeline):
    """What the dense and the sparse embedding pipelines share: the folder's sentence-transformers files
    (`read_folder_layout`: prompts, max_seq_length), the inputs (a text with its prompt, or token ids used as
    given), truncation on either side, and the input limit. A subclass pools (`forward`, `postprocess`)."""

    model_task = ""  # each subclass names the task of the model it pools
    single_input = (str,)
    input_description = "a text, a list of token ids, or a list of them"

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        source = model.load_report.source if model.load_report is not None else None
        self.sentence = self.read_folder_layout(Path(source) if source and Path(source).is_dir() else None)
        limits = [n for n in (self.max_positions, self.sentence.max_seq_length) if n is not None]
        self.max_input_length = min(limits) if limits else None
        self._left = None  # a left-truncating tokenizer copy, made on first use

    @staticmethod
    def read_folder_layout(folder: Path | None) -> Any:
        """The folder's layout record (prompts, default_prompt_name, max_seq_length, include_prompt, pooling)."""
        raise NotImplementedError

    def normalize(self, inputs: Any, opts: dict[str, Any]) -> tuple[list[Any], bool]:
        if isinstance(inputs, list) and inputs and all(isinstance(x, int) and not isinstance(x, bool) for x in inputs):
            return [inputs], True  # one input given as token ids
        return super().normalize(inputs, opts)

    def validate_inputs(self, opts: dict[str, Any]) -> dict[str, Any]:
        """truncate, truncation_direction and prompt_name, checked; opts["_prompt"] and ["_skip"] set for
        preprocess."""
        if opts["truncate"] is None:  # a non-bool ("only_first", a tokenizer strategy) was refused by check_options
            opts["truncate"] = False
        direction = str(opts["truncation_direction"]).lower()
        if direction not in DIRECTIONS:
            raise ValueError(f"truncation_direction={opts['truncation_direction']!r}: use 'right' or 'left'")
        opts["truncation_direction"] = direction
        name = opts["prompt_name"] if opts["prompt_name"] is not None else self.sentence.default_prompt_name
        if name is not None and name not in self.sentence.prompts:
            raise ValueError(f"prompt_name={name!r}: the model's prompts are {sorted(self.sentence.prompts) or 'none'}")
        opts["_prompt"] = self.sentence.prompts.get(name, "") if name is not None else ""
        prompt = opts.get("prompt")  # a prompt given as text wins over prompt_name, as in SentenceTransformer.encode
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt={prompt!r}: a prompt is a string")
            opts["_prompt"] = prompt
        excluded = opts["_prompt"] and not self.sentence.include_prompt
        opts["_skip"] = self.prompt_tokens(opts["_prompt"]) if excluded else 0  # leading tokens not pooled
        return opts

    def prompt_tokens(self, prompt: str) -> int:
        """How many leading tokens a prompt takes, as sentence-transformers counts them for include_prompt false: the
        prompt tokenized alone with its special tokens, less a trailing special token (so the leading [CLS] or <s>
        is counted and left out of pooling too)."""
        ids = self.tokenizer(prompt)["input_ids"]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def tokenizer_for(self, direction: str) -> Any:
        """The tokenizer truncating on `direction`: a copy for the side the folder does not use (the backend's
        truncation settings are per call, so sharing one object across both sides would race)."""
        if direction == self.tokenizer.truncation_side:
            return self.tokenizer
        if self._left is None:
            other = copy.copy(self.tokenizer)
            other._tokenizer = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
            other.truncation_side = direction
            self._left = other
        return self._left

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        return self.alone(item, opts)

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        """Token ids as given, one item at a time; the texts (each after its prompt) in one tokenizer call."""
        out: list[Any] = [attempt(self.token_id_rows, item, opts) if isinstance(item, list) else None
                          for item in items]
        texts = [i for i, item in enumerate(items) if not isinstance(item, list)]
        kwargs = {}
        if opts["truncate"] and self.max_input_length is not None:
            kwargs = {"truncation": True, "max_length": self.max_input_length}
        encoded = self.encode_items([items[i] for i in texts], lambda item: (opts["_prompt"] + check_text(item), None),
                                    self.tokenizer_for(opts["truncation_direction"]), **kwargs)
        for i, rows in zip(texts, encoded):
            out[i] = rows if isinstance(rows, Exception) else attempt(self.check_prompt_left, rows, opts)
        return out

    def token_id_rows(self, item: list[Any], opts: dict[str, Any]) -> list[Feature]:
        vocab = len(self.tokenizer)
        bad = [x for x in item if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab]
        if not item or bad:
            raise PipelineInputError(f"token ids must be integers in [0, {vocab}); got {bad[:3] or 'none'}")
        ids = list(item)
        if opts["truncate"] and self.max_input_length is not None and len(ids) > self.max_input_length:
            keep = self.max_input_length
            ids = ids[-keep:] if opts["truncation_direction"] == "left" else ids[:keep]
        types = [0] * len(ids) if "token_type_ids" in self.tokenizer.model_input_names else None
        return [Feature(item=-1, input_ids=ids, attention_mask=[1] * len(ids), token_type_ids=types)]

    def check_prompt_left(self, rows: list[Feature], opts: dict[str, Any]) -> list[Feature]:
        if opts["_skip"] and len(rows[0].input_ids) <= opts["_skip"]:
            raise PipelineInputError(f"nothing of the text is left to pool after its {opts['_skip']}-token prompt "
                                     "(the model's pooling has include_prompt false); shorten the text's truncation "
                                     "or use another prompt")
        return rows

    def check_length(self, row: Feature) -> None:
        n = len(row.input_ids)
        if self.max_input_length is not None and n > self.max_input_length:
            raise InputTooLongError(n, self.max_input_length, "pass truncate=True to cut it")


class SentenceEmbeddingPipeline(TextEmbeddingPipeline):
    """task "sentence-embedding": a vector per text, pooled as the folder says (read_layout).

    Options: pooling / normalize (default: the folder's), truncate (cut inputs longer than max_input_length instead
    of failing them), truncation_direction ("right"|"left"), dimensions (Matryoshka: keep the first n values, then
    normalize if asked), prompt_name (a prefix from the folder's prompts), prompt (a prefix given as text; it wins over
    prompt_name, and include_prompt false leaves its tokens out of pooling as sentence-transformers does), output ("sentence" or "tokens": the
    per-token hidden states, unpooled), with_token_count (each result becomes {"embedding", "tokens"}), return_tensors
    (a sentence's vector as a CPU float32 tensor instead of a list, as transformers' feature-extraction option).
    An item is a text or a list of token ids (used as given: no special tokens are added)."""

    task = "sentence-embedding"
    model_task = "feature-extraction"  # the bare encoder; pooling is this pipeline's
    token_outputs = ("last_hidden_state",)
    defaults: ClassVar[dict[str, Any]] = {"pooling": None, "normalize": None, "truncate": False,
                                          "truncation_direction": "right", "dimensions": None, "prompt_name": None,
                                          "prompt": None, "output": "sentence", "with_token_count": False,
                                          "return_tensors": False}

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.dimension = model.config.hidden_size

    @staticmethod
    def read_folder_layout(folder: Path | None) -> SentenceLayout:
        return read_layout(folder) if folder is not None else SentenceLayout()

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        if opts["pooling"] is None:
            opts["pooling"] = self.sentence.pooling
        if opts["pooling"] not in POOLINGS:
            raise ValueError(f"pooling={opts['pooling']!r}: use one of {list(POOLINGS)}")
        check_bool(f"{self.task}: normalize", opts["normalize"], allow_none=True)  # None: as the folder's layout
        if opts["normalize"] is None:
            opts["normalize"] = self.sentence.normalize
        positive_int("dimensions", opts["dimensions"], allow_none=True)
        if opts["dimensions"] is not None and opts["dimensions"] > self.dimension:
            raise ValueError(f"dimensions={opts['dimensions']}: the model's embeddings have {self.dimension}")
        self.validate_inputs(opts)
        if opts["output"] not in ("sentence", "tokens"):
            raise ValueError(f"output={opts['output']!r}: use 'sentence' or 'tokens'")
        return opts

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        out = super().preprocess_many(items, opts)
        for item, rows in zip(items, out):
            if not isinstance(rows, Exception):
                for f in rows:  # what device_outputs pools this row by (None: it needs its token states)
                    f.data["pooling"] = None if opts["output"] == "tokens" or self.skips_prompt(item, opts) \
                        else opts["pooling"]
        return out

    @staticmethod
    def skips_prompt(item: Any, opts: dict[str, Any]) -> bool:
        """include_prompt false: the prompt's tokens are not pooled (cls and lasttoken pick one position)."""
        return bool(opts["_skip"]) and opts["pooling"] in UNPOSITIONED and isinstance(item, str)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         encoder_outputs=encoder_outputs)
        return {"last_hidden_state": out.last_hidden_state}  # (B, T, C)

    def device_outputs(self, batch: list[Feature], outputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each row's sentence vector pooled on the model's device, so the host gets (B, C) in one copy, not the
        (B, T, C) states. A batch with a row that needs its states on the host (output="tokens", a prompt left out
        of pooling) sends them all instead, and postprocess pools there."""
        modes = [f.data.get("pooling") for f in batch]
        if None in modes:
            return outputs
        hidden = outputs["last_hidden_state"].float()  # (B, T, C): float32, as the host pooled its float32 copy
        lengths = torch.tensor([len(f.input_ids) for f in batch]).to(hidden.device, non_blocking=True)  # (B,)
        # a row's own tokens, as the host pooled them: the tokenizer's mask is all ones (it pads nothing)
        mask = torch.arange(hidden.shape[1], device=hidden.device)[None] < lengths[:, None]  # (B, T)
        if len(set(modes)) == 1:
            return {"sentence_embedding": pool(hidden, mask, modes[0])}  # (B, C)
        pooled = hidden.new_empty(hidden.shape[0], hidden.shape[2])  # (B, C): rows of calls with other poolings
        for mode in set(modes):
            rows = torch.tensor([r for r, m in enumerate(modes) if m == mode]).to(hidden.device, non_blocking=True)
            pooled.index_copy_(0, rows, pool(hidden[rows], mask[rows], mode))  # (B_m, C) into its rows
        return {"sentence_embedding": pooled}

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        f = features[0]
        if opts["output"] == "tokens":
            out = f.outputs["last_hidden_state"].tolist()  # TEI's embed_all: raw states, no pooling, no normalization
        else:
            vector = f.outputs.get("sentence_embedding")  # (C,), pooled on the device (device_outputs)
            if vector is None:  # its batch sent the token states
                hidden = f.outputs["last_hidden_state"]  # (T, C), this row's own tokens
                if self.skips_prompt(item, opts):
                    hidden = hidden[opts["_skip"]:]  # (T - prompt, C), never empty (preprocess checked)
                vector = pool(hidden[None], None, opts["pooling"])[0]  # (C,)
            if opts["dimensions"] is not None:
                vector = vector[: opts["dimensions"]]  # (D,): Matryoshka, cut before normalizing
            if opts["normalize"]:
                vector = F.normalize(vector, p=2, dim=-1)
            # a tensor of its own, not a view into the batch's (B, C)
            out = vector.clone() if opts["return_tensors"] else vector.tolist()
        return {"embedding": out, "tokens": len(f.input_ids)} if opts["with_token_count"] else out
