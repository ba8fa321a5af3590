"""A model folder with Qwen2.5-1.5B-Instruct's shape and no weights: what ``streamrft
validate`` and ``plan`` need of the GSM8K recipes' model, made locally (nothing is
downloaded). The shape is Qwen2.5-1.5B-Instruct's ``config.json``; the tokenizer is the
tiny character tokenizer with a chat template, so prompts render and count."""

from __future__ import annotations

import json
import struct
from pathlib import Path

QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
"""The fields of Qwen2.5-1.5B-Instruct's config.json the planner reads."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_qwen_shaped(folder: Path) -> Path:
    """The folder: config.json, a tokenizer, and a safetensors file without tensors."""
    from streamrft.infra.modeling import build_char_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    header = b"{}" + b" " * 6
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder
