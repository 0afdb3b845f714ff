"""What users feed a fine-tune (issue 44, item 5): the data columns are config fields with a CLI flag each
(--text-column, ..., one per column a task record names), the table of each task's columns (README.md and
docs/fine-tuning.md) is the records' own (hfport/train/columns.py), a file whose first row lacks a column fails
before anything loads, naming the flag and the tasks whose columns the row has, and a mistyped task name gets "did
you mean"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import hfport
from hfport import tasks
from hfport.cli import app
from hfport.train.columns import check_columns, column_fields, columns_table, fitting_tasks, flag
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError
from tests.data import write_jsonl

ROOT = Path(__file__).resolve().parent.parent
COLUMN_TABLES = [ROOT / "README.md", ROOT / "docs" / "fine-tuning.md"]  # where users start, and the data formats page


def config(train: Path, **options) -> FinetuneConfig:
    return FinetuneConfig(model="no-model-needed", train=str(train), **options)


def refused(train: Path, **options) -> str:
    with pytest.raises(DataError) as info:
        check_columns(config(train, **options))
    return str(info.value)


# --- the README's table and the flags read the records -----------------------------------------------------------


@pytest.mark.parametrize("page", COLUMN_TABLES, ids=lambda p: p.name)
def test_readme_table_is_the_records_table(page):
    text = page.read_text(encoding="utf-8")
    block = re.search(r"<!-- columns: [^\n]*-->\n(.*?)\n<!-- end columns -->", text, re.S)
    assert block, f"{page.name} has no columns table between its markers"
    assert block.group(1) == columns_table()  # regenerate: python -c "...columns import columns_table; print(...)"
    for record in tasks.TASKS.values():  # every fine-tuning task has its row, every column field its flag there
        if record.train is not None:
            assert f"| {record.name} |" in block.group(1)
    for field in column_fields():
        assert f"`{flag(field)}`" in block.group(1)


def test_every_column_field_is_a_config_field_and_a_finetune_flag():
    params = {p.name: p for p in typer.main.get_command(app).commands["finetune"].params}
    for field in column_fields():
        assert field in FinetuneConfig.model_fields, field
        assert flag(field) in params[field].opts, (field, params.get(field))
    assert {"choices_column", "text_pair_column", "negatives_column"} <= set(column_fields())


def test_column_flags_set_the_config_fields(tmp_path):
    """Each --<x>-column flag lands in its config field (--print-config says it came from a flag)."""
    args = ["finetune", "--model", "m", "--train", "t.jsonl", "--print-config"]
    for field in column_fields():
        args += [flag(field), f"my_{field}"]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    shown = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()}
    for field in column_fields():
        assert shown[field] == [f'"my_{field}"', "(flag)"], (field, shown[field])


def test_cli_trains_on_renamed_columns(tiny_bert, tmp_path):
    """A file with its own column names: refused by default, naming the flags; trained with them."""
    rows = [{"sentence": f"the film was {w}", "sentiment": s}
            for w, s in [("great", "pos"), ("awful", "neg"), ("fine", "pos"), ("dull", "neg")] * 2]
    train = write_jsonl(tmp_path / "reviews.jsonl", rows)
    common = ["finetune", "--model", str(tiny_bert), "--train", str(train), "--max-steps", "1", "--batch-size", "2",
              "--set", "eval_fraction=0.25", "--save-strategy", "no", "-q"]
    bad = CliRunner().invoke(app, [*common, "--output-dir", str(tmp_path / "bad")])
    assert bad.exit_code == 1
    assert "reviews.jsonl, line 1: no columns 'text', 'label'; the row has ['sentence', 'sentiment']" in bad.output
    assert "--text-column, --label-column" in bad.output
    assert not (tmp_path / "bad").exists()
    run = CliRunner().invoke(app, [*common, "--output-dir", str(tmp_path / "run"), "--text-column", "sentence",
                                   "--label-column", "sentiment"])
    assert run.exit_code == 0, run.output
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["label2id"] == {"neg": 0, "pos": 1}


# --- the missing-column error -----------------------------------------------------------------------------------


def test_one_missing_column_names_its_flag_and_the_unused_column(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "sentiment": "pos"}])
    assert refused(train) == (
        f"{train}, line 1, field 'label': missing; the row has ['sentiment', 'text']. text-classification reads "
        "text, label (+ a column named by --text-pair-column); name the file's column with --label-column "
        "(label_column in a config file), e.g. --label-column sentiment; the row's columns fit fill-mask "
        "(--task fill-mask)")
    check_columns(config(train, label_column="sentiment"))  # renamed: fits


def test_a_file_of_another_task_names_that_task(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"anchor": "q", "positive": "p"}])
    message = refused(pairs)  # the default task, text-classification
    assert "the row has ['anchor', 'positive']" in message
    assert message.endswith("the row's columns fit sentence-embedding or sparse-embedding (--task sentence-embedding "
                            "or --task sparse-embedding)")
    ranking = tmp_path / "ranking.csv"
    ranking.write_text("query,text,label\nq,t,1\n")
    message = refused(ranking, task="sentence-embedding")
    assert message.startswith(f"{ranking}, line 2: no columns 'anchor', 'positive'; the row has "
                              "['label', 'query', 'text']. sentence-embedding reads anchor, positive (+ negative) or "
                              "sentence1, sentence2, score; name the file's columns with --anchor-column, "
                              "--positive-column")
    assert message.endswith("fit text-ranking (--task text-ranking)")  # the task using most of the row's columns


def test_a_hint_weighs_the_values_not_only_the_names(tmp_path):
    """A labeled list (what `hfport mine --output-format labeled-list` writes: an anchor, a list of texts under
    `positive`, their labels) has an embedding pair's column names, but its positive is a list: no task reads that row,
    so the text-ranking error names none (it had said "fit sentence-embedding"). The same for the e.g.: a column holding
    a text is no example of a column of lists."""
    listed = write_jsonl(tmp_path / "mined.jsonl", [{"anchor": "q", "positive": ["p", "n"], "labels": [1, 0]}])
    message = refused(listed, task="text-ranking")
    assert message.startswith(f"{listed}, line 1: no columns 'query', 'negatives'; the row has ['anchor', 'labels', "
                              "'positive']")
    assert "fit" not in message.split("; the row has")[1], message
    group = write_jsonl(tmp_path / "group.jsonl", [{"query": "q", "positive": "p", "hard": "n"}])
    message = refused(group, task="text-ranking")
    assert "field 'negatives': missing" in message and "e.g." not in message, message
    grouped = write_jsonl(tmp_path / "grouped.jsonl", [{"query": "q", "positive": "p", "hard": ["n"]}])
    assert refused(grouped, task="text-ranking").endswith("e.g. --negatives-column hard")


def test_each_shape_of_a_task_is_a_shape_its_hint_names():
    """The kinds a task record declares (a text, a list) are those its reader takes: each shape's row, checked as
    another task's file, is hinted at that task."""
    names = {f: FinetuneConfig.model_fields[f].default for f in column_fields()}
    for task, rows in SHAPES.items():
        for row in rows:
            assert task in fitting_tasks(row, names, other_than=""), (task, row)


# a row of each shape of each fine-tuning task, as its reader takes it
SHAPES = {"sentence-embedding": [{"anchor": "a", "positive": "b"}, {"anchor": "a", "positive": "b", "negative": "c"},
                                 {"anchor": "a", "positive": "b", "negative": ["c", "d"]},
                                 {"sentence1": "a", "sentence2": "b", "score": 0.5}],
          "text-ranking": [{"query": "q", "text": "t", "label": 1},
                           {"query": "q", "positive": "p", "negatives": ["n"]}],
          "multiple-choice": [{"context": "c", "choices": ["a", "b"], "label": 0},
                              {"question": "q", "choices": ["a", "b"], "label": 1},
                              {"question": "q", "choices": '["a", "b"]', "label": "1"}],  # a CSV row's cells
          "question-answering": [{"question": "q", "context": "c", "answers": []}],
          "token-classification": [{"tokens": ["a"], "tags": ["O"]}],
          "fill-mask": [{"text": "a"}],
          "text-classification": [{"text": "a", "label": 0}, {"text": "a", "label": ["x", "y"]}]}


def test_each_shape_of_a_task_fits_and_the_eval_file_is_checked(tmp_path):
    for task, rows in SHAPES.items():
        for i, row in enumerate(rows):
            check_columns(config(write_jsonl(tmp_path / f"{task}-{i}.jsonl", [row]), task=task))
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "a", "label": 0}])
    bad_eval = write_jsonl(tmp_path / "eval.jsonl", [{"text": "a", "target": 0}])
    assert refused(good, eval=str(bad_eval)).startswith(f"{bad_eval}, line 1, field 'label': missing")
    paired = config(good, text_pair_column="premise")  # a named pair column must be there
    with pytest.raises(DataError, match=r"field 'premise': missing.*--text-pair-column"):
        check_columns(paired)
    renamed = write_jsonl(tmp_path / "mc.jsonl", [{"question": "q", "options": ["a", "b"], "label": 0}])
    with pytest.raises(DataError, match=r"field 'choices': missing.*e\.g\. --choices-column options"):
        check_columns(config(renamed, task="multiple-choice"))
    check_columns(config(renamed, task="multiple-choice", choices_column="options"))


def test_files_of_a_tasks_own_format_are_its_readers(tmp_path):
    """CoNLL, .txt and SQuAD JSON files have no columns to check (their readers say what is wrong with them)."""
    (tmp_path / "ner.conll").write_text("Paris B-LOC\nis O\n")
    check_columns(config(tmp_path / "ner.conll", task="token-classification"))
    (tmp_path / "texts.txt").write_text("one text\nanother\n")
    check_columns(config(tmp_path / "texts.txt", task="fill-mask"))
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"paragraphs": []}]}, indent=1))
    check_columns(config(tmp_path / "squad.json", task="question-answering"))


def test_preflight_checks_columns_before_the_model_loads(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"sentence": "a", "label": 0}])
    with pytest.raises(DataError, match=r"field 'text': missing.*e\.g\. --text-column sentence"):
        hfport.train.preflight({"model": str(tmp_path / "no-such-model"), "train": str(train)})


def test_multiple_choice_reads_the_renamed_choices(tiny_bert, tmp_path):
    rows = [{"question": f"q{i}", "options": ["yes", "no"], "label": i % 2} for i in range(4)]
    train = write_jsonl(tmp_path / "mc.jsonl", rows)
    checked = hfport.train.preflight({"model": str(tiny_bert), "task": "multiple-choice", "train": str(train),
                                      "eval_fraction": 0.0, "batch_size": 2, "choices_column": "options"})
    assert len(checked.data.train) == 4


# --- did you mean ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given, meant", [("text-clasification", "'text-classification'"),
                                          ("Token_Classification", "'token-classification'"),
                                          ("sentiment-analisys", "'sentiment-analysis' (= text-classification)"),
                                          ("reranker", "'reranking' (= text-ranking)")])
def test_mistyped_task_gets_did_you_mean(given, meant):
    with pytest.raises(tasks.UnknownTaskError) as info:
        tasks.get(given)
    assert f"did you mean {meant}? valid tasks: " in str(info.value)
    with pytest.raises(ValueError, match="did you mean"):
        hfport.pipeline(given, model="unused")
    with pytest.raises(ValueError, match="did you mean"):
        FinetuneConfig(model="m", train="t", task=given)


def test_far_off_task_name_lists_the_tasks_only():
    with pytest.raises(tasks.UnknownTaskError) as info:
        tasks.get("translation")
    assert "did you mean" not in str(info.value) and "valid tasks: feature-extraction" in str(info.value)


def test_cli_mistyped_task(tiny_bert):
    run = CliRunner().invoke(app, ["predict", str(tiny_bert), "--task", "sentence-embeding", "hello"])
    assert run.exit_code == 1 and "did you mean 'sentence-embedding'?" in run.output
    run = CliRunner().invoke(app, ["finetune", "--model", "m", "--train", "t", "--task", "tokn-classification",
                                   "--print-config"])
    assert run.exit_code == 1 and "did you mean 'token-classification'?" in run.output
