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


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict]:
    """``messages`` after ``system_prompt`` as a system message, unless none is configured
    or they begin with their own."""
    own = bool(messages) and messages[0]["role"] == "system"
    if system_prompt is None or own:
        return messages
    return [{"role": "system", "content": str(system_prompt)}, *messages]


def chat_messages(task: Task, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The conversation a chat template renders: the task's messages, or its prompt as one
    user message, after ``system_prompt`` (unless the task brings a system message)."""
    messages = [{"role": m.role, "content": m.content} for m in task.messages] or [
        {"role": "user", "content": task.prompt}
    ]
    return with_system_prompt(messages, system_prompt)


def raw_text(task: Task, system_prompt: str | None = None) -> str:
    """The raw-format prompt: the prompt (or the messages' contents joined by blank lines),
    after ``system_prompt`` and a blank line. A prompt task without a system prompt: its
    prompt exactly."""
    return RAW_SEPARATOR.join(m["content"] for m in chat_messages(task, system_prompt))


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

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        generation_prompt: bool = True,
    ) -> str:
        """``messages`` (after the system prompt, unless they bring one) as prompt text:
        through the chat template with its generation prompt (unless
        ``generation_prompt`` is false; and ``tools``, for a template that reads them), or
        their contents joined (raw)."""
        messages = with_system_prompt(messages, self.system_prompt)
        if not self.chat:
            return RAW_SEPARATOR.join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def text(self, task: Task) -> str:
        """The prompt as text (chat-templated, generation prompt included, or raw)."""
        return self.render(chat_messages(task))

    def tokenize(self, text: str) -> list[int]:
        """The ids of a prompt text this renderer made, special tokens added once (see the
        module's BOS note)."""
        return list(self.tokenizer(text, add_special_tokens=not self.chat).input_ids)

    def tokenize_within(self, text: str) -> list[int]:
        """The ids of text that goes inside a sequence (between two turns): special tokens
        written in it are read as such, none added."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def ids(self, task: Task) -> list[int]:
        """The prompt's token ids."""
        return self.tokenize(self.text(task))

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
