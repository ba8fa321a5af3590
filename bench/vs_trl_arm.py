"""The TRL arm of ``bench/vs_trl.py``: TRL's ``GRPOTrainer`` as its documentation shows it
(a model folder, a reward function, a ``datasets.Dataset``, ``trainer.train()``), in a
process of its own.

    python bench/vs_trl_arm.py CONFIG --out DIR --events FILE [--save-every N] [--resume]

CONFIG is the file the streamrft arm runs (``bench/vs_trl_setup.py`` writes it); its
settings become ``GRPOConfig`` options through :func:`vs_trl_setup.trl_options`. The reward
is the config's own streamrft reward function (``explorer.reward``) on TRL's decoded
completions; the evaluation is the streamrft trainer's (``GreedyEvaluator`` of the same
config: the same eval tasks, prompts, greedy decoding and answer check), at the start and
every ``eval.interval`` trainer steps (``eval.interval x ppo_epochs`` optimizer steps), as
the streamrft trainer evaluates itself. ``--resume``: ``trainer.train(resume_from_checkpoint
=True)``, TRL's documented restart from the newest checkpoint in DIR.

Events go to FILE, one JSON object a line, written when they happen (``t``: Unix time):
``start``, ``gen`` (a batch generated: its batch index, rollouts, completion tokens, mean
reward), ``step`` (a trainer step done: every ``ppo_epochs`` optimizer steps), ``eval``
(``accuracy``: ``eval/accuracy``), ``end``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl_setup import read_config, trl_missing, trl_options  # bench/, beside us


class EventLog:
    """The events file: one flushed JSON line per event."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("a", buffering=1)

    def write(self, kind: str, **values: Any) -> None:
        self.fh.write(json.dumps({"kind": kind, "t": time.time(), **values}) + "\n")


def make_reward(cfg, log: EventLog, epochs: int):
    """A TRL reward function around the config's streamrft reward (``explorer.reward``);
    it also logs each generated batch (``gen``)."""
    from streamrft.producers.rewards import get_reward
    from streamrft.schemas.experience import Task

    reward = get_reward(cfg.explorer.reward, cfg.explorer.reward_skips_thinking, cfg.reward)

    def exact_match(prompts, completions, completion_ids, answer, id, trainer_state, **_):
        scores = [
            reward(text, Task(id=i, prompt=p, answer=a))[0]
            for p, text, a, i in zip(prompts, completions, answer, id, strict=True)
        ]
        log.write(
            "gen",
            batch=trainer_state.global_step // epochs + 1,
            rollouts=len(scores),
            tokens=sum(len(ids) for ids in completion_ids),
            reward_mean=sum(scores) / len(scores),
        )
        return scores

    return exact_match


def make_callback(cfg, log: EventLog, epochs: int):
    """Evaluations at the start, every ``eval.interval`` trainer steps and at the end, and a
    ``step`` event per trainer step, as the streamrft trainer does."""
    import torch
    from transformers import TrainerCallback

    from streamrft.producers.evaluation import GreedyEvaluator

    evaluator = GreedyEvaluator(cfg)
    interval = cfg.eval.interval

    class Progress(TrainerCallback):
        last_eval = -1

        def _evaluate(self, step: int, model, processing_class) -> None:
            was_training = model.training
            model.eval()
            t0 = time.perf_counter()
            with torch.no_grad():
                values = evaluator(model, processing_class)
            model.train(was_training)
            self.last_eval = step
            log.write(
                "eval",
                step=step,
                accuracy=values["eval/accuracy"],
                seconds=time.perf_counter() - t0,
            )

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **_):
            self._evaluate(state.global_step // epochs, model, processing_class)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **_):
            if state.global_step % epochs:
                return
            step = state.global_step // epochs
            log.write("step", step=step)
            if interval and step % interval == 0:
                self._evaluate(step, model, processing_class)

        def on_train_end(self, args, state, control, model=None, processing_class=None, **_):
            step = state.global_step // epochs
            if step != self.last_eval:
                self._evaluate(step, model, processing_class)

    return Progress()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, required=True, help="TRL's output_dir (checkpoints)")
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--save-every", type=int, default=0, help="trainer steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True")
    args = p.parse_args(argv)
    missing = trl_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    log = EventLog(args.events)
    log.write("start", resume=args.resume)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from streamrft.infra.taskset import read_training_set

    cfg = read_config(args.config)
    epochs = cfg.trainer.ppo_epochs
    tasks = read_training_set(cfg.taskset)
    dataset = Dataset.from_list(
        [{"prompt": t.prompt, "answer": t.answer, "id": t.id} for t in tasks]
    )
    trainer = GRPOTrainer(
        model=cfg.model.path,
        reward_funcs=make_reward(cfg, log, epochs),
        args=GRPOConfig(**trl_options(cfg, args.out, args.save_every)),
        train_dataset=dataset,
        callbacks=[make_callback(cfg, log, epochs)],
    )
    log.write("ready", threads=torch.get_num_threads())
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    log.write("end", step=trainer.state.global_step // epochs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
