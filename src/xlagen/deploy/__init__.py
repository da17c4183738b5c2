"""Deployment: SavedModel export of the compiled generate (text and Whisper) and ahead-of-time compilation to C++."""
