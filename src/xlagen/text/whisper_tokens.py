"""Whisper's tokenizer: the byte-level BPE of `PreTrainedTokenizerFast` plus Whisper's special tokens.

Reference: transformers' `WhisperTokenizerFast` (4.57, models/whisper/tokenization_whisper_fast.py).
The vocabulary holds the regular tokens, then <|endoftext|>, <|startoftranscript|>, one <|xx|> per
language, <|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nocaptions|> (or
<|nospeech|>), <|notimestamps|>, and finally the timestamp tokens <|0.00|> ... <|30.00|> (0.02 s
apart), which start right after the last special token. The decoder prompt is
<|startoftranscript|> [<|language|>] [<|task|>] [<|notimestamps|>].

Known divergences from transformers:
  * The English text normalizers (`normalize=True`, `basic_normalize=True`) are not implemented.
  * A language's id is looked up by its token (<|fr|>) rather than by its position in the table;
    the two agree on every released Whisper vocabulary.
  * `get_prompt_ids(..., return_tensors="np")` gives int32 (xlagen's id dtype), not int64.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
from tokenizers import processors

from xlagen.text.tokenizer import PreTrainedTokenizerFast, _to_id_list

TASKS = ("translate", "transcribe")
_LANGUAGE_TABLE = (
    "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french ja:japanese pt:portuguese "
    "tr:turkish pl:polish ca:catalan nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi "
    "fi:finnish vi:vietnamese he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish "
    "hu:hungarian ta:tamil no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin "
    "mi:maori ml:malayalam cy:welsh sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian "
    "az:azerbaijani sl:slovenian kn:kannada et:estonian mk:macedonian br:breton eu:basque is:icelandic "
    "hy:armenian ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili gl:galician mr:marathi "
    "pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali af:afrikaans oc:occitan ka:georgian "
    "be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic yi:yiddish lo:lao uz:uzbek fo:faroese "
    "ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk mt:maltese sa:sanskrit lb:luxembourgish my:myanmar "
    "bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian ln:lingala ha:hausa ba:bashkir "
    "jw:javanese su:sundanese yue:cantonese")
# Whisper's languages, code -> English name, in the order of their tokens in the vocabulary.
LANGUAGES = {code: name.replace("_", " ") for code, name in (item.split(":") for item in _LANGUAGE_TABLE.split())}
# English name (and common alternative names) -> code.
LANGUAGE_CODES = {**{name: code for code, name in LANGUAGES.items()}, "burmese": "my", "valencian": "ca",
                  "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb", "pushto": "ps", "panjabi": "pa",
                  "moldavian": "ro", "moldovan": "ro", "sinhalese": "si", "castilian": "es", "mandarin": "zh"}
_TIMESTAMP = re.compile(r"<\|(\d+\.\d+)\|>")
_SEGMENT_FRAMES = 1500  # timestamp positions in one 30 s window (the encoder's output length)


class WhisperTokenizerFast(PreTrainedTokenizerFast):
    """Whisper's tokenizer with transformers' `WhisperTokenizerFast` extras.

    Loaded by `AutoTokenizer.from_pretrained` for a folder whose tokenizer class is
    WhisperTokenizer. `language`, `task` and `predict_timestamps` are read from tokenizer_config.json
    or given to `from_pretrained`; they shape `prefix_tokens` and are saved back.
    """

    def __init__(self, backend, config, added_tokens=()):
        super().__init__(backend, config, added_tokens)
        # Settings given at load time (or saved in tokenizer_config.json) shape the prompt that encoding adds,
        # as in transformers >= 5 (4.x applied them only when set_prefix_tokens was called).
        if self.language is not None or self.task is not None or self.predict_timestamps:
            self.set_prefix_tokens()

    @property
    def language(self) -> str | None:
        """Language of the transcript (a code or an English name), or None to let the model detect it."""
        return self.config.passthrough.get("language")

    @property
    def task(self) -> str | None:
        """"transcribe", "translate" or None."""
        return self.config.passthrough.get("task")

    @property
    def predict_timestamps(self) -> bool:
        """Whether the prompt lets the model predict timestamps (no <|notimestamps|>)."""
        return bool(self.config.passthrough.get("predict_timestamps", False))

    @property
    def timestamp_begin(self) -> int:
        """Id of <|0.00|>: the first id after the special tokens, as transformers defines it."""
        return self.all_special_ids[-1] + 1

    @property
    def prefix_tokens(self) -> list[int]:
        """<|startoftranscript|> [<|language|>] [<|task|>] [<|notimestamps|>] for the current settings.

        Raises:
            ValueError: On an unknown language or task.
        """
        ids = [self._special_id("<|startoftranscript|>")]
        if self.language is not None:
            ids.append(self._special_id(f"<|{language_code(self.language)}|>"))
        if self.task is not None:
            if self.task not in TASKS:
                raise ValueError(f"Unsupported task {self.task!r}; it must be one of {list(TASKS)}.")
            ids.append(self._special_id(f"<|{self.task}|>"))
        if not self.predict_timestamps:
            ids.append(self._special_id("<|notimestamps|>"))
        return ids

    def set_prefix_tokens(self, language: str | None = None, task: str | None = None,
                          predict_timestamps: bool | None = None) -> None:
        """Changes the prompt that encoding adds (None keeps a setting), as transformers does.

        Args:
            language: A code ("fr") or an English name ("french").
            task: "transcribe" or "translate".
            predict_timestamps: False adds <|notimestamps|>.

        Raises:
            ValueError: On an unknown language or task.
        """
        updates = {"language": language, "task": task, "predict_timestamps": predict_timestamps}
        settings = {**self.config.passthrough, **{k: v for k, v in updates.items() if v is not None}}
        if settings.get("language") is not None:
            settings["language"] = settings["language"].lower()
        previous = self.config
        self.config = dataclasses.replace(self.config, passthrough=settings)
        try:
            prefix = self.prefix_tokens
        except ValueError:
            self.config = previous
            raise
        names = self.convert_ids_to_tokens(prefix)
        template = " ".join(f"{name}:0" for name in names)
        eos = self.eos_token
        self._backend.post_processor = processors.TemplateProcessing(
            single=f"{template} $A:0 {eos}:0", pair=f"{template} $A:0 $B:1 {eos}:1",
            special_tokens=[(eos, self.eos_token_id), *zip(names, prefix)])

    def get_decoder_prompt_ids(self, task: str | None = None, language: str | None = None,
                               no_timestamps: bool = True) -> list[tuple[int, int]]:
        """The forced decoder ids after <|startoftranscript|>: [(1, language), (2, task), (3, notimestamps)].

        Like transformers, this also sets the prefix tokens (`set_prefix_tokens`).

        Args:
            task: "transcribe" or "translate"; None keeps the current setting.
            language: A code or English name; None keeps the current setting.
            no_timestamps: Force <|notimestamps|>.

        Returns:
            (position, token id) pairs.
        """
        self.set_prefix_tokens(task=task, language=language, predict_timestamps=not no_timestamps)
        return list(enumerate(self.prefix_tokens[1:], start=1))

    def get_prompt_ids(self, text: str, return_tensors: str | None = "np") -> np.ndarray | list[int]:
        """Ids of a text prompt for `generate(prompt_ids=...)`: <|startofprev|> then " " + text.

        Raises:
            ValueError: If the text contains a special token.
        """
        ids = self.encode(" " + text.strip(), add_special_tokens=False)
        first_special = self.all_special_ids[0]
        special = [token for token in ids if token >= first_special]
        if special:
            raise ValueError(f"The prompt contains the special token {self.convert_ids_to_tokens(special[0])}.")
        ids = [self._special_id("<|startofprev|>"), *ids]
        return ids if return_tensors is None else np.array(ids, dtype=np.int32)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, *, output_offsets: bool = False,
               time_precision: float = 0.02, decode_with_timestamps: bool = False) -> str | dict[str, Any]:
        """Turns one sequence of ids into text, with Whisper's options.

        Args:
            token_ids: An int, a list, a numpy array or a `tf.Tensor` of shape [T].
            skip_special_tokens: Drop special tokens; also drops a <|startofprev|> prompt up to
                <|startoftranscript|>. Timestamp tokens are always dropped from the plain text.
            clean_up_tokenization_spaces: Remove spaces before punctuation; default: the checkpoint's.
            output_offsets: Also return the text of each timestamped segment with its (start, end)
                in seconds.
            time_precision: Seconds per timestamp step.
            decode_with_timestamps: Keep timestamps in the text, rendered as "<|1.08|>" (times after
                the first 30 s window continue from it).

        Returns:
            The text, or {"text": text, "offsets": [{"text": ..., "timestamp": (start, end)}, ...]}
            when `output_offsets` is True.
        """
        ids = _to_id_list(token_ids)
        shown = self._strip_prompt(ids) if skip_special_tokens else ids
        if decode_with_timestamps:
            text = self._decode_with_timestamps(shown, skip_special_tokens, time_precision)
        else:
            text = self._plain_decode(shown, skip_special_tokens, clean_up_tokenization_spaces)
        if output_offsets:
            return {"text": text, "offsets": self._offsets(ids, time_precision)}
        return text

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None, **options: Any) -> list[Any]:
        """Decodes a batch ([B, T] array or tensor, or a list of lists); see `decode` for the options."""
        if hasattr(sequences, "numpy"):
            sequences = sequences.numpy()
        return [self.decode(sequence, skip_special_tokens, clean_up_tokenization_spaces, **options)
                for sequence in sequences]

    def _special_id(self, token: str) -> int:
        """The id of a Whisper special token; raises ValueError when the vocabulary lacks it."""
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"This Whisper vocabulary has no {token} token.")
        return token_id

    def _plain_decode(self, ids: list[int], skip_special_tokens: bool, clean_up: bool | None = None) -> str:
        """The base decode, with the timestamp tokens' text removed."""
        return _TIMESTAMP.sub("", super().batch_decode([ids], skip_special_tokens, clean_up)[0])

    def _strip_prompt(self, ids: list[int]) -> list[int]:
        """Drops a leading <|startofprev|> prompt: everything before <|startoftranscript|> (all if absent)."""
        if not ids or ids[0] != self._backend.token_to_id("<|startofprev|>"):
            return ids
        start = self._backend.token_to_id("<|startoftranscript|>")
        return ids[ids.index(start):] if start in ids else []

    def _decode_with_timestamps(self, ids: list[int], skip_special_tokens: bool, precision: float) -> str:
        """Text with "<|t|>" markers; a timestamp smaller than the last one starts a new 30 s window."""
        begin = self.timestamp_begin
        pieces: list[str | list[int]] = [[]]
        latest = before_latest = 0.0  # the last two timestamps (s) within the current window
        window_start = 0.0  # seconds of audio in the windows before
        for i, token in enumerate(ids):
            if token < begin:
                pieces[-1].append(token)
                continue
            seconds = (token - begin) * precision
            if seconds < latest:
                # A window normally ends on a pair of timestamps (end of one segment, start of the
                # next); a single one means the window was fully used.
                if i >= 2 and not (ids[i - 1] >= begin and ids[i - 2] >= begin):
                    window_start += precision * _SEGMENT_FRAMES
                else:  # The pair is the next window's start: undo the trailing marker.
                    latest = before_latest
                    window_start += before_latest
                    del pieces[-2:]
            before_latest, latest = latest, seconds
            pieces += [f"<|{seconds + window_start:.2f}|>", []]
        return "".join(piece if isinstance(piece, str) else self.decode(piece, skip_special_tokens)
                       for piece in pieces)

    def _offsets(self, ids: list[int], precision: float) -> list[dict[str, Any]]:
        """The segments between timestamp pairs with their text and (start, end) in seconds."""
        begin = self.timestamp_begin
        tokens = np.asarray(ids, dtype=np.int64)
        is_time = tokens >= begin
        positions = np.flatnonzero(is_time)
        # A segment ends after each pair of adjacent timestamps, and after the last timestamp.
        ends = (np.flatnonzero(is_time[:-1] & is_time[1:]) + 1).tolist()
        if not ends and len(positions) <= 1:
            return []
        if positions[-1] + 1 not in ends:
            ends.append(int(positions[-1]) + 1)
        offsets = []
        start, latest, window = int(positions[0]), 0, 0  # window: timestamp steps before this window
        for end in ends:
            segment = ids[start:end]
            if len(segment) > 1:
                first, last = segment[0] - begin, segment[-1] - begin
                if first < latest:  # a new window (see `_decode_with_timestamps`)
                    single = start >= 2 and not (ids[start - 2] >= begin and ids[start - 1] >= begin)
                    window += _SEGMENT_FRAMES if single else latest
                latest = last
                offsets.append({"text": self._plain_decode(segment, False),
                                "timestamp": (first * precision + window * precision,
                                              last * precision + window * precision)})
            start = end
        return offsets


def language_code(language: str) -> str:
    """Maps a language code or English name ("fr", "French") to Whisper's code.

    Raises:
        ValueError: If the language is not one of Whisper's.
    """
    language = language.lower()
    if language in LANGUAGES:
        return language
    if language in LANGUAGE_CODES:
        return LANGUAGE_CODES[language]
    choices = list(LANGUAGES) if len(language) <= 3 else list(LANGUAGE_CODES)
    raise ValueError(f"Unsupported language {language!r}; it must be one of {choices}.")
