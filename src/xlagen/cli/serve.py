"""`xlagen serve MODEL`: an OpenAI-compatible HTTP server (needs the `serve` extra: FastAPI, uvicorn,
prometheus-client, python-multipart, jinja2).

One process: the model is loaded once, the decoding runs on the backends' threads, uvicorn serves HTTP on
the event loop. A text model serves `/v1/completions` (and `/v1/chat/completions` when its tokenizer has a
chat template) on the slot engine, beam search (`num_beams` > 1) on the request batcher; a Whisper model
serves `/v1/audio/transcriptions`. The programs of the buckets named on the command line are compiled before
`/health` answers 200; with `--compile-cache DIR` a restarted server loads them from there instead.
SIGTERM (or Ctrl-C) drains: no new connections, the requests in flight finish, then the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from xlagen.cli.common import UsageError, add_hub_arguments, add_weight_dtype_argument, hub_options, int_list, positive_int
from xlagen.cli.generate import use_compile_cache

logger = logging.getLogger("xlagen.cli.serve")
API_KEY_VARIABLE = "XLAGEN_API_KEY"
_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "multipart", "jinja2")


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `serve` on the `xlagen` sub-parsers (see `xlagen.cli.__main__`)."""
    parser = subparsers.add_parser("serve", parents=parents, help="serve a model over HTTP (OpenAI API)",
                                   description="Serve a checkpoint over an OpenAI-compatible HTTP API: completions, "
                                   "chat completions, audio transcriptions (Whisper), /health and /metrics.")
    parser.add_argument("model", metavar="MODEL", help="Hugging Face checkpoint folder or Hub id")
    parser.add_argument("--model-name", help="the model id clients use (default: MODEL)")
    add_hub_arguments(parser)
    add_weight_dtype_argument(parser)
    net = parser.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    net.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_VARIABLE} "
                     "if set, else no key)")
    net.add_argument("--max-body-size", type=positive_int, default=25 * 1024 * 1024, metavar="BYTES",
                     help="larger request bodies get 413 (default: 25 MiB)")
    net.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="a request's deadline (default: 600)")
    net.add_argument("--max-n", type=positive_int, default=8, help="largest n accepted (default: 8)")
    engine = parser.add_argument_group("decoding")
    engine.add_argument("--backend", choices=("slots", "batcher"),
                        help="slots: the continuous-batching engine (default when installed); batcher: "
                             "whole-generation batches of concurrent requests (CompiledGenerator)")
    engine.add_argument("--slots", type=positive_int, default=8, help="decode slots of the engine (default: 8)")
    engine.add_argument("--max-length", type=positive_int, metavar="TOKENS",
                        help="prompt + new tokens per slot (default: the model's positions, at most 1024)")
    engine.add_argument("--prefill-batch", type=positive_int, default=4,
                        help="slots: most waiting prompts prefilled together (default: 4)")
    engine.add_argument("--max-batch", type=positive_int, default=8,
                        help="requests per batch of the batcher and of transcriptions (default: 8)")
    engine.add_argument("--max-queue", type=positive_int, default=64,
                        help="waiting requests before 429 (default: 64)")
    engine.add_argument("--prompt-buckets", type=int_list, default=(16, 64), metavar="LENGTHS",
                        help="prompt lengths to compile at start (comma-separated; default: 16,64)")
    engine.add_argument("--warmup-new-tokens", type=int_list, default=(16,), metavar="COUNTS",
                        help="batcher: max_new_tokens buckets to compile at start (default: 16)")
    engine.add_argument("--warmup-beams", type=int_list, default=(), metavar="BEAMS",
                        help="num_beams values to compile for beam search at start (default: none)")
    engine.add_argument("--no-warmup", action="store_true",
                        help="answer /health with 200 at once; the first request of each shape compiles")
    engine.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled XLA programs in DIR across restarts (TensorFlow's persistent cache)")
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def prepare(args: argparse.Namespace) -> None:
    """Checks the extra is installed, reads the API key's variable and sets up the compile cache (before
    TensorFlow starts).

    Raises:
        UsageError: If a package of the `serve` extra is missing, or a bad port or timeout.
    """
    import importlib.util

    missing = [name for name in _EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"xlagen serve needs {', '.join(missing)}: pip install 'xlagen[serve]'")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.backend is None:
        args.backend = "slots" if importlib.util.find_spec("xlagen.serving.engine") is not None else "batcher"
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_VARIABLE) or None
    if args.compile_cache:
        use_compile_cache(args.compile_cache)


def _load(args: argparse.Namespace):
    """(tokenizer or processor, model, is_speech)."""
    from xlagen.weights.checkpoint import read_json

    from xlagen.hub import resolve_model_dir

    hub = hub_options(args)
    folder = resolve_model_dir(args.model, **hub)
    if (read_json(folder, "config.json", required=False) or {}).get("model_type") == "whisper":
        from xlagen.modeling import TFAutoModelForSpeechSeq2Seq
        from xlagen.speech.processing import WhisperProcessor

        return (WhisperProcessor.from_pretrained(folder),
                TFAutoModelForSpeechSeq2Seq.from_pretrained(folder, weight_dtype=args.weight_dtype), True)
    from xlagen.cli.generate import _load as load_text

    tokenizer, model = load_text(str(folder), argparse.Namespace(**{**vars(args), **hub}))
    return tokenizer, model, False


def build_backends(args: argparse.Namespace, tokenizer, model, speech: bool):
    """The server's backends for the command line's choices, with their warm-up."""
    from xlagen.generation.compiled import CompiledGenerator
    from xlagen.serving.batcher import RequestBatcher
    from xlagen.serving.server import Backends

    generator = CompiledGenerator(model)
    if speech:
        from xlagen.serving.speech import TranscriptionBatcher

        batcher = TranscriptionBatcher(model, tokenizer, generator=generator, max_batch=args.max_batch,
                                       max_queue=args.max_queue)
        return Backends(tokenizer.tokenizer, speech=batcher, warmup=None if args.no_warmup else batcher.warmup)
    beams = RequestBatcher(model, tokenizer, generator=generator, max_batch=args.max_batch, max_queue=args.max_queue)
    if args.backend == "slots":
        from xlagen.serving import Engine

        text = Engine(model, tokenizer, slots=args.slots, max_length=args.max_length,
                      prompt_buckets=tuple(args.prompt_buckets), max_queue=args.max_queue,
                      prefill_batch=args.prefill_batch)
    else:
        text = beams

    def warmup():
        if text is beams:
            beams.warmup(batch_sizes=(1, args.max_batch), prompt_lengths=args.prompt_buckets,
                         max_new_tokens=args.warmup_new_tokens)
        else:
            text.warmup()
        for num_beams in args.warmup_beams:
            beams.warmup(batch_sizes=(1,), prompt_lengths=args.prompt_buckets,
                         max_new_tokens=args.warmup_new_tokens, num_beams=num_beams)

    return Backends(tokenizer, text=text, beams=beams, warmup=None if args.no_warmup else warmup)


def run(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM / SIGINT; returns 0 after a graceful drain."""
    import uvicorn

    from xlagen.serving.server import ServerSettings, create_app

    started = time.perf_counter()
    tokenizer, model, speech = _load(args)
    backends = build_backends(args, tokenizer, model, speech)
    settings = ServerSettings(model_name=args.model_name or args.model, api_key=args.api_key,
                              max_body_bytes=args.max_body_size, request_timeout=args.request_timeout,
                              max_n=args.max_n)
    app = create_app(backends, settings)
    logger.info("model loaded in %.1f s; serving on http://%s:%d", time.perf_counter() - started, args.host,
                args.port)
    # uvicorn drains on SIGTERM, then raises the signal again once its own handler is gone: the drain is done
    # by then, so this handler ends the process normally (and during loading, before uvicorn runs, at once).
    signal.signal(signal.SIGTERM, _exit_normally)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                timeout_graceful_shutdown=args.request_timeout)
    return 0


def _exit_normally(signum, frame) -> None:
    raise SystemExit(0)
