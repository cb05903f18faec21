"""Learner FLOPs (App. B.1): hand-computed small cases, and agreement with Lightning's ``measure_flops``.

``measure_flops`` runs ``torch.utils.flop_counter`` over a real forward+backward. On the meta device the attention
products run as ``bmm`` and are counted at full (T × T) shape, so the architecture count must agree *exactly*. (On CPU
tensors the fused SDPA kernel is not counted by the flop counter, which would read 6.5% low on the tiny model.)
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from lightning.fabric.utilities.throughput import measure_flops

from tslightning.measure.learner_flops import (
    DecoderShape,
    FlopCount,
    WeightTraining,
    learner_flops,
    linear_flops,
    matmul_flops,
    source_flops,
)

# hidden 4, one layer, 2 query heads and 1 KV head of width 2, MLP 6, vocabulary 10.
SMALL = DecoderShape(
    hidden_size=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=6, vocab_size=10
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_matmul_and_linear_follow_2mkn():
    assert matmul_flops(2, 3, 4) == 48
    assert linear_flops(5, 4, 3, weight_grad=True, input_grad=True) == FlopCount(120, 240)
    assert linear_flops(5, 4, 3, weight_grad=False, input_grad=True) == FlopCount(120, 120)  # frozen, grad passes
    assert linear_flops(5, 4, 3, weight_grad=False, input_grad=False) == FlopCount(120, 0)


def test_full_fine_tuning_small_case_by_hand():
    # T = 3 tokens. Forward: q 2·3·4·4=96, k 2·3·4·2=48, v 48, o 96, gate/up/down 2·3·4·6=144 each,
    # LM head 2·3·4·10=240, attention scores and values 2 heads · 2·3·2·3 = 72 each.
    forward = 96 + 48 + 48 + 96 + 3 * 144 + 240 + 2 * 72
    assert forward == 1104
    assert source_flops(SMALL, 3) == FlopCount(forward, 2 * forward)  # backward = 2× forward for trained weights
    assert learner_flops(SMALL, 3) == 3312


def test_lora_small_case_by_hand():
    """Frozen base + rank-1 adapters on every linear layer: input gradients through frozen weights, adapter products
    counted separately, and no backward at all for the first layer's Q/K/V base (nothing before them needs grad)."""
    count = source_flops(SMALL, 3, WeightTraining.lora(1, LINEARS))
    q = FlopCount(96 + 24 + 24, 0 + 24 + 48)  # base; A 4→1 (weight grad only); B 1→4 (weight + input grad)
    kv = FlopCount(48 + 24 + 12, 0 + 24 + 24)  # B 1→2
    attention = FlopCount(144, 4 * 72)  # dQ, dK, dP, dV
    o = FlopCount(96 + 24 + 24, 96 + 48 + 48)  # input grads now flow
    mlp_in = FlopCount(144 + 24 + 36, 144 + 48 + 72)  # gate, up: A 4→1, B 1→6
    down = FlopCount(144 + 36 + 24, 144 + 72 + 48)  # A 6→1, B 1→4
    head = FlopCount(240, 240)  # frozen LM head: input gradient only
    expected = q + kv + kv + attention + o + mlp_in + mlp_in + down + head
    assert expected == FlopCount(1452, 1680)
    assert count == expected


@pytest.mark.parametrize("tokens", [1, 2, 5, 100])
def test_every_context_token_counts_and_attention_is_the_full_square(tokens):
    # Per token, the linear layers cost 2·(16 + 8 + 8 + 16 + 3·24 + 40) = 320 forward; the two attention products
    # cost 2 heads · 2·T·2·T = 8T² each, the full T × T shape rather than the causal half. Everything ×3 with backward.
    assert learner_flops(SMALL, tokens) == 3 * (320 * tokens + 2 * 8 * tokens**2)


def test_decoder_shape_from_tiny_qwen2_config(make_policy):
    config = make_policy(torch.float32).config
    shape = DecoderShape.from_config(config)
    assert shape == DecoderShape(128, 2, 2, 1, 64, 256, config.vocab_size, True)
    assert shape.projection_widths("k_proj") == (128, 64)  # grouped-query attention shrinks K/V only


def test_mixture_of_experts_config_is_refused():
    config = transformers.Qwen2MoeConfig(num_experts=4)
    with pytest.raises(ValueError, match="experts"):
        DecoderShape.from_config(config)


def test_weight_training_read_from_full_and_lora_models(make_policy):
    assert WeightTraining.from_model(make_policy(torch.float32)) == WeightTraining.full()
    lora = _lora(make_policy(torch.float32), rank=4, targets=LINEARS)
    assert WeightTraining.from_model(lora) == WeightTraining.lora(4, LINEARS)
    with pytest.raises(ValueError, match="unknown projections"):
        WeightTraining(trained=frozenset({"qkv"}))


def _lora(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> peft.PeftModel:
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets))
    return peft.get_peft_model(model, config)


def _meta_tiny(config) -> transformers.Qwen2ForCausalLM:
    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tokens", [7, 53])
@pytest.mark.parametrize(
    "training",
    ["full", "lora", "lora_qv", "frozen_embeddings"],
)
def test_agrees_with_lightning_measure_flops_on_meta_tiny_qwen2(make_policy, tokens, training):
    config = make_policy(torch.float32).config
    model = _meta_tiny(config)
    if training == "lora":
        model = _lora(model, 8, LINEARS)
    elif training == "lora_qv":
        model = _lora(model, 8, ("q_proj", "v_proj"))
    elif training == "frozen_embeddings":
        model.get_input_embeddings().requires_grad_(False)  # tied: the LM head is frozen too
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    measured = measure_flops(model, lambda: model(input_ids=ids).logits, loss_fn=torch.Tensor.sum)
    counted = learner_flops(DecoderShape.from_config(config), tokens, WeightTraining.from_model(model))
    assert counted == measured
