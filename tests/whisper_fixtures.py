"""Tiny Whisper tokenizer, feature-extractor config and synthetic audio for tests (no downloads).

Import from a test module as `from whisper_fixtures import ...` (tests/ is on sys.path, as for
`conftest` and `generation.helpers`).
"""

from __future__ import annotations

import os

import numpy as np

from conftest import CORPUS

# Special tokens after <|endoftext|> and <|startoftranscript|>, languages aside, in Whisper's order.
TASK_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>")
NUM_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|> in steps of 0.02 s


def whisper_languages() -> list[str]:
    """Language codes in the order of transformers' Whisper LANGUAGES table (100, large-v3's)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return list(LANGUAGES)


def build_whisper_tokenizer(folder, multilingual: bool = True) -> dict:
    """Writes a tiny Whisper tokenizer laid out like the real one, via transformers' WhisperTokenizerFast.

    Regular tokens come first (a byte-level BPE trained on CORPUS: 300 tokens, or 299 for the
    English-only layout, which like the real `.en` checkpoints has one regular token fewer and the
    same special tokens), then <|endoftext|>, <|startoftranscript|>, one <|xx|> per language,
    <|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|>,
    and the 1501 timestamp tokens <|0.00|> ... <|30.00|> (added, not special, as in the real
    tokenizer.json). Encoding adds "<|startoftranscript|> <|notimestamps|>" before and
    "<|endoftext|>" after the text, as the real tokenizer.json does.

    Returns:
        {"eot", "sot", "lang_to_id" (code -> id), "translate", "transcribe", "start_of_prev",
         "no_speech", "no_timestamps", "timestamp_begin", "vocab_size"}.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import WhisperTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300 if multilingual else 299, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    regular = backend.get_vocab_size()
    languages = whisper_languages()
    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in languages), *TASK_TOKENS]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(NUM_TIMESTAMPS)]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in timestamps])
    ids = {token: backend.token_to_id(token) for token in specials + timestamps}
    assert [ids[t] for t in specials + timestamps] == list(range(regular, regular + len(specials) + NUM_TIMESTAMPS))
    sot, eot, no_timestamps = ids["<|startoftranscript|>"], ids["<|endoftext|>"], ids["<|notimestamps|>"]
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftranscript|> <|notimestamps|> $A:0 <|endoftext|>",
        pair="<|startoftranscript|> <|notimestamps|> $A:0 $B:1 <|endoftext|>",
        special_tokens=[("<|startoftranscript|>", sot), ("<|notimestamps|>", no_timestamps), ("<|endoftext|>", eot)])
    tokenizer = WhisperTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                     unk_token="<|endoftext|>", additional_special_tokens=specials,
                                     model_max_length=448, clean_up_tokenization_spaces=True, errors="replace")
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return {"eot": eot, "sot": sot, "lang_to_id": {code: ids[f"<|{code}|>"] for code in languages},
            "translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"],
            "start_of_prev": ids["<|startofprev|>"], "no_speech": ids["<|nospeech|>"],
            "no_timestamps": no_timestamps, "timestamp_begin": ids["<|0.00|>"],
            "vocab_size": ids[timestamps[-1]] + 1}


def reference_tokenizer(folder, **options):
    """transformers' WhisperTokenizerFast of `folder`, decoding as transformers 4.x did: transformers 5 ignores
    the checkpoint's `clean_up_tokenization_spaces=True` for BPE tokenizers unless told otherwise; xlagen
    keeps 4.x's behaviour (README, "Differences from transformers")."""
    from transformers import WhisperTokenizerFast

    return WhisperTokenizerFast.from_pretrained(
        folder, clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True, **options)


def save_feature_extractor(folder, num_mel_bins: int = 80) -> None:
    """Writes preprocessor_config.json with transformers' WhisperFeatureExtractor."""
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(folder)


def synthetic_audio(seconds: float, sampling_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A deterministic float32 [n] clip: three tones with a slow amplitude envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * sampling_rate)) / sampling_rate
    tones = sum(amplitude * np.sin(2 * np.pi * frequency * t + phase) for amplitude, frequency, phase in
                zip((0.3, 0.2, 0.1), rng.uniform(100, 3000, 3), rng.uniform(0, 2 * np.pi, 3)))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 0.5 * t)
    return (envelope * tones + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)
