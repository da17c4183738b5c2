"""Prompts as the slots take them: text or ids checked, padded to a length bucket, and split by the model
into its decoder prompt and its other inputs (an encoder's)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from xlagen.models.base import EncoderDecoderLM
from xlagen.serving.streams import ContextTooLong


@dataclass
class Prepared:
    """A prompt as the slots take it: the (decoder) prompt left-padded, and the model's other inputs."""

    ids: np.ndarray  # int32 [1, Pb]
    mask: np.ndarray  # int32 [1, Pb]
    extra: dict
    real_length: int  # real tokens of the decoder prompt: the columns a slot uses before new tokens
    prompt_tokens: int
    context: tuple  # prompt ids whose text precedes the output (incremental decoding)


def bucket_of(length: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= `length` (`ContextTooLong`, a ValueError, past the largest)."""
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ContextTooLong(length, None, buckets[-1], message=(
            f"prompt of {length} tokens is longer than the largest prompt bucket {buckets[-1]} (prompt_buckets="
            f"{buckets}); shorten it or build the Engine with larger buckets"))
    return buckets[index]


class Prompts:
    """Prepares the prompts of one model.

    Args:
        model: The model (its `generation_inputs` splits an encoder-decoder's inputs).
        tokenizer: Encodes text prompts.
        buckets: Ascending prompt lengths (decoder-only: the prompt, left-padded; encoder-decoder: the
            encoder's input, right-padded).
    """

    def __init__(self, model, tokenizer, buckets: tuple[int, ...]):
        self.model, self.tokenizer, self.buckets = model, tokenizer, buckets
        self.encoder_decoder = isinstance(model, EncoderDecoderLM)

    def _speech(self, features: np.ndarray) -> Prepared:
        if features.ndim != 2:
            raise ValueError(f"speech features must be [mel bins, frames], got shape {features.shape}")
        features = features[None].astype(np.float32)
        config = self.model.generation_config
        ids = self.model.forced_decoder_prompt(features, config)  # the model's own prompt (Whisper's), or None
        decoder_ids, decoder_mask, extra = self.model.generation_inputs(features, None, config.decoder_start_token_id,
                                                                        ids, None)
        decoder_ids, decoder_mask = np.asarray(decoder_ids, np.int32), np.asarray(decoder_mask, np.int32)
        extra = {name: np.asarray(value) for name, value in extra.items()}
        return Prepared(decoder_ids, decoder_mask, extra, int(decoder_mask.sum()), decoder_ids.shape[1], ())

    def _generation_inputs(self, ids: list[int]):
        """The model's decoder prompt and other inputs for prompt `ids` (an encoder's input is right-padded
        to its bucket): numpy `ids [1, P']`, `mask [1, P']`, dict `extra`."""
        length = len(ids)
        bucket = bucket_of(length, self.buckets)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :length] = ids
        mask = (np.arange(bucket) < length).astype(np.int32)[None]
        decoder_ids, decoder_mask, extra = self.model.generation_inputs(padded, mask)
        return (np.asarray(decoder_ids, np.int32), np.asarray(decoder_mask, np.int32),
                {name: np.asarray(value) for name, value in extra.items()})

    def token_ids(self, prompt) -> list[int]:
        """The ids of a text prompt (`tokenizer.encode`), or prompt ids checked.

        Raises:
            TypeError: for a prompt that is neither text nor a flat sequence of ints.
            ValueError: for an empty prompt or an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            ids = [int(i) for i in self.tokenizer.encode(prompt)]
        else:
            array = np.asarray(prompt)
            if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
                raise TypeError(f"prompt must be a string or a flat sequence of int token ids, got "
                                f"{type(prompt).__name__} {str(prompt)[:60]}")
            ids = [int(i) for i in array]
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def prepare(self, prompt) -> Prepared:
        """`prompt` (text or ids) padded to its bucket and split for the model (see `token_ids` for errors);
        for a speech model, float log-mel features `[mel bins, frames]` and its decoder prompt (start, language,
        task, no-timestamps, the language detected when the generation config names none)."""
        if isinstance(prompt, np.ndarray) and np.issubdtype(prompt.dtype, np.floating) and self.encoder_decoder:
            return self._speech(prompt)
        ids = self.token_ids(prompt)
        if self.encoder_decoder:
            decoder_ids, decoder_mask, extra = self._generation_inputs(ids)
            return Prepared(decoder_ids, decoder_mask, extra, int(decoder_mask.sum()), len(ids), ())
        bucket = bucket_of(len(ids), self.buckets)
        padded, mask = np.zeros((1, bucket), np.int32), np.zeros((1, bucket), np.int32)
        padded[0, bucket - len(ids):], mask[0, bucket - len(ids):] = ids, 1
        return Prepared(padded, mask, {}, len(ids), len(ids), tuple(ids))
