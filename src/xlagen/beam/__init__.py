"""Apache Beam model handlers: xlagen generation and transcription in `RunInference`, on a laptop (Beam's
in-process runner) or a cluster (Flink, Spark, Dataflow). Needs the extra: `pip install "xlagen[beam]"`.

    import apache_beam as beam
    from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
    from xlagen.beam import GenerationModelHandler

    handler = GenerationModelHandler("gpt2", max_new_tokens=64, do_sample=False)
    with beam.Pipeline() as p:
        results, failed = (p | beam.Create(["Hello", ("Once upon", {"max_new_tokens": 16})])
                           | RunInference(handler.with_preprocess_fn(handler.prepare)).with_exception_handling())

Dead letters: `RunInference(...).with_exception_handling()` returns the results and a `RunInferenceDLQ`.
With the handler's `prepare` as a preprocessing step (as above; for keyed elements
`KeyedModelHandler(handler).with_preprocess_fn(handler.prepare_keyed)`), each bad element (a prompt over the
largest bucket, unknown options, an unreadable audio file) lands alone in `failed.failed_preprocessing[0]`
as `(element, (exception type, message naming the element, traceback))` and the rest of its batch runs.
Without it the handler prepares elements in `run_inference`, and a bad one sends its whole batch to
`failed.failed_inferences`. Either way every input ends in the results or in a failed output.

Keys: `KeyedModelHandler(handler)` takes `(key, example)` elements and returns `(key, PredictionResult)`.
Each worker process loads one model (`large_model=True`: one per machine) and keeps its compiled programs
for every later batch and bundle.
"""

try:
    import apache_beam  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError("xlagen.beam needs Apache Beam: pip install 'xlagen[beam]'") from error

from xlagen.beam.generation import GenerationModelHandler, PreparedPrompt, PromptBatcher, result_record
from xlagen.beam.handler import local_checkpoint, lower_inclusive_boundaries
from xlagen.beam.transcription import ClipTranscriber, PreparedAudio, TranscriptionModelHandler, read_audio

__all__ = ["ClipTranscriber", "GenerationModelHandler", "PreparedAudio", "PreparedPrompt", "PromptBatcher",
           "TranscriptionModelHandler", "local_checkpoint", "lower_inclusive_boundaries", "read_audio", "result_record"]
