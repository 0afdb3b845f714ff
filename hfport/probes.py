"""The texts the exports (and int8 loading, hfport/int8.py) are traced, calibrated and judged on, kept apart.

    CALIBRATION_TEXTS / CALIBRATION_PAIRS   the trace batch, and the probe texts the int8 rules read (the outlier
                                            split and keep-fp32 rule, export/onnx.py) and the fp32 rows compare on;
    judged_texts() / judged_pairs()         the int8 gate's texts (hfport/agreement.py): JUDGED_SIZE texts and
                                            pairs generated deterministically from a word list, none of them a
                                            calibration text, so the gate never judges what the quantizer was fitted
                                            to; or the user's own (`--gate-data FILE`, read_gate_data).
A gate statistic over a handful of items means little (a rank correlation over 5 pairs falls to 0.90 on one near
tie), so the gate judges at least MIN_JUDGED items, the user's file included.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from .tasks import TASKS
from .tokenizer import AutoTokenizer
from .errors import ExportError

CALIBRATION_TEXTS = [
    "The film was wonderful.",
    "I would not recommend this restaurant to anyone; the service was slow and the food was cold.",
    "ok",
    "Marie Curie was born in Warsaw in 1867 and later moved to Paris, where she studied physics and chemistry.",
    "The committee will meet again next Tuesday to discuss the budget.",
    "What a terrible, awful, disappointing day!",
    "Shares of the company rose three percent after the quarterly report.",
    ("The old lighthouse keeper walked along the rocky shore every evening, watching the ships pass by and writing "
     "long letters to his sister in New York about the weather, the birds and the quiet life on the island."),
    "She plays the violin beautifully.",
    "Please send the invoice to the accounting department before Friday.",
]
CALIBRATION_PAIRS = [
    ("Who wrote the novel?", "Herman Melville wrote Moby-Dick in 1851, a long time ago."),
    ("Where is Berlin?", "Berlin is the capital of Germany and lies on the river Spree."),
    ("When did the war end?", "The war ended in 1945, after six years of fighting across Europe and Asia."),
    ("What colour is the sky?", "On a clear day the sky is blue."),
    ("How many legs does a spider have?", "Spiders have eight legs, while insects have six."),
]
PROBE_MAX_LENGTH = 96
MIN_JUDGED = 64  # the least items a gate statistic is computed over (the module docstring says why)
JUDGED_SIZE = 64
GATE_CHUNK = 16  # rows per forward pass of the gate: bounds memory (fill-mask logits are (rows, T, vocab))
SEED = 35

# the word list the judged texts are drawn from: people, places, things, and how they are described
_WHO = ["The teacher", "My neighbour", "A young doctor", "The old farmer", "Our manager", "The children",
        "A tired traveller", "The mayor", "His grandmother", "The new engineer", "A famous singer", "The pilot"]
_DOES = ["bought", "painted", "repaired", "forgot", "described", "carried", "sold", "found", "lost", "praised",
         "criticised", "cooked"]
_WHAT = ["a red bicycle", "the broken window", "three loaves of bread", "an expensive camera", "the wooden boat",
         "a letter from Rome", "the garden fence", "a small blue car", "the kitchen table", "an old map",
         "the violin", "a box of apples"]
_WHERE = ["in Madrid", "near the station", "at the market", "in a village by the sea", "behind the museum",
          "in Tokyo", "on the mountain road", "at the airport", "in the library", "by the river"]
_WHEN = ["yesterday", "last winter", "on Monday morning", "after the storm", "before dinner", "in 1998",
         "every summer", "late at night"]
_FEEL = ["It was a wonderful surprise.", "Nobody was happy about it.", "The price was far too high.",
         "Everyone agreed it was the right choice.", "It was boring and slow.", "What a brilliant idea!",
         "The result was disappointing.", "I loved every minute of it."]
_SHORT = ["Fine.", "Thanks!", "No.", "Great service.", "Terrible.", "Maybe later.", "Not bad at all.", "Why?"]


def judged_texts(n: int = JUDGED_SIZE) -> list[str]:
    """N distinct texts of mixed length and tone (a few words to ~60 tokens), none a calibration text, the same on
    every run (seeded)."""
    rng = random.Random(SEED)
    texts: list[str] = []
    tries = 0
    while len(texts) < n:  # a repeat is drawn again, as the next kind (no kind's few forms can run out)
        kind, tries = tries % 4, tries + 1
        if kind == 0:  # short, the way reviews and chat messages often are
            text = f"{rng.choice(_SHORT)} {rng.choice(_FEEL)}" if tries % 8 != 1 else rng.choice(_SHORT)
        elif kind == 1:
            text = f"{rng.choice(_WHO)} {rng.choice(_DOES)} {rng.choice(_WHAT)} {rng.choice(_WHERE)}."
        elif kind == 2:
            text = (f"{rng.choice(_WHO)} {rng.choice(_DOES)} {rng.choice(_WHAT)} {rng.choice(_WHEN)}. "
                    f"{rng.choice(_FEEL)}")
        else:  # long: several clauses, so the gate also sees long rows beside short ones in a padded batch
            text = (f"{rng.choice(_WHEN).capitalize()}, {rng.choice(_WHO).lower()} {rng.choice(_DOES)} "
                    f"{rng.choice(_WHAT)} {rng.choice(_WHERE)}, and then {rng.choice(_WHO).lower()} "
                    f"{rng.choice(_DOES)} {rng.choice(_WHAT)} {rng.choice(_WHERE)} {rng.choice(_WHEN)}. "
                    f"{rng.choice(_FEEL)} {rng.choice(_FEEL)}")
        if text not in texts and text not in CALIBRATION_TEXTS:
            texts.append(text)
    return texts


def judged_pairs(n: int = JUDGED_SIZE) -> list[tuple[str, str]]:
    """N (question, passage) pairs: half answered by their passage, half paired with an unrelated one, so a
    reranker's scores spread and a question-answering head sees real answers."""
    rng = random.Random(SEED + 1)
    pairs = []
    for i in range(n):
        who, does, what, where = rng.choice(_WHO), rng.choice(_DOES), rng.choice(_WHAT), rng.choice(_WHERE)
        question = [f"What did {who.lower()} do {where}?", f"Where was {what} {does}?",
                    f"Who {does} {what}?"][i % 3]
        if i % 2:  # unrelated: another subject, thing and place
            who, does, what, where = rng.choice(_WHO), rng.choice(_DOES), rng.choice(_WHAT), rng.choice(_WHERE)
        pairs.append((question, f"{who} {does} {what} {where} {rng.choice(_WHEN)}. {rng.choice(_FEEL)}"))
    return pairs


@dataclass
class GateData:
    """What the int8 gate judges: texts and/or pairs, and where they came from (the report names it)."""

    texts: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    origin: str = f"{JUDGED_SIZE} built-in judged texts and pairs (not the calibration texts)"

    @classmethod
    def builtin(cls) -> GateData:
        return cls(judged_texts(), judged_pairs())


def read_gate_data(path: str | os.PathLike[str]) -> GateData:
    """The user's gate texts: one text per line, or JSONL with `text` (and `text_pair` for pairs), read as JSONL
    when the first non-empty line starts with `{`. An ExportError names the file and line of a bad row, and a file
    with fewer than MIN_JUDGED texts or pairs of one kind is refused (the module docstring says why)."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"gate data {p}: cannot read it ({e})") from e
    data = GateData(origin=f"{p}")
    rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    jsonl = bool(rows) and rows[0][1].lstrip().startswith("{")
    for n, line in rows:
        if not jsonl:
            data.texts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ExportError(f"gate data {p}, line {n}: not JSON ({e.msg}); expected one JSON object a line with "
                              "'text' (and 'text_pair')") from e
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise ExportError(f"gate data {p}, line {n}: expected an object with a non-empty string 'text'")
        pair = row.get("text_pair")
        if pair is None:
            data.texts.append(row["text"])
        elif isinstance(pair, str) and pair.strip():
            data.pairs.append((row["text"], pair))
        else:
            raise ExportError(f"gate data {p}, line {n}: 'text_pair' must be a non-empty string")
    for what, items in (("texts", data.texts), ("pairs", data.pairs)):
        if 0 < len(items) < MIN_JUDGED:
            raise ExportError(f"gate data {p}: {len(items)} {what}; the gate judges at least {MIN_JUDGED} (a "
                              "statistic over fewer flips on one near tie)")
    if not data.texts and not data.pairs:
        raise ExportError(f"gate data {p}: no texts (one text per line, or JSONL with 'text' / 'text_pair')")
    return data


def takes_token_types(config: Any) -> bool:
    """Whether the model has more than one token type: with one (RoBERTa, XLM-R) or none, a tokenizer's token type
    ids are not fed (a WordPiece tokenizer's segment 1 would index past a one-row table)."""
    return getattr(config, "type_vocab_size", 0) > 1


def encode(tokenizer: Any, task: str, config: Any, texts: list[str] | None, pairs: list[tuple[str, str]] | None,
           max_length: int) -> dict[str, dict[str, Tensor]]:
    """TEXTS and PAIRS through TOKENIZER as padded batches {"texts": enc, "pairs": enc} (a task on pairs gets pairs
    only), with only the inputs the model takes; fill-mask rows get one word masked."""
    kwargs = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    record = TASKS[task]
    probes: dict[str, tuple[Any, ...]] = {}
    if texts and not record.pair_input:
        probes["texts"] = (texts,)
    if pairs:
        probes["pairs"] = ([q for q, _ in pairs], [c for _, c in pairs])
    keep = ("input_ids", "attention_mask") + (("token_type_ids",) if takes_token_types(config) else ())
    out = {}
    for name, args in probes.items():
        enc = tokenizer(*args, **kwargs)
        batch = {k: enc[k] for k in keep if k in enc}
        if record.masked_input:  # one word masked in each row, where a user of fill-mask puts it
            if tokenizer.mask_token_id is None:
                raise ExportError(f"{tokenizer.name_or_path}: the tokenizer has no mask token; fill-mask cannot be "
                                  "probed")
            ids = batch["input_ids"].clone()
            lengths = batch["attention_mask"].sum(1)  # (B,)
            for row, n in enumerate(lengths.tolist()):
                ids[row, max(1, n // 2)] = tokenizer.mask_token_id  # a real token, never [CLS]
            batch["input_ids"] = ids
            batch["masked"] = ids.eq(tokenizer.mask_token_id)
        out[name] = batch
    return out


def gate_batches(folder: Path, task: str, config: Any, data: GateData,
                 max_length: int) -> dict[str, list[dict[str, Tensor]]]:
    """DATA as the gate's batches: {"texts": [enc, ...], "pairs": [...]}, GATE_CHUNK rows each, each padded to its
    own longest row. Pairs are judged for every head (a reranker or a two-segment classifier reads them); texts
    for every head but a task on pairs."""
    if TASKS[task].pair_input and not data.pairs:
        raise ExportError(f"gate data {data.origin}: a {task} model is judged on pairs; give JSONL rows with "
                          "'text' and 'text_pair'")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out: dict[str, list[dict[str, Tensor]]] = {}
    for start in range(0, max(len(data.texts), len(data.pairs)), GATE_CHUNK):
        texts, pairs = data.texts[start:start + GATE_CHUNK], data.pairs[start:start + GATE_CHUNK]
        for name, enc in encode(tokenizer, task, config, texts, pairs, max_length).items():
            out.setdefault(name, []).append(enc)
    return out
