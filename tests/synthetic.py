"""Text, labels and a tokenizer made up on the spot, for machines without the MiniLM package or a network (the lent
GPU machine): a seeded vocabulary of pseudo-words, texts of chosen lengths with a learnable label, and a WordPiece
tokenizer trained on them in BERT's layout (tokenizer.json + tokenizer_config.json, [PAD] = 0), which both hfport
and transformers read. Used by tests/test_cuda.py and scripts/bench_gpu.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # BERT's order: [PAD] is 0
POSITIVE, NEGATIVE = "bright", "grim"  # a text's label is which of these it holds


def vocabulary(n: int = 600, seed: int = 0) -> list[str]:
    """n distinct pseudo-words of 1-4 syllables."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def texts(lengths: list[int], seed: int = 0, words: list[str] | None = None) -> list[tuple[str, int]]:
    """(text, label) per length (in words): pseudo-words with POSITIVE or NEGATIVE at a random place; label 1 for
    POSITIVE. Half of each, in a seeded order."""
    rng = random.Random(seed)
    words = words or vocabulary()
    out = []
    for i, n in enumerate(lengths):
        label = i % 2
        body = [rng.choice(words) for _ in range(max(n, 1) - 1)]
        body.insert(rng.randint(0, len(body)), POSITIVE if label else NEGATIVE)
        out.append((" ".join(body), label))
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[tuple[str, int]]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


def wordpiece_tokenizer(folder: Path, vocab_size: int = 2000, max_length: int = 512) -> dict[str, int]:
    """A WordPiece tokenizer trained on vocabulary()'s words, saved in BERT's layout into `folder`: [CLS] A [SEP]
    (B [SEP]) templates, lower-casing, [PAD] = 0. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    corpus = [" ".join(vocabulary()[i:i + 50]) for i in range(0, 600, 50)] + [POSITIVE, NEGATIVE] * 10
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "token_type_ids",
                                                                            "attention_mask"],
        "model_max_length": max_length, "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "mask_token": "[MASK]", "unk_token": "[UNK]", "do_lower_case": True}))
    return ids
