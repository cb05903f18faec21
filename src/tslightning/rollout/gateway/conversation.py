"""Exact token ids for a harness that sends its conversation back as text: the segmentation rule.

A harness speaks text (OpenAI messages, or a raw prompt); the learner must train on the ids the server sampled,
never on a re-tokenization of their text (byte-level BPE decodes many id sequences to the same text, and a sample is
rarely the canonical one). So a trajectory's context is kept as ids *and* as the text those ids stand for:

* A call's prompt is rendered with the policy's chat template (chat completions) or taken as given (completions).
* **Continuation.** If the rendered prompt starts with the segment's text — the previous prompt's text followed by the
  text of the ids sampled for it, including the end-of-turn token the template writes after an assistant message —
  the call continues the segment: its prompt ids are the previous prompt ids, the sampled ids, then the tokenization
  of the remaining text only (the observation, the next message headers). Nothing sampled is ever re-tokenized.
* **Rewrite.** Otherwise the harness rewrote its history (summarised, dropped or edited a message, or its chat
  template re-renders earlier turns differently): the call starts a new segment whose prompt is the tokenization of
  its whole rendered text. Every sampled token keeps the context the server really saw it in (see
  :mod:`tslightning.rollout.gateway.trajectory` for how segments are scored).

Token-id prompts (``/v1/completions`` with a list of ids) follow the same rule on ids directly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChatTokens", "Continuation", "SegmentContext"]


@dataclass(frozen=True)
class SegmentContext:
    """Where a segment stands after a call: its ids (last prompt + sampled ids) and the text they stand for.

    ``text`` is ``None`` for a segment of token-id prompts, which have no text to compare.
    """

    token_ids: tuple[int, ...]
    text: str | None


@dataclass(frozen=True)
class Continuation:
    """One call's prompt, as ids the learner can trust.

    Attributes:
        prompt_ids: The whole prompt: the segment's ids followed by ``new_ids`` (continued), or a fresh tokenization.
        new_ids: The tokens this call added after the segment's ids (the whole prompt for a new segment).
        text: The text ``prompt_ids`` stand for (``None`` for token-id prompts).
        new_segment: The call did not continue the previous segment (first call, or a rewritten history).
        divergence: For a rewrite, the index of the first character (or id) where the prompt left the segment.
    """

    prompt_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    text: str | None
    new_segment: bool
    divergence: int | None = None


class ChatTokens:
    """The policy tokenizer's view of harness calls: chat rendering, continuation ids and sampled text.

    Args:
        tokenizer: The policy's tokenizer, with a chat template whose assistant message is the generation prompt,
            the content and the end-of-turn token (``eos_token``), as ChatML-style templates render it.
    """

    def __init__(self, tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the policy's tokenizer has no eos_token: the gateway ends each turn at it")
        self.tokenizer = tokenizer
        self.end_of_turn = int(tokenizer.eos_token_id)
        self.end_of_turn_text = tokenizer.convert_ids_to_tokens(self.end_of_turn)

    def render(self, messages: list[dict]) -> str:
        """The chat-templated text of ``messages`` ending with the assistant generation prompt."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str) -> tuple[int, ...]:
        """``text``'s ids, with no special tokens added (the template writes its own)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def continuation(self, segment: SegmentContext | None, prompt: str | list[int]) -> Continuation:
        """The ids of a call whose prompt is ``prompt`` (rendered text, or ids), after ``segment`` (``None``: the
        attempt's first call)."""
        if isinstance(prompt, str):
            return self._text_continuation(segment, prompt)
        return self._id_continuation(segment, tuple(prompt))

    def sampled_text(self, token_ids: tuple[int, ...], stopped: bool) -> tuple[str, str]:
        """(content, segment text) of sampled ids: the content the harness receives (the ids before the end-of-turn
        token, special tokens kept as text), and the text they add to the segment (content + end-of-turn token)."""
        body = token_ids[:-1] if stopped else token_ids
        content = self.tokenizer.decode(list(body), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return content, content + (self.end_of_turn_text if stopped else "")

    def _text_continuation(self, segment: SegmentContext | None, text: str) -> Continuation:
        if segment is not None and segment.text is not None and text.startswith(segment.text):
            new = self.encode(text[len(segment.text) :])
            return Continuation(segment.token_ids + new, new, text, new_segment=False)
        ids = self.encode(text)
        return Continuation(ids, ids, text, new_segment=True, divergence=_divergence(segment, text))

    def _id_continuation(self, segment: SegmentContext | None, ids: tuple[int, ...]) -> Continuation:
        known = () if segment is None else segment.token_ids
        if segment is not None and ids[: len(known)] == known:
            return Continuation(ids, ids[len(known) :], None, new_segment=False)
        return Continuation(ids, ids, None, new_segment=True, divergence=_divergence(segment, ids))


def _divergence(segment: SegmentContext | None, prompt: str | tuple[int, ...]) -> int | None:
    """The first index at which ``prompt`` leaves the segment's text (or ids); ``None`` for a first call."""
    if segment is None:
        return None
    known = segment.text if isinstance(prompt, str) and segment.text is not None else segment.token_ids
    if isinstance(prompt, str) and not isinstance(known, str):
        return 0
    same = 0
    for mine, theirs in zip(known, prompt, strict=False):
        if mine != theirs:
            break
        same += 1
    return same
