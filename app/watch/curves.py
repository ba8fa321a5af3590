"""``<run dir>/curves.png``: a run's curves in one picture, drawn from its metrics events.

Four panels: reward (the trainer's batch mean by trainer step, and each explorer's by its
step), eval accuracy, staleness of the trained groups (mean and max per step), and the
trainer's step time beside its wait for experiences. ``series`` is the pure part (events to
named point lists); ``draw`` only plots them (matplotlib, no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from streamrft.schemas.events import MetricsEvent

Points = list[tuple[int, float]]

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("train/reward_mean", "explorer/reward_mean")),
    ("eval accuracy", ("eval/accuracy",)),
    ("staleness (versions)", ("train/staleness_mean", "train/staleness_max")),
    ("seconds per trainer step", ("train/step_seconds", "train/wait_seconds")),
)
"""Panel title and the metric keys it plots."""


def series(events: Iterable[MetricsEvent]) -> dict[str, dict[str, Points]]:
    """Panel title -> line label -> (step, value) points, in step order. A line is one key
    of one component (``explorer-0 explorer/reward_mean``); the trainer's lines carry only
    the key. Non-finite values are left out (a plot cannot show them)."""
    wanted = {key: title for title, keys in PANELS for key in keys}
    out: dict[str, dict[str, Points]] = {title: {} for title, _ in PANELS}
    for ev in events:
        for key, value in ev.values.items():
            title = wanted.get(key)
            if title is None or not math.isfinite(value):
                continue
            label = key if ev.component == "trainer" else f"{ev.component} {key}"
            out[title].setdefault(label, []).append((ev.step, value))
    for lines in out.values():
        for points in lines.values():
            points.sort(key=lambda p: p[0])
    return out


def draw(events: Iterable[MetricsEvent], path: Path, title: str = "") -> Path | None:
    """Write the curves to ``path`` (PNG); None when there is nothing to plot."""
    data = series(events)
    if not any(data.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (panel, lines) in zip(axes.flat, data.items(), strict=True):
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for label, points in sorted(lines.items()):
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=label, marker="." if len(points) < 30 else None)
        if lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
