"""Byte-level BPE (GPT-2, OPT) as plain TensorFlow ops, for SavedModels that take and return text.

It gives the ids of the `tokenizers` library's ByteLevel pre-tokenizer + BPE model (+ an optional
template of special tokens around the text) and decodes as `decode(..., skip_special_tokens=True)`,
with only core ops (`tf.strings`, `tf.lookup` tables, a `tf.while_loop`), so a SavedModel using it
loads with `import tensorflow` alone (no tensorflow-text).

How it matches the library:
  * Added tokens are cut out of the text first (longest first), as the library's added vocabulary does.
  * GPT-2's split regex has a look-ahead (`\\s+(?!\\S)`), which RE2 lacks. A whitespace run of two or
    more before a non-space keeps its last character for the next word; so a first pass cuts such a
    run before its last character, and a second pass splits each part with the regex minus the
    look-ahead, which then gives the same pieces. `\\s` is spelled out as Unicode White_Space (RE2's
    `\\s` is ASCII only).
  * Merges: each round merges, in every piece, all occurrences (left to right, non-overlapping) of
    the piece's lowest-ranked pair, until no pair has a rank: the same result as the library's
    priority queue.
  * Decoding joins each id's bytes (precomputed from the library's decoder) and replaces invalid
    UTF-8 with U+FFFD, as `String::from_utf8_lossy` does.

Divergence: the NUL character is reserved as a separator; a text containing it is rejected.
"""

from __future__ import annotations

import json

import tensorflow as tf

_SEP = "\x00"
_WHITE = r"\t\n\x0b\x0c\r \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
# Pass 1: a whitespace run before a non-space is cut before its last character.
_CUT_RUNS = rf"([{_WHITE}]+)([{_WHITE}][^{_WHITE}])"
# Pass 2: GPT-2's pattern without the look-ahead alternative.
_PIECE = rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?\p{{N}}+| ?[^{_WHITE}\p{{L}}\p{{N}}]+|[{_WHITE}]+"
_NO_RANK = 2**31 - 1
# transformers' `clean_up_tokenization` replacements, in order.
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class UnsupportedTokenizer(ValueError):
    """The tokenizer cannot run in the graph (the message says which part and why)."""


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character map: the symbol of byte b is `_byte_symbols()[b]`."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _check(state: dict) -> None:
    """Raises UnsupportedTokenizer unless `state` (tokenizer.json) is a byte-level BPE this module runs."""
    model, pre, decoder = state.get("model") or {}, state.get("pre_tokenizer") or {}, state.get("decoder") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"the model is {model.get('type')}, not byte-level BPE (text signatures are for GPT-2/OPT-"
                        "style tokenizers; a T5/SentencePiece Unigram model is not implemented in-graph)")
    elif model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
            or model.get("byte_fallback"):
        problems.append("the BPE model uses dropout, subword prefixes/suffixes or byte fallback")
    if state.get("normalizer") is not None:
        problems.append(f"it has a normalizer ({state['normalizer'].get('type')})")
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        problems.append(f"the pre-tokenizer is {pre.get('type')}, not ByteLevel with GPT-2's regex")
    if decoder.get("type") != "ByteLevel":
        problems.append(f"the decoder is {decoder.get('type')}, not ByteLevel")
    post = state.get("post_processor") or {"type": "ByteLevel"}
    if post.get("type") not in ("ByteLevel", "TemplateProcessing"):
        problems.append(f"the post-processor is {post.get('type')}")
    for token in state.get("added_tokens", []):
        if token.get("single_word") or token.get("lstrip") or token.get("rstrip"):
            problems.append(f"added token {token['content']!r} uses single_word/lstrip/rstrip matching")
    if problems:
        raise UnsupportedTokenizer("; ".join(problems))


def _template_ids(post: dict | None) -> tuple[list[int], list[int]]:
    """The special ids a TemplateProcessing post-processor puts before and after a single text."""
    if not post or post.get("type") != "TemplateProcessing":
        return [], []
    before, after, seen_text = [], [], False
    for item in post["single"]:
        if "Sequence" in item:
            seen_text = True
            continue
        ids = post["special_tokens"][item["SpecialToken"]["id"]]["ids"]
        (after if seen_text else before).extend(ids)
    return before, after


def _table(keys, values, key_dtype, value_dtype, default) -> tf.lookup.StaticHashTable:
    initializer = tf.lookup.KeyValueTensorInitializer(tf.constant(keys, key_dtype), tf.constant(values, value_dtype))
    return tf.lookup.StaticHashTable(initializer, default)


def _literal(text: str) -> str:
    """An RE2 pattern matching `text` literally (every non-alphanumeric character as `\\x{..}`)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _choose_rows(condition, where_true: tf.RaggedTensor, where_false: tf.RaggedTensor) -> tf.RaggedTensor:
    """Row i of `where_true` where `condition[i]`, else of `where_false` (both `[N, (?)]`)."""
    keep_true = tf.gather(condition, where_true.value_rowids())
    keep_false = ~tf.gather(condition, where_false.value_rowids())
    return tf.concat([tf.ragged.boolean_mask(where_true, where_true.with_flat_values(keep_true)),
                      tf.ragged.boolean_mask(where_false, where_false.with_flat_values(keep_false))], axis=1)


def _split_on(strings: tf.Tensor, pattern: str) -> tf.RaggedTensor:
    """`[N]` strings -> `[N, (pieces)]`: a cut before every match of `pattern` (which covers every character)."""
    marked = tf.strings.regex_replace(strings, f"({pattern})", _SEP + r"\1")
    pieces = tf.strings.split(marked, _SEP)
    return tf.ragged.boolean_mask(pieces, pieces != "")


class GraphTokenizer:
    """Encoding and decoding of one byte-level BPE tokenizer with TensorFlow ops.

    Build it eagerly with `from_tokenizer` (it creates lookup tables, which a SavedModel must track:
    see `resources`), then call `encode_batch` / `decode_batch` inside a tf.function.
    """

    def __init__(self, state: dict, specials: set[str], pad_id: int, vocab_size: int, cleanup: bool):
        _check(state)
        model = state["model"]
        self.add_prefix_space = bool(state["pre_tokenizer"].get("add_prefix_space", False))
        self.ignore_merges = bool(model.get("ignore_merges", False))
        self.prefix_ids, self.suffix_ids = _template_ids(state.get("post_processor"))
        self.pad_id = pad_id
        self.cleanup = cleanup
        vocab = dict(model["vocab"])
        added = {token["content"]: token["id"] for token in state.get("added_tokens", [])}
        vocab.update(added)
        symbols = _byte_symbols()
        missing = [b for b, s in enumerate(symbols) if s not in vocab]
        if missing:
            raise UnsupportedTokenizer(f"the vocabulary lacks the symbols of {len(missing)} bytes (e.g. byte "
                                       f"{missing[0]}), so some texts have no byte-level encoding")
        merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
        self.added_pattern = "|".join(_literal(c) for c in sorted(added, key=len, reverse=True))
        self.vocab = _table(list(vocab), list(vocab.values()), tf.string, tf.int32, -1)
        self.ranks = _table([" ".join(pair) for pair in merges], list(range(len(merges))), tf.string, tf.int32,
                            _NO_RANK)
        self.byte_symbols = _table([bytes([b]) for b in range(256)], symbols, tf.string, tf.string, "")
        self.added = _table(list(added) or [_SEP], list(added.values()) or [-1], tf.string, tf.int32, -1)
        size = max(vocab_size, max(vocab.values()) + 1)
        self.id_bytes = tf.constant(_decoded_bytes(vocab, added, specials, symbols, size))

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> GraphTokenizer:
        """From an xlagen tokenizer (its `tokenizers` backend's full state, special tokens included).

        Args:
            tokenizer: An `xlagen.text.tokenizer.PreTrainedTokenizerFast`.
            vocab_size: The model's vocabulary size (ids up to it decode, unknown ones to "").

        Raises:
            UnsupportedTokenizer: saying which part of the tokenizer cannot run in the graph.
        """
        # The wrapper registers special tokens (e.g. an added pad token) on its backend: read its state.
        state = json.loads(tokenizer._backend.to_str())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(state, set(tokenizer.all_special_tokens) | {t["content"] for t in state.get("added_tokens", [])
                                                               if t.get("special")},
                   pad or 0, vocab_size, bool(tokenizer.config.clean_up_tokenization_spaces))

    def resources(self) -> list:
        """The lookup tables (attach them to the saved module so they are saved)."""
        return [self.vocab, self.ranks, self.byte_symbols, self.added]

    def encode(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """string `[B]` -> int32 ids `[B, (T)]`, as the library's `encode(text).ids`."""
        texts = tf.convert_to_tensor(texts, tf.string)
        no_sep = tf.logical_not(tf.reduce_any(tf.strings.regex_full_match(texts, r"(?s).*\x00.*")))
        message = "a text contains the NUL character, which the in-graph tokenizer reserves"
        with tf.control_dependencies([tf.debugging.Assert(no_sep, [message])]):
            texts = tf.identity(texts)
        if self.added_pattern:
            texts = tf.strings.regex_replace(texts, f"({self.added_pattern})", _SEP + r"\1" + _SEP)
        segments = tf.strings.split(texts, _SEP)
        segments = tf.ragged.boolean_mask(segments, segments != "")  # [B, (S)]
        flat = segments.flat_values
        special = self.added.lookup(flat) >= 0
        plain = tf.where(special, "", flat)
        if self.add_prefix_space:
            plain = tf.where(tf.strings.substr(plain, 0, 1) == " ", plain, " " + plain)
            plain = tf.where(special, "", plain)
        runs = tf.strings.split(tf.strings.regex_replace(plain, _CUT_RUNS, r"\1" + _SEP + r"\2"), _SEP)
        runs = tf.ragged.boolean_mask(runs, runs != "")
        parts = runs.with_flat_values(_split_on(runs.flat_values, _PIECE)).merge_dims(1, 2)  # [S, (P)]
        pieces = _choose_rows(special, tf.RaggedTensor.from_tensor(flat[:, None]), parts)
        piece_special = tf.gather(special, pieces.value_rowids())
        byte_level = self.byte_symbols.lookup(tf.strings.bytes_split(tf.where(piece_special, "", pieces.flat_values)))
        raw = tf.RaggedTensor.from_tensor(pieces.flat_values[:, None])
        symbols = _choose_rows(piece_special, raw, byte_level)  # [pieces, (symbols)]
        if self.ignore_merges:
            whole = tf.strings.reduce_join(symbols, axis=1)
            symbols = _choose_rows(self.vocab.lookup(whole) >= 0, tf.RaggedTensor.from_tensor(whole[:, None]), symbols)
        ids = self.vocab.lookup(self._merge(symbols))
        ids = segments.with_flat_values(pieces.with_flat_values(ids)).merge_dims(1, 3)  # [B, (T)]
        rows = ids.nrows()
        parts = [tf.RaggedTensor.from_tensor(tf.tile(tf.constant([self.prefix_ids], tf.int32), [rows, 1]))] \
            if self.prefix_ids else []
        parts.append(ids)
        if self.suffix_ids:
            parts.append(tf.RaggedTensor.from_tensor(tf.tile(tf.constant([self.suffix_ids], tf.int32), [rows, 1])))
        return tf.concat(parts, axis=1) if len(parts) > 1 else ids

    def encode_batch(self, texts: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """string `[B]` -> left-padded `(input_ids int32 [B, T], attention_mask int32 [B, T])`."""
        ids = self.encode(texts)
        lengths = tf.cast(ids.row_lengths(), tf.int32)
        with tf.control_dependencies([tf.debugging.assert_positive(lengths, message="a text encodes to no tokens")]):
            width = tf.reduce_max(tf.concat([lengths, [0]], 0))
        right = ids.to_tensor(default_value=self.pad_id, shape=tf.stack([ids.nrows(), tf.cast(width, tf.int64)]))
        source = tf.range(width)[None, :] - (width - lengths)[:, None]  # [B, T]: column in the unpadded row
        mask = tf.cast(source >= 0, tf.int32)
        padded = tf.gather(right, tf.maximum(source, 0), batch_dims=1)
        return tf.where(mask > 0, padded, self.pad_id), mask

    def decode_batch(self, ids: tf.Tensor) -> tf.Tensor:
        """int `[B, T]` -> string `[B]`, as the library's `decode(ids, skip_special_tokens=True)`."""
        ids = tf.cast(ids, tf.int32)
        known = (ids >= 0) & (ids < tf.shape(self.id_bytes)[0])
        pieces = tf.where(known, tf.gather(self.id_bytes, tf.clip_by_value(ids, 0, tf.shape(self.id_bytes)[0] - 1)),
                          "")
        text = tf.strings.unicode_transcode(tf.strings.reduce_join(pieces, axis=1), "UTF-8", "UTF-8",
                                            errors="replace", replacement_char=0xFFFD,
                                            replace_control_characters=False)
        for before, after in _CLEANUPS if self.cleanup else ():
            text = tf.strings.regex_replace(text, _literal(before), after)
        return text

    def _merge(self, symbols: tf.RaggedTensor) -> tf.RaggedTensor:
        """BPE: merges each piece's lowest-ranked pair (every non-overlapping occurrence) until none is left."""
        rows = symbols.nrows(out_type=tf.int32)

        def body(values, splits, _):
            count = tf.shape(values)[0]
            row_of = tf.ragged.row_splits_to_segment_ids(splits)
            tail = tf.ones([tf.minimum(count, 1)], tf.bool)
            last = tf.concat([row_of[1:] != row_of[:-1], tail], 0)  # the symbol ends its piece
            following = tf.concat([values[1:], tf.fill([tf.minimum(count, 1)], "")], 0)
            rank = tf.where(last, _NO_RANK, self.ranks.lookup(tf.strings.join([values, following], " ")))
            lowest = tf.math.unsorted_segment_min(rank, row_of, rows)
            target = (rank == tf.gather(lowest, row_of)) & (rank < _NO_RANK)  # pair (i, i + 1) merges this round
            continues = tf.concat([[False], target[:-1]], 0)[:count] & target
            group = tf.cumsum(1 - tf.cast(continues, tf.int32)) - 1
            offset = tf.range(count) - tf.gather(tf.math.segment_min(tf.range(count), group), group)
            merge = target & (offset % 2 == 0)  # runs of overlapping pairs merge left to right
            dropped = tf.concat([[False], merge[:-1]], 0)[:count]
            merged = tf.where(merge, tf.strings.join([values, following]), values)
            lengths = tf.math.unsorted_segment_sum(1 - tf.cast(dropped, tf.int32), row_of, rows)
            return (tf.boolean_mask(merged, ~dropped), tf.concat([[0], tf.cumsum(lengths)], 0),
                    tf.reduce_any(merge))

        values, splits, _ = tf.while_loop(
            lambda values, splits, changed: changed, body,
            (symbols.flat_values, tf.cast(symbols.row_splits, tf.int32), tf.constant(True)),
            shape_invariants=(tf.TensorShape([None]), tf.TensorShape([None]), tf.TensorShape([])))
        return tf.RaggedTensor.from_row_splits(values, tf.cast(splits, tf.int64))


def _decoded_bytes(vocab: dict, added: dict, specials: set, symbols: list[str], size: int) -> list[bytes]:
    """Each id's bytes in decoded text: byte symbols mapped back, special tokens dropped, unknown ids empty."""
    to_byte = {s: b for b, s in enumerate(symbols)}
    table = [b""] * size
    for token, index in vocab.items():
        if token in specials and token in added:
            continue
        if all(c in to_byte for c in token):
            table[index] = bytes(to_byte[c] for c in token)
        else:  # the library's ByteLevel decoder keeps such tokens' own UTF-8
            table[index] = token.encode("utf-8")
    return table
