"""Rollout log-probs equal the trainer's recomputation; EOS handling; versions; rewards."""

from __future__ import annotations

import pytest
import torch

from streamrft.consumers.batching import collate, response_logprobs
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.rewards import exact_match, get_reward, last_number
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas import ConfigError, Task, unpack_f32, unpack_i32, validate_group
from streamrft.sync.styles import required_version

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

MAX_NEW = 10
TEMPERATURE = 0.8
TASKS = [Task(id="a", prompt="3+5=", answer="8"), Task(id="b", prompt="12+30=", answer="42")]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32
    )
    model = build_tiny_model(cfg, tokenizer).eval()
    # A random model almost never says EOS. Give the output layer a bias towards it (weight
    # still tied to the embeddings) so that some rollouts stop early and others run to
    # max_new_tokens: both paths of padding are exercised, deterministically.
    head = torch.nn.Linear(cfg.hidden_size, len(tokenizer), bias=True)
    head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 1.5
    model.lm_head = head
    return TransformersEngine(model, tokenizer)


@pytest.fixture(scope="module")
def groups(engine):
    spec = RolloutSpec(
        repeat_times=6,
        temperature=TEMPERATURE,
        max_new_tokens=MAX_NEW,
        seed=1234,
        run="r",
        explorer="explorer-0",
        model_version=0,
    )
    return get_workflow("math")(engine, TASKS, exact_match, spec)


# -- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_round_trips_text_with_spaces(tokenizer):
    text = "1 + 2 = 3"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text)  # one token per character
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.unk_token_id not in ids
    assert tokenizer("1~2").input_ids[2] == tokenizer.unk_token_id  # "~" is not in the charset


# -- rollouts --------------------------------------------------------------------------------


def test_rollout_groups_prompts_without_padding(engine, tokenizer):
    batches = engine.rollout(
        [tokenizer(t.prompt).input_ids for t in TASKS],
        n=3,
        temperature=1.0,
        max_new_tokens=4,
        seed=0,
    )
    assert [len(b) for b in batches] == [3, 3]
    for task, rollouts in zip(TASKS, batches, strict=True):
        for r in rollouts:
            # the left padding of the shorter prompt is not part of its prompt ids
            assert r.prompt_ids == tokenizer(task.prompt).input_ids
            assert len(r.response_ids) == len(r.logprobs)
            assert 1 <= len(r.response_ids) <= 4
    assert len(batches[0][0].prompt_ids) == 5
    assert len(batches[1][0].prompt_ids) == 7


def test_rollout_is_reproducible_for_a_seed(engine, tokenizer):
    prompt = [tokenizer("3+5=").input_ids]
    first = engine.rollout(prompt, 2, 1.0, 6, seed=7)
    again = engine.rollout(prompt, 2, 1.0, 6, seed=7)
    assert [r.response_ids for r in first[0]] == [r.response_ids for r in again[0]]


def test_completions_end_at_the_first_eos(groups, tokenizer):
    eos = tokenizer.eos_token_id
    ended = 0
    for g in groups:
        validate_group(g)
        for exp in g.experiences:
            response = unpack_i32(exp.tokens)[exp.prompt_length :]
            assert 1 <= len(response) <= MAX_NEW
            assert eos not in response[:-1]  # nothing after the first EOS
            if response[-1] == eos:
                ended += 1
            else:
                assert len(response) == MAX_NEW  # no EOS: only the length limit stops it
            assert len(unpack_f32(exp.logprobs)) == len(response)
            assert list(exp.action_mask) == [1] * len(response)
    # the fixture's EOS bias makes both kinds of rollout occur
    total = sum(len(g.experiences) for g in groups)
    assert 0 < ended < total


def test_rewards_and_versions_are_stamped(groups):
    assert [g.task_id for g in groups] == ["a", "b"]
    for g, task in zip(groups, TASKS, strict=True):
        assert g.id == f"r/{task.id}@0"  # the same whichever explorer explored it
        for i, exp in enumerate(g.experiences):
            assert exp.id == f"{g.id}#{i}"
            assert exp.model_version == 0
            assert exp.reward == exact_match(exp.response_text, task)[0]
            assert exp.info["response_length"] == exp.response_length


def test_recomputed_logprobs_match_recorded(engine, groups, tokenizer):
    experiences = [e for g in groups for e in g.experiences]
    batch = collate(experiences, tokenizer.pad_token_id)
    lengths = [e.response_length for e in experiences]
    assert batch.prompt_width == 7  # the longer prompt "12+30=" with BOS
    assert batch.response_ids.shape == (len(experiences), max(lengths))
    assert len(set(lengths)) > 1  # responses of different lengths, so right padding is used

    for i, exp in enumerate(experiences):
        n = exp.response_length
        assert batch.response_mask[i].tolist() == [1.0] * n + [0.0] * (max(lengths) - n)
        assert batch.response_ids[i, n:].eq(tokenizer.pad_token_id).all()
        assert batch.attention_mask[i, batch.prompt_width + n :].eq(0).all()
        assert batch.attention_mask[i].sum().item() == exp.num_tokens
    torch.testing.assert_close(batch.rewards, torch.tensor([e.reward for e in experiences]))

    with torch.no_grad():
        recomputed = response_logprobs(
            engine.model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_width,
            temperature=TEMPERATURE,
        )
    mask = batch.response_mask.bool()
    assert (batch.old_logprobs[mask] < 0).all()  # real log-probs, not zeros
    diff = (recomputed - batch.old_logprobs)[mask].abs().max().item()
    assert diff < 1e-4

    # the comparison is sensitive: the wrong temperature does not match
    with torch.no_grad():
        other = response_logprobs(
            engine.model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature=1.0
        )
    assert (other - batch.old_logprobs)[mask].abs().max().item() > 1e-2


def test_the_step_reports_the_rollout_mismatch_of_same_version_tokens(engine, groups, tokenizer):
    """The trainer's recomputation against the rollout's log-probs, on trained tokens
    sampled with the version the model holds: ~0 here (one engine, one model); a group of
    an older version is left out; a skewed rollout log-prob shows in the mean and max."""
    import copy

    import msgspec

    from streamrft.consumers.algorithms import policy_step, resolve_algorithm
    from streamrft.infra.config import Config, TrainerConfig
    from streamrft.schemas import pack_f32

    old = msgspec.structs.replace(groups[0], model_version=2)
    old = msgspec.structs.replace(
        old,
        experiences=[
            msgspec.structs.replace(
                e, model_version=2, logprobs=pack_f32([x - 3.0 for x in unpack_f32(e.logprobs)])
            )
            for e in old.experiences
        ],
    )
    model = copy.deepcopy(engine.model)
    cfg = TrainerConfig(lr=1e-6, ppo_epochs=1)
    algo = resolve_algorithm(Config(trainer=cfg))  # grpo
    fresh_tokens = sum(e.response_length for e in groups[1].experiences)

    def step(batch_groups):
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        return policy_step(
            model, opt, batch_groups, cfg, algo, tokenizer.pad_token_id, TEMPERATURE, None, 0
        )

    values = step([old, groups[1]])  # group 1 was sampled with version 0, the model's
    assert values["train/rollout_logprob_diff_tokens"] == fresh_tokens
    assert values["train/rollout_logprob_diff_max"] < 1e-4
    assert values["train/rollout_logprob_diff_mean"] <= values["train/rollout_logprob_diff_max"]
    assert values["train/logprob_max_abs_diff"] > 2.9  # the version-2 group, all tokens

    skewed = msgspec.structs.replace(
        groups[1],
        experiences=[
            msgspec.structs.replace(e, logprobs=pack_f32([x - 0.5 for x in unpack_f32(e.logprobs)]))
            for e in groups[1].experiences
        ],
    )
    model.load_state_dict(engine.model.state_dict())
    values = step([skewed])
    assert abs(values["train/rollout_logprob_diff_mean"] - 0.5) < 1e-3
    assert abs(values["train/rollout_logprob_diff_max"] - 0.5) < 1e-3
    values = step([old])  # no token of the model's version: only the count
    assert values["train/rollout_logprob_diff_tokens"] == 0
    assert "train/rollout_logprob_diff_mean" not in values


# -- versions and rewards --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interval", "offset", "expected"),
    [
        (1, 0, [0, 1, 2, 3, 4, 5, 6]),  # strictly on-policy
        (1, 1, [0, 0, 1, 2, 3, 4, 5]),  # one step off
        (2, 1, [0, 0, 0, 2, 2, 4, 4]),
        (2, 0, [0, 0, 2, 2, 4, 4, 6]),
        (3, 2, [0, 0, 0, 0, 0, 3, 3]),
    ],
)
def test_required_version_table(interval, offset, expected):
    assert [required_version(step, interval, offset) for step in range(7)] == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("8", "8", 1.0),
        (" 8 \n", "8", 1.0),
        ("8", " 8", 1.0),
        ("80", "8", 0.0),
        ("8.0", "8", 0.0),  # exact, not numeric
        ("", "8", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, answer, reward):
    value, info = exact_match(response, Task(id="t", prompt="p", answer=answer))
    assert value == reward
    assert info == {"correct": reward}


@pytest.mark.parametrize(
    ("response", "answer", "reward", "has_number"),
    [
        ("the answer is 42", "42", 1.0, 1.0),
        ("3 then 42", "42", 1.0, 1.0),
        ("42 then 3", "42", 0.0, 1.0),  # the last number counts
        ("42.0", "42", 1.0, 1.0),  # numeric comparison
        ("x=-7", "-7", 1.0, 1.0),
        ("2.5", "2.50", 1.0, 1.0),
        ("no digits", "1", 0.0, 0.0),
        ("12", "twelve", 0.0, 1.0),  # a non-numeric answer never matches
    ],
)
def test_last_number(response, answer, reward, has_number):
    value, info = last_number(response, Task(id="t", prompt="p", answer=answer))
    assert value == reward
    assert info == {"correct": reward, "has_number": has_number}


def test_get_reward():
    assert get_reward("exact_match") is exact_match
    assert get_reward("last_number") is last_number
    with pytest.raises(ConfigError, match=r"^explorer\.reward: unknown reward 'nope'"):
        get_reward("nope")
