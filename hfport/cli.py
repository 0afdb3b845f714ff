"""The `hfport` command: a thin typer layer over the library."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lean HF encoders: inspect, predict, fine-tune, export and serve.")

Verbose = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More log output (-vv for debug).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors.")]


@app.callback()
def _root() -> None:
    """Lean HF encoders: inspect, predict, fine-tune, export and serve."""


def setup_logging(verbose: int = 0, quiet: bool = False) -> None:
    level = logging.ERROR if quiet else logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def info(model: Annotated[str, typer.Argument(help="A model folder or a repo id in the local HF cache.")],
         as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
         verbose: Verbose = 0, quiet: Quiet = False) -> None:
    """Family, head, parameter count, dtype and the load report of MODEL."""
    setup_logging(verbose, quiet)
    from . import HfportError, load_any

    try:
        m = load_any(model)
    except (HfportError, ValueError) as e:
        fail(str(e))
        return
    report = m.load_report
    facts = {
        "path": str(model), "family": m.family.model_type, "head": m.task,
        "architecture": m.family.architectures[m.task], "parameters": m.num_parameters(), "dtype": str(m.dtype),
        "hidden_size": m.config.hidden_size, "layers": m.config.num_hidden_layers,
        "heads": m.config.num_attention_heads, "vocab_size": m.config.vocab_size,
        "labels": m.config.id2label if m.task in ("sequence-classification", "token-classification") else None,
        "load_report": {"loaded": len(report.loaded), "initialized": report.initialized,
                        "unexpected": report.unexpected,
                        "mismatched": [list(x) for x in report.mismatched]},
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
        if value is not None:
            typer.echo(f"{key:<{width}}  {value}")
    typer.echo(f"{'load':<{width}}  " + report.summary().replace("\n", "\n" + " " * (width + 2)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
