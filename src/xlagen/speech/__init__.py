"""Speech: audio decoding and log-mel features, Whisper's processor and decoding rules, and transcription of audio of
any length."""
