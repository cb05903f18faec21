"""The supervised warm start fits demonstrations in the agent loop's own token layout."""

from __future__ import annotations

import copy

import pytest
import torch

from tslightning.loop.warm_start import demonstration_tokens, supervised_warm_start
from tslightning.rollout.agent_loop import AgentLoop
from tslightning.tasks.demonstrations import Demonstration

DEMOS = [
    Demonstration(
        "Count the lines of data.txt into count.txt",
        (("<bash>wc -l < data.txt > count.txt</bash>", "[exit code 0]"), ("<finish/>", "")),
    ),
    Demonstration(
        "Sort names.txt into sorted.txt",
        (("<bash>sort names.txt > sorted.txt</bash>", "[exit code 0]"), ("<finish/>", "")),
    ),
]


def test_tokens_follow_the_agent_loop_serialization(tokenizer):
    loop = AgentLoop(engine=None, tokenizer=tokenizer)
    ids, mask = demonstration_tokens(loop, DEMOS[0])
    prompt = loop.prompt_token_ids(DEMOS[0].instruction)
    assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
    action = tokenizer.encode(DEMOS[0].turns[0][0], add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids[len(prompt) : len(prompt) + len(action)].tolist() == action
    observation = loop.observation_tokens("[exit code 0]")
    start = len(prompt) + len(action)
    assert ids[start : start + len(observation)].tolist() == observation
    assert int(mask.sum()) == len(action) + len(tokenizer.encode("<finish/>", add_special_tokens=False)) + 1


def test_warm_start_makes_the_policy_emit_the_demonstrated_action(tokenizer, make_policy):
    model = make_policy(torch.float32)
    loop = AgentLoop(engine=None, tokenizer=tokenizer)
    losses = supervised_warm_start(model, loop, DEMOS, steps=150, seed=0)
    assert losses[-1] < 0.1 * losses[0]
    ids, mask = demonstration_tokens(loop, DEMOS[0])
    prompt = ids[: int(mask.nonzero()[0])]
    out = model.generate(prompt[None], max_new_tokens=16, do_sample=False)
    assert tokenizer.decode(out[0, len(prompt) :]).startswith("<bash>wc -l < data.txt > count.txt")


def test_warm_start_requires_demonstrations(tokenizer, make_policy):
    with pytest.raises(ValueError, match="demonstration"):
        supervised_warm_start(copy.deepcopy(make_policy(torch.float32)), AgentLoop(None, tokenizer), [])


def test_near_miss_drops_the_redirection_or_the_last_line():
    from tslightning.tasks.demonstrations import near_miss

    one_line = Demonstration(
        "count", (("<bash>wc -l < log.txt > count.txt</bash>", "[exit code 0]"), ("<finish/>", ""))
    )
    assert near_miss(one_line).turns[0][0] == "<bash>wc -l < log.txt</bash>"
    two_lines = Demonstration("x", (("<bash>sort a > b\nmv b a</bash>", "[exit code 0]"), ("<finish/>", "")))
    assert near_miss(two_lines).turns == (("<bash>sort a > b</bash>", "[exit code 0]"), ("<finish/>", ""))


def test_warm_start_leaves_no_gradient_on_any_weight(tokenizer, make_policy):
    """The RL learner accumulates per-source gradients into ``.grad``: a warm start's last step must not seed them."""
    model = make_policy(torch.float32)
    supervised_warm_start(model, AgentLoop(engine=None, tokenizer=tokenizer), DEMOS, steps=3, seed=0)
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize(("schedule", "expected"), [("constant", [4e-3] * 4), ("linear", [4e-3, 3e-3, 2e-3, 1e-3])])
def test_a_linear_schedule_decays_the_learning_rate_to_zero(tokenizer, make_policy, monkeypatch, schedule, expected):
    stepped = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        stepped.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    loop = AgentLoop(engine=None, tokenizer=tokenizer)
    supervised_warm_start(make_policy(torch.float32), loop, DEMOS, steps=4, lr=4e-3, seed=0, lr_schedule=schedule)
    assert stepped == pytest.approx(expected)
