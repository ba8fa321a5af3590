"""The sizing rules of ``streamrft init`` and ``validate``'s warnings (``app/sizing.py``):
the values are the recipes' where a recipe fits (read here from the recipe files
themselves), the lengths follow the data's token counts, the learning rate the model's
size, and each warning names its field."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from streamrft.app import sizing
from streamrft.app.model_shapes import KNOWN_MODELS, shape_of_config
from streamrft.app.sizing import Choice, DataFacts, Hardware, ModelFacts, OwnResponses
from streamrft.consumers.algorithms.advantages import ADVANTAGES, AdvantageInputs
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.infra.config import from_dict
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.unit

GSM8K = ROOT / "examples" / "gsm8k"
CPU_EXAMPLE = ROOT / "examples" / "smollm2_gsm8k_format.yaml"
GPU = Hardware(1, 80 << 30, False, "1 GPU")
GPU_VLLM = Hardware(1, 80 << 30, True, "1 GPU")
TWO_GPUS = Hardware(2, 80 << 30, True, "2 GPUs")
CPU = Hardware(0, None, False, "no GPU")


def _recipe(name: str) -> dict:
    return yaml.safe_load((GSM8K / name).read_text())


def _values(choices: list[Choice]) -> dict[str, object]:
    return {c.field: c.value for c in choices}


def _data(answers: list[int], prompts: list[int], worked: bool = True, total=None) -> DataFacts:
    return DataFacts(
        "d.parquet", len(answers), total, tuple(sorted(prompts)), tuple(sorted(answers)), worked
    )


def test_the_learning_rates_are_the_recipes_at_their_models_sizes():
    lora, full = _recipe("one_gpu_lora.yaml"), _recipe("one_gpu_full.yaml")
    cpu = yaml.safe_load(CPU_EXAMPLE.read_text())
    qwen = shape_of_config(KNOWN_MODELS["qwen2.5-1.5b"], "").params
    smollm2 = shape_of_config(KNOWN_MODELS["smollm2-135m"], "").params
    assert smollm2 == sizing.LORA_ANCHORS[0][0]
    assert qwen == pytest.approx(sizing.RECIPE_PARAMS, rel=1e-4)  # less its q/k/v biases
    assert lora["model"]["lora"]["enabled"] and cpu["model"]["lora"]["enabled"]
    assert sizing.lr_range(qwen, lora=True).usual == lora["trainer"]["lr"]
    assert sizing.lr_range(qwen, lora=False).usual == full["trainer"]["lr"]
    assert sizing.lr_range(smollm2, lora=True).usual == cpu["trainer"]["lr"]


def test_the_learning_rate_falls_with_the_size_between_and_beyond_the_recipes():
    sizes = [50e6, 135e6, 360e6, 700e6, 1.5e9, 3e9, 7e9, 32e9]
    for lora in (True, False):
        rates = [sizing.lr_range(int(n), lora).usual for n in sizes]
        assert rates == sorted(rates, reverse=True), rates
    # between the anchors, in log scale: 360M's adapter rate lies inside (2e-5, 1e-3)
    assert 2e-5 < sizing.lr_range(int(360e6), True).usual < 1e-3
    # above the largest: the square root of the size, to 1, 2 or 5 x 10^k
    assert sizing.lr_range(int(6.2e9), False).usual == 5e-7  # 1e-6 / sqrt(4)
    r = sizing.lr_range(int(7e9), True)
    assert (r.low, r.high) == pytest.approx((r.usual / 10, r.usual * 10))


def test_on_gpus_the_batches_schedule_and_layout_are_the_recipes():
    for name in ("one_gpu_lora.yaml", "one_gpu_full.yaml", "one_gpu_vllm.yaml", "two_gpus.yaml"):
        r = _recipe(name)
        data = _data([100] * 50, [200] * 50)
        steps = _values(sizing.schedule_choices(data, 16))
        chosen = {
            **_values(sizing.batch_choices(GPU, 1024)),
            **steps,
            **_values(
                [sizing.response_choice(data, True, True), sizing.prompt_choice(data, True, True)]
            ),
        }
        for field, value in chosen.items():
            section, key = field.split(".")
            if key == "lr_warmup_ratio":  # written as a share: the recipes' 10 of 300 steps
                assert (
                    math.ceil(value * steps["trainer.max_steps"]) == r[section]["lr_warmup_steps"]
                )
            else:
                assert r[section][key] == value, (name, field)
    one_vllm, two = _recipe("one_gpu_vllm.yaml"), _recipe("two_gpus.yaml")
    placed = _values(sizing.placement_choices(GPU_VLLM, True, sizing.RECIPE_PARAMS))
    assert (
        placed["explorer.gpu_memory_utilization"] == one_vllm["explorer"]["gpu_memory_utilization"]
    )
    assert placed["trainer.gpu_memory_fraction"] == one_vllm["trainer"]["gpu_memory_fraction"]
    assert placed["model.lora"] == {
        "enabled": True,
        **_recipe("one_gpu_lora.yaml")["model"]["lora"],
    }
    assert (placed["model.dtype"], placed["explorer.engine"]) == ("bfloat16", "vllm")
    placed = _values(sizing.placement_choices(TWO_GPUS, False, sizing.RECIPE_PARAMS))
    assert (placed["explorer.device"], placed["trainer.device"]) == (
        two["explorer"]["device"], two["trainer"]["device"]
    )  # fmt: skip
    assert placed["explorer.gpu_memory_utilization"] == two["explorer"]["gpu_memory_utilization"]
    assert "model.lora" not in placed
    assert _values(sizing.placement_choices(GPU, False, 1))["explorer.engine"] == "transformers"


def test_on_a_cpu_the_sizes_are_the_cpu_examples():
    cpu = yaml.safe_load(CPU_EXAMPLE.read_text())
    chosen = _values(sizing.batch_choices(CPU, 120))  # the example's 80 + 40 tokens
    for field, value in chosen.items():
        section, key = field.split(".")
        assert cpu[section][key] == value, field
    # longer sequences: fewer rows a micro-batch, about as many tokens
    assert _values(sizing.batch_choices(CPU, 384))["trainer.micro_batch_size"] == 2
    assert _values(sizing.batch_choices(CPU, 4096))["trainer.micro_batch_size"] == 1
    # a sequence longer than a micro-batch's tokens: one row, and the reason says so
    (micro,) = [c for c in sizing.batch_choices(CPU, 2048 + 128) if "micro" in c.field]
    assert micro.value == 1 and micro.reason.startswith(
        "sequences a forward/backward, one 2176-token sequence, more than the 1024 tokens"
    )
    assert _values(sizing.batch_choices(GPU, 4096))["trainer.micro_batch_size"] == 8  # planned
    placed = _values(sizing.placement_choices(CPU, True, 134_515_008))
    assert placed["model.lora"] == {"enabled": True, **cpu["model"]["lora"]}
    assert (placed["model.device"], placed["model.dtype"]) == ("cpu", cpu["model"]["dtype"])


def test_the_recipes_fit_a_model_of_their_size_on_a_gpu_only():
    def model(params):
        return ModelFacts("m", params, 32768, True)

    assert sizing.recipe_fits(model(sizing.RECIPE_PARAMS), GPU)
    assert sizing.recipe_fits(model(int(1.2e9)), GPU)
    assert not sizing.recipe_fits(model(sizing.RECIPE_PARAMS), CPU)
    assert not sizing.recipe_fits(model(int(7e9)), GPU)
    assert not sizing.recipe_fits(model(int(135e6)), GPU)


def test_response_room_follows_the_answers():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    c = sizing.response_choice(worked, recipe=False, chat=False)
    assert worked.answer_p95 == 41 and c.value == 128  # 2 x 41 = 82, to a power of two
    assert c.reason == (
        "100 answers sampled from d.parquet: 95% within 41 tokens, the longest 60 (worked "
        "solutions); room for 2x that, and at least 128, to a power of two"
    )
    long = _data([100] * 100, [30] * 100)
    assert sizing.response_choice(long, recipe=False, chat=False).value == 256  # 200
    # a chat model explains in prose: at least 256
    c = sizing.response_choice(worked, recipe=False, chat=True)
    assert c.value == sizing.CHAT_FLOOR and "(a chat model explains in prose)" in c.reason
    assert sizing.response_choice(worked, recipe=True, chat=True).value == 512  # the recipes'
    longer = _data([300] * 100, [30] * 100)
    c = sizing.response_choice(longer, recipe=True, chat=True)
    assert c.value == 1024 and "power of two" in c.reason  # 512 would cut them: the data's
    bare = _data([3] * 100, [30] * 100, worked=False)
    c = sizing.response_choice(bare, recipe=False, chat=False)
    assert c.value == sizing.FLOOR and "(bare answers)" in c.reason


def _own(lengths: list[int], cap: int = 2048) -> OwnResponses:
    return OwnResponses(tuple(sorted(lengths)), sum(n >= cap for n in lengths), cap, 1.0)


WORKED = (
    "100 answers sampled from d.parquet: 95% within 41 tokens, the longest 60 (worked "
    "solutions); room for 2x that, and at least 128"
)
"""The data part of the reason for :func:`test_the_models_own_responses_widen_the_room`'s
data, a plain model's."""


def test_the_models_own_responses_widen_the_room():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    # responses that end early: the data decides, and the reason says what was sampled
    early = _own([12, 20, 25, 30, 31, 40, 44, 60])
    c = sizing.response_choice(worked, recipe=False, chat=False, own=early)
    assert early.p90 == 60 and c.value == 128  # 1.25 x 60 = 75 < the data's 128
    assert c.reason == (
        f"{WORKED}; 8 responses of the model at temperature 1.0: p90 60 tokens, all ended; "
        "room for 1.25x that, to a power of two"
    )
    # longer working than the data's answers: the model's 402 x 1.25 = 502.5 -> 512, which
    # the recipes' 512 holds; 450 x 1.25 = 562.5 does not fit it: 1024
    chatty = _own([94, 110, 120, 132, 150, 200, 300, 402])
    assert sizing.response_choice(worked, False, True, chatty).value == 512
    c = sizing.response_choice(worked, True, True, chatty)
    assert c.value == 512 and c.reason.startswith("the GSM8K recipes' 512 holds them (")
    c = sizing.response_choice(worked, True, True, _own([94, 110, 120, 132, 150, 200, 300, 450]))
    assert c.value == 1024 and "p90 450 tokens, all ended; room for 1.25x that" in c.reason
    # of 20 one runs to the cap, its 90th percentile does not: room over the 90th
    one_cut = _own([100] * 17 + [310, 320, 2048])
    assert one_cut.p90 == 310 and not one_cut.rambles
    c = sizing.response_choice(worked, False, True, one_cut)
    assert c.value == 512 and "p90 310 tokens, the longest 2048, 1 not ended by 2048;" in c.reason
    # near the cap: room up to the cap, never past what was sampled
    c = sizing.response_choice(worked, False, False, _own([100] * 7 + [1900]))
    assert c.value == 2048 and c.reason.endswith(
        "room for 1.25x that, up to the cap, to a power of two"
    )


def test_a_model_that_runs_on_to_the_cap_gets_the_cap():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    rambler = _own([62, 63, 80, 94, 132, 158, 2048, 2048])
    assert rambler.cut == 2 and rambler.rambles
    for recipe in (False, True):  # the recipes' 512 would not hold it: the cap, said so
        c = sizing.response_choice(worked, recipe, chat=False, own=rambler)
        assert c.value == 2048
        assert c.reason == (
            f"{WORKED}; 8 responses of the model at temperature 1.0: p90 2048 tokens, 2 not "
            "ended by 2048: the model runs on to the cap, so it gets the cap, to a power of two"
        )
    # a cap the context set below 512: the recipes' 512 is not said to hold them
    short = _own([300] * 8, cap=300)
    c = sizing.response_choice(worked, recipe=True, chat=True, own=short)
    assert c.value == 512 and "holds them" not in c.reason and "8 not ended by 300" in c.reason
    # and the context cuts what is chosen, as it cuts the data's room
    prompt = Choice("taskset.max_prompt_tokens", 32, "p")
    tiny_cap = _own([43] * 8, cap=43)  # a context of 64 left 43 after the longest prompt
    wanted = sizing.response_choice(worked, recipe=False, chat=True, own=tiny_cap)
    assert wanted.value == sizing.CHAT_FLOOR  # the cap (43) is below the chat floor
    cut = sizing.fit_context(prompt, wanted, 64)
    assert cut.value == 32 and cut.reason.endswith(
        "8 not ended by 43: the model runs on to the cap, so it gets the cap, to a power of "
        "two; cut to the 32 the model's 64 positions leave after 32 of prompt"
    )
    # no responses sampled: the data alone, as without them
    none = OwnResponses((), 0, 2048, 1.0)
    assert sizing.response_choice(worked, False, False, none) == sizing.response_choice(
        worked, False, False
    )


def _at(temperature: float, lengths: list[int], cap: int = 512) -> OwnResponses:
    return OwnResponses(tuple(sorted(lengths)), sum(n >= cap for n in lengths), cap, temperature)


DRIFTS = _at(1.0, [30, 62, 80, 110, 145, 158, 512, 512])
"""SmolLM2-135M-Instruct's way on GSM8K on a CPU: at 1.0, 2 of 8 responses drift on past the
512-token cap."""


def test_a_model_that_drifts_at_its_temperature_and_ends_at_a_lower_one_gets_the_lower():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    assert DRIFTS.rambles and sizing.CALMER_TEMPERATURE == 0.7
    assert sizing.tries_calmer(DRIFTS, temperature_given=False)
    calm = _at(0.7, [25, 40, 52, 70, 88, 96, 120, 180])
    assert not calm.rambles
    response, temperature = sizing.response_choices(worked, False, False, DRIFTS, calm)
    # sized by the responses at 0.7: 1.25 x 180 = 225 -> 256, where 1.0's gave the cap
    assert sizing.response_choice(worked, False, False, DRIFTS).value == 512
    assert response == sizing.response_choice(worked, False, False, calm)
    assert response.value == 256 and response.reason == (
        f"{WORKED}; 8 responses of the model at temperature 0.7: p90 180 tokens, all ended; "
        "room for 1.25x that, to a power of two"
    )
    assert temperature == Choice(
        "explorer.temperature",
        0.7,
        "8 responses at temperature 1.0: 2 not ended by 512, the model drifts on; at 0.7: "
        "p90 180 tokens, all ended: a lower temperature keeps its answers on track",
    )
    # of 20 at 0.7 one does not end, its 90th percentile does: still the lower temperature
    mostly = _at(0.7, [60] * 17 + [200, 300, 512])
    assert not mostly.rambles
    response, temperature = sizing.response_choices(worked, False, False, DRIFTS, mostly)
    assert (response.value, temperature.value) == (256, 0.7)  # 1.25 x 200 = 250 -> 256
    assert temperature.reason.endswith(
        "at 0.7: p90 200 tokens, 1 not ended by 512: a lower temperature keeps its answers on track"
    )


def test_a_model_that_drifts_at_the_lower_temperature_too_keeps_its_own_and_the_cap():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    still = _at(0.7, [40, 60, 70, 90, 100, 130, 200, 512])
    assert still.rambles
    (response,) = sizing.response_choices(worked, False, False, DRIFTS, still)
    alone = sizing.response_choice(worked, False, False, DRIFTS)
    assert response.value == alone.value == 512  # the cap, as without the second sampling
    assert response.reason == (
        f"{alone.reason}; at 0.7 too (p90 512 tokens, 1 not ended by 512): "
        "explorer.temperature kept at 1.0"
    )
    assert alone.reason.endswith(
        "the model runs on to the cap, so it gets the cap, to a power of two"
    )


def test_the_lower_temperature_is_tried_only_for_a_drifting_model_at_a_higher_one_not_given():
    worked = _data([20] * 90 + [41] * 9 + [60], [30] * 100)
    ends = _at(1.0, [30, 62, 80, 110, 145, 158, 200, 300])
    # its responses end: no second sampling, no temperature written
    assert not sizing.tries_calmer(ends, temperature_given=False)
    assert sizing.response_choices(worked, False, False, ends) == [
        sizing.response_choice(worked, False, False, ends)
    ]
    # even with a second sampling given, responses that end at 1.0 are sized by themselves
    calm = _at(0.7, [20] * 8)
    assert sizing.response_choices(worked, False, False, ends, calm) == [
        sizing.response_choice(worked, False, False, ends)
    ]
    # the user set the temperature: it is kept, sampled at, and sized by (the cap)
    assert not sizing.tries_calmer(DRIFTS, temperature_given=True)
    assert [c.field for c in sizing.response_choices(worked, False, False, DRIFTS)] == [
        "explorer.max_new_tokens"
    ]
    # already at (or below) the lower temperature; nothing sampled
    assert not sizing.tries_calmer(_at(0.7, [512] * 8), temperature_given=False)
    assert not sizing.tries_calmer(_at(0.5, [512] * 8), temperature_given=False)
    assert not sizing.tries_calmer(None, temperature_given=False)


def test_prompt_room_and_the_context_bound():
    data = _data([10] * 10, [40] * 9 + [90])
    p = sizing.prompt_choice(data, recipe=False, chat=True)
    assert p.value == 128 and "the longest of 10 prompts through the model's chat template is 90"
    assert sizing.prompt_choice(data, recipe=True, chat=True).value == 512
    r = Choice("explorer.max_new_tokens", 256, "x")
    assert sizing.fit_context(p, r, 0) is r and sizing.fit_context(p, r, 4096) is r
    cut = sizing.fit_context(p, r, 256)
    assert cut.value == 128 and "cut to the 128 the model's 256 positions leave" in cut.reason


def test_the_schedule_is_shorter_for_a_small_set():
    steps = _values(sizing.schedule_choices(_data([1], [1], total=40), batch=4))
    assert steps["trainer.max_steps"] == 30  # 3 epochs of 10 batches
    steps = _values(sizing.schedule_choices(_data([1], [1], total=7473), batch=16))
    assert steps["trainer.max_steps"] == 300


def test_all_weights_or_an_adapter_by_the_plan():
    assert sizing.tune(CPU, None, "auto")[0] is True
    lora, why = sizing.tune(GPU, 40 << 30, "auto")
    assert lora is False and "the plan needs 40.0 of 80 GiB (50%)" in why
    lora, why = sizing.tune(GPU, 70 << 30, "auto")
    assert lora is True and "over 80%" in why
    assert sizing.tune(Hardware(1, None, False, ""), None, "auto")[0] is True
    assert sizing.tune(CPU, None, "full") == (False, "--tune full")


def test_each_tiny_model_value_is_warned_of_and_recipe_values_are_not():
    model = ModelFacts("smollm2", 134_515_008, 8192, True)
    data = _data([28] * 512, [52] * 512)
    base = {"model": {"source": "path", "path": "m"}, "taskset": {"path": "t.parquet"}}
    tiny = from_dict({**base, "explorer": {"repeat_times": 2}})  # the defaults otherwise
    found = sizing.warnings(tiny, model, data, "grpo")
    assert [w.split(":")[0] for w in found] == [
        "explorer.max_new_tokens",
        "trainer.lr",
        "explorer.repeat_times",
    ]
    assert found[0] == (
        "explorer.max_new_tokens: 16 tokens would not hold the data's worked answers: 95% need "
        "up to 28 (the longest 28; 512 of 512 sampled are longer); init would write at least 256 "
        "(more where the model's own responses run longer)"
    )
    assert found[1].startswith("trainer.lr: 0.001 is 1,000x the usual 1e-06 for all weights")
    assert sizing.warnings(tiny, model, data, "reinforce_plus_plus")[2:] == []  # no groups
    sized = from_dict(
        {
            **base,
            "model": {**base["model"], "lora": {"enabled": True}},
            "explorer": {"max_new_tokens": 64},
            "taskset": {"path": "t.parquet", "max_prompt_tokens": 128},
        }
    )
    assert sizing.warnings(sized, model, data, "grpo") == []
    # the context, the prompts left out, float32 on a GPU
    crowded = from_dict(
        {
            **base,
            "model": {**base["model"], "lora": {"enabled": True}, "device": "cuda"},
            "explorer": {"max_new_tokens": 8192},
            "taskset": {"path": "t.parquet", "max_prompt_tokens": 32},
        }
    )
    found = sizing.warnings(crowded, model, data, "grpo")
    assert [w.split(":")[0] for w in found] == [
        "taskset.max_prompt_tokens + explorer.max_new_tokens",
        "taskset.max_prompt_tokens",
        "model.dtype",
    ]
    assert "leaves out 512 of 512 sampled prompts" in found[1]


def test_the_group_based_advantages_are_those_a_group_of_one_zeroes():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    inputs = AdvantageInputs(rewards, [1, 1, 1], torch.ones(3, 2))
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opmd"):
        zero = bool((ADVANTAGES[name](inputs, AlgorithmSpec()) == 0).all())
        assert zero == (name in sizing.GROUP_ADVANTAGES), name
