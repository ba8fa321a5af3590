"""What both arms of ``bench/vs_trl.py`` start from and train with: the warmed model folder,
the config file, and the TRL options that config maps to (one mapping, printed).

Both arms read the same config file: streamrft runs it (``streamrft run CONFIG``), the TRL
arm (``bench/vs_trl_arm.py``) loads it and turns it into ``GRPOConfig`` options with
:func:`trl_options`, and evaluates with the same evaluator the streamrft trainer uses. No
import of ``trl`` here: the orchestrator prints the mapping without it.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

import yaml

from streamrft.infra.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
TRL_VERSION = "1.16.0"
SETUP_HINT = (
    f"TRL {TRL_VERSION} is the bench extra: `pip install -e '.[bench]'` in the project's venv "
    "(or `make bench-trl-setup`); its needs (transformers, accelerate, datasets) are the "
    "project's own, nothing else changes"
)


def trl_version() -> str | None:
    """The installed TRL's version, or None."""
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


def trl_missing() -> str | None:
    """Why the TRL arm cannot run here (None: it can)."""
    found = trl_version()
    if found is None:
        return f"trl is not installed. {SETUP_HINT}"
    if found != TRL_VERSION:
        return f"trl {found} is installed, the bench is pinned to {TRL_VERSION}. {SETUP_HINT}"
    return None


# -- the warmed model folder ----------------------------------------------------------------
def example_config(seed: int, device: str = "cpu") -> Config:
    """The default example with ``run.seed`` and ``model.seed`` set to ``seed``."""
    overrides = [f"run.seed={seed}", f"model.seed={seed}", f"model.device={device}"]
    return load_config(EXAMPLE, overrides, needs_secrets=False)


def warm_folder(seed: int, out: Path, device: str = "cpu") -> tuple[Path, list[float]]:
    """The default example's tiny model of ``seed`` after its supervised warm-up (the
    trainer's own: ``trainer.warmup_sft_*`` through the train engine's ``warmup``), saved
    as a Hugging Face folder ``out`` (safetensors, config, tokenizer); and the warm-up's
    losses. Both arms load this folder."""
    from streamrft.consumers.train_engine import make_train_engine
    from streamrft.infra.modeling import save_policy
    from streamrft.infra.taskset import read_training_set

    cfg = example_config(seed, device)
    engine = make_train_engine(cfg)
    losses = engine.warmup(read_training_set(cfg.taskset))
    save_policy(engine.model, engine.tokenizer, out)
    return out, losses


# -- the config both arms read -----------------------------------------------------------------
def write_config(
    out: Path,
    folder: Path,
    seed: int,
    steps: int,
    eval_interval: int,
    save_interval: int,
    runs_dir: Path,
    device: str = "cpu",
) -> Path:
    """``out``: the default example's settings, its model replaced by ``folder`` (already
    warmed: no warm-up here), ``steps`` trainer steps, an evaluation every
    ``eval_interval`` steps, a checkpoint every ``save_interval`` (0: none before the
    end), the task file by its absolute path."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"].update(name="vs-trl", dir=str(runs_dir), seed=seed)
    data["model"] = {"source": "path", "path": str(folder), "device": device}
    data["taskset"]["path"] = str((EXAMPLE.parent / data["taskset"]["path"]).resolve())
    data["trainer"].update(max_steps=steps, warmup_sft_steps=0, save_interval=save_interval)
    data["eval"] = {"interval": eval_interval}
    out.write_text(
        "# written by bench/vs_trl.py: examples/arithmetic.yaml from a warmed model folder\n"
        + yaml.safe_dump(data, sort_keys=False)
    )
    return out


def read_config(path: Path) -> Config:
    """The config file both arms read (no secrets: it names no store)."""
    return load_config(path, needs_secrets=False)


# -- streamrft -> TRL ------------------------------------------------------------------------
def trl_options(cfg: Config, out_dir: Path, save_every: int = 0) -> dict[str, Any]:
    """``GRPOConfig`` options that train as ``cfg`` does (see :func:`mapping`).
    ``save_every``: a checkpoint every this many trainer steps (TRL's ``save_steps`` in
    optimizer steps); 0: TRL's default (``save_steps`` 500: none in these runs)."""
    t, e, a = cfg.trainer, cfg.explorer, cfg.algorithm
    epochs = t.ppo_epochs
    completions = t.batch_size * e.repeat_times
    opts: dict[str, Any] = {
        "output_dir": str(out_dir),
        "num_generations": e.repeat_times,
        "per_device_train_batch_size": completions,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": epochs,
        "max_steps": t.max_steps * epochs,
        "learning_rate": t.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "weight_decay": t.weight_decay,
        "adam_beta1": t.betas[0],
        "adam_beta2": t.betas[1],
        "max_grad_norm": t.grad_clip,
        "epsilon": a.clip_low if a.clip_low is not None else 0.2,
        "epsilon_high": a.clip_high if a.clip_high is not None else 0.2,
        "beta": 0.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "max_completion_length": e.max_new_tokens,
        "temperature": e.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "use_cpu": cfg.model.device == "cpu",
        "seed": cfg.run.seed,
        "shuffle_dataset": cfg.taskset.shuffle,
        "report_to": "none",
        "disable_tqdm": True,
    }
    if save_every:
        opts.update(save_strategy="steps", save_steps=save_every * epochs)
    return opts


def check_mappable(cfg: Config) -> None:
    """The settings :func:`trl_options` maps are the only ones that differ from what TRL
    does; anything else set in ``cfg`` that TRL has no match for is refused here."""
    t, a, e = cfg.trainer, cfg.algorithm, cfg.explorer
    if e.batch_size != t.batch_size:
        raise SystemExit("explorer.batch_size must equal trainer.batch_size (one TRL batch)")
    if (a.kl_loss_coef or 0) > 0 or (a.kl_penalty_coef or 0) > 0:
        raise SystemExit("the comparison has no KL term (TRL beta 0)")
    if (a.loss_agg_mode or "token-mean") != "token-mean" or a.type != "grpo":
        raise SystemExit("the comparison is GRPO with token-mean aggregation (TRL dapo)")
    if t.lr_schedule != "constant" or t.lr_warmup_steps or t.mini_batch_size:
        raise SystemExit("constant learning rate, whole-batch updates only")


def mapping(cfg: Config, trl_threads: int = 0) -> list[tuple[str, str, str]]:
    """``(streamrft setting = value, TRL option = value, why they match)`` rows;
    ``trl_threads``: the TRL process's torch threads (0: torch's default)."""
    t, e, a = cfg.trainer, cfg.explorer, cfg.algorithm
    opts = trl_options(cfg, Path("."))
    return [
        (
            f"explorer.repeat_times={e.repeat_times}",
            f"num_generations={e.repeat_times}",
            "group size",
        ),
        (
            f"trainer.batch_size={t.batch_size} groups",
            f"per_device_train_batch_size={opts['per_device_train_batch_size']}",
            "TRL counts completions: prompts per step x group",
        ),
        (
            f"trainer.ppo_epochs={t.ppo_epochs}",
            f"num_iterations={t.ppo_epochs}, steps_per_generation=1",
            "passes over a batch, one optimizer update each",
        ),
        (
            f"--max-steps {t.max_steps}",
            f"max_steps={opts['max_steps']}",
            "TRL counts optimizer updates: steps x ppo_epochs",
        ),
        (f"trainer.lr={t.lr}", f"learning_rate={t.lr}", "AdamW"),
        (
            f"trainer.lr_schedule={t.lr_schedule}",
            "lr_scheduler_type=constant, warmup_steps=0",
            "TRL's default is linear decay",
        ),
        (
            f"trainer.weight_decay={t.weight_decay}, betas={t.betas}",
            f"optim=adamw_torch, weight_decay={t.weight_decay}, adam_beta1/2={t.betas}",
            "torch.optim.AdamW on both sides, eps 1e-8",
        ),
        (f"trainer.grad_clip={t.grad_clip}", f"max_grad_norm={t.grad_clip}", "global norm"),
        (
            f"algorithm.clip_low/high={a.clip_low}/{a.clip_high}",
            f"epsilon={opts['epsilon']}, epsilon_high={opts['epsilon_high']}",
            "PPO clip of the token ratio",
        ),
        (
            f"algorithm.kl_loss_coef={a.kl_loss_coef}",
            "beta=0.0",
            "no KL, no reference model",
        ),
        (
            f"algorithm.loss_agg_mode={a.loss_agg_mode}",
            "loss_type=dapo",
            "sum over the batch's completion tokens / their count (one process, no accumulation)",
        ),
        (
            "algorithm.type=grpo (std_normalize)",
            "scale_rewards=group",
            "(r - group mean) / (unbiased group std + eps); eps 1e-6 here, 1e-4 in TRL",
        ),
        (
            f"explorer.max_new_tokens={e.max_new_tokens}",
            f"max_completion_length={e.max_new_tokens}",
            "",
        ),
        (
            f"explorer.temperature={e.temperature} (no truncation)",
            f"temperature={e.temperature}, top_p=1.0, top_k=0",
            "log-probs at the same temperature",
        ),
        (f"model.dtype={cfg.model.dtype}", "bf16=False, fp16=False", "TRL's default is bf16"),
        (
            f"trainer.gradient_checkpointing={t.gradient_checkpointing}",
            "gradient_checkpointing=False",
            "TRL's default is on",
        ),
        (f"run.seed={cfg.run.seed}", f"seed={cfg.run.seed}", ""),
        (
            f"eval.interval={cfg.eval.interval} (the trainer's own, greedy)",
            f"a callback every {cfg.eval.interval * t.ppo_epochs} optimizer steps",
            "the same GreedyEvaluator on the same eval set",
        ),
        (
            f"trainer.threads={t.threads}, explorer.threads={e.threads}",
            f"torch threads: {trl_threads or f'torch default, {os.cpu_count()} here'}",
            "--trl-threads" if trl_threads else "each tool's default",
        ),
    ]
