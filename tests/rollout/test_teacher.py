"""The frozen teacher scores exactly the scored tokens, off the caller's thread, and isolates bad requests."""

from __future__ import annotations

import os

import pytest
import torch

from tslightning.rollout.teacher import TeacherScorer


def direct_scores(teacher, ids, mask):
    with torch.no_grad():
        logp = teacher(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
    return logp.gather(-1, ids[1:, None])[:, 0][mask[1:]]


def test_scores_match_direct_log_softmax_in_a_batch(teacher64):
    generator = torch.Generator().manual_seed(0)
    requests = []
    for length in (5, 9, 13, 7):
        ids = torch.randint(0, 500, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 2 :] = True
        requests.append((ids, mask))
    with TeacherScorer(teacher64, max_batch=4) as scorer:
        futures = [scorer.submit(ids, mask) for ids, mask in requests]
        results = [f.result(timeout=30) for f in futures]
    for (ids, mask), scores in zip(requests, results, strict=True):
        assert scores.dtype == torch.float32 and scores.shape == (int(mask.sum()),)
        assert torch.allclose(scores.double(), direct_scores(teacher64, ids, mask), atol=1e-6)


def test_a_bad_request_fails_alone(teacher64):
    good = (torch.tensor([3, 4, 5, 6]), torch.tensor([False, False, True, True]))
    bad = (torch.tensor([3, 10**6, 5]), torch.tensor([False, True, True]))  # id outside the vocabulary
    with TeacherScorer(teacher64, max_batch=8) as scorer:
        futures = [scorer.submit(*good), scorer.submit(*bad), scorer.submit(*good)]
        with pytest.raises(IndexError):
            futures[1].result(timeout=30)
        assert futures[0].result(timeout=30).shape == (2,) and futures[2].result(timeout=30).shape == (2,)


def test_closed_scorer_refuses_work(teacher64):
    scorer = TeacherScorer(teacher64)
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(torch.tensor([1, 2]), torch.tensor([False, True]))


def test_cpus_place_only_the_scoring_thread(teacher64):
    caller = os.sched_getaffinity(0)
    core = max(caller)
    with TeacherScorer(teacher64, cpus=[core]) as scorer:
        assert scorer.score(torch.tensor([3, 4, 5]), torch.tensor([False, True, True])).shape == (2,)
        assert os.sched_getaffinity(scorer._worker.native_id) == {core}
        assert os.sched_getaffinity(0) == caller  # the learner's thread stays where it was


@pytest.mark.parametrize("cpus", [[], [10**4]])
def test_cpus_must_name_existing_cores(teacher64, cpus):
    with pytest.raises(ValueError, match="TeacherScorer: cpus"):
        TeacherScorer(teacher64, cpus=cpus)
