"""Text: tokenizers with the transformers 4.x API (byte-level BPE, Whisper's), their files, chat templates, and
byte-level BPE as TensorFlow ops."""
