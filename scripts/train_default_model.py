"""Trains xlagen's built-in default model with xlagen itself.

A small GPT-2-architecture model on the King James Version of the Bible (public domain; Debian's
`bible-kjv` package, whose `bible` program prints the text), with a byte-level BPE tokenizer trained
by the `tokenizers` library and xlagen's own Keras `fit(jit_compile=True)`. Seeded and reproducible
up to TensorFlow's float non-determinism on CPU.

    apt-get install bible-kjv          # the corpus (text in /usr/lib/bible.data)
    pip install -e ".[train]"          # matplotlib for the loss curve
    python scripts/train_default_model.py --output src/xlagen/default_model --report docs/default-model

Writes the Hugging Face checkpoint (config.json, generation_config.json, model.safetensors,
tokenizer files) and the model card README.md to --output (the wheel ships the checkpoint's files,
not the card), and training_log.json and loss_curve.png to --report (the repository's docs).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
import subprocess
import time

import numpy as np

EOS = "<|endoftext|>"
VERSE = re.compile(r"^ +(\d+) (.*)$")
HEADING = re.compile(r"^(\S.*) (\d+)$")

logger = logging.getLogger("train_default_model")


def read_kjv() -> list[list[str]]:
    """The KJV as chapters of verses, from the `bible` program of Debian's bible-kjv package."""
    try:
        text = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                              check=True).stdout
    except FileNotFoundError as error:
        raise SystemExit("the corpus needs Debian's bible-kjv package: apt-get install bible-kjv") from error
    chapters: list[list[str]] = []
    for line in text.splitlines():
        if HEADING.match(line):
            chapters.append([])
        elif (verse := VERSE.match(line)) and chapters:
            chapters[-1].append(verse.group(2).strip())
    if sum(map(len, chapters)) != 31102:
        raise SystemExit(f"expected 31102 verses, read {sum(map(len, chapters))}")
    return chapters


def split(chapters: list[list[str]], every: int) -> tuple[list[str], list[str]]:
    """Chapters as documents; every `every`-th chapter is held out for validation."""
    documents = ["\n".join(chapter) for chapter in chapters]
    validation = [d for i, d in enumerate(documents) if i % every == every - 1]
    train = [d for i, d in enumerate(documents) if i % every != every - 1]
    return train, validation


def train_tokenizer(documents: list[str], vocab_size: int, folder: pathlib.Path, max_positions: int):
    """A GPT-2-style byte-level BPE tokenizer, saved with its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOS, "eos_token": EOS, "unk_token": EOS,
              "model_max_length": max_positions, "add_prefix_space": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def blocks(tokenizer, documents: list[str], length: int) -> np.ndarray:
    """All documents as one token stream (EOS between them) cut into `[N, length]` blocks."""
    eos = tokenizer.token_to_id(EOS)
    stream = []
    for encoding in tokenizer.encode_batch(documents):
        stream.extend(encoding.ids + [eos])
    count = len(stream) // length
    return np.asarray(stream[:count * length], np.int32).reshape(count, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=pathlib.Path, required=True, help="the checkpoint folder")
    parser.add_argument("--report", type=pathlib.Path, default=pathlib.Path("docs/default-model"),
                        help="where the training log and the loss curve go (default: docs/default-model)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-positions", type=int, default=256)
    parser.add_argument("--block", type=int, default=128, help="training sequence length")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny run to check the script end to end")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import keras
    import tensorflow as tf

    from xlagen import AutoTokenizer, GenerationConfig, GPT2Config
    from xlagen.modeling import TFGPT2LMHeadModel

    keras.utils.set_random_seed(args.seed)
    chapters = read_kjv()
    if args.quick:
        chapters = chapters[:60]
    train_docs, validation_docs = split(chapters, every=50 if not args.quick else 10)
    staging = args.output.with_name(args.output.name + ".tokenizer")
    tokenizer = train_tokenizer(train_docs, args.vocab_size, staging, args.max_positions)
    train, validation = blocks(tokenizer, train_docs, args.block), blocks(tokenizer, validation_docs, args.block)
    logger.info("corpus: %d train blocks, %d validation blocks of %d tokens; vocabulary %d", len(train),
                len(validation), args.block, tokenizer.get_vocab_size())

    eos = tokenizer.token_to_id(EOS)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
                        num_layers=args.layers, num_heads=args.heads, max_positions=args.max_positions,
                        bos_token_id=eos, eos_token_id=eos)
    model = TFGPT2LMHeadModel(config)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                               max_new_tokens=60, do_sample=True, temperature=0.8, top_k=40,
                                               repetition_penalty=1.1)
    steps = args.epochs * (len(train) // args.batch_size)
    schedule = keras.optimizers.schedules.CosineDecay(0.0, max(steps - steps // 20, 1), alpha=0.05,
                                                      warmup_target=args.learning_rate, warmup_steps=steps // 20)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, clipnorm=1.0), jit_compile=True)

    step_losses: list[float] = []
    log_every = max(1, len(train) // args.batch_size // 10)

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step_losses.append(float(logs["loss"]))
            if batch % log_every == 0:
                logger.info("step %d: loss %.3f", len(step_losses), step_losses[-1])

    started = time.time()
    history = model.fit({"input_ids": train}, validation_data=({"input_ids": validation},),
                        batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0,
                        callbacks=[Progress(), keras.callbacks.LambdaCallback(
                            on_epoch_end=lambda epoch, logs: logger.info("epoch %d: %s", epoch + 1, logs))])
    seconds = time.time() - started
    final = model.evaluate({"input_ids": validation}, batch_size=args.batch_size, verbose=0, return_dict=True)

    model.save_pretrained(args.output, overwrite=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (staging / name).replace(args.output / name)
    staging.rmdir()
    xlagen_tokenizer = AutoTokenizer.from_pretrained(args.output)
    xlagen_tokenizer.save_pretrained(args.output, overwrite=True)  # adds special_tokens_map.json

    samples = []
    generate = tf.function(model.generate, jit_compile=True)
    for number, prompt in enumerate(["In the beginning", "And the LORD said unto Moses,", "Blessed are the",
                                     "And Jesus answered and said"]):
        encoded = xlagen_tokenizer([prompt], return_tensors="tf")
        tokens = generate(**encoded, seed=tf.constant([args.seed, number]))
        samples.append(prompt + xlagen_tokenizer.decode(tokens[0, encoded["input_ids"].shape[1]:],
                                                       skip_special_tokens=True))
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds, "steps": len(step_losses),
           "parameters": model.count_params(), "train_blocks": len(train), "validation_blocks": len(validation),
           "history": history.history, "step_losses": step_losses, "validation_loss": final["loss"],
           "validation_perplexity": final["perplexity"], "samples": samples,
           "versions": {"tensorflow": tf.__version__, "keras": keras.__version__}}
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot(step_losses, history.history, len(train) // args.batch_size, args.report / "loss_curve.png")
    logger.info("done in %.0f s: validation loss %.3f, perplexity %.2f", seconds, final["loss"],
                final["perplexity"])
    for sample in samples:
        logger.info("sample: %s", sample.replace("\n", " / "))


def plot(step_losses, history, steps_per_epoch: int, path: pathlib.Path) -> None:
    """Training loss per step and validation loss per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    # Keras reports the running mean of the loss since the start of the epoch.
    axis.plot(np.arange(1, len(step_losses) + 1), step_losses, label="training loss (running mean in epoch)",
              linewidth=0.8)
    epochs = np.arange(1, len(history["val_loss"]) + 1) * steps_per_epoch
    axis.plot(epochs, history["val_loss"], "o-", label="validation loss (epoch)")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats/token)")
    axis.set_title("xlagen default model: GPT-2 architecture on the KJV Bible")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
