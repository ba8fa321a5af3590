"""``streamrft score``: a run's checkpoints, scored on the eval taskset.

The policy is built once from the config's ``model`` section (with its LoRA adapter when
``model.lora.enabled``: a LoRA run checkpoints the wrapped model), and the engine
``explorer.engine`` names (or ``--engine``) once around it, before any checkpoint. Each
checkpoint chosen (``--checkpoint latest|all|STEP``) then goes into that engine as a full
version, through the hook an explorer's versions take (``consumers.checkpoint.load_weights``
with the engine as its ``sync.payload.WeightTarget``): the transformers engine copies it
into the model in place, vLLM into its own weights (and the adapter as a new LoRA request),
so every engine scores the checkpoint's weights and one vLLM instance serves them all.
Then, on the eval tasks (``eval.path``, else the training taskset; the first
``eval.max_tasks``), scored with ``explorer.reward`` by the evaluation the trainer and the
evaluator process use (``producers.evaluation.EvalSuite``), so all three agree for one set
of weights:

- greedy reward: the mean reward of greedy responses, what they report as
  ``eval/accuracy`` (with a 0/1 reward it is the accuracy; ``math_answer_format`` gives
  0.1 for the format);
- greedy accuracy: the fraction of those greedy responses that are correct
  (``producers.evaluation.is_correct``, as for pass@k);
- pass@1 and pass@k: ``n`` samples per task at ``eval.temperature`` (else
  ``explorer.temperature``; ``n = --k``, or ``--samples``), seeded by ``run.seed``, through
  the unbiased estimator (``producers.pass_at_k``); a sample is correct when the reward
  says so.

Results go to ``<run dir>/score.json`` (rewritten after every checkpoint, so an interrupted
bench keeps what it measured) and, as ``MetricsEvent`` records of component ``bench``
(step and version of the checkpoint; ``bench/greedy_reward``, ``bench/greedy_accuracy``,
``bench/pass@1``,
``bench/pass@K``, ``bench/tasks``, ``bench/samples``, ``bench/seconds``), to the run's
metrics topic. The broker is found as a process joining the run finds it
(``infra.endpoints``). When there is none to reach (the embedded broker of a finished
run), the results go to the file only and one line says so; ``--require-publish`` makes
that an error, checked before anything is evaluated.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamrft.app.watch.run_events import reachable
from streamrft.infra.config import Config
from streamrft.infra.durable import replace_durably
from streamrft.schemas.errors import ServiceError, StreamRFTError

SCORE_FILE = "score.json"
"""Written in the run's folder unless ``--out`` names another file."""
COMPONENT = "bench"
"""Component id (and role) of the metrics events bench mode publishes."""


@dataclass(frozen=True)
class ScoreOptions:
    """What ``streamrft score`` was asked (its command-line flags)."""

    checkpoint: str = "latest"
    """``latest``, ``all`` or a step number."""
    k: int = 4
    """pass@k is reported for this k (and for 1)."""
    samples: int | None = None
    """Samples per task (n >= k); None: k."""
    require_publish: bool = False
    """Fail, before evaluating, when the metrics cannot be published."""
    out: Path | None = None
    """The JSON file; None: ``<run dir>/score.json``."""

    @property
    def n(self) -> int:
        return self.samples or self.k

    def check(self) -> None:
        if self.k < 1:
            raise StreamRFTError(f"--k {self.k}: pass@k needs k >= 1")
        if self.n < self.k:
            raise StreamRFTError(f"--samples {self.n}: needs at least --k ({self.k}) samples")


@dataclass(frozen=True)
class BenchEntry:
    """One checkpoint's results (one entry of ``score.json``)."""

    step: int
    version: int
    checkpoint: str
    greedy_reward: float
    """Mean reward of the greedy responses: the trainer's ``eval/accuracy``."""
    greedy_accuracy: float
    """Fraction of the greedy responses that are correct (``is_correct``)."""
    pass_at_1: float
    pass_at_k: float
    k: int
    samples: int
    tasks: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The values of its metrics event."""
        return {
            "bench/greedy_reward": self.greedy_reward,
            "bench/greedy_accuracy": self.greedy_accuracy,
            "bench/pass@1": self.pass_at_1,
            f"bench/pass@{self.k}": self.pass_at_k,
            "bench/tasks": float(self.tasks),
            "bench/samples": float(self.samples),
            "bench/seconds": self.seconds,
        }

    def line(self) -> str:
        """The progress line printed once it is measured."""
        return (
            f"step {self.step} (version {self.version}): greedy reward "
            f"{self.greedy_reward:.3f}, accuracy {self.greedy_accuracy:.3f}, "
            f"pass@1 {self.pass_at_1:.3f}, pass@{self.k} {self.pass_at_k:.3f} "
            f"({self.tasks} tasks x {self.samples} samples, {self.seconds:.1f} s)"
        )


# -- which checkpoints -----------------------------------------------------------------------
def select_checkpoints(cfg: Config, which: str) -> list[Path]:
    """The checkpoint folders ``--checkpoint`` names; a :class:`StreamRFTError` naming the
    fix when the run, its checkpoints or the step do not exist."""
    from streamrft.consumers.checkpoint_folders import checkpoints, latest_checkpoint

    run_dir = cfg.run_dir
    if not run_dir.is_dir():
        runs = sorted(p.parent.name for p in Path(cfg.run.dir).glob("*/checkpoints"))
        known = f"; runs with checkpoints there: {', '.join(runs)}" if runs else ""
        raise StreamRFTError(
            f"run {cfg.run.id}: no folder {run_dir}; pass the id `streamrft run` printed "
            f"and the run's run.dir (-o run.dir=...){known}"
        )
    root = run_dir / "checkpoints"
    found = checkpoints(root)
    if not found:
        raise StreamRFTError(
            f"run {cfg.run.id}: no checkpoint in {root}; the trainer writes one every "
            "trainer.save_interval steps and when it stops: bench a run that has trained"
        )
    steps = dict(found)
    if which == "all":
        return [path for _, path in found]
    if which == "latest":
        return [latest_checkpoint(root) or found[-1][1]]
    if not which.isdigit():
        raise StreamRFTError(
            f"--checkpoint {which!r}: expected latest, all or a step number "
            f"(this run has steps {sorted(steps)})"
        )
    if int(which) not in steps:
        raise StreamRFTError(
            f"--checkpoint {which}: run {cfg.run.id} has no checkpoint of step {which}; "
            f"it has steps {sorted(steps)} (older ones are pruned: trainer.keep_checkpoints)"
        )
    return [steps[int(which)]]


# -- scoring ---------------------------------------------------------------------------------
class CheckpointScorer:
    """The run's policy and engine, built once; each checkpoint's weights go into the
    engine and are scored."""

    def __init__(self, cfg: Config) -> None:
        import torch

        from streamrft.infra.modeling import load_policy
        from streamrft.infra.prompts import PromptRenderer
        from streamrft.producers.engines import make_engine
        from streamrft.producers.evaluation import EvalSuite

        self.cfg = cfg
        torch.set_num_threads(cfg.explorer.threads)
        model, tokenizer = load_policy(cfg.model)
        if cfg.model.lora.enabled:
            from streamrft.sync.lora import attach_lora

            model = attach_lora(model, cfg.model.lora).eval()
        # right after loading, before any checkpoint: an engine that copies the model at
        # start (vLLM) starts from the untouched base; checkpoints go in through its hook
        self.engine = make_engine(cfg.explorer.engine, model, tokenizer, cfg.explorer)
        self.suite = EvalSuite(cfg)  # the eval tasks, reward and lengths, as an evaluator's
        self.prompts = PromptRenderer.from_config(cfg.taskset, tokenizer)

    def score(self, path: Path, k: int, n: int) -> BenchEntry:
        """Greedy reward and accuracy, pass@1 and pass@k of the checkpoint at ``path``."""
        from streamrft.consumers.checkpoint import load_weights

        t0 = time.perf_counter()
        state = load_weights(path, self.engine)
        result = self.suite.measure(self.engine, self.prompts, k, n)
        assert result.pass_at_1 is not None and result.pass_at_k is not None  # k >= 1
        return BenchEntry(
            step=state.step,
            version=state.version,
            checkpoint=str(path),
            greedy_reward=result.greedy_reward,
            greedy_accuracy=result.greedy_accuracy,
            pass_at_1=result.pass_at_1,
            pass_at_k=result.pass_at_k,
            k=k,
            samples=n,
            tasks=result.tasks,
            seconds=time.perf_counter() - t0,
        )


# -- publishing ------------------------------------------------------------------------------
class MetricsOutlet:
    """The run's metrics topic, when its broker can be reached; else nothing, said once
    (or, with ``require``, an error)."""

    def __init__(self, cfg: Config, require: bool) -> None:
        self.cfg = cfg
        self.require = require
        self.sender: Any = None
        self.not_published: str | None = None
        """Why the results were not (all) published; None while they are."""

    async def start(self) -> None:
        """Find the run's broker and connect, or give up (see :meth:`_give_up`)."""
        from streamrft.infra import admin
        from streamrft.infra.bus import EventSender
        from streamrft.infra.endpoints import resolve

        try:
            cfg, _ = resolve(self.cfg, joining=True)
            if not cfg.kafka.bootstrap_servers:
                raise ServiceError(f"no broker known for run {cfg.run.id}")
            if not reachable(cfg.kafka.bootstrap_servers, timeout=2.0):
                raise ServiceError(
                    f"the run's broker {cfg.kafka.bootstrap_servers} does not answer (a run's "
                    "embedded broker stops when the run ends)"
                )
            metrics = cfg.topics().metrics
            if metrics not in await admin.list_topics(cfg.kafka):
                raise ServiceError(
                    f"the broker {cfg.kafka.bootstrap_servers} has no topic {metrics} "
                    "(not this run's broker?)"
                )
            sender = EventSender(cfg, COMPONENT, COMPONENT)
            await sender.start()
            self.sender = sender
        except StreamRFTError as exc:
            self._give_up(exc)

    async def publish(self, entry: BenchEntry) -> None:
        from streamrft.schemas.codec import METRICS
        from streamrft.schemas.events import MetricsEvent

        if self.sender is None:
            return
        topics = self.cfg.topics()
        event = MetricsEvent(
            run=topics.run,
            component=COMPONENT,
            step=entry.step,
            version=entry.version,
            values=entry.metrics(),
            created_at=time.time(),
        )
        try:
            await self.sender.send(topics.metrics, METRICS, event, key=topics.run)
        except ServiceError as exc:
            await self.stop()
            self._give_up(exc)

    async def stop(self) -> None:
        if self.sender is not None:
            await self.sender.stop()
            self.sender = None

    def _give_up(self, exc: StreamRFTError) -> None:
        if self.require:
            raise StreamRFTError(
                f"metrics cannot be published: {exc}; start the run's broker, or leave out "
                "--require-publish to write the JSON file only"
            ) from exc
        self.not_published = str(exc)
        print(
            f"streamrft score: metrics not published, results go to the JSON file only "
            f"(--require-publish makes this an error): {exc}",
            file=sys.stderr,
        )


# -- the command -----------------------------------------------------------------------------
def score(cfg: Config, opts: ScoreOptions) -> Path:
    """Score the checkpoints ``opts`` names; returns the JSON file written."""
    from streamrft.producers.engines import check_engine

    opts.check()
    check_engine(cfg.explorer.engine)
    paths = select_checkpoints(cfg, opts.checkpoint)
    out = opts.out or cfg.run_dir / SCORE_FILE
    asyncio.run(_score(cfg, opts, paths, out))
    return out


async def _score(cfg: Config, opts: ScoreOptions, paths: list[Path], out: Path) -> None:
    outlet = MetricsOutlet(cfg, opts.require_publish)
    await outlet.start()
    try:
        scorer = await asyncio.to_thread(CheckpointScorer, cfg)
        entries: list[BenchEntry] = []
        for path in paths:
            entry = await asyncio.to_thread(scorer.score, path, opts.k, opts.n)
            print(entry.line(), flush=True)
            await outlet.publish(entry)
            entries.append(entry)
            _write(out, _report(cfg, opts, entries, outlet))
    finally:
        await outlet.stop()


def _report(
    cfg: Config, opts: ScoreOptions, entries: list[BenchEntry], outlet: MetricsOutlet
) -> dict[str, Any]:
    return {
        "run": cfg.run.id,
        "engine": cfg.explorer.engine,
        "eval_path": cfg.eval.path
        or cfg.taskset.path
        or ", ".join(source.path for source in cfg.taskset.sources),
        "k": opts.k,
        "samples": opts.n,
        "temperature": cfg.explorer.temperature,
        "published": outlet.not_published is None,
        "not_published": outlet.not_published,
        "checkpoints": [asdict(e) for e in entries],
    }


def _write(path: Path, report: dict[str, Any]) -> None:
    """Replace ``path`` in one step (a reader never sees half a file)."""
    replace_durably(path, (json.dumps(report, indent=2) + "\n").encode())
