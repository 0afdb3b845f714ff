"""Generated training data for the fine-tuning tests: small, seeded, and easy enough that a tiny model learns it in a
few steps. Sentiment rows (text, label), CoNLL-like NER rows (tokens, tags), extractive QA rows (SQuAD layout, and
SQuAD v2 JSON with unanswerable questions), masked-LM lines; `write_jsonl` writes rows one JSON object a line.
DATA is examples/data, the small real-text files (retrieval, reranking, topics) the examples ship."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- sentiment ------------------------------------------------------------------------------------------------

POS = ["great", "wonderful", "excellent", "lovely", "superb", "brilliant"]
NEG = ["awful", "terrible", "bad", "horrible", "poor", "dreadful"]


def write_sentiment(path: Path, n: int, seed: int, filler: int = 0) -> None:
    """`filler` > 0: up to that many extra words per row, so lengths vary as in real text."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = rng.choice(["negative", "positive"])
            word = rng.choice(POS if label == "positive" else NEG)
            thing = rng.choice(["film", "plot", "acting", "soundtrack", "ending"])
            extra = " ".join(rng.choice(["and", "then", "so", "we", "left"]) for _ in range(rng.randint(0, filler)))
            f.write(json.dumps({"text": f"the {thing} was {word} overall {extra}".strip(), "label": label}) + "\n")


SENTIMENT_WORDS = {"positive": ["great", "wonderful", "lovely"], "negative": ["awful", "terrible", "dreadful"]}


def sentiment_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Short sentiment rows with a `pair` column (a second text), for the data-source readers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["negative", "positive"])
        thing = rng.choice(["film", "plot", "ending"])
        filler = " ".join(rng.choice(["and", "so", "then"]) for _ in range(rng.randint(0, 6)))
        rows.append({"text": f"the {thing} was {rng.choice(SENTIMENT_WORDS[label])} {filler}".strip(),
                     "pair": f"a remark about the {thing}", "label": label})
    return rows


# --- token classification -----------------------------------------------------------------------------------

PEOPLE = [["alice"], ["bob", "smith"], ["carol"], ["dmitri", "ivanovich"], ["eve", "johansson"]]
PLACES = [["paris"], ["new", "york"], ["tokyo"], ["rio", "de", "janeiro"], ["zanzibarville"]]
FILLER = ["yesterday", "we", "think", "that", "quietly", "maybe", "often", "really"]


def ner_rows(n: int, seed: int) -> list[dict]:
    """'<filler> PERSON <filler> visited PLACE <filler>' with IOB2 tags; multi-word and multi-sub-token names."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(0, 2)):
            tokens.append(rng.choice(FILLER)), tags.append("O")
        person = rng.choice(PEOPLE)
        tokens += person
        tags += ["B-PER"] + ["I-PER"] * (len(person) - 1)
        tokens += [rng.choice(FILLER), "visited"]
        tags += ["O", "O"]
        place = rng.choice(PLACES)
        tokens += place
        tags += ["B-LOC"] + ["I-LOC"] * (len(place) - 1)
        rows.append({"tokens": tokens, "tags": tags})
    return rows


# --- question answering -------------------------------------------------------------------------------------

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "violet", "turquoise"]
WORDS = ["the", "house", "stood", "near", "a", "river", "and", "people", "walked", "past", "it", "every", "day",
         "while", "birds", "sang", "in", "trees", "old", "town"]


def qa_rows(n: int, seed: int, length: tuple[int, int] = (20, 50)) -> list[dict]:
    """Contexts of filler words with one color word somewhere; the question asks for the color. Long contexts
    spill over several windows at max_length 32, so the answer is often in a later window."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*length))]
        color = rng.choice(COLORS)
        words.insert(rng.randrange(len(words) + 1), color)
        context = " ".join(words)
        start = context.index(f" {color} ") + 1 if f" {color} " in context else context.index(color)
        rows.append({"id": f"q{k}", "question": "which color is mentioned?", "context": context,
                     "answers": {"text": [color], "answer_start": [start]}})
    return rows


def squad_v2(n: int, seed: int) -> dict:
    """SQuAD v2 JSON: the qa_rows questions, a quarter of them made unanswerable by taking the color out."""
    rng = random.Random(seed + 100)
    paragraphs = []
    for row in qa_rows(n, seed):
        if rng.random() < 0.25:
            color = row["answers"]["text"][0]
            context = " ".join(w for w in row["context"].split() if w != color)
            qas = [{"id": row["id"], "question": row["question"], "answers": [], "is_impossible": True}]
        else:
            context = row["context"]
            qas = [{"id": row["id"], "question": row["question"], "is_impossible": False,
                    "answers": [{"text": t, "answer_start": s} for t, s in zip(row["answers"]["text"],
                                                                                row["answers"]["answer_start"])]}]
        paragraphs.append({"context": context, "qas": qas})
    return {"version": "v2.0", "data": [{"title": "colors", "paragraphs": paragraphs}]}


# --- masked LM ----------------------------------------------------------------------------------------------

SUBJECTS = ["the cat", "a dog", "my sister", "the old man", "our teacher"]
VERBS = ["sat on", "looked at", "walked to", "painted", "found"]
OBJECTS = ["the mat", "a red door", "the garden", "the small boat", "a book"]


def mlm_lines(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} .\n" for _ in range(n))
