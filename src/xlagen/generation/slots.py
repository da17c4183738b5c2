"""`SlotDecoder`: the decoding state of a fixed number of independent requests ("slots") kept in variables,
and the compiled programs that fill a slot and advance all of them together (google/JetStream's prefill,
insert and generate step, on xlagen's model contract).

Layout. All slots share one write column, `index` (kept by the caller): a step writes every slot's pending
token at `index`. A request whose prompt is padded (on the left) to a bucket of Pb tokens is inserted at
columns `[index - Pb, index)`; its row of the attention mask is 0 before them, the prompt's mask on them,
and 1 from `index` on. Positions come from the mask (the n-th real token is at n - 1) and T5's relative
biases from column distances, which are contiguous, so every slot decodes as it would alone, with the
model's own `decode_step` at one scalar index. Columns left of a slot's start hold whatever an earlier
request wrote there: the mask hides them. When `index` nears the end of the cache, `shift` moves every
row left by the same number of columns (one copy of the cache, at most once every `margin` steps).

Why variables: a KV cache passed into and out of a compiled function is copied at every call (a 151 MB
cache: 36 ms a call on a 2-core CPU), while a variable is updated in place (0.5 ms).

Shapes: N slots, S cache columns (`max_length + margin`), Pb prompt bucket, V vocab, k steps per call.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from xlagen import native
from xlagen.generation import checks
from xlagen.cache import LayerCache
from xlagen.generation.loop import Prompt, model_ids, prefill, write_column
from xlagen.generation.row_sampling import RowOptions, choose, presence
from xlagen.models.base import DecoderState, EncoderContext


def _margin(max_length: int, steps_per_call: int) -> int:
    """Cache columns beyond `max_length` (a shift moves the slots left at most once every this many steps)."""
    return max(2 * steps_per_call + 2, max_length // 4)


def _roll_left(tensor, amount, axis: int):
    """`tensor` with its `axis` rotated left by a scalar tensor `amount` (the first columns wrap to the end). A
    gather: a slice's begin is a compile-time constant to XLA, which compiled a program per amount."""
    size = tensor.shape[axis]
    return tf.gather(tensor, (tf.range(size) + tf.cast(amount, tf.int32)) % size, axis=axis)


class SlotDecoder:
    """Slots of decoding state in variables, and their compiled programs.

    Not thread-safe: one thread (the serving engine's) calls it.

    Args:
        model: A model with the decoding contract (`xlagen.models.base.CausalDecoding`).
        slots: N, how many requests decode together.
        max_length: The most columns one request may use (its real prompt tokens and its new tokens).
        steps_per_call: k, the most tokens each slot may advance per `step` call (the cache keeps room for them).
        encoder_length: For encoder-decoder models whose encoder output has a mask (T5), the length the
            slots' cross-attention memory is padded to (the largest encoder input bucket); an output without
            a mask (Whisper's, always its 1500 positions) is kept as it is.
        suppress: Ids never generated (Whisper's `suppress_tokens`).
        begin_suppress: Ids not generated as the first new token (Whisper's `begin_suppress_tokens`).
        kernels: Where xlagen's native kernels run in the programs (`xlagen.native.Kernels`; None: the policy
            in force when it is made).

    Raises:
        ValueError: for sizes < 1.
    """

    def __init__(self, model, slots: int, max_length: int, steps_per_call: int = 1, encoder_length: int = 0,
                 suppress: tuple[int, ...] = (), begin_suppress: tuple[int, ...] = (),
                 kernels: native.Kernels | None = None):
        for name, value in (("slots", slots), ("max_length", max_length), ("steps_per_call", steps_per_call)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if kernels is not None and not isinstance(kernels, native.Kernels):
            raise TypeError(f"kernels must be a xlagen.native.Kernels policy, got {type(kernels).__name__}")
        self.model = model
        self.kernels = native.current() if kernels is None else kernels
        self.slots, self.max_length, self.steps_per_call = slots, max_length, steps_per_call
        self.margin = _margin(max_length, steps_per_call)
        self.length = max_length + self.margin
        self.encoder_length = encoder_length
        self.vocab_size = model.config.vocab_size
        self.compiles = 0
        self._banned = self._ban_mask(suppress)
        self._banned_first = self._ban_mask(tuple(suppress) + tuple(begin_suppress))
        self.cache_bytes = self._check_memory(model)
        self._cache = tuple(LayerCache(tf.Variable(k, trainable=False), tf.Variable(v, trainable=False))
                            for k, v in model.init_cache(slots, self.length))
        self._mask = tf.Variable(tf.zeros([slots, self.length], tf.int32), trainable=False)
        self._history = tf.Variable(tf.zeros([slots, self.length], tf.int32), trainable=False)
        self._last = tf.Variable(tf.zeros([slots], tf.int32), trainable=False)
        self._context = ()  # an EncoderContext of variables, made at the first insert of an encoder-decoder model
        self._prefill = self._compiled(self._prefill_program)
        self._chunk = self._compiled(self._chunk_program)
        self._insert = self._compiled(self._insert_program)
        # A step's attention reads a cache of mostly masked columns: `Kernels.slot_step_attention_min_rows`.
        self._step = self._compiled(self._step_program, self.kernels.replace(
            step_attention_min_rows=self.kernels.slot_step_attention_min_rows))
        self._shift = self._compiled(self._shift_program)
        self._shift_cache = self._compiled(self._shift_cache_program)
        self._move = self._compiled(self._move_program)

    @staticmethod
    def memory(model, slots: int, max_length: int, steps_per_call: int = 1) -> tuple[int, int]:
        """`(held, peak)`: the bytes the slots' KV cache, masks and histories hold, and the most they take at
        once (a shift copies one cache variable), for these sizes of `SlotDecoder`."""
        sizes = [int(np.prod(t.shape)) * t.dtype.size for t in keras.tree.flatten(model.init_cache(1, 1))]
        columns = slots * (max_length + _margin(max_length, steps_per_call))
        held = columns * (sum(sizes) + 8)  # + int32 mask and history per column
        return held, held + columns * max(sizes)

    def _check_memory(self, model) -> int:
        """The bytes of the slots' KV cache (and their masks and histories); refuses sizes that would not fit in the
        memory still available, before allocating them.

        Raises:
            ValueError: naming the bytes needed and available, and what lowers them.
        """
        need, peak = self.memory(model, self.slots, self.max_length, self.steps_per_call)
        available = checks.available_memory_bytes()
        if available is not None and peak > available:
            raise ValueError(f"the KV cache of {self.slots} slots x {self.length} columns "
                             f"(max_length {self.max_length} + {self.margin}) needs {peak / 2**30:.2f} GiB, more "
                             f"than the {available / 2**30:.2f} GiB of memory available: lower max_length or the "
                             "number of slots (xlagen serve: --max-length, --slots)")
        return need

    def _ban_mask(self, ids) -> np.ndarray | None:
        """bool `[V]`, True at `ids` (None without any)."""
        if not ids:
            return None
        mask = np.zeros(self.vocab_size, bool)
        mask[[i for i in ids if 0 <= i < self.vocab_size]] = True
        return mask

    def _choose(self, logits, present, options: RowOptions, banned, alternatives: int):
        """`row_sampling.choose` with the `banned` ids (a `_ban_mask`) at -inf."""
        if banned is not None:
            logits = tf.where(tf.constant(banned)[None, :], float("-inf"), logits)
        return choose(logits, present, options, alternatives)

    def _traced(self):
        """Counts a trace (each one compiles a program at its first call)."""
        self.compiles += 1

    def _compiled(self, program, kernels: native.Kernels | None = None):
        """`program` as XLA-compiled functions traced under `kernels` (default: this decoder's policy): one
        `tf.function` per signature (the shapes and dtypes of the tensors, the Python values), each traced once,
        so that a prompt bucket or step width seen for the first time compiles its own program without retracing
        another."""
        functions = {}
        kernels = self.kernels if kernels is None else kernels

        def traced(*args):
            with native.tracing(kernels):
                return program(*args)

        def call(*args):
            key = tuple((tuple(x.shape), x.dtype.name) if hasattr(x, "shape") else x for x in tf.nest.flatten(args))
            function = functions.get(key)
            if function is None:  # called as a concrete function: each traces once, by design, never "retraces"
                function = functions[key] = tf.function(traced, jit_compile=True,
                                                        autograph=False).get_concrete_function(*args)
            return function(*args)

        return call

    # -- prefill --------------------------------------------------------------------------------------

    def prefill(self, ids: np.ndarray, mask: np.ndarray, extra: dict, options: RowOptions, alternatives: int = 0):
        """Runs P prompts of one bucket together (one program per bucket, P and A) and chooses their first tokens.

        Args:
            ids: int32 `[P, Pb]`, the (decoder) prompts left-padded to their bucket.
            mask: int32 `[P, Pb]`.
            extra: The model's other inputs (an encoder's, padded to their bucket), each `[P, ...]`.
            options: The requests' options, each with P rows.
            alternatives: A, the most likely tokens to report with each chosen one (0: none).

        Returns:
            An opaque prefill result for `insert`, and `(tokens [P], logprobs [P], top_ids [P, A],
            top_logprobs [P, A])` as numpy arrays.
        """
        result = self._prefill(tf.constant(ids, tf.int32), tf.constant(mask, tf.int32),
                               {name: tf.constant(value) for name, value in extra.items()},
                               RowOptions(*(tf.constant(value) for value in options)), alternatives)
        return result, tuple(result[i].numpy() for i in (0, 1, 4, 5))

    def _prefill_program(self, ids, mask, extra, options: RowOptions, alternatives: int):
        self._traced()
        logits, state = prefill(self.model, Prompt(ids, mask, extra), ids.shape[1])
        token, logprob, top_ids, top_logprobs = self._choose(
            logits, lambda: presence(ids, mask > 0, self.vocab_size), options, self._banned_first, alternatives)
        context = state.context
        if isinstance(context, EncoderContext):
            context = self._padded_context(context.projected(self.model.decoder_blocks))
        return token, logprob, state.cache, context, top_ids, top_logprobs

    def prefill_chunk(self, ids: np.ndarray, mask: np.ndarray, offset: int, chunk: int, previous,
                      options: RowOptions, alternatives: int = 0):
        """Runs columns `[offset, offset + chunk)` of one decoder-only prompt against the keys and values of its
        columns before them, so that a long prompt can prefill a part at a time between steps (one program per
        bucket and chunk size; the offset is a tensor).

        Args:
            ids: int32 `[1, Pb]`, the prompt left-padded to its bucket.
            mask: int32 `[1, Pb]`.
            offset: The first column, 0 <= offset <= Pb - chunk; columns may be run again (the same keys and
                values come out), so a last chunk can end at Pb.
            chunk: C, columns per call.
            previous: The previous chunk's result, or None for a prompt's first chunk.
            options: The request's options, one row.
            alternatives: A, as for `prefill`.

        Returns:
            `(result, (token, logprob, top_ids, top_logprobs))`: `result` holds the cache for the next chunk and,
            after the chunk ending at Pb, is what `insert` takes (as from `prefill`); the token is the prompt's
            first new token once the chunk ends at Pb.
        """
        length = ids.shape[1]
        if not 0 <= offset <= length - chunk:
            raise ValueError(f"a chunk of {chunk} columns at {offset} does not fit a prompt of {length} columns")
        cache = self.model.init_cache(1, length) if previous is None else previous[2]
        result = self._chunk(tf.constant(ids, tf.int32), tf.constant(mask, tf.int32), tf.constant(offset, tf.int32),
                             cache, RowOptions(*(tf.constant(value) for value in options)), chunk, alternatives)
        return result, tuple(result[i].numpy() for i in (0, 1, 4, 5))

    def _chunk_program(self, ids, mask, offset, cache, options: RowOptions, chunk: int, alternatives: int):
        self._traced()
        # A gather, not tf.slice: a slice's begin is a compile-time constant to XLA (a program per offset).
        tokens = tf.gather(model_ids(ids, mask), offset + tf.range(chunk), axis=1)
        with native.prefill():
            logits, cache = self.model.call_with_cache(tokens, cache, offset, mask, last_only=True)
        token, logprob, top_ids, top_logprobs = self._choose(
            logits[:, -1], lambda: presence(ids, mask > 0, self.vocab_size), options, self._banned_first,
            alternatives)
        return token, logprob, cache, (), top_ids, top_logprobs

    def _padded_context(self, context: EncoderContext) -> EncoderContext:
        """The projected encoder memory (keys `[1, H, D, L]`, values `[1, H, L, D]`, mask `[1, L]`) padded to
        the slots' `encoder_length` (masked columns); without a mask, as it is."""
        if isinstance(context.mask, tuple):
            return context
        length = context.memory[0].value.shape[2]
        pad = self.encoder_length - length
        if pad < 0:
            raise ValueError(f"the encoder output has {length} positions, more than the slots' "
                             f"encoder_length {self.encoder_length}")
        if pad == 0:
            return context
        memory = tuple(LayerCache(tf.pad(key, [[0, 0], [0, 0], [0, 0], [0, pad]]),
                                  tf.pad(value, [[0, 0], [0, 0], [0, pad], [0, 0]])) for key, value in context.memory)
        return EncoderContext(memory, tf.pad(context.mask, [[0, 0], [0, pad]]))

    # -- insert ---------------------------------------------------------------------------------------

    def insert(self, prefilled, ids: np.ndarray, mask: np.ndarray, slot: int, index: int, row: int = 0) -> None:
        """Writes a prefilled prompt into `slot`, ending at column `index` (its first token is decoded at
        `index` by the next `step`).

        Args:
            prefilled: From `prefill`.
            ids, mask: The same `[P, Pb]` prompts as given to `prefill`.
            slot: Which slot (any earlier content is dropped).
            index: The current write column, >= Pb.
            row: Which of the P prompts.
        """
        token, _, cache, context = prefilled[:4]
        if ids.shape[0] > 1:  # one program per bucket inserts one row: take it out of the batch
            def one(tensor):
                return tensor[row:row + 1]

            token, cache, context = one(token), keras.tree.map_structure(one, cache), keras.tree.map_structure(
                one, context)
            ids, mask = ids[row:row + 1], mask[row:row + 1]
        if isinstance(context, EncoderContext) and not isinstance(self._context, EncoderContext):
            self._context = self._context_variables(context)
        self._insert(tf.constant(ids, tf.int32), tf.constant(mask, tf.int32), token, cache, context,
                     tf.constant(slot, tf.int32), tf.constant(index, tf.int32))

    def _context_variables(self, context: EncoderContext) -> EncoderContext:
        """Zero variables with room for N slots of `context` (one request's, padded)."""
        def slots_of(tensor):
            return tf.Variable(tf.zeros([self.slots, *tensor.shape[1:]], tensor.dtype), trainable=False)

        return EncoderContext(keras.tree.map_structure(slots_of, context.memory),
                              () if isinstance(context.mask, tuple) else slots_of(context.mask))

    def _insert_program(self, ids, mask, token, cache, context, slot, index):
        self._traced()
        start = index - ids.shape[1]
        zero = tf.zeros((), tf.int32)
        for variable, new in zip(keras.tree.flatten(self._cache), keras.tree.flatten(cache)):
            variable.assign(ops.slice_update(variable, [slot, zero, start, zero], tf.cast(new, variable.dtype)))
        columns = tf.range(self.length)
        row_mask = ops.slice_update(tf.zeros([self.length], tf.int32), [start], mask[0])
        row_mask = tf.where(columns >= index, 1, row_mask)
        row_history = ops.slice_update(tf.zeros([self.length], tf.int32), [start], ids[0])
        self._mask.assign(ops.slice_update(self._mask, [slot, zero], row_mask[None]))
        self._history.assign(ops.slice_update(self._history, [slot, zero], row_history[None]))
        self._last.assign(ops.slice_update(self._last, [slot], token))
        if isinstance(context, EncoderContext):
            for variable, new in zip(keras.tree.flatten(self._context), keras.tree.flatten(context)):
                begin = [slot] + [zero] * (len(new.shape) - 1)
                variable.assign(ops.slice_update(variable, begin, tf.cast(new, variable.dtype)))

    # -- generate step --------------------------------------------------------------------------------

    def step(self, index: int, options: RowOptions, width: int | None = None, alternatives: int = 0,
             steps: int | None = None):
        """Advances the first `width` slots by `steps` tokens, from column `index` (needs `index + steps <= S`).

        Args:
            index: The write column of the slots' pending tokens.
            options: The slots' options, `[width]` each (`step` counts the tokens each generated so far).
            width: W, how many slots (the first ones) to advance: each width is its own program; fewer rows
                cost less (a step of 16 GPT-2-small rows took 1.7-3.6x one of 1 row on a 2-core AVX2 CPU with
                the native kernels), and the others keep their state. The step reads the first W rows of the
                cache in place. Default: all N.
            alternatives: A, the most likely tokens to report with each chosen one (0: none; each A is a
                program of its own).
            steps: k, tokens per slot in this call, 1 to `steps_per_call` (default: `steps_per_call`); each k
                is a program of its own, running its steps in one loop.

        Returns:
            `(tokens int32 [W, k], logprobs float32 [W, k], top_ids int32 [W, k, A], top_logprobs float32
            [W, k, A])` as numpy arrays; rows of free slots are noise.
        """
        width = self.slots if width is None else width
        steps = self.steps_per_call if steps is None else steps
        if not 1 <= width <= self.slots:
            raise ValueError(f"width must be in [1, {self.slots}], got {width}")
        if not 1 <= steps <= self.steps_per_call:
            raise ValueError(f"steps must be in [1, {self.steps_per_call}], got {steps}")
        if index + steps > self.length:
            raise ValueError(f"step at column {index} needs {steps} free columns of {self.length}: shift first")
        outputs = self._step(tf.constant(index, tf.int32), RowOptions(*(tf.constant(v) for v in options)), width,
                             alternatives, steps)
        return tuple(output.numpy() for output in outputs)

    def _step_program(self, index, options: RowOptions, width: int, alternatives: int, steps: int):
        self._traced()
        everything = width == self.slots

        def rows(variable):  # the first `width` rows (a copy of them unless all are taken)
            return tf.convert_to_tensor(variable) if everything else tf.convert_to_tensor(variable)[:width]

        def write(variable, new):
            zero = tf.zeros((), tf.int32)
            variable.assign(new if everything else ops.slice_update(variable, [zero] * len(new.shape), new))

        mask = rows(self._mask)
        context = keras.tree.map_structure(rows, self._context)
        columns = tf.range(self.length)

        def body(i, last, cache, history, tokens, logprobs, top_ids, top_logprobs):
            column = index + i
            history = write_column(history, last, column)

            def present():
                return presence(history, (mask > 0) & (columns <= column)[None, :], self.vocab_size)

            with native.decoding_step():
                logits, state = self.model.decode_step(last[:, None], column, DecoderState(cache, mask, context))
            ids, logprob, top, top_logprob = self._choose(logits, present, options._replace(step=options.step + i),
                                                          self._banned, alternatives)
            return (i + 1, ids, state.cache, history, write_column(tokens, ids, i),
                    write_column(logprobs, logprob, i), write_column(top_ids, top, i),
                    write_column(top_logprobs, top_logprob, i))

        # The whole cache goes in, whatever the width: the attention reads the first W rows in place (a copy
        # of the rows cost more than a narrow step's products) and the step writes its column into them.
        cache = keras.tree.map_structure(tf.convert_to_tensor, self._cache)
        loop = (tf.constant(0), rows(self._last), cache, rows(self._history),
                tf.zeros([width, steps], tf.int32), tf.zeros([width, steps], tf.float32),
                tf.zeros([width, steps, alternatives], tf.int32), tf.zeros([width, steps, alternatives], tf.float32))
        if steps == 1:
            loop = body(*loop)
        else:
            loop = tf.while_loop(lambda i, *_: i < steps, body, loop, maximum_iterations=steps)
        _, last, cache, history, tokens, logprobs, top_ids, top_logprobs = loop
        for variable, new in zip(keras.tree.flatten(self._cache), keras.tree.flatten(cache)):
            variable.assign(new)
        write(self._history, history)
        write(self._last, last)
        return tokens, logprobs, top_ids, top_logprobs

    # -- move ------------------------------------------------------------------------------------------

    def move(self, source: int, target: int) -> None:
        """Copies slot `source`'s state (cache, mask, history, pending token, encoder memory) into slot `target`,
        so that the requests left can be packed into the first slots and decoded by a narrower step."""
        if not (0 <= source < self.slots and 0 <= target < self.slots):
            raise ValueError(f"slots must be in [0, {self.slots}), got {source} -> {target}")
        self._move(tf.constant(source, tf.int32), tf.constant(target, tf.int32))

    def _move_program(self, source, target):
        self._traced()
        for variable in keras.tree.flatten((self._cache, self._mask, self._history, self._last, self._context)):
            zero = [tf.zeros((), tf.int32)] * (variable.shape.rank - 1)
            row = tf.gather(tf.convert_to_tensor(variable), source[None])  # a gather: the index stays dynamic
            variable.assign(ops.slice_update(variable, [target, *zero], row))

    # -- shift ----------------------------------------------------------------------------------------

    def shift(self, amount: int, index: int) -> None:
        """Moves every slot's columns `amount` to the left; the caller's write column becomes `index - amount`.

        Raises:
            ValueError: unless 0 < amount <= index.
        """
        if not 0 < amount <= index:
            raise ValueError(f"shift amount must be in (0, {index}], got {amount}")
        amount = tf.constant(amount, tf.int32)
        for variable in keras.tree.flatten(self._cache):
            self._shift_cache(variable, amount)
        self._shift(amount, tf.constant(index - amount, tf.int32))

    def _shift_cache_program(self, variable, amount):
        """One cache variable `[N, H, S, D]` rotated left: one program serves every layer, so a shift holds one
        layer's copy at a time (a program rotating every layer held a copy of the whole cache, which the allocator
        kept afterwards: 1.2 GB more resident memory for GPT-2 small at 16 slots of 1280 columns)."""
        self._traced()
        variable.assign(_roll_left(tf.convert_to_tensor(variable), amount, axis=2))

    def _shift_program(self, amount, new_index):
        self._traced()
        mask = _roll_left(tf.convert_to_tensor(self._mask), amount, axis=1)
        self._mask.assign(tf.where(tf.range(self.length)[None, :] >= new_index, 1, mask))
        self._history.assign(_roll_left(tf.convert_to_tensor(self._history), amount, axis=1))
