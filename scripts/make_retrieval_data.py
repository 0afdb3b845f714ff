"""Writes examples/data/embed_{train,eval}.jsonl and rerank_{train,eval}.jsonl: questions about 50 countries
(capital, currency, main language, continent) with answer sentences, split by country (40 train, 10 eval).

embed_*: (anchor, positive, negative) triplets; the negative is another answer about the same country (a hard one).
rerank_*: (query, positive, negatives) groups; negatives: the country's other answers + two answers about others.
Deterministic (seeded); run from the repository root: python scripts/make_retrieval_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# country, capital, currency, main language, continent
FACTS = [
    ("France", "Paris", "euro", "French", "Europe"), ("Germany", "Berlin", "euro", "German", "Europe"),
    ("Italy", "Rome", "euro", "Italian", "Europe"), ("Spain", "Madrid", "euro", "Spanish", "Europe"),
    ("Portugal", "Lisbon", "euro", "Portuguese", "Europe"), ("the Netherlands", "Amsterdam", "euro", "Dutch", "Europe"),
    ("Greece", "Athens", "euro", "Greek", "Europe"), ("Poland", "Warsaw", "zloty", "Polish", "Europe"),
    ("Sweden", "Stockholm", "krona", "Swedish", "Europe"), ("Norway", "Oslo", "krone", "Norwegian", "Europe"),
    ("Denmark", "Copenhagen", "krone", "Danish", "Europe"), ("Finland", "Helsinki", "euro", "Finnish", "Europe"),
    ("Hungary", "Budapest", "forint", "Hungarian", "Europe"), ("the Czech Republic", "Prague", "koruna", "Czech",
                                                               "Europe"),
    ("Romania", "Bucharest", "leu", "Romanian", "Europe"), ("Ireland", "Dublin", "euro", "English", "Europe"),
    ("the United Kingdom", "London", "pound sterling", "English", "Europe"),
    ("Switzerland", "Bern", "Swiss franc", "German", "Europe"), ("Austria", "Vienna", "euro", "German", "Europe"),
    ("Ukraine", "Kyiv", "hryvnia", "Ukrainian", "Europe"), ("Japan", "Tokyo", "yen", "Japanese", "Asia"),
    ("China", "Beijing", "renminbi", "Mandarin Chinese", "Asia"), ("South Korea", "Seoul", "won", "Korean", "Asia"),
    ("India", "New Delhi", "rupee", "Hindi", "Asia"), ("Thailand", "Bangkok", "baht", "Thai", "Asia"),
    ("Vietnam", "Hanoi", "dong", "Vietnamese", "Asia"), ("the Philippines", "Manila", "peso", "Filipino", "Asia"),
    ("Pakistan", "Islamabad", "rupee", "Urdu", "Asia"), ("Iran", "Tehran", "rial", "Persian", "Asia"),
    ("Saudi Arabia", "Riyadh", "riyal", "Arabic", "Asia"), ("Egypt", "Cairo", "Egyptian pound", "Arabic", "Africa"),
    ("Kenya", "Nairobi", "shilling", "Swahili", "Africa"), ("Nigeria", "Abuja", "naira", "English", "Africa"),
    ("Morocco", "Rabat", "dirham", "Arabic", "Africa"), ("Ethiopia", "Addis Ababa", "birr", "Amharic", "Africa"),
    ("Ghana", "Accra", "cedi", "English", "Africa"), ("the United States", "Washington, D.C.", "dollar", "English",
                                                     "North America"),
    ("Canada", "Ottawa", "Canadian dollar", "English", "North America"),
    ("Mexico", "Mexico City", "peso", "Spanish", "North America"), ("Cuba", "Havana", "peso", "Spanish",
                                                                      "North America"),
    ("Brazil", "Brasilia", "real", "Portuguese", "South America"),
    ("Argentina", "Buenos Aires", "peso", "Spanish", "South America"),
    ("Chile", "Santiago", "peso", "Spanish", "South America"), ("Peru", "Lima", "sol", "Spanish", "South America"),
    ("Colombia", "Bogota", "peso", "Spanish", "South America"),
    ("Venezuela", "Caracas", "bolivar", "Spanish", "South America"),
    ("Australia", "Canberra", "Australian dollar", "English", "Oceania"),
    ("New Zealand", "Wellington", "New Zealand dollar", "English", "Oceania"),
    ("Tanzania", "Dodoma", "shilling", "Swahili", "Africa"), ("Indonesia", "Jakarta", "rupiah", "Indonesian", "Asia"),
]
QUESTIONS = {
    "capital": ["What is the capital of {c}?", "Which city is the seat of government of {c}?",
                "Where is the capital city of {c}?"],
    "currency": ["What currency is used in {c}?", "What money do people pay with in {c}?",
                 "Which currency would I need when travelling to {c}?"],
    "language": ["What language do most people speak in {c}?", "Which language is spoken in {c}?",
                 "What is the main language of {c}?"],
    "continent": ["On which continent is {c}?", "Where in the world is {c} located?",
                  "Which continent does {c} belong to?"],
}
ANSWERS = {
    "capital": "{x} is the capital of {c}, where its government sits.",
    "currency": "Shops in {c} take the {x}, the national currency.",
    "language": "Most people in {c} speak {x} at home and at work.",
    "continent": "{c} lies in {x}.",
}
RELATIONS = list(ANSWERS)


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def rows(facts: list[tuple[str, ...]], rng: random.Random) -> tuple[list[dict], list[dict]]:
    embed, rerank = [], []
    all_answers = [cap(ANSWERS[r].format(c=f[0], x=f[i + 1])) for f in facts for i, r in enumerate(RELATIONS)]
    for fact in facts:
        country = fact[0]
        answers = {r: cap(ANSWERS[r].format(c=country, x=fact[i + 1])) for i, r in enumerate(RELATIONS)}
        for r in RELATIONS:
            question = cap(rng.choice(QUESTIONS[r]).format(c=country))
            others = [answers[o] for o in RELATIONS if o != r]
            embed.append({"anchor": question, "positive": answers[r], "negative": rng.choice(others)})
            far = rng.sample([a for a in all_answers if country not in a], 2)
            rerank.append({"query": question, "positive": answers[r], "negatives": others + far})
    rng.shuffle(embed)
    rng.shuffle(rerank)
    return embed, rerank


def main() -> None:
    rng = random.Random(13)
    facts = list(FACTS)
    rng.shuffle(facts)
    out = Path("examples/data")
    for split, part in (("train", facts[:40]), ("eval", facts[40:])):
        embed, rerank = rows(part, rng)
        for name, data in (("embed", embed), ("rerank", rerank)):
            (out / f"{name}_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in data), encoding="utf-8")


if __name__ == "__main__":
    main()
