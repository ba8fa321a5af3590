"""A config mistake is reported with the field, what it expects and the likely fix: the
nearest field for an unknown one, the choices of an enum, the quoting of text YAML reads
as something else; an override of a text field takes the text as it is."""

from __future__ import annotations

import pytest

from streamrft.app.cli import main
from streamrft.infra.config import Config, from_dict, load_config
from streamrft.infra.config_messages import nearest_field
from streamrft.schemas.errors import ConfigError
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"trainer": {"learning_rate": 1e-6}}, "trainer: unknown field `learning_rate`; did you mean trainer.lr?"),
        ({"trainer": {"max_new_tokens": 64}}, "trainer: unknown field `max_new_tokens`; did you mean explorer.max_new_tokens?"),
        ({"explorer": {"max_response_tokens": 64}}, "explorer: unknown field `max_response_tokens`; did you mean explorer.max_new_tokens?"),
        ({"trainer": {"batch_sise": 4}}, "trainer: unknown field `batch_sise`; did you mean trainer.batch_size?"),
        ({"model": {"lora": {"rnak": 4}}}, "model.lora: unknown field `rnak`; did you mean model.lora.rank?"),
        ({"trainr": {}}, "config: unknown field `trainr`; did you mean trainer?"),
        ({"trainer": {"zzzz": 1}}, "trainer: unknown field `zzzz`"),
        ({"model": {"dtype": "bf16"}}, "model.dtype: Invalid enum value 'bf16'; expected one of bfloat16, float16, float32; did you mean bfloat16?"),
        ({"taskset": {"format": "text"}}, "taskset.format: Invalid enum value 'text'; expected one of auto, chat, raw"),
        ({"taskset": {"prompt_template": {"question": None}}}, "taskset.prompt_template: expected text, but YAML read {question} as a mapping; quote it: prompt_template: \"{question}\" (on the command line: -o 'taskset.prompt_template=\"{question}\"')"),
        ({"run": {"name": 2024}}, "run.name: expected text, but YAML read 2024 as a number; quote it: name: \"2024\""),
    ],
)  # fmt: skip
def test_each_mistake_names_its_fix(sections, message):
    data = {"taskset": {"path": "t.jsonl"}}
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    with pytest.raises(ConfigError) as caught:
        from_dict(data)
    assert str(caught.value).startswith(message), str(caught.value)
    if "did you mean" not in message and "expected" not in message:
        assert "did you mean" not in str(caught.value)  # nothing near: no guess


def test_a_name_found_in_another_section_is_suggested_there():
    assert nearest_field(Config, "trainer", "temperature") == "explorer.temperature"
    assert nearest_field(Config, "explorer", "max_prompt_length") == "taskset.max_prompt_tokens"
    assert nearest_field(Config, "model", "model_path") == "model.path"


def test_an_override_of_a_text_field_takes_the_text(tmp_path, capsys):
    cfg = load_config(
        EXAMPLE,
        ["taskset.prompt_template={prompt}", "run.name=2024", "taskset.system_prompt=[be brief]"],
    )
    assert cfg.taskset.prompt_template == "{prompt}"
    assert cfg.run.name == "2024"
    assert cfg.taskset.system_prompt == "[be brief]"
    # quoted as YAML it is the same text; a number field still reads a number
    cfg = load_config(EXAMPLE, ['taskset.prompt_template="{prompt}"', "trainer.lr=2e-5"])
    assert (cfg.taskset.prompt_template, cfg.trainer.lr) == ("{prompt}", 2e-5)
    # an enum is not text: its mistake is named with the choices
    assert main(["validate", str(EXAMPLE), "-o", "model.dtype=bf16"]) == 2
    assert "expected one of bfloat16, float16, float32" in capsys.readouterr().err


def test_a_file_with_an_unquoted_template_says_how_to_quote_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"taskset:\n  path: {tmp_path / 't.jsonl'}\n  prompt_template: {{question}}\n")
    (tmp_path / "t.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r'quote it: prompt_template: "\{question\}"'):
        load_config(path)
