"""Writes examples/data/debian_{train,eval,corpus}.jsonl and debian_packages.tsv from the Debian packages installed
on this machine: each package's short description (the query a user would type into `apt search`) and its long
description (the passage), both written by the package's Debian maintainers in its debian/control.

Real text, not generated: `examples/retrieval.py` mines hard negatives from the train pairs, fine-tunes
all-MiniLM-L6-v2 on them and evaluates on the held-out pairs against the corpus's distractors.

- Source: dpkg's status file (default /var/lib/dpkg/status): Package, Source, Version and Description of every
  installed package.
- Licence: a description is part of its source package's debian/control, so it is under the licence the package's
  machine-readable copyright file (/usr/share/doc/<package>/copyright, DEP-5) gives for debian/control: the last
  `Files:` paragraph whose patterns match it, as DEP-5 says. A package whose copyright file is not machine-readable
  (no `Format:` line), or names no licence for debian/control, is left out. Each row's package, version and licence
  are in debian_packages.tsv.
- Cleaning: the long description's continuation lines joined into paragraphs (" ." separates them); packages whose
  long description is under 12 words (nothing to retrieve), transitional or dummy packages, and texts two packages
  share are left out; a short description two packages share is left out too (an ambiguous query).
- Split by source package (binary packages built from one source often share sentences, so a held-out query's
  siblings never train): by a hash of the source name, ~30% eval, ~10% corpus only (distractors never trained on),
  the rest train. debian_corpus.jsonl holds every description that is not an eval positive (train positives and the
  corpus-only ones): the eval corpus is then "every package here" and mining draws negatives from the same texts.

Deterministic: the output depends only on the status file and the copyright files. Run from the repository root:
    python scripts/make_debian_data.py [--status /var/lib/dpkg/status] [--doc-dir /usr/share/doc] [--out examples/data]
Another machine has other packages installed and gives other rows; the committed files are the reference.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MIN_WORDS = 12  # a long description shorter than this says little more than its short one
SPLITS = (("eval", 30), ("corpus", 10), ("train", 60))  # percent of source packages, by hash
SKIP = re.compile(r"\b(transitional|dummy) package\b", re.I)


@dataclass
class Package:
    name: str
    source: str
    version: str
    short: str
    long: str
    licence: str = ""
    split: str = ""


def stanzas(text: str) -> list[dict[str, str]]:
    """deb822 paragraphs: field -> value, continuation lines kept with their leading space."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.split("\n"):
            if line[:1] in (" ", "\t") and key is not None:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            out.append(fields)
    return out


def long_description(lines: str) -> str:
    """Debian's extended description: a line of " ." separates paragraphs; other lines continue the paragraph
    (verbatim lines, indented two spaces, are joined too: the embedding model reads words, not layout)."""
    paragraphs, current = [], []
    for line in lines.split("\n"):
        if line.strip() == ".":
            paragraphs.append(" ".join(current))
            current = []
        elif line.strip():
            current.append(line.strip())
    paragraphs.append(" ".join(current))
    return "\n".join(re.sub(r"\s+", " ", p) for p in paragraphs if p)


def read_status(path: Path) -> list[Package]:
    packages = []
    for fields in stanzas(path.read_text(encoding="utf-8")):
        if "Description" not in fields or "install ok installed" not in fields.get("Status", "install ok installed"):
            continue
        short, _, rest = fields["Description"].partition("\n")
        packages.append(Package(fields["Package"], fields.get("Source", fields["Package"]).split()[0],
                                fields.get("Version", ""), short.strip(), long_description(rest)))
    return packages


def control_licence(copyright_file: Path) -> str | None:
    """The licence DEP-5 gives debian/control: the last Files paragraph with a pattern matching it (`*` matches
    `/` too); None when the file is missing or not machine-readable."""
    if not copyright_file.is_file():
        return None
    text = copyright_file.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("Format:"):
        return None
    licence = None
    for fields in stanzas(text):
        patterns = fields.get("Files", "").split()
        name = fields.get("License", "").split("\n")[0].strip()
        if name and any(fnmatch.fnmatchcase("debian/control", p) for p in patterns):
            licence = name
    return licence


def split_of(source: str) -> str:
    bucket = int(hashlib.sha256(source.encode()).hexdigest(), 16) % 100
    for name, percent in SPLITS:
        if bucket < percent:
            return name
        bucket -= percent
    raise AssertionError("SPLITS add up to 100")


def select(packages: list[Package], doc_dir: Path) -> tuple[list[Package], Counter]:
    dropped: Counter = Counter()
    texts = Counter(p.long for p in packages)
    queries = Counter(p.short.lower() for p in packages)
    kept = []
    for p in sorted(packages, key=lambda p: p.name):
        if len(p.long.split()) < MIN_WORDS:
            dropped["long description under 12 words"] += 1
        elif SKIP.search(p.short) or SKIP.search(p.long):
            dropped["transitional or dummy"] += 1
        elif texts[p.long] > 1:
            dropped["long description shared"] += 1
        elif queries[p.short.lower()] > 1:
            dropped["short description shared"] += 1
        elif (licence := control_licence(doc_dir / p.name / "copyright")) is None:
            dropped["no machine-readable licence for debian/control"] += 1
        else:
            p.licence, p.split = licence, split_of(p.source)
            kept.append(p)
    return kept, dropped


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--status", type=Path, default=Path("/var/lib/dpkg/status"))
    parser.add_argument("--doc-dir", type=Path, default=Path("/usr/share/doc"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "examples" / "data")
    args = parser.parse_args()
    kept, dropped = select(read_status(args.status), args.doc_dir)
    by_split = {name: [p for p in kept if p.split == name] for name, _ in SPLITS}
    write_jsonl(args.out / "debian_train.jsonl", [{"anchor": p.short, "positive": p.long} for p in by_split["train"]])
    write_jsonl(args.out / "debian_eval.jsonl", [{"anchor": p.short, "positive": p.long} for p in by_split["eval"]])
    write_jsonl(args.out / "debian_corpus.jsonl", [{"text": p.long} for p in kept if p.split != "eval"])
    with (args.out / "debian_packages.tsv").open("w", encoding="utf-8") as f:
        f.write("package\tversion\tsource\tsplit\tlicense_of_debian_control\n")
        for p in kept:
            f.write(f"{p.name}\t{p.version}\t{p.source}\t{p.split}\t{p.licence}\n")
    print(f"kept {len(kept)} packages: " + ", ".join(f"{n} {len(v)}" for n, v in by_split.items()))
    print("left out: " + ", ".join(f"{why} {n}" for why, n in sorted(dropped.items())))


if __name__ == "__main__":
    main()
