"""Reading JSONL tasksets: prompt lines, chat (messages) lines, and bad lines named by line."""

from __future__ import annotations

import json

import pytest

from streamrft.infra.config import TasksetConfig
from streamrft.infra.taskset import read_taskset
from streamrft.schemas import ChatMessage, ConfigError, Task

pytestmark = pytest.mark.unit

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+5?"}]


def write(tmp_path, *lines) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_prompt_and_chat_lines(tmp_path):
    path = write(
        tmp_path,
        {"id": "a", "prompt": "3+5=", "answer": 8},
        "",
        {"id": "b", "messages": CHAT, "answer": "8", "kind": "add"},
    )
    assert read_taskset(path, TasksetConfig()) == [
        Task(id="a", prompt="3+5=", answer="8"),
        Task(
            id="b",
            answer="8",
            metadata={"kind": "add"},
            messages=[
                ChatMessage(role="system", content="be brief"),
                ChatMessage(role="user", content="3+5?"),
            ],
        ),
    ]


def test_the_messages_field_name_is_configurable(tmp_path):
    path = write(tmp_path, {"conversation": CHAT, "answer": "8"})
    (task,) = read_taskset(path, TasksetConfig(messages_key="conversation"))
    assert task.id == "line000001" and task.prompt == "" and len(task.messages) == 2
    assert task.metadata == {}  # the chat is not copied into the metadata


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (
            {"answer": "8"},
            r":1: missing field 'prompt' \(taskset\.prompt_key\) or 'messages' "
            r"\(taskset\.messages_key\)$",
        ),
        ({"prompt": "x", "messages": CHAT}, r":1: has both fields 'prompt'"),
        ({"messages": []}, r":1: 'messages' \(taskset\.messages_key\) must be a non-empty list"),
        ({"messages": "hi"}, r":1: 'messages' \(taskset\.messages_key\) must be a non-empty list"),
        ({"messages": ["hi"]}, r":1: 'messages' \(taskset\.messages_key\)\[0\] is not an object"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
            r":1: 'messages' \(taskset\.messages_key\)\[1\] needs a non-empty string 'role'",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            r":1: 'messages' \(taskset\.messages_key\)\[0\] needs a string 'content'",
        ),
        ("[1, 2]", r":1: expected an object, got list"),
        ("{oops", r":1: not valid JSON"),
    ],
)
def test_a_bad_line_is_a_config_error_naming_it(tmp_path, line, error):
    path = write(tmp_path, line)
    with pytest.raises(ConfigError, match=r"^taskset .*tasks\.jsonl" + error):
        read_taskset(path, TasksetConfig())


def test_the_error_names_the_line_it_is_on(tmp_path):
    path = write(tmp_path, {"prompt": "1+1="}, {"messages": CHAT}, {"id": "x"})
    with pytest.raises(ConfigError, match=r"tasks\.jsonl:3: missing field"):
        read_taskset(path, TasksetConfig())
    path = write(tmp_path, {"id": "a", "prompt": "1"}, {"id": "a", "messages": CHAT})
    with pytest.raises(ConfigError, match=r"tasks\.jsonl:2: duplicate task id 'a'"):
        read_taskset(path, TasksetConfig())
