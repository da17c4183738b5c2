"""Audio for speech models, in numpy: `decoding` turns files and arrays into samples (`load_audio`),
`features` turns samples into Whisper's log-mel features (`WhisperFeatureExtractor`)."""

from xlagen.speech.audio.decoding import AudioTooLong, load_audio, read_audio
from xlagen.speech.audio.features import (DYNAMIC_RANGE, FEATURE_EXTRACTOR_NAME, LOG_FLOOR, PROCESSOR_NAME, BatchFeature,
                                   WhisperFeatureExtractor, mel_filter_bank, read_preprocessor_config)

__all__ = ["AudioTooLong", "DYNAMIC_RANGE", "FEATURE_EXTRACTOR_NAME", "LOG_FLOOR", "PROCESSOR_NAME", "BatchFeature",
           "WhisperFeatureExtractor", "load_audio", "mel_filter_bank", "read_audio",
           "read_preprocessor_config"]
