"""``tslightning plan``: each learner rank's memory for a ``fit`` config, before any GPU is asked for it.

The model comes from ``model.path``'s ``config.json`` (no weights are read), ``--model_config`` (a config.json of
any Hugging Face causal LM, e.g. one copied from a model card), or the embedded tiny model; the learner from the
config's precision, LoRA, strategy, ranks, admission cap, statistics placement and context limit
(:mod:`tslightning.measure.memory_plan`).
"""

from __future__ import annotations

from tslightning.measure.memory_plan import GIB, LearnerShape, MemoryPlan


def plan_report(plan: MemoryPlan, shape: LearnerShape, gpu_memory_gb: float | None, checkpointing: bool) -> str:
    """The printed plan: the table, and whether it fits ``gpu_memory_gb`` with the settings to change if not."""
    lines = [
        f"per learner rank: {shape.precision}, strategy {shape.strategy} x {shape.world_size}, {shape.objective}, "
        f"{shape.open_groups} open group(s) per rank, {shape.sequence_tokens}-token passes"
        + (f", statistics sharded over {plan.statistics_shards} ranks" if plan.statistics_shards > 1 else "")
        + (f", LoRA r={shape.lora_rank}" if shape.lora_rank else ", full fine-tuning"),
        plan.table(),
    ]
    if gpu_memory_gb is not None:
        available = int(gpu_memory_gb * GIB)
        need = plan.device_bytes(checkpointing)
        fits = "fits" if need <= available else "does NOT fit"
        lines.append(f"{need / GIB:.2f} GiB with the run's settings {fits} in {gpu_memory_gb:g} GiB of GPU memory")
        if need > available:
            lines += ["change: " + change for change in plan.advice(available, shape, checkpointing)]
    return "\n".join(lines)
