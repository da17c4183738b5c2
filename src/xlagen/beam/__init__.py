"""Apache Beam model handlers: xlagen generation and transcription in `RunInference`, on a laptop (Beam's
in-process runner) or a cluster (Flink, Spark, Dataflow). Needs the extra: `pip install "xlagen[beam]"`.

    import apache_beam as beam
    from apache_beam.ml.inference.base import RunInference
    from xlagen.beam import GenerationModelHandler

    handler = GenerationModelHandler("gpt2", max_new_tokens=64, do_sample=False)
    with beam.Pipeline() as p:
        results, failed = (p | beam.Create(["Hello", ("Once upon", {"max_new_tokens": 16})])
                           | RunInference(handler.with_dead_letters()).with_exception_handling())

Dead letters: `RunInference(...).with_exception_handling()` returns the results and a `RunInferenceDLQ`.
With `handler.with_dead_letters()` (`with_dead_letters(keyed=True)` for `(key, example)` elements), each
bad element fails alone and the rest of its batch runs: one that preparation refuses (a prompt over the
largest bucket or beyond the model's positions, unknown options, an unreadable audio file) lands in
`failed.failed_preprocessing[0]` as `(element, (exception type, message naming the element, traceback))`;
one that fails in the model (its batch is then run again element by element) in
`failed.failed_postprocessing[0]`, as its `PredictionResult`. With the bare handler a bad element sends its
whole batch to `failed.failed_inferences`. Either way every input ends in the results or in a failed output.

Keys: `with_dead_letters(keyed=True)` (or `KeyedModelHandler(handler)`) takes `(key, example)` elements
and returns `(key, PredictionResult)`. Each worker process loads one model (`large_model=True`: one per
machine) and keeps its compiled programs for every later batch and bundle.
"""

try:
    import apache_beam  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError("xlagen.beam needs Apache Beam: pip install 'xlagen[beam]'") from error

from xlagen.beam.generation import GenerationModelHandler, PreparedPrompt, PromptBatcher, result_record
from xlagen.beam.handler import ElementFailure, local_checkpoint, lower_inclusive_boundaries
from xlagen.beam.transcription import ClipTranscriber, PreparedAudio, TranscriptionModelHandler, read_audio

__all__ = ["ClipTranscriber", "ElementFailure", "GenerationModelHandler", "PreparedAudio", "PreparedPrompt",
           "PromptBatcher", "TranscriptionModelHandler", "local_checkpoint", "lower_inclusive_boundaries", "read_audio",
           "result_record"]
