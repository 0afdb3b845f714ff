"""The `hfport` command: a thin typer layer over the library."""

from __future__ import annotations

import codecs
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from . import settings as library_settings
from . import tasks, verbosity
from .convert import convert as convert_folder
from .errors import HfportError, ItemError
from .evaluation import evaluate as run_evaluate
from .export import DEFAULT_FORMAT, FORMATS, ExportError, ExportFormat, VerifyFailed, VerifyReport, formats_help, \
    get_format
from .export import export as export_to
from .export import verify as verify_folder
from .hardware import cpu_capabilities, describe, device_name
from .inference import for_inference, inference_steps
from .pipelines import InvalidInput, graph_backend, pipeline, shards
from .retrieval import OUTPUT_FORMATS, SAMPLING_STRATEGIES
from .retrieval import mine as run_mine
from .rundir import RunDir
from .tasks import load_any
from .train.columns import column_fields
from .train.config import FinetuneConfig, read_config_file, resolve_config
from .train.loop import finetune as run_finetune

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lean HF encoders: inspect, predict, fine-tune, export and serve.")

Verbose = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More log output (-vv for debug).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors.")]
DEVICE_HELP = "auto (the first CUDA device when there is one, else the CPU), cpu, cuda or cuda:N (default: cpu)."


@app.callback()
def _root() -> None:
    """Lean HF encoders: inspect, predict, fine-tune, export and serve."""


def setup_logging(verbose: int = 0, quiet: bool = False, default: str = "normal") -> str:
    """-q / -v flags, else HFPORT_VERBOSITY, else `default` (hfport/verbosity.py); returns the level's name. The
    library settings are read first, flags or not: a bad HFPORT_* variable stops the command here, in one line,
    instead of as a traceback wherever the command first reads them."""
    try:
        library_settings.settings()
        level = verbosity.resolve(verbose, quiet, default)
    except ValueError as e:
        fail(str(e))
        raise
    verbosity.configure(level)
    return level


USAGE_ERROR = 2  # click's and typer's exit status for a command line they cannot read; 1: the work failed


def fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def info(model: Annotated[Optional[str], typer.Argument(help="A model folder, a repo id in the local HF cache, a "
                                                            "fine-tune run folder (its best/), or an ONNX or OpenVINO "
                                                            "folder.")] = None,
         hardware: Annotated[bool, typer.Option("--hardware", help="This machine's measured matmul peaks per dtype "
                                                "and what they decide (bf16 native or not).")] = False,
         remeasure: Annotated[bool, typer.Option("--remeasure", help="With --hardware: measure again instead of "
                                                 "reading the cached result.")] = False,
         as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
         device: Annotated[Optional[str], typer.Option(help=DEVICE_HELP)] = None,
         dtype: Annotated[Optional[str], typer.Option(help="The dtype to load MODEL in: float32, bfloat16, float16 "
                                                     "or auto (default: the checkpoint's as stored, float32).")] = None,
         verbose: Verbose = 0, quiet: Quiet = False) -> None:
    """Family, head, parameter count, device, dtype, the inference steps a pipeline applies to it and the load report
    of MODEL (of an ONNX or OpenVINO folder: the graph it serves and what it computes in); --hardware: what this CPU
    computes fast."""
    setup_logging(verbose, quiet)
    if model is None and not hardware:
        fail("give a MODEL, or --hardware for this machine's measured capabilities")
    if hardware:
        caps = cpu_capabilities(refresh=remeasure)
        typer.echo(json.dumps(caps.to_dict(), indent=2) if as_json else describe(caps))
        if model is None:
            return
    folder = RunDir.model_folder(model)
    try:
        graph = graph_backend(folder, None) if Path(folder).exists() else None
        if graph is not None and device not in (None, "auto", "cpu"):
            raise ValueError(f"{folder}: a {graph.name} folder runs on the CPU; --device {device} does not apply")
        m = graph.load(folder, file=None, dtype=dtype) if graph is not None else \
            load_any(folder, device=device, dtype=dtype)
    except (HfportError, ValueError) as e:
        fail(str(e))
        return
    report = m.load_report
    facts = {
        "path": str(model), "family": m.family.model_type, "head": m.task,
        "architecture": m.family.architectures[m.task], "hidden_size": m.config.hidden_size,
        "layers": m.config.num_hidden_layers, "heads": m.config.num_attention_heads,
        "vocab_size": m.config.vocab_size, "labels": m.config.id2label if tasks.get(m.task).labels else None,
    }
    if graph is not None:  # a compiled graph: no parameters, steps or load report of hfport's own model
        facts |= {"format": graph.name, "graph": "; ".join(report.notes),  # its file and precision
                  "files_mb": round(sum(f.stat().st_size for f in m.files) / 2**20, 1)}
    else:
        steps = inference_steps(for_inference(m))  # what a pipeline over this model runs (hfport/inference.py)
        facts |= {
            "parameters": m.num_parameters(), "device": device_name(m.device),
            "dtype": str(m.dtype).removeprefix("torch."),
            "inference": {**{step: f"{n} layers" for step, n in steps.items()},
                          "row_shards": shards.describe("auto", m.dtype)},
            "load_report": {"loaded": len(report.loaded), "initialized": report.initialized,
                            "unexpected": report.unexpected,
                            "mismatched": [list(x) for x in report.mismatched], "nonfinite": report.nonfinite,
                            "notes": report.notes},
        }
    if as_json:
        typer.echo(json.dumps(facts, indent=2))
        return
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if key == "load_report":
            continue
        if key == "parameters":
            value = f"{value:,}"
        if key == "inference":
            value = "; ".join(f"{step} {what}" for step, what in value.items())
        if value is not None:
            typer.echo(f"{key:<{width}}  {value}")
    if graph is None:
        typer.echo(f"{'load':<{width}}  " + report.summary().replace("\n", "\n" + " " * (width + 2)))


def _column(field: str) -> typer.models.OptionInfo:
    """The flag of a fine-tune config column field (--text-column for text_column), in --help's "Data columns"."""
    info = FinetuneConfig.model_fields[field]
    default = f" (default {info.default})" if info.default is not None else ""
    return typer.Option(help=f"{info.description}{default}.", rich_help_panel="Data columns")


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def finetune(
    ctx: typer.Context,
    config_file: Annotated[Optional[Path], typer.Option("--config", help="YAML or JSON file of options.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model folder, repo id in the local HF cache, or a fine-tune "
                                                      "run folder (its best/).")] = None,
    task: Annotated[Optional[str], typer.Option(help=tasks.names_help(trainable_only=True) + ". Default "
                                                     "text-classification.")] = None,
    train: Annotated[Optional[str], typer.Option(help="Training data: CSV/TSV, JSONL, Parquet or Arrow file, a glob "
                                                     "of Parquet/Arrow files, or a datasets save_to_disk folder."
                                                 )] = None,
    eval: Annotated[Optional[str], typer.Option("--eval", help="Evaluation data; else a held-out fraction.")] = None,
    train_split: Annotated[Optional[str], typer.Option(help="A DatasetDict folder's split to train on (default "
                                                           "train).")] = None,
    eval_split: Annotated[Optional[str], typer.Option(help="The split of a DatasetDict folder --eval names (default "
                                                          "validation).")] = None,
    # the columns the task reads (README: the table of each task's; hfport/train/columns.py checks them)
    text_column: Annotated[Optional[str], _column("text_column")] = None,
    text_pair_column: Annotated[Optional[str], _column("text_pair_column")] = None,
    label_column: Annotated[Optional[str], _column("label_column")] = None,
    tokens_column: Annotated[Optional[str], _column("tokens_column")] = None,
    tags_column: Annotated[Optional[str], _column("tags_column")] = None,
    question_column: Annotated[Optional[str], _column("question_column")] = None,
    context_column: Annotated[Optional[str], _column("context_column")] = None,
    answers_column: Annotated[Optional[str], _column("answers_column")] = None,
    choices_column: Annotated[Optional[str], _column("choices_column")] = None,
    anchor_column: Annotated[Optional[str], _column("anchor_column")] = None,
    positive_column: Annotated[Optional[str], _column("positive_column")] = None,
    negative_column: Annotated[Optional[str], _column("negative_column")] = None,
    sentence1_column: Annotated[Optional[str], _column("sentence1_column")] = None,
    sentence2_column: Annotated[Optional[str], _column("sentence2_column")] = None,
    score_column: Annotated[Optional[str], _column("score_column")] = None,
    query_column: Annotated[Optional[str], _column("query_column")] = None,
    negatives_column: Annotated[Optional[str], _column("negatives_column")] = None,
    output_dir: Annotated[Optional[str], typer.Option(help="Where the run goes.")] = None,
    epochs: Annotated[Optional[float], typer.Option()] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Optimizer steps; overrides --epochs.")] = None,
    batch_size: Annotated[Optional[int], typer.Option()] = None,
    grad_accum: Annotated[Optional[int], typer.Option()] = None,
    group_by_length: Annotated[Optional[bool], typer.Option(help="Batch similar lengths together (the default); "
                                                                 "off: shuffled fixed-size batches.")] = None,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Padded-token budget per batch per process.")] = None,
    lr: Annotated[Optional[float], typer.Option()] = None,
    precision: Annotated[Optional[str], typer.Option(help="auto | bf16 | fp16 | fp32")] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="torch.compile the model (dynamic shapes).")] = False,
    max_grad_norm: Annotated[Optional[float], typer.Option()] = None,
    save_strategy: Annotated[Optional[str], typer.Option(help="epoch | steps | no: when to write a resumable "
                                                              "checkpoint (default epoch).")] = None,
    save_steps: Annotated[Optional[int], typer.Option()] = None,
    eval_steps: Annotated[Optional[int], typer.Option()] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    freeze: Annotated[Optional[str], typer.Option(help="Comma-separated parameter-name prefixes.")] = None,
    lora_r: Annotated[Optional[int], typer.Option(help="Train a LoRA adapter of this rank (best/ and final/ then "
                                                      "hold it in PEFT's format).")] = None,
    lora_alpha: Annotated[Optional[float], typer.Option(help="LoRA scaling numerator (scale alpha / r).")] = None,
    lora_dropout: Annotated[Optional[float], typer.Option(help="Dropout on the LoRA input.")] = None,
    lora_targets: Annotated[Optional[str], typer.Option(help="Comma-separated layers to adapt, hfport or HF names "
                                                             "(default: attention query and value).")] = None,
    gradient_checkpointing: Annotated[bool, typer.Option("--gradient-checkpointing", help="Recompute activations "
                                                         "per encoder layer in the backward pass.")] = False,
    resume: Annotated[Optional[str], typer.Option(help="Continue a run: 'latest' (the default when no value "
                                                       "follows) or a checkpoint folder.")] = None,
    teacher: Annotated[Optional[str], typer.Option(help="Distil: learn this model's outputs (a checkpoint of the "
                                                       "task's model with the same tokenizer, or a run folder: its "
                                                       "best/), computed once.")] = None,
    distill_alpha: Annotated[Optional[float], typer.Option(help="Weight of the teacher's term against the "
                                                                "task's own loss (default 0.5; 1: the teacher "
                                                                "alone).")] = None,
    distill_temperature: Annotated[Optional[float], typer.Option(help="Softmax temperature of the logits' KL "
                                                                      "(default 2).")] = None,
    teacher_dtype: Annotated[Optional[str], typer.Option(help="float32 (default) | bfloat16 | int8: the teacher's "
                                                              "dtype while its outputs are computed.")] = None,
    student_layers: Annotated[Optional[str], typer.Option(help="Train a student of these layers of --model "
                                                               "(0,2,4) or every_other.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a run already in --output-dir.")] = False,
    eval_before: Annotated[bool, typer.Option("--eval-before", help="Evaluate the base model before the first step: "
                                              "its figures are the run's step-0 eval line and report.html's "
                                              "'before' column.")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Any other option as KEY=VALUE "
                                                                    "(e.g. --set scheduler=cosine).")] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Show the resolved config and where "
                                                                      "each value came from, then exit.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Fine-tune MODEL on a data file; writes checkpoints, best/, final/, metrics.jsonl, report.html."""
    quiet = setup_logging(verbose, quiet) == "quiet"  # HFPORT_VERBOSITY=quiet silences the bar and summary too
    flags = {"model": model, "task": task, "train": train, "eval": eval, "train_split": train_split,
             "eval_split": eval_split, "output_dir": output_dir, "epochs": epochs,
             "max_steps": max_steps, "batch_size": batch_size, "grad_accum": grad_accum,
             "group_by_length": group_by_length, "max_batch_tokens": max_batch_tokens, "lr": lr,
             "precision": precision, "compile": compile_ or None, "max_grad_norm": max_grad_norm,
             "save_strategy": save_strategy, "save_steps": save_steps, "eval_steps": eval_steps, "seed": seed,
             "freeze": freeze, "resume": resume, "teacher": teacher, "distill_alpha": distill_alpha,
             "distill_temperature": distill_temperature, "teacher_dtype": teacher_dtype,
             "student_layers": student_layers,
             "overwrite": overwrite or None, "gradient_checkpointing": gradient_checkpointing or None,
             **{field: ctx.params[field] for field in column_fields()}}
    flags["eval_before"] = eval_before or None
    given = {"r": lora_r, "alpha": lora_alpha, "dropout": lora_dropout, "target_modules": lora_targets}
    if any(v is not None for v in given.values()):  # any --lora-* flag turns LoRA on
        flags["lora"] = {k: v for k, v in given.items() if v is not None}
    flags.update(_options(set_, "--set", "scheduler=cosine"))
    try:
        file_values = read_config_file(config_file) if config_file else None
        config, sources = resolve_config(file_values, flags, str(config_file or "config file"))
        if print_config:
            for name, value in config.model_dump().items():
                typer.echo(f"{name:<24} {json.dumps(value):<40} ({sources[name]})")
            return
        summary = run_finetune(config, progress=not quiet)
    except (HfportError, ValueError) as e:
        fail(str(e))
        return
    if not quiet and summary:  # the run's summary is the main process's: under a launch the other ranks get {}
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # -o truncation=True, as Python spells it


def _parse_value(text: str) -> object:
    if text.strip() in PYTHON_LITERALS:
        return PYTHON_LITERALS[text.strip()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _option(pair: str, flag: str = "--set", example: str = "top_k=3") -> tuple[str, object]:
    """KEY=VALUE with VALUE read as JSON when it parses (3, true, null, ["a","b"]) or as Python's True, False or
    None, else as a string; a pair that is not KEY=VALUE is a usage error naming FLAG."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        fail(f"{flag} {pair!r}: expected KEY=VALUE, e.g. {flag.split('/')[-1]} {example}", USAGE_ERROR)
    return key.strip().replace("-", "_"), _parse_value(value)


def _options(pairs: Optional[list[str]], flag: str, example: str) -> dict[str, object]:
    """The KEY=VALUE pairs given to FLAG as a dict. Reading them is reading the command line, so a pair that is not
    KEY=VALUE, or a key given twice (no silent last-one-wins), is a usage error: exit 2 as click's own, before any
    work starts. What the keys name is the library's to judge (an unknown option, a refused value: exit 1, as a
    refused --task or --dtype)."""
    out: dict[str, object] = {}
    for key, value in (_option(pair, flag, example) for pair in pairs or []):
        if key in out:
            fail(f"{flag} {key} is given twice ({key}={json.dumps(out[key])}, then {key}={json.dumps(value)}); "
                 "give each option once", USAGE_ERROR)
        out[key] = value
    return out


def _read_inputs(texts: list[str], input_file: Optional[str]) -> tuple[list[object], list[str | None]]:
    """TEXT arguments, then the lines of --input (JSON per line), and where each came from: None for a TEXT (its
    error says "input N", its position), "FILE line N" for a line, so an error names the file's own line even where
    blank lines were skipped. A TEXT that is a JSON object is used as one ({"text", "text_pair"} or {"question",
    "context"}); a line that cannot be read stays an error in its place."""
    items: list[object] = []
    for text in texts:
        try:
            value = json.loads(text) if text.lstrip().startswith("{") else text
        except json.JSONDecodeError:
            value = text
        items.append(value)
    places: list[str | None] = [None] * len(items)
    if input_file is not None:
        try:
            raw = sys.stdin.buffer.read() if input_file == "-" else Path(input_file).read_bytes()
        except OSError as e:
            fail(f"--input {input_file}: {e.strerror or e}")
        raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows editors) is no content, as in --train
        name = "stdin" if input_file == "-" else input_file
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            places.append(f"{name} line {number}")
            try:
                items.append(json.loads(line.decode("utf-8")))
            except UnicodeDecodeError as e:
                items.append(InvalidInput(f"not UTF-8 ({e.reason} at byte {e.start})"))
            except json.JSONDecodeError as e:
                items.append(InvalidInput(f"not JSON ({e.msg})"))
    return items, places


@app.command()
def predict(
    model: Annotated[str, typer.Argument(help="A model folder, a repo id in the local HF cache, or a fine-tune "
                                              "run folder (its best/).")],
    texts: Annotated[Optional[list[str]], typer.Argument(
        help="Inputs; a JSON object is one structured input, e.g. a question and its context.")] = None,
    task: Annotated[str, typer.Option("--task", "-t", help=tasks.names_help() + ".")] = ...,
    input_file: Annotated[Optional[str], typer.Option(
        "--input", "-i", help="A JSONL file (- for stdin): one input per line, a JSON string or object.")] = None,
    options: Annotated[Optional[list[str]], typer.Option(
        "--set", "-o", help="A pipeline option as KEY=VALUE (JSON value), e.g. -o top_k=3 "
        "-o aggregation_strategy=simple; repeatable.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Rows per forward pass.")] = None,
    device: Annotated[Optional[str], typer.Option(help=DEVICE_HELP)] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, float16, bfloat16, auto, int8 (the encoder's Linear "
                                                 "layers in int8 behind the int8 gate) or auto-int8 (the fastest "
                                                 "int8 path installed that passes its gate, in batches and on one "
                                                 "input together: hfport's engine, or an "
                                                 "ONNX / OpenVINO int8 export kept in the cache; else bf16).")] = None,
    gate_data: Annotated[Optional[str], typer.Option("--gate-data", help="With --dtype int8/auto-int8: a file of "
                                                     "texts the int8 gate also judges (one a line, or JSONL with "
                                                     "text / text_pair).")] = None,
    file: Annotated[Optional[str], typer.Option("--file", help="An ONNX or OpenVINO folder's graph to run (default: "
                                                "the one its manifest names: an int8 export's int8 graph); --file "
                                                "model.onnx or openvino_model.xml runs the fp32 one.")] = None,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Run TASK on each input; print one JSON line per input, in order (an error object for a bad input). Exit 1 when
    every input failed; when only some did, exit 0 and count them on stderr."""
    quiet = setup_logging(verbose, quiet) == "quiet"
    parsed = _options(options, "--set/-o", "top_k=3")  # the command line first, before stdin is read
    items, places = _read_inputs(texts or [], input_file)
    if not items:
        fail("no inputs: give TEXT arguments or --input FILE.jsonl")
    try:
        pipe = pipeline(task, model=RunDir.model_folder(model), device=device, dtype=dtype, batch_size=batch_size,
                        gate_data=gate_data, file=file)
        results = pipe.predict(items, **parsed)
    except (HfportError, ValueError, TypeError) as e:
        fail(str(e))
        return
    for result in ItemError.render(results, places):  # a failed input: {"error", "error_type", "index"}
        typer.echo(json.dumps(result, ensure_ascii=False))
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, ItemError)]
    if failed and len(failed) == len(results):  # nothing answered: a script must not take this for success
        fail(f"every input failed ({len(failed)} of {len(results)}); the first: "
             f"{failed[0][1].to_dict(failed[0][0], places[failed[0][0]])['error']}")
    if failed and not quiet:
        shown = ", ".join(places[i] or f"input {i}" for i, _ in failed[:10]) + (", ..." if len(failed) > 10 else "")
        typer.secho(f"warning: {len(failed)} of {len(results)} inputs failed ({shown}); their error objects "
                    "are on their lines", fg=typer.colors.YELLOW, err=True)


def _print_report(report: VerifyReport, json_path: Optional[Path]) -> None:
    typer.echo(report.table())
    if json_path is not None:
        typer.echo(f"report written to {json_path}")


def _format_options(fmt: ExportFormat, flags: list[tuple[str, str, object]]) -> dict[str, object]:
    """The given flags ((flag, option, value); None: not given) as FMT's options; a flag FMT does not take is an
    error naming the formats that do."""
    options: dict[str, object] = {}
    wrong: dict[str, str] = {}
    for flag, option, value in flags:
        if value is None:
            continue
        if option not in fmt.option_names():
            takers = sorted(f.name for f in FORMATS.values() if option in f.option_names())
            wrong[flag] = f"{flag}: only with --format {' or '.join(takers)}"
        options[option] = value
    if wrong:
        fail("; ".join(wrong.values()))
    return options


@app.command()
def export(
    src: Annotated[str, typer.Argument(help="A fine-tune output folder (its best/ unless --final), a checkpoint "
                                            "folder, or a model folder.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The folder to write.")],
    format_: Annotated[str, typer.Option("--format", help=f"What to write: {formats_help()}.")] = DEFAULT_FORMAT,
    verify: Annotated[bool, typer.Option("--verify", help="Prove the export against SRC before DIR appears (the ONNX "
                                                          "and OpenVINO formats always do; this prints the report); "
                                                          "non-zero exit on any failure.")] = False,
    atol: Annotated[Optional[float], typer.Option(help="Absolute tolerance (default by dtype: fp32 1e-5, fp16 1e-2, "
                                                       "bf16 5e-2).")] = None,
    rtol: Annotated[Optional[float], typer.Option(help="Relative tolerance (default by dtype: fp32 1e-4, fp16 1e-2, "
                                                       "bf16 5e-2).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="fp32 | fp16 | bf16: the dtype the weights are stored in "
                                                      "(default fp32).")] = None,
    max_shard_size: Annotated[Optional[str], typer.Option(help="Shard the weights above this size, e.g. 500MB "
                                                               "(default 5GB).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the verify report here as JSON.")] = None,
    final: Annotated[bool, typer.Option("--final", help="Export a fine-tune run's final/ instead of best/.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing DIR.")] = False,
    quantize: Annotated[Optional[str], typer.Option(help="int8: with --format onnx (or openvino), the same as "
                                                         "--format onnx-int8 (openvino-int8).")] = None,
    optimize: Annotated[bool, typer.Option("--optimize", help="onnx: also write model_optimized.onnx, the graph "
                                                              "with onnxruntime's fused attention and norms (always "
                                                              "with int8: the int8 graph is made from it).")] = False,
    opset: Annotated[Optional[int], typer.Option(help="onnx: the ONNX opset (default 17).")] = None,
    min_agreement: Annotated[Optional[float], typer.Option(help="onnx, openvino: the least task-level agreement "
                                                               "(or Spearman) of the int8 graph with fp32 (default "
                                                               "0.99), and least cosine for embeddings (default "
                                                               "0.98).")] = None,
    gate_data: Annotated[Optional[Path], typer.Option("--gate-data", help="onnx-int8, openvino-int8: judge the int8 "
                                                                          "graph on these texts (one a line, or "
                                                                          "JSONL with text / text_pair; at least 64) "
                                                                          "instead of the built-in judged set.")]
    = None,
    pooling: Annotated[Optional[str], typer.Option(help="sentence-transformers: mean | cls | max (default: the "
                                                        "source's pooling, else mean).")] = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="sentence-transformers: "
                                                      "L2-normalise the embeddings (default: as the source).")]
    = None,
    merge: Annotated[bool, typer.Option("--merge", help="A LoRA adapter: write a plain HF folder with the updates "
                                                        "merged (head included): --format merged.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Write SRC in an export format (--format): by default a folder transformers loads (config, safetensors
    weights, tokenizer files and a model card); proven against SRC before it appears with --verify (always for
    ONNX)."""
    setup_logging(verbose, quiet)
    try:
        fmt = get_format(format_)
    except ExportError as e:
        fail(str(e))
        return
    if quantize is not None:  # the older spelling of the quantized formats: --format onnx --quantize int8
        if quantize not in fmt.quantized:
            takers = sorted(f.name for f in FORMATS.values() if quantize in f.quantized)
            known = sorted({q for f in FORMATS.values() for q in f.quantized})
            fail(f"--quantize {quantize}: only with --format {' or '.join(takers)}" if takers else
                 f"--quantize {quantize!r}: expected one of {known}")
        fmt = FORMATS[fmt.quantized[quantize]]
    options = _format_options(fmt, [
        ("--dtype", "dtype", dtype), ("--max-shard-size", "max_shard_size", max_shard_size), ("--atol", "atol", atol),
        ("--rtol", "rtol", rtol), ("--opset", "opset", opset), ("--optimize", "optimize", optimize or None),
        ("--min-agreement", "min_agreement", min_agreement), ("--min-agreement", "min_cosine", min_agreement),
        ("--pooling", "pooling", pooling), ("--normalize", "normalize", normalize),
        ("--gate-data", "gate_data", None if gate_data is None else str(gate_data))])
    if json_path is not None and not (verify or fmt.always_verified):
        fail("--json writes the verify report: add --verify")
    try:
        result = export_to(src, out, format=fmt.name, which="final" if final else "best", force=force, verify=verify,
                           json_path=json_path, merge=merge, **options)
    except VerifyFailed as e:
        _print_report(e.report, json_path)
        fail(f"{out}: the export does not match {e.report.source or src}; nothing was written")
        return
    except (HfportError, ValueError) as e:
        fail(str(e))
        return
    if verify and result.report is not None:
        _print_report(result.report, json_path)
    if not quiet:
        typer.echo(f"exported {result.source} as {result.format} ({result.family}, {result.task}, {result.dtype}) to "
                   f"{result.out}: " + ", ".join(result.files))


@app.command()
def verify(
    folder: Annotated[str, typer.Argument(metavar="DIR", help="A folder in an export format (an HF folder, a "
                                                               "LoRA adapter, a sentence-transformers embedding "
                                                               "or reranker folder, an ONNX or OpenVINO folder; a "
                                                               "fine-tune output folder: its best/, or final/ "
                                                               "with --final).")],
    source: Annotated[Optional[str], typer.Option("--source", help="What DIR was exported from (a fine-tune output "
                                                                   "folder, a checkpoint or a model folder). "
                                                                   "Without it DIR is checked against hfport's own "
                                                                   "load of what it names: an adapter over its "
                                                                   "base, an ONNX/OpenVINO folder against its "
                                                                   "recorded "
                                                                   "source, any other folder against itself.")]
    = None,
    format_: Annotated[Optional[str], typer.Option("--format", help="Check DIR as this format (default: the one it "
                                                                    f"says it is): {', '.join(FORMATS)}.")] = None,
    atol: Annotated[Optional[float], typer.Option(help="Absolute tolerance (default by DIR's dtype: fp32 1e-5, "
                                                       "fp16 1e-2, bf16 5e-2; ONNX 1e-4; OpenVINO 1e-5).")]
    = None,
    rtol: Annotated[Optional[float], typer.Option(help="Relative tolerance (default by DIR's dtype: fp32 1e-4, "
                                                       "fp16 1e-2, bf16 5e-2; ONNX 1e-4; OpenVINO 1e-5).")]
    = None,
    final: Annotated[bool, typer.Option("--final", help="DIR or SOURCE is a run: its final/, not best/.")]
    = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the report here as JSON.")] = None,
    min_agreement: Annotated[Optional[float], typer.Option(help="ONNX/OpenVINO folder: the least int8 "
                                                               "agreement / "
                                                               "Spearman (default 0.99) / cosine (default 0.98) "
                                                               "with fp32.")] = None,
    gate_data: Annotated[Optional[Path], typer.Option("--gate-data", help="ONNX/OpenVINO folder: judge the int8 "
                                                                          "graph on "
                                                                          "these texts (one a line, or JSONL with "
                                                                          "text / text_pair; at least 64).")] = None,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Prove DIR with the verify of the format it is; exit 1 on any FAIL. With --source: DIR computes what hfport
    computes from SOURCE (transformers, peft, sentence-transformers, onnxruntime or OpenVINO loading DIR)."""
    setup_logging(verbose, quiet)
    try:
        report = verify_folder(folder, source, format=format_, which="final" if final else "best", atol=atol,
                               rtol=rtol, json_path=json_path, min_agreement=min_agreement,
                               min_cosine=min_agreement, gate_data=gate_data)
    except (HfportError, ValueError, OSError) as e:  # a bad option, or the report itself could not be written
        fail(str(e))
        return
    _print_report(report, json_path)
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def convert(
    folder: Annotated[str, typer.Argument(help="A folder with pytorch_model.bin, or its shards and "
                                               "pytorch_model.bin.index.json.")],
    out: Annotated[Path, typer.Option("--out", help="The safetensors folder to write.")],
    max_shard_size: Annotated[str, typer.Option(help="Largest weights file, e.g. 5GB or 500MB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="Replace the files of a non-empty --out.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Convert pickled PyTorch weights to safetensors once, keeping every tensor, the config and tokenizer files.

    Only torch's restricted loader (weights_only=True) reads the pickle: a file holding anything but tensors is
    refused, not run. Loading never unpickles; this command is the one explicit step that does."""
    setup_logging(verbose, quiet)
    try:
        result = convert_folder(folder, out, max_shard_size=max_shard_size, overwrite=overwrite)
    except (HfportError, ValueError) as e:
        fail(str(e))
        return
    typer.echo(result.summary())


@app.command()
def mine(
    model: Annotated[str, typer.Option("--model", help="A sentence-embedding model: a folder, a repo id in the "
                                                      "local HF cache, or a fine-tune run folder (its best/).")],
    data: Annotated[str, typer.Option("--data", help="(anchor, positive) rows: CSV/TSV, JSONL, Parquet, Arrow or a "
                                                    "datasets folder; the anchor/positive columns, else the first "
                                                    "two.")],
    out: Annotated[Path, typer.Option("--out", help="Where the mined rows go: .jsonl or .parquet.")],
    corpus: Annotated[Optional[str], typer.Option("--corpus", help="More candidate texts: a .txt file (one text a "
                                                                   "line) or a data file with a `text` column; the "
                                                                   "positives always are candidates.")] = None,
    num_negatives: Annotated[int, typer.Option(help="Negatives per (anchor, positive).")] = 3,
    range_min: Annotated[int, typer.Option(help="Skip each query's this many best candidates.")] = 0,
    range_max: Annotated[Optional[int], typer.Option(help="Consider each query's this many best candidates "
                                                          "(default: range_min + num_negatives + positives, x10 "
                                                          "negatives with a score filter).")] = None,
    max_score: Annotated[Optional[float], typer.Option(help="Drop candidates scoring above this.")] = None,
    min_score: Annotated[Optional[float], typer.Option(help="Drop candidates scoring below this.")] = None,
    absolute_margin: Annotated[Optional[float], typer.Option(help="Drop candidates scoring above the query's "
                                                                  "lowest positive score minus this.")] = None,
    relative_margin: Annotated[Optional[float], typer.Option(help="Drop candidates scoring above the lowest "
                                                                  "positive score minus its magnitude times this "
                                                                  "(0.05: 5% below).")] = None,
    sampling_strategy: Annotated[str, typer.Option(help=f"{' | '.join(SAMPLING_STRATEGIES)}: the best "
                                                       "candidates left, or a random draw of them.")] = "top",
    seed: Annotated[Optional[int], typer.Option(help="The random draw's seed (sampling random).")] = None,
    include_positives: Annotated[bool, typer.Option("--include-positives", help="Keep the positives among the "
                                                    "candidates (a first-stage ranking; forces n-tuple).")] = False,
    output_format: Annotated[str, typer.Option(help=f"{' | '.join(OUTPUT_FORMATS)} (sentence-transformers' "
                                                    "columns; n-tuple and triplet train sentence-embedding, "
                                                    "labeled-pair text-ranking).")] = "triplet",
    output_scores: Annotated[bool, typer.Option("--output-scores", help="Add the scores to each row.")] = False,
    query_prompt_name: Annotated[Optional[str], typer.Option(help="A prompt of the model for the anchors.")] = None,
    query_prompt: Annotated[Optional[str], typer.Option(help="A prompt text for the anchors.")] = None,
    corpus_prompt_name: Annotated[Optional[str], typer.Option(help="A prompt of the model for the corpus.")] = None,
    corpus_prompt: Annotated[Optional[str], typer.Option(help="A prompt text for the corpus.")] = None,
    reranker: Annotated[Optional[str], typer.Option(help="A text-ranking model (or a fine-tune run folder: its "
                                                         "best/) that rescores the candidates for the score "
                                                         "filters.")] = None,
    anchor_column: Annotated[Optional[str], typer.Option(help="The anchor column (default: anchor, else the "
                                                              "first).")] = None,
    positive_column: Annotated[Optional[str], typer.Option(help="The positive column (default: positive, else the "
                                                                "second).")] = None,
    corpus_column: Annotated[str, typer.Option(help="The --corpus data file's text column.")] = "text",
    split: Annotated[str, typer.Option(help="The split of a --data DatasetDict folder (save_to_disk).")] = "train",
    batch_size: Annotated[Optional[int], typer.Option(help="Rows per forward pass.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1, mps ...")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="As `hfport predict --dtype`: float32, float16, bfloat16, "
                                                      "auto, int8, auto-int8.")] = None,
    faiss: Annotated[Optional[bool], typer.Option("--faiss/--no-faiss", help="Search with faiss (installed: "
                                                  "hfport[faiss]) or exactly in blocks (default: faiss for 1M+ "
                                                  "texts when installed).")] = None,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Keep the embeddings on disk by model and text "
                                                                   "(hfport's cache dir) so another run reuses "
                                                                   "them.")] = True,
    cache_dir: Annotated[Optional[Path], typer.Option(help="Where the embedding cache lives.")] = None,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Mine hard negatives for (anchor, positive) rows, as sentence-transformers' mine_hard_negatives; writes rows
    `hfport finetune` reads (--task sentence-embedding; labeled-pair: --task text-ranking)."""
    quiet = setup_logging(verbose, quiet) == "quiet"
    try:
        result = run_mine(model, data, corpus=corpus, out=out, anchor_column=anchor_column,
                          positive_column=positive_column, corpus_column=corpus_column, split=split,
                          reranker=reranker, range_min=range_min,
                          range_max=range_max, max_score=max_score, min_score=min_score,
                          absolute_margin=absolute_margin, relative_margin=relative_margin,
                          num_negatives=num_negatives, sampling_strategy=sampling_strategy,
                          query_prompt_name=query_prompt_name, query_prompt=query_prompt,
                          corpus_prompt_name=corpus_prompt_name, corpus_prompt=corpus_prompt,
                          include_positives=include_positives, output_format=output_format,
                          output_scores=output_scores, seed=seed, use_faiss=faiss, dtype=dtype, device=device,
                          batch_size=batch_size, cache=cache_dir if cache and cache_dir else cache,
                          progress=not quiet)
    except (HfportError, ValueError, ImportError) as e:
        fail(str(e))
        return
    if not quiet:
        typer.echo(result.summary(), err=True)
        typer.echo(f"wrote {len(result.rows)} rows ({', '.join(result.columns)}) to {out}", err=True)


@app.command()
def evaluate(
    model: Annotated[str, typer.Argument(help="A model folder, a repo id in the local HF cache, or a fine-tune run "
                                              "folder (its best/).")],
    data: Annotated[str, typer.Option("--data", help="Labelled data in the format fine-tuning reads for the task "
                                                    "(sentence-embedding: (query, positive) rows: the anchor and "
                                                    "positive columns, else the file's first two).")],
    task: Annotated[str, typer.Option("--task", "-t", help=tasks.names_help(trainable_only=True) + ".")],
    corpus: Annotated[Optional[str], typer.Option("--corpus", help="sentence-embedding: distractors added to the "
                                                                   "corpus (.txt, one text a line, or a file with a "
                                                                   "`text` column).")] = None,
    compare: Annotated[Optional[str], typer.Option("--compare", help="Another model evaluated the same way, side by "
                                                                     "side (e.g. the base of a fine-tune); the "
                                                                     "difference column is MODEL minus it.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the figures here as JSON.")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write a self-contained report.html with the "
                                                                    "charts here.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Examples per forward pass.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1, mps ...")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="As `hfport predict --dtype`: float32, float16, bfloat16, "
                                                      "auto, int8, auto-int8.")] = None,
    cache: Annotated[bool, typer.Option("--cache/--no-cache", help="sentence-embedding: keep the embeddings on "
                                                                   "disk by model and text.")] = True,
    options: Annotated[Optional[list[str]], typer.Option(
        "--set", help="How to read the data, by fine-tuning's option names, as KEY=VALUE: text_column, label_column, "
                      "anchor_column, max_length, ...; sentence-embedding also query_prompt, corpus_prompt_name, "
                      "use_faiss. Repeatable.")] = None,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """TASK's metrics of MODEL on DATA, computed as fine-tuning's evaluation (and sentence-transformers'
    InformationRetrievalEvaluator, for sentence-embedding) computes them; a table, --json and --report."""
    quiet = setup_logging(verbose, quiet) == "quiet"
    parsed = _options(options, "--set", "max_length=128")
    try:
        evaluation = run_evaluate(model, data, task=task, corpus=corpus, compare=compare, json_path=json_path,
                                  report_path=report, dtype=dtype, device=device, batch_size=batch_size, cache=cache,
                                  progress=not quiet, **parsed)
    except (HfportError, ValueError, ImportError) as e:
        fail(str(e))
        return
    typer.echo(evaluation.table())
    for path, what in ((json_path, "figures"), (report, "report")):
        if path is not None and not quiet:
            typer.echo(f"{what} written to {path}", err=True)


class ServeCommand(TyperCommand):
    """`serve --help` ends with every setting's environment variable, by group, read from the settings classes when
    the help is shown: the library never imports the server at import time."""

    @property
    def epilog(self) -> str:
        try:
            from server.settings import Settings as ServerSettings
        except ModuleNotFoundError as e:  # an install without the service's packages: the help says so, as serve does
            from server.__main__ import StartRefused, missing_package

            if not isinstance(refused := missing_package(e), StartRefused):
                raise
            return f"The settings cannot be listed: {refused}"

        paragraphs = ["Flags win over these environment variables; docs/settings.md says what each setting means.",
                      *library_settings.help_text(ServerSettings, "Server"),
                      *library_settings.help_text(library_settings.Settings, "Library")]
        # typer's rich help keeps a paragraph's line breaks; click's plain help keeps them after a \b line
        return "\n\n".join(paragraphs if self.rich_markup_mode else ["\b\n" + p for p in paragraphs])

    @epilog.setter
    def epilog(self, value: str | None) -> None:  # click's __init__ sets it; the property above answers instead
        pass


@app.command(cls=ServeCommand)
def serve(
    host: Annotated[Optional[str], typer.Option(help="Bind address (default 127.0.0.1, or HFPORT_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000, or HFPORT_PORT).")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Job store, registry, uploads and runs "
                                                         "(default ./hfport-data, or HFPORT_DATA_DIR).")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Jobs run at once (HFPORT_MAX_CONCURRENT_JOBS).")] = None,
    role: Annotated[Optional[str], typer.Option(help="api (HTTP only), worker (runs jobs, no HTTP) or all (both; "
                                                     "default, or HFPORT_ROLE). Scale out: see README.")] = None,
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", help="A model to register and load at start: a folder or cached repo id, NAME=PATH to name it; "
                        "repeatable; the first is the default of the TEI/OpenAI routes (HFPORT_MODELS).")] = None,
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Run the HTTP service (server/): predict, fine-tune and export jobs, the dashboard at /."""
    level = setup_logging(verbose, quiet, default="verbose")
    # the service is an application over the library, like this CLI: the library never imports it, so it is
    # imported here, when the command runs (`python -m server` is the same entry point)
    try:
        from server.__main__ import StartRefused
        from server.__main__ import serve as run
    except ImportError as e:
        fail(f"the service needs its dependencies ({e}); pip install hfport")
        return
    try:
        run(host=host, port=port, data_dir=data_dir, max_concurrent_jobs=workers, role=role, models=model or None,
            verbosity=level)
    except StartRefused as e:  # a bad setting, an unusable store, a refused --model: one line, as `python -m server`
        fail(str(e))


def main() -> None:
    # `--resume` with no value means the latest checkpoint (typer options always take a value)
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            argv.insert(i + 1, "latest")
            break
    app(args=argv)


if __name__ == "__main__":
    main()
