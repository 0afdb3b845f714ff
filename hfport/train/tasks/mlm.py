"""Masked language modelling: raw text, masked afresh in every batch (BERT's 15% with 80/10/10).

Each example is masked by a torch.Generator of its own, seeded from the batch's seed and the example's identity
(its file line): an example gets the same mask whichever batch, micro-batch or process it lands in, so a run on
two processes masks exactly as one process with the whole batch does. The loop's seed is the same for a batch after
a resume, and evaluation's seeds are fixed, so it sees the same masks at every eval and its perplexities compare
across the run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...formats.tables import decoded_lines
from ..data import (DataError, EncodedData, Features, compact, data_sources, field_of, in_chunks, iter_records, pad_ids,
                    split_off, where)
from ..metrics import mlm as metrics
from ..stored import collect
from . import TrainTask

IGNORE = -100


def read_texts(path: Path, text_column: str) -> Iterator[tuple[str, int]]:
    """(text, line), streamed: a .txt file's non-blank lines, or a table's text column."""
    if path.suffix.lower() != ".txt":
        yield from ((_checked(field_of(r, text_column, path), path, r.line, text_column), r.line)
                    for r in iter_records(path))
        return
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    empty = True
    for number, text in decoded_lines(path):
        if text.strip():
            empty = False
            yield text.strip(), number
    if empty:
        raise DataError(f"{path}: the file has no examples")


def encode_texts(path: Path, config: Any, tokenizer: Any) -> Iterator[list[Features]]:
    """A source's texts tokenized a chunk at a time (yielded as they are encoded), with their special-tokens masks."""
    for chunk in in_chunks(read_texts(path, config.text_column)):
        enc = tokenizer([t for t, _ in chunk], truncation=True, max_length=config.max_length,
                        return_special_tokens_mask=True)
        types = enc.get("token_type_ids")
        yield [Features(compact(enc["input_ids"][i]), compact(types[i], "b") if types is not None else None, None,
                        (str(path), line), {"special": enc["special_tokens_mask"][i]})
               for i, (_, line) in enumerate(chunk)]


def _checked(value: Any, path: Path, line: int, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where(path, line, column)}: expected non-empty text, got {value!r}")
    return value


def mask_tokens(input_ids: torch.Tensor, maskable: torch.Tensor, generator: torch.Generator, mask_token_id: int,
                vocab_size: int, probability: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: each maskable token is chosen with `probability`; of the chosen, 80% become [MASK], 10% a
    random token, 10% stay. Every row with a maskable token gets at least one chosen, so no row (and no
    batch) is left with nothing to predict.

    input_ids, maskable: (B, T); returns (corrupted ids (B, T), labels (B, T): the original id where chosen,
    else -100)."""
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & maskable  # (B, T)
    # a row that drew nothing gets one of its maskable tokens, picked uniformly
    empty = ~chosen.any(dim=1) & maskable.any(dim=1)  # (B,)
    if empty.any():
        noise = torch.rand(input_ids.shape, generator=generator).masked_fill(~maskable, -1.0)  # (B, T)
        pick = F.one_hot(noise.argmax(dim=1), input_ids.shape[1]).bool()  # (B, T)
        chosen |= pick & empty[:, None]
    labels = input_ids.masked_fill(~chosen, IGNORE)  # (B, T)
    roll = torch.rand(input_ids.shape, generator=generator)  # (B, T): one draw decides mask / random / keep
    to_mask = chosen & (roll < 0.8)
    to_random = chosen & (roll >= 0.8) & (roll < 0.9)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator)  # (B, T)
    corrupted = input_ids.masked_fill(to_mask, mask_token_id)
    corrupted = torch.where(to_random, random_ids, corrupted)
    return corrupted, labels


def example_generator(seed: int, example: Features) -> torch.Generator:
    """A generator for one example, from the batch's seed and the example's identity: its file's name (not its path,
    so the masks do not change when the data moves) and its line."""
    name, line = Path(example.source[0]).name, example.source[1]
    digest = hashlib.blake2b(f"{seed}\0{name}\0{line}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)


class MaskedLM(TrainTask):
    name = "fill-mask"
    compute_metrics = staticmethod(metrics.compute)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        if tokenizer.mask_token_id is None:
            raise ConfigError(f"{config.model}: the tokenizer has no mask token, so it cannot be trained as a masked "
                              "LM")
        settings = {"text": config.text_column, "max_length": config.max_length}
        encoded = [collect(encode_texts(path, config, tokenizer), path, tokenizer, self.name, settings)
                   for path in data_sources(config) if path is not None]
        train = encoded[0]
        evaluation = encoded[1] if config.eval else []
        if not config.eval:
            train, evaluation = split_off(train, config.eval_fraction, config.seed)
        extra = {"mask_token_id": tokenizer.mask_token_id, "vocab_size": len(tokenizer),
                 "probability": config.mlm_probability}
        return EncodedData(train, evaluation, None, tokenizer.pad_token_id, extra)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        batch = pad_ids(items, data.pad_token_id)
        batch["labels"] = torch.full_like(batch["input_ids"], IGNORE)  # (B, T): padding is never a target
        for i, x in enumerate(items):  # one generator per example: its mask does not depend on its batch-mates
            ids = batch["input_ids"][i:i + 1, :len(x.input_ids)]  # (1, T_i)
            maskable = ~torch.tensor(x.meta["special"], dtype=torch.bool)[None]  # (1, T_i)
            corrupted, labels = mask_tokens(ids, maskable, example_generator(seed, x), data.extra["mask_token_id"],
                                            data.extra["vocab_size"], data.extra["probability"])
            batch["input_ids"][i, :len(x.input_ids)], batch["labels"][i, :len(x.input_ids)] = corrupted[0], labels[0]
        return batch

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        return frozenset({"label_smoothing"})

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        logits = outputs.logits.float()  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                               label_smoothing=label_smoothing)

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        return (batch["labels"] != IGNORE).sum()  # (): the masked positions

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """(summed loss, masked count, correct predictions) per example: no (T, V) logits kept."""
        logits = outputs.logits.float()  # (B, T, V)
        labels = batch["labels"]  # (B, T)
        token_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                     reduction="none").view(labels.shape)  # (B, T), 0 where ignored
        masked = labels != IGNORE  # (B, T)
        correct = (logits.argmax(-1) == labels) & masked  # (B, T)
        return [(float(token_loss[i].sum()), int(masked[i].sum()), int(correct[i].sum())) for i in range(len(items))]

    def sample_rows(self, data: EncodedData) -> list[Any]:
        return [(1.0, 1, 1)]  # (summed loss, masked count, correct)

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        # token-weighted: every masked token counts the same, however the batches fell
        total_loss = sum(r[0] for r in rows)
        count = sum(r[1] for r in rows)
        if count == 0:
            raise DataError("fill-mask evaluation masked no token: the eval texts hold only special tokens")
        out = self.compute_metrics(loss=total_loss / count)
        out["accuracy"] = sum(r[2] for r in rows) / count
        return out

