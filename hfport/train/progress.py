"""The fine-tune's progress bar on the terminal."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from .monitor import fmt_duration, fmt_resources


class Progress:
    """A tqdm bar: loss, lr, then the adaptive ETA (Pace's, evaluations included: tqdm's own assumes every step
    costs the average), throughput and memory. Silent when disabled."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, desc="fine-tune", unit="step", dynamic_ncols=True,
                            bar_format=self.FORMAT)

    def update(self, n: int, loss: float, lr: float, perf: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self.line(loss, lr, perf), refresh=False)
            self.bar.update(n)

    @staticmethod
    def line(loss: float, lr: float, perf: dict[str, Any]) -> str:
        """`ETA 2:13, 3.10 step/s, 12,345 tok/s, loss=0.3817, lr=2.00e-05, RSS 1.2/23.5 GB  VRAM 2.1/80 GB (3%)`
        (tqdm puts it after the elapsed time, behind a comma)."""
        parts = [f"ETA {fmt_duration(perf['eta_s'])}", f"{perf['steps_per_s']:.2f} step/s",
                 f"{perf['tokens_per_s']:,.0f} tok/s"] if "eta_s" in perf else []
        parts += [f"loss={loss:.4f}", f"lr={lr:.2e}"]
        resources = fmt_resources(perf)
        return ", ".join(parts + ([resources] if resources else []))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
