"""``streamrft init`` with a real model folder sizes the run for the model and the data,
and says why; ``streamrft validate`` warns of a real model's tiny-model values (``--strict``:
errors) and reports every check, a missing file or folder on its own line.

The folders are made here: the tiny Llama the tests train, saved with a chat template (64
positions: the context bounds the lengths), and a folder of Qwen2.5-1.5B's shape without
weights (sized as the GSM8K recipes are); the data is a GSM8K-shaped Parquet file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from streamrft.app import sizing_facts
from streamrft.app.cli import main
from streamrft.app.sizing import OwnResponses
from streamrft.app.sizing_facts import model_responses, why_not_sampled
from streamrft.infra.config import TasksetConfig, load_config
from streamrft.schemas.errors import ConfigError
from tests.helpers.gsm8k_shape import write_gsm8k_shaped
from tests.helpers.model_folders import (
    write_drifting_folder,
    write_eos_steered_folder,
    write_tiny_folder,
)
from tests.helpers.qwen_shape import write_qwen_shaped

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizing")
    return (
        write_tiny_folder(root / "tiny-llama"),
        write_qwen_shaped(root / "qwen2.5-1.5b-instruct"),
        write_gsm8k_shaped(root / "train.parquet"),
    )


DATA_REASON = (
    "100 answers sampled from train.parquet: 95% within 27 tokens, the longest 27 (worked "
    "solutions); room for 2x that, and at least 256 (a chat model explains in prose)"
)
"""The data's part of ``explorer.max_new_tokens``' reason: answers such as "3 plus 4 makes
7." and "#### 7" on a second line, 27 tokens at most with the EOS."""


def _init(capsys, out, model, data, *flags: str) -> tuple[int, dict[str, str], str]:
    return _init_err(capsys, out, model, data, *flags)[:3]


def _init_err(capsys, out, model, data, *flags: str) -> tuple[int, dict[str, str], str, str]:
    """``init``'s exit status, the reasons it printed by field, its output and its stderr."""
    code = main(
        ["init", "--yes", "--model", str(model), "--data", str(data), "--out", str(out), *flags]
    )
    printed, err = capsys.readouterr()
    lines = printed.split("written:")[0].splitlines()[1:]
    reasons = {
        field.strip().split(" = ")[0]: reason.strip()
        for field, reason in zip(lines[::2], lines[1::2], strict=True)
    }
    return code, reasons, printed, err


def test_a_cpu_run_of_a_model_folder_is_sized_by_its_context_and_data(folders, tmp_path, capsys):
    tiny, _qwen, data = folders
    out = tmp_path / "tiny.yaml"
    code, reasons, printed = _init(capsys, out, tiny, data, "--device", "cpu")
    assert code == 0, printed
    cfg = load_config(out)
    e, t = cfg.explorer, cfg.trainer
    # answers "3 plus 4 makes 7.\n#### 7": 23-26 characters, 27 with the EOS; the prompt
    # "<user>3+4\n<assistant>" 21 at most: 32 with room, leaving 32 of the 64 positions
    assert cfg.taskset.max_prompt_tokens == 32
    assert (
        "the longest of 100 prompts through the model's chat template is 21 tokens"
        in (reasons["taskset.max_prompt_tokens"])
    )
    assert e.max_new_tokens == 32
    # the model's own responses were sampled too (how long the random model's run is the
    # seeded draw's, at 1.0 and where they run on at 0.7 too): whatever they are, the 64
    # positions cut the room to 32
    why = reasons["explorer.max_new_tokens"]
    assert why.startswith(f"{DATA_REASON}; 8 responses of the model at temperature ")
    assert why.endswith("; cut to the 32 the model's 64 positions leave after 32 of prompt")
    # a CPU: an adapter at the CPU example's rate and sizes
    assert cfg.model.lora.enabled and (cfg.model.lora.rank, cfg.model.lora.alpha) == (16, 32)
    assert (t.lr, cfg.model.device, cfg.model.dtype) == (1e-3, "cpu", "float32")
    assert (
        "examples/smollm2_gsm8k_format.yaml (SmolLM2-135M, LoRA), kept for smaller"
        in (reasons["trainer.lr"])
    )
    assert (e.batch_size, e.repeat_times, t.batch_size, t.micro_batch_size) == (4, 8, 4, 8)
    # 100 tasks in batches of 4: three epochs are 75 steps, a warm-up of 3
    assert (t.max_steps, t.lr_schedule, t.lr_warmup_ratio, t.min_lr_ratio) == (
        75, "cosine", 0.033, 0.1
    )  # fmt: skip
    assert cfg.algorithm.mask_truncated is True
    # the reasons are in the file too, under each field's documentation
    text = out.read_text()
    assert "  # init: 100 answers sampled from train.parquet: 95% within 27 tokens" in text
    # validate finds nothing to warn of in what init wrote
    assert "sizes         ok: tiny-llama" in printed and "warning" not in printed
    assert main(["validate", str(out), "--strict"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "config ok"


def test_a_recipe_sized_model_takes_the_recipes_values(folders, tmp_path, capsys):
    _tiny, qwen, data = folders
    out = tmp_path / "full.yaml"
    code, reasons, printed, err = _init_err(
        capsys, out, qwen, data, "--gpus", "1", "--gpu-memory", "80GiB"
    )
    assert code == 0, printed
    # a folder of the shape without weights: its responses cannot be sampled, and it says so
    assert (
        "init: the model's responses are not sampled (qwen2.5-1.5b-instruct holds no weights): "
        "max_new_tokens from the data alone" in err
    )
    cfg = load_config(out)
    e, t = cfg.explorer, cfg.trainer
    assert not cfg.model.lora.enabled
    assert reasons["model.lora"] == "all weights fit: the plan needs 51.1 of 80 GiB (64%)"
    assert t.lr == 1e-6 and "examples/gsm8k/one_gpu_full.yaml" in reasons["trainer.lr"]
    assert (e.max_new_tokens, cfg.taskset.max_prompt_tokens) == (512, 512)
    assert (e.batch_size, e.repeat_times, t.batch_size, t.mini_batch_size) == (16, 8, 16, 8)
    assert (t.micro_batch_size, t.gradient_checkpointing) == (8, True)
    assert (cfg.model.device, cfg.model.dtype) == ("cuda", "bfloat16")
    assert "cuda:0: 51.09 GiB of 80.00 GiB: fits" in printed  # the plan on the GPU given
    # an adapter when asked, at the LoRA recipe's rate and rank
    out = tmp_path / "lora.yaml"
    code, reasons, printed = _init(
        capsys, out, qwen, data, "--gpus", "1", "--gpu-memory", "80GiB", "--tune", "lora"
    )
    cfg = load_config(out)
    assert code == 0 and cfg.model.lora.enabled and cfg.trainer.lr == 2e-5
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (32, 64)
    assert reasons["model.lora"].startswith("--tune lora; an adapter of rank 32")
    # a GPU too small for all weights: an adapter, said why
    out = tmp_path / "small.yaml"
    code, reasons, printed = _init(capsys, out, qwen, data, "--gpus", "1", "--gpu-memory", "24GiB")
    assert code == 0 and load_config(out).model.lora.enabled
    assert reasons["model.lora"].startswith(
        "all weights would need 51.1 of 24 GiB (213%, over 80%)"
    )


def test_two_gpus_split_the_explorer_and_the_trainer(folders, tmp_path, capsys):
    _tiny, qwen, data = folders
    out = tmp_path / "two.yaml"
    code, _reasons, printed = _init(capsys, out, qwen, data, "--gpus", "2", "--gpu-memory", "80GiB")
    assert code == 0, printed
    cfg = load_config(out)
    assert (cfg.explorer.device, cfg.trainer.device) == ("cuda:0", "cuda:1")


def test_the_tiny_model_keeps_its_own_values(tmp_path, capsys):
    out = tmp_path / "t.yaml"
    assert (
        main(
            [
                "init",
                "--yes",
                "--data",
                str(write_gsm8k_shaped(tmp_path / "d.parquet")),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "sized for" not in printed and "sizes " not in printed
    cfg = load_config(out)
    assert (cfg.explorer.max_new_tokens, cfg.trainer.lr, cfg.model.source) == (16, 1e-3, "tiny")


def _validate(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(["validate", *argv])
    return code, capsys.readouterr().out.splitlines()


def test_tiny_model_values_on_a_real_model_are_warnings(folders, tmp_path, capsys):
    tiny, _qwen, data = folders
    config = tmp_path / "kept.yaml"  # what init wrote before it sized: the tiny defaults
    config.write_text(
        f"model: {{source: path, path: {tiny}}}\n"
        f"taskset: {{path: {data}, prompt_template: '{{question}}', answer_extract: gsm8k}}\n"
        "explorer: {reward: math_answer, repeat_times: 2}\n"
    )
    code, lines = _validate(capsys, str(config))
    assert code == 0
    warnings = [line[14:] for line in lines if line.startswith("warning")]
    assert [w.split(":")[0] for w in warnings] == [
        "explorer.max_new_tokens", "trainer.lr", "explorer.repeat_times"
    ]  # fmt: skip
    assert warnings[0] == (
        "explorer.max_new_tokens: 16 tokens would not hold the data's worked answers: 95% need "
        "up to 27 (the longest 27; 100 of 100 sampled are longer); init would write at least 64 "
        "(more where the model's own responses run longer)"
    )
    assert warnings[1].startswith("trainer.lr: 0.001 is 1,000x the usual 1e-06 for all weights")
    assert lines[-1] == "config ok with 3 warnings"
    code, lines = _validate(capsys, str(config), "--strict")
    assert code == 1 and lines[-1] == "3 warnings, errors under --strict"
    # fixed by overrides: no warning left
    code, lines = _validate(
        capsys, str(config), "--strict", "-o", "explorer.max_new_tokens=32",
        "-o", "explorer.repeat_times=8", "-o", "trainer.lr=1e-6",
    )  # fmt: skip
    assert code == 0 and lines[-1] == "config ok"


def test_every_check_runs_and_a_missing_file_is_its_own_line(folders, tmp_path, capsys):
    _tiny, _qwen, data = folders
    config = tmp_path / "missing.yaml"
    config.write_text(
        f"model: {{source: path, path: {tmp_path / 'models' / 'not-downloaded'}}}\n"
        f"taskset: {{path: {tmp_path / 'data' / 'train.parquet'}, max_prompt_tokens: 512}}\n"
        f"eval: {{path: {tmp_path / 'data' / 'test.parquet'}}}\n"
        "explorer: {reward: no_such_reward}\n"
    )
    code, lines = _validate(capsys, str(config))
    assert code == 1
    checks = {line[:13].strip(): line[13:].strip() for line in lines[:-1]}
    assert checks["taskset"] == (
        f"FAILED: taskset.path: '{tmp_path / 'data' / 'train.parquet'}' does not exist "
        "(expected a JSONL or Parquet file, a folder of them as a dataset hub's download "
        "lays it out, or a folder of a saved dataset)"
    )
    assert checks["eval set"].startswith("FAILED: eval.path: ")
    assert checks["names"].startswith("FAILED: explorer.reward: unknown reward 'no_such_reward'")
    assert checks["model"] == (
        f"FAILED: model.path: {tmp_path / 'models' / 'not-downloaded'} is not a folder "
        "(expected a local Hugging Face model folder: config.json, a tokenizer, "
        "*.safetensors; nothing is downloaded)"
    )
    assert checks["device"].startswith("ok: trainer cpu")
    assert lines[-1] == "4 check(s) failed: taskset, eval set, names, model"
    # the data there, the model still missing: the tasks are counted, their prompts not
    # measured, and no hub error ("Repo id must be in the form ...") anywhere
    code, lines = _validate(
        capsys, str(config), "-o", f"taskset.path={data}", "-o", "eval.path=",
        "-o", "taskset.prompt_template={question}",
    )  # fmt: skip
    checks = {line[:13].strip(): line[13:].strip() for line in lines[:-1]}
    assert checks["taskset"] == (
        f"ok: 100 tasks in {data}; prompt lengths not measured (no model folder: see model)"
    )
    assert "Repo id" not in "\n".join(lines)


def test_a_hub_style_folder_gives_its_test_split_to_evaluation(folders, tmp_path, capsys):
    tiny, _qwen, data = folders
    main_ = tmp_path / "data" / "gsm8k" / "main"  # as `hf download openai/gsm8k` lays it out
    main_.mkdir(parents=True)
    (main_ / "train-00000-of-00001.parquet").write_bytes(data.read_bytes())
    (main_ / "test-00000-of-00001.parquet").write_bytes(data.read_bytes())
    out = tmp_path / "hub.yaml"
    code, reasons, printed = _init(
        capsys, out, tiny, tmp_path / "data" / "gsm8k", "--device", "cpu"
    )
    assert code == 0, printed
    cfg = load_config(out)
    assert cfg.taskset.path == str(tmp_path / "data" / "gsm8k")
    assert cfg.eval.path == str(main_ / "test-00000-of-00001.parquet")
    assert "path: data/gsm8k/main/test-00000-of-00001.parquet" in out.read_text()  # relative
    assert reasons["eval.path"] == "the data folder's held-out split, its own file"
    assert reasons["eval.max_tasks"] == "the first 48 of them (the CPU example)"
    assert "eval set      ok: 100 tasks in" in printed


def test_init_samples_the_models_own_responses(folders, tmp_path, capsys):
    _tiny, _qwen, data = folders
    # a model that never ends, with 512 positions: its two responses run to the 491 the
    # longest prompt (21 tokens) leaves, at 0.7 as at 1.0, so it gets that cap, within the
    # context, and keeps its temperature
    never = write_eos_steered_folder(tmp_path / "never", ends=False, positions=512)
    out = tmp_path / "never.yaml"
    code, reasons, printed, err = _init_err(
        capsys, out, never, data, "--device", "cpu", "--sample-responses", "2"
    )
    assert code == 0, printed + err
    cfg = load_config(out)
    assert (cfg.explorer.max_new_tokens, cfg.taskset.max_prompt_tokens) == (480, 32)
    assert reasons["explorer.max_new_tokens"] == (
        f"{DATA_REASON}; 2 responses of the model at temperature 1.0: p90 491 tokens, 2 not "
        "ended by 491: the model runs on to the cap, so it gets the cap, to a power of two; at "
        "0.7 too (p90 491 tokens, 2 not ended by 491): explorer.temperature kept at 1.0; cut "
        "to the 480 the model's 512 positions leave after 32 of prompt"
    )
    assert "explorer.temperature" not in reasons and cfg.explorer.temperature == 1.0
    assert "init: sampling 2 responses of the model to size max_new_tokens (2/2)" in err
    assert (
        "init: sampling them again at temperature 0.7 (2 of 2 at 1.0 did not end by 491) (2/2)"
        in err
    )
    assert cfg.trainer.micro_batch_size == 2  # 1,024 tokens of 512-token sequences
    # a model that ends at once: the data decides, and the reason says what was sampled
    at_once = write_eos_steered_folder(tmp_path / "at-once", ends=True, positions=512)
    out = tmp_path / "at-once.yaml"
    code, reasons, printed = _init(capsys, out, at_once, data, "--device", "cpu")
    assert code == 0 and load_config(out).explorer.max_new_tokens == 256
    assert reasons["explorer.max_new_tokens"] == (
        f"{DATA_REASON}; 8 responses of the model at temperature 1.0: p90 1 tokens, all "
        "ended; room for 1.25x that, to a power of two"
    )
    # --sample-responses 0: the data alone, nothing sampled
    out = tmp_path / "data-only.yaml"
    code, reasons, printed, err = _init_err(
        capsys, out, never, data, "--device", "cpu", "--sample-responses", "0"
    )
    assert code == 0 and load_config(out).explorer.max_new_tokens == 256
    assert reasons["explorer.max_new_tokens"] == f"{DATA_REASON}, to a power of two"
    assert "sampling" not in err
    code = main(["init", "--yes", "--model", str(never), "--data", str(data), "--out",
                 str(tmp_path / "x.yaml"), "--sample-responses", "-1"])  # fmt: skip
    assert code == 2 and not (tmp_path / "x.yaml").exists()
    assert "--sample-responses: -1 is negative (0: none)" in capsys.readouterr().err


def test_a_model_that_drifts_at_its_temperature_is_given_a_lower_one(folders, tmp_path, capsys):
    _tiny, _qwen, data = folders
    # at 1.0 three of its 8 responses run on to the 299 the 320 positions leave, at 0.7
    # all end, the longest after 100 tokens (tests/helpers/model_folders.py says why)
    drifting = write_drifting_folder(tmp_path / "drifting")
    out = tmp_path / "calmer.yaml"
    code, reasons, printed, err = _init_err(capsys, out, drifting, data, "--device", "cpu")
    assert code == 0, printed + err
    cfg = load_config(out)
    assert (cfg.explorer.temperature, cfg.explorer.max_new_tokens) == (0.7, 256)
    assert reasons["explorer.temperature"] == (
        "8 responses at temperature 1.0: 3 not ended by 299, the model drifts on; at 0.7: p90 "
        "100 tokens, all ended: a lower temperature keeps its answers on track"
    )
    # sized by the responses at 0.7 (1.25 x 100 within the chat model's 256), not the cap
    assert reasons["explorer.max_new_tokens"] == (
        f"{DATA_REASON}; 8 responses of the model at temperature 0.7: p90 100 tokens, all "
        "ended; room for 1.25x that, to a power of two"
    )
    assert "init: sampling 8 responses of the model to size max_new_tokens (8/8)" in err
    assert (
        "init: sampling them again at temperature 0.7 (3 of 8 at 1.0 did not end by 299) (8/8)"
        in err
    )
    text = out.read_text()
    assert "  temperature: 0.7\n" in text
    assert (
        "  # init: 8 responses at temperature 1.0: 3 not ended by 299, the model drifts on;" in text
    )
    assert "warning" not in printed
    # the user's own temperature is kept, and sampled at once: the cap, and the user's
    # max_new_tokens over it, said
    out = tmp_path / "given.yaml"
    code, reasons, printed, err = _init_err(
        capsys, out, drifting, data, "--device", "cpu",
        "-o", "explorer.temperature=1.0", "-o", "explorer.max_new_tokens=128",
    )  # fmt: skip
    assert code == 0, printed + err
    cfg = load_config(out)
    assert (cfg.explorer.temperature, cfg.explorer.max_new_tokens) == (1.0, 128)
    assert "explorer.temperature" not in reasons and "again" not in err
    assert reasons["explorer.max_new_tokens"] == (
        f"as given (-o explorer.max_new_tokens); init would write 288: {DATA_REASON}; 8 "
        "responses of the model at temperature 1.0: p90 299 tokens, 3 not ended by 299: the "
        "model runs on to the cap, so it gets the cap, to a power of two; cut to the 288 the "
        "model's 320 positions leave after 32 of prompt"
    )
    assert "  temperature: 1.0\n" in out.read_text()
    # a field that does not exist stops init before it samples anything
    code = main(["init", "--yes", "--model", str(drifting), "--data", str(data), "--out",
                 str(tmp_path / "typo.yaml"), "-o", "explorer.temprature=1.0"])  # fmt: skip
    printed, err = capsys.readouterr()
    assert code == 2 and "did you mean explorer.temperature?" in err and "sampling" not in err
    # a conversion takes no -o: its values come from the source
    code = main(["init", "--from-verl", "data.train_batch_size=8", "--out",
                 str(tmp_path / "verl.yaml"), "-o", "explorer.temperature=1.0"])  # fmt: skip
    assert code == 2 and not (tmp_path / "verl.yaml").exists()
    assert "-o: not with --from-trinity or --from-verl" in capsys.readouterr().err


def test_the_sampling_is_seeded_bounded_and_leaves_torch_as_found(folders, tmp_path):
    tiny, _qwen, data = folders
    taskset = TasksetConfig(path=str(data), prompt_template="{question}", answer_extract="gsm8k")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _seeded_bounded_and_torch_as_found(taskset, data, tiny, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _seeded_bounded_and_torch_as_found(taskset, data, tiny, tmp_path):
    state = torch.random.get_rng_state()
    calls: list[tuple[int, int]] = []

    def sample(folder, **kw):
        kw = {"count": 8, "temperature": 1.0, "device": "cpu", "context": 64, **kw}
        return model_responses(folder, taskset, str(data), **kw)

    first = sample(tiny, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 8) for i in range(9)]
    assert sample(tiny) == first  # seeded: the same lengths again
    assert torch.get_num_threads() == 1 and torch.equal(torch.random.get_rng_state(), state)
    assert len(first.lengths) == 8 and first.cap == 64 - 21 and first.temperature == 1.0
    assert first.cut <= sum(n == first.cap for n in first.lengths)  # cut ones run to the cap
    assert all(1 <= n <= first.cap for n in first.lengths)
    # the cap given, and the context's room when it is less; a model that never ends runs
    # every response to it
    never = write_eos_steered_folder(tmp_path / "never", ends=False)
    assert sample(never, cap=5) == OwnResponses((5,) * 8, 8, 5, 1.0)
    assert sample(never, count=3, temperature=0.5) == OwnResponses((43,) * 3, 3, 43, 0.5)
    ended = sample(write_eos_steered_folder(tmp_path / "ends", ends=True))
    assert ended == OwnResponses((1,) * 8, 0, 43, 1.0)  # the EOS counted
    # a context with room for more: on a CPU the cap is CPU_RESPONSE_CAP's 512
    long = write_eos_steered_folder(tmp_path / "long", ends=False, positions=1024)
    assert sample(long, count=1, context=1024) == OwnResponses((512,), 1, 512, 1.0)
    assert sizing_facts.CPU_RESPONSE_CAP == 512


def test_a_model_that_cannot_be_sampled_is_a_config_error_or_skipped(folders, tmp_path):
    tiny, qwen, data = folders
    taskset = TasksetConfig(path=str(data), prompt_template="{question}", answer_extract="gsm8k")
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)  # its weights no longer fit its config
    conf = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**conf, "hidden_size": 128}))
    with pytest.raises(ConfigError) as caught:
        model_responses(
            broken, taskset, str(data), count=2, temperature=1.0, device="cpu", context=64
        )
    assert str(caught.value).startswith(
        "--sample-responses: cannot sample broken's responses on cpu: "
    )
    assert str(caught.value).endswith("(--sample-responses 0 sizes from the data alone)")
    # skipped, and why: no weights; too large to sample on a CPU
    assert why_not_sampled(qwen, 1_543_714_304, "cuda") == "qwen2.5-1.5b-instruct holds no weights"
    assert why_not_sampled(tiny, 2_000_000_000, "cpu").startswith(
        "a 2.0B model samples too slowly on a CPU (over 0.6B)"
    )
    assert why_not_sampled(tiny, 100_000, "auto") is None


def test_a_field_given_inside_a_sized_mapping_leaves_what_init_would_write_untouched(
    folders, tmp_path, capsys
):
    """``-o model.lora.rank=...`` changes the written adapter, not the sized value the
    reason quotes; a whole section given leaves a sized field to its default, said."""
    _tiny, qwen, data = folders
    flags = ("--gpus", "1", "--gpu-memory", "24GiB")
    code, _reasons, printed = _init(capsys, tmp_path / "sized.yaml", qwen, data, *flags)
    assert code == 0, printed
    sized = load_config(tmp_path / "sized.yaml").model.lora
    mine = sized.rank * 2
    out = tmp_path / "mine.yaml"
    code, reasons, printed = _init(capsys, out, qwen, data, *flags, "-o", f"model.lora.rank={mine}")
    assert code == 0, printed
    assert load_config(out).model.lora.rank == mine
    assert reasons["model.lora"].startswith(
        f"as given (-o model.lora.rank); init would write {{alpha: {sized.alpha:g}, enabled: "
        f"true, rank: {sized.rank}}}: "
    )
    out = tmp_path / "section.yaml"
    code, reasons, printed = _init(
        capsys, out, qwen, data, *flags, "-o", "explorer={temperature: 0.9}"
    )
    assert code == 0, printed
    assert load_config(out).explorer.temperature == 0.9
    assert reasons["explorer.max_new_tokens"].startswith(
        "left to its default (-o explorer); init would write "
    )
