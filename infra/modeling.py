"""Build or load the policy model and its tokenizer, on its device in its dtype.

Two sources, chosen by ``model.source``:

- ``tiny``: a small Llama-architecture model built from a config with a character-level
  tokenizer made locally; nothing is downloaded. Deterministic for a given seed, so the
  trainer and every explorer build the same architecture and tokenizer independently.
- ``path``: a Hugging Face folder on local disk (``model.path``).

Llama, not Qwen2: with ``model_type: qwen2`` transformers swaps in a byte-level
pre-tokenizer that drops spaces from a character vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from streamrft.schemas.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from streamrft.infra.config import ModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
DEFAULT_CHARSET = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_char_tokenizer(charset: str = DEFAULT_CHARSET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``charset``.

    A BPE model with no merges splits any string into its characters; unknown characters
    map to ``<unk>``. Decoding fuses the characters back without separators.
    """
    chars = list(dict.fromkeys(charset))
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=False))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )


def build_tiny_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` -> torch dtype."""


def resolve_device(spec: str, field: str = "model.device") -> torch.device:
    """The torch device ``spec`` names (``auto``: the GPU when torch sees one).

    A GPU asked for but absent is a :class:`ConfigError` naming ``field`` (the setting that
    chose ``spec``), never a silent fall-back to CPU.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{field}: {spec!r} but torch sees no GPU (torch {torch.__version__}); "
                "use cpu or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{field}: {spec!r} but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without any)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer of the model ``cfg`` names (left padding; the EOS token pads where
    the tokenizer has no pad token), without loading the model."""
    if cfg.source == "tiny":
        return build_char_tokenizer(cfg.charset)
    if cfg.source != "path":  # guarded by config validation
        raise ConfigError(f"model.source: unknown source {cfg.source!r}")
    from transformers import AutoTokenizer

    if not Path(str(cfg.path)).is_dir():  # else the hub's "Repo id must be in the form ..."
        raise ConfigError(
            f"model.path: {cfg.path!r} is not a folder: give a local Hugging Face model "
            "folder (config.json, a tokenizer, *.safetensors); nothing is downloaded"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
    except OSError as exc:
        raise ConfigError(f"model.path: cannot load a tokenizer from {cfg.path!r}: {exc}") from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    cfg: ModelConfig, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The model (eval mode, on ``model.device``) and tokenizer named by ``cfg``.

    ``dtype``: the parameters' dtype; ``model.dtype`` when None (an explorer). The trainer
    passes float32: its master weights stay float32 whatever it computes in.
    """
    device = resolve_device(cfg.device)
    dtype = dtype or DTYPES[cfg.dtype]
    tokenizer = load_tokenizer(cfg)
    if cfg.source == "tiny":
        model = build_tiny_model(cfg, tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        try:
            # safetensors only: a pickled pytorch_model.bin is refused, never unpickled
            model = AutoModelForCausalLM.from_pretrained(
                cfg.path, local_files_only=True, dtype=dtype, use_safetensors=True
            )
        except OSError as exc:
            raise ConfigError(f"model.path: cannot load a model from {cfg.path!r}: {exc}") from exc
    model.to(device=device)
    cast_parameters(model, dtype)
    model.eval()
    return model, tokenizer


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters (floating) to ``dtype`` in place; buffers keep theirs. ``model.to(dtype)``
    would also round the rotary embedding's float32 ``inv_freq`` to bf16, and positions
    would then be encoded differently from the trainer (float32 master) and vLLM."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def save_policy(model: PreTrainedModel, tokenizer, out_dir: str | Path) -> Path:
    """Write ``model`` (safetensors) and ``tokenizer`` as a Hugging Face folder.

    The folder loads back with ``load_policy(ModelConfig(source="path", path=out_dir))``
    or ``AutoModelForCausalLM.from_pretrained(out_dir)``. Returns the folder.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
