"""``streamrft init [--expert] [--out FILE]``: a config written from a few questions.

It asks for the model, the task file (and shows its first row), the prompt and answer
fields, how the answer is read and scored, the algorithm preset and the device; every
question has a flag (``--model``, ``--data``, ...) and ``--yes`` takes the suggested
answer of any question not given, so scripts run it without a terminal. For a model
folder it then sizes the run (``app/sizing.py``): response and prompt lengths from a
sample of the data in the model's tokens and a few of the model's own responses
(``--sample-responses``; where they run on, the same at a lower temperature, which it
writes where there they end), the learning rate by the model's size, batches,
group size, schedule, engine and devices by the hardware (``--gpus``/``--gpu-memory`` for
another machine), all weights or an adapter by the memory plan (``--tune``), and shows
each choice with its reason; a field set with ``-o`` is kept. The file it writes holds
the choices that matter with a comment on each (``--expert``: every field of every
section, each with its documentation), is checked as ``streamrft validate`` checks, and
``plan``'s memory table is printed after it. ``--from-trinity FILE`` and ``--from-verl``
convert another framework's config instead of asking (:mod:`.init_from`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrft.app.sizing import RESPONSE_SAMPLES, Choice, ModelFacts, OwnResponses
from streamrft.infra.config import (
    Config,
    TasksetConfig,
    apply_overrides,
    from_dict,
    parse_override,
    resolve_paths,
)
from streamrft.infra.source_docs import field_docs
from streamrft.schemas.errors import ConfigError

SAMPLE_CHARS = 400
"""Most characters of the first row shown."""


@dataclass
class Answers:
    """What ``init`` asks, by question (None: not answered yet)."""

    model: str | None = None
    data: str | None = None
    prompt: str | None = None
    answer_key: str | None = None
    answer_extract: str | None = None
    reward: str | None = None
    algorithm: str | None = None
    device: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class Machine:
    """What ``init`` sizes a model folder's run for (flags ``--tune``, ``--gpus``,
    ``--gpu-memory``)."""

    tune: str = "auto"
    """``lora``, ``full``, or ``auto``: all weights where the memory plan leaves room."""
    gpus: int | None = None
    """GPUs of the machine the config is for; None: those torch sees here."""
    gpu_memory: int | None = None
    """Bytes of one of its GPUs; None: what torch says here."""
    sample_responses: int = RESPONSE_SAMPLES
    """The model's own responses to the data's first prompts sampled to size
    ``explorer.max_new_tokens`` by (``--sample-responses``); 0: from the data alone."""


Ask = Callable[[str, str], str]
"""``ask(question, suggestion) -> answer`` (the suggestion when the answer is empty)."""


def ask_stdin(question: str, suggestion: str) -> str:
    """A question on stderr, the answer from stdin (end of input: the suggestion)."""
    print(f"{question} [{suggestion}]: ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:  # end of input: not an answer
        print(file=sys.stderr)
        raise ConfigError("init: input ended before every question was answered; answer with "
                          "flags, or take the suggestions with --yes")  # fmt: skip
    return line.strip() or suggestion


def first_row(path: str, split: str) -> dict[str, Any]:
    """The first row of a task file, as the taskset reader reads it."""
    from streamrft.infra.taskset import read_rows

    if not Path(path).exists():
        raise ConfigError(f"--data: {path!r} does not exist")
    for _where, _index, row in read_rows(Path(path), TasksetConfig(path=path, split=split)):
        return row
    raise ConfigError(f"--data: {path} holds no row")


def splits_of(path: str) -> list[str]:
    """The splits of a saved dataset dict (a folder with ``dataset_dict.json``), else []."""
    index = Path(path) / "dataset_dict.json"
    if not index.is_file():
        return []
    try:
        return [str(name) for name in json.loads(index.read_text())["splits"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--data: {index} cannot be read: {exc}") from exc


ANSWER_KEYS = ("answer", "solution", "target", "ground_truth", "label", "output")
"""Column names a reference answer usually has, in the order they are suggested."""


def suggest_prompt(row: dict[str, Any]) -> str:
    """The prompt field of ``row``, or a template for the usual names of question columns."""
    for key in ("prompt", "messages"):
        if key in row:
            return key
    for key in ("question", "problem", "query", "instruction"):
        if key in row:
            return "{" + key + "}"
    return "prompt"


def suggest_extract(answer: Any) -> str:
    """``gsm8k`` for ``... #### 72``, ``boxed`` for a ``\\boxed{}``, else ``none``."""
    text = str(answer)
    if re.search(r"####\s*\S", text):
        return "gsm8k"
    if "\\boxed{" in text:
        return "boxed"
    return "none"


def collect(given: Answers, ask: Ask | None) -> Answers:
    """Every answer: ``given``, else asked with ``ask`` (None: the suggestion)."""

    def answer(name: str, question: str, suggestion: str) -> str:
        value = getattr(given, name)
        if value is not None:
            return value
        return ask(question, suggestion) if ask else suggestion

    out = Answers()
    out.model = answer(
        "model", "Model: a Hugging Face folder (config.json, safetensors), or tiny", "tiny"
    )
    example = Path(__file__).resolve().parents[1] / "examples" / "data" / "addition.jsonl"
    suggested = str(example) if out.model == "tiny" and example.is_file() else "data/train.parquet"
    out.data = answer("data", "Task file: JSONL, Parquet, or a saved datasets folder", suggested)
    splits = splits_of(out.data)
    if splits:
        pick = "train" if "train" in splits else splits[0]
        out.split = answer("split", f"Split ({', '.join(splits)})", pick)
    row = first_row(out.data, out.split or "train")
    shown = json.dumps(row, ensure_ascii=False, default=str)
    print(f"first row of {out.data}: {shown[:SAMPLE_CHARS]}", file=sys.stderr)
    out.prompt = answer(
        "prompt", "Prompt: a field, or a template with {fields}", suggest_prompt(row)
    )
    key = next((k for k in ANSWER_KEYS if k in row), "answer")
    out.answer_key = answer("answer_key", "Field holding the reference answer", key)
    extract = suggest_extract(row.get(out.answer_key, ""))
    out.answer_extract = answer(
        "answer_extract", "Reading the answer: none, gsm8k, boxed, or a pattern", extract
    )
    math = out.answer_extract != "none"
    out.reward = answer(
        "reward",
        "Reward: exact_match, last_number, math_answer, math_answer_format, or module:function",
        "math_answer" if math else "exact_match",
    )
    out.algorithm = answer(
        "algorithm", "Algorithm preset (grpo, dapo, gspo, rloo, ppo, ...)", "grpo"
    )
    out.device = answer(
        "device", "Device: cpu, cuda, cuda:N or auto", "cpu" if out.model == "tiny" else "auto"
    )
    return out


def config_data(a: Answers, out: Path) -> dict[str, Any]:
    """The config the answers make (paths relative to the file written at ``out``)."""
    assert a.model and a.data and a.prompt and a.answer_key and a.algorithm and a.device
    taskset: dict[str, Any] = {"path": _relative(a.data, out), "answer_key": a.answer_key}
    if a.split:
        taskset["split"] = a.split
    if "{" in a.prompt:
        taskset["prompt_template"] = a.prompt
    elif a.prompt == "messages":
        taskset["messages_key"] = a.prompt
    else:
        taskset["prompt_key"] = a.prompt
    if a.answer_extract and a.answer_extract != "none":
        taskset["answer_extract"] = a.answer_extract
    model: dict[str, Any] = {"device": a.device}
    if a.model == "tiny":
        model["source"] = "tiny"
    else:
        model.update(source="path", path=_relative(a.model, out))
        model["dtype"] = "float32" if a.device == "cpu" else "bfloat16"
    data = {
        "run": {"name": re.sub(r"[^A-Za-z0-9_-]+", "-", out.stem).strip("-") or "run"},
        "model": model,
        "taskset": taskset,
        "explorer": {"reward": a.reward},
        "algorithm": {"type": a.algorithm},
    }
    return data


def _relative(path: str, out: Path) -> str:
    """``path`` as the config file at ``out`` reads it: relative to its folder when inside
    it, else absolute."""
    target = Path(os.path.abspath(path))  # a symbolic link stays itself
    try:
        return str(target.relative_to(Path(os.path.abspath(out)).parent))
    except ValueError:
        return str(target)


def render(
    data: dict[str, Any], cfg: Config, expert: bool, reasons: dict[str, str] | None = None
) -> str:
    """The YAML to write: the chosen fields, each after the first sentence of its
    documentation (and, for a sized one, the reason of ``reasons``, by dotted field);
    ``expert``: every field of every section, its whole documentation."""
    reasons = reasons or {}
    lines = [
        "# Written by `streamrft init`"
        + (" --expert: every field, with its documentation." if expert else "."),
        "# Check: streamrft validate THIS_FILE   Memory: streamrft plan THIS_FILE",
        "# Every field: docs/reference/configuration.md",
    ]
    for section in msgspec.structs.fields(Config):
        chosen = data.get(section.name, {})
        if not chosen and not expert:
            continue
        value = getattr(cfg, section.name)
        docs = field_docs(type(value), grouped=expert)
        lines += ["", f"{section.name}:"]
        for f in msgspec.structs.fields(type(value)):
            if f.name not in chosen and not expert:
                continue
            doc = " ".join(docs.get(f.name, "").split()).replace("``", "`")
            if doc:
                text = doc if expert else _first_sentence(doc)
                lines += [f"  # {w}" for w in _wrap(text, 86)]
            why = reasons.get(f"{section.name}.{f.name}")
            if why:
                lines += [f"  # {w}" for w in _wrap(f"init: {why}", 86)]
            shown = (
                chosen[f.name] if f.name in chosen else msgspec.to_builtins(getattr(value, f.name))
            )
            dumped = yaml.safe_dump(
                {f.name: shown}, default_flow_style=True, width=1000, allow_unicode=True
            ).strip()
            lines.append("  " + dumped.removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"


def _first_sentence(text: str) -> str:
    """Up to the first full stop followed by a capital (so not at "e.g. x")."""
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*out, line] if line else out


def init(
    given: Answers,
    out: Path,
    expert: bool,
    ask: Ask | None,
    machine: Machine | None = None,
    overrides: list[str] | None = None,
) -> tuple[Config, list[Choice]]:
    """Ask, size a model folder's run for ``machine``, write ``out``; the config read back
    from it, and the sizes chosen (none for the tiny model). ``overrides`` (``-o
    key.path=value``) set fields of the config; the sizing keeps them."""
    from streamrft.infra.config import load_config

    answers = collect(given, ask)
    data = config_data(answers, out)
    base = Path(os.path.abspath(out)).parent
    if overrides:
        apply_overrides(data, overrides)
        from_dict(_resolved(data, base))  # an override's mistake stops here, before sizing
    keys = [".".join(parse_override(o)[0]) for o in overrides or []]
    choices = []
    if answers.model != "tiny":
        choices = size(data, answers, base, machine or Machine(), keys)
        for c in choices:
            section, name = c.field.split(".", 1)
            data.setdefault(section, {})[name] = copy.deepcopy(c.value)  # overrides go in
        apply_overrides(data, overrides or [])  # the user's values over the sizes
        choices = [_as_given(c, data, keys) for c in choices]
    cfg = from_dict(_resolved(data, base))  # a mistake stops here, before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data, cfg, expert, {c.field: c.reason for c in choices}))
    return load_config(out), choices


def _as_given(choice: Choice, data: dict[str, Any], keys: list[str]) -> Choice:
    """``choice`` as the overrides of ``keys`` (dotted) left it in config tree ``data``:
    where one set its field, or a key within it, the value there, and the reason says so."""
    field = choice.field
    touched = [
        k for k in keys if k == field or k.startswith(f"{field}.") or field.startswith(f"{k}.")
    ]
    if not touched:
        return choice
    section, name = field.split(".", 1)
    sized = yaml.safe_dump(choice.value, default_flow_style=True).removesuffix("...\n").strip()
    given = (data.get(section) or {}).get(name)  # a whole section given may leave it out
    how = "as given" if given is not None else "left to its default"
    return Choice(
        field, given, f"{how} (-o {', '.join(touched)}); init would write {sized}: {choice.reason}"
    )


def _resolved(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of config tree ``data``, its paths taken from ``base`` (the file's folder)."""
    resolved = json.loads(json.dumps(data))
    resolve_paths(resolved, base)
    return resolved


def size(
    data: dict[str, Any], a: Answers, base: Path, machine: Machine, given: list[str] | None = None
) -> list[Choice]:
    """The sizes of the run ``data`` describes (a model folder's), each with its reason
    (:mod:`app.sizing`); the user's own device answer is kept, and a temperature the user
    set (``given``: the dotted fields they set) is sampled at and kept."""
    from streamrft.app import sizing
    from streamrft.app.sizing_facts import data_facts, hardware, load_tokenizer_of, model_facts

    resolved = _resolved(data, base)
    folder = Path(resolved["model"]["path"])
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--model: {folder} is not a model folder (no config.json): give a local Hugging "
            "Face folder, or tiny"
        )
    tokenizer = load_tokenizer_of(folder)
    model = model_facts(folder, tokenizer)
    taskset = msgspec.convert(resolved["taskset"], TasksetConfig)
    facts = data_facts(taskset, taskset.path, tokenizer)
    hw = hardware(machine.gpus, machine.gpu_memory, a.device or "auto")
    recipe = sizing.recipe_fits(model, hw)
    prompt = sizing.prompt_choice(facts, recipe, model.chat_template)
    temperature_given = "explorer.temperature" in (given or [])
    own, calmer = _own_responses(
        folder, taskset, resolved, model, a.device or "auto", machine, temperature_given
    )
    wanted, *temperature = sizing.response_choices(facts, recipe, model.chat_template, own, calmer)
    response = sizing.fit_context(prompt, wanted, model.context)
    batches = sizing.batch_choices(hw, prompt.value + response.value)
    batch = next(c.value for c in batches if c.field == "trainer.batch_size")
    common = [
        response,
        *temperature,
        prompt,
        *batches,
        *sizing.schedule_choices(facts, batch),
        *sizing.eval_choices(hw, _held_out(Path(taskset.path), base)),
    ]

    def build(lora: bool) -> list[Choice]:
        placed = sizing.placement_choices(hw, lora, model.params)
        if a.device != "auto":  # answered: kept
            placed = [c for c in placed if c.field != "model.device"]
        return [*placed, sizing.lr_choice(model, lora), *common]

    full_bytes = _busiest(data, build(False), base, hw) if hw.gpus else None
    lora, why = sizing.tune(hw, full_bytes, machine.tune)
    choices = build(lora)
    if not lora:
        choices.append(Choice("model.lora", {"enabled": False}, why))
    else:
        choices = [
            Choice(c.field, c.value, f"{why}; {c.reason}") if c.field == "model.lora" else c
            for c in choices
        ]
    return _fit_micro_batch(data, choices, base, hw)


def _own_responses(
    folder: Path,
    taskset: TasksetConfig,
    resolved: dict[str, Any],
    model: ModelFacts,
    device: str,
    machine: Machine,
    temperature_given: bool,
) -> tuple[OwnResponses | None, OwnResponses | None]:
    """The model's own responses (``machine.sample_responses`` of them) at the explorer's
    temperature, and where they ramble the same again at
    :data:`~streamrft.app.sizing.CALMER_TEMPERATURE` (:func:`~streamrft.app.sizing.tries_calmer`;
    else None), progress on stderr; None, said on stderr, where they are not sampled."""
    from streamrft.app.sizing import CALMER_TEMPERATURE, tries_calmer
    from streamrft.app.sizing_facts import model_responses, why_not_sampled
    from streamrft.infra.config import ExplorerConfig

    count = machine.sample_responses
    if not count:
        return None, None
    why = why_not_sampled(folder, model.params, device)
    if why:
        print(
            f"init: the model's responses are not sampled ({why}): max_new_tokens from the "
            "data alone",
            file=sys.stderr,
        )
        return None, None
    explorer = msgspec.convert(resolved.get("explorer", {}), ExplorerConfig)

    def sample(temperature: float, line: str) -> OwnResponses:
        tty = sys.stderr.isatty()

        def progress(done: int, total: int) -> None:
            start, end = ("\r", "\n" if done == total else "") if tty else ("", "\n")
            print(f"{start}{line} ({done}/{total})", end=end, file=sys.stderr, flush=True)

        return model_responses(
            folder,
            taskset,
            taskset.path,
            count=count,
            temperature=temperature,
            device=device,
            context=model.context,
            progress=progress,
        )

    own = sample(
        explorer.temperature,
        f"init: sampling {count} responses of the model to size max_new_tokens",
    )
    if not tries_calmer(own, temperature_given):
        return own, None
    again = (
        f"init: sampling them again at temperature {CALMER_TEMPERATURE} ({own.cut} of "
        f"{len(own.lengths)} at {own.temperature} did not end by {own.cap})"
    )
    return own, sample(CALMER_TEMPERATURE, again)


def _held_out(data: Path, base: Path) -> str | None:
    """The one file of a hub-style data folder's test (else validation) split, as the
    config file in ``base`` reads it; None for a file, a saved dataset, or a split of
    several files or none."""
    from streamrft.infra.data_files import is_saved_dataset, split_files

    if not data.is_dir() or is_saved_dataset(data):
        return None
    for split in ("test", "validation"):
        try:
            files = split_files(data, split)
        except ConfigError:  # no such split there
            continue
        return _relative(str(files[0]), base / "config.yaml") if len(files) == 1 else None
    return None


def _with(data: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    out = json.loads(json.dumps(data))
    for c in choices:
        section, name = c.field.split(".", 1)
        out.setdefault(section, {})[name] = c.value
    return out


def _busiest(data: dict[str, Any], choices: list[Choice], base: Path, hw: Any) -> int:
    """Bytes the plan puts on the busiest device of the run ``choices`` make."""
    from streamrft.app.plan import make_plan

    cfg = from_dict(_resolved(_with(data, choices), base))
    return max(make_plan(cfg, None, hw.gpu_bytes).by_device().values())


def _fit_micro_batch(
    data: dict[str, Any], choices: list[Choice], base: Path, hw: Any
) -> list[Choice]:
    """``choices`` with ``trainer.micro_batch_size`` halved until the plan fits the GPU
    (unchanged without a GPU or its size)."""
    if not (hw.gpus and hw.gpu_bytes):
        return choices
    i = next(i for i, c in enumerate(choices) if c.field == "trainer.micro_batch_size")
    first = choices[i]
    while _busiest(data, choices, base, hw) > hw.gpu_bytes and choices[i].value > 1:
        rows = choices[i].value // 2
        choices[i] = Choice(
            first.field, rows, f"{first.reason}; halved to {rows} to fit the GPU (plan)"
        )
    return choices


def add_init_parser(sub: argparse._SubParsersAction) -> None:
    """``init`` under the ``streamrft`` parser's subcommands ``sub``."""
    sp = sub.add_parser("init", help="write a config from a few questions (flags answer them)")
    sp.add_argument(
        "--out", default="streamrft.yaml", help="file to write (default streamrft.yaml)"
    )
    sp.add_argument("--expert", action="store_true", help="every field, each documented")
    sp.add_argument(
        "--yes", action="store_true", help="take the suggestion of every question not given"
    )
    sp.add_argument("--force", action="store_true", help="replace an existing --out file")
    sp.add_argument("--model", help="model folder, or tiny")
    sp.add_argument("--data", help="task file: JSONL, Parquet, or a saved datasets folder")
    sp.add_argument("--split", help="split of a saved dataset dict (taskset.split)")
    sp.add_argument("--prompt", help="prompt field, or a template with {fields}")
    sp.add_argument("--answer-key", help="field of the reference answer")
    sp.add_argument("--answer-extract", help="none, gsm8k, boxed, or a pattern with one group")
    sp.add_argument("--reward", help="reward name, or package.module:function")
    sp.add_argument("--algorithm", help="algorithm preset (algorithm.type)")
    sp.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    sp.add_argument(
        "--tune",
        choices=("auto", "lora", "full"),
        default="auto",
        help="a model folder: train an adapter or all weights (default auto: all weights "
        "where the memory plan leaves room on the GPU, an adapter on a CPU)",
    )
    sp.add_argument(
        "--gpus",
        type=int,
        help="a model folder: size for a machine with this many GPUs (default: those here)",
    )
    sp.add_argument(
        "--gpu-memory",
        help="a model folder: one GPU's memory on that machine, e.g. 80GiB (default: here)",
    )
    sp.add_argument(
        "--sample-responses",
        type=int,
        default=RESPONSE_SAMPLES,
        metavar="N",
        help="a model folder: sample the model's own responses to the data's first N "
        "prompts (on a GPU here, else the CPU) and give explorer.max_new_tokens room for "
        "them too; where they run on to the cap at an explorer.temperature over 0.7 not set "
        "with -o, sample them again at 0.7 and write 0.7 if there they end (default "
        "%(default)s; 0: size it from the data's answers alone)",
    )
    sp.add_argument(
        "-o",
        "--override",
        action="append",
        metavar="KEY=VALUE",
        help="set a config field: KEY a dotted path, VALUE read as YAML, e.g. "
        "explorer.temperature=1.0; init keeps it (a temperature given is sampled at; other "
        "sizes are not redone around a value given); repeatable",
    )
    sp.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    from streamrft.app.plan import cuda_memory, make_plan
    from streamrft.app.plan import render as render_plan
    from streamrft.app.process import setup_logging
    from streamrft.app.validate import validate
    from streamrft.infra.memory_plan import parse_size

    setup_logging("WARNING")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"--out: {out} exists; give another file or --force")
    given = Answers(
        model=args.model,
        data=args.data,
        prompt=args.prompt,
        answer_key=args.answer_key,
        answer_extract=args.answer_extract,
        reward=args.reward,
        algorithm=args.algorithm,
        device=args.device,
        split=args.split,
    )
    if args.sample_responses < 0:
        raise ConfigError(f"--sample-responses: {args.sample_responses} is negative (0: none)")
    machine = Machine(
        args.tune,
        args.gpus,
        parse_size(args.gpu_memory) if args.gpu_memory else None,
        args.sample_responses,
    )
    ask = None if args.yes else ask_stdin
    cfg, choices = init(given, out, args.expert, ask, machine, args.override)
    if choices:
        print(f"sized for {cfg.model.path} and {cfg.taskset.path}:")
        for choice in choices:
            shown = yaml.safe_dump(choice.value, default_flow_style=True)
            print(f"  {choice.field} = {shown.strip().removesuffix('...').strip()}")
            print(f"      {choice.reason}")
    print(f"written: {out}")
    checks = validate(cfg, False)
    for c in checks:
        print(f"{c.name:<13} {'ok' if c.ok else 'FAILED'}: {c.detail}")
        for w in c.warnings:
            print(f"{'warning':<13} {w}")
    if cfg.model.source == "tiny" or (Path(str(cfg.model.path)) / "config.json").is_file():
        print(render_plan(make_plan(cfg, None, machine.gpu_memory or cuda_memory())))
    else:
        print("plan: skipped (the model folder has no config.json to size it from)")
    return 1 if any(not c.ok for c in checks) else 0
