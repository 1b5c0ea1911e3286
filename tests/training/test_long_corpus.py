"""A corpus far beyond the model's context trains with the memory of a short one: nothing in
synthesis or training holds more than a teacher window of the corpus at a time."""

from __future__ import annotations

import random
import threading

import psutil
import pytest

from cartridges.selfstudy import TrainConfig
from cartridges.training import train

from .tiny import tiny_model

pytestmark = pytest.mark.slow


def generated_corpus(num_tokens: int, seed: int = 0) -> str:
    """Invented sentences, different all along, of `num_tokens` characters (the tiny model's
    tokenizer reads one token per character)."""
    rng = random.Random(seed)
    names = ["Quelmor", "Arvand", "Tessel", "Brannick", "Odo", "Lisel", "Varrow", "Ennis"]
    nouns = ["bell", "bridge", "granary", "harbour", "mill", "tower", "ferry", "archive"]
    parts, size, i = [], 0, 0
    while size < num_tokens:
        sentence = (f"In section {i}, the {rng.choice(nouns)} of {rng.choice(names)} holds "
                    f"{rng.randint(2, 9999)} tonnes. ")
        parts.append(sentence)
        size += len(sentence)
        i += 1
    return "".join(parts)[:num_tokens]


def peak_rss_while(fn) -> tuple[int, object]:
    """The process' peak resident memory above where it started, sampled every 20 ms while
    fn() runs, and fn()'s result."""
    process = psutil.Process()
    start = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return max(peak, process.memory_info().rss) - start, result


def test_a_100k_token_corpus_trains_in_the_memory_of_a_10k_one():
    model = tiny_model(context=1024)
    config = TrainConfig(num_tokens=64, num_samples=8, chunk_tokens=200, teacher_tokens=600, synthesis_batch_size=4,
                         max_question_tokens=16, max_answer_tokens=24, top_k=4, epochs=1, batch_size=4,
                         quality_samples=4, init="spread")
    short, long = generated_corpus(10_000), generated_corpus(100_000, seed=1)
    train(model, [short[:2000]], config, progress=False)  # warm up: the engine, the allocator's pools
    # Each corpus trains twice, alternating, and the lower peak counts: the allocator grows its
    # pools by tens of MB once, in whichever run first asks for some size (either corpus, seen
    # under every setting), while what grows with the corpus would show in both of its runs.
    peaks: dict[str, list[int]] = {"short": [], "long": []}
    carts = {}
    for _ in range(2):
        for name, corpus in (("short", short), ("long", long)):
            peak, carts[name] = peak_rss_while(lambda: train(model, [corpus], config, progress=False))
            peaks[name].append(peak)
    short_peak, long_peak = min(peaks["short"]), min(peaks["long"])
    short_cart, long_cart = carts["short"], carts["long"]
    assert short_cart.num_tokens == long_cart.num_tokens == 64
    assert long_cart.stats["steps"] == short_cart.stats["steps"] == 2
    # The corpus itself (100K token ids and its text) is about 1 MB; what grew with it would
    # take more: the KV of the whole corpus alone is 25 MB even for this tiny model.
    assert long_peak < short_peak + 16 * 2**20, (short_peak, long_peak)
