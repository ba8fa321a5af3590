"""``streamrft plan`` before anything is downloaded: a recipe is planned without its task
files, from a model folder holding only ``config.json``, or from a known model's shape
(``--model qwen2.5-1.5b``, or the folder's name when the folder is not there yet)."""

from __future__ import annotations

import json

import pytest

from streamrft.app.cli import main
from streamrft.app.model_shapes import KNOWN_MODELS, known_name, shape_of_config
from tests.helpers.qwen_shape import QWEN2_5_1_5B
from tests.helpers.recipes import RECIPES

pytestmark = pytest.mark.unit

PUBLISHED = {
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-1.5b": 1.544e9,
    "qwen2.5-3b": 3.086e9,
    "qwen2.5-7b": 7.616e9,
    "qwen3-0.6b": 0.596e9,
    "qwen3-1.7b": 1.72e9,
    "qwen3-4b": 4.02e9,
    "qwen3-8b": 8.19e9,
    "llama-3.2-1b": 1.236e9,
    "llama-3.2-3b": 3.213e9,
    "llama-3.1-8b": 8.03e9,
    "smollm2-135m": 134.5e6,
    "smollm2-360m": 361.8e6,
    "smollm2-1.7b": 1.711e9,
}
"""Parameter counts as the models' cards (or ``sum(p.numel())``) give them."""


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_each_known_shape_counts_its_published_parameters(name):
    params = shape_of_config(KNOWN_MODELS[name], name).params
    assert params == pytest.approx(PUBLISHED[name], rel=0.01)


def test_the_recipes_model_is_the_shape_the_tests_use():
    assert KNOWN_MODELS["qwen2.5-1.5b"].items() <= QWEN2_5_1_5B.items()


@pytest.mark.parametrize(
    "text, name",
    [
        ("Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-1.5b"),
        ("models/qwen2.5-1.5b-instruct/", "qwen2.5-1.5b"),
        ("SmolLM2-135M-Instruct", "smollm2-135m"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("qwen3-8b", "qwen3-8b"),
        ("qwen2.5-2b", None),
        ("my-model", None),
    ],
)
def test_names_are_read_as_hubs_and_folders_spell_them(text, name):
    assert known_name(text) == name


def _plan(capsys, *argv: str) -> tuple[int, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_is_planned_before_its_model_and_data_are_downloaded(recipe, capsys, tmp_path):
    # the recipe's model folder and task files are not there (nothing is downloaded here)
    assert not (recipe.parent / "../../models/qwen2.5-1.5b-instruct/config.json").exists()
    code, out = _plan(capsys, str(recipe), "--device-memory", "80GiB")
    assert code == 0, out
    assert "model: qwen2.5-1.5b, a known shape (" in out and "has no config.json)" in out
    assert "1,543.7M parameters" in out and "does NOT fit" not in out
    # a larger model in the same recipe, by name
    code, out = _plan(capsys, str(recipe), "--model", "Qwen/Qwen2.5-7B-Instruct", "--json")
    assert json.loads(out)["params"] == shape_of_config(KNOWN_MODELS["qwen2.5-7b"], "").params


def test_a_folder_with_config_json_alone_is_enough(capsys, tmp_path):
    folder = tmp_path / "downloaded-config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_MODELS["smollm2-135m"]))
    recipe = RECIPES[2]  # one_gpu_lora
    code, out = _plan(capsys, str(recipe), "-o", f"model.path={folder}", "--device-memory", "80GiB")
    assert code == 0, out
    assert f"model: {folder}\n  134.5M parameters" in out
    # --model takes the folder or its config.json too
    code, again = _plan(capsys, str(recipe), "--model", str(folder / "config.json"))
    assert code == 0 and f"model: {folder}\n  134.5M parameters" in again


def test_a_model_it_cannot_size_is_named_with_what_would_do(capsys, tmp_path):
    recipe = RECIPES[2]
    code, out = _plan(capsys, str(recipe), "-o", f"model.path={tmp_path / 'my-model'}")
    assert code == 2
    assert f"model.path: {tmp_path / 'my-model'} has no config.json (not downloaded yet?)" in out
    assert "--model NAME (qwen2.5-0.5b, qwen2.5-1.5b," in out
    code, out = _plan(capsys, str(recipe), "--model", "gpt-5")
    assert code == 2 and "--model: 'gpt-5' is not a model folder, a config.json, nor a known" in out


def test_each_device_line_holds_its_unit(capsys):
    from tests.helpers.paths import EXAMPLE

    code, out = _plan(capsys, str(EXAMPLE))
    assert code == 0
    lines = out.splitlines()
    device = next(line for line in lines if line.startswith("cpu: "))
    assert device.endswith(" GiB; device size unknown: give --device-memory"), device
    assert lines[-1].startswith("figures in GiB; estimates without the CUDA context")
    code, out = _plan(capsys, str(EXAMPLE), "--device-memory", "1GiB")
    assert code == 0 and any(
        line.startswith("cpu: ") and line.endswith(" GiB of 1.00 GiB: fits")
        for line in out.splitlines()
    )
