"""A verl command line as a streamrft config (``streamrft init --from-verl``).

verl's PPO trainer (``python3 -m verl.trainer.main_ppo``) takes Hydra overrides,
``key.path=value``, over ``verl/trainer/config/ppo_trainer.yaml``, whose defaults the
:data:`DEFAULTS` table compares with streamrft's. :func:`parse_overrides` reads them from
a command line, a file of one a line, or the shell script that runs verl (its line
continuations, quotes and ``NAME=value`` variables followed); :func:`convert` maps them.
Both are pure.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from streamrft.app.conversion import (
    Conversion,
    Default,
    Rule,
    apply,
    finish,
    optimizer_defaults,
    optimizer_rules,
    run_name,
)
from streamrft.schemas.errors import ConfigError

SOURCE = "verl"
A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.model"

ESTIMATORS = {
    "grpo": "grpo",
    "grpo_vectorized": "grpo",
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
    "gae": "ppo",
}
KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2"}
KL |= {"low_var_kl": "low_var_kl", "k3": "low_var_kl"}
"""verl's KL estimators (its ``k3`` is its clamped ``low_var_kl``)."""
LOSS_MODES = {"vanilla": "ppo_clip", "gspo": "gspo", "cispo": "cispo"}
ENGINES = {"vllm": "vllm", "hf": "transformers"}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
DTYPES |= {"float32": "float32", "fp32": "float32"}
CORRECTIONS = {"token": "truncated_is_token", "sequence": "truncated_is_sequence"}

RULES = (
    Rule(
        "data.prompt_key",
        "taskset.messages_key",
        why="verl's rows hold the chat (a list of messages) there",
    ),
    Rule("data.max_prompt_length", "taskset.max_prompt_tokens"),
    Rule(f"{R}.prompt_length", "taskset.max_prompt_tokens"),
    Rule("data.max_response_length", "explorer.max_new_tokens"),
    Rule(f"{R}.response_length", "explorer.max_new_tokens"),
    Rule("data.train_batch_size", "trainer.batch_size", why="prompts (groups) per step"),
    Rule("data.train_batch_size", "explorer.batch_size", why="most prompts per explorer step"),
    Rule("data.shuffle", "taskset.shuffle"),
    Rule("data.seed", "run.seed"),
    Rule(f"{M}.path", "model.path"),
    Rule(f"{M}.enable_gradient_checkpointing", "trainer.gradient_checkpointing"),
    *optimizer_rules(f"{A}.optim"),
    Rule(f"{A}.ppo_mini_batch_size", "trainer.mini_batch_size", why="prompts (groups), as verl"),
    Rule(
        f"{A}.ppo_micro_batch_size_per_gpu",
        "trainer.micro_batch_size",
        why="sequences per forward and backward (one trainer process: its GPU's)",
    ),
    Rule(f"{A}.ppo_micro_batch_size", "trainer.micro_batch_size"),
    Rule(f"{A}.ppo_max_token_len_per_gpu", "trainer.max_tokens_per_micro_batch"),
    Rule(f"{A}.ppo_epochs", "trainer.ppo_epochs"),
    Rule(f"{A}.grad_clip", "trainer.grad_clip"),
    Rule(f"{A}.clip_ratio", "algorithm.clip_low"),
    Rule(f"{A}.clip_ratio", "algorithm.clip_high"),
    Rule(f"{A}.clip_ratio_low", "algorithm.clip_low"),
    Rule(f"{A}.clip_ratio_high", "algorithm.clip_high"),
    Rule(f"{A}.entropy_coeff", "algorithm.entropy_coef"),
    Rule(f"{A}.loss_agg_mode", "algorithm.loss_agg_mode"),
    Rule(f"{A}.policy_loss.loss_mode", "algorithm.policy_loss_fn", LOSS_MODES),
    Rule(f"{R}.n", "explorer.repeat_times"),
    Rule(f"{R}.name", "explorer.engine", ENGINES),
    Rule(f"{R}.temperature", "explorer.temperature"),
    Rule(f"{R}.tensor_model_parallel_size", "explorer.tensor_parallel_size"),
    Rule(f"{R}.gpu_memory_utilization", "explorer.gpu_memory_utilization"),
    Rule(f"{R}.dtype", "model.dtype", DTYPES),
    Rule("actor_rollout_ref.nccl_timeout", "synchronizer.sync_timeout"),
    Rule("algorithm.adv_estimator", "algorithm.type", ESTIMATORS),
    Rule("algorithm.norm_adv_by_std_in_grpo", "algorithm.std_normalize"),
    Rule("algorithm.gamma", "algorithm.gamma"),
    Rule("algorithm.lam", "algorithm.lam"),
    Rule("algorithm.rollout_correction.rollout_is", "algorithm.off_policy_correction", CORRECTIONS),
    Rule("algorithm.rollout_correction.rollout_is_threshold", "algorithm.is_cap"),
    Rule("critic.optim.lr", "algorithm.critic_lr"),
    Rule("critic.cliprange_value", "algorithm.value_clip"),
    Rule("reward_model.overlong_buffer.len", "algorithm.overlong_buffer"),
    Rule("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_penalty"),
    Rule("trainer.total_epochs", "taskset.total_epochs"),
    Rule("trainer.total_training_steps", "trainer.max_steps"),
    Rule(
        "trainer.save_freq",
        "trainer.save_interval",
        lambda v: max(int(v), 0),
        value_why={"-1": "none on the way; 0 here: at the end only"},
    ),
    Rule(
        "trainer.max_actor_ckpt_to_keep",
        "trainer.keep_checkpoints",
        lambda v: v or 0,
    ),
    Rule("trainer.device", "model.device", {"cuda": "cuda", "cpu": "cpu"}),
)

DEFAULTS = (
    Default("data.prompt_key", "prompt", "taskset.messages_key", take=True, why="the chat"),
    Default("data.max_prompt_length", 512, "taskset.max_prompt_tokens", why="0: no limit"),
    Default("data.max_response_length", 512, "explorer.max_new_tokens", take=True),
    Default("data.train_batch_size", 1024, "trainer.batch_size"),
    Default(f"{M}.enable_gradient_checkpointing", True, "trainer.gradient_checkpointing"),
    *optimizer_defaults(f"{A}.optim", weight_decay=0.01, min_lr_ratio=0.0),
    Default(
        f"{A}.ppo_mini_batch_size",
        256,
        "trainer.mini_batch_size",
        why="0: one update per pass over the batch",
    ),
    Default(
        f"{R}.n",
        1,
        "explorer.repeat_times",
        advice="a group here needs 2 or more rollouts to compare",
    ),
    Default(f"{R}.tensor_model_parallel_size", 2, "explorer.tensor_parallel_size"),
    Default(f"{R}.gpu_memory_utilization", 0.5, "explorer.gpu_memory_utilization"),
    Default(f"{R}.dtype", "bfloat16", "model.dtype", take=True),
    Default("algorithm.adv_estimator", "gae", "algorithm.type", why="gae: ppo, with a critic"),
    Default("trainer.total_epochs", 30, "taskset.total_epochs"),
    Default("trainer.save_freq", 0, "trainer.save_interval", said="-1 (none on the way)"),
    Default(
        "trainer.max_actor_ckpt_to_keep",
        0,
        "trainer.keep_checkpoints",
        said="null (every checkpoint kept)",
        why="0 keeps all here",
    ),
    Default(
        "trainer.test_freq",
        0,
        "eval.interval",
        said="-1 (validation before training only)",
        why="0: the first and the last",
    ),
)

SAME = {
    "data.filter_overlong_prompts": (True,),
    "data.truncation": ("error",),
    "data.return_raw_chat": (True, False),
    "data.val_batch_size": (None,),
    f"{M}.use_remove_padding": (True, False),
    f"{M}.target_modules": ("all-linear",),
    f"{A}.use_dynamic_bsz": (True, False),
    f"{A}.shuffle": (False,),
    f"{A}.strategy": ("fsdp", "fsdp2"),
    f"{A}.ulysses_sequence_parallel_size": (1,),
    f"{A}.fsdp_config.param_offload": (False,),
    f"{A}.fsdp_config.optimizer_offload": (False,),
    f"{A}.optim.total_training_steps": (-1, None),
    f"{A}.optim.optimizer": ("AdamW", "adamw"),
    f"{R}.top_p": (1, 1.0),
    f"{R}.top_k": (-1, 0),
    f"{R}.val_kwargs.do_sample": (False,),
    f"{R}.val_kwargs.temperature": (0, 0.0),
    f"{R}.val_kwargs.n": (1,),
    "actor_rollout_ref.hybrid_engine": (True,),
    "algorithm.use_pf_ppo": (False,),
    "algorithm.kl_ctrl.type": ("fixed",),
    "reward_model.enable": (False,),
    "reward_model.reward_manager": ("naive", "dapo"),
    "reward_model.overlong_buffer.enable": (True,),
    "trainer.critic_warmup": (0,),
    "trainer.val_before_train": (True,),
    "trainer.resume_mode": ("auto", "disable"),
}
"""Keys whose value here is what streamrft does anyway: taken without a field."""

KNOWN = {
    "data.reward_fn_key": "the reward is explorer.reward, for every row",
    "data.val_files": "eval.path takes one set (the first is converted)",
    f"{M}.lora_alpha": "read with lora_rank (model.lora)",
    f"{A}.fsdp_config.": "streamrft's FSDP2 has no CPU offload and its own wrapping: an "
    "adapter (model.lora) or more ranks (trainer.nproc) save memory",
    "actor_rollout_ref.ref.fsdp_config.": "streamrft's FSDP2 has no CPU offload; the reference "
    "is kept only with a KL weight",
    f"{A}.checkpoint.": "a checkpoint holds the weights, the optimizer and the run's state",
    f"{A}.clip_ratio_c": "no dual clip: ppo_clip does not bound negative advantages' ratios",
    f"{R}.log_prob_*": "the trainer's log-prob passes use trainer.micro_batch_size",
    "actor_rollout_ref.ref.log_prob_*": "the trainer's log-prob passes use "
    "trainer.micro_batch_size",
    f"{R}.": "a vLLM option streamrft's engine does not expose",
    "actor_rollout_ref.ref.": "the reference is the weights RL started from, kept only with a "
    "KL weight",
    "critic.": "the critic is a copy of the policy's backbone (algorithm.critic_lr, value_clip)",
    "custom_reward_function.": "a reward of yours is explorer.reward: package.module:function, "
    "called as (response_text, task) -> (reward, info): wrap verl's compute_score in one",
    "reward_model.": "a reward model: explorer.reward: judge scores with a served model "
    "(reward.base_url)",
    "trainer.default_local_dir": "checkpoints live in <run.dir>/<run id>/checkpoints",
    "trainer.log_val_generations": "decoded rollouts are on the samples topic "
    "(explorer.samples_per_step)",
    "trainer.rollout_data_dir": "every rollout is on the experiences topic",
    "trainer.resume_from_path": "a run resumes from its own checkpoints (run.id)",
    "trainer.val_before_train": "the trainer evaluates the first version (eval.interval counts "
    "from it)",
    "algorithm.rollout_correction.": "only rollout_is (truncated importance sampling) maps",
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*)|[@*])")
_KEY = re.compile(r"\+{0,2}([A-Za-z_][\w\-]*(?:\.[\w\-]+)+)=(.*)", re.S)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_overrides(text: str, env: Mapping[str, str]) -> dict[str, str]:
    """The ``key.path=value`` overrides of ``text`` (a command line, one a line, or a shell
    script), in order, a later one replacing an earlier; ``$NAME`` and ``${NAME}`` filled
    from the script's own ``NAME=value`` lines and then ``env``, single-quoted text left
    as it is; ``~key`` deletions and words without ``=`` passed over."""
    assigned: dict[str, str] = {}
    out: dict[str, str] = {}
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(_expand(line, {**env, **assigned}), comments=True)
        except ValueError as exc:
            raise ConfigError(f"--from-verl: cannot read {line.strip()!r}: {exc}") from None
        if words and words[0] == "export":
            words = words[1:]
        while words and _is_assignment(words[0]):
            name, value = words.pop(0).split("=", 1)
            assigned[name] = value
        for word in words:
            found = _KEY.fullmatch(word)
            if found:
                out[found.group(1)] = found.group(2)
    return out


def _is_assignment(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and bool(_NAME.fullmatch(name))


def _expand(line: str, env: Mapping[str, str]) -> str:
    """``line`` with the shell's variables filled where the shell fills them: outside
    single quotes (a single quote inside double quotes is a character); an unknown one
    kept as written, ``$@`` and ``$*`` dropped."""
    out, quote, i = [], "", 0
    while i < len(line):
        c = line[i]
        if c == "\\" and quote != "'" and i + 1 < len(line):
            out.append(line[i : i + 2])
            i += 2
            continue
        if c in "'\"" and quote in ("", c):
            quote = "" if quote == c else c
        elif c == "$" and quote != "'":
            m = _VAR.match(line, i)
            if m:
                out.append(_value(m, env))
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _value(m: re.Match[str], env: Mapping[str, str]) -> str:
    name = m.group(1) or m.group(3)
    if name is None:  # $@, $*: the script's own arguments
        return ""
    if name in env:
        return env[name]
    return m.group(2) if m.group(2) is not None else m.group(0)


def hydra_value(text: str) -> Any:
    """An override's value as Hydra reads it: ``null``, ``True``, ``1e-6``, ``[a, b]``,
    else the text."""
    low = text.strip().lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if _NUMBER.fullmatch(text.strip()):
        number = float(text)
        return int(number) if re.fullmatch(r"[-+]?\d+", text.strip()) else number
    if text.strip().startswith(("[", "{")):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    return text


def convert(overrides: Mapping[str, str]) -> Conversion:
    """The streamrft config of verl's ``overrides`` (``key.path`` -> text)."""
    conv = Conversion(SOURCE)
    flat = {key: hydra_value(value) for key, value in overrides.items()}
    _data(flat, conv)
    apply(flat, RULES, (), conv)
    project = _run(flat, conv)
    _lora(flat, conv)
    _kl(flat, conv)
    _evaluation(flat, conv)
    _placement(flat, conv)
    _logger(flat, conv, project)
    apply(flat, (), DEFAULTS, conv)
    if f"{A}.clip_ratio_c" not in flat:
        conv.note(
            "verl's PPO loss bounds the ratio of a negative advantage's token at clip_ratio_c "
            "(3, its dual clip); streamrft's ppo_clip has no such bound"
        )
    finish(flat, conv, "trainer.total_training_steps", SAME, KNOWN)
    return conv


def _data(flat: dict[str, Any], conv: Conversion) -> None:
    """``data.train_files`` (one file, or several: sources) and the first of
    ``data.val_files``; the answer where verl's rows keep it."""
    files = _paths(flat.pop("data.train_files", None))
    if len(files) == 1:
        conv.set("taskset.path", files[0], "verl's `data.train_files`")
    elif files:
        sources = [{"path": path, "name": run_name(_stem(path))} for path in files]
        conv.set(
            "taskset.sources",
            sources,
            f"verl's {len(files)} `data.train_files`, read as one set there: mixed by weight "
            "here (1 each: set weights to give each its share of an epoch)",
        )
    conv.set(
        "taskset.answer_key",
        "reward_model.ground_truth",
        "verl's rows keep the reference answer there (its reward's ground truth)",
    )
    evals = _paths(flat.pop("data.val_files", None))
    if evals:
        conv.set("eval.path", evals[0], "verl's `data.val_files`, its first")
        for extra in evals[1:]:
            conv.skip(f"data.val_files: {extra}", KNOWN["data.val_files"])
    conv.set(
        "explorer.reward",
        "math_answer",
        "verl scores a row by its data_source (GSM8K's: the number after `####`); "
        "math_answer reads <answer> tags or \\boxed{} or else the last number",
    )


def _paths(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _stem(path: str) -> str:
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return "-".join(parts[-2:]).split(".")[0] if parts else "set"


def _run(flat: dict[str, Any], conv: Conversion) -> str:
    """``trainer.project_name``/``experiment_name``: the run's folder, as verl's
    ``checkpoints/<project>/<experiment>``; a fixed run id where verl resumes (its
    ``resume_mode: auto``). The project's name."""
    project = str(flat.pop("trainer.project_name", "verl_examples"))
    name = str(flat.pop("trainer.experiment_name", "gsm8k"))
    conv.set("run.name", run_name(name), f"verl's `trainer.experiment_name: {name}`")
    conv.set(
        "run.dir",
        f"checkpoints/{project}",
        f"verl keeps checkpoints in checkpoints/<project_name>/<experiment_name> "
        f"(`project_name: {project}`); a run's folder is run.dir/<run id>",
    )
    if flat.get("trainer.resume_mode", "auto") == "auto":
        conv.set(
            "run.id",
            run_name(name),
            "verl's `trainer.resume_mode: auto`: a fixed run id, so running this file again "
            "continues the run from its checkpoints",
        )
    conv.note("run it: streamrft run THIS_FILE")
    return project


def _lora(flat: dict[str, Any], conv: Conversion) -> None:
    rank = flat.pop(f"{M}.lora_rank", 0) or 0
    if not rank:
        return
    alpha = flat.pop(f"{M}.lora_alpha", 16)
    conv.set(
        "model.lora",
        {"enabled": True, "rank": int(rank), "alpha": float(alpha)},
        f"verl's `{M}.lora_rank: {rank}`, `lora_alpha: {alpha}` (verl's default 16 where not "
        "given)",
    )


def _kl(flat: dict[str, Any], conv: Conversion) -> None:
    """The KL loss (``use_kl_loss``) and the KL penalty in the reward (``use_kl_in_reward``):
    off is a weight of 0 here."""
    for use, kind_key, coef_key, target in (
        (f"{A}.use_kl_loss", f"{A}.kl_loss_type", f"{A}.kl_loss_coef", "kl_loss"),
        ("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.kl_coef", "kl_penalty"),
    ):  # fmt: skip
        on, kind = flat.pop(use, False), flat.pop(kind_key, None)
        coef = flat.pop(coef_key, None)
        if not on:
            if kind is not None or coef is not None:
                conv.set(f"algorithm.{target}_coef", 0.0, f"verl's `{use}: false`")
            continue
        kind = "low_var_kl" if kind is None and target == "kl_loss" else kind or "kl"
        ours = KL.get(str(kind).lower())
        if ours is None:
            conv.skip(
                kind_key, f"{kind}: no counterpart (streamrft's: k1, k2, k3, low_var_kl, abs)"
            )
            continue
        conv.set(f"algorithm.{target}_fn", ours, f"verl's `{kind_key}: {kind}`")
        weight = 0.001 if coef is None else coef
        conv.set(
            f"algorithm.{target}_coef",
            weight,
            f"verl's `{coef_key}`" + (": its default, 0.001" if coef is None else ""),
        )


def _evaluation(flat: dict[str, Any], conv: Conversion) -> None:
    freq = flat.pop("trainer.test_freq", None)
    if freq is not None and freq > 0:
        conv.set("eval.interval", freq, f"verl's `trainer.test_freq: {freq}`")
    elif freq is not None:
        conv.set("eval.in_trainer", False, f"verl's `trainer.test_freq: {freq}`: no validation")
    n = flat.get(f"{R}.val_kwargs.n", 1)
    if isinstance(n, int) and n > 1 and flat.get(f"{R}.val_kwargs.do_sample"):
        why = f"verl's `{R}.val_kwargs.n: {n}` sampled: pass@k of {n}"
        conv.set("eval.pass_k", n, why)
        conv.set("eval.samples", n, why)
        del flat[f"{R}.val_kwargs.n"], flat[f"{R}.val_kwargs.do_sample"]
        if f"{R}.val_kwargs.temperature" in flat:
            value = flat.pop(f"{R}.val_kwargs.temperature")
            conv.set("eval.temperature", value, f"verl's `{R}.val_kwargs.temperature`")


def _placement(flat: dict[str, Any], conv: Conversion) -> None:
    """verl's hybrid engine gives every GPU to rollout and training in turn; here the
    explorers and the trainer run side by side."""
    gpus = flat.pop("trainer.n_gpus_per_node", None)
    nodes = flat.pop("trainer.nnodes", 1)
    if gpus is None:
        return
    conv.set("model.device", "cuda", f"verl's `trainer.n_gpus_per_node: {gpus}`")
    if nodes and nodes > 1:
        conv.skip(
            "trainer.nnodes",
            f"{nodes}: a trainer over hosts is trainer.nnodes with trainer.rdzv HOST:PORT, "
            "explorers on other hosts are started with streamrft explore --run-id (docs/hosts.md)",
        )
    if gpus > 1:
        conv.skip(
            "trainer.n_gpus_per_node",
            f"{gpus}: verl's hybrid engine shares every GPU between rollout and training in "
            "turn; here they run side by side: give each its GPUs (explorer.devices, "
            "trainer.nproc and trainer.devices), or size them with streamrft init --model "
            f"FOLDER --data FILE --gpus {gpus}",
        )
        return
    why = (
        "one GPU: verl's hybrid engine gives it to rollout and training in turn; here both "
        "hold their memory at once (examples/gsm8k/one_gpu_vllm.yaml's split)"
    )
    if conv.fields.get("explorer.engine") == "vllm":
        share = float(conv.fields.get("explorer.gpu_memory_utilization", 0.5))
        if share > 0.35:
            conv.set("explorer.gpu_memory_utilization", 0.35, why)
        conv.set("trainer.gpu_memory_fraction", 0.55, why)


def _logger(flat: dict[str, Any], conv: Conversion, project: str) -> None:
    names = flat.pop("trainer.logger", None)
    if names is None:
        return
    names = names if isinstance(names, list) else [names]
    ours = [str(n) for n in names if str(n) in ("tensorboard", "wandb", "mlflow")]
    other = [str(n) for n in names if str(n) not in ours and str(n) != "console"]
    why = f"verl's `trainer.logger: {names}` (console: the progress line)"
    conv.set("monitor.exporters", ours, why)
    if other:
        conv.skip("trainer.logger", f"{', '.join(other)}: no exporter (tensorboard, wandb, mlflow)")
    if "wandb" in ours:
        conv.set("monitor.wandb", {"project": project, "mode": "online"}, f"{why}: online")
