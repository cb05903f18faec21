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


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("sed -i 's/a\\.b/c/g' config.ini", "sed 's/a\\.b/c/g' config.ini"),  # prints the edit instead of making it
        ("find w -name '*.tmp' -delete", "find w -name '*.tmp'"),  # no redirection, no -i: the last word goes
        ("ls", "ls"),  # nothing shorter is a command
    ],
)
def test_a_near_miss_of_a_one_liner_without_redirection_differs_from_the_reference(reference, expected):
    from tslightning.tasks.demonstrations import near_miss

    demo = Demonstration("x", ((f"<bash>{reference}</bash>", "[exit code 0]"), ("<finish/>", "")))
    assert near_miss(demo).turns[0][0] == f"<bash>{expected}</bash>"


def test_no_shipped_task_s_near_miss_is_its_reference():
    """A near miss equal to the reference leaves its task's sampled groups without a reward spread."""
    from tslightning.loop.settings import RolloutSettings
    from tslightning.loop.task_selection import select_tasks
    from tslightning.tasks.demonstrations import near_miss, reference_demonstration

    demos = [reference_demonstration(t) for t in select_tasks(RolloutSettings(split="all")).tasks if t.solution_script]
    assert len(demos) > 30
    assert [d.instruction[:40] for d in demos if near_miss(d).turns == d.turns] == []


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


class _CountingPolicy(torch.nn.Module):
    """Uniform logits from one weight; records the demonstration each step fitted (its token count)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.seen: list[int] = []

    def forward(self, input_ids):
        self.seen.append(input_ids.shape[1])
        return type("Output", (), {"logits": self.bias.expand(*input_ids.shape, -1)})()


@pytest.mark.parametrize("share", [0.2, 0.7])
def test_reference_share_is_how_often_a_step_shows_a_reference(tokenizer, share):
    from tslightning.tasks.demonstrations import near_miss

    loop = AgentLoop(engine=None, tokenizer=tokenizer)
    demos = [*DEMOS, *(near_miss(d) for d in DEMOS)]
    lengths = [len(demonstration_tokens(loop, d)[0]) for d in demos]
    assert len(set(lengths)) == 4 and [d.reference for d in demos] == [True, True, False, False]
    policy = _CountingPolicy(len(tokenizer))
    supervised_warm_start(policy, loop, demos, steps=2000, seed=0, reference_share=share)
    drawn = torch.tensor([lengths.index(n) for n in policy.seen])
    assert (drawn < 2).float().mean().item() == pytest.approx(share, abs=0.03)
    assert ((drawn == 0).sum() / (drawn < 2).sum()).item() == pytest.approx(0.5, abs=0.08)  # uniform in a kind


def test_without_a_reference_share_every_demonstration_is_drawn_equally_often(tokenizer):
    from tslightning.tasks.demonstrations import near_miss

    loop = AgentLoop(engine=None, tokenizer=tokenizer)
    demos = [*DEMOS, near_miss(DEMOS[0])]
    lengths = [len(demonstration_tokens(loop, d)[0]) for d in demos]
    policy = _CountingPolicy(len(tokenizer))
    supervised_warm_start(policy, loop, demos, steps=1500, seed=0)
    assert (torch.tensor([lengths.index(n) for n in policy.seen]) >= 2).float().mean().item() == pytest.approx(
        1 / 3, abs=0.03
    )


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"reference_share": 1.0}, "warm_start.reference_share must be in (0, 1) or null; got 1.0"),
        ({"reference_share": 0.3, "near_misses": False}, "warm_start.reference_share needs warm_start.near_misses"),
    ],
)
def test_a_reference_share_out_of_range_or_without_near_misses_is_a_problem(settings, problem):
    from tslightning.loop.warm_start import WarmStartSettings

    assert any(p.startswith(problem) for p in WarmStartSettings(steps=10, **settings).problems())
    assert WarmStartSettings(steps=10, reference_share=0.3).problems() == []
