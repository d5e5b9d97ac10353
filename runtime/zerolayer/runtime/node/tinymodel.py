"""Generate a tiny Llama-style model for running the real engine on a CPU.

Random weights and a byte-level BPE tokenizer trained here on text that ships with
Python itself, so nothing is downloaded. The output is a normal Hugging Face model
folder (``config.json``, ``model.safetensors``, ``tokenizer.json`` with a chat
template) that vLLM loads like any other. Random weights produce noise: use it to test
structure (token counts, finish reasons), never text.

    python -m zerolayer.runtime.node.tinymodel .models/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

DEFAULT_DIR = ".models/tiny-llama"

# A Llama-3-like template: roles in headers, an end-of-turn token vLLM stops on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|sep|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|eot|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|start|>", "<|sep|>", "<|eot|>"]


def _training_text() -> list[str]:
    """Docstrings and comments of the standard library: plenty of English, always present."""
    import sysconfig

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for path in sorted(stdlib.glob("*.py"))[:120]:
        try:
            lines.extend(path.read_text(encoding="utf-8", errors="ignore").splitlines())
        except OSError:
            continue
    return lines


def build_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eot|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|start|>", "<|sep|>", "<|eos|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def generate(out_dir: str | pathlib.Path = DEFAULT_DIR, *, vocab_size: int = 2048, layers: int = 2,
             hidden: int = 128, heads: int = 4, max_positions: int = 2048, seed: int = 0,
             init_std: float = 0.02) -> pathlib.Path:
    """Write the model folder and return its path. Idempotent: an existing model is kept.

    ``init_std`` is the weights' standard deviation. At the default (Llama's 0.02) the layers barely
    change the residual stream, so with tied embeddings greedy decoding repeats the prompt's last
    token whatever the seed; a larger one (0.5) gives a model whose greedy output depends on its
    weights, for tests that must tell two models apart."""
    out = pathlib.Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,  # head size = hidden / heads = 32, vLLM's CPU attention minimum
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=init_std,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def generate_lora(base_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, rank: int = 8,
                  scale: float = 0.5, seed: int = 1) -> pathlib.Path:
    """Write a LoRA adapter for the tiny model at ``base_dir`` (PEFT layout: ``adapter_config.json``,
    ``adapter_model.safetensors``) with random A and B matrices on ``q_proj`` and ``v_proj``, so
    greedy output under the adapter differs from the base model's. Idempotent."""
    out = pathlib.Path(out_dir)
    if (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file

    config = json.loads((pathlib.Path(base_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    rng = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=rng) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=rng) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": pathlib.Path(base_dir).name}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    print(generate(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
