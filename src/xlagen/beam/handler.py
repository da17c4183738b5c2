"""What xlagen's two Beam model handlers share: batching arguments for `beam.BatchElements`, per-element
preparation and checking (the dead-letter steps), keyed elements, and pickling without loaded state.

Beam's `RunInference` gives dead letters per element only to its preprocessing and postprocessing steps; a
batch whose `run_inference` raises lands whole in `failed_inferences`. So `with_dead_letters` prepares
each element before batching (what can be checked without the model), and when a batch still fails in the
model, `run_inference` runs its elements one by one and hands each that fails alone to the postprocessing
step as an `ElementFailure`, which raises it there: that element alone becomes a dead letter.

Beam pickles a model handler on the machine that builds the pipeline and unpickles it on every worker;
the handler therefore holds only settings, and loads its tokenizer (for preparation) and its model
(`load_model`, once per worker process, or once per machine with `large_model=True`) where it runs.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from apache_beam.ml.inference.base import KeyedModelHandler, ModelHandler, PredictionResult

logger = logging.getLogger(__name__)

_COPY_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class ElementFailure:
    """The inference of an element that failed alone in `run_inference` (with `with_dead_letters`), until
    the postprocessing step (`XlagenModelHandler.check`) raises its error.

    Attributes:
        error: The exception the element raised.
    """

    error: Exception


def local_checkpoint(name_or_path: str) -> str:
    """A local folder for a checkpoint given as a URL that Beam's `FileSystems` reads (gs://, s3://, ...):
    the folder's files copied into a new temporary folder. Local folders and Hub ids are returned unchanged.

    Raises:
        FileNotFoundError: If the URL's folder holds no files.
        OSError: If a file cannot be read or written (naming it).
    """
    if "://" not in name_or_path:
        return name_or_path
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    files = FileSystems.match([name_or_path.rstrip("/") + "/*"])[0].metadata_list
    if not files:
        raise FileNotFoundError(f"no checkpoint files under {name_or_path}")
    folder = tempfile.mkdtemp(prefix="xlagen-checkpoint-")
    for file in files:
        target = os.path.join(folder, file.path.rstrip("/").rsplit("/", 1)[-1])
        try:
            with FileSystems.open(file.path, compression_type=CompressionTypes.UNCOMPRESSED) as source, \
                    open(target, "wb") as destination:
                shutil.copyfileobj(source, destination, _COPY_CHUNK)
        except Exception as error:  # noqa: BLE001 - each file system raises its own types; name the file
            raise OSError(f"cannot copy the checkpoint file {file.path} to {target}: {error}") from error
    return folder


def lower_inclusive_boundaries(buckets: Sequence[int]) -> list[int]:
    """Beam's `batch_bucket_boundaries` whose buckets are the given xlagen buckets.

    xlagen pads a length up to the smallest bucket >= it (bucket 16 holds lengths 9..16); Beam's boundaries
    are lower-inclusive (boundaries [9, 17] make the buckets (-inf, 9), [9, 17), [17, inf)), so each
    xlagen bucket b but the last becomes the boundary b + 1. Lengths beyond the largest bucket share
    Beam's last bucket with it (they fail preparation anyway).

    Args:
        buckets: Ascending positive sizes (e.g. `Buckets.prompt_lengths`).

    Returns:
        The boundaries, ascending; one fewer than the buckets.
    """
    return [size + 1 for size in sorted(buckets)[:-1]]


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= `length` (the last one for longer lengths)."""
    return buckets[min(bisect.bisect_left(buckets, length), len(buckets) - 1)]


def describe(element: Any, limit: int = 80) -> str:
    """A short repr of an element for error messages."""
    text = repr(element)
    return text if len(text) <= limit else text[:limit] + "..."


class XlagenModelHandler(ModelHandler):
    """Base of `GenerationModelHandler` and `TranscriptionModelHandler`.

    Subclasses implement `prepare(example)` (per element: read and check, raising for a bad element),
    `prepared_type`, `length(prepared)` (the size that picks a batch bucket), `weight(prepared)` (its
    share of a batch's work), `infer(prepared, model)` and Beam's `load_model`.

    Args:
        model_name_or_path: A checkpoint folder, a Hugging Face Hub id, or the URL of a folder that Beam's
            `FileSystems` reads (gs://, s3://, ...: copied to local disk on each worker), read on each worker.
        length_buckets: Beam's lower-inclusive `batch_bucket_boundaries` (used with
            `max_batch_duration_secs`).
        batching: `min_batch_size`, `max_batch_size`, `max_batch_duration_secs` for Beam's BatchElements.
        large_model: One model per machine shared by its worker processes (Beam's `MultiProcessShared`)
            instead of one per process.
        model_copies: With `large_model`, how many copies per machine.
    """

    prepared_type: type = object

    def __init__(self, model_name_or_path: str, *, length_buckets: list[int], batching: Mapping[str, Any],
                 large_model: bool = False, model_copies: int | None = None):
        if not isinstance(model_name_or_path, str) or not model_name_or_path:
            raise TypeError(f"model_name_or_path must be a folder or Hub id (a non-empty str), got "
                            f"{model_name_or_path!r}")
        stateful = batching.get("max_batch_duration_secs") is not None
        super().__init__(**batching, element_size_fn=self._element_weight, large_model=large_model,
                         model_copies=model_copies, batch_length_fn=self._element_length if stateful else None,
                         batch_bucket_boundaries=length_buckets if stateful else None)
        self.model_name_or_path = model_name_or_path
        self._isolate_failures = False
        self._loaded_tools = None
        self._local_folders: dict[str, str] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_loaded_tools=None, _local_folders={})
        return state

    def local(self, name_or_path: str) -> str:
        """`name_or_path` as `from_pretrained` takes it: a URL's folder is copied to local disk once per process."""
        if name_or_path not in self._local_folders:
            self._local_folders[name_or_path] = local_checkpoint(name_or_path)
        return self._local_folders[name_or_path]

    def prepare(self, example: Any) -> Any:
        """Reads and checks one element before batching (see the subclasses)."""
        raise NotImplementedError(type(self))

    def prepare_keyed(self, element: tuple[Any, Any]) -> tuple[Any, Any]:
        """`prepare` for a `(key, example)` element of a `KeyedModelHandler`: `(key, prepared)`.

        Raises:
            TypeError: If the element is not a `(key, example)` pair; as `prepare` otherwise.
        """
        if not isinstance(element, tuple) or len(element) != 2:
            raise TypeError(f"a keyed element must be a (key, example) pair, got {describe(element)}")
        key, example = element
        return key, self.prepare(example)

    def prepared(self, batch: Sequence[Any]) -> list[Any]:
        """The batch's elements prepared (those that went through `prepare` as a preprocessing step are
        kept as they are).

        Raises:
            As `prepare`, for the first bad element, naming it: Beam's dead-letter output then holds
            the whole batch.
        """
        return [example if isinstance(example, self.prepared_type) else self.prepare(example) for example in batch]

    def with_dead_letters(self, keyed: bool = False) -> ModelHandler:
        """This handler with a dead letter for each bad element, for `RunInference(...).with_exception_handling()`.

        Each element is prepared before batching (`prepare`); an element that fails there lands in
        `failed_preprocessing[0]`. A batch that fails in the model is run again element by element; an
        element that fails alone lands in `failed_postprocessing[0]` (as its `PredictionResult`, keyed:
        `(key, PredictionResult)`), and the rest of its batch succeeds. Dead letters are
        `(element, (exception type, message, traceback))`.

        Args:
            keyed: Take `(key, example)` elements and return `(key, PredictionResult)` (a `KeyedModelHandler`).

        Returns:
            The model handler to give `RunInference`.
        """
        handler = copy.copy(self)
        handler._isolate_failures = True
        if keyed:
            return (KeyedModelHandler(handler).with_preprocess_fn(handler.prepare_keyed)
                    .with_postprocess_fn(handler.check_keyed))
        return handler.with_preprocess_fn(handler.prepare).with_postprocess_fn(handler.check)

    @staticmethod
    def check(result: PredictionResult) -> PredictionResult:
        """`result`, after inference (the postprocessing step of `with_dead_letters`).

        Raises:
            Exception: The error of an element that failed alone in `run_inference`.
        """
        if isinstance(result.inference, ElementFailure):
            raise result.inference.error
        return result

    def check_keyed(self, element: tuple[Any, PredictionResult]) -> tuple[Any, PredictionResult]:
        """`check` for a `(key, PredictionResult)` element."""
        self.check(element[1])
        return element

    def infer(self, prepared: Sequence[Any], model: Any) -> list[Any]:
        """The inference of each prepared element, in order (see the subclasses)."""
        raise NotImplementedError(type(self))

    def run_inference(self, batch: Sequence[Any], model: Any,
                      inference_args: dict[str, Any] | None = None) -> Iterable[PredictionResult]:
        """Runs a batch (its elements prepared here unless a preprocessing step did it).

        With `with_dead_letters`, a batch that fails is run again element by element, and an element that
        fails alone gets an `ElementFailure` as its inference (raised by the postprocessing step).

        Raises:
            Exception: For a bad element (naming it) or an error of the model; without `with_dead_letters`,
                Beam's `with_exception_handling()` puts the whole batch in `failed_inferences`.
        """
        prepared = self.prepared(batch)
        try:
            inferences = self.infer(prepared, model)
        except Exception as error:  # noqa: BLE001 - any error of the model; each element is run again alone
            if not self._isolate_failures:
                raise
            if len(prepared) == 1:
                inferences = [ElementFailure(error)]
            else:
                logger.warning("a batch of %d elements failed (%s: %s): running them one by one", len(prepared),
                               type(error).__name__, error)
                inferences = [self._infer_alone(element, model) for element in prepared]
        return [PredictionResult(p.example, inference, self.model_name_or_path)
                for p, inference in zip(prepared, inferences)]

    def _infer_alone(self, prepared: Any, model: Any) -> Any:
        """The inference of one element, or its `ElementFailure`."""
        try:
            return self.infer([prepared], model)[0]
        except Exception as error:  # noqa: BLE001 - the element's own error, for its dead letter
            return ElementFailure(error)

    def length(self, prepared: Any) -> int:
        raise NotImplementedError(type(self))

    def weight(self, prepared: Any) -> int:
        raise NotImplementedError(type(self))

    def _unkeyed_prepared(self, element: Any) -> Any | None:
        """The prepared example inside a batching element (bare or keyed), or None if not prepared yet."""
        if isinstance(element, self.prepared_type):
            return element
        if isinstance(element, tuple) and len(element) == 2 and isinstance(element[1], self.prepared_type):
            return element[1]
        return None

    def _element_length(self, element: Any) -> int:
        # Never raises: an element that was not prepared goes to the first bucket and is checked later.
        prepared = self._unkeyed_prepared(element)
        return 0 if prepared is None else self.length(prepared)

    def _element_weight(self, element: Any) -> int:
        prepared = self._unkeyed_prepared(element)
        return 1 if prepared is None else self.weight(prepared)

    def get_metrics_namespace(self) -> str:
        return f"xlagen.{type(self).__name__}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_name_or_path!r})"
