"""A tiny, randomly initialised Qwen2 causal LM and byte-level BPE tokenizer, built offline for tests and CI.

Everything here is deterministic and needs no network: the tokenizer is trained on an embedded corpus and the
model weights come from a seeded initialisation. The head dimension is fixed at 64 so that vLLM's CPU attention
backend can serve the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

__all__ = [
    "CHAT_TEMPLATE",
    "CORPUS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TinyModelConfig",
    "build_tiny_model",
    "build_tokenizer",
    "tiny_qwen2_config",
    "load_tiny_model",
    "save_tiny_model",
]

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MARKER_FILE = "tslightning_tiny.json"
# Bump when the corpus, tokenizer recipe or model recipe changes, so cached checkpoints are rebuilt.
_FORMAT_VERSION = 1
_HEAD_DIM = 64
_VOCAB_MULTIPLE = 64
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS: tuple[str, ...] = tuple(
    json.loads(line)
    for line in resources.files(__package__).joinpath("tokenizer_corpus.jsonl").read_text(encoding="ascii").split("\n")
    if line
)
"""The tokenizer's training text: shell commands, numbers and chat turns, one JSON string per line (package data)."""


@dataclass
class TinyModelConfig:
    """Shape and seed of the tiny Qwen2 model and its tokenizer."""

    vocab_size: int = 512
    """Target BPE vocabulary size. The trained tokenizer may stop below it; the model's vocabulary is
    ``len(tokenizer)`` rounded up to a multiple of 64."""

    hidden_size: int = 128
    """Width of the residual stream; must equal ``64 * num_attention_heads``."""

    num_attention_heads: int = 2
    """Number of query heads."""

    num_key_value_heads: int = 1
    """Number of key/value heads (grouped-query attention); must divide ``num_attention_heads``."""

    num_hidden_layers: int = 2
    """Number of decoder layers."""

    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""

    max_position_embeddings: int = 4096
    """Maximum sequence length the rotary embeddings are configured for."""

    tie_word_embeddings: bool = True
    """Share the input embedding matrix with the LM head."""

    seed: int = 0
    """Seed of the weight initialisation."""

    def __post_init__(self) -> None:
        """Validate the shape constraints.

        Raises:
            ValueError: If a field is out of range or the head dimension is not 64.
        """
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyModelConfig.{name} must be >= 1, got {getattr(self, name)}.")
        min_vocab = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size < min_vocab:
            raise ValueError(
                f"TinyModelConfig.vocab_size must be >= {min_vocab} (256 byte tokens + {len(SPECIAL_TOKENS)} special "
                f"tokens), got {self.vocab_size}."
            )
        if self.hidden_size != _HEAD_DIM * self.num_attention_heads:
            raise ValueError(
                f"TinyModelConfig.hidden_size / num_attention_heads must be {_HEAD_DIM} (vLLM's CPU attention needs "
                f"head dim {_HEAD_DIM}), got hidden_size={self.hidden_size}, num_attention_heads="
                f"{self.num_attention_heads}; set hidden_size={_HEAD_DIM * self.num_attention_heads} or "
                f"num_attention_heads=hidden_size // {_HEAD_DIM}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyModelConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})."
            )


def build_tokenizer(vocab_size: int = 512) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the embedded corpus.

    The pipeline (NFC normalizer, Qwen2 split regex, byte-level BPE) is exactly the one ``Qwen2Tokenizer`` rebuilds
    on load, since ``AutoTokenizer`` always picks that class for a ``qwen2`` checkpoint; the saved tokenizer thus
    behaves identically to this one. Every string is encodable, NFC-normalised text round-trips exactly through
    encode and decode, and training is deterministic: equal ``vocab_size`` gives equal vocabularies.

    Args:
        vocab_size: Target vocabulary size, special tokens included. Training may stop below it when the corpus runs
            out of merges.

    Returns:
        A fast tokenizer with a ChatML chat template, ``eos_token="<|im_end|>"`` and ``pad_token="<|endoftext|>"``
        (also the nominal ``unk_token``, as ``Qwen2Tokenizer`` sets it; byte-level BPE never emits it).
    """
    tokenizer = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer, length=len(CORPUS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=TinyModelConfig.max_position_embeddings,
    )


def tiny_qwen2_config(
    config: TinyModelConfig, tokenizer: transformers.PreTrainedTokenizerBase
) -> transformers.Qwen2Config:
    """The Hugging Face config of the tiny model of ``config`` sized for ``tokenizer`` (no weights built)."""
    vocab_size = -(-len(tokenizer) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    # Qwen2 has no BOS token in its tokenizer but uses <|endoftext|> as the config's bos id.
    bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id
    hf_config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        max_window_layers=config.num_hidden_layers,
        tie_word_embeddings=config.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    return hf_config


def build_tiny_model(
    config: TinyModelConfig, tokenizer: transformers.PreTrainedTokenizerBase
) -> transformers.Qwen2ForCausalLM:
    """Build a randomly initialised Qwen2 causal LM sized for ``tokenizer``.

    The weights depend only on ``config`` and ``len(tokenizer)``: the global torch RNG state and default dtype are
    neither used nor changed.

    Args:
        config: Model shape and seed.
        tokenizer: Tokenizer from :func:`build_tokenizer`; the model's vocabulary covers it and its special token ids
            become the model's bos/eos/pad ids.

    Returns:
        A float32 model in eval mode.
    """
    hf_config = tiny_qwen2_config(config, tokenizer)
    bos_token_id = hf_config.bos_token_id
    default_dtype = torch.get_default_dtype()
    # Initialising in another default dtype would draw different weights for the same seed.
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = transformers.Qwen2ForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.bos_token_id = bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def _marker(config: TinyModelConfig) -> dict[str, Any]:
    return {"format_version": _FORMAT_VERSION, "config": dataclasses.asdict(config)}


def _read_marker(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def save_tiny_model(path: str | os.PathLike[str], config: TinyModelConfig | None = None) -> pathlib.Path:
    """Build the tokenizer and model and save both (safetensors) into ``path``.

    The write is atomic: everything goes into a temporary directory beside ``path`` that is then renamed. It is also
    idempotent: if ``path`` already holds a checkpoint saved with the same config, nothing is rebuilt. A checkpoint
    saved with a different config is replaced.

    Args:
        path: Target directory.
        config: Model shape and seed; defaults to ``TinyModelConfig()``.

    Returns:
        ``path`` as a :class:`pathlib.Path`.

    Raises:
        FileExistsError: If ``path`` exists and is neither empty nor a checkpoint written by this function.
    """
    config = config if config is not None else TinyModelConfig()
    path = pathlib.Path(path)
    marker = _marker(config)
    if _read_marker(path) == marker:
        return path
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and _read_marker(path) is None)):
        raise FileExistsError(f"{path} exists and is not a tiny model checkpoint; refusing to overwrite it.")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tokenizer = build_tokenizer(config.vocab_size)
        model = build_tiny_model(config, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if path.exists():
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            # Lost a race with a concurrent writer: keep its checkpoint if it matches.
            if _read_marker(path) != marker:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tiny_model(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load a checkpoint written by :func:`save_tiny_model` from local disk.

    Args:
        path: Checkpoint directory.
        dtype: Dtype of the loaded weights.

    Returns:
        The model (in eval mode) and its tokenizer.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer
