"""The converters' tables (``app/convert_trinity.py``, ``app/convert_verl.py``): each key
a Trinity-RFT or verl user has in a config becomes the right streamrft field and value, a
default that differs is written with both defaults said, a key with no counterpart is
listed with its reason, and what they make is a config streamrft loads.

The source configs here are written in those frameworks' formats for these tests (a
Trinity-RFT YAML's keys; a verl Hydra command line and the shell script around one)."""

from __future__ import annotations

import pytest

from streamrft.app import convert_trinity, convert_verl
from streamrft.app.conversion import Conversion
from streamrft.infra.config import from_dict

pytestmark = pytest.mark.unit

TRINITY = {
    "project": "math-rft",
    "name": "qwen-gsm8k",
    "checkpoint_root_dir": "/ckpt",
    "mode": "both",
    "algorithm": {
        "algorithm_type": "grpo",
        "repeat_times": 8,
        "optimizer": {
            "lr": "1e-6",  # as PyYAML reads it: text
            "lr_warmup_steps": -1,
            "lr_warmup_steps_ratio": 0.05,
            "lr_scheduler_type": "cosine",
            "min_lr_ratio": 0.1,
            "weight_decay": 0.05,
            "betas": [0.9, 0.95],
            "clip_grad": 0.5,
        },
    },
    "model": {"model_path": "/models/qwen", "max_prompt_tokens": 256, "max_response_tokens": 1024},
    "cluster": {"node_num": 1, "gpu_per_node": 4},
    "buffer": {
        "total_epochs": 2,
        "batch_size": 64,
        "total_steps": 300,
        "explorer_input": {
            "taskset": {
                "name": "gsm8k",
                "path": "/data/gsm8k",
                "subset_name": "main",
                "split": "train",
                "format": {"prompt_key": "question", "response_key": "answer"},
                "rollout_args": {"temperature": 0.9},
            },
            "eval_tasksets": [
                {
                    "name": "gsm8k-test",
                    "path": "/data/gsm8k",
                    "subset_name": "main",
                    "split": "test",
                },
                {"name": "math500", "path": "/data/math500", "split": "test"},
            ],
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_boxed_reward",
        },
    },
    "explorer": {
        "eval_interval": 20,
        "rollout_model": {"engine_type": "vllm", "engine_num": 2, "tensor_parallel_size": 1},
    },
    "trainer": {"save_interval": 50, "max_checkpoints_to_keep": 5},
    "synchronizer": {"sync_method": "memory", "sync_style": "explorer_driven", "sync_interval": 2},
    "monitor": {"monitor_type": "wandb"},
}


def trinity(data: dict) -> Conversion:
    conv = convert_trinity.convert(data, {})
    from_dict(conv.tree())  # loads: every field known, every rule between fields kept
    return conv


def test_each_trinity_key_becomes_its_field():
    f = trinity(TRINITY).fields
    assert (f["model.path"], f["model.source"]) == ("/models/qwen", "path")
    assert (f["explorer.max_new_tokens"], f["taskset.max_prompt_tokens"]) == (1024, 256)
    assert f["trainer.lr"] == 1e-6 and isinstance(f["trainer.lr"], float)
    assert (f["trainer.lr_schedule"], f["trainer.lr_warmup_ratio"]) == ("cosine", 0.05)
    assert (f["trainer.min_lr_ratio"], f["trainer.weight_decay"]) == (0.1, 0.05)
    assert (f["trainer.betas"], f["trainer.grad_clip"]) == ([0.9, 0.95], 0.5)
    assert f["trainer.lr_warmup_steps"] == 0  # -1: the ratio decides
    assert (f["taskset.prompt_key"], f["taskset.answer_key"]) == ("question", "answer")
    assert f["taskset.path"] == "/data/gsm8k/main"  # the subset's folder
    assert f["taskset.answer_extract"] == "gsm8k"  # the path names GSM8K
    assert f["explorer.temperature"] == 0.9
    assert (f["taskset.workflow"], f["explorer.reward"]) == ("math", "math_answer")
    assert (f["algorithm.type"], f["explorer.repeat_times"]) == ("grpo", 8)
    assert (f["trainer.batch_size"], f["explorer.batch_size"]) == (64, 64)
    assert (f["taskset.total_epochs"], f["trainer.max_steps"]) == (2, 300)
    assert (f["explorer.engine"], f["explorer.count"], f["explorer.tensor_parallel_size"]) == (
        "vllm", 2, 1
    )  # fmt: skip
    assert (f["trainer.save_interval"], f["trainer.keep_checkpoints"]) == (50, 5)
    assert f["eval.interval"] == 20
    assert f["monitor.exporters"] == ["wandb"]
    assert f["monitor.wandb"] == {"project": "math-rft", "mode": "online"}
    # checkpoint_root_dir/project/name is the job's folder: run.dir/<run id>
    assert (f["run.dir"], f["run.name"], f["run.id"]) == (
        "/ckpt/math-rft",
        "qwen-gsm8k",
        "qwen-gsm8k",
    )


def test_trinity_eval_tasksets_as_a_list():
    conv = trinity(TRINITY)
    assert conv.fields["eval.path"] == "/data/gsm8k/main"
    assert conv.eval_split == "test"  # the writer takes the folder's file of it
    assert "eval.path takes one set" in conv.unmapped["buffer.explorer_input.eval_tasksets[1]"]


def test_trinity_cluster_places_the_engines_first_and_the_trainer_on_the_rest():
    f = trinity(TRINITY).fields
    assert f["model.device"] == "cuda"
    assert f["explorer.devices"] == ["cuda:0", "cuda:1"]  # 2 engines of 1 GPU
    assert (f["trainer.nproc"], f["trainer.devices"]) == (2, ["cuda:2", "cuda:3"])
    wide = {**TRINITY, "explorer": {"rollout_model": {"engine_num": 1, "tensor_parallel_size": 2,
                                                      "engine_type": "vllm"}}}  # fmt: skip
    f = trinity(wide).fields
    assert (f["explorer.devices"], f["trainer.devices"]) == (["cuda:0"], ["cuda:2", "cuda:3"])


def test_trinity_colocate_shares_one_gpu():
    data = {**TRINITY, "mode": "colocate"}
    del data["cluster"]
    data["explorer"] = {"rollout_model": {"engine_type": "vllm", "gpu_memory_utilization": 0.9}}
    conv = trinity(data)
    f = conv.fields
    assert f["model.device"] == "cuda" and "explorer.devices" not in f
    assert (f["explorer.gpu_memory_utilization"], f["trainer.gpu_memory_fraction"]) == (0.25, 0.55)
    assert any("share the one GPU" in n for n in conv.notes)


@pytest.mark.parametrize(
    ("method", "ours"),
    [("memory", "auto"), ("checkpoint", "filesystem"), ("nccl", "nccl"), ("offline", "filesystem")],
)
def test_trinity_sync_methods(method, ours):
    conv = trinity({**TRINITY, "synchronizer": {"sync_method": method}})
    assert conv.fields["synchronizer.method"] == ours
    if method == "memory":  # across nodes: never same-host shared memory alone
        why = conv.reason_text()["synchronizer.method"]
        assert "object store for those on other hosts" in why


@pytest.mark.parametrize(
    ("style", "ours"),
    [
        ("fixed", "fixed"),
        ("explorer_driven", "dynamic_by_explorer"),
        ("trainer_driven", "dynamic_by_trainer"),
        ("EXPLORER_DRIVEN", "dynamic_by_explorer"),  # Trinity-RFT's enums ignore case
        ("dynamic_by_explorer", "dynamic_by_explorer"),  # its older names
        ("dynamic_by_trainer", "dynamic_by_trainer"),
    ],
)
def test_trinity_sync_styles(style, ours):
    assert (
        trinity({**TRINITY, "synchronizer": {"sync_style": style}}).fields["synchronizer.style"]
        == ours
    )


def test_trinity_defaults_that_differ_are_written_with_both_said():
    data = {**TRINITY, "algorithm": {"algorithm_type": "grpo", "repeat_times": 4}}
    data["synchronizer"] = {"sync_method": "nccl"}
    conv = trinity(data)
    f, why = conv.fields, conv.reason_text()
    assert f["synchronizer.sync_offset"] == 1
    assert (
        "Trinity-RFT's default is 0, streamrft's is 1: set to 0 to match"
        in why["synchronizer.sync_offset"]
    )
    assert f["synchronizer.sync_timeout"] == 300.0
    assert (
        "Trinity-RFT's default is 3600, streamrft's is 300: set to 3600"
        in why["synchronizer.sync_timeout"]
    )
    assert f["trainer.weight_decay"] == 0.0
    assert "default is 0.01, streamrft's is 0: set to 0.01 to match" in why["trainer.weight_decay"]
    assert "default is 0.01, streamrft's is 0" in why["trainer.min_lr_ratio"]
    # the learning rate: streamrft's default is the tiny model's, so Trinity-RFT's is taken
    assert f["trainer.lr"] == 1e-6 and "1e-06 written" in why["trainer.lr"]
    # Trinity-RFT's grpo adds a KL loss streamrft's preset has not
    assert f["algorithm.kl_loss_coef"] == 0.0
    assert "set kl_loss_fn: k2 and kl_loss_coef: 0.001 to match" in why["algorithm.kl_loss_coef"]
    # no sync_offset here: a given one is taken as it is
    given = trinity({**TRINITY, "synchronizer": {"sync_offset": 0, "sync_timeout": 3600}})
    assert given.fields["synchronizer.sync_offset"] == 0
    assert "default is" not in given.reason_text()["synchronizer.sync_offset"]


def test_trinity_unknown_keys_have_no_counterpart():
    data = {**TRINITY, "trainer": {"save_interval": 10, "frobnicate": 3}}
    data["service"] = {"data_juicer": {"auto_start": True}}
    conv = trinity(data)
    assert conv.unmapped["trainer.frobnicate"] == "3: no counterpart in streamrft"
    assert conv.unmapped["service.data_juicer.auto_start"].startswith("true: no outside")
    assert "trainer.frobnicate" not in str(conv.tree())
    bad = trinity({**TRINITY, "synchronizer": {"sync_style": "sometimes"}})
    assert "sometimes has no counterpart" in bad.unmapped["synchronizer.sync_style"]
    assert "synchronizer.style" not in bad.fields


def test_trinity_lengths_from_max_model_len_and_continuing():
    data = {**TRINITY, "model": {"model_path": "/m", "max_model_len": 2048,
                                 "max_response_tokens": 1536}}  # fmt: skip
    data["continue_from_checkpoint"] = False
    conv = trinity(data)
    assert (conv.fields["explorer.max_new_tokens"], conv.fields["taskset.max_prompt_tokens"]) == (
        1536, 512
    )  # fmt: skip
    assert "run.id" not in conv.fields  # a new id each run, as Trinity-RFT renames the job
    only_len = trinity({**TRINITY, "model": {"model_path": "/m", "max_model_len": 1024}})
    assert only_len.fields["explorer.max_new_tokens"] == 512  # half, as Trinity-RFT splits it


def test_trinity_interpolations_and_lora():
    data = {
        **TRINITY,
        "model": {
            "model_path": "${oc.env:MODEL_PATH,/default/model}",
            "max_response_tokens": 64,
            "lora_configs": [{"name": "lora", "lora_rank": 16}],
        },
    }
    conv = convert_trinity.convert(data, {"MODEL_PATH": "/from/env"})
    assert conv.fields["model.path"] == "/from/env"
    assert conv.fields["model.lora"] == {"enabled": True, "rank": 16, "alpha": 32.0}
    assert convert_trinity.convert(data, {}).fields["model.path"] == "/default/model"


VERL_SCRIPT = r"""set -x
# GRPO on GSM8K, written for this test in verl's command-line form
gsm8k_train=$HOME/data/gsm8k/train.parquet
gsm8k_test=$HOME/data/gsm8k/test.parquet

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$gsm8k_train \
    data.val_files="['$gsm8k_test']" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_epochs=2 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.002 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0.001 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.temperature=0.8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    algorithm.use_kl_in_reward=False \
    trainer.logger='["console","tensorboard"]' \
    trainer.project_name='gsm8k' \
    trainer.experiment_name='qwen_grpo' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=25 \
    trainer.test_freq=10 \
    trainer.total_epochs=3 \
    trainer.frobnicate=yes $@
"""


def verl(text: str, env: dict | None = None) -> Conversion:
    conv = convert_verl.convert(convert_verl.parse_overrides(text, env or {"HOME": "/home/me"}))
    from_dict(conv.tree())
    return conv


def test_verl_script_is_read_as_the_shell_reads_it():
    o = convert_verl.parse_overrides(VERL_SCRIPT, {"HOME": "/home/me"})
    assert o["data.train_files"] == "/home/me/data/gsm8k/train.parquet"
    assert o["data.val_files"] == "['/home/me/data/gsm8k/test.parquet']"  # '' inside "": text
    assert o["trainer.logger"] == '["console","tensorboard"]'
    assert "gsm8k_train" not in o and "python3" not in str(o)
    assert convert_verl.parse_overrides("a.b='$X' c.d=\"$X\" e.f=${X} +g.h=2 ~i.j", {"X": "1"}) == {
        "a.b": "$X", "c.d": "1", "e.f": "1", "g.h": "2"
    }  # fmt: skip
    one_a_line = "data.train_batch_size=8\n# a comment\nactor_rollout_ref.rollout.n=4\n"
    assert convert_verl.parse_overrides(one_a_line, {}) == {
        "data.train_batch_size": "8", "actor_rollout_ref.rollout.n": "4"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-6", 1e-6), ("256", 256), ("0.5", 0.5), ("True", True), ("false", False),
     ("null", None), ("['a', 'b']", ["a", "b"]), ("vllm", "vllm"), ("-1", -1)],
)  # fmt: skip
def test_hydra_values(text, value):
    got = convert_verl.hydra_value(text)
    assert got == value and type(got) is type(value)


def test_each_verl_key_becomes_its_field():
    conv = verl(VERL_SCRIPT)
    f = conv.fields
    assert f["taskset.path"] == "/home/me/data/gsm8k/train.parquet"
    assert f["eval.path"] == "/home/me/data/gsm8k/test.parquet"
    # verl's rows: the chat in `prompt`, the answer in reward_model.ground_truth
    assert (f["taskset.messages_key"], f["taskset.answer_key"]) == (
        "prompt", "reward_model.ground_truth"
    )  # fmt: skip
    assert (f["taskset.max_prompt_tokens"], f["explorer.max_new_tokens"]) == (512, 1024)
    assert (f["trainer.batch_size"], f["explorer.batch_size"]) == (256, 256)
    assert (f["model.path"], f["model.source"]) == ("Qwen/Qwen2.5-1.5B-Instruct", "path")
    assert (f["trainer.lr"], f["trainer.mini_batch_size"], f["trainer.ppo_epochs"]) == (1e-6, 64, 2)
    assert (f["algorithm.kl_loss_fn"], f["algorithm.kl_loss_coef"]) == ("low_var_kl", 0.002)
    # use_kl_in_reward off: no KL penalty, as streamrft's grpo has none
    assert (
        "algorithm.kl_penalty_coef" not in f and "algorithm.use_kl_in_reward" not in conv.unmapped
    )
    assert f["algorithm.entropy_coef"] == 0.001
    assert (f["algorithm.clip_low"], f["algorithm.clip_high"]) == (0.2, 0.28)
    assert f["algorithm.loss_agg_mode"] == "seq-mean-token-mean"
    assert (f["explorer.repeat_times"], f["explorer.engine"], f["explorer.temperature"]) == (
        8, "vllm", 0.8
    )  # fmt: skip
    assert f["explorer.tensor_parallel_size"] == 1
    assert f["algorithm.type"] == "grpo"
    assert (f["taskset.total_epochs"], f["trainer.save_interval"], f["eval.interval"]) == (
        3,
        25,
        10,
    )
    assert f["model.device"] == "cuda"
    # one GPU: vLLM and the trainer hold their memory side by side
    assert (f["explorer.gpu_memory_utilization"], f["trainer.gpu_memory_fraction"]) == (0.35, 0.55)
    assert f["monitor.exporters"] == ["tensorboard"]
    assert (f["run.name"], f["run.id"], f["run.dir"]) == (
        "qwen_grpo",
        "qwen_grpo",
        "checkpoints/gsm8k",
    )
    assert f["trainer.max_steps"] == 0  # the epochs decide, as in verl
    assert conv.unmapped["trainer.frobnicate"] == "yes: no counterpart in streamrft"


def test_verl_clip_ratio_and_kl_in_reward_and_several_files():
    conv = verl(
        "data.train_files=\"['/d/gsm8k/train.parquet','/d/math/train.parquet']\" "
        "actor_rollout_ref.actor.clip_ratio=0.3 algorithm.use_kl_in_reward=True "
        "algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.01 algorithm.adv_estimator=gae "
        "trainer.test_freq=-1 trainer.save_freq=-1 trainer.n_gpus_per_node=8 trainer.nnodes=2"
    )
    f = conv.fields
    assert [s["path"] for s in f["taskset.sources"]] == [
        "/d/gsm8k/train.parquet",
        "/d/math/train.parquet",
    ]
    assert (f["algorithm.clip_low"], f["algorithm.clip_high"]) == (0.3, 0.3)
    assert (f["algorithm.kl_penalty_fn"], f["algorithm.kl_penalty_coef"]) == ("k1", 0.01)
    assert f["algorithm.type"] == "ppo"  # gae: PPO with its critic
    assert (f["eval.in_trainer"], f["trainer.save_interval"]) == (False, 0)
    assert "hybrid engine" in conv.unmapped["trainer.n_gpus_per_node"]
    assert "trainer.rdzv" in conv.unmapped["trainer.nnodes"]


def test_verl_defaults_that_differ_are_written_with_both_said():
    conv = verl("data.train_files=/d/train.parquet actor_rollout_ref.model.path=/m")
    f, why = conv.fields, conv.reason_text()
    assert f["trainer.weight_decay"] == 0.0
    assert (
        "verl's default is 0.01, streamrft's is 0: set to 0.01 to match"
        in why["trainer.weight_decay"]
    )
    assert f["explorer.repeat_times"] == 8  # verl's 1 cannot be: a group of one compares nothing
    assert "verl's default is 1, streamrft's is 8" in why["explorer.repeat_times"]
    assert (f["trainer.lr"], f["explorer.max_new_tokens"]) == (1e-6, 512)  # taken: tiny's are not
    assert f["algorithm.type"] == "grpo" and "verl's default is gae" in why["algorithm.type"]
    assert "verl's default is 30, streamrft's is 1" in why["taskset.total_epochs"]
    assert "min_lr_ratio" not in str(why)  # the same default (0) is not said


def test_style_aliases_are_read_by_the_config():
    cfg = from_dict({"taskset": {"path": "x.jsonl"}, "synchronizer": {"style": "explorer_driven"}})
    assert cfg.synchronizer.style == "dynamic_by_explorer"
    cfg = from_dict({"taskset": {"path": "x.jsonl"}, "synchronizer": {"style": "trainer_driven"}})
    assert cfg.synchronizer.style == "dynamic_by_trainer"


def test_one_field_named_by_both_keys_is_the_chat_or_the_prompt(tmp_path):
    import json

    from streamrft.infra.config import TasksetConfig
    from streamrft.infra.taskset import read_taskset

    path = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}},
        {"prompt": "4+4?", "reward_model": {"ground_truth": "8"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = TasksetConfig(path=str(path), messages_key="prompt", answer_key="reward_model.ground_truth")
    chat, text = read_taskset(str(path), t)
    assert (chat.prompt, chat.messages[0].content, chat.answer) == ("", "2+3?", "5")
    assert (text.prompt, text.messages, text.answer) == ("4+4?", [], "8")
