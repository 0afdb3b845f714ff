"""The worked retrieval example (examples/retrieval.py, docs/retrieval-example.md) runs end to end: every command of
the documented chain, on a slice of the real Debian data and a tiny random BERT (--quick: one step per run), so that
the documented path cannot rot. The figures the docs quote come from the full run, not from here."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from hfport import RunDir

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"


def _example():
    spec = importlib.util.spec_from_file_location("retrieval_example", REPO / "examples" / "retrieval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(tmp_path / "cache"))  # the embeddings and teacher outputs it stores


def test_the_data_is_what_its_readme_says():
    """Train, eval and corpus as examples/data/README.md counts them; eval queries and passages held out from
    training; every row's package has a stated licence; the corpus is every description that is not an eval
    positive; together well under 1 MB."""
    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]

    train, held_out, corpus = rows("debian_train.jsonl"), rows("debian_eval.jsonl"), rows("debian_corpus.jsonl")
    packages = [line.split("\t") for line in (DATA / "debian_packages.tsv").read_text().splitlines()[1:]]
    assert (len(train), len(held_out), len(corpus), len(packages)) == (255, 119, 328, 447)
    assert all(set(r) == {"anchor", "positive"} for r in train + held_out) and all(set(r) == {"text"} for r in corpus)
    assert not {r["anchor"] for r in train} & {r["anchor"] for r in held_out}
    assert not {r["positive"] for r in train} & {r["positive"] for r in held_out}
    texts = {r["text"] for r in corpus}
    assert len(texts) == len(corpus) and texts >= {r["positive"] for r in train}
    assert not texts & {r["positive"] for r in held_out}
    assert all(len(p) == 5 and p[4] for p in packages)
    splits = [p[3] for p in packages]
    assert (splits.count("train"), splits.count("eval"), splits.count("corpus")) == (255, 119, 73)
    assert sum(f.stat().st_size for f in DATA.glob("debian_*")) < 1_000_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT with MiniLM's tokenizer and 512 positions (fine-tuning encodes up to 256 tokens, and the
    Debian descriptions are that long; tiny_bert has 128)."""
    from tests.tiny import save_with_tokenizer

    folder = tmp_path_factory.mktemp("retrieval-example") / "tiny"
    save_with_tokenizer("bert", "base", folder, minilm_path, vocab_size=30522, max_position_embeddings=512)
    return folder


def test_the_example_runs_every_command(tiny, tmp_path, capsys):
    """--quick over a tiny random BERT with MiniLM's tokenizer: mine, evaluate, fine-tune (--eval-before), evaluate
    --compare, distil into every other layer (a run folder as --model and --teacher), evaluate the student, export it
    as sentence-transformers and ONNX (--verify), serve the ONNX folder and embed through /v1/embeddings."""
    example = _example()
    out = tmp_path / "out"
    figures = example.main(["--quick", "--out", str(out), "--model", str(tiny)])
    printed = capsys.readouterr().out
    commands = [line.split()[2] for line in printed.splitlines() if line.startswith("$ hfport ")]
    assert commands == ["mine", "evaluate", "finetune", "evaluate", "finetune", "evaluate", "export",
                                        "export", "serve"]
    assert figures == json.loads((out / "figures.json").read_text())
    assert figures["mined_rows"] > 0 and figures["base"]["queries"] == 10
    assert [r["model"] for r in figures["finetuned_vs_base"]] == [str(out / "finetuned" / "best"), str(tiny)]
    assert [r["model"] for r in figures["student_vs_teacher"]] == [str(out / "student" / "best"),
                                                                   str(out / "finetuned" / "best")]
    assert figures["finetune_eval"]["before"]["step"] == 0 and figures["finetune_eval"]["after"]["step"] == 1
    # every ranking figure each evaluation wrote is a real score: present, finite, within [0, 1]
    rows = [figures["base"], *figures["finetuned_vs_base"], *figures["student_vs_teacher"]]
    scores = [v for row in rows for k, v in row.items() if k.startswith("cosine_")]
    assert len(scores) == 5 * 7 and all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in scores)
    for run in ("finetune_eval", "student_eval"):
        for when in ("before", "after"):
            line = figures[run][when]
            assert math.isfinite(line["eval_loss"]) and 0.0 <= line["eval_ndcg@10"] <= 1.0, (run, when, line)
    teacher_layers = json.loads((out / "finetuned" / "best" / "config.json").read_text())["num_hidden_layers"]
    student = json.loads((RunDir(out / "student").best / "config.json").read_text())
    assert student["num_hidden_layers"] == (teacher_layers + 1) // 2
    assert all(v["passed"] and v["checks"] > 0 and v["failures"] == 0 for v in figures["verify"].values())
    timed = figures["speed"]  # a figure only: never asserted beyond being measured
    assert timed["texts"] == 20 and set(timed["texts_per_s"]) == {"student", "teacher"}
    assert all(math.isfinite(v) and v > 0 for v in [*timed["texts_per_s"].values(), timed["student_speed_over_teacher"]])
    served = figures["served"]
    assert served["dimensions"] == student["hidden_size"] and len(served["ranked"]) == 3
    assert served["max_abs_diff_vs_local"] < 1e-5  # the server runs the same ONNX graph in fp32
    assert (out / "report-finetuned.html").is_file() and (out / "report-student.html").is_file()
    svgs = sorted(p.name for p in (out / "charts").iterdir())
    assert svgs == sorted(f"{run}-{chart}.svg" for run in ("finetuned", "student")
                          for chart in ("metrics", "recall-at-k", "accuracy-at-k"))


def test_resume_skips_a_command_whose_output_is_there(tmp_path, capsys):
    """--resume: a command whose output exists is printed and skipped (a stopped full run goes on from there); one
    whose output is missing runs (here a bad one, so running it fails)."""
    example = _example()
    chain = example.Chain(tmp_path, tmp_path / "no-model", quick=True, resume=True)
    done = tmp_path / "mined.jsonl"
    done.write_text("{}\n")
    chain.hfport("mine", "--model", tmp_path / "no-model", "--data", tmp_path / "none.jsonl", "--out", done, makes=done)
    assert "# --resume: skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="hfport mine exited"):
        chain.hfport("mine", "--model", tmp_path / "no-model", "--data", tmp_path / "none.jsonl", "--out",
                     tmp_path / "other.jsonl", makes=tmp_path / "other.jsonl")
