"""`xlagen serve [MODEL]`: an OpenAI-compatible HTTP server (needs the `serve` extra: FastAPI, uvicorn,
prometheus-client, python-multipart, jinja2).

One process: the model is loaded once, the decoding runs on the backends' threads, uvicorn serves HTTP on
the event loop. A text model serves `/v1/completions` (and `/v1/chat/completions` when its tokenizer has a
chat template) on the slot engine, beam search (`num_beams` > 1) on the request batcher; a Whisper model
serves `/v1/audio/transcriptions` (and `/v1/audio/translations`). Without MODEL it serves the built-in
default model. The listening socket is bound before the model loads, so a port in use is reported at once.
The programs of the prompt lengths named by `--prompt-buckets` are compiled before `/health` answers 200
(longer prompts compile their bucket when they first come); with `--compile-cache DIR` a restarted server
loads them from there instead. SIGTERM (or Ctrl-C) drains: no new connections, the requests in flight finish,
bodies still being sent are refused, then the process exits.

The API key comes from `--api-key-file` (its first line), `--api-key` (visible to other users in the process
list) or `$XLAGEN_API_KEY`; an empty one is an error, never "no key". docs/serving.md ("Deploying") describes
the security model and every flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import time

from xlagen.cli.common import (UsageError, add_hub_arguments, add_weight_dtype_argument, default_model_path,
                               hub_options, int_list, positive_float, positive_int)
from xlagen.cli.generate import use_compile_cache

logger = logging.getLogger("xlagen.cli.serve")
API_KEY_VARIABLE = "XLAGEN_API_KEY"
_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "multipart", "jinja2")


def _names(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated host names (`*`, `.example.com`, `api.example.com`, `10.0.0.5`)."""
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    if not names or not all(re.fullmatch(r"\*|\.?[A-Za-z0-9_.:\[\]-]+", name) for name in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated host names, got {value!r}")
    return names


def _origins(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated web origins (`https://app.example.com`, `http://localhost:3000`, `*`)."""
    origins = tuple(part.strip() for part in value.split(",") if part.strip())
    if not origins or not all(re.fullmatch(r"\*|[a-z][a-z0-9+.-]*://[^/\s]+/?", origin) for origin in origins):
        raise argparse.ArgumentTypeError(f"expected comma-separated origins such as https://app.example.com, "
                                         f"got {value!r}")
    return origins


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `serve` on the `xlagen` sub-parsers (see `xlagen.cli.__main__`)."""
    parser = subparsers.add_parser("serve", parents=parents, help="serve a model over HTTP (OpenAI API)",
                                   description="Serve a checkpoint over an OpenAI-compatible HTTP API: completions, "
                                   "chat completions, audio transcriptions and translations (Whisper), /health and "
                                   "/metrics.")
    parser.add_argument("model", metavar="MODEL", nargs="?",
                        help="Hugging Face checkpoint folder or Hub id (default: the built-in default model)")
    parser.add_argument("--model-name", help="the model id clients use (default: MODEL)")
    add_hub_arguments(parser)
    add_weight_dtype_argument(parser)
    net = parser.add_argument_group("HTTP and security")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    net.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one)")
    net.add_argument("--api-key-file", metavar="FILE",
                     help="require 'Authorization: Bearer KEY' on /v1, KEY being this file's first line")
    net.add_argument("--api-key", help=f"the same with KEY given here (visible in the process list; prefer "
                     f"--api-key-file or ${API_KEY_VARIABLE}); default: ${API_KEY_VARIABLE} if set, else no key")
    net.add_argument("--allowed-hosts", type=_names, default=(), metavar="NAMES",
                     help="host names (Host header) to answer to besides the listening address and, on loopback, "
                          "localhost: comma-separated, '.example.com' for a domain and its subdomains, '*' for any")
    net.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGINS",
                     help="web origins (https://app.example.com) whose pages may call the API, with CORS; requests "
                          "from other origins get 403 (default: none; '*' for any)")
    net.add_argument("--max-body-size", type=positive_int, default=25 * 1024 * 1024, metavar="BYTES",
                     help="larger request bodies get 413 (default: 25 MiB)")
    net.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                     help="a request's deadline (default: 600)")
    net.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                     help="a connection that has not sent its request's headers within this is closed (default: 10)")
    net.add_argument("--body-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                     help="a request whose body has not arrived within this gets 408 (default: 60)")
    net.add_argument("--max-connections", type=positive_int, default=512,
                     help="open connections at most; more are closed at once (default: 512)")
    net.add_argument("--max-n", type=positive_int, default=8, help="largest n accepted (default: 8)")
    net.add_argument("--max-audio-seconds", type=positive_float, default=3600.0, metavar="SECONDS",
                     help="audio uploads that last longer get 400, checked before their samples are held "
                          "(default: 3600)")
    engine = parser.add_argument_group("decoding")
    engine.add_argument("--backend", choices=("slots", "batcher"),
                        help="slots: the continuous-batching engine (default when installed); batcher: "
                             "whole-generation batches of concurrent requests (CompiledGenerator)")
    engine.add_argument("--slots", type=positive_int, default=8, help="decode slots of the engine (default: 8)")
    engine.add_argument("--max-length", type=positive_int, metavar="TOKENS",
                        help="prompt + new tokens per slot (default: the model's positions, halved while the slots' KV "
                             "cache would take over half of the memory available); each slot holds a KV cache of "
                             "1.25x this, and start-up refuses a size that does not fit in memory")
    engine.add_argument("--prefill-batch", type=positive_int, default=4,
                        help="slots: most waiting prompts prefilled together (default: 4)")
    engine.add_argument("--prefill-chunk", type=positive_int, default=256, metavar="TOKENS",
                        help="slots: a longer prompt arriving while others decode is prefilled this many tokens at a "
                             "time between their steps (default: 256)")
    engine.add_argument("--steps-per-call", type=positive_int, default=4, metavar="K",
                        help="slots: tokens per slot in one compiled call while no request waits for a slot "
                             "(tokens then stream up to K-1 late; 1: one per call; default: 4)")
    engine.add_argument("--max-batch", type=positive_int, default=8,
                        help="requests per batch of the batcher and of transcriptions (default: 8)")
    engine.add_argument("--max-queue", type=positive_int, default=64,
                        help="waiting requests before 429 (default: 64)")
    engine.add_argument("--prompt-buckets", type=int_list, default=(16, 64), metavar="LENGTHS",
                        help="prompt lengths whose programs are compiled at start (comma-separated; default: 16,64); "
                             "every prompt that fits is served, a longer one compiles its length bucket when it "
                             "first comes")
    engine.add_argument("--warmup-new-tokens", type=int_list, default=(16,), metavar="COUNTS",
                        help="batcher: max_new_tokens buckets to compile at start (default: 16)")
    engine.add_argument("--beam-sizes", type=int_list, default=(2, 4), metavar="BEAMS",
                        help="num_beams values above 1 that are served, each with programs of its own; others get "
                             "400 (default: 2,4)")
    engine.add_argument("--warmup-beams", type=int_list, default=(), metavar="BEAMS",
                        help="num_beams values to compile for beam search at start (served too; default: none)")
    engine.add_argument("--no-warmup", action="store_true",
                        help="answer /health with 200 at once; the first request of each shape compiles")
    engine.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled XLA programs in DIR across restarts (TensorFlow's persistent cache)")
    parser.set_defaults(run=run, prepare=prepare)
    return parser


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or the variable, in that order.

    Raises:
        UsageError: For an empty key, both flags, or an unreadable file.
    """
    if args.api_key_file is not None and args.api_key is not None:
        raise UsageError("give --api-key-file or --api-key, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                key, source = (file.readline().strip(), f"--api-key-file {args.api_key_file}")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --api-key-file {args.api_key_file}: {error}") from None
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_VARIABLE in os.environ:
        key, source = os.environ[API_KEY_VARIABLE], f"${API_KEY_VARIABLE}"
    else:
        return None
    if not key.strip():
        raise UsageError(f"the API key from {source} is empty (an unset variable?): give a key, or none of "
                         f"--api-key-file, --api-key and ${API_KEY_VARIABLE} to serve without one")
    if source == "--api-key":
        logger.warning("--api-key puts the key in the process list, where other users of this machine can read it: "
                       "prefer --api-key-file or $%s", API_KEY_VARIABLE)
    return key.strip()


def prepare(args: argparse.Namespace) -> None:
    """Checks the extra is installed and the options, reads the API key, binds the listening socket and sets up
    the compile cache (before TensorFlow starts).

    Raises:
        UsageError: If a package of the `serve` extra is missing, or for a bad option or key.
        OSError: If the address cannot be bound (a port in use).
    """
    import importlib.util

    missing = [name for name in _EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"xlagen serve needs {', '.join(missing)}: pip install 'xlagen[serve]'")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if any(size < 2 for size in (*args.beam_sizes, *args.warmup_beams)):
        raise UsageError("--beam-sizes and --warmup-beams are num_beams values >= 2")
    if args.model is None:
        args.model = default_model_path()
        if args.model is None:
            raise UsageError("xlagen serve needs MODEL: the built-in default model is missing from this installation")
        args.model_name = args.model_name or "xlagen-default"
    if args.backend is None:
        args.backend = "slots" if importlib.util.find_spec("xlagen.serving.engine") is not None else "batcher"
    args.api_key = _api_key(args)
    from xlagen.serving.guard import is_loopback
    from xlagen.serving.http import bind, raise_file_limit

    if args.api_key is None and not is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can use the model",
                       args.host)
    raise_file_limit(args.max_connections + 256)
    args.socket = bind(args.host, args.port)
    if args.compile_cache:
        use_compile_cache(args.compile_cache, args.verbose)


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
                                       max_queue=args.max_queue, max_audio_seconds=args.max_audio_seconds)
        return Backends(tokenizer.tokenizer, speech=batcher, warmup=None if args.no_warmup else batcher.warmup)
    beams = RequestBatcher(model, tokenizer, generator=generator, max_batch=args.max_batch, max_queue=args.max_queue)
    if args.backend == "slots":
        from xlagen.serving.engine import Engine, default_max_length, default_prompt_buckets

        positions = getattr(model.config, "max_positions", None)
        max_length = args.max_length or default_max_length(model, args.slots, args.steps_per_call)
        if positions is not None and max_length > positions:
            raise UsageError(f"--max-length {max_length} exceeds the model's {positions} positions")
        encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        buckets = set(default_prompt_buckets(max_length, encoder_decoder))
        buckets |= {b for b in args.prompt_buckets if encoder_decoder or b < max_length}
        text = Engine(model, tokenizer, slots=args.slots, max_length=max_length, prompt_buckets=tuple(sorted(buckets)),
                      max_queue=args.max_queue, prefill_batch=args.prefill_batch, steps_per_call=args.steps_per_call,
                      prefill_chunk=args.prefill_chunk)
        logger.info("slots' KV cache: %.2f GiB", text.stats()["cache_bytes"] / 2**30)
    else:
        text = beams

    def warmup():
        if text is beams:
            beams.warmup(batch_sizes=(1, args.max_batch), prompt_lengths=args.prompt_buckets,
                         max_new_tokens=args.warmup_new_tokens)
        else:
            text.warmup(buckets=[b for b in args.prompt_buckets if b <= text.prompt_buckets[-1]])
        for num_beams in args.warmup_beams:
            beams.warmup(batch_sizes=(1,), prompt_lengths=args.prompt_buckets,
                         max_new_tokens=args.warmup_new_tokens, num_beams=num_beams)

    return Backends(tokenizer, text=text, beams=beams, warmup=None if args.no_warmup else warmup)


def run(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM / SIGINT; returns 0 after a graceful drain."""
    from xlagen.serving.http import HttpLimits, server_for
    from xlagen.serving.server import ServerSettings, create_app

    started = time.perf_counter()
    # SIGTERM while loading ends the process at once; once uvicorn runs it drains, then raises the signal again
    # after its own handler is gone: the drain is done by then, so this handler ends the process normally.
    signal.signal(signal.SIGTERM, _exit_normally)
    try:
        settings = ServerSettings(model_name=args.model_name or args.model, api_key=args.api_key,
                                  max_body_bytes=args.max_body_size, request_timeout=args.request_timeout,
                                  max_n=args.max_n, host=args.host, allowed_hosts=args.allowed_hosts,
                                  allowed_origins=args.allowed_origins, body_timeout=args.body_timeout,
                                  beam_sizes=tuple(sorted(set(args.beam_sizes) | set(args.warmup_beams))))
        tokenizer, model, speech = _load(args)
        backends = build_backends(args, tokenizer, model, speech)
        app = create_app(backends, settings)
        limits = HttpLimits(header_timeout=args.header_timeout, max_connections=args.max_connections,
                            graceful_timeout=args.request_timeout)
        server = server_for(app, limits, log_level="info" if args.verbose else "warning", access_log=args.verbose)
        host, port = args.socket.getsockname()[:2]
        logger.info("model loaded in %.1f s; serving on http://%s:%d", time.perf_counter() - started,
                    f"[{host}]" if ":" in host else host, port)
        server.run(sockets=[args.socket])
    finally:
        args.socket.close()
    return 0


def _exit_normally(signum, frame) -> None:
    raise SystemExit(0)
