"""The segmentation rule: a call that continues its segment keeps the sampled ids and tokenizes only what is new; one
that rewrites the history starts a segment."""

from __future__ import annotations

from gateway_fakes import character_ids

from tslightning.rollout.gateway.conversation import ChatTokens, SegmentContext

SYSTEM = {"role": "system", "content": "Reply with one command."}
USER = {"role": "user", "content": "Count the lines of /app/input.txt"}


def _after_reply(chat: ChatTokens, messages, sampled: list[int]):
    """The segment after sampling ``sampled`` (ending with the end-of-turn token) for ``messages``, and the reply's
    content as a harness receives it."""
    first = chat.continuation(None, chat.render(messages))
    content, text = chat.sampled_text(tuple(sampled), stopped=True)
    return SegmentContext(first.prompt_ids + tuple(sampled), first.text + text), content, first


def test_a_continuation_keeps_the_sampled_ids_though_they_retokenize_otherwise(tokenizer):
    chat = ChatTokens(tokenizer)
    sampled = character_ids(tokenizer, "wc -l input.txt") + [tokenizer.eos_token_id]
    segment, content, first = _after_reply(chat, [SYSTEM, USER], sampled)
    assert content == "wc -l input.txt"
    assert tokenizer.encode(content, add_special_tokens=False) != sampled[:-1]  # the proof needs ids that differ

    observation = {"role": "user", "content": "3 input.txt"}
    messages = [SYSTEM, USER, {"role": "assistant", "content": content}, observation]
    call = chat.continuation(segment, chat.render(messages))

    assert not call.new_segment
    assert call.prompt_ids[: len(first.prompt_ids) + len(sampled)] == first.prompt_ids + tuple(sampled)
    new_text = "\n<|im_start|>user\n3 input.txt<|im_end|>\n<|im_start|>assistant\n"
    assert call.new_ids == tuple(tokenizer.encode(new_text, add_special_tokens=False))
    assert call.prompt_ids != tuple(tokenizer.encode(chat.render(messages), add_special_tokens=False))


def test_a_reply_cut_at_its_length_is_closed_by_the_template_as_new_context(tokenizer):
    chat = ChatTokens(tokenizer)
    sampled = tuple(character_ids(tokenizer, "ls -"))
    first = chat.continuation(None, chat.render([SYSTEM, USER]))
    content, text = chat.sampled_text(sampled, stopped=False)
    segment = SegmentContext(first.prompt_ids + sampled, first.text + text)
    messages = [SYSTEM, USER, {"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
    call = chat.continuation(segment, chat.render(messages))
    assert not call.new_segment and call.new_ids[0] == tokenizer.eos_token_id  # unscored, like the loop's closing


def test_a_rewritten_history_starts_a_segment_at_the_first_difference(tokenizer):
    chat = ChatTokens(tokenizer)
    sampled = character_ids(tokenizer, "cat input.txt") + [tokenizer.eos_token_id]
    segment, content, _ = _after_reply(chat, [SYSTEM, USER], sampled)
    summary = {"role": "user", "content": "Summary: you listed the file."}
    rewritten = [SYSTEM, summary, {"role": "user", "content": "Now count its lines."}]
    call = chat.continuation(segment, chat.render(rewritten))
    assert call.new_segment
    assert call.prompt_ids == tuple(tokenizer.encode(chat.render(rewritten), add_special_tokens=False))
    system = tokenizer.apply_chat_template([SYSTEM], tokenize=False)
    assert call.divergence == len(system + "<|im_start|>user\n")  # where "Count ..." became "Summary: ..."

    edited = [SYSTEM, USER, {"role": "assistant", "content": content.strip() + " "}, {"role": "user", "content": "x"}]
    assert chat.continuation(segment, chat.render(edited)).new_segment  # an edited reply is a rewrite too


def test_token_id_prompts_continue_on_ids(tokenizer):
    chat = ChatTokens(tokenizer)
    segment = SegmentContext((5, 6, 7, 8), None)
    assert chat.continuation(segment, [5, 6, 7, 8, 9, 10]).new_ids == (9, 10)
    assert chat.continuation(segment, [5, 6, 9]).new_segment
    assert chat.continuation(segment, [5, 6, 9]).divergence == 2
