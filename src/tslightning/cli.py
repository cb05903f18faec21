"""The ``tslightning`` command line: jsonargparse subcommands derived from typed signatures (LitGPT style)."""

from __future__ import annotations

import importlib.resources
import json as json_module
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentError, ArgumentParser, auto_parser, set_dumper, set_parsing_settings

from tslightning.commands.evaluation import format_report
from tslightning.commands.policy_comparison import format_comparison
from tslightning.commands.policy_comparison import validate_or_compare as run_validation
from tslightning.commands.task_directories import tasks_migrate, tasks_toolchain, tasks_validate
from tslightning.commands.verification import DTypeName
from tslightning.commands.verification import verify as run_verification
from tslightning.loop.fit import fit
from tslightning.loop.learner_shape import planned_memory, policy_config
from tslightning.loop.run_config import yaml_text
from tslightning.loop.settings import SettingsError, moved_key
from tslightning.measure.analytical_model import SpeedupModelParameters
from tslightning.measure.memory_plan import plan_report
from tslightning.sandbox import SandboxUnavailableError

_BARE_FLAGS = ("--json", "--overwrite")


def verify(
    objective: Literal["grpo", "opd"] = "grpo",
    dtype: DTypeName = "float64",
    updates: int = 3,
    seed: int = 0,
    json: bool = False,
    device: str = "cpu",
) -> None:
    """Prove the streamed update equals the batch-synchronous one on the tiny transformer (App. G protocol).

    Builds the tiny Qwen2 model offline, makes ``updates`` logical batches (several groups, multi-turn
    trajectories, varied lengths, a uniform-reward group), replays each under sync and under streaming in a
    shuffled arrival order from the same θ_0, and reports the first direction's relative error and cosine and
    the parameter gap after each update beside the bf16-vs-fp32 reference gap. Exits 1 when the relative error
    exceeds the dtype's tolerance (1e-10 for float64, 1e-5 for float32).

    Args:
        objective: ``grpo`` (Eqs. 4-7) or ``opd`` (Eqs. 8-9).
        dtype: Precision of the two compared runs.
        updates: Logical batches (optimizer updates) to replay.
        seed: Seed of the model, the batches and the arrival orders.
        json: Print the report as JSON instead of text.
        device: Where the replays run (``cpu``, ``cuda``, ``cuda:1``): the device kernels' exactness, float64 included.
    """
    report = run_verification(objective=objective, dtype=dtype, updates=updates, seed=seed, device=device)
    print(json_module.dumps(report.to_dict(), indent=2) if json else report.summary())
    if not report.passed:
        sys.exit(1)


def validate(json: bool = False, **options: Any) -> None:
    """Estimate a checkpoint's pass@k on held-out tasks (App. E.2; Eq. 31).

    Usage: ``tslightning validate --checkpoint DIR [--tasks DIR] [--split dev] [--attempts 3] [--k '[1,3]']``.
    Runs ``attempts`` independent attempts per task, each in a fresh sandbox with a fresh agent history; an attempt
    succeeds when the verifier passes every test. Prints per-task n, c and pass@k, then the mean over tasks. When
    ``--checkpoint`` is a ``fit`` run's directory (or one of its checkpoints) and no ``--split`` is given, it prints
    the run's final policy beside its policy-0 on the train and dev splits instead, with the run's tasks and limits.
    Exits 2 on a bad argument, a checkpoint without a policy, or an unavailable sandbox. The options are those of
    ``tslightning.commands.evaluation.validate`` (jsonargparse follows ``**options`` there).

    Args:
        json: Print the report as JSON instead of a table.
    """
    try:
        report = run_validation(**options)
    except (ValueError, FileNotFoundError, SandboxUnavailableError) as error:
        print(f"validate: {error}", file=sys.stderr)
        sys.exit(2)
    if json:
        print(json_module.dumps(report, indent=2))
    else:
        print(format_comparison(report) if "rows" in report else format_report(report))


def replay(trace: str, warmup: int = 0, json: bool = False) -> None:
    """Replay a release trace (Eqs. 14-15 per rank): the predicted Sync and ThunderSync steps and speedup.

    Also estimates one-step-off Async's step (max(R, L) + P per update).

    Args:
        trace: A ``trace-rank*.jsonl`` file or the directory ``tslightning fit`` wrote (``<out_dir>/trace``).
        warmup: Leading updates left out of the means (App. B.3 window).
        json: Print the summary as JSON.
    """
    from tslightning.measure.trace_replay import replay_trace

    summary = replay_trace(trace).summary(warmup=warmup)
    if json:
        print(json_module.dumps(summary, indent=2))
        return
    print(
        f"tslightning replay: {summary['updates']} update(s), ranks {summary['ranks']}, warm-up {warmup}\n"
        f"  predicted mean endpoint  sync {summary['mean_sync_end_s']:.3f} s   "
        f"thundersync {summary['mean_thundersync_end_s']:.3f} s\n"
        f"  predicted speedup (ratio of means): {summary['predicted_speedup']:.3f}x\n"
        f"  one-step-off async estimate max(R, L) + P: {summary['mean_async_end_s']:.3f} s "
        f"(thundersync {summary['thundersync_vs_async']:.3f}x its step)"
    )


def bench(
    fit_config: str,
    schedules: str = "sync,thundersync,async,fully_async",
    updates: int = 10,
    warmup: int = 2,
    out_dir: str = "runs/bench",
    latency_scales: Sequence[float] = (),
    fit_args: Sequence[str] = (),
    json: str | None = None,
    pictures: bool = True,
    repeats: int = 1,
    variants: dict[str, list[str]] | None = None,
) -> None:
    """Run one workload under each schedule side by side and print the comparison (App. B, F).

    Usage: ``tslightning bench --config configs/bench_balanced.yaml --schedules sync,thundersync --updates 10
    --warmup 2 --json runs/bench/bench.json`` (``--config`` names the fit config: it is ``--fit_config``). Each
    schedule runs the config as its own ``tslightning fit`` process, one after another; the table gives, over the
    updates after ``warmup``, the mean step time, the speedup vs sync (ratio of means), the trace-replay predicted
    speedup, trainer active MFU, learner service time (and its ratio to sync's), learner and rollout idle
    fractions, the rollout/learner ratio r, policy lag, peak learner memory and mean reward; then each run's rollout
    tail (τ, its share of the step, the tail's tokens per second, speculative decoding's acceptance) and every
    thundersync step against every async step.

    Args:
        fit_config: The ``tslightning fit`` config of the workload (a ``configs/bench_*.yaml``); ``--config`` too.
        schedules: Comma-separated schedules among sync, thundersync, async, fully_async.
        updates: Updates per run, warm-up included.
        warmup: Leading updates left out of the means (App. B.3).
        out_dir: Run directories and pictures go here.
        latency_scales: Ratio sweep: extra sync and thundersync runs with the simulated tool latency scaled by each
            factor (e.g. ``[0.35, 2.8]``).
        fit_args: Extra ``tslightning fit`` arguments for every run (e.g. ``["--warm_start.steps=50"]``).
        json: Also write the measurements to this JSON file.
        pictures: Write Fig. 3-style timelines per run and the Fig. 8-style predicted-vs-measured scatter.
        repeats: Runs of every schedule, in alternating order (forward, reversed, ...), pooled into each row: a
            drift in the machine's speed over the bench then cancels instead of favouring the schedules run first;
            each repeat's own speedups are printed beside the table.
        variants: Named sets of further ``fit`` arguments; every schedule runs once per variant, e.g. ``{"off":
            ["--rollout.server_urls=[http://127.0.0.1:8000]"], "spec": ["--rollout.server_urls=[http://127.0.0.1:8001]",
            "--rollout.speculative.method=ngram"]}``. Speedups compare runs of the same variant.
    """
    from tslightning.commands.bench import bench as run_bench
    from tslightning.commands.bench import format_table, write_pictures

    try:
        measurements = run_bench(
            fit_config,
            [s.strip() for s in schedules.split(",") if s.strip()],
            updates,
            warmup,
            out_dir,
            latency_scales,
            fit_args,
            repeats,
            variants,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"bench: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_table(measurements))
    if pictures:
        for path in write_pictures(measurements, out_dir):
            print(f"wrote {path}")
    if json is not None:
        Path(json).parent.mkdir(parents=True, exist_ok=True)
        Path(json).write_text(json_module.dumps([asdict(m) for m in measurements], indent=2))
        print(f"wrote {json}")


def predict(
    objective: Literal["grpo", "opd"] = "grpo",
    batch: int = 256,
    ratio: float = 1.0,
    turns: int = 40,
    capacity: int = SpeedupModelParameters.capacity,
    group_size: int = SpeedupModelParameters.group_size,
    closure_fraction: float = SpeedupModelParameters.closure_fraction,
    deferred_fraction: float = SpeedupModelParameters.deferred_fraction,
    service_exponent: float = SpeedupModelParameters.service_exponent,
    suffix: float = SpeedupModelParameters.suffix,
    plots: str | None = None,
    json: bool = False,
) -> None:
    """Predict Sync vs ThunderSync step time and speedup from the analytical model (App. F, Eqs. 16-28).

    Usage: ``tslightning predict [--objective opd] [--batch 256] [--ratio 1.0] [--turns 40] [--plots DIR]``.
    No trace or GPU needed: the workload is B trajectories in w = max(1, B/Q) rollout waves with learner load
    ρ_w = min(1, B/Q)/r (Eq. 28), work released by Eq. 22 (GRPO) or Eq. 24 (OPD). Step times print in units of W,
    the rollout time of one full wave. The defaults are App. F.5's, which reproduce App. F.6's quoted speedups.
    Exits 2 on an invalid argument.

    Args:
        objective: ``grpo`` (work released at each reward, Eq. 22) or ``opd`` (per scored turn, Eq. 24).
        batch: B, trajectories per optimizer step.
        ratio: r, rollout time over learner time at full capacity (1 is balance).
        turns: a, agentic turns per trajectory (GRPO's prediction does not depend on it).
        capacity: Q, trajectories one full rollout wave runs at once.
        group_size: m, GRPO group size (trajectories).
        closure_fraction: β, share of GRPO learner service that waits for the whole group (0-1).
        deferred_fraction: δ, share of OPD learner service deferred to trajectory completion (0-1).
        service_exponent: γ ≥ 0, learner service of a trajectory completing at u·W grows as u^γ.
        suffix: κ_w, serial suffix (reduction, optimizer step, publication) in units of W.
        plots: Also write Figs. 9 and 10 (speedup over r × turns and r × batch, GRPO and OPD) as PNGs here.
        json: Print the prediction as JSON.
    """
    from tslightning.measure.analytical_model import predict_speedup

    try:
        parameters = SpeedupModelParameters(
            capacity, group_size, closure_fraction, deferred_fraction, service_exponent, suffix
        )
        prediction = predict_speedup(objective, batch, ratio, turns, parameters)
    except ValueError as error:
        print(f"predict: {error}", file=sys.stderr)
        sys.exit(2)
    written = []
    if plots is not None:
        from tslightning.measure.speedup_plots import write_speedup_surfaces

        written = [str(path) for path in write_speedup_surfaces(plots, parameters)]
    if json:
        print(json_module.dumps({**prediction.to_dict(), "plots": written}, indent=2))
        return
    print(prediction.summary())
    for path in written:
        print(f"  wrote {path}")


def plan(fit_config: str, gpu_memory_gb: float | None = None, model_config: str | None = None) -> None:
    """Print each learner rank's planned memory for a fit config, and what to change when it does not fit.

    The plan (weights, gradients, optimizer state, statistics, activations with and without checkpointing) comes from
    the model's config alone; the settings to change are printed when it does not fit ``gpu_memory_gb``.

    Args:
        fit_config: A fit config file, or a shipped config's name (``--config`` works too).
        gpu_memory_gb: Memory of one learner GPU (GiB), to say whether the run fits.
        model_config: A Hugging Face ``config.json`` to plan for instead of ``model.path``'s (no weights needed).
    """
    cli = parser()
    arguments = cli.instantiate(cli.parse_args(["fit", "--config", _config_file(fit_config)]))["fit"]
    config = policy_config(arguments["model"], model_config)
    learner = arguments["learner"]
    available = None if gpu_memory_gb is None else int(gpu_memory_gb * 2**30)
    algorithm = arguments["algorithm"]
    planned = planned_memory(
        config, arguments["objective"], arguments["schedule"], arguments["model"], arguments["rollout"], learner,
        algorithm.group_admission_cap, algorithm.micro_batch_size, available, algorithm.optimizer.state_dtype,
    )  # fmt: skip
    print(plan_report(planned.plan, planned.shape, gpu_memory_gb, learner.activation_checkpointing))


COMMANDS = {
    "fit": fit,
    "plan": plan,
    "verify": verify,
    "validate": validate,
    "replay": replay,
    "predict": predict,
    "bench": bench,
    "tasks": {
        "_help": "Check, migrate and prepare terminal tasks in the Harbor layout.",
        "validate": tasks_validate,
        "migrate": tasks_migrate,
        "toolchain": tasks_toolchain,
    },
}

_DESCRIPTION = (
    "tslightning: exact gradient streaming for agentic RL on PyTorch Lightning / Fabric. Run `tslightning COMMAND "
    "--help` for a command's options (with each setting's documentation). `--config FILE` may come before or after "
    "the command; FILE may also name a shipped config (quickstart, quickstart_opd, bench_balanced, ...). A user error "
    "prints one line naming the setting and the fix and exits 2; add --debug anywhere for the traceback."
)

_CONFIG_NAME = re.compile(r"(configs/)?[\w.-]+")
"""A ``--config`` value that may name a shipped config (a bare name, ``NAME.yaml`` or ``configs/NAME.yaml``)."""


class CommandLineError(ValueError):
    """A command line the user must fix (an unknown config, a value a settings class refused)."""


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``tslightning`` console script.

    A user error — an unknown option or value, a config that is neither a file nor a shipped config, a setting out of
    range, a malformed task, an output directory that holds an earlier run — prints one line and exits 2 before
    anything is written; ``--debug`` (anywhere on the command line) raises it with its traceback instead.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        _run([arg for arg in args if arg != "--debug"])
    except (ArgumentError, SettingsError, CommandLineError) as error:
        if debug:
            raise
        hint = " (see --help)" if isinstance(error, ArgumentError) else ""
        print(f"tslightning: {' '.join(str(error).split())}{hint}; --debug shows the traceback", file=sys.stderr)
        sys.exit(2)


def parser() -> ArgumentParser:
    """The ``tslightning`` parser: one subcommand per command, settings documented from their attribute docstrings."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    set_dumper("yaml", yaml_text)  # --print_config writes enum defaults (e.g. of a callback) as their values
    return auto_parser(COMMANDS, as_positional=False, exit_on_error=False, prog="tslightning", description=_DESCRIPTION)


def shipped_configs() -> dict[str, Path]:
    """The configs installed with the package (``tslightning/configs/*.yaml``, the repository's ``configs/``)."""
    directory = importlib.resources.files("tslightning") / "configs"
    if not isinstance(directory, Path) or not directory.is_dir():
        return {}
    return {path.stem: path for path in sorted(directory.glob("*.yaml"))}


def _run(args: list[str]) -> None:
    """Parse, instantiate the settings, and run the chosen command."""
    args = _expand_bare_flags(
        _shipped_config_paths(_bench_fit_config(_config_after_command(_positional_task_dir(args))))
    )
    _refuse_moved_keys(args)
    cli = parser()
    config = cli.parse_args(args)
    try:
        settings = cli.instantiate(config)
    except (ValueError, TypeError) as error:  # a settings class refused a value (e.g. TinyModelConfig's shape)
        raise CommandLineError(str(error)) from error
    command, arguments = COMMANDS[settings.subcommand], settings[settings.subcommand]
    while isinstance(command, dict):  # `tasks validate`
        command, arguments = command[arguments.subcommand], arguments[arguments.subcommand]
    arguments.pop("config", None)
    arguments.pop("subcommand", None)
    command(**arguments)


def _refuse_moved_keys(args: list[str]) -> None:
    """A ``fit`` key that moved (``--max_grad_norm``, a config's ``optimizer:``), named in one line with its new key,
    before jsonargparse reports it as merely unknown. Configs are checked for ``fit``, ``plan`` and ``bench``."""
    if args[:1] not in (["fit"], ["plan"], ["bench"]):
        return
    renames = []
    for position, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in ("--config", "--fit_config"):
            config = value if equals else (args[position + 1] if position + 1 < len(args) else "")
            renames += [f"{key} → {moved_key(key)} (in {config})" for key in _moved_config_keys(config)]
        elif args[0] == "fit" and name.startswith("--") and moved_key(name[2:]):
            renames.append(f"{name} → --{moved_key(name[2:])}")
    if renames:
        raise CommandLineError(
            f"fit's learning-algorithm settings moved under `algorithm` (some renamed) in 0.1.0: rename "
            f"{', '.join(renames)}"
        )


def _moved_config_keys(config: str) -> list[str]:
    """The top-level keys of a fit config (or of its ``fit:`` section) that moved under ``algorithm``."""
    try:
        settings = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return []  # not a readable YAML file: jsonargparse reports it
    if isinstance(settings, dict) and isinstance(settings.get("fit"), dict):
        settings = settings["fit"]
    if not isinstance(settings, dict):
        return []
    algorithm = settings.get("algorithm") if isinstance(settings.get("algorithm"), dict) else {}
    nested = [f"algorithm.{key}" for key in algorithm if moved_key(f"algorithm.{key}")]
    return [key for key in settings if moved_key(str(key))] + nested


def _positional_task_dir(args: list[str]) -> list[str]:
    """Let ``tasks validate DIR`` name its directory positionally as well as with ``--path DIR``, and ``tasks
    migrate SOURCE TARGET`` its two as well as with ``--source``, ``--target``."""
    if args[:2] in (["tasks", "validate"], ["tasks", "toolchain"]) and len(args) > 2 and not args[2].startswith("-"):
        return [*args[:2], "--path", *args[2:]]
    if args[:2] == ["tasks", "migrate"] and len(args) > 3 and not any(a.startswith("-") for a in args[2:4]):
        return [*args[:2], "--source", args[2], "--target", args[3], *args[4:]]
    return args


def _config_after_command(args: list[str]) -> list[str]:
    """``tslightning --config X fit ...`` means ``tslightning fit --config X ...``, unless X nests its settings under
    the command's name (jsonargparse's own form for a config given before the command)."""
    position, leading = 0, []
    while position < len(args):
        if args[position] == "--config" and position + 1 < len(args):
            leading += args[position : position + 2]
            position += 2
        elif args[position].startswith("--config="):
            leading.append(args[position])
            position += 1
        else:
            break
    if not leading or position == len(args) or args[position].startswith("-"):
        return args
    command = args[position : position + (2 if args[position] == "tasks" else 1)]
    values = [arg.removeprefix("--config=") for arg in leading if arg != "--config"]
    if any(_nests_under(value, command[0]) for value in values):
        return args
    return [*command, *leading, *args[position + len(command) :]]


def _nests_under(config: str, command: str) -> bool:
    try:
        settings = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(settings, dict) and command in settings


def _shipped_config_paths(args: list[str]) -> list[str]:
    """Resolve each ``--config`` (and bench's ``--fit_config``) value naming a shipped config rather than a file."""
    resolved, option = [], None
    for arg in args:
        name, equals, value = arg.partition("=")
        if option is not None:
            arg = _config_file(arg)
        elif equals and name in ("--config", "--fit_config"):
            arg = f"{name}={_config_file(value)}"
        option = arg if arg in ("--config", "--fit_config") else None
        resolved.append(arg)
    return resolved


def _config_file(value: str) -> str:
    """An existing file as given; else the shipped config it names (``quickstart``, ``quickstart.yaml`` or
    ``configs/quickstart.yaml``, which a plain pip install has no copy of)."""
    if Path(value).exists() or not _CONFIG_NAME.fullmatch(value):
        return value
    shipped = shipped_configs()
    name = Path(value).stem if value.endswith((".yaml", ".yml")) else Path(value).name
    if name not in shipped:
        raise CommandLineError(
            f"--config {value} is neither a file nor a shipped config; give a path or one of: {', '.join(shipped)}"
        )
    return str(shipped[name])


def _bench_fit_config(args: list[str]) -> list[str]:
    """``bench --config FILE`` and ``plan --config FILE`` name a fit config, not a config of their own arguments."""
    if args[:1] not in (["bench"], ["plan"]):
        return args
    renamed = []
    for arg in args:
        if arg == "--config":
            arg = "--fit_config"
        elif arg.startswith("--config="):
            arg = "--fit_config=" + arg.removeprefix("--config=")
        renamed.append(arg)
    return renamed


def _expand_bare_flags(args: list[str]) -> list[str]:
    """Let boolean switches be given bare (``--json``) as well as ``--json true`` (``bench --json`` takes a path)."""
    if args[:1] == ["bench"]:
        return args
    expanded = []
    for position, arg in enumerate(args):
        expanded.append(arg)
        following = args[position + 1] if position + 1 < len(args) else None
        if arg in _BARE_FLAGS and (following is None or following.startswith("--")):
            expanded.append("true")
    return expanded


if __name__ == "__main__":
    main()
