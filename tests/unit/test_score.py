"""Bench mode's parts: the pass@k estimator, correct-sample counts, and a checkpoint's
weights loaded into a fresh model (full and LoRA)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from streamrft.consumers.checkpoint import CheckpointError, load_weights, save_checkpoint
from streamrft.consumers.checkpoint_folders import checkpoints
from streamrft.consumers.state import TrainerState
from streamrft.infra.config import LoraConfig, ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import SimulatedEngine
from streamrft.producers.evaluation import correct_counts, is_correct
from streamrft.producers.pass_at_k import mean_pass_at_k, pass_at_k
from streamrft.schemas.experience import Task
from streamrft.sync.lora import attach_lora
from streamrft.sync.weights import unique_state_dict

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

TINY = ModelConfig(
    hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_positions=16
)
LORA = LoraConfig(enabled=True, rank=2, target_modules=("q_proj", "v_proj"))


# -- pass@k ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # 1 - 3/5
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c < k: any 4 of 5 hold a correct one
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_ratio_of_binomials_and_grows_with_k():
    for n in range(1, 13):
        for c in range(n + 1):
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            for k, value in enumerate(values, start=1):
                assert value == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
            assert values == sorted(values)  # pass@k >= pass@(k-1) from the same samples
            assert values[0] == pytest.approx(c / n)  # pass@1: the fraction correct


def test_mean_pass_at_k_averages_over_tasks():
    assert mean_pass_at_k([2, 0, 5], 5, 1) == pytest.approx((0.4 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k([2, 0], 5, 2) == pytest.approx(0.35)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 4, 1)


# -- correct samples -------------------------------------------------------------------------
def test_is_correct_prefers_the_rewards_own_verdict():
    assert is_correct(1.0, {}) and not is_correct(0.5, {})
    assert not is_correct(1.1, {"correct": 0.0})  # a format bonus alone is not correct
    assert is_correct(0.9, {"correct": 1.0})


def test_correct_counts_scores_n_samples_per_task_reproducibly():
    """Every task gets exactly ``n`` samples scored (across engine calls of ``batch``
    sequences), the counts follow the reward, and the same seed draws the same samples."""
    tokenizer = build_char_tokenizer()
    engine = SimulatedEngine(torch.nn.Linear(1, 1), tokenizer)
    tasks = [Task(id=f"t{i}", prompt=f"{i}+1=", answer="") for i in range(7)]
    scored: list[str] = []

    def first_is_digit(text: str, task: Task) -> tuple[float, dict[str, float]]:
        scored.append(task.id)
        return float(text[:1].isdigit()), {}

    counts = correct_counts(engine, tasks, first_is_digit, 6, 1.0, 3, seed=11, batch=12)
    assert sorted(scored) == sorted(t.id for t in tasks for _ in range(6))
    assert len(counts) == len(tasks) and all(0 <= c <= 6 for c in counts)
    assert 0 < sum(counts) < 6 * len(tasks)  # ~10 of 75 ordinary characters are digits
    assert correct_counts(engine, tasks, first_is_digit, 6, 1.0, 3, seed=11, batch=12) == counts
    always = correct_counts(engine, tasks, lambda text, task: (1.0, {}), 4, 1.0, 3, seed=0)
    assert always == [4] * len(tasks)


# -- a checkpoint's weights into a fresh model -----------------------------------------------
def _tiny(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(msgspec.structs.replace(TINY, seed=seed), build_char_tokenizer())


def _save(root, model: torch.nn.Module, step: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    save_checkpoint(root, TrainerState(step=step, version=step + 1), model, opt, keep=0)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = unique_state_dict(a), unique_state_dict(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_weights_restores_a_full_checkpoint_and_lists_them_in_step_order(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoints(root) == []
    first, second = _tiny(seed=1), _tiny(seed=2)
    _save(root, first, 10)
    _save(root, second, 3)  # an older step saved later: order is by step, latest says 3
    assert [step for step, _ in checkpoints(root)] == [3, 10]
    fresh = _tiny(seed=0)
    state = load_weights(root / "step_00000010", fresh)
    assert (state.step, state.version) == (10, 11)
    assert _same(fresh, first) and not _same(fresh, second)


def test_load_weights_restores_a_lora_checkpoint_into_a_wrapped_model(tmp_path):
    """A LoRA run checkpoints the wrapped model (warmed-up base and adapter): both come back
    into a freshly wrapped model, whose own random adapter is replaced."""
    torch.manual_seed(0)
    trained = attach_lora(_tiny(seed=1), LORA)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_()
    _save(tmp_path, trained, 4)
    torch.manual_seed(1)
    fresh = attach_lora(_tiny(seed=0), LORA)
    assert not _same(fresh, trained)
    load_weights(tmp_path / "step_00000004", fresh)
    assert _same(fresh, trained)


def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(tmp_path):
    torch.manual_seed(0)
    _save(tmp_path, attach_lora(_tiny(seed=1), LORA), 4)
    plain = _tiny(seed=0)
    before = {k: v.clone() for k, v in unique_state_dict(plain).items()}
    with pytest.raises(CheckpointError, match=r"model\.lora"):
        load_weights(tmp_path / "step_00000004", plain)
    assert all(torch.equal(before[k], v) for k, v in unique_state_dict(plain).items())
    with pytest.raises(CheckpointError):
        load_weights(tmp_path / "step_00000099", plain)


# -- scoring: one engine, every checkpoint through its weight hook ---------------------------
def formatted_but_wrong(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """What ``math_answer_format`` gives a model that always marks a wrong answer."""
    return 0.1, {"correct": 0.0, "format": 1.0}


def right_on_even_tasks(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """A 0/1 reward without a ``correct`` entry: right on half the tasks."""
    return float(int(task.id.removeprefix("t")) % 2 == 0), {}


def _bench_config(tmp_path, reward: str):
    from streamrft.infra.config import from_dict

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(f'{{"id": "t{i}", "prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(6))
    )
    return from_dict(
        {
            "run": {"dir": str(tmp_path / "runs"), "id": "r"},
            "model": msgspec.to_builtins(TINY),
            "taskset": {"path": str(tasks)},
            "explorer": {"reward": reward, "max_new_tokens": 3, "threads": 1},
        }
    )


@pytest.mark.parametrize(
    ("reward", "greedy_reward", "greedy_accuracy"),
    [("formatted_but_wrong", 0.1, 0.0), ("right_on_even_tasks", 0.5, 0.5)],
)
def test_bench_reports_the_greedy_mean_reward_and_the_greedy_accuracy(
    tmp_path, reward, greedy_reward, greedy_accuracy
):
    """A model that always formats but is always wrong scores 0.1 by mean reward (the
    trainer's ``eval/accuracy``) and 0 by accuracy (``is_correct``, as pass@k)."""
    from streamrft.app.score import CheckpointScorer

    cfg = _bench_config(tmp_path, f"{__name__}:{reward}")
    _save(tmp_path / "ckpt", _tiny(seed=1), 5)
    entry = CheckpointScorer(cfg).score(tmp_path / "ckpt" / "step_00000005", k=2, n=2)
    assert entry.greedy_reward == pytest.approx(greedy_reward)
    assert entry.greedy_accuracy == greedy_accuracy == entry.pass_at_1 == entry.pass_at_k
    assert entry.metrics()["bench/greedy_reward"] == entry.greedy_reward
    assert entry.metrics()["bench/greedy_accuracy"] == entry.greedy_accuracy


def test_the_scorer_builds_one_engine_and_pushes_each_checkpoint_into_it(tmp_path):
    """Checkpoints go into the engine built before the first one (the transformers engine:
    its model, in place); the greedy reward is the trainer's evaluator's on those weights."""
    from streamrft.app.score import CheckpointScorer
    from streamrft.producers.evaluation import GreedyEvaluator

    cfg = _bench_config(tmp_path, "exact_match")
    first, second = _tiny(seed=1), _tiny(seed=2)
    _save(tmp_path / "ckpt", first, 1)
    _save(tmp_path / "ckpt", second, 2)
    scorer = CheckpointScorer(cfg)
    engine = scorer.engine
    for step, trained in ((1, first), (2, second), (1, first)):
        entry = scorer.score(tmp_path / "ckpt" / f"step_{step:08d}", k=1, n=1)
        assert (entry.step, entry.version) == (step, step + 1)
        assert scorer.engine is engine and _same(engine.model, trained)
        trainer_eval = GreedyEvaluator(cfg)(trained, engine.tokenizer)["eval/accuracy"]
        assert entry.greedy_reward == trainer_eval


# -- which folder vLLM starts from (no vLLM needed) -------------------------------------------
@pytest.fixture
def loaded(tmp_path):
    """A tiny model written as a Hugging Face folder and loaded back (``model.source: path``)."""
    from streamrft.infra.modeling import load_policy, save_policy

    folder = save_policy(_tiny(seed=1), build_char_tokenizer(), tmp_path / "base")
    model, tokenizer = load_policy(ModelConfig(source="path", path=str(folder)))
    return folder, model, tokenizer


def _folder_weights(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()


def test_vllm_reuses_the_loaded_folder_only_while_it_holds_the_models_weights(loaded, tmp_path):
    """Untouched, the model's own folder is reused; with a checkpoint applied (what bench did
    before building vLLM) the folder is stale, and the current weights are written."""
    from streamrft.producers.engines.vllm_engine import model_folder

    folder, model, tokenizer = loaded
    assert model_folder(model, tokenizer, tmp_path / "scratch-1") == folder
    _save(tmp_path / "ckpt", _tiny(seed=2), 3)
    load_weights(tmp_path / "ckpt" / "step_00000003", model)
    written = model_folder(model, tokenizer, tmp_path / "scratch-2")
    assert written == tmp_path / "scratch-2"
    stored = _folder_weights(written)
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items())


def test_vllm_gets_a_lora_models_base_unmerged(loaded, tmp_path):
    """vLLM applies the adapter per request: its folder holds the base weights alone,
    whatever the adapter holds (merged in, the adapter would count twice)."""
    from streamrft.producers.engines.vllm_engine import base_weights, model_folder

    folder, model, tokenizer = loaded
    torch.manual_seed(0)
    peft = attach_lora(model, LORA)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_()
    assert model_folder(peft, tokenizer, tmp_path / "scratch-1") == folder  # base untouched
    with torch.no_grad():
        peft.get_base_model().model.embed_tokens.weight.add_(1.0)  # the base changed
    written = model_folder(peft, tokenizer, tmp_path / "scratch-2")
    assert written == tmp_path / "scratch-2"
    stored, base = _folder_weights(written), dict(base_weights(peft))
    assert stored.keys() == base.keys()
    assert all(torch.equal(stored[k], v) for k, v in base.items())
    assert any(".lora_" in name for name in peft.state_dict())  # the model kept its adapter


# -- the command's bad input: a clear error, exit 2, before any model or broker ------------
@pytest.fixture
def one_checkpoint_run(tmp_path):
    """A config, and a run ``r1`` under it holding one checkpoint (step 3)."""
    from tests.helpers.configs import write_config

    config = write_config(
        tmp_path, {"run": {"dir": str(tmp_path / "runs")}, "taskset": {"path": "data/tasks.jsonl"}}
    )
    _save(tmp_path / "runs" / "r1" / "checkpoints", _tiny(), 3)
    (tmp_path / "runs" / "empty").mkdir()
    return config


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--run-id", "r9"], "run r9: no folder"),
        (["--run-id", "empty"], "run empty: no checkpoint in"),
        (["--run-id", "r1", "--checkpoint", "best"], "expected latest, all or a step number"),
        (["--run-id", "r1", "--checkpoint", "7"], "no checkpoint of step 7; it has steps [3]"),
        (["--run-id", "r1", "--k", "4", "--samples", "2"], "needs at least --k (4) samples"),
        (["--run-id", "r1", "--engine", "vllmm"], "explorer.engine: unknown engine 'vllmm'"),
        ([], "--run-id is required"),
    ],
)
def test_bad_bench_input_is_a_clear_error(one_checkpoint_run, capsys, flags, message):
    from streamrft.app.cli import main

    assert main(["score", str(one_checkpoint_run), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
