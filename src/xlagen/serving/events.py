"""A request's generated token ids as the engine reports them, for a path that generates all tokens before it
reports them (the request batcher): one `TokenEvent` per token, with the engine's text rules (incremental
decoding that never splits a character, stop strings cut from the text) and stop rules (EOS and
`stop_token_ids` end the request, reported without text), and the `Completion`."""

from __future__ import annotations

from collections.abc import Sequence

from xlagen.serving.options import RequestOptions
from xlagen.serving.streams import Completion, TokenEvent
from xlagen.serving.text import TokenText


def token_events(tokenizer, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float] | None,
                 options: RequestOptions, eos_ids: Sequence[int], top_logprobs=None) -> list[TokenEvent]:
    """The events of a request whose tokens are all known.

    Args:
        tokenizer: Decodes ids.
        prompt: The prompt's ids (context for decoding the first tokens, as the engine does).
        tokens: The generated ids (at most `options.max_new_tokens`).
        logprobs: One log-probability per token, or None.
        options: The request's options (`stop`, `stop_token_ids`).
        eos_ids: The model's EOS ids.
        top_logprobs: Per token, `(id, logprob)` pairs of the most likely tokens, or None.

    Returns:
        The events; the last has the finish reason ("stop" or "length").
    """
    text_rules = TokenText(tokenizer, prompt, set(eos_ids) | set(options.stop_token_ids), options.stop)
    events: list[TokenEvent] = []
    for index, token in enumerate(tokens):
        logprob = None if logprobs is None else float(logprobs[index])
        text, ended = text_rules.add(token)
        last = index == len(tokens) - 1
        if last and not ended:  # the held-back text may complete a stop string
            rest, ended = text_rules.finish()
            text += rest
        top = None if top_logprobs is None else tuple(top_logprobs[index])
        events.append(TokenEvent(int(token), text, logprob, "stop" if ended else "length" if last else None, top))
        if ended:
            break
    return events


def completion_of(events: Sequence[TokenEvent], prompt_tokens: int, logprobs: bool) -> Completion:
    """The `Completion` made of a request's events."""
    ids = tuple(e.token_id for e in events if e.token_id is not None)
    reason = events[-1].finish_reason if events else "length"
    top = tuple(e.top_logprobs for e in events) if events and events[0].top_logprobs is not None else None
    return Completion("".join(e.text for e in events), ids, reason, prompt_tokens, len(ids),
                      tuple(e.logprob for e in events) if logprobs else None, top)
