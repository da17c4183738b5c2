"""What every causal language model shares: output type, position ids, the cached forward.

Shapes: B batch, T tokens in this call, S cache length (static), V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

from keras import ops


class CausalLMOutput(NamedTuple):
    """Output of a full forward pass; `output.logits` or `output[0]` as in transformers.

    Attributes:
        logits: float32 `[B, T, V]`.
    """

    logits: object


def positions_from_mask(attention_mask):
    """Position ids that skip left padding: the n-th real token gets position n - 1.

    Args:
        attention_mask: `[B, S]` 1/0.

    Returns:
        int32 `[B, S]`; padding positions get 0 (they are masked anyway).
    """
    mask = ops.cast(attention_mask, "int32")
    return ops.maximum(ops.cumsum(mask, axis=-1) - 1, 0)


def positions_at(attention_mask, cache_index, num_tokens: int):
    """Position ids of the `num_tokens` tokens written at `cache_index`.

    Args:
        attention_mask: `[B, S]` over the whole cache.
        cache_index: int32 scalar.
        num_tokens: T.

    Returns:
        int32 `[B, T]`.
    """
    columns = ops.cast(cache_index, "int32") + ops.arange(num_tokens, dtype="int32")
    return ops.take(positions_from_mask(attention_mask), columns, axis=1)


class DecoderState(NamedTuple):
    """What a decoder-only model carries between steps; every tensor has the batch on axis 0.

    Attributes:
        cache: The static KV cache (`xlagen.cache`).
        attention_mask: int32 `[B, S]`, the prompt's mask followed by ones for new tokens.
    """

    cache: tuple
    attention_mask: object


class CausalDecoding:
    """The decoding contract of a decoder-only model, built on `init_cache` / `call_with_cache`.

    Generation calls only `prefill` and `decode_step`; the state they pass around is an opaque nest
    whose tensors all have the batch on axis 0, so beam search can reorder it generically.
    """

    def prefill(self, input_ids, attention_mask, total_length: int):
        """Runs the prompt and returns the next-token logits and the decoding state.

        Args:
            input_ids: int32 `[B, P]` (left-padded).
            attention_mask: `[B, P]` 1/0.
            total_length: S = P + new tokens, the static cache length.

        Returns:
            `(logits float32 [B, V] of the last prompt position, DecoderState)`.
        """
        batch, prompt_length = ops.shape(input_ids)[0], input_ids.shape[1]
        mask = ops.concatenate([ops.cast(attention_mask, "int32"),
                                ops.ones((batch, total_length - prompt_length), "int32")], axis=1)
        cache = self.init_cache(batch, total_length)
        logits, cache = self.call_with_cache(input_ids, cache, ops.zeros((), "int32"), mask, last_only=True)
        return logits[:, -1], DecoderState(cache, mask)

    def decode_step(self, token_ids, index, state: DecoderState):
        """Runs one token per row written at `index`.

        Args:
            token_ids: int32 `[B, 1]`.
            index: int32 scalar, the token's position in the cache.
            state: From `prefill` (or a previous step).

        Returns:
            `(logits float32 [B, V], new state)`.
        """
        logits, cache = self.call_with_cache(token_ids, state.cache, index, state.attention_mask)
        return logits[:, -1], state._replace(cache=cache)
