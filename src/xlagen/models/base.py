"""What every language model shares: output type, position ids, the decoding contract, the cached
forward of decoder-only models.

Shapes: B batch, T tokens in this call, S cache length (static), H heads, D head dim, V vocab.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import keras
from keras import ops

from xlagen import cache as cache_lib
from xlagen.layers.attention import FoldedMemory, causal_mask, padding_mask
from xlagen.layers.block import run_blocks
from xlagen.models.training import unpack_inputs


class CausalLMOutput(NamedTuple):
    """Output of a full forward pass; `output.logits` or `output[0]` as in transformers.

    Attributes:
        logits: float32 `[B, T, V]`.
    """

    logits: object


class Seq2SeqLMOutput(NamedTuple):
    """Output of an encoder-decoder full forward pass; `output.logits` or `output[0]` as in transformers.

    Attributes:
        logits: float32 `[B, T, V]` over the decoder positions.
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


def column_positions(attention_mask):
    """Position ids 0..T-1 of every row whatever the mask (what transformers' forward uses by default; it
    derives them from the mask only in generate()).

    Args:
        attention_mask: `[B, T]`.

    Returns:
        int32 `[B, T]`.
    """
    length = ops.shape(attention_mask)[1]
    return ops.broadcast_to(ops.arange(length, dtype="int32")[None, :], ops.shape(attention_mask))


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
    """What a model carries between decoding steps; every tensor has the batch on axis 0 (in the beam
    layout, the cache, slots and context have the prompts on axis 0, the cache and slots each prompt's K
    beams inside).

    Attributes:
        cache: The static KV cache of the (decoder's) self-attention (`xlagen.cache`).
        attention_mask: int32 `[B, S]`, the prompt's mask followed by ones for new tokens.
        context: Read-only tensors the decoder attends to besides its cache, from `encode_context`:
            `()` for decoder-only models, an `EncoderContext` for encoder-decoder models.
        slots: `()`, or with the cache in the beam layout (`expand_beams`), int32 `[G, K, S]`: which of
            its prompt's K slots holds each position of each beam's history.
    """

    cache: tuple
    attention_mask: object
    context: object = ()
    slots: object = ()


class EncoderContext(NamedTuple):
    """An encoder's output as the decoder's cross-attention sees it, computed once per generation.

    Attributes:
        memory: Per decoder layer, the cross-attention keys `[B, H, D, L]` (transposed once) and values
            `[B, H, L, D]` as a `LayerCache` (see `CrossAttention.project_memory`); or, with `states`, the
            layer's key kernel transposed (`CrossAttention.folded_key_kernel`).
        mask: int32 `[B, L]`, the encoder input's attention mask; or `()` when every position is real
            (Whisper), so that cross-attention runs unmasked (and can be the fused native kernel).
        states: `()`, or the encoder output `[B, L, hidden]` that every layer attends to with its
            projections folded in (`native.memory_attention`).
    """

    memory: tuple
    mask: object
    states: object = ()

    def key_mask(self):
        """The cross-attention's mask, bool `[B, 1, 1, L]` (`attention.padding_mask`), or None without one."""
        return None if isinstance(self.mask, tuple) else padding_mask(self.mask)

    def layer_memories(self) -> tuple:
        """Each decoder layer's `memory` argument of `CrossAttention.call`."""
        if isinstance(self.states, tuple):
            return self.memory
        return tuple(FoldedMemory(self.states, key_kernel_t) for key_kernel_t in self.memory)

    def projected(self, decoder_blocks) -> "EncoderContext":
        """This context with every layer's keys and values projected (`CrossAttention.project_memory`):
        what beam search attends over, where a prompt's K beams share one memory row and the folded
        attention would compute K times as much per step."""
        if isinstance(self.states, tuple):
            return self
        memory = tuple(block.cross_attention.project_memory(self.states) for block in decoder_blocks)
        return EncoderContext(memory, self.mask)


def decoder_start_prompt(batch, default_start, decoder_start_token_id=None, decoder_input_ids=None,
                         decoder_attention_mask=None):
    """An encoder-decoder model's decoder prompt `(ids [B, P'], mask [B, P'])`: `decoder_input_ids` (mask
    all ones unless given), else the start token (`decoder_start_token_id`, or the model's `default_start`).

    Raises:
        ValueError: when there is no decoder prompt and no start token.
    """
    if decoder_input_ids is not None:
        mask = ops.ones_like(decoder_input_ids) if decoder_attention_mask is None else decoder_attention_mask
        return decoder_input_ids, mask
    start = default_start if decoder_start_token_id is None else decoder_start_token_id
    if start is None:
        raise ValueError("generate() needs a decoder_start_token_id (in generation_config.json, config.json "
                         "or as an argument)")
    return ops.full((batch, 1), start, "int32"), ops.ones((batch, 1), "int32")


def encoder_context(decoder_blocks, encoder_output, attention_mask, fold: bool = False) -> EncoderContext:
    """The `EncoderContext` of an encoder output `[B, L, hidden]`: each decoder block's cross-attention
    keys/values (projected once) and the encoder mask `[B, L]` (None: every position is real).

    With `fold` (a generation's context, not a training forward pass), where every block's cross-attention
    `can_fold`, the context keeps the encoder output itself and each block's transposed key kernel instead
    (`CrossAttention.folded_key_kernel`); `EncoderContext.projected` turns it into the projected form."""
    mask = () if attention_mask is None else ops.cast(attention_mask, "int32")
    attentions = [block.cross_attention for block in decoder_blocks]
    if fold and all(attention.can_fold(encoder_output, attention_mask) for attention in attentions):
        memory = tuple(attention.folded_key_kernel() for attention in attentions)
        return EncoderContext(memory, mask, encoder_output)
    return EncoderContext(tuple(attention.project_memory(encoder_output) for attention in attentions), mask)


def extend_mask(attention_mask, total_length: int):
    """The prompt's mask `[B, P]` followed by ones up to `[B, total_length]` (the generated tokens)."""
    batch, prompt_length = ops.shape(attention_mask)[0], attention_mask.shape[1]
    return ops.concatenate([ops.cast(attention_mask, "int32"),
                            ops.ones((batch, total_length - prompt_length), "int32")], axis=1)


class CausalDecoding:
    """The decoding contract, built on `init_cache` / `call_with_cache`.

    Generation calls `generation_inputs`, then `prefill` and `decode_step`; the state they pass around
    is an opaque nest (a `DecoderState`). Beam search turns it into K beams per prompt with
    `expand_beams` and continues chosen beams with `reorder_state`. Decoder-only models use everything
    as is (`DecoderOnlyLM`); encoder-decoder models build on `EncoderDecoderLM`.
    """

    def generation_inputs(self, input_ids, attention_mask, decoder_start_token_id=None, decoder_input_ids=None,
                          decoder_attention_mask=None):
        """Splits `generate`'s inputs into the prompt the decoder continues and the inputs of `encode_context`.

        Args:
            input_ids: int32 `[B, P]`.
            attention_mask: int32 `[B, P]`.
            decoder_start_token_id: First decoder token (encoder-decoder models).
            decoder_input_ids: Optional decoder prompt `[B, P']` (encoder-decoder models).
            decoder_attention_mask: Optional `[B, P']` mask of `decoder_input_ids`.

        Returns:
            `(prompt_ids [B, P'], prompt_mask [B, P'], extra)`: the sequences `generate` returns start
            with the prompt; `extra` is a dict of `[B, L]` tensors passed to `prefill` as keywords.

        Raises:
            ValueError: for decoder inputs given to a decoder-only model.
        """
        if decoder_input_ids is not None or decoder_attention_mask is not None:
            raise ValueError(f"{type(self).__name__} is a decoder-only model: give the prompt as input_ids "
                             "(decoder_input_ids and decoder_attention_mask are for encoder-decoder models)")
        return input_ids, attention_mask, {}

    def encode_context(self, **extra):
        """What the decoder attends to besides its own cache (`extra` from `generation_inputs`); () here."""
        if extra:
            raise TypeError(f"{type(self).__name__} takes no inputs besides the prompt, got {sorted(extra)}")
        return ()

    def prefill(self, input_ids, attention_mask, total_length: int, **extra):
        """Runs the prompt and returns the next-token logits and the decoding state.

        Args:
            input_ids: int32 `[B, P]` (left-padded).
            attention_mask: `[B, P]` 1/0.
            total_length: S = P + new tokens, the static cache length.
            **extra: The model's other inputs from `generation_inputs` (an encoder's, run here once).

        Returns:
            `(logits float32 [B, V] of the last prompt position, DecoderState)`.
        """
        context = self.encode_context(**extra)
        mask = extend_mask(attention_mask, total_length)
        cache = cache_lib.fresh(self.init_cache(ops.shape(input_ids)[0], total_length))
        logits, cache = self.call_with_cache(input_ids, cache, ops.zeros((), "int32"), mask, last_only=True,
                                             context=context)
        return logits[:, -1], DecoderState(cache, mask, context)

    def decoding_bytes(self, batch_size: int, max_length: int, num_beams: int = 1) -> int:
        """An estimate of the bytes a decoding run holds, without allocating it: the cache of `batch_size`
        prompts of `num_beams` beams over `max_length` positions, and one layer's attention scores of a step
        (in the beam layout each beam scores its prompt's K slots, `[B, H, K, K * S]`)."""
        unit = keras.tree.flatten(self.init_cache(1, 1))  # per layer [1, H, 1, D]: the cache grows with B and S
        per_position = sum(math.prod(t.shape) * _dtype_bytes(t.dtype) for t in unit)
        # Scores have a row per query head: more than the cache's key/value heads with grouped-query attention.
        heads = max(max(t.shape[1] for t in unit), getattr(self.config, "num_heads", 0))
        rows = batch_size * num_beams
        scores = rows * heads * num_beams * max_length * (4 * 2 + 1)  # float32 scores and weights, bool mask
        return rows * max_length * per_position + scores

    def expand_beams(self, state: DecoderState, num_beams: int) -> DecoderState:
        """The state of K = `num_beams` beams per row of a prompt's state (rows `[G]` -> `[G * K]`).

        The attention mask is repeated per beam; the cache goes to the beam layout
        (`xlagen.cache.expand_beams`), where each beam starts from a copy of the prompt in its own slot.
        The encoder context keeps one row per prompt: its K beams attend over it together
        (`CrossAttention.call`), which reads an encoder's keys and values once per step, not K times; a
        folded context is projected here (`EncoderContext.projected`).
        """
        groups, length = ops.shape(state.attention_mask)[0], state.attention_mask.shape[1]
        rows = ops.repeat(ops.arange(groups, dtype="int32"), num_beams)
        mask = cache_lib.batch_gather(state.attention_mask, rows)
        slots = ops.broadcast_to(ops.arange(num_beams, dtype="int32")[None, :, None], (groups, num_beams, length))
        context = state.context
        if isinstance(context, EncoderContext):
            context = context.projected(self.decoder_blocks)
        return DecoderState(cache_lib.expand_beams(state.cache, num_beams), mask, context, slots=slots)

    def reorder_state(self, state: DecoderState, rows) -> DecoderState:
        """The state of `expand_beams`' rows `rows` `[B * K]` (beam search: each beam continues a parent
        beam of the same prompt).

        Only the slots table is gathered: the cache never moves, and the attention mask and encoder
        context are the same for every beam of a prompt (copying an encoder's keys and values every step
        would cost a speech model about one more weight read per step).

        Raises:
            ValueError: for a state that is not in the beam layout.
        """
        if isinstance(state.slots, tuple):
            raise ValueError("reorder_state takes a state from expand_beams (the cache in the beam layout)")
        _, beams, length = state.slots.shape
        slots = ops.take(ops.reshape(state.slots, (-1, length)), rows, axis=0)
        return state._replace(slots=ops.reshape(slots, (-1, beams, length)))

    def decode_step(self, token_ids, index, state: DecoderState):
        """Runs one token per row written at `index`.

        Args:
            token_ids: int32 `[B, 1]`.
            index: int32 scalar, the token's position in the cache.
            state: From `prefill` (or a previous step), or `expand_beams`.

        Returns:
            `(logits float32 [B, V], new state)`.
        """
        if isinstance(state.slots, tuple):
            logits, cache = self.call_with_cache(token_ids, state.cache, index, state.attention_mask,
                                                 context=state.context)
            return logits[:, -1], state._replace(cache=cache)
        # Each beam writes its token into its own slot.
        _, beams, length = state.slots.shape
        own = ops.arange(length, dtype="int32") == ops.cast(index, "int32")
        slots = ops.where(own, ops.arange(beams, dtype="int32")[None, :, None], state.slots)
        logits, cache = self.call_with_cache(token_ids, state.cache, index, state.attention_mask,
                                             context=state.context, slots=slots)
        return logits[:, -1], state._replace(cache=cache, slots=slots)


class EncoderDecoderLM(CausalDecoding):
    """The decoding contract of an encoder-decoder model (T5, Whisper): the encoder runs once per generation
    (`encode_context`), and the decoder's steps attend to its output through the `EncoderContext`.

    A subclass (also a `keras.Model`) defines what is its own:
    - `_encoder_inputs(inputs, attention_mask) -> dict`: the checked inputs of `encode_context` (keywords);
    - `encode_context(**encoder_inputs) -> EncoderContext`;
    - `decoder_cache_shape() -> (layers, heads, head_dim)` of the decoder's self-attention cache;
    - `_decode_cached(token_ids, cache, cache_index, attention_mask, last_only, context, slots)`: the
      decoder's cached forward, `(logits [B, T, V], cache)`.
    """

    def generation_inputs(self, inputs, attention_mask, decoder_start_token_id=None, decoder_input_ids=None,
                          decoder_attention_mask=None):
        """The encoder gets `inputs` (token ids or audio features, with their mask if any); the decoder
        continues `decoder_input_ids`, or starts from its start token.

        Returns:
            `(prompt_ids [B, P'], prompt_mask [B, P'], encoder inputs)`: see `CausalDecoding`.

        Raises:
            ValueError: for encoder inputs the model cannot take, or no decoder start token.
        """
        encoder = self._encoder_inputs(inputs, attention_mask)
        ids, mask = decoder_start_prompt(ops.shape(inputs)[0], self.config.decoder_start_token_id,
                                         decoder_start_token_id, decoder_input_ids, decoder_attention_mask)
        return ids, mask, encoder

    def init_cache(self, batch_size: int, max_length: int, dtype=None):
        """Zero decoder self-attention cache `L x (k, v) [B, H, S, D]`."""
        layers, heads, head_dim = self.decoder_cache_shape()
        return cache_lib.init_cache(layers, batch_size, heads, max_length, head_dim, dtype or self.compute_dtype)

    def call_with_cache(self, token_ids, cache, cache_index, attention_mask, last_only=False, context=None,
                        slots=None):
        """Runs decoder tokens written at `cache_index` against the static cache and the encoder context.

        Args:
            token_ids: int32 `[B, T]`.
            cache: From `init_cache`, `[B, H, S, D]` per layer (or the beam layout, see `slots`).
            cache_index: int32 scalar tensor, the write offset (and the first token's position).
            attention_mask: `[B, S]` 1/0 over the whole cache (prompt mask then ones).
            last_only: Compute logits for the last token only (`T` becomes 1 in the output).
            context: The `EncoderContext` from `encode_context`, of B rows, or of G rows with the beam layout
                (each prompt's K beams attend over its one row).
            slots: For a decoding step over a cache in the beam layout: int32 `[G, K, S]`, see
                `attention.causal_mask`.

        Returns:
            `(logits float32 [B, T, V], updated cache)`.

        Raises:
            TypeError: without an `EncoderContext`.
        """
        if not isinstance(context, EncoderContext):
            raise TypeError(f"{type(self).__name__} decodes against its encoder: pass "
                            "context=model.encode_context(...) (the encoder inputs of generation_inputs)")
        return self._decode_cached(token_ids, cache, cache_index, attention_mask, last_only, context, slots)


def _dtype_bytes(dtype) -> int:
    """Bytes of one element of `dtype` ("float32" -> 4, "bfloat16" -> 2, "bool" -> 1)."""
    bits = re.search(r"\d+$", keras.backend.standardize_dtype(dtype))
    return int(bits.group()) // 8 if bits else 1


class DecoderOnlyLM(CausalDecoding):
    """Embeddings, a stack of `TransformerBlock`s and an LM head: the forward passes of GPT-2 and OPT.

    A subclass (also a `keras.Model`) builds `token_embedding` (a `TokenEmbedding`), `blocks` and
    `lm_head` (None when tied to the token embedding), has a `config` with `num_layers`, `num_heads`
    and `head_dim`, and defines what is its own: `_embed`, `_finish` and `_default_positions`; and, if
    it has them, `_rotary` (rotary position tables for the blocks), `cache_heads` (grouped-query
    attention's key/value heads) and `attention_window` (a sliding window).
    """

    # Each query attends to at most this many positions, its own included (Mistral's sliding window); or one
    # such value (None: no window) per block (Qwen2's sliding layers).
    attention_window: int | tuple[int | None, ...] | None = None

    def _masks(self, attention_mask, cache_index, num_tokens: int, slots=None):
        """The blocks' key masks (`attention.causal_mask`): one for every block, or with a window per block
        a tuple of one per block."""
        window = self.attention_window
        if not isinstance(window, tuple):
            return causal_mask(attention_mask, cache_index, num_tokens, slots, window=window)
        masks = {size: causal_mask(attention_mask, cache_index, num_tokens, slots, window=size) for size in set(window)}
        return tuple(masks[size] for size in window)

    @property
    def cache_heads(self) -> int:
        """The heads the cache holds (the key/value heads)."""
        return self.config.num_heads

    def _rotary(self, positions):
        """Position ids `[B, T]` -> what the blocks rotate queries and keys by (`layers.rotary`), or None."""
        return None

    def _embed(self, token_ids, positions, training=False):
        """token ids and position ids `[B, T]` -> hidden states `[B, T, hidden]`."""
        raise NotImplementedError

    def _finish(self, hidden):
        """Last hidden states `[B, T, hidden]` -> the LM head's input (final norm, projection)."""
        raise NotImplementedError

    def _default_positions(self, attention_mask):
        """Position ids `[B, T]` of `call` when none are given, as the HF model computes them."""
        raise NotImplementedError

    def _forward(self, token_ids, positions, mask, cache=None, cache_index=None, last_only=False, training=False):
        x = self._embed(token_ids, positions, training)
        x, new_cache = run_blocks(self.blocks, x, mask, cache, cache_index, training, rotary=self._rotary(positions),
                                  last_only=last_only)
        x = self._finish(x)
        logits = self.token_embedding.attend(x) if self.lm_head is None else self.lm_head(x)
        return ops.cast(logits, "float32"), new_cache

    def call(self, input_ids, attention_mask=None, position_ids=None, training=False):
        """Full forward pass (training, scoring, parity).

        Args:
            input_ids: int `[B, T]`, or Keras' dict `{"input_ids", "attention_mask"}`.
            attention_mask: Optional `[B, T]` 1/0.
            position_ids: Optional int `[B, T]`; by default what the transformers model uses.
            training: Applies the model's dropout.

        Returns:
            `CausalLMOutput` with float32 logits `[B, T, V]`.

        Raises:
            ValueError: If T exceeds the model's positions.
        """
        input_ids, attention_mask = unpack_inputs(input_ids, attention_mask)
        input_ids = ops.convert_to_tensor(input_ids)
        length = input_ids.shape[1]
        limit = self.config.max_positions  # None: no learned positions, nothing to outgrow
        if length is not None and limit is not None and length > limit:
            raise ValueError(f"input length {length} exceeds the model's {self.config.max_positions} positions")
        if attention_mask is None:
            attention_mask = ops.ones_like(input_ids)
        if position_ids is None:
            position_ids = self._default_positions(attention_mask)
        mask = self._masks(attention_mask, 0, input_ids.shape[1])
        logits, _ = self._forward(input_ids, position_ids, mask, training=training)
        return CausalLMOutput(logits)

    def init_cache(self, batch_size: int, max_length: int, dtype=None):
        """Zero cache `L x (k, v) [B, H, S, D]`."""
        return cache_lib.init_cache(self.config.num_layers, batch_size, self.cache_heads, max_length,
                                    self.config.head_dim, dtype or self.compute_dtype)

    def call_with_cache(self, token_ids, cache, cache_index, attention_mask, last_only=False, context=(),
                        slots=None):
        """Runs `token_ids` written at `cache_index` against the static cache.

        Args:
            token_ids: int32 `[B, T]` (the prompt on the first call, one token per step after).
            cache: From `init_cache`, `[B, H, S, D]` per layer (or the beam layout, see `slots`).
            cache_index: int32 scalar tensor, the write offset.
            attention_mask: `[B, S]` 1/0 over the whole cache (prompt mask then ones).
            last_only: Compute logits for the last token only (`T` becomes 1 in the output).
            context: Unused (decoder-only models attend to nothing else), see `encode_context`.
            slots: For a decoding step over a cache in the beam layout: int32 `[G, K, S]`, see
                `attention.causal_mask`.

        Returns:
            `(logits float32 [B, T, V], updated cache)`.
        """
        num_tokens = token_ids.shape[1]
        positions = positions_at(attention_mask, cache_index, num_tokens)
        mask = self._masks(attention_mask, cache_index, num_tokens, slots)
        return self._forward(token_ids, positions, mask, cache, cache_index, last_only)
