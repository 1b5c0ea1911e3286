"""The Python generation call: per-sequence streaming, cancellation, prefixes per prompt."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tiny_models import VOCAB, build_pair


@pytest.fixture(scope="module")
def model():
    return build_pair("llama-tied", seed=5)[1]


def test_tokens_stream_per_sequence_in_order(model):
    seen: dict[int, list[int]] = {0: [], 1: []}
    results = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=10, stop_token_ids=[],
                             on_token=lambda i, t: seen[i].append(t))
    assert [seen[0], seen[1]] == [r.tokens for r in results]


def test_returning_false_cancels_only_that_sequence(model):
    free = model.generate([[7, 8, 9]], max_new_tokens=10, stop_token_ids=[])[0]
    counts = {0: 0, 1: 0}

    def on_token(i: int, _: int) -> bool:
        counts[i] += 1
        return not (i == 1 and counts[i] == 3)

    cancelled, other = model.generate([[7, 8, 9], [7, 8, 9]], max_new_tokens=10, stop_token_ids=[],
                                      on_token=on_token)[::-1]
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 3
    assert other.tokens == free.tokens and other.finish_reason == "length"


def test_stop_token_ends_with_stop(model):
    free = model.generate([[3, 1, 4]], max_new_tokens=10, stop_token_ids=[])[0]
    stopped = model.generate([[3, 1, 4]], max_new_tokens=10, stop_token_ids=[free.tokens[4]])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[: stopped.tokens.index(free.tokens[4]) + 1]


def test_callback_errors_reach_the_caller(model):
    def boom(i: int, t: int) -> None:
        raise ValueError("from the callback")

    with pytest.raises(ValueError, match="from the callback"):
        model.generate([[1, 2]], max_new_tokens=4, on_token=boom)


def test_generation_releases_the_gil(model):
    """Another Python thread keeps running while the engine generates."""
    ticks = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        before = len(ticks)
        start = time.perf_counter()
        model.generate([[1] * 50] * 4, max_new_tokens=200, stop_token_ids=[])
        elapsed = time.perf_counter() - start
        during = len(ticks) - before
    finally:
        stop.set()
        thread.join()
    # The ticker waits 1 ms between ticks: with the GIL held it could not tick at all.
    assert during >= min(3, int(elapsed / 0.002)), (during, elapsed)


def test_per_prompt_prefixes(model):
    g = torch.Generator().manual_seed(0)
    doc_a, doc_b = torch.randint(VOCAB, (6,), generator=g), torch.randint(VOCAB, (4,), generator=g)
    a, b = model.native.prefix_from_tokens(doc_a), model.native.prefix_from_tokens(doc_b)
    prompt = [5, 6, 7]
    kwargs = dict(max_new_tokens=8, stop_token_ids=[])
    batched = model.generate([prompt, prompt], prefixes=[[a], [b]], **kwargs)
    assert batched[0].tokens == model.generate([doc_a.tolist() + prompt], **kwargs)[0].tokens
    assert batched[1].tokens == model.generate([doc_b.tolist() + prompt], **kwargs)[0].tokens
    with pytest.raises(ValueError):
        model.generate([prompt, prompt], prefixes=[[a]], **kwargs)


def test_context_overflow_is_a_clear_error(model):
    from cartridges import ContextLengthError

    with pytest.raises(ContextLengthError, match="context"):
        model.generate([[1] * 500], max_new_tokens=100)


def test_cartridge_objects_are_accepted_as_prefixes(model):
    import cartridges_core

    from cartridges import Cartridge

    doc = torch.randint(VOCAB, (8,), generator=torch.Generator().manual_seed(1))
    prefix = model.native.prefix_from_tokens(doc)
    cart = Cartridge.from_params(cartridges_core.CartridgeParams(prefix, 1))
    kwargs = dict(max_new_tokens=8, stop_token_ids=[])
    with_object = model.generate([[5, 6, 7]], prefixes=[cart], **kwargs)[0].tokens
    assert with_object == model.generate([doc.tolist() + [5, 6, 7]], **kwargs)[0].tokens
