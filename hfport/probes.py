"""The texts the exports (and int8 loading, hfport/int8.py) are traced, calibrated and judged on, kept apart.

    CALIBRATION_TEXTS / CALIBRATION_PAIRS   the trace batch, and the probe texts the int8 rules read (the outlier
                                            split and keep-fp32 rule, export/onnx.py) and the fp32 rows compare on,
                                            cut at PROBE_MAX_LENGTH tokens;
    judged_texts() / judged_pairs()         the int8 gate's short texts (hfport/agreement.py): JUDGED_SIZE texts and
                                            pairs of a few to ~50 tokens generated deterministically from a word
                                            list, none of them a calibration text, so the gate never judges what the
                                            quantizer was fitted to;
    long_texts() / long_pairs()             and its long ones: JUDGED_SIZE texts and (question, passage) pairs
                                            built from the same word list through the model's tokenizer, their
                                            lengths spread evenly from LONG_FROM tokens up to the model's max length
                                            (`judged_length`: config and tokenizer limits, capped at GATE_MAX_LENGTH),
                                            so int8 error that grows with the length (a 96-token cut passed a
                                            MiniLM reranker at Spearman 0.9988 that scores real 170-230-token pairs at
                                            0.984) is judged where it shows;
    the user's own (`--gate-data FILE`, read_gate_data), judged whole: cut only at the model's own max length.
The gate judges each set by itself (texts, pairs, long texts, long pairs): a statistic pooled over short and long
rows would let the many short ones carry the long. A gate statistic over a handful of items means little (a rank
correlation over 5 pairs falls to 0.90 on one near tie), so each set has at least MIN_JUDGED items, the user's file
included.
"""

from __future__ import annotations

import itertools
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
PROBE_MAX_LENGTH = 96  # the calibration and fp32 probe batches' cut (their texts are shorter); never the gate's
MIN_JUDGED = 64  # the least items a gate statistic is computed over (the module docstring says why)
JUDGED_SIZE = 64
# rows per forward pass of the gate, and tokens (rows x their padded length): bound memory, fill-mask's logits being
# (rows, T, vocab); the token budget is what GATE_CHUNK rows of PROBE_MAX_LENGTH tokens took before the long rows
GATE_CHUNK = 16
GATE_TOKENS = GATE_CHUNK * PROBE_MAX_LENGTH
# the long texts' lengths start past the short judged texts' longest (52 tokens with BERT's WordPiece) ...
LONG_FROM = 64
# ... and reach the model's max length, but at most this: the gate runs at every int8 load on the CPU, and 64 texts
# and 64 pairs spread up to 8192 tokens (ModernBERT, GTE, jina-v3, EuroBERT) would take minutes a pass where up to 512
# (BERT's and most rerankers' and embedders' max length, and past where most passages end) takes seconds. A model
# served on longer inputs is judged there with its own `gate_data`, which is cut only at the model's max length.
GATE_MAX_LENGTH = 512
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


def _sentence(rng: random.Random) -> str:
    """One sentence of the word list (what judged_texts' middle kinds draw)."""
    if rng.random() < 0.5:
        return f"{rng.choice(_WHO)} {rng.choice(_DOES)} {rng.choice(_WHAT)} {rng.choice(_WHERE)} {rng.choice(_WHEN)}."
    return f"{rng.choice(_WHO)} {rng.choice(_DOES)} {rng.choice(_WHAT)} {rng.choice(_WHERE)}. {rng.choice(_FEEL)}"


def spread(shortest: int, longest: int, n: int = JUDGED_SIZE) -> list[int]:
    """N token lengths spread evenly over (SHORTEST, LONGEST], ascending; the last is LONGEST."""
    return [shortest + (longest - shortest) * (i + 1) // n for i in range(n)]


def _fill(tokenizer: Any, rng: random.Random, budget: int) -> list[str]:
    """Sentences drawn from the word list until they hold at least BUDGET tokens (counted alone, without special
    tokens: a joined text's count differs from the sum by a token or two at most)."""
    out: list[str] = []
    while budget > 0:
        sentences = [_sentence(rng) for _ in range(max(1, budget // 12))]  # ~12 tokens a sentence
        for sentence, ids in zip(sentences, tokenizer(sentences, add_special_tokens=False)["input_ids"]):
            if budget > 0:
                out.append(sentence)
                budget -= max(1, len(ids))
    return out


def _specials(tokenizer: Any, pair: bool) -> int:
    """The special tokens the tokenizer adds to a text (or a pair)."""
    args = ("a", "a") if pair else ("a",)
    return len(tokenizer(*args)["input_ids"]) - len(args) * len(tokenizer("a", add_special_tokens=False)["input_ids"])


def long_texts(tokenizer: Any, lengths: list[int]) -> list[str]:
    """One text per token length in LENGTHS (at least that many tokens through TOKENIZER, special tokens included;
    the gate cuts it at its max length): sentences of the word list, the same on every run (seeded)."""
    rng = random.Random(SEED + 2)
    specials = _specials(tokenizer, pair=False)
    return [" ".join(_fill(tokenizer, rng, n - specials)) for n in lengths]


def long_pairs(tokenizer: Any, lengths: list[int]) -> list[tuple[str, str]]:
    """One (question, passage) pair per token length in LENGTHS, the passage filled with sentences of the word list;
    in every other pair the passage answers the question, its answer somewhere within it (not only near the start,
    so a question-answering head answers at long positions too), in the others it does not."""
    rng = random.Random(SEED + 3)
    specials = _specials(tokenizer, pair=True)
    pairs = []
    for i, n in enumerate(lengths):
        who, does, what, where = rng.choice(_WHO), rng.choice(_DOES), rng.choice(_WHAT), rng.choice(_WHERE)
        question = [f"What did {who.lower()} do {where}?", f"Where was {what} {does}?", f"Who {does} {what}?"][i % 3]
        asked = len(tokenizer(question, add_special_tokens=False)["input_ids"])
        passage = _fill(tokenizer, rng, n - specials - asked)
        if i % 2 == 0:  # answered: the answer replaces a sentence, never the last (the gate's cut may shorten it)
            at = (i // 2) % max(1, len(passage) - 1)
            passage[at] = f"{who} {does} {what} {where} {rng.choice(_WHEN)}."
        pairs.append((question, " ".join(passage)))
    return pairs


@dataclass
class GateData:
    """What the int8 gate judges: texts and/or pairs, and where they came from (the report names it).

    max_length: the most tokens a row is judged at (None: the model's own max length, `judged_length`); long: add
    the long texts and pairs (long_texts, long_pairs), their lengths spread up to that cut."""

    texts: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    origin: str = f"{JUDGED_SIZE} built-in judged texts and pairs (not the calibration texts)"
    max_length: int | None = None
    long: bool = False

    @classmethod
    def builtin(cls) -> GateData:
        return cls(judged_texts(), judged_pairs(), origin="built-in judged set (not the calibration texts)",
                   max_length=GATE_MAX_LENGTH, long=True)


def read_gate_data(path: str | os.PathLike[str]) -> GateData:
    """The user's gate texts: one text per line, or JSONL with `text` (and `text_pair` for pairs), read as JSONL
    when the first non-empty line starts with `{`. An ExportError names the file and line of a bad row, and a file
    with fewer than MIN_JUDGED texts or pairs of one kind is refused (the module docstring says why)."""
    p = Path(path).expanduser()
    try:
        # utf-8-sig: a byte-order mark (Windows editors) is no content; kept, it hid a JSONL file's first "{" and
        # its JSON lines were judged as plain texts
        lines = p.read_text(encoding="utf-8-sig").splitlines()
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


def model_max_length(config: Any, tokenizer: Any) -> int:
    """The longest input the model takes: config.max_position_embeddings less 2 (room for RoBERTa's position offset,
    whose positions start at pad_token_id + 1), or the tokenizer's model_max_length where that is smaller."""
    return max(1, min(config.max_position_embeddings - 2, tokenizer.model_max_length))


def judged_length(config: Any, tokenizer: Any, cap: int | None = None) -> int:
    """The most tokens a judged row has: the model's max length, at most CAP."""
    longest = model_max_length(config, tokenizer)
    return longest if cap is None else min(longest, cap)


def _chunks(tokenizer: Any, texts: list[str], pairs: list[tuple[str, str]],
            max_length: int) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """TEXTS and PAIRS cut into the gate's forward passes, in order: at most GATE_CHUNK rows and GATE_TOKENS tokens
    (rows x the longest row's length) each, texts and pairs chunked alike where a chunk holds both."""
    def lengths(*args: Any) -> list[int]:
        if not args[0]:
            return []
        ids = tokenizer(*args, truncation=True, max_length=max_length)["input_ids"]
        return [len(x) for x in ids]

    sizes = [max(a, b) for a, b in itertools.zip_longest(
        lengths(texts), lengths([q for q, _ in pairs], [c for _, c in pairs]), fillvalue=0)]
    out, start = [], 0
    while start < len(sizes):
        end, longest = start, 0
        while end < len(sizes) and end - start < GATE_CHUNK and \
                max(longest, sizes[end]) * (end - start + 1) <= max(GATE_TOKENS, sizes[end]):
            longest = max(longest, sizes[end])
            end += 1
        out.append((texts[start:end], pairs[start:end]))
        start = end
    return out


def gate_batches(folder: Path, task: str, config: Any, data: GateData) -> dict[str, list[dict[str, Tensor]]]:
    """DATA as the gate's batches: {"texts": [enc, ...], "pairs": [...], "long texts": [...], "long pairs": [...]},
    each set cut into forward passes (_chunks), each pass padded to its own longest row. Rows are cut at
    `judged_length` (DATA's max_length: the built-in set's GATE_MAX_LENGTH, the user's none). Pairs are judged for
    every head (a reranker or a two-segment classifier reads them); texts for every head but a task on pairs."""
    if TASKS[task].pair_input and not data.pairs:
        raise ExportError(f"gate data {data.origin}: a {task} model is judged on pairs; give JSONL rows with "
                          "'text' and 'text_pair'")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    limit = judged_length(config, tokenizer, data.max_length)
    sets = [("", data.texts, data.pairs)]
    if data.long and limit > LONG_FROM:  # a shorter model: the short texts already reach its max length
        lengths = spread(LONG_FROM, limit)
        sets.append(("long ", long_texts(tokenizer, lengths), long_pairs(tokenizer, lengths)))
    out: dict[str, list[dict[str, Tensor]]] = {}
    for prefix, texts, pairs in sets:
        for chunk_texts, chunk_pairs in _chunks(tokenizer, texts, pairs, limit):
            for name, enc in encode(tokenizer, task, config, chunk_texts, chunk_pairs, limit).items():
                out.setdefault(prefix + name, []).append(enc)
    return out
