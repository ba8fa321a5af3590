"""A Trinity-RFT config as a streamrft config (``streamrft init --from-trinity FILE``).

The keys and defaults are Trinity-RFT's configuration dataclasses' (``Config`` and its
sections in ``trinity/common/config.py``, version 0.5); its style names are its
``SyncStyle`` (``fixed``, ``trainer_driven``, ``explorer_driven``, and the older
``dynamic_by_trainer``, ``dynamic_by_explorer``). :func:`convert` is pure: the tables
below, a few functions for what one key cannot say alone (the task sets, the lengths,
the GPUs, the run's folder), then :func:`.conversion.settle`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from streamrft.app.conversion import (
    Conversion,
    Default,
    Rule,
    apply,
    drop_same,
    explicit_default,
    finish,
    flatten,
    interpolate,
    leftovers,
    optimizer_defaults,
    optimizer_rules,
    run_name,
    shown,
    streamrft_default,
)

SOURCE = "Trinity-RFT"

SYNC_METHODS = {
    "nccl": "nccl",
    "checkpoint": "filesystem",
    "memory": "auto",
    "online": "nccl",
    "offline": "filesystem",
}
SYNC_METHOD_WHY = {
    "nccl": "a broadcast from the trainer (NCCL on GPUs), the object store as the fallback",
    "checkpoint": "each version written to a folder the explorers read (across hosts a "
    "shared one: synchronizer.fs_dir)",
    "memory": "Trinity-RFT's memory method hands each version to its synchronizer actor, "
    "from which explorers on any node fetch it; auto does that job: shared memory (CUDA IPC "
    "on a GPU) for explorers on the trainer's host, the object store for those on other "
    "hosts (shared alone would reach the trainer's host only)",
    "online": "Trinity-RFT's old name of nccl",
    "offline": "Trinity-RFT's old name of checkpoint: a folder of versions",
}
SYNC_STYLES = {
    "fixed": "fixed",
    "trainer_driven": "dynamic_by_trainer",
    "explorer_driven": "dynamic_by_explorer",
    "dynamic_by_trainer": "dynamic_by_trainer",
    "dynamic_by_explorer": "dynamic_by_explorer",
}
SYNC_STYLE_WHY = {
    "trainer_driven": "the trainer publishes every sync_interval steps and the explorers take "
    "the new version at their next step",
    "explorer_driven": "an explorer asks for a newer version every sync_interval steps and "
    "waits until the trainer, at its next step, publishes one",
    "dynamic_by_trainer": "Trinity-RFT's older name of trainer_driven",
    "dynamic_by_explorer": "Trinity-RFT's older name of explorer_driven",
}
ALGORITHMS = {
    "grpo": "grpo",
    "ppo": "ppo",
    "rloo": "rloo",
    "reinforceplusplus": "reinforce_plus_plus",
    "opmd": "opmd",
    "gspo": "gspo",
    "cispo": "cispo",
    "sft": "sft",
    "dpo": "dpo",
    "mix_chord": "chord",
    "on_policy_distill": "on_policy_distill",
}
KL_LOSS_PRESETS = ("ppo", "grpo", "rloo", "reinforceplusplus", "opmd", "gspo", "cispo")
"""Trinity-RFT's algorithms whose preset adds a ``k2`` KL loss (weight 0.001)."""
ADVANTAGES = {
    "grpo": "grpo",
    "ppo": "gae",
    "rloo": "rloo",
    "reinforceplusplus": "reinforce_plus_plus",
    "opmd": "opmd",
    "on_policy_distill": "distill",
}
POLICY_LOSSES = {
    "ppo": "ppo_clip",
    "gspo": "gspo",
    "cispo": "cispo",
    "opmd": "opmd",
    "sft": "sft",
    "dpo": "dpo",
}
KL_FNS = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl", "abs": "abs"}
SAMPLE_STRATEGIES = {"default": "default", "mix": "mix"}
WORKFLOWS = {
    "math_workflow": ("math", "math_answer_format"),
    "async_math_workflow": ("math", "math_answer_format"),
    "math_boxed_workflow": ("math", "math_answer"),
    "async_math_boxed_workflow": ("math", "math_answer"),
    "simple_workflow": ("math", None),
    "async_simple_workflow": ("math", None),
}
"""Trinity-RFT's workflow -> (streamrft's workflow, the reward its own reward stands for)."""
REWARDS = {
    "math_reward": "math_answer_format",
    "math_boxed_reward": "math_answer",
    "accuracy_reward": "math_answer",
    "math_dapo_reward": "math_answer",
    "format_reward": "format",
}
ENGINES = {"vllm": "vllm", "vllm_async": "vllm"}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
DTYPES |= {"half": "float16", "float32": "float32", "fp32": "float32"}
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
SELECTORS = {"sequential": False, "shuffle": True, "random": True}

RULES = (
    Rule("algorithm.algorithm_type", "algorithm.type", ALGORITHMS),
    Rule("algorithm.repeat_times", "explorer.repeat_times"),
    *optimizer_rules("algorithm.optimizer"),
    Rule("algorithm.sample_strategy", "algorithm.sample_strategy", SAMPLE_STRATEGIES),
    Rule("algorithm.advantage_fn", "algorithm.advantage_fn", ADVANTAGES),
    Rule("algorithm.policy_loss_fn", "algorithm.policy_loss_fn", POLICY_LOSSES),
    Rule("algorithm.loss_agg_mode", "algorithm.loss_agg_mode"),
    Rule("algorithm.policy_loss_fn_args.loss_agg_mode", "algorithm.loss_agg_mode"),
    Rule("algorithm.policy_loss_fn_args.clip_range", "algorithm.clip_low"),
    Rule("algorithm.policy_loss_fn_args.clip_range", "algorithm.clip_high"),
    Rule("algorithm.policy_loss_fn_args.clip_range_low", "algorithm.clip_low"),
    Rule("algorithm.policy_loss_fn_args.clip_range_high", "algorithm.clip_high"),
    Rule("algorithm.entropy_loss_fn_args.entropy_coef", "algorithm.entropy_coef"),
    Rule("model.model_path", "model.path"),
    Rule("model.max_response_tokens", "explorer.max_new_tokens"),
    Rule("explorer.rollout_model.max_response_tokens", "explorer.max_new_tokens"),
    Rule("model.temperature", "explorer.temperature"),
    Rule("buffer.batch_size", "trainer.batch_size", why="tasks (groups) per training step"),
    Rule("buffer.batch_size", "explorer.batch_size", why="most tasks per explorer step"),
    Rule("buffer.total_epochs", "taskset.total_epochs"),
    Rule("buffer.total_steps", "trainer.max_steps"),
    Rule("trainer.total_steps", "trainer.max_steps"),
    Rule("explorer.rollout_model.engine_type", "explorer.engine", ENGINES),
    Rule("explorer.rollout_model.engine_num", "explorer.count", why="one explorer per engine"),
    Rule("explorer.rollout_model.tensor_parallel_size", "explorer.tensor_parallel_size"),
    Rule("explorer.rollout_model.gpu_memory_utilization", "explorer.gpu_memory_utilization"),
    Rule("explorer.rollout_model.dtype", "model.dtype", DTYPES),
    Rule("explorer.rollout_model.seed", "run.seed"),
    Rule("explorer.max_timeout", "explorer.task_timeout_s"),
    Rule("explorer.max_retry_times", "explorer.task_retries"),
    Rule("explorer.eval_interval", "eval.interval", why="Trinity-RFT counts explorer steps"),
    Rule("trainer.save_interval", "trainer.save_interval"),
    Rule("trainer.grad_clip", "trainer.grad_clip"),
    Rule(
        "trainer.max_checkpoints_to_keep",
        "trainer.keep_checkpoints",
        lambda v: v or 0,
        "null or 0: every one kept",
    ),
    Rule("trainer.max_token_len_per_gpu", "trainer.max_tokens_per_micro_batch"),
    Rule("synchronizer.sync_method", "synchronizer.method", SYNC_METHODS, "", SYNC_METHOD_WHY),
    Rule("synchronizer.sync_style", "synchronizer.style", SYNC_STYLES, "", SYNC_STYLE_WHY),
    Rule("synchronizer.sync_interval", "synchronizer.sync_interval"),
    Rule("synchronizer.sync_offset", "synchronizer.sync_offset"),
    Rule("synchronizer.sync_timeout", "synchronizer.sync_timeout"),
    Rule("log.level", "monitor.log_level", lambda v: str(v).upper()),
)

DEFAULTS = (
    *optimizer_defaults("algorithm.optimizer", weight_decay=0.01, min_lr_ratio=0.01),
    Default("algorithm.algorithm_type", "ppo", "algorithm.type"),
    Default(
        "algorithm.repeat_times",
        1,
        "explorer.repeat_times",
        advice="a group here needs 2 or more rollouts to compare",
    ),
    Default("buffer.batch_size", 1, "trainer.batch_size"),
    Default("explorer.eval_interval", 100, "eval.interval"),
    Default("trainer.save_interval", 0, "trainer.save_interval", why="0: at the end only"),
    Default(
        "trainer.max_checkpoints_to_keep",
        0,
        "trainer.keep_checkpoints",
        said="null (every checkpoint kept)",
        why="0 keeps all here",
    ),
    Default("explorer.rollout_model.engine_type", "vllm", "explorer.engine", why="vllm extra"),
    Default("explorer.rollout_model.dtype", "bfloat16", "model.dtype", take=True),
    Default("synchronizer.sync_method", "nccl", "synchronizer.method"),
    Default("synchronizer.sync_offset", 0, "synchronizer.sync_offset", why="strictly on-policy"),
    Default("synchronizer.sync_timeout", 3600, "synchronizer.sync_timeout", why="seconds"),
)

SAME = {
    "trainer.trainer_type": ("verl",),
    "trainer.use_dynamic_bsz": (True,),
    "trainer.ulysses_sequence_parallel_size": (1,),
    "trainer.enable_preview": (True,),
    "explorer.eval_on_startup": (True,),
    "model.top_p": (1.0,),
    "model.top_k": (-1,),
    "model.logprobs": (0,),
    "model.min_response_tokens": (0,),
    "model.repetition_penalty": (1.0,),
    "model.enable_prompt_truncation": (True,),
    "model.tinker.enable": (False,),
    "model.external_model.enable": (False,),
    "algorithm.entropy_loss_fn": ("default",),
    "algorithm.optimizer.optimizer_type": ("adam",),
    "cluster.ray_address": ("auto",),
}
"""Keys whose value here is what streamrft does anyway: taken without a field."""

KNOWN = {
    "trainer.trainer_strategy": "streamrft's trainer shards with FSDP2 over trainer.nproc ranks",
    "trainer.save_hf_checkpoint": "`streamrft export` writes a Hugging Face folder from any "
    "checkpoint",
    "trainer.trainer_config": "verl's own settings: convert them with --from-verl",
    "trainer.trainer_config_path": "verl's own settings: convert them with --from-verl",
    "explorer.runner_per_model": "streamrft samples a step's tasks together "
    "(explorer.tasks_per_call, explorer.calls_in_flight)",
    "explorer.rollout_model.": "a vLLM option streamrft's engine does not expose",
    "explorer.auxiliary_models": "other models of a workflow: a judge is explorer.reward: judge "
    "(reward.base_url)",
    "buffer.trainer_input.": "the experiences topic is the buffer (replayable: streamrft "
    "train --from-run)",
    "buffer.explorer_output": "the experiences topic",
    "data_processor.": "no data pipeline: prepare the task file before the run",
    "service.": "no outside services",
    "stages": "run each stage from its own config; an SFT warm-up is trainer.warmup_sft_steps",
    "model.custom_chat_template": "streamrft renders with the tokenizer's own chat template",
    "model.chat_template_path": "streamrft renders with the tokenizer's own chat template",
    "model.critic_model_path": "the critic is a copy of the policy's backbone",
    "monitor.monitor_args": "the exporters' settings are monitor.wandb / monitor.mlflow",
    "ray_namespace": "no Ray",
    "explorer.eval_on_startup": "the trainer evaluates the first version (eval.interval counts "
    "from it)",
    "log.group_by_node": "each process logs to its own file in the run folder",
}


def convert(data: Mapping[str, Any], env: Mapping[str, str]) -> Conversion:
    """The streamrft config of the Trinity-RFT config ``data`` (its YAML, loaded), with
    ``${oc.env:...}`` filled from ``env``."""
    conv = Conversion(SOURCE)
    tree: dict[str, Any] = interpolate(dict(data), env)
    explorer_input = _pop(tree, "buffer", "explorer_input")
    lora = _pop(tree, "model", "lora_configs")
    flat = flatten(tree)
    _run(flat, conv)
    apply(flat, RULES, (), conv)
    _tasksets(explorer_input, conv)
    _lengths(flat, conv)
    _lora(lora, conv)
    _algorithm_parts(flat, conv)
    _train_batch(flat, conv)
    _placement(flat, conv)
    _monitor(flat, conv, tree)
    apply(flat, (), DEFAULTS, conv)
    finish(flat, conv, "buffer.total_steps", SAME, KNOWN)
    return conv


def _pop(data: dict[str, Any], section: str, key: str) -> Any:
    part = data.get(section)
    return part.pop(key, None) if isinstance(part, dict) else None


def _run(flat: dict[str, Any], conv: Conversion) -> None:
    """``name`` and the job's folder, ``checkpoint_root_dir/project/group/name``; a fixed
    run id where Trinity-RFT continues from its checkpoint (its default)."""
    name = str(flat.pop("name", "rft"))
    project, group = str(flat.pop("project", "Trinity-RFT")), str(flat.pop("group", ""))
    root = str(flat.pop("checkpoint_root_dir", "") or ".")
    folder = posixpath.join(root, *(p for p in (project, group) if p))
    conv.set("run.name", run_name(name), f"Trinity-RFT's `name: {name}`")
    conv.set(
        "run.dir",
        folder,
        f"Trinity-RFT keeps a job in checkpoint_root_dir/project/group/name "
        f"(`checkpoint_root_dir: {root}`, `project: {project}`); a run's folder is "
        "run.dir/<run id>",
    )
    if flat.pop("continue_from_checkpoint", True):
        conv.set(
            "run.id",
            run_name(name),
            "`continue_from_checkpoint: true` (Trinity-RFT's default): a fixed run id, so "
            "running this file again continues the run from its checkpoints (trainer.resume)",
        )
    else:
        conv.notes.append(
            "continue_from_checkpoint: false: no run.id, so each run gets a new one "
            "(Trinity-RFT renames the job with a time stamp)"
        )
    mode = str(flat.pop("mode", "both"))
    commands = {
        "both": "streamrft run THIS_FILE (explorers, trainer and feeder)",
        "colocate": "streamrft run THIS_FILE (explorer and trainer share the one GPU)",
        "explore": "streamrft explore THIS_FILE --run-id ID (explorers joining a run)",
        "train": "streamrft train THIS_FILE --run-id ID (the trainer; --from-run to train "
        "from a recorded run's experiences)",
        "serve": "streamrft serve THIS_FILE --run-id ID (an OpenAI-compatible API)",
        "bench": "streamrft score THIS_FILE --run-id ID (a run's checkpoints scored)",
    }
    if mode in commands:
        conv.notes.append(f"mode: {mode}: {commands[mode]}")
    else:
        conv.skip("mode", f"{mode}: no such mode")
    if mode == "colocate":
        flat.setdefault("cluster.node_num", 1)
        flat.setdefault("cluster.gpu_per_node", 1)


def _tasksets(given: Any, conv: Conversion) -> None:
    """``buffer.explorer_input``: the training task set(s), the evaluation set, the
    default workflow and reward."""
    if not isinstance(given, dict):
        conv.notes.append("no buffer.explorer_input.taskset: give taskset.path")
        return
    key = "buffer.explorer_input"
    sets = given.pop("tasksets", None) or []
    if given.get("taskset"):
        sets = [given.pop("taskset"), *sets]
    evals = given.pop("eval_tasksets", None) or []
    workflow = given.pop("default_workflow_type", None)
    reward = given.pop("default_reward_fn_type", None)
    eval_workflow = given.pop("default_eval_workflow_type", None)
    if len(sets) == 1 and isinstance(sets[0], dict):
        flat = flatten(sets[0])
        _one_taskset(flat, conv, f"{key}.taskset")
        workflow = flat.pop("default_workflow_type", workflow)
        reward = flat.pop("default_reward_fn_type", reward)
        leftovers(flat, conv, TASKSET_KNOWN, f"{key}.taskset.")
    elif sets:
        _sources(sets, conv, f"{key}.tasksets")
    if workflow is not None:
        _workflow(str(workflow), conv, f"{key}.default_workflow_type")
    if reward is not None:
        _reward(str(reward), conv, f"{key}.default_reward_fn_type")
    if eval_workflow not in (None, workflow):
        conv.skip(f"{key}.default_eval_workflow_type", "the evaluation runs the same workflow")
    for i, item in enumerate(evals):
        where = f"{key}.eval_tasksets[{i}]"
        if i == 0 and isinstance(item, dict):
            _eval_set(flatten(item), conv, where)
        else:
            conv.skip(where, "eval.path takes one set (the first is converted)")
    leftovers(flatten(given), conv, {}, f"{key}.")


TASKSET_RULES = (
    Rule("format.prompt_key", "taskset.prompt_key"),
    Rule(
        "format.response_key",
        "taskset.answer_key",
        why="the reference answer Trinity-RFT's workflows score against",
    ),
    Rule("format.messages_key", "taskset.messages_key"),
    Rule("format.system_prompt", "taskset.system_prompt"),
    Rule("rollout_args.temperature", "explorer.temperature"),
    Rule("rollout_args.max_tokens", "explorer.max_new_tokens"),
    Rule("data_selector.selector_type", "taskset.shuffle", SELECTORS),
    Rule("task_selector.selector_type", "taskset.shuffle", SELECTORS),
)
TASKSET_SAME = {
    "storage_type": ("file",),
    "format.prompt_type": (None,),
    "rollout_args.top_p": (None,),
    "rollout_args.top_k": (-1,),
    "rollout_args.logprobs": (None,),
    "rollout_args.n": (1,),
    "repeat_times": (1,),
    "max_retry_times": (3,),
    "max_retry_interval": (1,),
    "enable_progress_bar": (False,),
    "data_selector.seed": (42,),
    "task_selector.seed": (42,),
}
TASKSET_KNOWN = {
    "name": "the set's name is its file's",
    "workflow_args": "no workflow arguments: a workflow of your own is a module "
    "(producers/workflows)",
    "format.": "not read: streamrft reads the prompt, answer, messages and id keys",
    "data_selector.": "the order is taskset.shuffle's (seeded by run.seed)",
    "task_selector.": "the order is taskset.shuffle's (seeded by run.seed)",
}


def _one_taskset(flat: dict[str, Any], conv: Conversion, where: str) -> None:
    path, split = flat.pop("path", None), flat.pop("split", "train")
    subset = flat.pop("subset_name", None)
    if path:
        _path(conv, "taskset.path", str(path), subset, where)
    if split != "train":
        conv.set("taskset.split", split, f"Trinity-RFT's `{where}.split: {split}`")
    apply(flat, _prefixed(TASKSET_RULES, ""), (), conv)
    if "taskset.shuffle" not in conv.fields:
        selector = f"{where}.data_selector.selector_type"
        explicit_default(conv, Default(selector, False, "taskset.shuffle", said="sequential"))
    _overlong(flat, conv, where)
    drop_same(flat, TASKSET_SAME)
    answer = conv.fields.get("taskset.answer_key", "answer")
    if path and "gsm8k" in str(path).lower() and answer == "answer":
        conv.set(
            "taskset.answer_extract",
            "gsm8k",
            "the path names GSM8K, whose answers end `#### N`: the number after it is the "
            "reference answer (remove this line if yours are bare numbers)",
        )


def _path(conv: Conversion, target: str, path: str, subset: Any, where: str) -> None:
    full = posixpath.join(path, str(subset)) if subset else path
    why = f"Trinity-RFT's `{where}.path: {path}`"
    if subset:
        why += f" and its `subset_name: {subset}` (the configuration's folder)"
    conv.set(target, full, why)


def _prefixed(rules: tuple[Rule, ...], prefix: str) -> list[Rule]:
    return [Rule(prefix + r.key, r.target, r.values, r.why, r.value_why) for r in rules]


def _overlong(flat: dict[str, Any], conv: Conversion, where: str) -> None:
    """DAPO's overlong punishment in ``reward_fn_args`` (``math_dapo_reward``)."""
    args = {k.removeprefix("reward_fn_args."): v for k, v in flat.items()}
    if not args.get("enable_overlong_penalty"):
        return
    for key in ("enable_overlong_penalty", "cache_length", "penalty_factor", "max_response_length"):
        flat.pop(f"reward_fn_args.{key}", None)
    said = f"Trinity-RFT's `{where}.reward_fn_args`"
    if args.get("cache_length") is not None:
        conv.set("algorithm.overlong_buffer", args["cache_length"], f"{said}.cache_length")
    if args.get("penalty_factor") is not None:
        conv.set("algorithm.overlong_penalty", args["penalty_factor"], f"{said}.penalty_factor")
    if args.get("max_response_length") is not None:
        conv.notes.append(
            f"reward_fn_args.max_response_length {args['max_response_length']}: the "
            "punishment's length here is explorer.max_new_tokens"
        )


def _sources(sets: list[Any], conv: Conversion, where: str) -> None:
    """Several training sets: ``taskset.sources``, mixed by weight."""
    sources = []
    for i, item in enumerate(sets):
        flat = flatten(item) if isinstance(item, dict) else {}
        key = f"{where}[{i}]"
        path, subset = flat.pop("path", ""), flat.pop("subset_name", None)
        source: dict[str, Any] = {
            "path": posixpath.join(str(path), str(subset)) if subset else path
        }
        for theirs, ours in (
            ("name", "name"),
            ("split", "split"),
            ("format.prompt_key", "prompt_key"),
            ("format.response_key", "answer_key"),
            ("format.messages_key", "messages_key"),
        ):
            if theirs in flat:
                source[ours] = flat.pop(theirs)
        if "name" in source:
            source["name"] = run_name(str(source["name"]))
        if "default_workflow_type" in flat:
            named = WORKFLOWS.get(str(flat.pop("default_workflow_type")).lower())
            if named:
                source["workflow"] = named[0]
        drop_same(flat, TASKSET_SAME)
        leftovers(flat, conv, TASKSET_KNOWN, f"{key}.")
        sources.append(source)
    conv.set(
        "taskset.sources",
        sources,
        f"Trinity-RFT's {len(sets)} sets of `{where}`: each a source, mixed by weight (1 each: "
        "set weights to change their shares)",
    )


def _eval_set(flat: dict[str, Any], conv: Conversion, where: str) -> None:
    path, split = flat.pop("path", None), flat.pop("split", "train")
    subset = flat.pop("subset_name", None)
    if path:
        _path(conv, "eval.path", str(path), subset, where)
    if split != conv.fields.get("taskset.split", "train") and path:
        conv.eval_split = str(split)
        conv.reasons["eval.path"].append(
            f"its `split: {split}`: a folder here is read with taskset.split, so name the "
            f"file of {split} (the writer does where the folder holds one)"
        )
    repeat = flat.pop("repeat_times", 1)
    if isinstance(repeat, int) and repeat > 1:
        why = f"Trinity-RFT's `{where}.repeat_times: {repeat}`: pass@k of {repeat} samples"
        conv.set("eval.pass_k", repeat, why)
        conv.set("eval.samples", repeat, why)
    if "rollout_args.temperature" in flat and "eval.pass_k" in conv.fields:
        value = flat.pop("rollout_args.temperature")
        conv.set("eval.temperature", value, f"Trinity-RFT's `{where}.rollout_args.temperature`")
    if "rollout_args.max_tokens" in flat:
        value = flat.pop("rollout_args.max_tokens")
        conv.set("eval.max_new_tokens", value, f"Trinity-RFT's `{where}.rollout_args.max_tokens`")
    for theirs, ours in (
        ("format.prompt_key", "prompt_key"),
        ("format.response_key", "answer_key"),
    ):
        if theirs in flat and flat[theirs] == conv.fields.get(f"taskset.{ours}"):
            del flat[theirs]
    drop_same(flat, TASKSET_SAME)
    known = {**TASKSET_KNOWN, "format.": "the evaluation set is read with the taskset's keys"}
    leftovers(flat, conv, known, f"{where}.")


def _workflow(name: str, conv: Conversion, where: str) -> None:
    named = WORKFLOWS.get(name.lower())
    if named is None:
        conv.skip(where, f"{name}: no counterpart (streamrft's workflows: producers/workflows)")
        return
    workflow, reward = named
    why = f"Trinity-RFT's `{where}: {name}`"
    if name.lower().endswith("math_workflow"):
        why += (
            "; its system prompt asking for <think> and <answer> tags is not added: set "
            "taskset.system_prompt to ask for them"
        )
    conv.set("taskset.workflow", workflow, why)
    if reward and "explorer.reward" not in conv.fields:
        conv.set(
            "explorer.reward",
            reward,
            f"{why.split(';')[0]}: its reward reads the answer and its format (the weights "
            "of the two differ)",
        )


def _reward(name: str, conv: Conversion, where: str) -> None:
    ours = REWARDS.get(name.lower())
    if ours is None:
        conv.skip(where, f"{name}: no counterpart (a function of yours: package.module:function)")
        return
    conv.set("explorer.reward", ours, f"Trinity-RFT's `{where}: {name}`")


def _lengths(flat: dict[str, Any], conv: Conversion) -> None:
    """Responses and prompts from ``max_model_len`` where Trinity-RFT derives them."""
    context = flat.pop("model.max_model_len", None)
    context = flat.pop("explorer.rollout_model.max_model_len", context)
    prompt = flat.pop("model.max_prompt_tokens", None)
    prompt = flat.pop("explorer.rollout_model.max_prompt_tokens", prompt)
    response = conv.fields.get("explorer.max_new_tokens")
    if context and response is None:
        prompt_part = prompt if prompt is not None else context // 2
        response = context - prompt_part
        conv.set(
            "explorer.max_new_tokens",
            response,
            f"Trinity-RFT's `model.max_model_len: {context}` less the prompt's {prompt_part}",
        )
    if prompt is not None:
        conv.set(
            "taskset.max_prompt_tokens",
            prompt,
            f"Trinity-RFT's `model.max_prompt_tokens: {prompt}`; Trinity-RFT cuts a longer "
            "prompt, the feeder here leaves it out (and counts it)",
        )
    elif context and response is not None:
        conv.set(
            "taskset.max_prompt_tokens",
            context - response,
            f"Trinity-RFT's `model.max_model_len: {context}` less the responses' {response}",
        )
    if response is None:
        ours = streamrft_default("explorer.max_new_tokens")
        conv.set(
            "explorer.max_new_tokens",
            ours,
            "`model.max_response_tokens` and `max_model_len` not set: Trinity-RFT takes the "
            f"model's context; streamrft's {ours} is the tiny model's: set the responses' "
            "length (`streamrft init --model FOLDER --data FILE` sizes it from the data)",
        )


def _lora(configs: Any, conv: Conversion) -> None:
    if not configs:
        return
    first = configs[0] if isinstance(configs, list) and isinstance(configs[0], dict) else {}
    rank, alpha = first.get("lora_rank", 32), first.get("lora_alpha", 32)
    conv.set(
        "model.lora",
        {"enabled": True, "rank": rank, "alpha": float(alpha)},
        f"Trinity-RFT's `model.lora_configs[0]` (rank {rank}, alpha {alpha}: Trinity-RFT's "
        "defaults where not given, streamrft's are 8 and 16)",
    )
    for key, value in flatten(first).items():
        if key not in ("lora_rank", "lora_alpha", "name") and (key, value) != (
            "target_modules",
            "all-linear",
        ):
            conv.skip(f"model.lora_configs[0].{key}", f"{shown(value)}: no counterpart")
    for i in range(1, len(configs) if isinstance(configs, list) else 0):
        conv.skip(f"model.lora_configs[{i}]", "one adapter is trained")


def _algorithm_parts(flat: dict[str, Any], conv: Conversion) -> None:
    """The KL terms (a function named ``none`` is a weight of 0 here), and the KL loss
    Trinity-RFT's presets add."""
    for kind in ("loss", "penalty"):
        fn = flat.pop(f"algorithm.kl_{kind}_fn", None)
        coef = flat.pop(f"algorithm.kl_{kind}_fn_args.kl_coef", None)
        where = f"algorithm.kl_{kind}_fn"
        if fn is None:
            continue
        if str(fn).lower() == "none":
            conv.set(f"algorithm.kl_{kind}_coef", 0.0, f"Trinity-RFT's `{where}: none`")
        elif str(fn).lower() in KL_FNS:
            conv.set(f"algorithm.kl_{kind}_fn", KL_FNS[str(fn).lower()], f"Trinity-RFT's `{where}`")
            weight = 0.001 if coef is None else coef
            conv.set(
                f"algorithm.kl_{kind}_coef",
                weight,
                f"Trinity-RFT's `{where}_args.kl_coef`"
                + (" default, 0.001" if coef is None else ""),
            )
        else:
            conv.skip(where, f"{fn}: no counterpart (streamrft's: {', '.join(KL_FNS)})")
    ours = conv.fields.get("algorithm.type")
    theirs = next((k for k, v in ALGORITHMS.items() if v == ours), "ppo")
    ours = ours or streamrft_default("algorithm.type")
    if theirs in KL_LOSS_PRESETS and "algorithm.kl_loss_coef" not in conv.fields:
        conv.set(
            "algorithm.kl_loss_coef",
            0.0,
            f"`algorithm.kl_loss_fn` not set: Trinity-RFT's {theirs} adds a k2 KL loss weighed "
            f"0.001, streamrft's {ours} none: set kl_loss_fn: k2 and kl_loss_coef: 0.001 to "
            "match",
        )


def _train_batch(flat: dict[str, Any], conv: Conversion) -> None:
    """``buffer.train_batch_size`` counts experiences; a streamrft batch counts groups."""
    size = flat.pop("buffer.train_batch_size", 0)
    if not size:
        return
    group = conv.fields.get("explorer.repeat_times", 1)
    if size % group:
        conv.skip("buffer.train_batch_size", f"{size}: not whole groups of {group}")
        return
    conv.set(
        "trainer.batch_size",
        size // group,
        f"Trinity-RFT's `buffer.train_batch_size: {size}` experiences, groups of {group}",
    )


def _placement(flat: dict[str, Any], conv: Conversion) -> None:
    """``cluster.*``: the explorers take the first GPUs (``engine_num`` x
    ``tensor_parallel_size``), the trainer the others, as Trinity-RFT places them."""
    nodes = flat.pop("cluster.node_num", 0) or 0
    gpus = flat.pop("cluster.gpu_per_node", 0) or 0
    said = f"Trinity-RFT's `cluster: {{node_num: {nodes}, gpu_per_node: {gpus}}}`"
    if not (nodes and gpus):
        conv.set("model.device", "auto", "Trinity-RFT finds the GPUs of its Ray cluster: auto")
        return
    conv.set("model.device", "cuda", said)
    if nodes > 1:
        conv.skip(
            "cluster.node_num",
            f"{nodes}: hosts are placed by hand here (explorers started with streamrft explore "
            "--run-id on the others; a trainer over hosts: trainer.nnodes, docs/hosts.md)",
        )
        return
    engines = int(conv.fields.get("explorer.count", 1))
    tp = int(conv.fields.get("explorer.tensor_parallel_size", 1))
    rollout = engines * tp
    if gpus == 1:
        why = f"{said}: explorer and trainer share the GPU (Trinity-RFT's colocate)"
        if conv.fields.get("explorer.engine", "vllm") == "vllm":
            share = min(float(conv.fields.get("explorer.gpu_memory_utilization", 0.9)), 0.25)
            conv.set("explorer.gpu_memory_utilization", share, f"{why}; vLLM at 0.25 at most")
            conv.set("trainer.gpu_memory_fraction", 0.55, f"{why}; the trainer's cap beside it")
        return
    if rollout >= gpus:
        conv.skip("cluster.gpu_per_node", f"{gpus}: the engines take {rollout}, none is left")
        return
    conv.set(
        "explorer.devices",
        [f"cuda:{i * tp}" for i in range(engines)],
        f"{said}: the engines on the first {rollout} GPUs",
    )
    left = list(range(rollout, gpus))
    why = f"{said}: the trainer on the other {len(left)}"
    if len(left) == 1:
        conv.set("trainer.device", f"cuda:{left[0]}", why)
    else:
        conv.set("trainer.nproc", len(left), f"{why} (FSDP2 over them)")
        conv.set("trainer.devices", [f"cuda:{g}" for g in left], why)


def _monitor(flat: dict[str, Any], conv: Conversion, data: Mapping[str, Any]) -> None:
    kind = flat.pop("monitor.monitor_type", None)
    if kind is None:
        return
    ours = MONITORS.get(str(kind).lower())
    if ours is None:
        conv.skip("monitor.monitor_type", f"{kind}: no exporter (tensorboard, wandb, mlflow)")
        return
    why = f"Trinity-RFT's `monitor.monitor_type: {kind}`"
    conv.set("monitor.exporters", [ours], why)
    project = str(data.get("project", "Trinity-RFT"))
    if ours == "wandb":
        conv.set("monitor.wandb", {"project": project, "mode": "online"}, f"{why}, its project")
    elif ours == "mlflow":
        conv.set("monitor.mlflow", {"experiment": project}, f"{why}, its project")
