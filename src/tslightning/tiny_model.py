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

CORPUS: tuple[str, ...] = (
    "ls",
    "ls -la",
    "ls -l /tmp",
    "ls -lh data/",
    "ls -R src | head -n 20",
    "pwd",
    "cd /workspace && ls",
    "cd .. && pwd",
    "cat file.txt",
    "cat README.md",
    "cat notes.txt | wc -l",
    "cat -n main.py",
    "head -n 5 data.csv",
    "head -n 10 log.txt",
    "tail -n 20 server.log",
    "tail -f app.log",
    "grep -n foo file.txt",
    "grep -rn TODO src/",
    "grep -c error log.txt",
    "grep -i warning output.log",
    "grep -v '^#' config.ini",
    "grep -E '[0-9]+' numbers.txt",
    "grep -o 'id=[0-9]*' access.log | sort | uniq -c",
    "echo hello",
    "echo 'hello world'",
    "echo $HOME",
    "echo $PATH",
    "echo 42 > answer.txt",
    "echo 'done' >> log.txt",
    "wc -l file.txt",
    "wc -w essay.txt",
    "wc -c data.bin",
    "sort names.txt",
    "sort -n numbers.txt | tail -n 1",
    "sort -u words.txt > unique.txt",
    "uniq -c sorted.txt",
    "cut -d, -f2 data.csv",
    "cut -d: -f1 /etc/passwd",
    "tr 'a-z' 'A-Z' < input.txt",
    "tr -d '\\r' < dos.txt > unix.txt",
    "sed 's/foo/bar/g' file.txt",
    "sed -n '2,4p' file.txt",
    "sed -i 's/old/new/' config.txt",
    "sed '/^$/d' notes.txt",
    "awk '{print $1}' file.txt",
    "awk -F, '{sum += $3} END {print sum}' data.csv",
    "awk 'NR==3' lines.txt",
    "awk '{ print NF }' table.txt",
    "python3 -c 'print(1 + 1)'",
    'python3 -c "import sys; print(sys.version)"',
    "python3 -c 'print(sum(range(10)))'",
    "python3 script.py --input data.json",
    "python3 -m pytest -q",
    "python3 -m json.tool data.json",
    "find . -name '*.py'",
    "find /tmp -type f -size +1M",
    "find . -name '*.txt' | xargs wc -l",
    "mkdir -p out/results",
    "touch empty.txt",
    "cp file.txt backup.txt",
    "mv old.txt new.txt",
    "rm -f tmp.txt",
    "rm -rf build/",
    "chmod +x run.sh",
    "du -sh .",
    "df -h",
    "date",
    "whoami",
    "env | grep PATH",
    "diff a.txt b.txt",
    "tar -czf archive.tar.gz src/",
    "tar -xzf archive.tar.gz",
    "git status",
    "git log --oneline -n 5",
    "git diff HEAD~1",
    "jq '.items | length' data.json",
    "curl -s http://localhost:8000/health",
    "seq 1 10",
    "seq 1 10 | paste -sd+ | bc",
    "printf '%s\\n' a b c",
    "xargs -n 1 echo < list.txt",
    "nl poem.txt",
    "rev word.txt",
    "base64 secret.txt",
    "md5sum file.txt",
    "sha256sum data.bin",
    "stat -c %s file.txt",
    "basename /path/to/file.txt",
    "dirname /path/to/file.txt",
    "which python3",
    "exit",
    "Count the number of lines in file.txt.",
    "How many words are in essay.txt?",
    "Print the first three lines of data.csv.",
    "Find all lines containing the word error in log.txt.",
    "Replace every occurrence of foo with bar in file.txt.",
    "Sort the names in names.txt alphabetically and print them.",
    "What is the sum of the numbers in numbers.txt?",
    "Print the largest number in numbers.txt.",
    "List all Python files in the current directory.",
    "Create a file called hello.txt containing the text hello world.",
    "Delete all empty lines from notes.txt.",
    "Convert the contents of input.txt to uppercase.",
    "Print the second column of data.csv.",
    "Count how many times the word the appears in story.txt.",
    "Reverse the order of lines in list.txt.",
    "Print the number of unique words in words.txt.",
    "Extract the email addresses from contacts.txt.",
    "Compute the average of the third column in scores.csv.",
    "Show the last ten lines of server.log.",
    "Find the longest line in file.txt and print its length.",
    "Rename report.txt to final_report.txt.",
    "Check whether config.ini contains the key timeout.",
    "Print the size of data.bin in bytes.",
    "Merge a.txt and b.txt into combined.txt.",
    "Remove duplicate lines from words.txt while keeping the order.",
    "Print lines 2 through 4 of file.txt.",
    "Count the files in the src directory.",
    "Print the current working directory.",
    "Use the shell to answer the question, then give the final answer.",
    "Answer with a single number.",
    "When you are done, reply with the final answer only.",
    "You can run shell commands. Each command's output will be shown to you.",
    "Solve the task step by step using the available tools.",
    "Read the file and summarise it in one sentence.",
    "Fix the typo in the first line of notes.txt.",
    "Write the result to answer.txt.",
    "Find the line that starts with ERROR and print the message after it.",
    "Print every line that contains a number.",
    "Print the total of all numbers in the file.",
    "Tell me how many lines end with a question mark.",
    "total 12",
    "drwxr-xr-x 2 user user 4096 Jan  1 12:00 .",
    "drwxr-xr-x 5 user user 4096 Jan  1 11:59 ..",
    "-rw-r--r-- 1 user user  120 Jan  1 12:00 file.txt",
    "-rw-r--r-- 1 user user 2048 Feb 14 09:30 data.csv",
    "-rwxr-xr-x 1 user user  311 Mar  3 17:45 run.sh",
    "42 file.txt",
    "17 essay.txt",
    "3 numbers.txt",
    "  12 apple",
    "   7 banana",
    "   1 cherry",
    "hello world",
    "HELLO WORLD",
    "/home/user",
    "/workspace",
    "1:foo = 1",
    "3:print(foo)",
    "12:    return foo",
    "src/main.py:10:# TODO: handle errors",
    "src/utils.py:4:# TODO: add tests",
    "ERROR: file not found",
    "Error: permission denied",
    "WARNING: disk almost full",
    "INFO: server started on port 8000",
    "bash: foo: command not found",
    "cat: missing.txt: No such file or directory",
    "grep: data: Is a directory",
    "Traceback (most recent call last):",
    '  File "<string>", line 1, in <module>',
    "ZeroDivisionError: division by zero",
    "NameError: name 'x' is not defined",
    "SyntaxError: invalid syntax",
    "KeyError: 'name'",
    "ValueError: invalid literal for int() with base 10: 'abc'",
    "Python 3.11.4",
    "name,age,city",
    "alice,30,Paris",
    "bob,25,London",
    "carol,35,Berlin",
    "dave,41,Tokyo",
    "id,score",
    "1,88",
    "2,93",
    "3,71",
    '{"status": "ok", "count": 3}',
    '{"items": [1, 2, 3], "total": 6}',
    "[1, 2, 3, 4, 5]",
    "True",
    "False",
    "None",
    "4.0K\t.",
    "Filesystem      Size  Used Avail Use% Mounted on",
    "overlay          64G   12G   52G  19% /",
    "exit code: 0",
    "exit code: 1",
    "(no output)",
    "3c59dc048e8850243be8079a5c74d079  file.txt",
    "1 passed in 0.02s",
    "2 failed, 5 passed in 1.31s",
    "On branch main",
    "nothing to commit, working tree clean",
    "Hello! How can I help you today?",
    "Hi there.",
    "Thank you very much.",
    "You're welcome.",
    "Sure, let me check the file first.",
    "I will count the lines with wc.",
    "Let me look at the contents of the directory.",
    "The file has 42 lines.",
    "The answer is 7.",
    "The final answer is 12.",
    "I could not find that file. Let me list the directory.",
    "The command failed, so I will try a different approach.",
    "Here is the result of the command.",
    "That looks correct.",
    "Is there anything else you need?",
    "Please run the tests again.",
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Can you explain what this script does?",
    "This script reads a file and prints every line in reverse order.",
    "I think the error is caused by a missing file.",
    "First, I will read the file. Then I will count the words.",
    "The output shows three matching lines.",
    "There are no errors in the log.",
    "Good morning! What would you like to do?",
    "Let's try that again with the correct path.",
    "Great, the task is complete.",
    "I'm sorry, I made a mistake in the previous step.",
    "Could you tell me more about the problem?",
    "The numbers add up to 55.",
    "The largest value is 93, in the second row.",
    "Yes.",
    "No.",
    "Maybe later.",
    "OK, done.",
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "To be, or not to be, that is the question.",
    "All models are wrong, but some are useful.",
    "The weather today is sunny with a light breeze.",
    "She opened the door and walked into the quiet room.",
    "We should write a test before changing the code.",
    "Reading and writing files is a common task.",
    "Every line in the file ends with a newline character.",
    "0 1 2 3 4 5 6 7 8 9",
    "10 20 30 40 50 60 70 80 90 100",
    "11 12 13 14 15 16 17 18 19",
    "123456789",
    "3.14159",
    "2.71828",
    "1 + 1 = 2",
    "2 * 3 = 6",
    "10 / 4 = 2.5",
    "7 - 9 = -2",
    "2024-01-01",
    "12:34:56",
    "v1.2.3",
    "0x1f",
    "1e-6",
    "100%",
    "#1 #2 #3",
    "$ 19.99",
    "port 8080",
    "line 1\nline 2\nline 3",
    "a\tb\tc",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nCount the lines in file.txt.<|im_end|>\n",
    "<|im_start|>assistant\nwc -l file.txt<|im_end|>\n",
    "<|im_start|>user\n42 file.txt<|im_end|>\n",
    "<|im_start|>assistant\nThe file has 42 lines.<|im_end|>\n",
    "<|endoftext|>",
)


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
