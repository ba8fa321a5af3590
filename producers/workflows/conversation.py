"""The token ids of a conversation's non-policy parts: the first prompt, and the glue and
message the environment inserts after each policy turn. Pure: no I/O, no model.

A multi-turn episode's token sequence is built by appending ids, never by re-tokenizing
the conversation's text: the policy's sampled ids stay exactly as sampled (a tokenizer
may split the decoded text differently). So what goes between two policy turns is
rendered as text on its own and tokenized on its own:

- ``chat`` format: the template's text after the policy's turn and up to the next
  generation prompt, i.e. the rest of the template's end of an assistant turn (its
  ``<|im_end|>``-like closing, minus the EOS the policy sampled itself) then the
  difference between the conversation rendered with and without the new message
  (``add_generation_prompt=True`` on the longer one). A template that renders earlier
  turns differently once a message is added cannot be appended to (ConfigError).
- ``raw`` format: the message's content between blank lines (:data:`RAW_SEPARATOR`),
  after the policy's EOS.

Tools: a chat template that uses the ``tools`` variable is given the tools' JSON schemas
(``apply_chat_template(..., tools=...)``); for any other chat template the plain-text
call format is explained in a system message
(:func:`~streamrft.producers.workflows.tools.plain_instructions`); raw format adds no
instructions (a raw-format model learns the format from demonstrations, or from
``taskset.system_prompt``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from streamrft.infra.prompts import RAW_SEPARATOR, PromptRenderer
from streamrft.producers.workflows.environments import Message
from streamrft.producers.workflows.tools import plain_instructions
from streamrft.schemas.errors import ConfigError

_MARK = "STREAMRFTASSISTANTMARK"
"""Stands for an assistant turn's content while the template's closing of it is found."""


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template reads the ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _reads_tools(template)


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    """Parsed once per template (a serve process asks on every request with tools)."""
    try:
        import jinja2
        from jinja2 import meta

        names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # a tag of transformers' own extensions: read the text
        return "tools" in template
    return "tools" in names


def assistant_closing(render: Callable[[list[Message], bool], str]) -> str:
    """The chat template's text after an assistant turn's content (``<|im_end|>\\n``...),
    found by rendering (``render(messages, generation_prompt)``) a marked assistant turn;
    :class:`ConfigError` for a template that drops the assistant's content."""
    text = render(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}], False
    )
    if _MARK not in text:
        raise ConfigError(
            "taskset.format: the model's chat template drops the assistant's content; "
            "multi-turn conversations need a template that renders assistant turns"
        )
    return text[text.rindex(_MARK) + len(_MARK) :]


def glue_text(
    close: str, tokenizer: Any, policy_ids: list[int], before: str, after: str
) -> str | None:
    """The text after a policy turn (sampled as ``policy_ids``) up to the next generation
    prompt: the template's ``close`` of the turn (less the EOS the policy sampled itself),
    then what rendering the conversation with the new messages (``after``) adds to
    rendering it up to the policy's turn (``before``); None when ``after`` does not begin
    with ``before`` (the template renders earlier turns differently once one is added)."""
    eos = tokenizer.eos_token
    if policy_ids and policy_ids[-1] == tokenizer.eos_token_id and eos and close.startswith(eos):
        close = close[len(eos) :]  # the policy closed its turn itself
    if not after.startswith(before):
        return None
    return close + after[len(before) :]


class TurnRenderer:
    """Renders one episode's non-policy tokens, by the ``taskset`` prompt settings of
    ``prompts`` (format, system prompt) and the environment's ``tools``."""

    def __init__(self, prompts: PromptRenderer, tools: list[dict]) -> None:
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.chat = prompts.chat
        self.system_prompt = prompts.system_prompt
        self.tools = tools
        self.template_tools = bool(tools) and self.chat and template_takes_tools(self.tokenizer)
        """Tools go to the template; else a chat model is told the plain-text format."""
        self.close = self._closing() if self.chat else ""
        """The template's text after an assistant turn's content."""

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        tools = self.tools if self.template_tools else None
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _closing(self) -> str:
        return assistant_closing(self._render)

    def _system(self, messages: list[Message]) -> list[Message]:
        """``messages`` with one system message first: the task's own (else the system
        prompt) and, for a chat template that takes no tools, the plain-text tool
        instructions; none when there is nothing to say."""
        parts, rest = [], list(messages)
        if rest and rest[0]["role"] == "system":
            parts.append(rest.pop(0)["content"])
        elif self.system_prompt is not None:
            parts.append(self.system_prompt)
        if self.tools and not self.template_tools:
            parts.append(plain_instructions(self.tools))
        if not parts:
            return rest
        return [{"role": "system", "content": RAW_SEPARATOR.join(parts)}, *rest]

    def start(self, messages: list[Message]) -> tuple[list[Message], list[int]]:
        """The conversation as the template sees it and the first prompt's ids."""
        if not self.chat:
            own = bool(messages) and messages[0]["role"] == "system"
            parts = [m["content"] for m in messages]
            if self.system_prompt is not None and not own:
                parts.insert(0, self.system_prompt)
            text = RAW_SEPARATOR.join(parts)
            return list(messages), list(self.tokenizer(text).input_ids)
        conversation = self._system(messages)
        text = self._render(conversation, True)
        return conversation, self.prompts.tokenize_within(text)

    def glue(
        self, conversation: list[Message], policy_ids: list[int], message: Message
    ) -> list[int]:
        """The ids after a policy turn (the last message of ``conversation``, sampled as
        ``policy_ids``) up to the next turn's generation prompt, ``message`` included."""
        if not self.chat:
            return self.prompts.tokenize_within(RAW_SEPARATOR + message["content"] + RAW_SEPARATOR)
        before = self._render(conversation, False)
        after = self._render([*conversation, message], True)
        text = glue_text(self.close, self.tokenizer, policy_ids, before, after)
        if text is None:
            raise ConfigError(
                "taskset.format: the model's chat template renders earlier turns differently "
                "once a message is added, so a conversation cannot be extended token by token"
            )
        return self.prompts.tokenize_within(text)
