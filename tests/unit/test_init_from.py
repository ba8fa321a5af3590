"""``streamrft init --from-trinity FILE`` and ``--from-verl``: a Trinity-RFT config and a
verl command line, written here in those frameworks' formats around a model folder and
data made here, become a streamrft config whose every field says where it came from, with
the keys that have no counterpart listed in it; ``streamrft validate`` passes on it."""

from __future__ import annotations

import pytest

from streamrft.app.cli import main
from streamrft.infra.config import load_config
from tests.helpers.gsm8k_shape import TEST_FILE, write_hub_folder
from tests.helpers.model_folders import write_tiny_folder

pytestmark = pytest.mark.unit

TRINITY_YAML = """\
project: rft-test
name: tiny-gsm8k
checkpoint_root_dir: {root}/checkpoints
mode: both
algorithm:
  algorithm_type: grpo
  repeat_times: 4
  optimizer:
    lr: 1e-5
model:
  model_path: {model}
  max_prompt_tokens: 24
  max_response_tokens: 24
cluster:
  node_num: 1
  gpu_per_node: 2
buffer:
  total_epochs: 1
  batch_size: 8
  explorer_input:
    taskset:
      name: gsm8k
      storage_type: file
      path: {data}
      subset_name: main
      split: train
      format:
        prompt_key: question
        response_key: answer
      rollout_args:
        temperature: 1.0
    eval_tasksets:
    - name: gsm8k-eval
      storage_type: file
      path: {data}
      subset_name: main
      split: test
      format:
        prompt_key: question
        response_key: answer
    default_workflow_type: math_workflow
  trainer_input:
    experience_buffer:
      name: gsm8k_buffer
      storage_type: queue
explorer:
  eval_interval: 10
  rollout_model:
    engine_type: vllm
    engine_num: 1
    tensor_parallel_size: 1
    enforce_eager: true
synchronizer:
  sync_method: memory
  sync_style: explorer_driven
  sync_interval: 1
trainer:
  save_interval: 20
  max_checkpoints_to_keep: 2
  ulysses_sequence_parallel_size: 1
monitor:
  monitor_type: tensorboard
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("from")
    return root, write_tiny_folder(root / "tiny-model"), write_hub_folder(root / "gsm8k")


def test_a_trinity_config_converts_and_validates(made, tmp_path, capsys):
    root, model, data = made
    source = tmp_path / "trinity.yaml"
    source.write_text(TRINITY_YAML.format(root=root, model=model, data=data))
    out = tmp_path / "converted.yaml"
    assert main(["init", "--from-trinity", str(source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "explorer.rollout_model.enforce_eager: true: a vLLM option" in printed
    assert "taskset       ok: 100 tasks" in printed and "eval set      ok: 10 tasks" in printed
    cfg = load_config(out)
    assert (cfg.model.path, cfg.model.source) == (str(model), "path")
    assert cfg.taskset.path == str(data / "main") and cfg.taskset.answer_extract == "gsm8k"
    assert cfg.eval.path == str(data / "main" / TEST_FILE)  # the folder's test split
    assert (cfg.synchronizer.method, cfg.synchronizer.style) == ("auto", "dynamic_by_explorer")
    assert (cfg.explorer.max_new_tokens, cfg.taskset.max_prompt_tokens) == (24, 24)
    assert (cfg.trainer.lr, cfg.explorer.repeat_times, cfg.trainer.batch_size) == (1e-5, 4, 8)
    assert (cfg.explorer.devices, cfg.trainer.device) == (["cuda:0"], "cuda:1")
    text = out.read_text()
    assert "# init: Trinity-RFT's `synchronizer.sync_method: memory`" in text
    assert (
        "# init: `synchronizer.sync_offset` not set: Trinity-RFT's default is 0, streamrft's is\n"
        "  # 1: set to 0 to match"
    ) in text
    assert "\n  sync_offset: 1\n" in text
    block = text.split("keys with no streamrft counterpart (not converted):")[1]
    assert "buffer.trainer_input.experience_buffer.storage_type: queue" in block
    assert main(["validate", str(out)]) == 0
    assert "config ok" in capsys.readouterr().out


def _verl_parquet(path):
    """Rows in the layout verl's GSM8K preprocessing writes: the chat in ``prompt``, the
    answer in ``reward_model.ground_truth``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate((a, b) for a in range(6) for b in range(5))
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("as_file", [False, True])
def test_a_verl_command_line_converts_and_validates(made, tmp_path, capsys, as_file):
    _root, model, _data = made
    train = _verl_parquet(tmp_path / "train.parquet")
    test = _verl_parquet(tmp_path / "test.parquet")
    line = (
        f"algorithm.adv_estimator=grpo data.train_files={train} data.val_files={test} "
        "data.train_batch_size=8 data.max_prompt_length=24 data.max_response_length=24 "
        f"actor_rollout_ref.model.path={model} actor_rollout_ref.actor.optim.lr=1e-5 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.use_kl_loss=True "
        "actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl "
        "actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.name=hf "
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1 "
        "trainer.logger='[\"console\"]' trainer.project_name=p trainer.experiment_name=e "
        "trainer.total_epochs=1 trainer.save_freq=10 trainer.test_freq=5 trainer.device=cpu "
        "trainer.balance_batch=True"
    )
    given = line
    if as_file:  # the shell script that runs verl, its lines continued
        script = tmp_path / "run.sh"
        script.write_text(
            "set -x\npython3 -m verl.trainer.main_ppo \\\n    "
            + line.replace(" ", " \\\n    ")
            + " $@\n"
        )
        given = str(script)
    out = tmp_path / "verl.yaml"
    assert main(["init", "--from-verl", given, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "trainer.balance_batch: true: no counterpart in streamrft" in printed
    assert "taskset       ok: 30 tasks" in printed
    cfg = load_config(out)
    t = cfg.taskset
    assert (t.path, t.messages_key, t.answer_key) == (
        str(train),
        "prompt",
        "reward_model.ground_truth",
    )
    assert (cfg.algorithm.kl_loss_fn, cfg.algorithm.kl_loss_coef) == ("low_var_kl", 0.001)
    assert (cfg.explorer.engine, cfg.explorer.repeat_times, cfg.trainer.mini_batch_size) == (
        "transformers", 4, 4
    )  # fmt: skip
    assert (cfg.model.device, cfg.run.id, cfg.eval.interval) == ("cpu", "e", 5)
    said = " ".join(line.strip(" #") for line in out.read_text().splitlines())  # unwrapped
    assert "verl's default is 0.01, streamrft's is 0: set to 0.01 to match" in said
    assert main(["validate", str(out)]) == 0
