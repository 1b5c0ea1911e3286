"""What each synthesis batch reads: chunks that cover the corpus, windows that hold them, and
defaults that scale with the corpus. No model needed."""

from __future__ import annotations

import random

import pytest

from cartridges.selfstudy import TrainConfig
from cartridges.selfstudy.chunking import Span, even_spans, named_texts, part_of, part_view, partner_chunk, plan_views
from cartridges.selfstudy.config import LONG_CORPUS_TOKENS, default_num_samples, default_num_tokens
from cartridges.selfstudy.prompts import (CLOZE_TEMPLATES, FACT, FACT_TEMPLATES, RECALL_TEMPLATES, TOPIC,
                                         TOPIC_TEMPLATES, VERIFY, VERIFY_TEMPLATES, cloze_message, draw_seed_prompts,
                                         fact_message, recall_message, swap_candidates, topic_message,
                                         verify_message)
from cartridges.selfstudy.synthesize import loop_start


def covered(spans, total: int) -> bool:
    seen = [False] * total
    for s in spans:
        seen[s.start : s.end] = [True] * len(s)
    return all(seen)


@pytest.mark.parametrize("total,length,count", [(10, 3, None), (100, 7, 20), (5, 9, None), (4096, 512, 9)])
def test_even_spans_cover_and_are_evenly_spaced(total, length, count):
    spans = even_spans(0, total, length, count)
    assert covered(spans, total)
    assert spans[0].start == 0 and spans[-1].end == total
    assert all(len(s) == min(length, total) for s in spans)
    starts = [s.start for s in spans]
    gaps = {b - a for a, b in zip(starts, starts[1:])}
    assert max(gaps, default=0) - min(gaps, default=0) <= 1


@pytest.mark.parametrize("corpus", [300, 2_500, 2_954, 100_000])
def test_the_default_plan_covers_every_part_of_the_corpus(corpus):
    config = TrainConfig().for_corpus(corpus)
    batches = -(-config.num_samples // config.synthesis_batch_size)
    views = plan_views(corpus, batches, config.chunk_tokens, config.teacher_tokens, random.Random(0))
    assert len(views) == batches
    assert covered([v.chunk for v in views], corpus)
    for v in views:
        assert v.window.start <= v.chunk.start and v.chunk.end <= v.window.end  # B sees A's chunk
        assert len(v.chunk) <= config.chunk_tokens and len(v.window) <= config.teacher_tokens
    # Batches of one window come together (its KV is computed once per round).
    windows = [v.window for v in views]
    changes = sum(a != b for a, b in zip(windows, windows[1:]))
    rounds = -(-batches // len({(v.chunk.start, v.chunk.end) for v in views}))
    assert changes <= len(set(windows)) * (rounds + 1)


def test_too_few_batches_get_longer_chunks_that_still_cover():
    views = plan_views(10_000, 4, 512, 4096, random.Random(1))
    assert covered([v.chunk for v in views], 10_000)
    assert all(len(v.chunk) > 512 for v in views)


def test_a_corpus_that_fits_is_one_window_the_teacher_reads_whole():
    views = plan_views(2_000, 30, 512, 4096, random.Random(2))
    assert {(v.window.start, v.window.end) for v in views} == {(0, 2_000)}
    # Later rounds shift the chunk boundaries, so that no fact always sits on one.
    assert len({v.chunk for v in views}) > -(-2_000 // 512)


def test_several_files_are_joined_in_order_under_their_names():
    assert named_texts([("only.txt", "Alpha.")]) == ["Alpha."]  # one file reads as it is
    assert named_texts([("b.md", "Beta."), ("a.txt", "Alpha.")]) == ["# b.md\n\nBeta.", "# a.txt\n\nAlpha."]


def test_plan_is_deterministic_in_the_seed():
    a = plan_views(5_000, 40, 512, 1024, random.Random(3))
    assert a == plan_views(5_000, 40, 512, 1024, random.Random(3))
    assert a != plan_views(5_000, 40, 512, 1024, random.Random(4))


@pytest.mark.parametrize("total,chunk,window", [(5_000, 512, 1024), (20_000, 512, 1024), (700, 512, 1024)])
def test_a_held_out_view_reads_its_own_tenth_of_the_corpus(total, chunk, window):
    rng = random.Random(5)
    for part in range(10):
        for _ in range(5):
            view = part_view(total, part, 10, chunk, window, rng)
            assert view.window.start <= view.chunk.start and view.chunk.end <= view.window.end
            assert len(view.chunk) == min(chunk, total) and len(view.window) == min(window, total)
            if chunk * 10 <= total:  # a chunk shorter than a tenth is centred in it
                assert part_of((view.chunk.start, view.chunk.end), total) == part


def test_default_number_of_conversations_scales_with_the_corpus():
    assert default_num_samples(100) == 128  # at least a few batches, even for a paragraph
    assert default_num_samples(2_500) == 256
    assert default_num_samples(LONG_CORPUS_TOKENS) == 832
    assert default_num_samples(16_000) == 2_000  # one per 8 tokens beyond the context
    assert default_num_samples(100_000) == 8_192  # bounded: about 16 per 512-token chunk
    sizes = [default_num_samples(n) for n in range(0, 200_000, 997)]
    assert sizes == sorted(sizes) and all(s % 16 == 0 for s in sizes)
    config = TrainConfig()
    assert config.num_samples is None and config.quality_samples is None
    fitted = config.for_corpus(2_500)
    assert fitted.num_samples == 256 and fitted.quality_samples == 16
    assert TrainConfig(num_samples=64).for_corpus(100_000).num_samples == 64  # a choice is kept
    with pytest.raises(ValueError, match="num_samples"):
        TrainConfig(num_samples=0)


def test_a_corpus_beyond_the_context_gets_the_long_corpus_plan():
    """Up to LONG_CORPUS_TOKENS: two epochs, one conversation per 10 tokens, no yes/no or fact
    conversations, recall and cloze at even odds, the corpus' first tokens as the
    initialization; beyond: one epoch, one conversation per 8 tokens, a fifth of the written
    conversations yes/no, a quarter of the rest fact and the others recall, the whole corpus
    compacted. What a config gives is kept."""
    short, long = TrainConfig().for_corpus(LONG_CORPUS_TOKENS), TrainConfig().for_corpus(LONG_CORPUS_TOKENS + 1)
    plan = lambda c: (c.epochs, c.verify_fraction, c.fact_fraction, c.cloze_fraction, c.init)  # noqa: E731
    assert plan(short) == (2, 0.0, 0.0, 0.5, "corpus")
    assert plan(long) == (1, 0.2, 0.25, 0.0, "compact")
    assert long.num_samples == 1_040 and short.num_samples == 832
    assert long.for_corpus(LONG_CORPUS_TOKENS + 1) is long  # decided once
    given = TrainConfig(epochs=3, verify_fraction=0.0, fact_fraction=0.1, cloze_fraction=0.3,
                        init="spread").for_corpus(50_000)
    assert plan(given) == (3, 0.0, 0.1, 0.3, "spread")
    assert TrainConfig().init is None and TrainConfig(init="compact").for_corpus(100).init == "compact"


def test_default_cartridge_length_is_an_eighth_of_the_corpus():
    assert default_num_tokens(2_500) == 304  # 8.2x less KV than the document in context
    assert default_num_tokens(100) == 64  # a paragraph still gets a usable cartridge...
    assert TrainConfig().for_corpus(40).num_tokens == 40  # ...never longer than itself
    assert default_num_tokens(8_192) == default_num_tokens(100_000) == 1_024  # bounded
    for n in range(512, 16_384, 37):  # at least 8x less KV wherever the bounds leave room
        assert n / default_num_tokens(n) >= 8 and default_num_tokens(n) % 16 == 0
    sizes = [default_num_tokens(n) for n in range(0, 40_000, 997)]
    assert sizes == sorted(sizes)
    config = TrainConfig()
    assert config.num_tokens is None and config.for_corpus(6_000).num_tokens == 736
    assert TrainConfig(num_tokens=32).for_corpus(100_000).num_tokens == 32  # a choice is kept
    assert TrainConfig(num_tokens=512).for_corpus(300).num_tokens == 300  # clipped to the corpus...
    assert TrainConfig(num_tokens=512, init="spread").for_corpus(300).num_tokens == 300
    assert TrainConfig(num_tokens=512, init="text").for_corpus(300).num_tokens == 512  # ...when made from it
    with pytest.raises(ValueError, match="num_tokens"):
        TrainConfig(num_tokens=0)
    with pytest.raises(ValueError, match="at least 64"):
        TrainConfig(num_frozen=64)


def test_loop_start_cuts_a_looping_tail_only():
    text = [5, 6, 7, 8, 9]
    assert loop_start(text) == len(text)
    loop = [1, 2, 3] + [4, 5] * 10
    assert loop_start(loop) == 5  # the first "4, 5" is kept
    assert loop_start([7] * 30) == 1
    # A repeat too short to be a loop (a table row, a phrase said twice) is left alone.
    assert loop_start([1, 2, 3, 4, 1, 2, 3, 4]) == 8


def test_recall_message_quotes_a_sentence_start_and_answers_with_what_follows():
    chunk = ("The council meets on the first Monday of every month in the long hall. "
             "Members who miss three meetings in a row lose their vote for one year, unless the "
             "chair excuses them in writing before the meeting.")
    for seed in range(5):
        message, answer = recall_message(RECALL_TEMPLATES[0], chunk, random.Random(seed))
        cue = message.split('"')[1]
        assert chunk.index(cue) in (0, chunk.index("Members"))
        assert chunk.endswith(answer) and chunk.index(cue) + len(cue) < chunk.index(answer)
        assert len(answer.split()) >= 12


def test_cloze_message_blanks_a_number_or_name_of_a_whole_sentence():
    chunk = ("cut off at the start. The furnace Old Ember works at 1,150 °C and is relined every "
             "4.5 years by the firm of Harrow Brothers. The end is cut")
    seen = set()
    for seed in range(20):
        message, answer = cloze_message(CLOZE_TEMPLATES[0], chunk, random.Random(seed))
        sentence = message.split('"')[1]
        assert "____" in sentence and sentence.replace("____", answer) in chunk
        seen.add(answer)
    assert seen <= {"1,150 °C", "4.5", "Old Ember", "Harrow Brothers"} and len(seen) > 1
    # No sentence to blank: a recall message instead.
    message, answer = cloze_message(CLOZE_TEMPLATES[0], "just some lowercase words without any facts at all "
                                    "in them, said twice over and over here", random.Random(0))
    assert "____" not in message and answer


def test_verify_message_states_a_sentence_true_or_with_a_number_or_name_swapped():
    chunk = ("cut off at the start. The furnace Old Ember works at 1,150 °C and is relined every "
             "4.5 years by the firm of Harrow Brothers. The end is cut")
    sentence = "The furnace Old Ember works at 1,150 °C and is relined every 4.5 years by the firm of Harrow Brothers."
    answers = set()
    for seed in range(30):
        message, answer = verify_message(VERIFY_TEMPLATES[0], chunk, random.Random(seed))
        assert message.endswith("Answer yes or no.")
        statement = message.split('"')[1]
        answers.add(answer)
        if answer == "Yes":
            assert statement == sentence
        else:  # one number swapped for another number of the chunk, or one name for another name
            assert answer == "No" and statement != sentence
            swaps = {("1,150 °C", "4.5"), ("4.5", "1,150 °C"), ("Old Ember", "Harrow Brothers"),
                     ("Harrow Brothers", "Old Ember")}
            assert any(statement == sentence.replace(a, b, 1) for a, b in swaps), statement
    assert answers == {"Yes", "No"}
    # Nothing of its sort to swap in (a sentence's first word is no name): the statement stays true.
    lone = "start. The bell Brannick was cast in 1402 by the smith. Then it rang. end"
    for seed in range(10):
        message, answer = verify_message(VERIFY_TEMPLATES[0], lone, random.Random(seed))
        assert answer == "Yes" and "Brannick was cast in 1402" in message


def test_verify_message_with_a_swap_pool_swaps_in_a_corpus_name_and_corrects_it():
    chunk = ("cut off at the start. The flagship of the fleet was the Wakeful Heron, built in 1402 at "
             "the yard of Harrow Brothers. The end is cut")
    sentence = "The flagship of the fleet was the Wakeful Heron, built in 1402 at the yard of Harrow Brothers."
    pool = swap_candidates("Elsewhere. The tender was called Wake Vell by Odo. A pier of 77 piles. The Tessel "
                           "Marsh drained in 1650. So, The end.")
    assert pool == ["1650", "77", "Odo", "Tessel Marsh", "The", "Wake Vell"]  # "The" is never swapped in
    answers = set()
    for seed in range(40):
        message, answer = verify_message(VERIFY_TEMPLATES[0], chunk, random.Random(seed), swap_pool=pool,
                                         correction=True)
        statement = message.split('"')[1]
        word, said = answer.split(". ", 1)
        assert said == f'The document says: "{sentence}"'  # the right sentence, whatever the statement
        answers.add(word)
        if word == "Yes":
            assert statement == sentence
        else:  # a number from the corpus for a number; a name of as many words for a name
            swaps = {("Wakeful Heron", "Wake Vell"), ("Wakeful Heron", "Tessel Marsh"), ("Harrow Brothers", "Wake Vell"),
                     ("Harrow Brothers", "Tessel Marsh"), ("1402", "1650"), ("1402", "77")}
            assert word == "No" and any(statement == sentence.replace(a, b, 1) for a, b in swaps), statement
    assert answers == {"Yes", "No"}
    # Without a pool or a correction the message and answer are the chunk's own verify ones.
    for seed in range(10):
        assert verify_message(VERIFY_TEMPLATES[0], chunk, random.Random(seed), swap_pool=swap_candidates(chunk)) == \
            verify_message(VERIFY_TEMPLATES[0], chunk, random.Random(seed))


def test_verify_fraction_zero_draws_the_seed_prompts_of_a_config_without_it():
    plain = draw_seed_prompts(random.Random(5), 40, 1.0)
    assert draw_seed_prompts(random.Random(5), 40, 1.0, 0.0) == plain
    mixed = [kind for kind, _ in draw_seed_prompts(random.Random(5), 400, 1.0, 0.25)]
    assert 0.15 < mixed.count(VERIFY) / len(mixed) < 0.35
    assert {"recall", "cloze"} <= set(mixed)


def test_cloze_fraction_sets_the_share_of_cloze_among_recall_and_cloze():
    even = draw_seed_prompts(random.Random(5), 40, 1.0, 0.25)
    assert draw_seed_prompts(random.Random(5), 40, 1.0, 0.25, 0.5) == even
    recall_only = [kind for kind, _ in draw_seed_prompts(random.Random(5), 400, 1.0, 0.25, 0.0)]
    assert "cloze" not in recall_only and {"recall", VERIFY} <= set(recall_only)
    assert 0.15 < recall_only.count(VERIFY) / len(recall_only) < 0.35
    mostly_cloze = [kind for kind, _ in draw_seed_prompts(random.Random(5), 400, 1.0, 0.0, 0.8)]
    assert 0.7 < mostly_cloze.count("cloze") / len(mostly_cloze) < 0.9


def test_topic_message_names_words_of_a_sentence_and_answers_with_it_and_the_next():
    chunk = ("cut off at the start. The breakdown crane Old Marrable lifts 12 tonnes at a radius of 5 "
             "metres. It stands in the shed at Greyholm, beside the tool van. A short line. "
             "The crane's driver must hold Grade C. The end is cut")
    sentences = ["The breakdown crane Old Marrable lifts 12 tonnes at a radius of 5 metres.",
                 "It stands in the shed at Greyholm, beside the tool van.",
                 "The crane's driver must hold Grade C."]
    topics = set()
    for seed in range(60):
        message, answer = topic_message(TOPIC_TEMPLATES[0], chunk, random.Random(seed))
        topic = message.split('"')[1]
        topics.add(topic)
        words = topic.split()
        assert 2 <= len(words) <= 3 and not any(ch.isdigit() for ch in topic)
        assert words[0].lower() not in ("the", "at", "a", "of") and words[-1].lower() not in ("the", "at", "a", "of")
        assert "," not in topic and "." not in topic and chunk.count(topic) == 1
        # The answer: the chunk's text from the sentence that holds the topic to the end of the next one.
        first = next(s for s in sentences if topic in s)
        assert answer.startswith(first) and answer in chunk
        following = sentences[sentences.index(first) + 1:]
        assert answer.endswith(following[0]) if following else answer == first
    assert {"breakdown crane", "Old Marrable", "tool van"} <= topics
    assert not any("Greyholm beside" in topic for topic in topics)  # no phrase across a comma
    # No sentence with such a phrase: a recall message instead.
    message, answer = topic_message(TOPIC_TEMPLATES[0], "cut. It is on at 5 and at 6 but not at 7 or 8 at all. cut",
                                    random.Random(0))
    assert message.startswith("Continue this passage") and answer


def test_topic_fraction_sets_the_share_of_topic_among_the_written_kinds_but_verify():
    plain = draw_seed_prompts(random.Random(5), 40, 1.0, 0.25, 0.0)
    assert draw_seed_prompts(random.Random(5), 40, 1.0, 0.25, 0.0, 0.0) == plain
    kinds = [kind for kind, _ in draw_seed_prompts(random.Random(5), 800, 1.0, 0.25, 0.0, 0.5)]
    assert 0.15 < kinds.count(VERIFY) / len(kinds) < 0.35
    others = [k for k in kinds if k != VERIFY]
    assert set(others) == {TOPIC, "recall"} and 0.4 < others.count(TOPIC) / len(others) < 0.6


def test_fact_message_asks_for_one_number_or_name_and_answers_with_it_then_the_sentence():
    chunk = ("cut off at the start. The census of 615 CR counted 38,950 people on Orrisk. "
             "Below the Moothall lies the Cindervault, the League's archive, founded in 307 CR by Ysolde Krane. "
             "The Council of the Lamps meets twice a year. The end is cut")
    sentences = ["The census of 615 CR counted 38,950 people on Orrisk.",
                 "Below the Moothall lies the Cindervault, the League's archive, founded in 307 CR by Ysolde Krane.",
                 "The Council of the Lamps meets twice a year."]
    asked = {}
    for seed in range(80):
        message, answer = fact_message(FACT_TEMPLATES[0], chunk, random.Random(seed))
        assert message.startswith("According to the document, ") and message.endswith("?")
        fact, sentence = answer.split(". ", 1)
        assert sentence in sentences and fact in sentence  # the fact first, then its sentence
        asked[fact] = message.removeprefix("According to the document, ")
    assert asked["38,950 people"] == "the census of 615 CR counted how many people on Orrisk?"
    assert asked["615"] == "the census of what CR counted 38,950 people on Orrisk?"
    # A long sentence is asked by its first clause and the fact's clause, the words between left out.
    assert asked["307"] == "Below the Moothall lies the Cindervault, founded in what year CR by Ysolde Krane?"
    assert asked["Ysolde Krane"] == "Below the Moothall lies the Cindervault, founded in 307 CR by what?"
    assert "Lamps" not in asked  # the last word of a name ("Council of the Lamps") is not a name of its own
    assert "Moothall" in asked and "Orrisk" in asked
    # No sentence with a number or name: a recall message instead.
    message, answer = fact_message(FACT_TEMPLATES[1], "cut. it is on at noon and off at dusk but not all day. cut",
                                   random.Random(0))
    assert message.startswith("Continue this passage") and answer


def test_fact_fraction_sets_the_share_of_fact_among_the_written_kinds_but_verify():
    plain = draw_seed_prompts(random.Random(5), 40, 1.0, 0.25, 0.0)
    assert draw_seed_prompts(random.Random(5), 40, 1.0, 0.25, 0.0, 0.0, 0.0) == plain
    kinds = [kind for kind, _ in draw_seed_prompts(random.Random(5), 800, 1.0, 0.25, 0.0, 0.0, 0.5)]
    others = [k for k in kinds if k != VERIFY]
    assert set(others) == {FACT, "recall"} and 0.4 < others.count(FACT) / len(others) < 0.6


@pytest.mark.parametrize("total, start, length", [(1000, 0, 100), (1000, 450, 100), (1000, 900, 100), (400, 150, 100)])
def test_a_partner_chunk_lies_a_quarter_of_the_corpus_away(total, start, length):
    rng = random.Random(0)
    chunk = Span(start, start + length)
    for _ in range(200):
        partner = partner_chunk(total, chunk, rng)
        assert partner is not None and len(partner) == length and 0 <= partner.start and partner.end <= total
        assert abs((partner.start + partner.end) / 2 - (start + length / 2)) >= total / 4
    assert partner_chunk(150, Span(0, 100), rng) is None  # no room that far away
