"""The tiny dummy-weight Llama that `replay --engine vllm` serves by default, written as files. Runs in: frontend process.

vLLM loads it with `--load-format dummy` (random weights), so only its shape and its
tokenizer are files: config.json, and a word-level tokenizer in the `tokenizers`
package's format (tokenizer.json) with transformers' fast-tokenizer config beside it.
The words are exactly kvdrain's text prompt words (replay/openai/tokenizer.py): word
`w<N>` is token N for N < vocab_size, split on whitespace, so `--prompt-format text`
and `ids` send the same token ids. The special tokens come after the words: transformers
matches added special tokens inside words, so a special token placed among the words
(say as id 1) would split `w17` into pieces. No post-processor: no BOS is added, and the
engine sees exactly the ids kvdrain synthesised. The shape: 2 layers, hidden 256,
4 heads of 64, bf16; it serves in well under a minute on two CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_WORDS = 512  # kvdrain's tiny preset's vocabulary: prompts are drawn from it
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids NUM_WORDS, NUM_WORDS + 1, NUM_WORDS + 2
SERVED_NAME = "kvdrain/tiny"
MAX_POSITIONS = 4096


def model_config(num_words: int = NUM_WORDS) -> dict:
    """config.json of a 2-layer LlamaForCausalLM over num_words words and the specials."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": num_words + len(SPECIAL_TOKENS),
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "unk_token_id": num_words,
        "bos_token_id": num_words + 1,
        "eos_token_id": num_words + 2,
    }


def tokenizer_json(num_words: int = NUM_WORDS) -> dict:
    """tokenizer.json: WordLevel over `w0 ... w<num_words - 1>`, the specials after them."""
    vocab = {f"w{i}": i for i in range(num_words)}
    vocab.update({token: num_words + i for i, token in enumerate(SPECIAL_TOKENS)})
    added = [
        {
            "id": num_words + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": SPECIAL_TOKENS[0]},
    }


def tokenizer_config() -> dict:
    """tokenizer_config.json: transformers' fast tokenizer over tokenizer.json."""
    unk, bos, eos = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": unk,
        "bos_token": bos,
        "eos_token": eos,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }


def write_tiny_model(directory: Path, num_words: int = NUM_WORDS) -> Path:
    """The model's files in directory (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    unk, bos, eos = SPECIAL_TOKENS
    files = {
        "config.json": model_config(num_words),
        "tokenizer.json": tokenizer_json(num_words),
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {"unk_token": unk, "bos_token": bos, "eos_token": eos},
        "generation_config.json": {"bos_token_id": num_words + 1, "eos_token_id": num_words + 2},
    }
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=1) + "\n")
    return directory
