"""The slot engine: greedy tokens identical to `model.generate` alone and among other requests, reproducible
sampling, stop ids / stop strings / lengths, cancellation, the queue bound and deadlines."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import CORPUS, random_ids, tiny_family_model

TEXTS = [text[:24] for text in CORPUS[:5]]  # prompts within the 16-token bucket
from xlagen import AutoTokenizer, native
from xlagen.serving import Completion, ContextTooLong, Engine, QueueFull, RequestOptions, TokenEvent
from xlagen.serving.engine import EngineClosed

# 16 requests of different prompt lengths and token counts (more requests than slots, so some wait).
LENGTHS = [3, 7, 5, 8, 12, 2, 9, 4, 14, 6, 1, 10, 16, 11, 13, 15]
NEW_TOKENS = [5, 24, 12, 7, 20, 25, 3, 16, 9, 1, 18, 11, 6, 22, 14, 2]


def references(model, prompts, new_tokens, left_pad=True):
    """`model.generate`'s greedy new tokens for each prompt (one padded batch), each cut at its own count
    and after its first EOS."""
    width = max(len(p) for p in prompts)
    ids, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        columns = slice(width - len(prompt), width) if left_pad else slice(0, len(prompt))
        ids[row, columns], mask[row, columns] = prompt, 1
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=max(new_tokens), pad_token_id=0).numpy()
    stops = set(model.generation_config.eos_token_ids)
    result = []
    for row, new in zip(tokens, new_tokens):
        row = row[-max(new_tokens):][:new].tolist()
        ends = [n for n, token in enumerate(row) if token in stops]
        result.append(row[:ends[0] + 1] if ends else row)
    return result


def run(engine, *requests):
    """Runs `(prompt, options)` requests concurrently; returns their `Completion`s. Every request is submitted
    before the engine thread may take any of them, so that one admission finds them all (submitted one after
    another, a loaded machine could let the engine thread take the first alone)."""
    async def main():
        with engine._lock:  # the engine thread takes waiting requests under this (re-entrant) lock
            streams = [engine.stream(prompt, **options) for prompt, options in requests]

        async def finish(events):
            async for _ in events:
                pass
            return events.completion()

        return await asyncio.gather(*(finish(events) for events in streams))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizer(gpt2_checkpoint):
    return AutoTokenizer.from_pretrained(gpt2_checkpoint[0])


@pytest.fixture(scope="module")
def engine(gpt2_model, tokenizer):
    # max_length 40 with 16 columns of prompt bucket: the 16 requests below make the slots shift.
    engine = Engine(gpt2_model, tokenizer, slots=4, max_length=40, prompt_buckets=(16,), max_queue=32)
    engine.warmup()
    engine.start()
    yield engine
    engine.close()


def test_greedy_alone_equals_generate(engine, gpt2_model):
    prompt = random_ids((5,), 300, seed=1).tolist()
    (completion,) = run(engine, (prompt, dict(max_new_tokens=20)))
    assert [list(completion.token_ids)] == references(gpt2_model, [prompt], [20])
    assert completion.prompt_tokens == 5 and completion.completion_tokens == len(completion.token_ids)


def test_greedy_among_15_others_equals_generate(engine, gpt2_model):
    before = engine.stats()
    shifts = before["shifts"]
    prompts = [random_ids((n,), 300, seed=20 + i).tolist() for i, n in enumerate(LENGTHS)]
    completions = run(engine, *((p, dict(max_new_tokens=n)) for p, n in zip(prompts, NEW_TOKENS)))
    for new, completion, expected in zip(NEW_TOKENS, completions, references(gpt2_model, prompts, NEW_TOKENS)):
        assert list(completion.token_ids) == expected
        assert completion.finish_reason == ("stop" if expected[-1] == 0 and len(expected) <= new else "length")
    stats = engine.stats()
    assert stats["shifts"] > shifts, "the test should make the slots shift"
    # Steps of one token while requests wait for a slot, of steps_per_call (4) tokens once none waits.
    multi, single = (stats["multi_steps"] - before["multi_steps"],
                     stats["steps"] - before["steps"] - (stats["multi_steps"] - before["multi_steps"]))
    assert multi > 0 and single > 0
    assert stats["active_slots"] == 0 and stats["queue_depth"] == 0


def test_a_request_left_alone_moves_to_the_first_slot(engine, gpt2_model):
    """Two prompts prefilled together take slots 0 and 1; when the first ends, the second is moved to slot 0
    and decoded by the one-row step, with the same tokens."""
    before = engine.stats()
    prompts = [random_ids((n,), 300, seed=90 + n).tolist() for n in (4, 9)]
    completions = run(engine, (prompts[0], dict(max_new_tokens=2)), (prompts[1], dict(max_new_tokens=16)))
    assert [list(c.token_ids) for c in completions] == references(gpt2_model, prompts, [2, 16])
    stats = engine.stats()
    assert stats["moves"] == before["moves"] + 1 and stats["prefills"] == before["prefills"] + 2


@pytest.mark.parametrize("kernels", [None, native.Kernels.OFF], ids=["native-step-attention", "xla-ops"])
def test_a_narrow_step_reads_its_rows_of_the_whole_cache(gpt2_model, tokenizer, kernels):
    """A step of 2 of 4 slots attends over the first rows of the whole cache (the native step attention in
    place, XLA's dots on the rows taken out) and writes its column there: the same tokens as alone."""
    engine = Engine(gpt2_model, tokenizer, slots=4, max_length=40, prompt_buckets=(16,), step_widths=(2, 4),
                    prefill_batch=2, kernels=kernels)
    engine.warmup()
    engine.start()
    try:
        prompts = [random_ids((n,), 300, seed=70 + n).tolist() for n in (4, 9, 13)]
        new_tokens = [20, 3, 12]
        completions = run(engine, *((p, dict(max_new_tokens=n)) for p, n in zip(prompts, new_tokens)))
    finally:
        engine.close()
    assert [list(c.token_ids) for c in completions] == references(gpt2_model, prompts, new_tokens)
    assert engine.stats()["moves"] >= 1  # the last requests were packed into the 2-slot step


@pytest.mark.parametrize("rows, native_calls", [(1, True), (2, False)])
def test_a_one_row_step_attends_with_the_native_kernel(gpt2_model, monkeypatch, rows, native_calls):
    """A slot step's attention is the native call from `Kernels.slot_step_attention_min_rows` query rows (one
    by default: it skips the cache's masked columns, which XLA's dots read), not from the `generate` policy's
    `step_attention_min_rows`."""
    from xlagen.generation.row_sampling import RowOptions
    from xlagen.generation.slots import SlotDecoder

    calls = []
    real = native.step_attention
    monkeypatch.setattr(native, "step_attention", lambda *args: calls.append(args[0].shape) or real(*args))
    decoder = SlotDecoder(gpt2_model, slots=2, max_length=24,
                          kernels=native.Kernels().replace(slot_step_attention_min_rows=rows))
    options = RowOptions(np.zeros(1, bool), np.ones(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                         np.ones(1, np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.int32))
    decoder.step(8, options, width=1)
    assert bool(calls) == native_calls
    assert all(shape[0] == 1 for shape in calls)


def test_text_is_the_decoded_tokens(engine, tokenizer):
    completions = run(engine, *((text, dict(max_new_tokens=12)) for text in TEXTS[:3]))
    for completion in completions:
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_stream_events(engine):
    async def main():
        events = [event async for event in engine.stream(TEXTS[1], max_new_tokens=6, logprobs=True)]
        return events

    events = asyncio.run(main())
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason in ("stop", "length")
    assert all(e.logprob is not None and e.logprob <= 0.0 for e in events)


def test_greedy_logprobs_are_the_log_softmax_of_the_logits(engine, gpt2_model):
    prompt = random_ids((6,), 300, seed=3).tolist()
    (completion,) = run(engine, (prompt, dict(max_new_tokens=4, logprobs=True)))
    output = gpt2_model.generate(np.array([prompt], np.int32), max_new_tokens=4, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    expected = [float(tf.nn.log_softmax(scores[0])[token]) for scores, token in zip(output.scores,
                                                                                    completion.token_ids)]
    np.testing.assert_allclose(completion.logprobs, expected, rtol=1e-5, atol=1e-5)


def test_sampling_with_a_seed_is_reproducible(engine):
    options = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=1234,
                   repetition_penalty=1.3, stop_token_ids=[])
    prompt = TEXTS[2]
    (alone,) = run(engine, (prompt, options))
    others = [(TEXTS[i % 4], dict(max_new_tokens=8 + i, do_sample=True, seed=i)) for i in range(5)]
    crowded = run(engine, *others[:2], (prompt, options), *others[2:])[2]
    assert crowded.token_ids == alone.token_ids
    reseeded = run(engine, *((prompt, {**options, "seed": seed}) for seed in range(4)))
    assert len({c.token_ids for c in reseeded} | {alone.token_ids}) > 1


def test_top_k_1_sampling_is_greedy(engine):
    prompt = TEXTS[3]
    greedy, sampled = run(engine, (prompt, dict(max_new_tokens=10)),
                          (prompt, dict(max_new_tokens=10, do_sample=True, top_k=1, seed=5)))
    assert sampled.token_ids == greedy.token_ids


def test_stop_token_ids_and_max_new_tokens(engine):
    prompt = random_ids((4,), 300, seed=7).tolist()
    (full,) = run(engine, (prompt, dict(max_new_tokens=10)))
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop = full.token_ids[3]
    (stopped,) = run(engine, (prompt, dict(max_new_tokens=10, stop_token_ids=[stop])))
    end = full.token_ids.index(stop) + 1
    assert stopped.token_ids == full.token_ids[:end] and stopped.finish_reason == "stop"


def test_stop_strings_are_trimmed(engine):
    (full,) = run(engine, (TEXTS[0], dict(max_new_tokens=16)))
    stop = full.text[5:8]
    (stopped,) = run(engine, (TEXTS[0], dict(max_new_tokens=16, stop=[stop, "never seen"])))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]


def test_prompt_and_max_new_tokens_beyond_max_length_are_refused(engine):
    prompt = random_ids((16,), 300, seed=8).tolist()

    async def submit(**options):
        engine.stream(prompt, **options)

    with pytest.raises(ContextTooLong, match=r"16 tokens \+ max_new_tokens 25 = 41 exceed max_length 40.* at most 24"):
        asyncio.run(submit(max_new_tokens=25))
    (exact,), (fitting,) = run(engine, (prompt, dict(max_new_tokens=24))), run(engine, (prompt, dict(max_new_tokens=None)))
    assert fitting == exact and len(exact.token_ids) <= 24  # None: as many as fit
    assert exact.finish_reason == ("length" if len(exact.token_ids) == 24 else "stop")


def test_a_stop_string_completed_by_the_final_flush_is_a_stop(engine, tokenizer):
    """The last token leaves an incomplete character, held back until the request ends; a stop string that the
    flushed text completes ends the request with "stop", like one found earlier."""
    ascii_ids = [i for i in range(2, 300) if tokenizer.decode([i]).isascii()]
    for seed in range(40):
        prompt = [ascii_ids[i] for i in random_ids((6,), len(ascii_ids), seed=60 + seed)]
        (full,) = run(engine, (prompt, dict(max_new_tokens=20)))
        texts = [tokenizer.decode(full.token_ids[:n], skip_special_tokens=True)
                 for n in range(1, len(full.token_ids) + 1)]
        ends = [n for n, text in enumerate(texts, 1) if len(text) > 1 and text.endswith("\ufffd")
                and text.index(text[-2:]) == len(text) - 2]
        if ends:
            break
    else:
        pytest.fail("no greedy output ends with an incomplete character")
    new, text = ends[0], texts[ends[0] - 1]
    (stopped,) = run(engine, (prompt, dict(max_new_tokens=new, stop=[text[-2:]])))
    assert stopped.finish_reason == "stop" and stopped.text == text[:-2]


def test_cancelling_frees_the_slot(engine, monkeypatch):
    # Steps made slow, so that the request is still decoding when the test cancels it (on the tiny model, 24
    # tokens at 4 per call could otherwise end between the test seeing the request and cancelling it).
    step = engine._decoder.step
    monkeypatch.setattr(engine._decoder, "step", lambda *args, **kw: time.sleep(0.2) or step(*args, **kw))

    async def main():
        events = engine.stream(TEXTS[4], max_new_tokens=24, stop_token_ids=[])
        first = await events.__anext__()
        await events.aclose()
        submitted = engine.stats()["requests_submitted"]
        task = asyncio.ensure_future(engine.generate(TEXTS[3], max_new_tokens=24))
        for _ in range(3000):  # until the engine has the request (a loaded machine may take seconds)
            await asyncio.sleep(0.01)
            if engine.stats()["requests_submitted"] > submitted:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):
            stats = engine.stats()
            if stats["active_slots"] == 0 and stats["requests_finished"]["cancelled"] == cancelled + 2:
                break
            await asyncio.sleep(0.01)
        return first

    cancelled = engine.stats()["requests_finished"]["cancelled"]
    first = asyncio.run(main())
    assert first.finish_reason is None
    stats = engine.stats()
    assert stats["active_slots"] == 0 and stats["requests_finished"]["cancelled"] == cancelled + 2


def test_bad_requests_are_refused(engine):
    async def submit(prompt, **options):
        engine.stream(prompt, **options)

    with pytest.raises(ValueError, match="num_beams=2"):
        asyncio.run(submit("hi", num_beams=2))
    with pytest.raises(TypeError, match="unknown request option"):
        asyncio.run(submit("hi", max_tokens=2))
    with pytest.raises(ValueError, match="longer than the largest prompt bucket 16"):
        asyncio.run(submit(list(range(2, 19))))
    with pytest.raises(TypeError, match="flat sequence of int token ids"):
        asyncio.run(submit([1.5, 2.0]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(submit([5, 100000]))
    with pytest.raises(ValueError, match="stop_token_ids holds 999"):
        asyncio.run(submit("hi", stop_token_ids=[999]))


def test_queue_bound_deadline_and_close(gpt2_model, tokenizer):
    """On an engine that is not started: nothing compiles, the requests wait."""
    engine = Engine(gpt2_model, tokenizer, slots=1, max_length=40, prompt_buckets=(8,), max_queue=2)

    async def main():
        late = engine.stream("hello", deadline=0.01)
        waiting = engine.stream("hello")
        with pytest.raises(QueueFull, match="max_queue=2"):
            engine.stream("hello")
        assert engine.stats()["queue_depth"] == 2
        await asyncio.sleep(0.05)
        engine.close(drain=False)
        with pytest.raises(EngineClosed):
            engine.stream("hello")
        return [event async for event in late], await waiting.__anext__()

    late, waiting = asyncio.run(main())
    assert late == [TokenEvent(None, "", None, "cancelled")]  # closed before its deadline was checked
    assert waiting.finish_reason == "cancelled"


def test_deadline_ends_a_waiting_request(engine):
    async def main():
        blockers = [asyncio.ensure_future(engine.generate(TEXTS[0], max_new_tokens=24, stop_token_ids=[]))
                    for _ in range(4)]
        await asyncio.sleep(0)
        late = await engine.generate(TEXTS[1], max_new_tokens=24, deadline=0.001)
        await asyncio.gather(*blockers)
        return late

    late = asyncio.run(main())
    assert late.finish_reason == "deadline"


def test_options_object_fields_are_the_stream_options():
    assert set(RequestOptions.field_names()) >= {"max_new_tokens", "stop", "logprobs", "deadline"}
    assert Completion._fields == ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
                                  "logprobs", "top_logprobs")


@pytest.mark.parametrize("family", ["opt", "mistral", "t5"])
def test_other_families_equal_generate(tmp_path, tokenizer, family):
    model, _ = tiny_family_model(str(tmp_path), family)
    engine = Engine(model, tokenizer, slots=4, max_length=48, prompt_buckets=(16,), step_widths=(4,))
    engine.start()
    try:  # 8 requests on 4 slots
        prompts = [random_ids((n,), 50, seed=40 + i).tolist() for i, n in enumerate(LENGTHS[:8])]
        news = [min(n, 8) for n in NEW_TOKENS[:8]]
        completions = run(engine, *((p, dict(max_new_tokens=n)) for p, n in zip(prompts, news)))
    finally:
        engine.close()
    expected = references(model, prompts, news, left_pad=family != "t5")
    assert [list(completion.token_ids) for completion in completions] == expected


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_a_long_prompt_prefills_in_chunks_between_steps(gpt2_model, tmp_path, tokenizer, family):
    """A 25-token prompt (bucket 32) arriving while a request decodes is prefilled 8 columns at a time, a chunk
    between two steps (4 chunks: the first holds its first real token), and both requests get `generate`'s
    tokens; Mistral's sliding window and grouped queries included. Arriving when nothing decodes, it is
    prefilled at once."""
    model, vocab = (gpt2_model, 300) if family == "gpt2" else (tiny_family_model(str(tmp_path), family)[0], 50)
    engine = Engine(model, tokenizer, slots=4, max_length=48, prompt_buckets=(8, 32), prefill_chunk=8,
                    steps_per_call=1)
    calls = []
    for name in ("prefill_chunk", "step", "prefill"):
        method = getattr(engine._decoder, name)
        setattr(engine._decoder, name, lambda *args, _method=method, _name=name, **kw: calls.append(_name) or
                _method(*args, **kw))
    engine.warmup()
    engine.start()
    short, long = random_ids((5,), vocab, seed=3).tolist(), random_ids((25,), vocab, seed=4).tolist()

    async def main():
        first = engine.stream(short, max_new_tokens=20)
        tokens = [(await first.__anext__()).token_id]
        calls.clear()
        second = engine.stream(long, max_new_tokens=6)
        tokens += [event.token_id async for event in first if event.token_id is not None]
        return tokens, [event.token_id async for event in second if event.token_id is not None]

    try:
        short_tokens, long_tokens = asyncio.run(main())
        assert engine.stats()["prefill_chunks"] == 4
        chunks = [n for n, call in enumerate(calls) if call == "prefill_chunk"]
        assert "prefill" not in calls and all(calls[n + 1] == "step" for n in chunks[:-1]), calls
        calls.clear()
        (alone,) = run(engine, (long, dict(max_new_tokens=6)))
        assert "prefill_chunk" not in calls and engine.stats()["prefill_chunks"] == 4
    finally:
        engine.close()
    assert [short_tokens, long_tokens] == [references(model, [short], [20])[0], references(model, [long], [6])[0]]
    assert list(alone.token_ids) == long_tokens


def test_whisper_equals_generate(tmp_path, tokenizer):
    """Speech: the encoder runs once per request in its prefill (with language detection), the decoder
    prompt is forced, and the generation config's suppressed tokens stay banned on the slots."""
    from models.test_whisper import features

    model, _ = tiny_family_model(str(tmp_path), "whisper")
    audio = features(3)
    engine = Engine(model, tokenizer, slots=2, max_length=24, prompt_buckets=(8,), step_widths=(2,))
    engine.start()
    try:
        completions = run(engine, *((rows, dict(max_new_tokens=n)) for rows, n in zip(audio, (6, 4, 8))))
    finally:
        engine.close()
    tokens = model.generate(audio, max_new_tokens=8).numpy()
    stops = set(model.generation_config.eos_token_ids)
    for row, new, completion in zip(tokens, (6, 4, 8), completions):
        expected = row[-8:][:new].tolist()
        ends = [n for n, token in enumerate(expected) if token in stops]
        assert list(completion.token_ids) == (expected[:ends[0] + 1] if ends else expected)


def test_default_buckets_take_every_prompt_that_fits(gpt2_model, tokenizer):
    """Without prompt_buckets, a prompt of any length up to max_length - 1 is served (its bucket compiled when it
    first comes, or in warmup(buckets=...)), and one of max_length tokens is refused naming max_length."""
    from xlagen.serving.engine import default_prompt_buckets
    from xlagen.serving.streams import ContextTooLong

    assert default_prompt_buckets(64) == (16, 32, 63) and default_prompt_buckets(1024)[-2:] == (512, 1023)
    engine = Engine(gpt2_model, tokenizer, slots=2, max_length=64)
    assert engine.prompt_buckets == (16, 32, 63) and engine.max_prompt_tokens == 63 and engine.capacity == 66
    engine.warmup(buckets=(10,))
    warm = engine.stats()["compiles"]
    engine.start()
    try:
        prompt = random_ids((60,), 300, seed=4).tolist()
        (completion,) = run(engine, (prompt, dict(max_new_tokens=3)))
        assert list(completion.token_ids) == references(gpt2_model, [prompt], [3])[0]
        assert engine.stats()["compiles"] > warm  # the 63 bucket's prefill and insert, compiled on first use
        with pytest.raises(ContextTooLong, match="max_length 64"):
            run(engine, (prompt + [5] * 4, {}))
    finally:
        engine.close()


def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution(engine, gpt2_model):
    prompt = random_ids((9,), 300, seed=6).tolist()
    completion, plain = run(engine, (prompt, dict(max_new_tokens=4, logprobs=True, top_logprobs=5)),
                            (prompt, dict(max_new_tokens=4, logprobs=True)))
    assert completion.token_ids == plain.token_ids and plain.top_logprobs is None
    ids = np.array([prompt + list(completion.token_ids)], np.int32)
    log_softmax = tf.nn.log_softmax(gpt2_model(ids).logits[0, len(prompt) - 1:-1]).numpy()
    for step, top in enumerate(completion.top_logprobs):
        assert len(top) == 5 and top[0][0] == completion.token_ids[step]  # greedy: the chosen one is the most likely
        expected = np.argsort(-log_softmax[step])[:5]
        assert [i for i, _ in top] == expected.tolist()
        np.testing.assert_allclose([lp for _, lp in top], log_softmax[step][expected], atol=1e-4)


def test_a_cache_that_does_not_fit_in_memory_is_refused_before_it_is_allocated(gpt2_model, tokenizer):
    with pytest.raises(ValueError, match=r"KV cache of 10000000 slots x 80 columns .* needs [0-9.]+ GiB, more than the "
                                         r"[0-9.]+ GiB of memory available: lower max_length or the number of slots"):
        Engine(gpt2_model, tokenizer, slots=10_000_000, max_length=64)


def test_the_default_max_length_is_lowered_to_what_fits(gpt2_model, monkeypatch, caplog):
    """Without max_length the engine takes the model's positions, halved (down to 256) while the slots' cache
    would take more than half of the memory available, and says so."""
    import types

    from xlagen.generation import checks
    from xlagen.generation.slots import SlotDecoder
    from xlagen.serving.engine import default_max_length

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_positions=4096), init_cache=gpt2_model.init_cache)
    peak = {length: SlotDecoder.memory(gpt2_model, 8, length, 4)[1] for length in (256, 1024, 2048, 4096)}
    assert peak[2048] > peak[1024]
    for available, expected in ((2 * peak[4096], 4096), (2 * peak[1024], 1024), (2 * peak[2048] - 1, 1024),
                                (peak[256], 256), (None, 4096)):
        monkeypatch.setattr(checks, "available_memory_bytes", lambda: available)
        caplog.clear()
        with caplog.at_level("WARNING", logger="xlagen.serving.engine"):
            assert default_max_length(model, 8, 4) == expected
        assert ("max_length %d of the model's 4096 positions" % expected in caplog.text) == (expected < 4096)


def test_a_seed_gives_the_same_tokens_on_the_engine_and_the_request_batcher(engine, gpt2_model, tokenizer):
    """The server's two backends (the slots for one beam; `CompiledGenerator` batches under --backend batcher)
    draw a request's tokens from the same random stream."""
    from xlagen.serving.batcher import RequestBatcher

    prompt = random_ids((7,), 300, seed=8).tolist()
    seed = 2**40 + 3  # both 32-bit words of the seed matter
    options = dict(max_new_tokens=10, do_sample=True, temperature=1.3, top_p=0.95, seed=seed)
    (on_slots,) = run(engine, (prompt, options))
    batcher = RequestBatcher(gpt2_model, tokenizer, max_batch=1)
    batcher.start()
    try:
        batched = asyncio.run(batcher.generate(prompt, **options))
    finally:
        batcher.close()
    assert batched.token_ids == on_slots.token_ids
    (other_seed,) = run(engine, (prompt, {**options, "seed": seed + 1}))
    assert other_seed.token_ids != on_slots.token_ids
