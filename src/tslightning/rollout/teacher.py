"""Frozen-teacher scoring for OPD (Eq. 8, App. D.3).

The teacher scores each completed turn's sampled action tokens under the student's serialized causal history
(the same token ids, never a rewritten conversation) and returns FP32 log-probabilities. Scoring runs on its own
worker thread and answers through futures, so it overlaps with tool execution and later turns; when a turn's
future resolves, that turn is a ready OPD source.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.objectives.scored_logprobs import batched_scored_logprobs
from tslightning.rollout.core_placement import check_cores, place_this_thread


class TeacherScorer:
    """A frozen HF causal LM that scores action tokens on a worker thread.

    Args:
        teacher: The frozen teacher (same tokenizer as the student: token-level correspondence), on the device it
            scores on (a GPU's teacher scores on a stream of its own).
        max_batch: Most pending turns scored in one padded forward.
        pad_token_id: Id used for right padding (masked out by the attention mask).
        cpus: Cores the scoring thread runs on (``os.sched_setaffinity`` of that thread only), e.g. the rollout
            pool's, as a separate teacher pool would be; ``None``: wherever the creating process runs (then the
            teacher competes with the learner for its cores).
        chunk_tokens: Most rows of logits the teacher's head holds at a time (only scored rows reach it: a scored
            batch never builds T×V logits).

    Raises:
        ValueError: if ``cpus`` is empty or names a core this machine does not have.
    """

    def __init__(
        self,
        teacher: torch.nn.Module,
        max_batch: int = 8,
        pad_token_id: int = 0,
        cpus: Sequence[int] | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        check_cores("TeacherScorer", cpus)
        self.teacher = teacher.eval().requires_grad_(False)
        self.max_batch = max_batch
        self.pad_token_id = pad_token_id
        self.chunk_tokens = chunk_tokens
        self.cpus = None if cpus is None else tuple(cpus)
        self._requests: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="teacher-scorer", daemon=True)
        self._closed = False
        self._worker.start()

    def submit(self, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> Future[torch.Tensor]:
        """Queue one turn; resolves to ``(|M|,)`` float32 log π_T of its scored tokens, in position order."""
        if self._closed:
            raise RuntimeError("TeacherScorer is closed")
        future: Future[torch.Tensor] = Future()
        self._requests.put((token_ids, scored_mask, future))
        return future

    def score(self, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> torch.Tensor:
        """Blocking form of :meth:`submit`."""
        return self.submit(token_ids, scored_mask).result()

    def close(self) -> None:
        """Finish queued work, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._requests.put(None)
            self._worker.join()

    def __enter__(self) -> TeacherScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        if self.cpus is not None:
            place_this_thread(self.cpus)
        device = next(self.teacher.parameters()).device
        if device.type == "cuda":  # its own stream: scoring overlaps the learner's kernels instead of queuing behind
            torch.cuda.set_device(device)
            with torch.cuda.stream(torch.cuda.Stream(device)):
                self._serve_requests()
        else:
            self._serve_requests()

    def _serve_requests(self) -> None:
        while True:
            first = self._requests.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self._requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._requests.put(None)  # stop after this batch
                    break
                batch.append(item)
            self._score_batch(batch)

    @torch.inference_mode()
    def _score_batch(self, batch: list) -> None:
        try:
            scores = batched_scored_logprobs(
                self.teacher,
                [ids for ids, _, _ in batch],
                [mask for _, mask, _ in batch],
                self.pad_token_id,
                self.chunk_tokens,
            )
        except Exception as error:  # one bad turn must not strand the others: retry them one by one
            if len(batch) == 1:
                batch[0][2].set_exception(error)
                return
            for item in batch:
                self._score_batch([item])
            return
        for (_, _, future), logprobs in zip(batch, scores, strict=True):
            future.set_result(logprobs.float().cpu())
