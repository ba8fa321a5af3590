"""How a task becomes the prompt the model reads: its token ids, by chat template or raw text.

One renderer for everything that feeds prompts to the policy: the explorer's workflows,
the evaluator and the trainer's SFT warm-up build it from the ``taskset`` section and the
tokenizer, so all three see the same tokens. Pure: no I/O, no model.

``taskset.format`` picks the rendering (:func:`uses_chat`):

- ``chat``: the task's messages (a plain-prompt task is one user message), after
  ``taskset.system_prompt`` as a system message, through
  ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``;
- ``raw``: the prompt text (a chat task's contents joined by blank lines, the system
  prompt first).

BOS: raw text is tokenized with the tokenizer's special tokens (its BOS, as always); a
chat-templated string already holds every special token its template wants (the BOS
included where the model uses one), so it is tokenized without adding any, as
``apply_chat_template(tokenize=True)`` does. Never two BOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from streamrft.infra.config import TasksetConfig
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

RAW_SEPARATOR = "\n\n"
"""Between the system prompt and the text, and between a chat task's messages, in raw format."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat(fmt: str, tokenizer: Any) -> bool:
    """Whether ``taskset.format`` ``fmt`` renders with the chat template of ``tokenizer``;
    :class:`ConfigError` when ``chat`` is asked of a tokenizer without one."""
    if fmt not in ("auto", "chat", "raw"):
        raise ConfigError(f"taskset.format: unknown format {fmt!r}; known: auto, chat, raw")
    if fmt == "chat" and not has_chat_template(tokenizer):
        raise ConfigError(
            "taskset.format: 'chat' needs a tokenizer with a chat template and this model's "
            "has none; use 'raw' (or 'auto': chat only where there is a template)"
        )
    return fmt == "chat" or (fmt == "auto" and has_chat_template(tokenizer))


def _needs_system(task: Task, system_prompt: str | None) -> bool:
    """A system prompt is configured and the task's messages do not begin with their own."""
    own = bool(task.messages) and task.messages[0].role == "system"
    return system_prompt is not None and not own


def chat_messages(task: Task, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The conversation a chat template renders: the task's messages, or its prompt as one
    user message, after ``system_prompt`` (unless the task brings a system message)."""
    messages = [{"role": m.role, "content": m.content} for m in task.messages] or [
        {"role": "user", "content": task.prompt}
    ]
    if _needs_system(task, system_prompt):
        messages.insert(0, {"role": "system", "content": str(system_prompt)})
    return messages


def raw_text(task: Task, system_prompt: str | None = None) -> str:
    """The raw-format prompt: the prompt (or the messages' contents joined by blank lines),
    after ``system_prompt`` and a blank line. A prompt task without a system prompt: its
    prompt exactly."""
    parts = [m.content for m in task.messages] or [task.prompt]
    if _needs_system(task, system_prompt):
        parts.insert(0, str(system_prompt))
    return RAW_SEPARATOR.join(parts)


class PromptRenderer:
    """Task -> prompt text and token ids, by ``taskset.format`` and ``taskset.system_prompt``.

    Built once per process (``chat`` without a template fails there, naming the field).
    """

    def __init__(
        self, tokenizer: Any, format: str = "auto", system_prompt: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = uses_chat(format, tokenizer)
        """Whether the chat template is applied."""
        self.system_prompt = system_prompt

    @classmethod
    def from_config(cls, cfg: TasksetConfig, tokenizer: Any) -> PromptRenderer:
        """The renderer the ``taskset`` section describes."""
        return cls(tokenizer, cfg.format, cfg.system_prompt)

    def text(self, task: Task) -> str:
        """The prompt as text (chat-templated, generation prompt included, or raw)."""
        if not self.chat:
            return raw_text(task, self.system_prompt)
        return self.tokenizer.apply_chat_template(
            chat_messages(task, self.system_prompt), tokenize=False, add_generation_prompt=True
        )

    def ids(self, task: Task) -> list[int]:
        """The prompt's token ids, special tokens added once (see the module's BOS note)."""
        return list(self.tokenizer(self.text(task), add_special_tokens=not self.chat).input_ids)

    def lengths(self, tasks: Sequence[Task]) -> list[int]:
        """How many tokens each task's prompt holds (:meth:`ids`, in one tokenizer call)."""
        if not tasks:
            return []
        texts = [self.text(t) for t in tasks]
        encoded = self.tokenizer(texts, add_special_tokens=not self.chat).input_ids
        return [len(ids) for ids in encoded]

    def batch(self, tasks: Sequence[Task]) -> list[list[int]]:
        """:meth:`ids` of each task, in order."""
        return [self.ids(t) for t in tasks]
