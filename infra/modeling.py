"""Build or load the policy model and its tokenizer.

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


def load_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The model (float32, eval mode) and tokenizer named by ``cfg``."""
    if cfg.source == "tiny":
        tokenizer = build_char_tokenizer(cfg.charset)
        model = build_tiny_model(cfg, tokenizer)
    elif cfg.source == "path":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
            # safetensors only: a pickled pytorch_model.bin is refused, never unpickled
            model = AutoModelForCausalLM.from_pretrained(
                cfg.path, local_files_only=True, torch_dtype=torch.float32, use_safetensors=True
            )
        except OSError as exc:
            raise ConfigError(f"model.path: cannot load a model from {cfg.path!r}: {exc}") from exc
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:  # guarded by config validation
        raise ConfigError(f"model.source: unknown source {cfg.source!r}")
    model.eval()
    return model, tokenizer


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
