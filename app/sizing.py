"""The sizes a real model's run needs, from the model, the data and the hardware: the rules
``streamrft init`` writes a config by and ``streamrft validate`` warns by. Pure: the facts
come in (``app/sizing_facts.py`` reads them), the choices and warnings go out, each with
its reason.

The values are the repository's recipes' where one fits: ``examples/gsm8k/*.yaml``
(Qwen2.5-1.5B on GPUs) and ``examples/smollm2_gsm8k_format.yaml`` (SmolLM2-135M with LoRA
on a CPU). Between and beyond them the rules scale:

- the learning rate by the model's size, full fine-tuning or an adapter (:func:`lr_range`);
- the response length from the data's answers and the model's own responses to its first
  prompts (:func:`response_choice`), and a lower temperature where those ramble and at
  the lower one they do not (:func:`response_choices`); the prompt length from its
  prompts as the model's template renders them (:func:`prompt_choice`);
- batches, group size and schedule by the hardware (:func:`batch_choices`,
  :func:`schedule_choices`), the engine and devices by what is there (:func:`placement_choices`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from streamrft.infra.config import Config

GROUP_ADVANTAGES = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opmd")
"""Advantage estimators that compare a task's rollouts with each other: a group of one
gives every rollout a zero advantage."""
RECIPE_PARAMS = 1_543_714_304
"""Qwen2.5-1.5B-Instruct, the GSM8K recipes' model."""
RECIPE_SPAN = (0.67, 1.5)
"""A model within these multiples of the recipes' model takes their values on GPUs."""
FULL_HEADROOM = 0.8
"""Full fine-tuning is chosen where the plan's total stays within this share of the GPU
(Run a real model measured the trainer 7% over its estimate, plus the CUDA context)."""
WORKED_FACTOR = 2
"""Room for a response over the data's worked answers: a model's own working is longer
than a dataset's terse reference."""
FLOOR = 128
"""The least response room: enough to work a short answer out."""
CHAT_FLOOR = 256
"""The least response room of a chat model, which explains in prose: SmolLM2-135M-Instruct's
sampled answers (temperature 1) to 8 questions of the GSM8K-shaped sample, whose worked
answers are 28 tokens at most, ran 30, 62, 63, 80, 145, 158 tokens and two past 256
(2-core dev box, 2026-12-06)."""
PROMPT_HEADROOM = 1.25
"""Over the longest prompt sampled, for the rows not sampled."""
RESPONSE_SAMPLES = 8
"""The model's own responses ``init`` samples by default (``--sample-responses``), one to
each of the data's first prompts: few, as a CPU samples them one by one."""
CALMER_TEMPERATURE = 0.7
"""The temperature ``init`` samples the model's responses at again where at the explorer's
(higher) temperature they ramble, and writes where there they do not
(:func:`tries_calmer`, :func:`response_choices`): SmolLM2-135M-Instruct on GSM8K at 1.0
drifted into unrelated text past 512 tokens in 2 of 8 responses, and a two-step run cut 25%
of its responses there; at 0.7 the same run cut 3% (2-core dev box, 2026-12-06)."""
RESPONSE_HEADROOM = 1.25
"""Over the model's own sampled responses (their 90th percentile: of 8, the longest), for
the prompts not sampled."""
WARMUP_RATIO = 0.033
"""The recipes' warm-up: 10 of 300 steps."""
MIN_GROUP = 4
"""Smaller groups of a group-based algorithm are warned of (the recipes use 8)."""
CPU_MICRO_TOKENS = 1024
"""Tokens of a CPU trainer's micro-batch: the CPU example's 8 rows of about 120 tokens
(its trainer peaked at ~4.4 GB); a two-step run with 8 rows of 128 + 256 tokens had its
trainer killed for memory at 19.5 GB resident on the 24 GB dev box (2026-12-06)."""
LR_SPREAD = 10.0
"""An lr more than this factor from the usual one for the model's size is warned of."""


@dataclass(frozen=True)
class ModelFacts:
    """What the sizes depend on in the model's folder."""

    name: str
    params: int
    context: int
    """Positions the model reads (``max_position_embeddings``); 0: unknown."""
    chat_template: bool


@dataclass(frozen=True)
class DataFacts:
    """What the sizes depend on in the data: token counts of a sample of its rows."""

    where: str
    sampled: int
    """Rows sampled (those with an answer the extractor reads)."""
    total: int | None
    """Rows in the file, where known (None: more than were sampled)."""
    prompt_tokens: tuple[int, ...]
    """Each sampled prompt, rendered as the explorer renders it, in tokens (sorted)."""
    answer_tokens: tuple[int, ...]
    """Each sampled answer field as written, in tokens with the EOS (sorted)."""
    worked: bool
    """The answer field holds a worked solution that the extractor reads the answer out
    of (GSM8K's rationale), not the bare answer."""

    @property
    def answer_p95(self) -> int:
        return percentile(self.answer_tokens, 0.95)

    @property
    def longest_prompt(self) -> int:
        return self.prompt_tokens[-1] if self.prompt_tokens else 0


@dataclass(frozen=True)
class OwnResponses:
    """The model's own responses to the data's first prompts, sampled as the explorer
    samples them (``app/sizing_facts.py``, :func:`~streamrft.app.sizing_facts.model_responses`)."""

    lengths: tuple[int, ...]
    """Each response in tokens, its EOS included (sorted); one cut at ``cap`` counts ``cap``."""
    cut: int
    """Responses that reached ``cap`` without an EOS."""
    cap: int
    """Tokens each response could run to."""
    temperature: float
    """The sampling temperature (the explorer's)."""

    @property
    def p90(self) -> int:
        return percentile(self.lengths, 0.9)

    @property
    def rambles(self) -> bool:
        """Whether the 90th percentile ran to the cap: how long the model would go on is not
        known, only that the cap is too short."""
        return self.cut > 0 and self.p90 >= self.cap


@dataclass(frozen=True)
class Hardware:
    """The machine the config is for."""

    gpus: int
    gpu_bytes: int | None
    """One GPU's memory (None: unknown)."""
    vllm: bool
    """Whether the vLLM engine is installed."""
    seen: str
    """How it was found, as the reasons say it."""


@dataclass(frozen=True)
class Choice:
    """One value written, and why."""

    field: str
    """Dotted: ``explorer.max_new_tokens``; ``model.lora`` holds a mapping."""
    value: Any
    reason: str


@dataclass(frozen=True)
class LrRange:
    usual: float
    low: float
    high: float
    basis: str


LORA_ANCHORS = (
    (134_515_008, 1e-3, "examples/smollm2_gsm8k_format.yaml (SmolLM2-135M, LoRA)"),
    (RECIPE_PARAMS, 2e-5, "examples/gsm8k/one_gpu_lora.yaml (Qwen2.5-1.5B, LoRA)"),
)
FULL_ANCHORS = ((RECIPE_PARAMS, 1e-6, "examples/gsm8k/one_gpu_full.yaml (Qwen2.5-1.5B)"),)
"""(parameters, lr, the recipe): the learning rates the repository's recipes train with."""


def percentile(values: Sequence[int], q: float) -> int:
    """The ``q`` quantile of sorted ``values`` (nearest rank; 0 for none)."""
    if not values:
        return 0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def power_of_two(n: float, floor: int = 1) -> int:
    """The smallest power of two at least ``n`` and ``floor``."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def nice(x: float) -> float:
    """``x`` to one of 1, 2, 5 x 10^k, the nearest in log scale."""
    k = math.floor(math.log10(x))
    steps = [m * 10.0**e for e in (k - 1, k, k + 1) for m in (1, 2, 5)]
    return min(steps, key=lambda s: abs(math.log(s / x)))


def lr_range(params: int, lora: bool) -> LrRange:
    """The usual learning rate for a model of ``params`` (an adapter or all weights): the
    recipes' at their sizes, log-interpolated between them, constant below the smallest
    and falling as the square root of the size above the largest."""
    anchors = LORA_ANCHORS if lora else FULL_ANCHORS
    if params <= anchors[0][0]:
        lr, basis = anchors[0][1], anchors[0][2]
        if params < 0.95 * anchors[0][0]:
            basis += ", kept for smaller models"
    elif params >= anchors[-1][0]:
        size, top, basis = anchors[-1]
        lr = top * math.sqrt(size / params)
        if params > size * 1.05:
            basis += f", scaled down as the square root of the size ({params / 1e9:.1f}B)"
    else:
        (n0, lr0, b0), (n1, lr1, b1) = next(
            (a, b) for a, b in itertools.pairwise(anchors) if a[0] <= params <= b[0]
        )
        t = math.log(params / n0) / math.log(n1 / n0)
        lr = math.exp(math.log(lr0) + t * math.log(lr1 / lr0))
        basis = f"between {b0} and {b1}, by size"
    usual = nice(lr)
    return LrRange(usual, usual / LR_SPREAD, usual * LR_SPREAD, basis)


def recipe_fits(model: ModelFacts, hw: Hardware) -> bool:
    """Whether the GSM8K recipes' values apply: a model of about their model's size, on
    GPUs."""
    low, high = RECIPE_SPAN
    return hw.gpus > 0 and low * RECIPE_PARAMS <= model.params <= high * RECIPE_PARAMS


def response_choice(
    data: DataFacts, recipe: bool, chat: bool, own: OwnResponses | None = None
) -> Choice:
    """``explorer.max_new_tokens``: twice the data's answers (95th percentile), at least
    :data:`CHAT_FLOOR` for a chat model (``chat``), else :data:`FLOOR`, and
    :data:`RESPONSE_HEADROOM` times the model's own responses (``own``: their 90th
    percentile, within the cap they were sampled to; the cap itself where they ran to it),
    to a power of two; the recipes' 512 where that holds them."""
    p95, longest = data.answer_p95, data.answer_tokens[-1] if data.answer_tokens else 0
    seen = (
        f"{data.sampled} answers sampled from {data.where}: 95% within {p95} tokens, the "
        f"longest {longest}"
    )
    kind = "worked solutions" if data.worked else "bare answers"
    floor, who = (CHAT_FLOOR, "a chat model explains in prose") if chat else (FLOOR, "")
    room: float = max(floor, WORKED_FACTOR * p95)
    why = f"{seen} ({kind}); room for {WORKED_FACTOR}x that, and at least {floor}"
    why += f" ({who})" if who else ""
    rambles = False
    if own is not None and own.lengths:
        own_room, own_why = _own_room(own)
        room, why, rambles = max(room, own_room), f"{why}; {own_why}", own.rambles
    need = power_of_two(room)
    if recipe and need <= 512 and not rambles:
        return Choice("explorer.max_new_tokens", 512, f"the GSM8K recipes' 512 holds them ({why})")
    return Choice("explorer.max_new_tokens", need, f"{why}, to a power of two")


def tries_calmer(own: OwnResponses | None, temperature_given: bool) -> bool:
    """Whether ``init`` samples the same prompts again, with the same seeds, at
    :data:`CALMER_TEMPERATURE`: the model's responses at the explorer's temperature
    (``own``) ramble, that temperature is higher, and the user did not set it
    (``temperature_given``)."""
    return (
        own is not None
        and own.rambles
        and own.temperature > CALMER_TEMPERATURE
        and not temperature_given
    )


def response_choices(
    data: DataFacts,
    recipe: bool,
    chat: bool,
    own: OwnResponses | None = None,
    calmer: OwnResponses | None = None,
) -> list[Choice]:
    """``explorer.max_new_tokens`` (:func:`response_choice`), and ``explorer.temperature``
    where the model's responses at the explorer's temperature (``own``) ramble and those at
    a lower one (``calmer``: the same prompts and seeds, :func:`tries_calmer`) do not: the
    lower temperature, and the response room those responses need. Where they ramble too,
    the temperature is kept and the room is the cap, as without ``calmer``; the reason says
    so."""
    if own is None or calmer is None or not own.rambles:
        return [response_choice(data, recipe, chat, own)]
    drifts = (
        f"{len(own.lengths)} responses at temperature {own.temperature}: {own.cut} not ended "
        f"by {own.cap}, the model drifts on"
    )
    ended = f", {calmer.cut} not ended by {calmer.cap}" if calmer.cut else ", all ended"
    seen = f"p90 {calmer.p90} tokens{ended}"
    if calmer.rambles:
        kept = response_choice(data, recipe, chat, own)
        why = (
            f"{kept.reason}; at {calmer.temperature} too ({seen}): explorer.temperature kept "
            f"at {own.temperature}"
        )
        return [Choice(kept.field, kept.value, why)]
    return [
        response_choice(data, recipe, chat, calmer),
        Choice(
            "explorer.temperature",
            calmer.temperature,
            f"{drifts}; at {calmer.temperature}: {seen}: a lower temperature keeps its "
            "answers on track",
        ),
    ]


def _own_room(own: OwnResponses) -> tuple[float, str]:
    """The room the model's own responses ask for, and the reason's words for it."""
    seen = (
        f"{len(own.lengths)} responses of the model at temperature {own.temperature}: p90 "
        f"{own.p90} tokens"
    )
    if own.p90 < own.lengths[-1]:
        seen += f", the longest {own.lengths[-1]}"
    seen += f", {own.cut} not ended by {own.cap}" if own.cut else ", all ended"
    if own.rambles:
        return own.cap, f"{seen}: the model runs on to the cap, so it gets the cap"
    room = RESPONSE_HEADROOM * own.p90
    if room > own.cap:
        return own.cap, f"{seen}; room for {RESPONSE_HEADROOM:g}x that, up to the cap"
    return room, f"{seen}; room for {RESPONSE_HEADROOM:g}x that"


def prompt_choice(data: DataFacts, recipe: bool, chat: bool) -> Choice:
    """``taskset.max_prompt_tokens``: the longest prompt sampled with room to spare, to a
    power of two; the recipes' 512 where that holds them."""
    rendered = "through the model's chat template" if chat else "as raw text"
    seen = f"the longest of {data.sampled} prompts {rendered} is {data.longest_prompt} tokens"
    need = power_of_two(PROMPT_HEADROOM * data.longest_prompt, 32)
    if recipe and need <= 512:
        return Choice("taskset.max_prompt_tokens", 512, f"the GSM8K recipes' 512 ({seen})")
    return Choice(
        "taskset.max_prompt_tokens",
        need,
        f"{seen}; {PROMPT_HEADROOM:g}x that to a power of two (longer ones are left out, "
        "and counted, when the feeder starts)",
    )


def fit_context(prompt: Choice, response: Choice, context: int) -> Choice:
    """``response`` cut to what the model's context leaves after the prompt."""
    if not context or prompt.value + response.value <= context:
        return response
    room = context - prompt.value
    return Choice(
        response.field,
        max(1, room),
        f"{response.reason}; cut to the {room} the model's {context} positions leave after "
        f"{prompt.value} of prompt",
    )


def lr_choice(model: ModelFacts, lora: bool) -> Choice:
    r = lr_range(model.params, lora)
    what = "an adapter" if lora else "all weights"
    return Choice(
        "trainer.lr",
        r.usual,
        f"{what} of a {size_text(model.params)} model: {r.basis}",
    )


def batch_choices(hw: Hardware, sequence: int) -> list[Choice]:
    """Tasks, group and batch sizes: the GSM8K recipes' on GPUs, the SmolLM2 example's on
    a CPU, where micro-batches of sequences of ``sequence`` tokens (prompt and response)
    hold about :data:`CPU_MICRO_TOKENS`."""
    gpu = bool(hw.gpus)
    tasks = 16 if gpu else 4
    basis = (
        "the GSM8K recipes (examples/gsm8k/*.yaml)"
        if gpu
        else "on a CPU, the CPU example's (examples/smollm2_gsm8k_format.yaml)"
    )
    rows: list[tuple[str, Any, str]] = [
        ("explorer.batch_size", tasks, "tasks an explorer step samples"),
        ("explorer.repeat_times", 8, "rollouts a task (the group)"),
        ("trainer.batch_size", tasks, f"groups a step, {tasks * 8} sequences"),
    ]
    if gpu:
        rows.append(("trainer.micro_batch_size", 8, "sequences a forward/backward"))
    else:
        micro = max(1, min(8, CPU_MICRO_TOKENS // max(1, sequence)))
        held = (
            f"about {CPU_MICRO_TOKENS} tokens of {sequence}-token sequences"
            if sequence <= CPU_MICRO_TOKENS
            else f"one {sequence}-token sequence, more than the {CPU_MICRO_TOKENS} tokens "
            "a micro-batch is meant to hold (a shorter explorer.max_new_tokens keeps it so)"
        )
        why = (
            f"sequences a forward/backward, {held}: the CPU example's 8 rows of about 120 "
            f"peaked at ~4.4 GB, and 8 rows of 384 were killed for memory at 19.5 GB"
        )
        rows.append(("trainer.micro_batch_size", micro, why))
    if gpu:
        rows += [
            ("trainer.mini_batch_size", 8, "two optimizer updates a step"),
            ("trainer.gradient_checkpointing", True, "long sequences on a GPU"),
        ]
    return [Choice(field, value, f"{why}: {basis}") for field, value, why in rows]


def schedule_choices(data: DataFacts, batch: int) -> list[Choice]:
    """Steps, epochs and the learning-rate schedule: the GSM8K recipes' 300 steps over up
    to 3 epochs (fewer where the data holds fewer batches), a cosine decay to a tenth after
    a warm-up of 3.3% of the steps (the recipes: 10 of 300)."""
    steps, epochs = 300, 3
    why = "the GSM8K recipes' 300 steps"
    if data.total is not None:
        per_epoch = math.ceil(data.total / batch)
        if epochs * per_epoch < steps:
            steps = epochs * per_epoch
            why = f"3 epochs of {data.total} tasks in batches of {batch} (the recipes: 300 steps)"
        else:
            why += f" ({steps / per_epoch:.1f} epochs of {data.total} tasks in batches of {batch})"
    return [
        Choice("trainer.max_steps", steps, why),
        Choice("taskset.total_epochs", epochs, "passes over the tasks at most (the recipes: 3)"),
        Choice("trainer.lr_schedule", "cosine", "the recipes' decay after the warm-up"),
        Choice(
            "trainer.lr_warmup_ratio",
            WARMUP_RATIO,
            f"a warm-up of {math.ceil(WARMUP_RATIO * steps)} of {steps} steps (the recipes: 10 "
            "of 300), as a share so --max-steps keeps it in proportion",
        ),
        Choice("trainer.min_lr_ratio", 0.1, "the decay's floor, a tenth of lr (the recipes)"),
        Choice(
            "algorithm.mask_truncated",
            True,
            "a response cut at max_new_tokens gets no gradient (the recipes)",
        ),
    ]


def eval_choices(hw: Hardware, held_out: str | None = None) -> list[Choice]:
    """The trainer's own evaluation: every 50 steps (the recipes) on the first 500 tasks on
    GPUs (two_gpus.yaml), 48 on a CPU (the CPU example's held-out set), of ``held_out``
    (the data folder's test split, a path as the file reads it) or else of the training
    set."""
    tasks = 500 if hw.gpus else 48
    basis = "examples/gsm8k/two_gpus.yaml" if hw.gpus else "the CPU example"
    out = [
        Choice(
            "eval.interval", 50, "greedy accuracy every 50 steps, the first and last (the recipes)"
        )
    ]
    if held_out is None:
        why = "the training tasks, as no held-out set is named: set eval.path to one"
        return [*out, Choice("eval.max_tasks", tasks, f"the first {tasks} ({basis}); {why}")]
    return [
        Choice("eval.path", held_out, "the data folder's held-out split, its own file"),
        *out,
        Choice("eval.max_tasks", tasks, f"the first {tasks} of them ({basis})"),
    ]


def placement_choices(hw: Hardware, lora: bool, params: int) -> list[Choice]:
    """Devices, precision, engine and the adapter, by the hardware (``lora`` decided by
    :func:`tune`)."""
    out: list[Choice] = []
    if not hw.gpus:
        out += [
            Choice("model.device", "cpu", hw.seen),
            Choice("model.dtype", "float32", "the CPU computes in float32"),
            Choice("explorer.engine", "transformers", "the engine that samples on a CPU"),
        ]
    else:
        out += [
            Choice("model.device", "cuda", hw.seen),
            Choice("model.dtype", "bfloat16", "half the memory of float32 on a GPU (the recipes)"),
        ]
        engine = "vllm" if hw.vllm else "transformers"
        why = (
            "vLLM is installed: the faster sampler"
            if hw.vllm
            else "vLLM is not installed (pip install -e '.[vllm]' for the faster sampler)"
        )
        out.append(Choice("explorer.engine", engine, why))
        if hw.gpus >= 2:
            recipe = "examples/gsm8k/two_gpus.yaml's layout"
            out += [
                Choice("explorer.device", "cuda:0", f"a GPU of its own to sample on: {recipe}"),
                Choice("trainer.device", "cuda:1", f"a GPU of its own to train on: {recipe}"),
            ]
            if hw.vllm:
                out.append(
                    Choice("explorer.gpu_memory_utilization", 0.85, f"its GPU to itself: {recipe}")
                )
        elif hw.vllm:
            recipe = "examples/gsm8k/one_gpu_vllm.yaml"
            out += [
                Choice(
                    "explorer.gpu_memory_utilization", 0.35, f"vLLM's share of the GPU: {recipe}"
                ),
                Choice(
                    "trainer.gpu_memory_fraction", 0.55, f"the trainer's cap beside it: {recipe}"
                ),
            ]
    if lora:
        rank, alpha = (32, 64) if hw.gpus else (16, 32)
        basis = "the GSM8K recipes" if hw.gpus else "the CPU example"
        out.append(
            Choice(
                "model.lora",
                {"enabled": True, "rank": rank, "alpha": alpha},
                f"an adapter of rank {rank} ({basis}) in place of all {size_text(params)} weights",
            )
        )
    return out


def tune(hw: Hardware, full_bytes: int | None, asked: str) -> tuple[bool, str]:
    """``(lora, why)``: an adapter or all weights. ``asked``: ``lora``, ``full`` or
    ``auto`` (all weights where the full fine-tune's plan, ``full_bytes`` on its busiest
    GPU, keeps :data:`FULL_HEADROOM` of it; an adapter on a CPU)."""
    if asked != "auto":
        return asked == "lora", f"--tune {asked}"
    if not hw.gpus:
        return True, "on a CPU: an adapter, a small share of the optimizer's memory and work"
    if hw.gpu_bytes is None or full_bytes is None:
        return True, "the GPU's memory is unknown (give --gpu-memory): an adapter is safer"
    share = full_bytes / hw.gpu_bytes
    gib = f"{full_bytes / (1 << 30):.1f} of {hw.gpu_bytes / (1 << 30):.0f} GiB"
    if share <= FULL_HEADROOM:
        return False, f"all weights fit: the plan needs {gib} ({share:.0%})"
    return True, f"all weights would need {gib} ({share:.0%}, over {FULL_HEADROOM:.0%})"


def size_text(params: int) -> str:
    """``1.5B``, ``135M``: a model's size as the reasons say it."""
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


def warnings(cfg: Config, model: ModelFacts, data: DataFacts | None, advantage: str) -> list[str]:
    """What a real model's config keeps that suits the tiny model, each as ``field: what is
    wrong; what init would write`` (``advantage``: the algorithm's advantage estimator;
    ``data`` None: the data could not be sampled)."""
    e, t = cfg.explorer, cfg.trainer
    out = []
    if data is not None and data.answer_tokens:
        need = data.answer_p95 if data.worked else 32
        if e.max_new_tokens < need:
            cut = sum(1 for n in data.answer_tokens if n > e.max_new_tokens)
            suggested = response_choice(data, False, model.chat_template).value
            if model.context:  # what the context leaves after the prompts
                suggested = min(suggested, model.context - cfg.taskset.max_prompt_tokens)
            what = "worked answers" if data.worked else "answers"
            out.append(
                f"explorer.max_new_tokens: {e.max_new_tokens} tokens would not hold the data's "
                f"{what}: 95% need up to {data.answer_p95} (the longest "
                f"{data.answer_tokens[-1]}; {cut} of {data.sampled} sampled are longer); "
                f"init would write at least {suggested} (more where the model's own "
                "responses run longer)"
            )
    r = lr_range(model.params, cfg.model.lora.enabled)
    if not r.low <= t.lr <= r.high:
        what = "an adapter" if cfg.model.lora.enabled else "all weights"
        out.append(
            f"trainer.lr: {t.lr:g} is {_factor(t.lr, r.usual)} the usual {r.usual:g} for "
            f"{what} of a {size_text(model.params)} model ({r.basis}); usual range "
            f"{r.low:g} to {r.high:g}"
        )
    if advantage in GROUP_ADVANTAGES and e.repeat_times < MIN_GROUP:
        out.append(
            f"explorer.repeat_times: groups of {e.repeat_times} for {advantage!r} advantages, "
            f"which compare a task's rollouts: a group whose rollouts score alike teaches "
            f"nothing, and small groups often do; the recipes use 8"
        )
    prompt = cfg.taskset.max_prompt_tokens
    if model.context and prompt + e.max_new_tokens > model.context:
        out.append(
            f"taskset.max_prompt_tokens + explorer.max_new_tokens: {prompt} + "
            f"{e.max_new_tokens} is more than the model's {model.context} positions"
        )
    if data is not None and prompt and data.prompt_tokens:
        over = sum(1 for n in data.prompt_tokens if n > prompt)
        if over > 0.05 * len(data.prompt_tokens):
            out.append(
                f"taskset.max_prompt_tokens: {prompt} leaves out {over} of {data.sampled} "
                f"sampled prompts (the longest is {data.longest_prompt} tokens)"
            )
    devices = {cfg.model.device, e.device, t.device, *e.devices, *t.devices} - {None}
    if cfg.model.dtype == "float32" and any(str(d).startswith("cuda") for d in devices):
        out.append(
            "model.dtype: float32 on a GPU holds and moves twice the bytes of bfloat16 "
            "(the recipes use bfloat16)"
        )
    return out


def _factor(value: float, usual: float) -> str:
    ratio = value / usual
    return f"{ratio:,.0f}x" if ratio >= 1 else f"1/{1 / ratio:,.0f} of"
