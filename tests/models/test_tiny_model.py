"""Tests for the offline tiny Qwen2 model and tokenizer."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import unicodedata

import pytest
import torch
import transformers

from tslightning.models import tiny_model
from tslightning.models.tiny_model import (
    EOS_TOKEN,
    PAD_TOKEN,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    load_tiny_model,
    save_tiny_model,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer()


def _backend_state(tok: transformers.PreTrainedTokenizerBase) -> dict:
    state = json.loads(tok.backend_tokenizer.to_str())
    model = state["model"]
    return {
        "normalizer": state["normalizer"],
        "pre_tokenizer": state["pre_tokenizer"],
        "decoder": state["decoder"],
        "post_processor": state["post_processor"],
        "added_tokens": state["added_tokens"],
        "model": (model["type"], model["vocab"], model["merges"], model["byte_fallback"], model["unk_token"]),
    }


def test_tokenizer_is_deterministic(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    other = build_tokenizer()
    assert tokenizer.get_vocab() == other.get_vocab()
    assert tokenizer.backend_tokenizer.to_str() == other.backend_tokenizer.to_str()
    assert 256 + 3 < len(tokenizer) <= 512
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(tokenizer.all_special_tokens)


def test_tokenizer_is_deterministic_across_processes(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    code = (
        "from tslightning.models.tiny_model import build_tokenizer; print(build_tokenizer().backend_tokenizer.to_str())"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == json.loads(tokenizer.backend_tokenizer.to_str())


def test_smaller_vocab_target(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    small = build_tokenizer(300)
    assert len(small) <= 300 < len(tokenizer)
    with pytest.raises(ValueError, match="vocab_size"):
        TinyModelConfig(vocab_size=100)


def test_chat_template(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count the lines in file.txt."},
        {"role": "assistant", "content": "wc -l file.txt"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCount the lines in file.txt.<|im_end|>\n"
        "<|im_start|>assistant\nwc -l file.txt<|im_end|>\n"
    )
    assert "<|im_start|>assistant" in text
    prompt = tokenizer.apply_chat_template(conversation[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.eos_token_id) == 3
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    [
        "ls -la && cat file.txt | wc -l",
        "héllo wörld 🤖 中文字符 Ελληνικά العربية 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010ffff",
        bytes(range(256)).decode("latin-1"),
        "  leading and trailing spaces  \n\n\ttabs\r\nCRLF ",
        "literal <|im_end|> and <|endoftext|> inside text",
        "",
    ],
)
def test_encode_decode_round_trip(tokenizer: transformers.PreTrainedTokenizerFast, text: str) -> None:
    assert unicodedata.is_normalized("NFC", text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_non_nfc_text_is_normalised_like_qwen2(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    assert tokenizer.decode(tokenizer.encode("cafe\u0301", add_special_tokens=False)) == "caf\u00e9"


def test_build_is_seeded_and_leaves_global_rng_alone(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = build_tiny_model(TinyModelConfig(), tokenizer)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_tiny_model(TinyModelConfig(), tokenizer)
    c = build_tiny_model(TinyModelConfig(seed=1), tokenizer)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        d = build_tiny_model(TinyModelConfig(), tokenizer)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(default_dtype)
    assert torch.equal(a.model.layers[0].self_attn.q_proj.weight, d.model.layers[0].self_attn.q_proj.weight)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert not a.training
    assert a.dtype == torch.float32
    assert a.config.vocab_size % 64 == 0 and a.config.vocab_size >= len(tokenizer)
    assert a.config.eos_token_id == tokenizer.eos_token_id
    assert a.config.pad_token_id == tokenizer.pad_token_id
    assert a.config.hidden_size // a.config.num_attention_heads == 64
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_save_load_gives_identical_logits(
    saved_dir: pathlib.Path, tokenizer: transformers.PreTrainedTokenizerFast
) -> None:
    reference = build_tiny_model(TinyModelConfig(), tokenizer)
    model, loaded_tok = load_tiny_model(saved_dir)
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    assert not model.training and model.dtype == torch.float32

    auto_model = transformers.AutoModelForCausalLM.from_pretrained(saved_dir, dtype=torch.float32).eval()
    auto_tok = transformers.AutoTokenizer.from_pretrained(saved_dir)
    for tok in (loaded_tok, auto_tok):
        assert _backend_state(tok) == _backend_state(tokenizer)
        assert len(tok) == len(tokenizer)
        assert tok.eos_token_id == tokenizer.eos_token_id
        assert tok.pad_token_id == tokenizer.pad_token_id
        assert tok.chat_template == tokenizer.chat_template

    messages = [{"role": "user", "content": "How many lines are in data.csv?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert torch.equal(auto_tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"], ids)
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(auto_model(ids).logits, expected)


def test_load_in_float64(saved_dir: pathlib.Path) -> None:
    model, _ = load_tiny_model(saved_dir, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_head_dim_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"hidden_size.*num_attention_heads.*64") as info:
        TinyModelConfig(hidden_size=96)
    assert "set hidden_size=128" in str(info.value)
    with pytest.raises(ValueError, match="num_attention_heads"):
        TinyModelConfig(num_attention_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TinyModelConfig(hidden_size=192, num_attention_heads=3, num_key_value_heads=2)
    assert TinyModelConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2).hidden_size == 256


def test_save_is_idempotent_and_atomic(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model"
    assert save_tiny_model(str(target)) == target
    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt although the saved config matches")

    with monkeypatch.context() as mp:
        mp.setattr(tiny_model, "build_tiny_model", fail)
        mp.setattr(tiny_model, "build_tokenizer", fail)
        assert save_tiny_model(target, TinyModelConfig()) == target
    assert weights.stat().st_mtime_ns == mtime

    save_tiny_model(target, TinyModelConfig(seed=3))
    assert json.loads((target / tiny_model.MARKER_FILE).read_text())["config"]["seed"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    with monkeypatch.context() as mp:
        mp.setattr(tiny_model, "build_tiny_model", fail)
        with pytest.raises(AssertionError):
            save_tiny_model(tmp_path / "broken", TinyModelConfig(seed=4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        save_tiny_model(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


def test_peft_lora_on_loaded_model(saved_dir: pathlib.Path) -> None:
    from peft import LoraConfig, get_peft_model

    model, tok = load_tiny_model(saved_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(trainable) == 2 * 2 * model.config.num_hidden_layers

    ids = tok("echo hello", return_tensors="pt")["input_ids"]
    peft_model.train()
    peft_model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in peft_model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in peft_model.parameters() if not p.requires_grad)


def test_float64_forward_backward(tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    model = build_tiny_model(TinyModelConfig(), tokenizer).to(torch.float64)
    batch = tokenizer(["cat file.txt", "wc -l data.csv | sort"], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(**batch, labels=labels)
    assert out.logits.dtype == torch.float64
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)


def test_saved_directory_is_small(saved_dir: pathlib.Path) -> None:
    files = [p for p in saved_dir.rglob("*") if p.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", tiny_model.MARKER_FILE} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) < 2 * 1024 * 1024
