"""The Python face of the serving engine: blocking and asyncio streams, closing cancels, text
stop sequences, log-probabilities, seeds of `n` choices, the cartridge cache, typed errors."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from cartridges import ContextLengthError, Engine, EngineBusyError
from cartridges.stream import choice_seeds
from tiny_models import VOCAB, build_pair, requests_across_a_compaction


@pytest.fixture(scope="module")
def model():
    return build_pair("llama", seed=3)[1]


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, kv_tokens=4096, prefill_tokens_per_step=32)
    yield engine
    engine.close()


def test_blocking_stream_equals_generate(model, engine):
    expected = model.generate([[5, 6, 7, 8]], max_new_tokens=12, stop_token_ids=[])[0]
    stream = engine.submit([5, 6, 7, 8], max_new_tokens=12, stop_token_ids=[])
    tokens = [d.token for d in stream]
    assert tokens == expected.tokens and stream.finish_reason == "length"


def test_async_streams_run_concurrently_and_match_alone(model, engine):
    prompts = [[1 + i, 2, 3 + i] * (i + 1) for i in range(6)]
    alone = [model.generate([p], max_new_tokens=10, stop_token_ids=[])[0].tokens for p in prompts]

    async def consume(prompt):
        stream = engine.submit(prompt, max_new_tokens=10, stop_token_ids=[])
        return [d.token async for d in stream], stream.finish_reason

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == alone
    assert all(reason == "length" for _, reason in results)


def test_a_loop_that_takes_the_events_itself_serves_every_stream(model):
    """`deliver_on`: the loop reads the engine's events file descriptor and hands the events out
    itself; the dispatcher thread ends. Its own streams, a blocking stream of another thread
    and a stream of another loop all get what they get from the dispatcher, in order; once the
    engine is shut down the loop stops reading."""
    import threading

    engine = Engine(model, kv_tokens=4096, prefill_tokens_per_step=32)
    prompts = [[1 + i, 2, 3 + i] * (i + 1) for i in range(4)]
    alone = [model.generate([p], max_new_tokens=10, stop_token_ids=[])[0].tokens for p in prompts]
    fd = engine.native.events_fd()
    assert fd >= 0

    def on_another_loop(prompt, out):
        async def run():
            out.append([d.token async for d in engine.submit(prompt, max_new_tokens=10, stop_token_ids=[])])
        asyncio.run(run())

    async def main():
        assert engine.deliver_on(asyncio.get_running_loop())
        assert not engine.deliver_on(asyncio.get_running_loop())  # once
        blocking, other_loop = [], []
        threads = [threading.Thread(target=lambda: blocking.append(
                       [d.token for d in engine.submit(prompts[2], max_new_tokens=10, stop_token_ids=[])])),
                   threading.Thread(target=on_another_loop, args=(prompts[3], other_loop))]
        for thread in threads:
            thread.start()

        async def consume(prompt):
            return [d.token async for d in engine.submit(prompt, max_new_tokens=10, stop_token_ids=[])]

        own = await asyncio.gather(*(consume(p) for p in prompts[:2]))
        while any(thread.is_alive() for thread in threads):
            await asyncio.sleep(0.01)  # the blocking stream's events come from this loop
        engine._dispatcher.join(timeout=5)
        dispatcher_ended = not engine._dispatcher.is_alive()
        engine.close()
        for _ in range(200):  # the shutdown's last events reach the reader, which then leaves
            await asyncio.sleep(0.01)
            if engine.native.drained:
                break
        await asyncio.sleep(0.05)
        reader_left = not asyncio.get_running_loop().remove_reader(fd)
        return own, blocking, other_loop, dispatcher_ended and reader_left

    own, blocking, other_loop, dispatcher_ended = asyncio.run(main())
    assert own == alone[:2] and blocking == [alone[2]] and other_loop == [alone[3]]
    assert dispatcher_ended


def test_leaving_an_async_stream_cancels_the_request(engine):
    async def main():
        stream = engine.submit([9, 9, 9], max_new_tokens=400, stop_token_ids=[])
        async for _ in stream:
            break  # the consumer goes away after one token
        return stream

    stream = asyncio.run(main())
    assert stream.finish_reason == "cancelled" and len(stream.tokens) < 400
    for _ in range(100):  # the cancel takes effect at the engine's next step
        if engine.stats().running == 0:
            break
        time.sleep(0.01)
    assert engine.stats().running == 0 and engine.stats().kv_tokens_used == 0


def test_text_stop_sequence_ends_the_request_and_is_not_returned():
    from cartridges import load_model

    model = load_model()  # a real tokenizer, for text
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = model.chat(messages, max_tokens=40)
    stop = full[len(full) // 3: len(full) // 3 + 2]
    assert stop and stop in full
    stopped = model.generate([model.encode_chat(messages)], max_new_tokens=40, stop=[stop])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    streamed = "".join(model.stream_chat(messages, max_tokens=40, stop=[stop]))
    assert streamed == stopped.text


def test_logprobs_equal_a_full_forward(model, engine):
    prompt = [3, 1, 4, 1, 5]
    stream = engine.submit(prompt, max_new_tokens=5, stop_token_ids=[], logprobs=4)
    completion = stream.result()
    tokens = torch.tensor([prompt + completion.tokens])
    logprobs = torch.log_softmax(model.native.forward(tokens)[0], -1)
    for i, lp in enumerate(completion.logprobs):
        row = logprobs[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
        values, ids = row.topk(4)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_a_shared_opening_is_prefilled_once_with_the_same_results(model):
    """Requests without cartridges that open alike (template and system prompt, up to
    weigh_from) read the opening's KV from a cache: the same tokens and log-probabilities as
    prefilling it, the usage still counts the whole prompt."""
    opening = [(7 * i) % 50 + 3 for i in range(20)]
    prompts = [opening + [5, 6, 7], opening + [9, 1], opening + [2]]
    cached, plain = Engine(model, kv_tokens=4096), Engine(model, kv_tokens=4096, cache_openings=False)
    options = dict(max_new_tokens=8, stop_token_ids=[], logprobs=2)
    try:
        for prompt in prompts:
            stream = cached.submit_many([prompt], weigh_from=[len(opening)], **options)[0]
            got, want = stream.result(), plain.submit_many([prompt], weigh_from=[len(opening)], **options)[0].result()
            assert got.tokens == want.tokens and stream.prompt_tokens == len(prompt)
            assert [x.logprob for x in got.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
        assert list(cached._openings) == [tuple(opening)]
        # too short an opening, or a request with cartridges: prefilled as before
        cached.submit_many([prompts[0]], weigh_from=[10], **options)[0].result()
        prefix = model.native.prefix_from_tokens(torch.tensor([4, 5, 6]))
        cached.submit_many([prompts[1]], prefixes=[[prefix]], weigh_from=[len(opening)], **options)[0].result()
        assert list(cached._openings) == [tuple(opening)]
        # an opening that is not the vocabulary's is refused as before, and not cached
        for bad in ([VOCAB + 5] + opening[1:], [1.5] + opening[1:]):
            with pytest.raises((ValueError, TypeError)):
                cached.submit_many([bad + [5, 6]], weigh_from=[len(opening)], **options)
        assert list(cached._openings) == [tuple(opening)]
    finally:
        cached.close()
        plain.close()


def test_n_choices_are_distinct_and_repeatable(model):
    seeds = choice_seeds(42, 3)
    assert len(set(seeds)) == 3 and seeds == choice_seeds(42, 3)
    kwargs = dict(max_new_tokens=16, stop_token_ids=[], temperature=1.0)

    def run() -> list[list[int]]:
        return [s.result().tokens for s in model.engine.submit_many([[7, 7]] * 3, seeds=seeds, **kwargs)]

    first, again = run(), run()
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_cartridge_cache_through_the_engine(model, engine):
    doc = torch.randint(VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    prefix = model.native.prefix_from_tokens(doc)
    engine.cartridges.put("user/doc/abc12345", prefix)
    cached = engine.cartridges.get("user/doc/abc12345")
    got = engine.submit([4, 5, 6], prefixes=[cached], max_new_tokens=8, stop_token_ids=[]).result()
    expected = model.generate([doc.tolist() + [4, 5, 6]], max_new_tokens=8, stop_token_ids=[])[0]
    assert got.tokens == expected.tokens
    stats = engine.stats().cartridges
    assert stats.entries == 1 and stats.loads == 1 and stats.hits == 1 and stats.bytes == prefix.nbytes


def bayesian_mixture(model, docs: list[torch.Tensor], text: list[int], weigh_from: int = 0) -> torch.Tensor:
    """[T-1]: log p(text[t] | text[<t]) for t >= 1 under the mixture of the documents in context,
    each weighted by the likelihood it gave to text[weigh_from:t]."""
    each = []  # [C, T-1]: log p(text[t] | doc c, text[<t]) for t >= 1
    for doc in docs:
        with torch.no_grad():
            logits = model.native.forward(torch.tensor([doc.tolist() + text]))[0, len(doc):-1]
        each.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(text[1:])[:, None])[:, 0])
    each = torch.stack(each).double()
    counted = each.clone()
    counted[:, :max(weigh_from - 1, 0)] = 0
    before = torch.cat([torch.zeros(len(docs), 1, dtype=torch.float64), counted.cumsum(1)[:, :-1]], 1)
    return torch.logsumexp(before + each, 0) - torch.logsumexp(before, 0)


def test_several_cartridges_mix_by_default_and_concatenate_on_request(model, engine):
    """A mixture's log-probabilities are the Bayesian mixture of each cartridge's own, computed
    here from full forwards with each document in context; concatenation is one forward with
    both KV in front, in order."""
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(VOCAB, (n,), generator=g) for n in (8, 11)]
    kv = [model.native.prefix_from_tokens(d) for d in docs]
    prompt = torch.randint(VOCAB, (40,), generator=g).tolist()  # longer than a prefill step
    kwargs = dict(max_new_tokens=6, stop_token_ids=[], logprobs=1)
    mixed = engine.submit(prompt, prefixes=kv, **kwargs).result()
    mixture = bayesian_mixture(model, docs, prompt + mixed.tokens)
    assert [t.logprob for t in mixed.logprobs] == pytest.approx(mixture[len(prompt) - 1:].tolist(), abs=1e-4)

    concatenated = engine.submit(prompt, prefixes=kv, composition="concatenate", **kwargs).result().tokens
    with torch.no_grad():
        logits = model.native.forward(torch.tensor([prompt + concatenated]), prefixes=[kv])[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == concatenated  # greedy, both KV in front
    with pytest.raises(ValueError, match="composition"):
        engine.submit(prompt, prefixes=kv, composition="average", **kwargs)


def test_a_route_reads_the_prompt_with_every_cartridge_then_decodes_with_the_heaviest(model, engine):
    """`route`: the cartridge that gave the prompt (from weigh_from on) the most likelihood,
    computed here from full forwards, decodes the reply alone: the same tokens and
    log-probabilities as that cartridge by itself. Beside other requests, a routed one computes
    one sequence from then on, and each request gets its own answer."""
    g = torch.Generator().manual_seed(9)
    kwargs = dict(max_new_tokens=6, stop_token_ids=[], logprobs=1)
    chosen_any = set()
    for trial in range(4):
        docs = [torch.randint(VOCAB, (n,), generator=g) for n in (8, 11, 5)]
        kv = [model.native.prefix_from_tokens(d) for d in docs]
        prompt = torch.randint(VOCAB, (40,), generator=g).tolist()  # longer than a prefill step
        weigh_from = 10 * trial
        each = []
        for doc in docs:
            with torch.no_grad():
                logits = model.native.forward(torch.tensor([doc.tolist() + prompt]))[0, len(doc):-1]
            gained = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            each.append(gained[max(weigh_from - 1, 0):].sum().item())
        chosen = max(range(len(docs)), key=lambda c: each[c])
        chosen_any.add(chosen)
        # Submitted together, so that they share steps: the routed request beside a mixture.
        routed, alone, mixed = [engine.submit(prompt, prefixes=p, composition=c, weigh_from=weigh_from, **kwargs)
                                for p, c in ((kv, "route"), ([kv[chosen]], "mixture"), (kv, "mixture"))]
        routed, alone, mixed = routed.result(), alone.result(), mixed.result()
        assert routed.tokens == alone.tokens
        assert [t.logprob for t in routed.logprobs] == pytest.approx([t.logprob for t in alone.logprobs], abs=1e-4)
        mixture = bayesian_mixture(model, docs, prompt + mixed.tokens, min(weigh_from, len(prompt)))
        assert [t.logprob for t in mixed.logprobs] == pytest.approx(mixture[len(prompt) - 1:].tolist(), abs=1e-4)
    assert len(chosen_any) >= 2  # the trials chose different cartridges: the choice is the prompt's


@pytest.mark.parametrize("seed", [9, 12, 17])  # the first cartridge chosen, then the second twice
def test_routed_requests_get_what_they_get_alone_across_a_pool_compaction(model, seed):
    """The two-cartridge request routed: its chosen sequence (the first or the second of its KV
    range) moves with the pool's compaction."""
    requests_across_a_compaction(model, seed, composition="route")


def test_a_routed_request_gives_back_its_other_cartridges_kv_at_once(model):
    """A routed request reserves a sequence per cartridge while its prompt is read, then keeps
    its chosen one's KV alone: a request that fits only in the slots given back starts then,
    beside it, not after it."""
    g = torch.Generator().manual_seed(4)
    kv = [model.native.prefix_from_tokens(torch.randint(VOCAB, (n,), generator=g)) for n in (8, 11, 5)]
    routed_prompt, other_prompt = (torch.randint(VOCAB, (n,), generator=g).tolist() for n in (20, 10))
    # The routed request holds 3 x 420 of 1,300 slots while its prompt is read; the other needs 310.
    engine = Engine(model, kv_tokens=1300, cache_openings=False)
    try:
        kwargs = dict(stop_token_ids=[])
        routed = engine.submit(routed_prompt, prefixes=kv, composition="route", max_new_tokens=400, **kwargs)
        other = engine.submit(other_prompt, max_new_tokens=300, **kwargs)
        routed_tokens, other_tokens = [d.token for d in routed], [d.token for d in other]
        assert engine.stats().steps < 400 + 300  # the two decoded side by side
        assert engine.stats().kv_tokens_used == 0
    finally:
        engine.close()
    assert other_tokens == model.generate([other_prompt], max_new_tokens=300, **kwargs)[0].tokens
    assert routed_tokens == model.generate([routed_prompt], prefixes=kv, composition="route", max_new_tokens=400,
                                           **kwargs)[0].tokens


def test_a_mixture_weighs_its_cartridges_from_weigh_from(model, engine):
    """Prompt tokens before weigh_from (the chat template's opening, a system prompt) add
    nothing to the weights; the output always does."""
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(VOCAB, (n,), generator=g) for n in (8, 11)]
    kv = [model.native.prefix_from_tokens(d) for d in docs]
    prompt = torch.randint(VOCAB, (40,), generator=g).tolist()
    kwargs = dict(max_new_tokens=6, stop_token_ids=[], logprobs=1)
    for weigh_from in (25, 40, 100):
        mixed = engine.submit(prompt, prefixes=kv, weigh_from=weigh_from, **kwargs).result()
        mixture = bayesian_mixture(model, docs, prompt + mixed.tokens, min(weigh_from, len(prompt)))
        assert [t.logprob for t in mixed.logprobs] == pytest.approx(mixture[len(prompt) - 1:].tolist(), abs=1e-4)
    everything = bayesian_mixture(model, docs, prompt + mixed.tokens)
    assert not torch.allclose(everything[len(prompt) - 1:], mixture[len(prompt) - 1:], atol=1e-3)
    with pytest.raises(ValueError, match="weigh_from"):
        engine.submit(prompt, prefixes=kv, weigh_from=-1, **kwargs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")
def test_the_compute_thread_and_its_openmp_team_are_named(engine):
    """benchmarks/bench_http.py tells the engine's compute from the rest of a server by name."""
    list(engine.submit([1, 2, 3], max_new_tokens=2))
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    assert "cartridges-step" in names


def test_typed_errors(model):
    small = Engine(model, kv_tokens=64, max_waiting=1, max_running=1)
    try:
        with pytest.raises(ContextLengthError):
            small.submit([1] * 10, max_new_tokens=100)  # more than the whole pool
        with pytest.raises(ContextLengthError):
            small.submit([1] * 10, max_new_tokens=600)  # more than the context
        with pytest.raises(ValueError):
            small.submit([], max_new_tokens=4)
        with pytest.raises(ValueError):
            small.submit([1], max_new_tokens=4, temperature=-1)
        small.submit([1, 2], max_new_tokens=50, stop_token_ids=[])
        with pytest.raises(EngineBusyError):
            for _ in range(3):
                small.submit([1, 2], max_new_tokens=50, stop_token_ids=[])
        with pytest.raises(TypeError):
            Engine(model, kv_token=5)
    finally:
        small.close()
