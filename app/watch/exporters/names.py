"""The one place that says what a metric is called in each exporter, and on which step axis.

A metric is a ``(component, key)`` pair: the component that measured it (``trainer``,
``explorer-0``, ``evaluator-0``, ``bench``, ``serve``...) and the key of its
``MetricsEvent.values`` (``train/loss``, ``explorer/reward_mean``, ``bench/pass@4``...).
Every value is plotted against its component's own step (``MetricsEvent.step``): the
trainer's optimizer step, an explorer's step, the bench's checkpoint step, the trainer
step of the version an evaluator evaluated. Components
never share an axis, so explorers that run at different speeds do not interleave.

How components are told apart:

- **TensorBoard**: one run (a subfolder of the TensorBoard folder) per component, named
  :func:`folder`; the tag is :func:`tag` of the key. The same tag of several explorers
  lines up in one chart, one line per explorer.
- **W&B and MLflow**: one W&B/MLflow run per streamrft run; the metric is
  :func:`metric` = ``<component>/<tag>`` (``explorer-0/explorer/reward_mean``), so each
  component is a section of its own. W&B plots it against :func:`step_metric`
  (``<component>/step``, declared with ``define_metric``); MLflow takes the step as is.

Names are made valid for the strictest backend (MLflow: letters, digits and ``_ - . space
/`` only, at most 250 characters, no empty, ``.`` or ``..`` path segment) the same way every
time: ``@`` reads ``_at_`` (``bench/pass@4`` -> ``bench/pass_at_4``); any other character
that is not allowed becomes ``_`` and the name gets ``-`` and 6 hex digits of the original's
SHA-1, so two keys that differ only in such characters stay two metrics (a key that
already reads ``pass_at_4`` and one that reads ``pass@4`` would meet: none does). A
component is a folder in TensorBoard, so ``/`` in a component is replaced too; a key that
reads ``step`` becomes ``step_`` (W&B's step metric has that name).
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from streamrft.schemas.events import MetricsEvent

MAX_NAME = 250
"""MLflow's limit on a metric name (W&B and TensorBoard take longer ones)."""
STEP = "step"
"""Suffix of W&B's per-component step metric, ``<component>/step``."""

_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")
_BAD_IN_FOLDER = re.compile(r"[^A-Za-z0-9_\-. ]")
_WORDS = {"@": "_at_"}
"""Characters with a readable replacement that keeps names apart without a hash."""


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:6]


def _clean(text: str, bad: re.Pattern[str], limit: int) -> str:
    """``text`` with only allowed characters and clean path segments, stable, see above."""
    worded = text
    for char, word in _WORDS.items():
        worded = worded.replace(char, word)
    segments = [
        "_" if seg == "" else f"_{seg}" if seg in (".", "..") else seg
        for seg in bad.sub("_", worded).split("/")
    ]
    cleaned = "/".join(segments).strip(" ") or "_"
    if cleaned != worded or len(cleaned) > limit:
        cleaned = f"{cleaned[: limit - 7]}-{_digest(text)}"
    return cleaned


def tag(key: str) -> str:
    """The exported name of the metric key ``key`` (TensorBoard's tag)."""
    out = _clean(key, _BAD, MAX_NAME - 60)  # room for a component prefix
    return f"{out}_" if out == STEP else out


def folder(component: str) -> str:
    """TensorBoard's run (subfolder) of ``component``; also the W&B/MLflow prefix."""
    return _clean(component, _BAD_IN_FOLDER, 50)


def metric(component: str, key: str) -> str:
    """W&B's and MLflow's name of ``key`` measured by ``component``."""
    return f"{folder(component)}/{tag(key)}"


def step_metric(component: str) -> str:
    """W&B's step metric of ``component`` (its own step axis)."""
    return f"{folder(component)}/{STEP}"


class Point(NamedTuple):
    """One exported value: the metric's name in the backend, its step and value."""

    component: str
    """TensorBoard run of the component (:func:`folder`)."""
    tag: str
    """The key's name (:func:`tag`)."""
    step: int
    value: float

    @property
    def name(self) -> str:
        """``<component>/<tag>``: W&B's and MLflow's name, and the watermark key."""
        return f"{self.component}/{self.tag}"


def points(ev: MetricsEvent) -> list[Point]:
    """Every value of ``ev`` as exported, on its component's own step."""
    comp = folder(ev.component)
    return [Point(comp, tag(key), ev.step, float(value)) for key, value in ev.values.items()]
