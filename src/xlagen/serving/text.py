"""Text of a token stream: incremental decoding that never splits a character, and stop strings.

Numpy-free and TensorFlow-free: the engine thread runs these per token.
"""

from __future__ import annotations

# Prompt tokens decoded with the first new ones, so that a tokenizer that drops or adds a leading space at
# the start of a text (SentencePiece) gives the first piece its space as in the whole text.
_CONTEXT_TOKENS = 4


class IncrementalDecoder:
    """Turns token ids, one at a time, into the pieces of text they add.

    A byte-level BPE token may hold part of a UTF-8 character, and a tokenizer's decoding of a token can
    depend on its neighbours; each piece is the difference between the decoding of a short window ending
    with the new token and of the same window without it, held back while it ends with an incomplete
    character (U+FFFD), as text-generation-inference does.

    Args:
        tokenizer: Anything with `decode(ids, skip_special_tokens=...)`.
        context: Prompt ids to decode with the first new tokens (their text is not emitted).
    """

    def __init__(self, tokenizer, context=()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in list(context)[-_CONTEXT_TOKENS:]]
        self.prefix = 0  # the window starts here
        self.read = len(self.ids)  # the text of ids[:read] was emitted

    def _text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes ('' while a character is still incomplete)."""
        self.ids.append(int(token_id))
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end of the stream), as decoded."""
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


class StopStrings:
    """Finds stop strings in streamed text; the text before the first stop string is released, the
    rest never.

    Text that could be the start of a stop string is held back until it is not (or the stream ends).

    Args:
        stops: The stop strings (non-empty).
    """

    def __init__(self, stops=()):
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Adds `text`; returns `(text to release now, whether a stop string was found)`."""
        if not self.stops:
            return text, False
        self.held += text
        found = [self.held.find(stop) for stop in self.stops]
        found = [at for at in found if at >= 0]
        if found:
            released, self.held = self.held[:min(found)], ""
            return released, True
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if self.held.endswith(stop[:n])),
                   default=0)
        released, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return released, False

    def flush(self) -> str:
        """The held-back text (the stream ended without a stop string)."""
        released, self.held = self.held, ""
        return released


class TokenText:
    """The text rules of one request's new tokens: each token's text piece (`IncrementalDecoder`), stop ids
    and stop strings (`StopStrings`).

    Args:
        tokenizer: Decodes ids.
        context: Prompt ids decoded before the first new token (their text is not emitted).
        stop_ids: Ids that end the request (EOS and `stop_token_ids`); their text is never emitted.
        stops: Stop strings; the text from the first one on is never emitted.
    """

    def __init__(self, tokenizer, context=(), stop_ids=(), stops=()):
        self.decoder = IncrementalDecoder(tokenizer, context)
        self.stops = StopStrings(stops)
        self.stop_ids = frozenset(stop_ids)

    def add(self, token_id: int) -> tuple[str, bool]:
        """`(the text token_id releases, whether it ended the request)`: a stop id releases what was held
        back; a stop string releases the text before it."""
        if token_id in self.stop_ids:
            return self.finish()[0], True
        return self.stops.feed(self.decoder.add(token_id))

    def finish(self) -> tuple[str, bool]:
        """`(the text still held back, whether it completes a stop string)` at the end of the request (no more
        tokens will come): the decoder's held-back bytes may complete a stop string only now."""
        text, found = self.stops.feed(self.decoder.flush())
        return (text, True) if found else (text + self.stops.flush(), False)
