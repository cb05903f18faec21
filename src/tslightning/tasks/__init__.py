"""Tasks the agentic trainer rolls out on, and their rewards.

- :mod:`~tslightning.tasks.terminal_task`: Harbor / Terminal-Bench 2 task directories (:class:`TerminalTask`).
- :mod:`~tslightning.tasks.verifier`: run a task's verifier on an attempt (:func:`run_verifier`).
- :mod:`~tslightning.tasks.rewards`: binary and SETA partial rewards, reward.txt / reward.json (App. E.1).
- :mod:`~tslightning.tasks.validation`: reference passes, no-op fails (App. C.2); ``tslightning tasks validate``.
- :mod:`~tslightning.tasks.split`: the SHA-256 train / dev split by group (App. C.2).
- :mod:`~tslightning.tasks.swe_smith`: SWE-smith JSONL records.

``harbor/`` reads the Harbor format (``task.toml``, Dockerfiles, compose projects, what an environment needs);
``environment/`` builds and starts environments without a container engine. ``library/`` ships small terminal
tasks in the Harbor layout (see :func:`library_dir`).

Layer: above ``sandbox`` (where attempts and verifiers run), which is all it imports.
"""

from tslightning.tasks.rewards import RewardReading, RewardScheme, binary_reward, read_reward_files, seta_reward
from tslightning.tasks.split import split_groups, split_of
from tslightning.tasks.swe_smith import SweSmithFormatError, SweSmithInstance, load_swe_smith_jsonl
from tslightning.tasks.terminal_task import TaskFormatError, TerminalTask, find_task_dirs
from tslightning.tasks.validation import TaskValidation, library_dir, validate_task, validate_tasks
from tslightning.tasks.verifier import VerifierResult, run_verifier

__all__ = [
    "RewardReading",
    "RewardScheme",
    "SweSmithFormatError",
    "SweSmithInstance",
    "TaskFormatError",
    "TaskValidation",
    "TerminalTask",
    "VerifierResult",
    "binary_reward",
    "find_task_dirs",
    "library_dir",
    "load_swe_smith_jsonl",
    "read_reward_files",
    "run_verifier",
    "seta_reward",
    "split_groups",
    "split_of",
    "validate_task",
    "validate_tasks",
]
