"""Collects the parity matrix while tests run and prints it at the end of the session: its hooks below are
conftest's (imported there). Under xdist each worker collects its own cells and sends them back when it finishes;
the controller, whose own grid no test records into, merges them and prints the whole grid."""

from __future__ import annotations

import pytest

RESULTS: dict[tuple[str, str], float] = {}


def record(family: str, task: str, diff: float) -> None:
    RESULTS[(family, task)] = max(diff, RESULTS.get((family, task), 0.0))


def rows() -> list[tuple[str, str, float]]:
    """RESULTS as plain rows, as a worker sends them to the controller."""
    return [(family, task, diff) for (family, task), diff in RESULTS.items()]


def merge(rows: list[tuple[str, str, float]]) -> None:
    for family, task, diff in rows:
        record(family, task, diff)


def render() -> str:
    if not RESULTS:
        return ""
    families = sorted({f for f, _ in RESULTS})
    tasks = list(dict.fromkeys(t for _, t in RESULTS))
    width = max(len(t) for t in tasks) + 2
    first = max(len(f) for f in families + ["family"]) + 2
    lines = ["parity vs transformers: max |diff| over outputs, loss and gradients (fp32)",
             "family".ljust(first) + "".join(t.rjust(width) for t in tasks)]
    for f in families:
        cells = [f"{RESULTS[(f, t)]:.1e}" if (f, t) in RESULTS else "-" for t in tasks]
        lines.append(f.ljust(first) + "".join(c.rjust(width) for c in cells))
    return "\n".join(lines)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: what it sends back when it finishes
        session.config.workeroutput["parity_grid"] = rows()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: called on the controller as each worker finishes
def pytest_testnodedown(node, error) -> None:
    merge(getattr(node, "workeroutput", {}).get("parity_grid", []))


def pytest_terminal_summary(terminalreporter) -> None:
    text = render()
    if text:
        terminalreporter.write_sep("-", "parity grid")
        terminalreporter.write_line(text)
