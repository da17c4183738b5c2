"""`GenerationModelHandler`: text generation in Beam's RunInference, through `CompiledGenerator`.

An element is a prompt string, or a `(prompt, options)` pair whose options (`GenerationConfig` fields and
`seed`) override the handler's for that prompt (Beam's `inference_args` apply to a whole transform).
Each batch that Beam hands over is sorted into groups of equal options and prompt-length bucket, and each
group is one `CompiledGenerator.generate` call: prompts are left-padded, the group padded up to a batch
bucket, so a worker compiles one program per (batch bucket, prompt bucket, new-token bucket, static
options) it meets and reuses it for every later batch and bundle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from apache_beam.ml.inference.base import PredictionResult

from xlagen.beam.handler import XlagenModelHandler, bucket_of, describe, lower_inclusive_boundaries
from xlagen.generation.compiled import Buckets
from xlagen.generation.config import GenerationConfig

_PER_ELEMENT = GenerationConfig.field_names() - {"max_memory_gb"} | {"seed"}


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A checked, tokenized prompt (what `GenerationModelHandler.prepare` returns).

    Attributes:
        example: The element as given (echoed in the `PredictionResult`).
        ids: Its token ids.
        options: The handler's options updated with the element's, as sorted `(name, value)` pairs
            (lists as tuples), so that equal options group together.
    """

    example: Any
    ids: tuple[int, ...]
    options: tuple[tuple[str, Any], ...]


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _split_example(example: Any) -> tuple[str, Mapping[str, Any]]:
    """(prompt, options) of an element: a string or a `(string, mapping)` pair."""
    if isinstance(example, str):
        return example, {}
    if (isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], str)
            and isinstance(example[1], Mapping)):
        return example
    hint = " ((key, example) pairs need KeyedModelHandler)" if isinstance(example, tuple) else ""
    raise TypeError(f"a generation element is a prompt string or a (prompt, options dict) pair, got "
                    f"{describe(example)}{hint}")


class _Tools:
    """What preparation needs on a worker: the tokenizer and the checkpoint's generation config."""

    def __init__(self, handler: GenerationModelHandler):
        from xlagen import AutoTokenizer
        from xlagen.hub import resolve_model_dir
        from xlagen.modeling import TFAutoModelForGeneration

        hub = handler.hub_options
        self.tokenizer = AutoTokenizer.from_pretrained(handler.local(handler.tokenizer_name), padding_side="left",
                                                       **hub)
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"the tokenizer of {handler.tokenizer_name} has neither a pad nor an EOS token to "
                                 "pad batches with")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        folder = resolve_model_dir(handler.local(handler.model_name_or_path), **hub)
        self.config = (GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file()
                       else GenerationConfig())
        model_config = TFAutoModelForGeneration.config_from_pretrained(folder)
        self.max_positions = model_config.max_positions
        self.is_encoder_decoder = getattr(model_config, "is_encoder_decoder", False)


class GenerationModelHandler(XlagenModelHandler):
    """A Beam `ModelHandler` generating text for prompts with an xlagen causal or encoder-decoder LM.

    Elements are prompt strings or `(prompt, options)` pairs; each result is
    `PredictionResult(example, {"text": str, "tokens": [int], "finish_reason": "stop" | "length"},
    model_id)`, the new tokens up to (not including) the first EOS. With `num_return_sequences=R > 1`
    "text", "tokens" and "finish_reason" are lists of R.

    Args:
        model_name_or_path: A checkpoint folder or Hub id, loaded on each worker (see docs/scale-out.md).
        tokenizer: Tokenizer folder or Hub id; default: the model's.
        buckets: xlagen's padding buckets; Beam's batches follow them (`max_batch_size` defaults to the
            largest batch bucket; with `max_batch_duration_secs`, the prompt-length buckets become Beam's
            length buckets).
        weight_dtype: "float32", "bfloat16" or "int8" (see `from_pretrained`).
        hub_options: `revision`, `cache_dir`, `local_files_only` for the model and tokenizer.
        min_batch_size, max_batch_size, max_batch_duration_secs: Beam's BatchElements settings.
        large_model, model_copies: Share the model between a machine's worker processes (Beam's
            large-model mode); by default each worker process loads one.
        **generation_options: `GenerationConfig` fields (max_new_tokens, do_sample, num_beams, ...) and
            `seed`, for every element.

    Raises:
        TypeError, ValueError: For an unknown or invalid generation option (checked here, on the machine
            that builds the pipeline).
    """

    prepared_type = PreparedPrompt

    def __init__(self, model_name_or_path: str, *, tokenizer: str | None = None, buckets: Buckets | None = None,
                 weight_dtype: str = "float32", hub_options: Mapping[str, Any] | None = None,
                 min_batch_size: int | None = None, max_batch_size: int | None = None,
                 max_batch_duration_secs: float | None = None, large_model: bool = False,
                 model_copies: int | None = None, **generation_options):
        self.buckets = buckets or Buckets()
        self._checked_options(generation_options, GenerationConfig(), "handler")
        self.generation_options = dict(generation_options)
        largest = max_batch_size or self.buckets.batch_sizes[-1]
        batching = {"min_batch_size": min_batch_size or largest, "max_batch_size": largest,
                    "max_batch_duration_secs": max_batch_duration_secs}
        super().__init__(model_name_or_path, length_buckets=lower_inclusive_boundaries(self.buckets.prompt_lengths),
                         batching={k: v for k, v in batching.items() if v is not None}, large_model=large_model,
                         model_copies=model_copies)
        self.tokenizer_name = tokenizer or model_name_or_path
        self.weight_dtype = weight_dtype
        self.hub_options = dict(hub_options or {})

    @staticmethod
    def _checked_options(options: Mapping[str, Any], base: GenerationConfig, where: str) -> GenerationConfig:
        """`base` updated with `options` (the seed aside), refusing unknown options and invalid values."""
        unknown = sorted(set(options) - _PER_ELEMENT)
        if unknown:
            raise TypeError(f"unknown generation option(s) {unknown} for the {where}: use GenerationConfig "
                            "fields such as max_new_tokens, do_sample, temperature, top_k, top_p, num_beams, or seed")
        if "seed" in options and (isinstance(options["seed"], bool) or not isinstance(options["seed"], int)):
            raise TypeError(f"seed must be an int, got {options['seed']!r}")
        return base.update(**{k: v for k, v in options.items() if k != "seed"})

    def _tools(self) -> _Tools:
        if self._loaded_tools is None:
            self._loaded_tools = _Tools(self)
        return self._loaded_tools

    def prepare(self, example: Any) -> PreparedPrompt:
        """Checks and tokenizes one element (run it per element before batching to give bad elements
        their own dead letters: `handler.with_dead_letters()`).

        Raises:
            TypeError: For an element that is neither a string nor a (string, options) pair, or unknown options.
            ValueError: For an empty prompt, invalid options, a prompt or max_new_tokens beyond the largest
                bucket, or a prompt and new tokens beyond the model's positions; the message quotes the
                element.
        """
        prompt, own = _split_example(example)
        tools = self._tools()
        try:
            options = {**self.generation_options, **own}
            config = self._checked_options(options, tools.config, "element")
            ids = tools.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("the prompt encodes to no tokens")
            if len(ids) > self.buckets.prompt_lengths[-1]:
                raise ValueError(f"the prompt has {len(ids)} tokens, more than the largest prompt bucket "
                                 f"{self.buckets.prompt_lengths[-1]}")
            # An encoder-decoder model's positions are its decoder's, whose prompt is its start token.
            new = config.new_tokens(1 if tools.is_encoder_decoder else len(ids), tools.max_positions)
            if new > self.buckets.new_tokens[-1]:
                raise ValueError(f"{new} new tokens exceed the largest new-token bucket "
                                 f"{self.buckets.new_tokens[-1]}")
        except (TypeError, ValueError) as error:
            raise type(error)(f"element {describe(example)}: {error}") from error
        return PreparedPrompt(example, tuple(ids), tuple(sorted((k, _frozen(v)) for k, v in options.items())))

    def length(self, prepared: PreparedPrompt) -> int:
        return len(prepared.ids)

    def weight(self, prepared: PreparedPrompt) -> int:
        return 1

    def load_model(self) -> PromptBatcher:
        """Loads the model and its tokenizer (once per worker process, or per machine in large-model mode)."""
        from xlagen.modeling import TFAutoModelForGeneration

        model = TFAutoModelForGeneration.from_pretrained(self.local(self.model_name_or_path),
                                                         weight_dtype=self.weight_dtype, **self.hub_options)
        return PromptBatcher(model, self._tools().tokenizer, self.buckets)

    def infer(self, prepared: Sequence[PreparedPrompt], model: PromptBatcher) -> list[dict[str, Any]]:
        """The inference dict of each prepared prompt, in order (see `XlagenModelHandler.run_inference`)."""
        return model.generate(prepared)

    def validate_inference_args(self, inference_args: dict[str, Any] | None) -> None:
        if inference_args:
            raise ValueError(f"GenerationModelHandler takes no inference_args (got {sorted(inference_args)}): give "
                             "options to the handler, or per element as (prompt, options)")


class PromptBatcher:
    """A loaded model, its tokenizer and compiled programs: generates for prepared prompts of any lengths
    and options, one `CompiledGenerator.generate` call per (options, prompt bucket) group.

    Args:
        model: An xlagen generation model.
        tokenizer: Its tokenizer, with a pad token.
        buckets: Padding buckets of the `CompiledGenerator`.
    """

    def __init__(self, model, tokenizer, buckets: Buckets):
        from xlagen.generation.compiled import CompiledGenerator

        self.tokenizer = tokenizer
        self.generator = CompiledGenerator(model, buckets)
        # An encoder-decoder model returns the decoder's tokens: its start token, then the new ones.
        self.continues_prompt = not getattr(model.config, "is_encoder_decoder", False)

    @property
    def compile_count(self) -> int:
        """Programs compiled so far."""
        return self.generator.compile_count

    def generate(self, prompts: Sequence[PreparedPrompt]) -> list[dict[str, Any]]:
        """The inference dict of each prompt, in order (see `GenerationModelHandler`)."""
        groups: dict[tuple, list[int]] = {}
        for index, prompt in enumerate(prompts):
            key = (prompt.options, bucket_of(len(prompt.ids), self.generator.buckets.prompt_lengths))
            groups.setdefault(key, []).append(index)
        results: list[dict[str, Any]] = [{}] * len(prompts)
        for (options, _), indices in groups.items():
            for index, result in zip(indices, self._generate_group([prompts[i].ids for i in indices], dict(options))):
                results[index] = result
        return results

    def _generate_group(self, rows: list[tuple[int, ...]], options: dict[str, Any]) -> list[dict[str, Any]]:
        import numpy as np

        from xlagen.generation.api import resolve_config

        seed = options.pop("seed", None)
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}
        width = max(len(row) for row in rows)
        ids = np.full((len(rows), width), self.tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):  # left padding
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        sequences = self.generator.generate(ids, attention_mask=mask, seed=seed, **options).numpy()
        new = sequences[:, width if self.continues_prompt else 1:]
        config = resolve_config(self.generator.model, None, options)
        per_prompt = config.num_return_sequences
        outputs = [self._output(row, set(config.eos_token_ids)) for row in new.tolist()]
        if per_prompt == 1:
            return outputs
        return [{name: [o[name] for o in outputs[i * per_prompt:(i + 1) * per_prompt]] for name in outputs[0]}
                for i in range(len(rows))]

    def _output(self, tokens: list[int], eos_ids: set[int]) -> dict[str, Any]:
        ends = [i for i, token in enumerate(tokens) if token in eos_ids]
        kept = tokens[:ends[0]] if ends else tokens
        return {"text": self.tokenizer.decode(kept, skip_special_tokens=True), "tokens": kept,
                "finish_reason": "stop" if ends else "length"}


def result_record(result: PredictionResult) -> dict[str, Any]:
    """A JSON-ready record of a generation result: the prompt, its options if any, and the inference."""
    prompt, options = _split_example(result.example)
    return {"prompt": prompt, **({"options": dict(options)} if options else {}), **result.inference}
