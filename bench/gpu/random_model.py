"""A random-init Hugging Face folder of a named model's shape, for measuring on a machine
with no model hub (the GPU machine has no network).

    python bench/gpu/random_model.py OUT --tokenizer FOLDER [--shape qwen2.5-1.5b] [--device cuda]

The weights are drawn by transformers' own initialisation (normal, std 0.02), in bfloat16,
saved as safetensors with the tokenizer files of FOLDER (e.g. SmolLM2's, 49,152 tokens).
The vocabulary is the tokenizer's: a model that samples an id its tokenizer cannot decode
would measure nothing real, so the embedding and output matrix are 49,152 rows instead of
Qwen2.5's 151,936 (1.39B parameters instead of 1.54B; every other dimension is Qwen2.5's).
Such a model answers noise and learns nothing useful: it is for time and memory only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/helpers, beside bench/

from tests.helpers.qwen_shape import QWEN2_5_1_5B

SHAPES = {
    # Qwen/Qwen2.5-1.5B-Instruct's config.json (the fields the planner reads, and the rest
    # of what makes its layers), the vocabulary aside: it is the tokenizer's
    "qwen2.5-1.5b": {
        **{k: v for k, v in QWEN2_5_1_5B.items() if k not in ("architectures", "vocab_size")},
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    started = time.perf_counter()
    tok_dir, out = Path(args.tokenizer), Path(args.out)
    vocab = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"])
    added = json.loads((tok_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    vocab = max([vocab - 1, *(t["id"] for t in added)]) + 1
    fields = dict(SHAPES[args.shape])
    fields.pop("torch_dtype", None)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=vocab, **fields)
    config.torch_dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "shape": args.shape,
                "params": params,
                "vocab": vocab,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
