"""A corpus far beyond the context as parts, a cartridge trained for each, and a chat on them
answered by the part its question is about.

A cartridge per part of a corpus of five or six contexts can remember more of it than one for
the whole: on the 53K-token chronicle four parts recover 0.66 of the oracle's gain against one
cartridge's 0.61, on the held-out 44K-token university calendar three parts 0.57 and 0.61
against 0.51 and 0.44 under two seeds, on the held-out 41K-token lighthouse handbook 0.58-0.60
against 0.58-0.63 under two seeds (no gain), and on the held-out 49K-token canal annals 0.54
against 0.47, for the parts' count times the KV and the same training time (docs/experiments.md,
"Does a cartridge per part of a long corpus, composed by mixture, remember more of it?" and
"Should a corpus past four contexts train in parts by default?"). The parts are kept as one
cartridge file (`cartridges.save_cartridges`). Where the parts' text is at hand, `PartSearch`
finds the part a question is about from the question alone, and that part answers: one part's
cost, about the mixture's quality (the server's default, `composition: "search"`;
docs/experiments.md, "Should search be the chat's default for a cartridge in parts?"); each
part records the size its corpus was cut by (`record_cut`) and, as every cartridge does, the
digest of the text it was trained on, so that the library and a local chat given the training
files search too (`part_search_for`), and files other than the ones trained on are refused
rather than searched. Without the text the parts are
composed by mixture, which puts its weight on the part the question is about. Either way a
question that joins two parts is answered from one of them. They are not to be concatenated:
parts trained apart read as one cartridge recover half as much. The CLI and the server train a
corpus this way when it holds more than four of the model's contexts and the user did not say
(`in_parts_by_default`).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .selfstudy import TrainConfig

MIN_PART_TOKENS = 64
DEFAULT_PART_CONTEXTS = 2  # parts of two contexts: where the defaults reach 0.70-0.73 on held-out corpora
# The CLI and the server train a corpus of more than four contexts in parts unless told otherwise:
# past five contexts parts recovered 0.60 of the oracle's gain on average over four documents
# against one cartridge's 0.54, ahead on three (docs/experiments.md, "Should a corpus past four
# contexts train in parts by default?"); from two to four contexts nothing was measured, and one
# cartridge stays.
PARTS_PAST_CONTEXTS = 4
HEADING = re.compile(r"(#{1,6}) ")  # a markdown heading starts a paragraph: the best place for a cut
# What a cut prefers, best first: before a heading (of level 1, ..., 6), between paragraphs, between
# lines, between words.
PARAGRAPH_CUT, LINE_CUT, WORD_CUT = 7, 8, 9
CUT_KINDS = (1, 2, 3, 4, 5, 6, PARAGRAPH_CUT, LINE_CUT, WORD_CUT)


@dataclass
class _Piece:
    text: str
    cut: int  # how good a cut before it is: the level of the heading it starts, or *_CUT (lower is better)
    separator: str  # what joins it to the piece before: a blank line, a newline or a space
    tokens: int
    heading: bool = False


def _pieces(tokenizer: Any, text: str, longest: int) -> list[_Piece]:
    """`text` as paragraphs, each a piece; a paragraph of more than `longest` tokens as its
    lines, and a line of more as runs of words, so that a cut can fall inside it. A heading
    stays with what follows it: the cut right after it is the worst kind."""
    pieces: list[_Piece] = []
    for paragraph in (p.strip() for p in re.split(r"\n[ \t]*\n", text)):
        if not paragraph:
            continue
        heading = HEADING.match(paragraph)
        first = len(heading.group(1)) if heading else PARAGRAPH_CUT
        if pieces and pieces[-1].heading:
            first = WORD_CUT
        tokens = len(tokenizer.encode(paragraph))
        if tokens <= longest:
            pieces.append(_Piece(paragraph, first, "\n\n", tokens, heading=heading is not None))
            continue
        for i, line in enumerate(line for line in paragraph.splitlines() if line.strip()):
            cut, separator = (first, "\n\n") if i == 0 else (LINE_CUT, "\n")
            tokens = len(tokenizer.encode(line))
            if tokens <= longest:
                pieces.append(_Piece(line, cut, separator, tokens))
                continue
            words = line.split()
            per_run = max(1, math.ceil(len(words) * longest / tokens))  # about `longest` tokens a run
            for k in range(0, len(words), per_run):
                run = " ".join(words[k:k + per_run])
                pieces.append(_Piece(run, cut if k == 0 else WORD_CUT, separator if k == 0 else " ",
                                     len(tokenizer.encode(run))))
    return pieces


def _joined(pieces: Sequence[_Piece]) -> str:
    return "".join(p.text if i == 0 else p.separator + p.text for i, p in enumerate(pieces))


def corpus_parts(tokenizer: Any, texts: str | Sequence[str], max_tokens: int) -> list[str]:
    """The corpus of `texts` (joined as `Corpus.from_texts` joins them) cut into the fewest
    parts of about `max_tokens` tokens, of near-equal length (the cut nearest an equal share at
    the best boundary can leave a part over `max_tokens`: on the suite's long documents by up to
    12% at 8,192 and 16,384 tokens, 29% at 4,096). Each cut falls at the best
    kind of boundary that lies within a quarter of a part of its equal share, the nearest of
    that kind: before a heading of the highest level ("# ..." first, "###### ..." last), else
    between paragraphs, lines or words. Every part after the first starts with the corpus'
    opening (its headings and first paragraph, when they are short), so that it says what it is
    a part of. A corpus of at most `max_tokens` tokens is one part, the corpus as it is."""
    if max_tokens < MIN_PART_TOKENS:
        raise ValueError(f"max_tokens must be at least {MIN_PART_TOKENS}, not {max_tokens}")
    texts = [texts] if isinstance(texts, str) else [t for t in texts if t.strip()]
    whole = "\n\n".join(texts)
    if len(tokenizer.encode(whole)) <= max_tokens:
        return [whole]
    pieces = _pieces(tokenizer, whole, max_tokens // 16)
    # The opening: the leading headings and the first paragraph, when it is whole (not cut into lines) and short.
    opening_end = next((i for i, p in enumerate(pieces) if not p.heading), 0)  # the first paragraph
    whole_paragraph = opening_end + 1 < len(pieces) and pieces[opening_end + 1].separator == "\n\n"
    if whole_paragraph and sum(p.tokens for p in pieces[:opening_end + 1]) <= max_tokens // 16:
        opening_end += 1
    opening, body = pieces[:opening_end], pieces[opening_end:]
    before = [0]  # before[i]: the tokens of body[:i]
    for p in body:
        before.append(before[-1] + p.tokens)
    count = min(len(body), math.ceil(before[-1] / max_tokens))
    if count == 1:  # the body fits, the opening with it a little over: the corpus as it is
        return [whole]
    share = before[-1] / count
    starts = [0]  # the body piece each part starts at
    for j in range(1, count):
        candidates = range(starts[-1] + 1, len(body) - (count - j) + 1)
        target = j * share
        for kind in CUT_KINDS:
            near = [i for i in candidates if body[i].cut <= kind and abs(before[i] - target) <= share / 4]
            if near:
                break
        else:  # pieces too long for any cut near the share (only with very few of them): the nearest cut
            near = list(candidates)
        starts.append(min(near, key=lambda i: abs(before[i] - target)))
    ends = [*starts[1:], len(body)]
    return [_joined([*opening, *body[start:end]]) for start, end in zip(starts, ends)]


def train_parts(
    model: Any,
    texts: str | Sequence[str],
    config: TrainConfig | None = None,
    max_part_tokens: int | None = None,
    progress: bool = True,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    resume: bool = False,
    on_trained: Callable[[int, int, Cartridge], object] | None = None,
) -> list[Cartridge]:
    """A cartridge per part of the corpus (`corpus_parts`, parts of about `max_part_tokens`:
    by default `default_part_tokens(model)`), each trained by `train` with `config` decided for
    its own part; a corpus that fits in one part gets one cartridge, as `train` makes it. Save
    them as one file with `save_cartridges` and chat with them together: the part `PartSearch`
    finds for each question, or all of them composed by mixture. `progress` shows which part
    trains, its bar, and after each part the time the others will take. With `checkpoint`, part
    j of k keeps its training state at CHECKPOINT.partJofK (and `resume` continues each part
    from its own). `on_trained(j, k, cartridge)` is called as soon as part j of k is trained."""
    from .training import train

    texts_of_parts = corpus_parts(model.tokenizer, texts, max_part_tokens or default_part_tokens(model))
    count = len(texts_of_parts)
    sizes = [len(model.tokenizer.encode(text)) for text in texts_of_parts]
    cartridges = []
    started = time.monotonic()
    for j, text in enumerate(texts_of_parts, 1):
        if progress and count > 1:
            print(f"part {j} of {count}: {sizes[j - 1]:,} tokens", file=sys.stderr)
        part_checkpoint = checkpoint if checkpoint is None or count == 1 else f"{checkpoint}.part{j}of{count}"
        cartridges.append(train(model, text, config, progress, checkpoint=part_checkpoint, resume=resume))
        if count > 1:
            record_cut(cartridges[-1], max_part_tokens or default_part_tokens(model))
        if on_trained is not None:
            on_trained(j, count, cartridges[-1])
        if progress and j < count:
            print(f"part {j} of {count} done; {remaining_estimate(time.monotonic() - started, sizes, j)}",
                  file=sys.stderr)
    return cartridges


class UnrecordedCut(ValueError):
    """Parts that do not record the size their corpus was cut by: nothing to search them with."""


def record_cut(part: Cartridge, part_tokens: int) -> None:
    """Keep in a part's config the size its corpus was cut by, so that the part can be found again
    wherever the corpus is at hand (`part_search_for`); the digest of its text, which tells other
    texts from it, is kept by training (`corpus_sha256`)."""
    part.config = {**part.config, "part_tokens": part_tokens}


def recorded_digest(cartridge: Cartridge) -> str | None:
    """The digest of the text `cartridge` (or a part) was trained on, where it records one:
    `corpus_sha256`, or `part_sha256` in parts that kept it under that name."""
    return cartridge.config.get("corpus_sha256") or cartridge.config.get("part_sha256")


def check_trained_on(cartridge: Cartridge, texts: str | Sequence[str], which: str = "the cartridge") -> None:
    """ValueError where `cartridge` records the digest of its text and `texts` (joined as training
    joins them) are another text; nothing to check where it records none."""
    from .selfstudy.chunking import corpus_digest

    recorded = recorded_digest(cartridge)
    if recorded is not None and recorded != corpus_digest(texts):
        raise ValueError(f"{which} was trained on another text than the files given: give the files it was "
                         "trained on, in the same order")


def recorded_cut(parts: Sequence[Cartridge]) -> int | None:
    """The part size every one of `parts` records (`record_cut`), or None where they do not agree on one."""
    sizes = {part.config.get("part_tokens") for part in parts}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) else None


def texts_of_recorded_parts(tokenizer: Any, texts: str | Sequence[str], parts: Sequence[Cartridge]) -> list[str]:
    """`texts` (the files the cartridge in `parts` was trained on, in order, joined as training
    joins them: `cartridges.selfstudy.named_texts` for several) cut again at the size the parts
    recorded: each part's own text. ValueError, saying why, for texts that do not cut into as
    many parts or whose part differs from the one a part was trained on (where the part records
    its text's digest: parts trained before it was kept do not), and its UnrecordedCut for parts
    that recorded no size (trained before it was kept, or not by `train_parts` or a datablock)."""
    part_tokens = recorded_cut(parts)
    if part_tokens is None:
        raise UnrecordedCut("these cartridges do not record how their corpus was cut into parts (parts "
                            "trained before it was kept): they answer by mixture, without a search")
    texts_of_parts = corpus_parts(tokenizer, texts, part_tokens)
    if len(texts_of_parts) != len(parts):
        raise ValueError(f"the texts given cut into {len(texts_of_parts)} parts of about {part_tokens:,} tokens, "
                         f"not the cartridge's {len(parts)}: give the files it was trained on, in the same order")
    for j, (text, part) in enumerate(zip(texts_of_parts, parts), 1):
        check_trained_on(part, text, f"part {j} of {len(parts)}")
    return texts_of_parts


def part_search_for(tokenizer: Any, texts: str | Sequence[str], parts: Sequence[Cartridge]) -> PartSearch:
    """The search over the parts of `texts` (the files the cartridge in `parts` was trained on,
    in order), each part's text as `texts_of_recorded_parts` cuts it again, with its errors. One
    cartridge is searched as a part of its own: the whole corpus, found for any question that
    shares a word with it."""
    if len(parts) == 1:
        check_trained_on(parts[0], texts)
        return PartSearch(tokenizer, ["\n\n".join([texts] if isinstance(texts, str) else texts)])
    return PartSearch(tokenizer, texts_of_recorded_parts(tokenizer, texts, parts))


def search_of_cut(tokenizer: Any, texts: str | Sequence[str], part_tokens: int, parts: int) -> PartSearch | None:
    """The search over `texts` cut into parts of about `part_tokens` tokens, or None where they
    do not cut into `parts` parts (other texts than the parts were trained on)."""
    texts_of_parts = corpus_parts(tokenizer, texts, part_tokens)
    return PartSearch(tokenizer, texts_of_parts) if len(texts_of_parts) == parts else None


def default_part_tokens(model: Any) -> int:
    """The most tokens of a part unless told: two of the model's contexts (16,384 tokens for the
    default model)."""
    return DEFAULT_PART_CONTEXTS * _context_tokens(model)


def in_parts_by_default(model: Any, corpus_tokens: int) -> bool:
    """Whether the CLI and the server train a corpus of `corpus_tokens` in parts when not told:
    past four of the model's contexts (32,768 tokens for the default model)."""
    return corpus_tokens > PARTS_PAST_CONTEXTS * _context_tokens(model)


def _context_tokens(model: Any) -> int:
    from .cartridge import native_model

    return native_model(model).config.max_position_embeddings


def remaining_estimate(elapsed_s: float, sizes: Sequence[int], done: int) -> str:
    """The time the parts after the first `done` will take, at the pace of those (training time
    grows about linearly with a part's tokens): "about 31 minutes for the other 2 parts"."""
    left = sum(sizes[done:]) * elapsed_s / max(sum(sizes[:done]), 1)
    others = len(sizes) - done
    amount = f"{left / 60:.0f} minutes" if left >= 90 else f"{left:.0f} seconds"
    return f"about {amount} for the last part" if others == 1 else f"about {amount} for the other {others} parts"


# A part whose best chunk scores at least this share of the best chunk's is found too: at 1.0,
# only a tie (a passage that two parts share). Within 10% (0.9) the questions BM25 sends to another part than their own
# mostly find theirs too (98-100% against 94-99%, 1.04-1.09 parts a question), but the answers
# gained nothing on the held-out corpus (docs/experiments.md, "Does choosing a cartridge's part
# by BM25 keep the mixture's quality?").
NEAR_TIE = 1.0


class PartSearch:
    """Which part of a corpus a question is about, by BM25 over the parts' own text (the chunks
    and the ranking of `cartridges.retrieval`): the part of the best chunk, and any other part
    whose best chunk scores at least `near_tie` times as much. On the suite's documents past
    four contexts the part of the best chunk holds the question's section for 94-99% of the
    questions, in parts of one or two contexts. Choosing the part from the question alone lets a
    chat read its prompt behind that part, where a mixture or a route reads it once per part."""

    def __init__(self, tokenizer: Any, texts_of_parts: Sequence[str], near_tie: float = NEAR_TIE) -> None:
        from .retrieval import Retriever

        self.parts = len(texts_of_parts)
        self.near_tie = near_tie
        self._retriever = Retriever.from_texts(tokenizer, texts_of_parts)

    def find_many(self, questions: Sequence[str]) -> list[list[int]]:
        """Per question, the indexes of its candidate parts, the best first; none where no chunk
        shares a word with it (a question of stop words alone)."""
        found = []
        for hits in self._retriever.hits_many(questions, len(self._retriever.chunks)):
            best: dict[int, float] = {}
            for hit in hits:
                best.setdefault(hit.source, hit.score)
            found.append([j for j, score in best.items() if score >= self.near_tie * hits[0].score])
        return found

    def find(self, question: str) -> list[int]:
        return self.find_many([question])[0]
