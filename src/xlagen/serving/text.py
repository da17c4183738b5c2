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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


class TokenPieces:
    """Each token's own bytes and text, as OpenAI's logprobs report them (the token alone, not the difference
    it makes to the decoded text): a byte-level BPE token's bytes (possibly part of a character), a
    SentencePiece byte-fallback token's byte, a SentencePiece word piece with its leading space.

    Args:
        tokenizer: An xlagen tokenizer (its `tokenizers.Tokenizer` decides how tokens map to bytes).
    """

    def __init__(self, tokenizer):
        import json

        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_backend", None)
        decoder = getattr(backend, "decoder", None)
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {part.get("type") for part in state.get("decoders", [state])}
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._spaces = bool(kinds & {"Metaspace", "Replace"})
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for."""
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if token is None:
            return b""
        if int(token_id) in self._special:
            return token.encode("utf-8")
        if self._byte_level is not None and all(c in self._byte_level for c in token):
            return bytes(self._byte_level[c] for c in token)
        if self._byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if self._spaces:
            return token.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([int(token_id)]).encode("utf-8")

    def text_of(self, token_id: int) -> str:
        """The token's text; a token holding part of a character is written as its bytes, `bytes:\\xe2\\x80`."""
        data = self.bytes_of(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
