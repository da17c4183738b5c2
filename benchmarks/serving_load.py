"""Load test of `xlagen serve` on loopback: concurrent streaming clients, and the same workload through
`CompiledGenerator` one request at a time and in static batches of 8.

The model is a GPT-2-small-shaped random checkpoint (or --layers/--width for a smaller one) written to a
temporary folder with a tokenizer of the same vocabulary (a byte-level BPE plus filler tokens). For each
concurrency level (default 1, 4, 16, 64) the clients send `--requests` streaming greedy completions in all,
prompts of mixed lengths given as token ids and mixed `max_tokens`, each client one request at a time; the
run of a level stops after `--level-seconds`. Measured: requests/s, output tokens/s, time to first token
and inter-token gaps (p50, p99) as the client sees them, 429s, and whether each accepted request got the
complete, correct answer (its text equals the greedy continuation `CompiledGenerator` gives alone).
Also measured: the time from launch to `/health` 200 with an empty compile cache (cold) and with the
cache the first launch filled (warm). With --whisper-uploads N, a second server (a tiny random Whisper)
transcribes N uploads of 1-20 s (speech from espeak-ng when installed, else synthesised tones): each alone
(the reference transcripts), then from concurrent clients, measured on a second pass after a first that
compiles the batch shapes (requests/s, latency p50/p99, 429s, whether each answer equals the one it got
alone).

    python benchmarks/serving_load.py --requests 64 --concurrency 1,4,16,64 --level-seconds 240 \\
        --whisper-uploads 8 --whisper-concurrency 4,8 --skip-cold \\
        --out benchmarks/results/serving-load-gpt2-small.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (8, 12, 24, 40, 60)
MAX_TOKENS = (16, 32, 64)


def build_checkpoint(folder: Path, layers: int, width: int, heads: int) -> int:
    """A random GPT-2 checkpoint and a tokenizer of its vocabulary (50257); returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from xlagen.modeling import TFGPT2LMHeadModel
    from xlagen.models.gpt2 import GPT2Config

    vocab = 50257
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    backend.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(vocab - backend.get_vocab_size())])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "model_max_length": 1024}))
    model = TFGPT2LMHeadModel(GPT2Config(num_layers=layers, hidden_size=width, num_heads=heads))
    model.save_pretrained(folder)
    return vocab


def workload(count: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`count` (prompt ids, max_tokens) pairs, lengths and budgets cycling through the mixes."""
    random = np.random.RandomState(seed)
    return [(random.randint(1, vocab, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]).tolist(),
             MAX_TOKENS[(i // len(PROMPT_LENGTHS)) % len(MAX_TOKENS)]) for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def start_server(folder: Path, args, port: int, cache: Path) -> tuple[subprocess.Popen, float]:
    """Launches `xlagen serve`; returns it and the seconds until /health answered 200."""
    import httpx

    command = [sys.executable, "-m", "xlagen.cli", "serve", str(folder), "--port", str(port), "--backend",
               args.backend, "--prompt-buckets", "16,32,64", "--warmup-new-tokens", "16,32,64", "--max-batch",
               str(args.max_batch), "--max-queue", str(args.max_queue), "--slots", str(args.slots),
               "--max-length", str(args.max_length), "--compile-cache", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process, time.perf_counter() - started
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(300)


async def one_request(client, prompt: list[int], max_tokens: int) -> dict:
    """Streams one completion; returns its status, text and timings."""
    sent = time.perf_counter()
    stamps, text, status = [], "", None
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                               "temperature": 0, "stream": True}) as response:
        status = response.status_code
        if status == 200:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
                    text += chunk["choices"][0]["text"]
        else:
            await response.aread()
    return {"status": status, "text": text, "ttft": stamps[0] - sent if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "done": stamps[-1] if stamps else time.perf_counter()}


async def run_level(url: str, jobs: list, concurrency: int, seconds: float, expected: list[str],
                    counts: list[int]) -> dict:
    import httpx

    queue = list(enumerate(jobs))
    results = []
    deadline = time.perf_counter() + seconds

    async def client_loop(client):
        while queue and time.perf_counter() < deadline:
            index, (prompt, max_tokens) = queue.pop(0)
            result = await one_request(client, prompt, max_tokens)
            results.append((index, result))

    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    accepted = [(i, r) for i, r in results if r["status"] == 200]
    correct = sum(r["text"] == expected[i] for i, r in accepted)
    tokens = sum(counts[i] for i, r in accepted if r["text"] == expected[i])
    gaps = [g for _, r in accepted for g in r["gaps"]]
    ttfts = [r["ttft"] for _, r in accepted if r["ttft"] is not None]
    return {"concurrency": concurrency, "sent": len(results), "accepted": len(accepted),
            "rejected_429": sum(r["status"] == 429 for _, r in results),
            "other_errors": sum(r["status"] not in (200, 429) for _, r in results),
            "complete_and_correct": correct, "wall_s": wall, "requests_per_s": len(accepted) / wall,
            "output_tokens_per_s": tokens / wall, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "inter_token_p50_ms": (percentile(gaps, 50) or 0) * 1000, "inter_token_p99_ms": (percentile(gaps, 99) or 0) * 1000}


def baselines(folder: Path, jobs: list) -> tuple[dict, list[str], list[int]]:
    """The workload one at a time and in static batches of 8 through CompiledGenerator; the expected texts."""
    from xlagen import AutoTokenizer, TFAutoModelForCausalLM
    from xlagen.generation.compiled import CompiledGenerator

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = TFAutoModelForCausalLM.from_pretrained(folder)
    generator = CompiledGenerator(model)
    eos = tokenizer.eos_token_id
    options = dict(do_sample=False, repetition_penalty=1.0, eos_token_id=eos, pad_token_id=eos)

    def one_at_a_time(jobs=jobs) -> tuple[list[str], list[int]]:
        texts, counts = [], []
        for prompt, max_tokens in jobs:
            out = generator.generate(np.array([prompt], np.int32), max_new_tokens=max_tokens, **options).numpy()[0]
            new = out[len(prompt):].tolist()
            new = new[:new.index(eos) + 1] if eos in new else new
            counts.append(len(new))
            texts.append(tokenizer.decode(new, skip_special_tokens=True))
        return texts, counts

    def static_batches(jobs=jobs) -> None:
        for start in range(0, len(jobs), 8):
            batch = jobs[start:start + 8]
            length = max(len(p) for p, _ in batch)
            ids = np.full((len(batch), length), eos, np.int32)
            mask = np.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):
                ids[row, length - len(prompt):], mask[row, length - len(prompt):] = prompt, 1
            generator.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in batch), **options).numpy()

    shapes = len(PROMPT_LENGTHS) * len(MAX_TOKENS)  # the first jobs hold every shape of the workload
    one_at_a_time(jobs[:shapes])  # compiles: both are timed warm, as the server is
    static_batches(jobs[:2 * shapes])
    started = time.perf_counter()
    expected, counts = one_at_a_time()
    single = time.perf_counter() - started
    started = time.perf_counter()
    static_batches()
    static = time.perf_counter() - started
    tokens = sum(counts)
    return ({"requests": len(jobs), "output_tokens": tokens,
             "one_at_a_time": {"wall_s": single, "tokens_per_s": tokens / single},
             "static_batches_of_8": {"wall_s": static, "tokens_per_s": tokens / static}}, expected, counts)


def build_whisper(folder: Path, clips: int, seed: int = 0) -> list[bytes]:
    """A tiny random Whisper checkpoint (the tests' builders) and `clips` WAV uploads of 1-20 s: synthesised tones
    (espeak-ng speech when it is installed)."""
    import io

    import soundfile

    sys.path.insert(0, str(ROOT / "tests"))
    from models.test_whisper import save_tiny_whisper
    from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor, synthetic_audio

    save_tiny_whisper(folder, seed=2, max_length=64)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    uploads = []
    for number in range(clips):
        seconds = 1.0 + 19.0 * number / max(clips - 1, 1)
        data = io.BytesIO()
        espeak = shutil.which("espeak-ng")
        if espeak:
            words = " ".join(["the quick brown fox jumps over the lazy dog"] * max(1, int(seconds / 3)))
            data.write(subprocess.run([espeak, "--stdout", words], capture_output=True, check=True).stdout)
        else:
            soundfile.write(data, synthetic_audio(seconds, seed=seed + number), 16000, format="WAV")
        uploads.append(data.getvalue())
    return uploads


async def transcribe(client, audio: bytes, number: int) -> dict:
    sent = time.perf_counter()
    response = await client.post("/v1/audio/transcriptions", files={"file": (f"clip{number}.wav", audio)},
                                 data={"language": "en"})
    return {"status": response.status_code, "seconds": time.perf_counter() - sent,
            "text": response.json().get("text") if response.status_code == 200 else None}


async def run_uploads(url: str, uploads: list[bytes], concurrency: int, expected: list[str] | None) -> dict:
    """`uploads` sent by `concurrency` clients; with `expected`, each accepted answer is checked against it."""
    import httpx

    queue = list(enumerate(uploads))
    results = []

    async def client_loop(client):
        while queue:
            number, audio = queue.pop(0)
            results.append((number, await transcribe(client, audio, number)))

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    accepted = [(n, r) for n, r in results if r["status"] == 200]
    seconds = [r["seconds"] for _, r in accepted]
    return {"concurrency": concurrency, "sent": len(results), "accepted": len(accepted),
            "rejected_429": sum(r["status"] == 429 for _, r in results),
            "other_errors": sum(r["status"] not in (200, 429) for _, r in results),
            "complete_and_correct": sum(expected is not None and r["text"] == expected[n] for n, r in accepted),
            "wall_s": wall, "requests_per_s": len(accepted) / wall, "latency_p50_s": percentile(seconds, 50),
            "latency_p99_s": percentile(seconds, 99), "texts": [r["text"] for _, r in sorted(accepted)]}


def whisper_load(work: Path, args, port: int) -> dict:
    """The Whisper server under uploads: each clip alone (the reference transcripts), then concurrent clients."""
    uploads = build_whisper(work / "whisper", args.whisper_uploads)
    process, ready = start_server(work / "whisper", args, port, work / "whisper-cache")
    try:
        alone = asyncio.run(run_uploads(f"http://127.0.0.1:{port}", uploads, 1, None))
        expected = alone.pop("texts")
        levels = []
        for concurrency in (int(c) for c in args.whisper_concurrency.split(",")):
            # A first pass compiles the batch shapes this concurrency makes (not measured).
            asyncio.run(run_uploads(f"http://127.0.0.1:{port}", uploads, concurrency, expected))
            level = asyncio.run(run_uploads(f"http://127.0.0.1:{port}", uploads, concurrency, expected))
            level.pop("texts")
            levels.append(level)
            print(json.dumps(level), flush=True)
    finally:
        stop_server(process)
    return {"model": "tiny random Whisper (the tests' builder), 80 mel bins",
            "audio": "espeak-ng speech" if shutil.which("espeak-ng") else "synthesised tones (espeak-ng not installed)",
            "clips": len(uploads), "clip_seconds": [1.0, 20.0], "ready_s": ready, "one_at_a_time": alone,
            "levels": levels}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("slots", "batcher"), default="slots")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--level-seconds", type=float, default=300.0, help="time bound of one level")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256, help="the engine's columns per slot")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--whisper-uploads", type=int, default=0, help="also load a tiny Whisper server with this "
                        "many uploads (0: no)")
    parser.add_argument("--whisper-concurrency", default="4,16", help="concurrent upload clients")
    parser.add_argument("--skip-cold", action="store_true", help="measure the ready time with a warm cache only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    work = Path(tempfile.mkdtemp(prefix="serving-load-"))
    try:
        vocab = build_checkpoint(work / "model", args.layers, args.width, args.heads)
        jobs = workload(args.requests, vocab)
        baseline, expected, counts = baselines(work / "model", jobs)
        port = free_port()
        cold = None
        if not args.skip_cold:
            process, cold = start_server(work / "model", args, port, work / "cache")
            stop_server(process)
        process, warm = start_server(work / "model", args, port, work / "cache")
        levels = []
        try:
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                levels.append(asyncio.run(run_level(f"http://127.0.0.1:{port}", jobs, concurrency, args.level_seconds,
                                                    expected, counts)))
                print(json.dumps(levels[-1]), flush=True)
        finally:
            stop_server(process)
        whisper = whisper_load(work, args, port) if args.whisper_uploads else None
        result = {"what": "xlagen serve under concurrent streaming clients vs CompiledGenerator", "backend": args.backend, "slots": args.slots, "max_length": args.max_length,
                  "model": {"layers": args.layers, "width": args.width, "heads": args.heads, "vocab": vocab},
                  "workload": {"prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS, "requests": len(jobs),
                               "greedy": True},
                  "ready_s": {"cold_compile_cache": cold, "warm_compile_cache": warm},
                  "levels": levels, "baselines": baseline, "whisper": whisper,
                  "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version()}}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["ready_s"]), json.dumps(baseline))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
