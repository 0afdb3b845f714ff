"""`hfport predict`'s exit status (issue 44, item 14): non-zero when every input failed, 0 when some were answered
(each failure an error object on its line, and counted on stderr)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfport.cli import app


def predict(model, *args: str):
    return CliRunner().invoke(app, ["predict", str(model), "--task", "feature-extraction", *args])


def test_every_input_failed_exits_non_zero(tiny_bert, tmp_path):
    run = predict(tiny_bert, "", "   ")
    assert run.exit_code == 1
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["index"], r["error_type"]) for r in lines] == [(0, "PipelineInputError"), (1, "PipelineInputError")]
    assert "error: every input failed (2 of 2); the first: input 0: text is empty or only whitespace" in run.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": \n"unterminated\n')  # two lines, neither JSON
    run = predict(tiny_bert, "--input", str(bad))
    assert run.exit_code == 1 and "every input failed (2 of 2)" in run.stderr
    assert "bad.jsonl line 1: not JSON" in run.stdout


def test_some_inputs_failed_exits_zero_and_counts_them(tiny_bert):
    run = predict(tiny_bert, "fine", "", "great")
    assert run.exit_code == 0, run.output
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert isinstance(lines[0], list) and isinstance(lines[2], list)
    assert lines[1]["index"] == 1 and "text is empty" in lines[1]["error"]
    assert "warning: 1 of 3 inputs failed (input 1)" in run.stderr
    quiet = predict(tiny_bert, "fine", "", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    ok = predict(tiny_bert, "fine")
    assert ok.exit_code == 0 and ok.stderr == ""


def test_a_fine_tune_run_folder_predicts_with_its_best_model(tiny_bert, tmp_path):
    """`hfport predict RUN` takes a run folder as export, evaluate and finetune do: its best/ model."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_bert, run / "best")
    (run / "summary.json").write_text("{}")
    got, want = predict(run, "fine", "great"), predict(run / "best", "fine", "great")
    assert got.exit_code == 0, got.output
    assert got.stdout == want.stdout


def test_an_input_file_with_a_byte_order_mark_reads_as_without(tiny_bert, tmp_path):
    """A JSONL file saved by a Windows editor (UTF-8 BOM, CRLF lines), which --train reads: its first line is an
    input, not 'not JSON'."""
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_bytes(b'"fine"\n"great"\n')
    marked.write_bytes(b'\xef\xbb\xbf"fine"\r\n"great"\r\n')
    got, want = predict(tiny_bert, "--input", str(marked)), predict(tiny_bert, "--input", str(plain))
    assert got.exit_code == 0 and got.stderr == "", got.output
    assert got.stdout == want.stdout


def test_an_option_given_twice_is_refused_naming_it(tiny_bert):
    """-o normalize=true -o normalize=false (or --set lr=... twice in finetune) is refused, not settled by the last
    one silently."""
    run = predict(tiny_bert, "fine", "-o", "normalize=true", "-o", "normalize=false")
    assert run.exit_code == 2 and run.stdout == ""  # a usage error, as test_a_malformed_key_value_... checks
    assert "error: --set/-o normalize is given twice (normalize=true, then normalize=false); give each option once" \
        in run.stderr
    run = CliRunner().invoke(app, ["finetune", "--model", "m", "--train", "t.jsonl", "--set", "lr=0.1",
                                   "--set", "lr=0.2", "--print-config"])
    assert run.exit_code == 2 and "error: --set lr is given twice (lr=0.1, then lr=0.2)" in run.stderr


# every command that takes KEY=VALUE pairs: (its arguments up to the pairs, its flag, the flag's example)
KEY_VALUE_COMMANDS = {
    "predict": (["predict", "MODEL", "--task", "feature-extraction", "fine"], "--set/-o", "-o top_k=3"),
    "evaluate": (["evaluate", "MODEL", "--data", "rows.csv", "--task", "text-classification"], "--set",
                 "--set max_length=128"),
    "finetune": (["finetune", "--model", "MODEL", "--train", "rows.csv", "--output-dir", "RUN"], "--set",
                 "--set scheduler=cosine"),
}


@pytest.mark.parametrize("command", sorted(KEY_VALUE_COMMANDS))
def test_a_malformed_key_value_option_is_a_usage_error_on_every_command(command, tmp_path):
    """A pair that is not KEY=VALUE, or a key given twice, is a command line hfport cannot read: exit 2 on every
    command that takes such pairs, as click's own refusals (an unknown flag, a non-integer --batch-size), before any
    work starts (MODEL does not exist: reading it would fail with 1); the message names the flag and its form. Until
    this, predict exited 2 (click's BadParameter) but evaluate and finetune 1, and a key given twice 1 everywhere."""
    args, flag, example = KEY_VALUE_COMMANDS[command]
    args = [str(tmp_path / "nope") if a == "MODEL" else str(tmp_path / "run") if a == "RUN" else a for a in args]
    opt = flag.split("/")[-1]
    for pairs, message in ((["max_length"], f"error: {flag} 'max_length': expected KEY=VALUE, e.g. {example}"),
                           (["=3"], f"error: {flag} '=3': expected KEY=VALUE"),
                           (["seed=1", "seed=2"], f"error: {flag} seed is given twice (seed=1, then seed=2)")):
        run = CliRunner().invoke(app, [*args, *[x for p in pairs for x in (opt, p)]])
        assert run.exit_code == 2, (pairs, run.output)
        assert message in run.stderr, (pairs, run.stderr)
        assert "Traceback" not in run.output
    failed = CliRunner().invoke(app, [*args, opt, "seed=1"])  # read: the work itself fails (no MODEL): 1
    assert failed.exit_code == 1, failed.output


def test_an_error_about_a_line_of_input_names_the_file_and_its_line(tiny_bert, tmp_path):
    """Blank lines of --input are skipped, so an input's index is not its line: its error names FILE line N."""
    data = tmp_path / "in.jsonl"
    data.write_text('"fine"\n\n\n"   "\n{"text": \n"great"\n')  # line 4: whitespace only; line 5: not JSON
    run = predict(tiny_bert, "first", "--input", str(data))
    assert run.exit_code == 0, run.output
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["error"] for line in lines if isinstance(line, dict)] == [
        f"{data} line 4: text is empty or only whitespace", f"{data} line 5: not JSON (Expecting value)"]
    assert [line["index"] for line in lines if isinstance(line, dict)] == [2, 3]  # the output's own positions
    assert f"warning: 2 of 5 inputs failed ({data} line 4, {data} line 5)" in run.stderr
