"""Seed prompts for "A", the model instance that writes user messages about a chunk, and the
system prompt both instances see. Five kinds, as in self-study (the wording is ours), and
kinds written here rather than by A, whose answer comes from the chunk and is scored by the
teacher, not generated: "recall" (the start of a sentence quoted, the document's own text
after it asked for), "cloze" (a number or name blanked out) and "verify" (a statement, true
or with a number or name swapped, to answer yes or no). They put the facts themselves among
what the cartridge learns to say: a small model as B often answers other messages wrongly."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

SYSTEM_PROMPT = (
    "You are reading the following document. Use only what it says.\n\n"
    "<document>\n{chunk}\n</document>"
)

SEED_PROMPTS: dict[str, tuple[str, ...]] = {
    "structuring": (
        "Write a message asking for one part of the document above to be organized as a "
        "list or table of its key names, numbers and dates. Name the part. Output only the message.",
        "Write a request to lay out the facts of one section of the document above in a structured "
        "form (bullet points with each fact on its own line). Output only the request.",
    ),
    "summarization": (
        "Write a message asking for a short summary of a specific part of the document above; "
        "say which part. Output only the message.",
        "Write a request for a summary of the whole document above in a few sentences. Output only the request.",
    ),
    "question": (
        "Write one question whose answer is a specific fact stated in the document above (a name, "
        "number, date or place). Output only the question.",
        "Write a question that can only be answered by someone who read the document above closely. "
        "Output only the question.",
        "Write a question about how two things mentioned in the document above are related. "
        "Output only the question.",
    ),
    "use_case": (
        "Think of a practical task someone could do with the information in the document above, "
        "and write the message they would send to get help with it. Output only the message.",
        "Write a message from a person who needs one particular detail from the document above "
        "for their work, asking for it. Output only the message.",
    ),
    "creative": (
        "Write a request for a short creative piece (a poem, a story or a dialogue) grounded in "
        "the facts of the document above. Output only the request.",
        "Write a message asking for the document above to be explained to a child, keeping its "
        "facts. Output only the message.",
    ),
}

RECALL = "recall"
CLOZE = "cloze"
VERIFY = "verify"  # a sentence of the chunk, true or with one number or name swapped: yes or no (verify_fraction)
TOPIC = "topic"  # a phrase of a sentence named, the sentence and the next one asked for (topic_fraction)
FACT = "fact"  # a question about one number or name of a sentence, answered with it and the sentence (fact_fraction)
JOINED = "joined"  # two recalls from distant parts of the corpus in one message (joined_fraction)
KINDS = (*SEED_PROMPTS, RECALL, CLOZE, VERIFY, TOPIC, FACT, JOINED)
WRITTEN_HERE = (RECALL, CLOZE, VERIFY, TOPIC, FACT)  # kinds whose message and answer come from the chunk, not from A and B

# How often each of A's kinds is drawn: weighted toward messages that ask for the facts. A
# small model as A turns creative and use-case seeds into messages often not about the chunk.
KIND_WEIGHTS = {"question": 4, "structuring": 2, "summarization": 1, "use_case": 1, "creative": 1}

RECALL_TEMPLATES = (
    'Continue this passage from the document, word for word: "{cue}"',
    'What does the document say right after "{cue}"? Quote it.',
    'Where the document says "{cue}", what comes next?',
    'Quote the rest of the part of the document that begins "{cue}".',
)

JOINED_TEMPLATES = (
    'The document says "{first}" in one place and "{second}" in another. Continue both passages, '
    'word for word, the first one first.',
    'Quote what follows "{first}" in the document, and then what follows "{second}".',
)


CLOZE_TEMPLATES = (
    'Fill in the blank with the words the document uses: "{sentence}"',
    'According to the document, what goes in the blank? "{sentence}"',
)

VERIFY_ANSWERS = ("Yes", "No")  # a verify message's written answer: its statement true, or with a swap

# The phrasing users' yes/no questions end with ("... Answer yes or no."), so that what the
# cartridge learns about such answers is asked the way it will be.
VERIFY_TEMPLATES = (
    'According to the document, is this true? "{statement}" Answer yes or no.',
    'Does the document say this? "{statement}" Answer yes or no.',
)

# Asked the way users ask about a part of a document: by words of it, not by where it starts.
TOPIC_TEMPLATES = (
    'What does the document say about "{topic}"?',
    'Quote what the document says about "{topic}".',
    'Which passage of the document mentions "{topic}"? Quote it.',
)

# Asked the way users ask for one fact, and answered the way they want it: the fact first.
FACT_TEMPLATES = (
    "According to the document, {question}",
    "{question}",
)

_TEMPLATES = {**SEED_PROMPTS, RECALL: RECALL_TEMPLATES, CLOZE: CLOZE_TEMPLATES, VERIFY: VERIFY_TEMPLATES,
              TOPIC: TOPIC_TEMPLATES, FACT: FACT_TEMPLATES}


def draw_seed_prompts(rng: random.Random, n: int, written_fraction: float,
                      verify_fraction: float = 0.0, cloze_fraction: float = 0.5,
                      topic_fraction: float = 0.0, fact_fraction: float = 0.0) -> list[tuple[str, str]]:
    """`n` (kind, prompt) pairs: with probability `written_fraction` a written kind (the prompt
    is a template that `written_message` fills in): "verify" with probability
    `verify_fraction`, else "topic" with probability `topic_fraction`, else "fact" with
    probability `fact_fraction`, else "cloze" with probability `cloze_fraction` and "recall"
    otherwise; otherwise one of A's kinds drawn by KIND_WEIGHTS; then a prompt of that kind. A
    `verify_fraction`, `topic_fraction` or `fact_fraction` of 0 draws nothing for it, and a
    `cloze_fraction` of 0.5 draws as an even choice, so that the other draws are those of a
    config without them."""
    a_kinds = tuple(KIND_WEIGHTS)

    def written_kind() -> str:
        if verify_fraction > 0 and rng.random() < verify_fraction:
            return VERIFY
        if topic_fraction > 0 and rng.random() < topic_fraction:
            return TOPIC
        if fact_fraction > 0 and rng.random() < fact_fraction:
            return FACT
        if cloze_fraction == 0.5:
            return rng.choice((RECALL, CLOZE))
        return CLOZE if rng.random() < cloze_fraction else RECALL

    kinds = [
        written_kind() if rng.random() < written_fraction
        else rng.choices(a_kinds, weights=[KIND_WEIGHTS[k] for k in a_kinds])[0]
        for _ in range(n)
    ]
    return [(k, rng.choice(_TEMPLATES[k])) for k in kinds]


def written_message(kind: str, template: str, chunk_text: str, rng: random.Random,
                    swap_pool: Sequence[str] | None = None, correction: bool = False) -> tuple[str, str]:
    """The message and answer of a row whose kind is in WRITTEN_HERE; `swap_pool` and
    `correction` go to `verify_message`."""
    if kind == VERIFY:
        return verify_message(template, chunk_text, rng, swap_pool=swap_pool, correction=correction)
    make = {RECALL: recall_message, CLOZE: cloze_message, TOPIC: topic_message, FACT: fact_message}[kind]
    return make(template, chunk_text, rng)


SENTENCE_START = re.compile(r"(?:^|(?<=[.!?:;|\n]))\s*(?=[A-Z0-9])")  # where a sentence, line or table cell starts
RECALL_CUE_WORDS = 8  # the words of a sentence a recall message quotes


def recall_message(template: str, chunk_text: str, rng: random.Random, cue_words: int = RECALL_CUE_WORDS,
                   min_rest_words: int = 12) -> tuple[str, str]:
    """A "recall" message and its answer: `template` with the first `cue_words` words of a
    sentence (or line, or table cell) of the chunk, drawn at random among those followed by at
    least `min_rest_words` more words, and the chunk's text after the cue."""
    candidates = []
    for match in SENTENCE_START.finditer(chunk_text):
        words = list(re.finditer(r"\S+", chunk_text[match.end() :]))
        if len(words) >= cue_words + min_rest_words:
            cue_end = match.end() + words[cue_words - 1].end()
            candidates.append((chunk_text[match.end() : cue_end], cue_end))
    if not candidates:  # a chunk without such sentences: its first words
        words = list(re.finditer(r"\S+", chunk_text))
        cue_end = words[min(cue_words, len(words)) - 1].end() if words else 0
        candidates = [(chunk_text[:cue_end], cue_end)]
    cue, cue_end = rng.choice(candidates)
    return template.format(cue=" ".join(cue.split())), chunk_text[cue_end:].strip()


def joined_message(template: str, first_text: str, second_text: str, rng: random.Random) -> tuple[str, str, str]:
    """A "joined" message and the two parts of its answer: a recall cue from each of two chunks
    (in corpus order) in one `template`, and each chunk's text after its cue."""
    cue_template = "{cue}"
    first_cue, first_rest = recall_message(cue_template, first_text, rng)
    second_cue, second_rest = recall_message(cue_template, second_text, rng)
    return template.format(first=first_cue, second=second_cue), first_rest, second_rest


# What a cloze blanks out: a number (with a % or °C), or a run of capitalized words that does
# not start the sentence (a name).
_CLOZE_SPAN = re.compile(r"\d(?:[\d,.:/]*\d)?(?:\s?(?:%|°C))?|(?<=\s)[A-Z][a-z]+(?:\s[A-Z][a-z]+)*")
_SENTENCE = re.compile(r"(?:[^.!?\n|]|[.!?](?=\S))+[.!?]?")  # "6.4" does not end a sentence


def cloze_message(template: str, chunk_text: str, rng: random.Random, min_words: int = 6) -> tuple[str, str]:
    """A "cloze" message and its answer: a sentence of the chunk (or table cell run) with one
    number or name blanked out, drawn at random, and the blanked words. Sentences cut by the
    chunk's edges are left out. Falls back to a recall message when no sentence has a blank."""
    candidates = []
    for sentence in _whole_sentences(chunk_text, min_words):
        for span in _CLOZE_SPAN.finditer(sentence):
            if span.start() > 0:
                candidates.append((sentence, span))
    if not candidates:
        return recall_message(RECALL_TEMPLATES[0], chunk_text, rng)
    sentence, span = rng.choice(candidates)
    blanked = " ".join((sentence[: span.start()] + "____" + sentence[span.end() :]).split())
    return template.format(sentence=blanked), span.group()


def _whole_sentence_spans(chunk_text: str, min_words: int) -> list[tuple[int, int]]:
    """Where the chunk's sentences (or table cell runs) of at least `min_words` words that its
    edges do not cut lie: [start, end) character spans, in order."""
    return [(m.start(), m.end()) for m in _SENTENCE.finditer(chunk_text)
            if len(m.group().split()) >= min_words and m.start() > 0 and m.end() < len(chunk_text)]


def _whole_sentences(chunk_text: str, min_words: int) -> list[str]:
    """The chunk's sentences (or table cell runs) of at least `min_words` words that its edges do not cut."""
    return [chunk_text[start:end].strip() for start, end in _whole_sentence_spans(chunk_text, min_words)]


def verify_message(template: str, chunk_text: str, rng: random.Random, min_words: int = 6,
                   swap_pool: Sequence[str] | None = None, correction: bool = False) -> tuple[str, str]:
    """A "verify" message and its answer: a sentence of the chunk as a statement to check, and
    "Yes"; or, at even odds, the same sentence with one number or name replaced by a different
    one of the same sort (a number by a number, a name by a name), and "No". The swap comes
    from the chunk, or from `swap_pool` when given (the numbers and names of the whole corpus,
    `swap_candidates`: the siblings a cartridge confuses live elsewhere in it), preferring one
    of as many words. With `correction` the answer goes on with the chunk's sentence ('No.
    The document says: "..."'), so that a swapped name is met by the right one. The teacher
    scores the answer with the chunk in context, so what is learned is its judgment. A
    sentence with nothing to swap stays true; a chunk without whole sentences falls back to a
    recall message."""
    sentences = _whole_sentences(chunk_text, min_words)
    if not sentences:
        return recall_message(RECALL_TEMPLATES[0], chunk_text, rng)
    sentence = rng.choice(sentences)
    statement, answer = sentence, VERIFY_ANSWERS[0]
    if rng.random() < 0.5:
        spans = [s for s in _CLOZE_SPAN.finditer(sentence) if s.start() > 0]
        if spans:
            span = rng.choice(spans)
            numeric = span.group()[0].isdigit()
            pool = swap_pool if swap_pool is not None else swap_candidates(chunk_text)
            others = [o for o in pool if o[0].isdigit() == numeric and o != span.group()]
            if swap_pool is not None:  # a name of as many words, where the corpus has one; no lone "The"
                words = len(span.group().split())
                others = [o for o in others if o.lower() not in _FUNCTION_WORDS]
                others = [o for o in others if len(o.split()) == words] or others
            if others:
                statement = sentence[: span.start()] + rng.choice(others) + sentence[span.end() :]
                answer = VERIFY_ANSWERS[1]
    message = template.format(statement=" ".join(statement.split()))
    if correction:
        return message, f'{answer}. The document says: "{" ".join(sentence.split())}"'
    return message, answer


def swap_candidates(text: str) -> list[str]:
    """The numbers and names (cloze spans not starting a sentence) of `text`'s sentences, each
    once, sorted: what a verify statement's swap draws from."""
    return sorted({m.group() for part in _SENTENCE.finditer(text)
                   for m in _CLOZE_SPAN.finditer(part.group().strip()) if m.start() > 0})


# Words that do not make a topic on their own: a topic phrase neither starts nor ends with one.
_FUNCTION_WORDS = frozenset("""
a an the and or but nor of to in on at by for from with without into onto over under than then
as is are was were be been being has have had do does did not no it its this that these those
which who whom whose what when where while if so such each every any all some one may must shall
should can could will would there their they them he she his her we our you your i after before
up down out off about between within per via
""".split())


_TOPIC_LINKS = frozenset({"of", "and", "for", "on", "in", "to", "at", "the"})


def _is_topic(words: list[str], raw_but_last: list[str]) -> bool:
    """Whether `words` make a topic phrase: content words at both ends, only a linking word
    (of, and, the...) between, no number, and no punctuation inside (`raw_but_last`: the words
    before the last as written)."""
    lowered = [w.lower() for w in words]
    return (all(any(ch.isalpha() for ch in w) for w in words) and not any(ch.isdigit() for w in words for ch in w)
            and lowered[0] not in _FUNCTION_WORDS and lowered[-1] not in _FUNCTION_WORDS
            and all(w not in _FUNCTION_WORDS or w in _TOPIC_LINKS for w in lowered[1:-1])
            and not any(w[-1] in ".,;:!?)\"'" for w in raw_but_last))


def topic_message(template: str, chunk_text: str, rng: random.Random, min_words: int = 6) -> tuple[str, str]:
    """A "topic" message and its answer: `template` naming a phrase of two or three words from
    a whole sentence of the chunk (`_is_topic`, found once in the chunk), drawn at random, and
    the chunk's text from that sentence to the end of the next whole one as the answer. A
    question about a part of a document names words of it; recall cues it by where a sentence
    starts. Falls back to a recall message when no sentence has such a phrase."""
    spans = _whole_sentence_spans(chunk_text, min_words)
    lowered = chunk_text.lower()
    candidates = []
    for index, (start, end) in enumerate(spans):
        raw = chunk_text[start:end].split()
        words = [w.strip(".,;:!?()\"'*_`#|-[]") for w in raw]
        for n in (2, 3):
            for i in range(len(words) - n + 1):
                phrase = words[i : i + n]
                if _is_topic(phrase, raw[i : i + n - 1]) and lowered.count(" ".join(phrase).lower()) == 1:
                    candidates.append((" ".join(phrase), index))
    if not candidates:
        return recall_message(RECALL_TEMPLATES[0], chunk_text, rng)
    topic, index = rng.choice(candidates)
    start, end = spans[index][0], spans[min(index + 1, len(spans) - 1)][1]
    return template.format(topic=topic), chunk_text[start:end].strip()


_YEAR_LEAD = frozenset({"in", "since", "until", "till", "by", "before", "after", "from"})
_NAME_TAIL = re.compile(r"[A-Z][a-z]+ of (?:the )?$")  # "Council of the" Lamps: a name's last word, not a name
_CLAUSE_BREAK = re.compile(r",\s|;\s|\s[—–]\s|:\s")


def _question_phrase(sentence: str, span: re.Match) -> tuple[str, int, int]:
    """What a question asks in place of the cloze span `span` of `sentence`, and the answer's
    [start, end) there: "how many <noun>" for a number before a lowercase word (the noun joins
    the answer: "38,950 people"), "what percentage" for a share, "what year" for a number after
    "in", "since"... and "what" otherwise (a name, a bare number)."""
    text, start, end = span.group(), span.start(), span.end()
    if not text[0].isdigit():
        return "what", start, end
    if text.endswith("%"):
        return "what percentage", start, end
    following = re.match(r"\s([a-z][a-z-]*)\b", sentence[end:])
    if following and following.group(1) not in _FUNCTION_WORDS:
        return f"how many {following.group(1)}", start, end + following.end()
    before = sentence[:start].split()
    if before and before[-1].lower() in _YEAR_LEAD and re.fullmatch(r"\d{1,4}", text):
        return "what year", start, end
    return "what", start, end


def fact_message(template: str, chunk_text: str, rng: random.Random, min_words: int = 6) -> tuple[str, str]:
    """A "fact" message and its answer: a question about one number or name (a cloze span) of a
    whole sentence of the chunk, written from the sentence: its first clause and the clause
    that holds the span, the span replaced by a question word (`_question_phrase`); the answer
    is the span, then the sentence ("38,950 people. The census of 615 CR counted 38,950 people
    on Orrisk."). A user asks for one fact in fewer words than the sentence and wants it first;
    recall and cloze quote the sentence. Falls back to a recall message when no sentence has a
    span."""
    candidates = [(sentence, span) for sentence in _whole_sentences(chunk_text, min_words)
                  for span in _CLOZE_SPAN.finditer(sentence)
                  if span.start() > 0 and not _NAME_TAIL.search(sentence[: span.start()])]
    if not candidates:
        return recall_message(RECALL_TEMPLATES[0], chunk_text, rng)
    sentence, span = rng.choice(candidates)
    phrase, start, end = _question_phrase(sentence, span)
    asked = sentence[:start] + phrase + sentence[end:]
    # The clauses of `asked` as [start, end) spans; the question phrase starts at `start`.
    cuts = list(_CLAUSE_BREAK.finditer(asked))
    clauses = list(zip([0, *(m.end() for m in cuts)], [*(m.start() for m in cuts), len(asked)]))
    own = max(i for i, (s, _) in enumerate(clauses) if s <= start)
    if own == 0 or len(asked[slice(*clauses[own])].split()) < 4:
        question = asked
    else:
        question = asked[slice(*clauses[0])] + ", " + asked[slice(*clauses[own])]
    question = " ".join(question.rstrip(" .!?;:,").split()) + "?"
    words = question.split(" ", 1)
    if template.startswith("According") and words[0].lower() in _FUNCTION_WORDS:
        question = words[0].lower() + " " + words[1]
    return template.format(question=question), f"{sentence[start:end]}. {' '.join(sentence.split())}"


# For init="text": KV of text unrelated to any corpus.
UNRELATED_TEXT = (
    "The history of bread spans thousands of years. Early farmers ground wild grains between "
    "stones, mixed the flour with water and baked flat cakes on hot rocks. Leavened bread came "
    "later, when dough left in warm air began to rise. Bakers learned to keep a piece of old "
    "dough to start the next batch, and mills powered by water and wind made flour cheaper. "
    "Today bread is made in countless shapes, from long thin loaves to round dense ones, and "
    "each region keeps its own recipes, grains and habits of eating it. "
)
