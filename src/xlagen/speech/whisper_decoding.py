"""Speech recognition decoding as Whisper defines it: the forced decoder prompt (start, language, task,
no-timestamps), language detection and the timestamp rules; `TFWhisperForConditionalGeneration` plugs
them into `generate` through the model hooks of `xlagen.generation.api.GenerationMixin`.

Reference: transformers 4.57's `WhisperGenerationMixin._retrieve_init_tokens` / `detect_language` and
`WhisperTimeStampLogitsProcessor`.
Everything here is tensor code that runs eagerly and inside the one XLA program of `generate`: the
detected language is a tensor per row, and the timestamp rules are masks over the token buffer rather
than Python loops over rows.

Shapes: B rows, V vocab, T_max the static token buffer.
"""

from __future__ import annotations

import tensorflow as tf

from xlagen.generation.config import GenerationConfig
from xlagen.generation.loop import batch_size
from xlagen.generation.sampling import NEG_INF, Context, Processor, token_mask
from xlagen.text.whisper_tokens import LANGUAGE_CODES, LANGUAGES


def timestamp_rules(no_timestamps_id: int, eos_id: int, max_initial_index: int | None) -> Processor:
    """Whisper's timestamp grammar (transformers' WhisperTimeStampLogitsProcessor), for every row at once.

    Timestamps come in pairs (a lone one may only precede EOS or a second one), never decrease, the
    first token is a timestamp of at most `max_initial_index`, and a timestamp is forced whenever the
    timestamps together are more likely than the best text token.
    """
    begin_timestamps = no_timestamps_id + 1

    def apply(logits, ctx: Context):
        vocab = tf.range(logits.shape[-1])
        tokens, length, begin = ctx.tokens, ctx.length, ctx.prompt_length
        generated = length - begin
        is_time = tokens >= begin_timestamps  # [B, T_max]
        last = tf.gather(is_time, tf.maximum(length - 1, 0), axis=1) & (generated >= 1)  # [B]
        second_last = tf.gather(is_time, tf.maximum(length - 2, 0), axis=1) | (generated < 2)
        text, times = vocab < begin_timestamps, vocab >= begin_timestamps  # [V]
        ban = tf.equal(vocab, no_timestamps_id)[None, :]
        ban |= (last & second_last)[:, None] & times[None, :]  # after a pair: text (or EOS)
        ban |= (last & ~second_last)[:, None] & (vocab < eos_id)[None, :]  # after a lone one: its pair or EOS
        # Timestamps never decrease; a closed pair's end cannot be repeated as the next start.
        columns = tf.range(tf.shape(tokens)[1])
        generated_time = is_time & ((columns >= begin) & (columns < length))[None, :]
        where_last = tf.reduce_max(tf.where(generated_time, columns[None, :], -1), axis=1)  # [B]
        latest = tf.gather(tokens, tf.maximum(where_last, 0), axis=1, batch_dims=1)
        floor = tf.where(last & ~second_last, latest, latest + 1)
        ban |= (where_last >= 0)[:, None] & times[None, :] & (vocab[None, :] < floor[:, None])
        first = tf.equal(generated, 0)
        ban |= first & text[None, :]
        if max_initial_index is not None:
            ban |= first & (vocab > begin_timestamps + max_initial_index)[None, :]
        logits = tf.where(ban, tf.constant(NEG_INF, logits.dtype), logits)
        logprobs = tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)
        time_mass = tf.reduce_logsumexp(tf.where(times[None, :], logprobs, NEG_INF), axis=-1)
        best_text = tf.reduce_max(tf.where(text[None, :], logprobs, NEG_INF), axis=-1)
        force_time = (time_mass > best_text)[:, None] & text[None, :]
        return tf.where(force_time, tf.constant(NEG_INF, logits.dtype), logits)

    return apply


def processors(config: GenerationConfig) -> tuple[Processor, ...]:
    """The timestamp rules, when `config` asks for timestamps (after the generic token suppression, where
    transformers puts them)."""
    chosen: list[Processor] = []
    if config.return_timestamps:
        if config.no_timestamps_token_id is None or not config.eos_token_ids:
            raise ValueError("return_timestamps needs no_timestamps_token_id and eos_token_id in the generation "
                             "config (a Whisper checkpoint's generation_config.json has them)")
        chosen.append(timestamp_rules(config.no_timestamps_token_id, config.eos_token_ids[0],
                                      config.max_initial_timestamp_index))
    return tuple(chosen)


def language_id(language: str, config: GenerationConfig) -> int:
    """The token id of a language given as a code ("fr"), a name ("French") or a token ("<|fr|>")."""
    name = language.lower()
    if name in config.lang_to_id:
        token = name
    elif name in LANGUAGE_CODES:
        token = f"<|{LANGUAGE_CODES[name]}|>"
    elif name in LANGUAGES:
        token = f"<|{name}|>"
    else:
        raise ValueError(f"unknown language {language!r}: give a code such as 'fr', a name such as 'french', or a "
                         f"token such as '<|fr|>'; this model knows {sorted(config.lang_to_id)}")
    if token not in config.lang_to_id:
        raise ValueError(f"language {language!r} ({token}) is not one of this model's languages "
                         f"(generation_config.lang_to_id): {sorted(config.lang_to_id)}")
    return config.lang_to_id[token]


def check_options(config: GenerationConfig) -> None:
    """Refuses language/task options the model's generation config cannot serve (before any tracing);
    `config.decoder_start_token_id` must be resolved (see `decoder_prompt`)."""
    if config.is_multilingual is False and (config.language is not None or config.task is not None):
        raise ValueError("this is an English-only Whisper model: it takes no language or task (leave them out)")
    if config.language is not None and not config.lang_to_id:
        raise ValueError("language needs lang_to_id in the generation config (a multilingual Whisper "
                         "checkpoint's generation_config.json has it)")
    if config.task is not None and not (config.task_to_id and config.task in config.task_to_id):
        raise ValueError(f"task {config.task!r} needs task_to_id in the generation config")
    if config.decoder_start_token_id is None:
        raise ValueError("Whisper's generate needs decoder_start_token_id in the generation config")


def detect_language(model, input_features, config: GenerationConfig) -> tf.Tensor:
    """The most likely language token of each row: the decoder's first prediction after the start token,
    restricted to the language tokens (as transformers' `detect_language`).

    Returns:
        int32 `[B]`.
    """
    start = tf.fill([batch_size(input_features), 1], tf.constant(config.decoder_start_token_id, tf.int32))
    logits, _ = model.prefill(start, tf.ones_like(start), 1, input_features=input_features)
    languages = token_mask(config.lang_to_id.values(), logits.shape[-1])
    return tf.argmax(tf.where(languages[None, :], logits, NEG_INF), axis=-1, output_type=tf.int32)


def decoder_prompt(model, input_features, config: GenerationConfig) -> tf.Tensor:
    """The forced decoder prompt `[B, P]`: start, language, task and <|notimestamps|> as transformers
    builds them (including its rules for legacy `forced_decoder_ids`), the language detected per row
    when none is given.
    """
    if config.decoder_start_token_id is None:  # a model built from its config: its own start token
        config = config.update(decoder_start_token_id=model.config.decoder_start_token_id)
    check_options(config)
    columns: list = [config.decoder_start_token_id]
    if config.task is None and config.language is None and config.forced_decoder_ids:
        forced = list(config.forced_decoder_ids)
        if forced[0][0] == 1:
            while forced and forced[0][0] == len(columns):
                columns.append(forced.pop(0)[1])
        if forced:
            raise ValueError(f"forced_decoder_ids {list(config.forced_decoder_ids)} do not follow Whisper's prompt "
                             "pattern (positions 1, 2, ... after the start token)")
    language = config.language
    if isinstance(language, tuple):
        if input_features.shape[0] is not None and len(language) != input_features.shape[0]:
            raise ValueError(f"{len(language)} languages for a batch of {input_features.shape[0]}: give one "
                             "language, or one per row")
        language_ids = tf.constant([language_id(name, config) for name in language], tf.int32)
    elif language is not None:
        language_ids = language_id(language, config)
    elif config.lang_to_id and (len(columns) == 1 or columns[1] is None):
        language_ids = detect_language(model, input_features, config)
    else:
        language_ids = None
    if language_ids is not None:
        if len(columns) > 1:
            columns[1] = language_ids
        else:
            columns.append(language_ids)
    task_ids = tuple((config.task_to_id or {}).values())
    if config.task is not None:
        task_id = config.task_to_id[config.task]
        if any(isinstance(c, int) and c in task_ids for c in columns):
            columns = [task_id if isinstance(c, int) and c in task_ids else c for c in columns]
        else:
            columns.append(task_id)
    elif language is not None and config.task_to_id and not any(isinstance(c, int) and c in task_ids
                                                                for c in columns):
        columns.append(config.task_to_id["transcribe"])
    no_timestamps = config.no_timestamps_token_id
    ends_without = not (isinstance(columns[-1], int) and columns[-1] == no_timestamps)
    if not config.return_timestamps and no_timestamps is not None and ends_without:
        columns.append(no_timestamps)
    elif config.return_timestamps and isinstance(columns[-1], int) and columns[-1] == no_timestamps:
        columns.pop()
    columns = [c for c in columns if c is not None]
    batch = batch_size(input_features)
    return tf.stack([tf.fill([batch], tf.constant(c, tf.int32)) if isinstance(c, int)
                     else tf.broadcast_to(tf.cast(c, tf.int32), [batch]) for c in columns], axis=1)
