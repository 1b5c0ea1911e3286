"""Self-study synthesis: "A" writes a user message about a chunk, "B" answers it with the
window around the chunk in context (the whole corpus when it fits); B's top-k
log-probabilities per answer token are the teacher's targets.

Conversations of one batch share their chunk and window (`chunking.plan_views`): the system
prompt holding the chunk is run once per batch into a KV prefix that A's rows reuse, and the
one holding the window once per window, for every batch that reads it. Both run on the
model's serving engine as background requests (interactive chat goes first); B's top-k
log-probabilities come with its tokens.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import cartridges_core

from ..cartridge import native_model
from ..heap import release_free_memory
from ..models.tokenizer import common_prefix_len
from ..retrieval import Retriever, passages_prompt
from .chunking import PARTS, BatchView, Corpus, Span, part_view, partner_chunk, plan_views
from .config import TrainConfig
from .precision import resolved_training_dtype
from .prompts import (JOINED, JOINED_TEMPLATES, SEED_PROMPTS, SYSTEM_PROMPT, VERIFY, VERIFY_ANSWERS, WRITTEN_HERE,
                      draw_seed_prompts, joined_message, swap_candidates, written_message)

# What stands between the two chunks a joined conversation's teacher reads.
JOINED_SEPARATOR = "\n\n[...]\n\n"

# Template tokens around the chunk and the messages, beyond what the config's limits count.
_TEMPLATE_MARGIN = 32


@dataclass
class Conversation:
    kind: str  # seed prompt kind
    chunk: str  # the corpus chunk A had in context (one string shared by its batch)
    question: str  # A's message (or the recall message), the user turn
    answer: list[int]  # B's tokens, its stop token included when it stopped, cut where it loops
    topk_ids: torch.Tensor  # [len(answer), K] int64: the teacher's most likely tokens per answer token
    topk_logprobs: torch.Tensor  # [len(answer), K] float32: their log-probabilities
    window: str = ""  # the corpus window B had in context (it holds the chunk)
    chunk_span: tuple[int, int] = (0, 0)  # the chunk's [start, end) in corpus tokens
    partner_span: tuple[int, int] = (0, 0)  # a joined conversation's second chunk; (0, 0): none


def slice_prefix(prefix: cartridges_core.KVPrefix, n: int) -> cartridges_core.KVPrefix:
    """The KV of the first n tokens (a causal prefix of a prefix is the prefix of the prefix)."""
    if n == prefix.num_tokens:
        return prefix
    return cartridges_core.KVPrefix([k[:, :n] for k in prefix.keys], [v[:, :n] for v in prefix.values])


def _pad(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(r) for r in rows]
    tokens = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, lengths


# Answer tokens scored through the vocabulary at once. On the CPU a block's float32
# log-softmax (128 x 49,152 words: 25 MB for the default model) stays about as large as one
# recall answer's, which measured no slower than larger blocks; a GPU takes larger ones, since
# each block costs it kernel launches and a copy back.
SCORE_BLOCK_TOKENS = {"cpu": 128, "gpu": 2048}

# Teacher windows' KV kept between batches (a 1,024-token window of the default model: ~50 MB).
WINDOW_CACHE_BYTES = 256 << 20


class Synthesizer:
    def __init__(self, model, config: TrainConfig) -> None:
        self.model = model
        self.native = native_model(model)
        self.engine = model.engine
        self.tok = model.tokenizer
        self.config = config
        self.stop = list(self.tok.eos_token_ids)
        context = self.native.config.max_position_embeddings
        # B's prompt holds the window and A's message, then B answers: the window gets the rest
        # (and the chunk, which B sees too, no more).
        overhead = len(self.prompt("", "x")) + _TEMPLATE_MARGIN
        budget = context - overhead - config.max_question_tokens - config.max_answer_tokens
        if budget < 1:
            raise ValueError(
                f"the model's context ({context}) leaves no room for a chunk with "
                f"max_question_tokens={config.max_question_tokens} and max_answer_tokens={config.max_answer_tokens}"
            )
        self.budget = budget
        self.chunk_tokens = min(config.chunk_tokens, budget)
        self.window_tokens = min(max(config.teacher_tokens, self.chunk_tokens), budget)
        if config.teacher_tokens == 0:
            self.window_tokens = self.chunk_tokens
        # Windows' text and KV, most recently used last: a round of batches visits every window,
        # so a short corpus's windows are all kept and computed once for the whole run.
        self._windows: OrderedDict[Span, tuple[str, cartridges_core.KVPrefix, int]] = OrderedDict()
        # When the cartridge trains in bfloat16, the teacher's attention behind its window runs in
        # bfloat16 too: on a CPU with AVX-512 BF16 the core's own kernels do it 3-6x faster than
        # float32 (docs/experiments.md, "Can an own bfloat16 kernel make the attention over a
        # prefix cheaper?"); elsewhere the flag changes nothing.
        self._swaps_of, self._swaps = None, []  # the corpus whose swap candidates are kept (verify_style="correct")
        self.bfloat16_attention = resolved_training_dtype(self.native, config.training_dtype) == "bfloat16"

    def prompt(self, document: str, user: str) -> list[int]:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(chunk=document)},
            {"role": "user", "content": user},
        ]
        return list(self.tok.encode_chat(messages, add_generation_prompt=True))

    def plan(self, corpus: Corpus, num_batches: int) -> list[BatchView]:
        """The views of the training batches, in order (deterministic in the seed)."""
        rng = random.Random(f"selfstudy-plan:{self.config.seed}")
        return plan_views(len(corpus), num_batches, self.chunk_tokens, self.window_tokens, rng)

    def part_view(self, corpus: Corpus, part: int, parts: int, rng: random.Random) -> BatchView:
        return part_view(len(corpus), part, parts, self.chunk_tokens, self.window_tokens, rng)

    def _system_kv(self, document: str) -> tuple[cartridges_core.KVPrefix, int]:
        """The KV of the prompt part that holds `document` (the same for every user message)."""
        probes = [self.prompt(document, "A"), self.prompt(document, "B")]
        shared = common_prefix_len(probes)
        return self.native.prefix_from_tokens(torch.tensor(probes[0][:shared], dtype=torch.long)), shared

    def window_kv(self, corpus: Corpus, window: Span) -> tuple[str, cartridges_core.KVPrefix, int]:
        """The window's text and KV, kept while they fit WINDOW_CACHE_BYTES (least recently
        used dropped first; the window in use always kept)."""
        if window in self._windows:
            self._windows.move_to_end(window)
            return self._windows[window]
        text = self.tok.decode(corpus.tokens[window.start : window.end])
        self._windows[window] = (text, *self._system_kv(text))
        while len(self._windows) > 1 and sum(kv.nbytes for _, kv, _ in self._windows.values()) > WINDOW_CACHE_BYTES:
            self._windows.popitem(last=False)
        return self._windows[window]

    @staticmethod
    def _shared(prompts, prefix) -> tuple[int, list]:
        """How many leading tokens of `prompts` come from `prefix` = (KV of tokens every prompt
        starts with, how many it covers), and the prefix list that holds them."""
        kv, available = prefix
        shared = min(common_prefix_len(prompts), available, min(len(p) for p in prompts) - 1)
        return shared, [slice_prefix(kv, shared)] if shared > 0 else []

    def _generate(self, prompts, prefix, seeds: list[int], sampling: dict, logprobs: int = 0) -> list:
        """Generate on the model's engine (as background work), the shared part of the prompts
        taken from `prefix`. One batch at a time: the engine's results depend (in the last bits)
        on which rows share a step, so overlapping batches would make synthesis depend on thread
        timing, and the same seed would no longer give the same cartridge."""
        shared, prefixes = self._shared(prompts, prefix)
        streams = self.engine.submit_many(
            [p[shared:] for p in prompts], prefixes=[prefixes] * len(prompts), seeds=seeds,
            stop_token_ids=self.stop, logprobs=logprobs, priority="background", **sampling,
        )
        try:
            return [s.result() for s in streams]
        finally:
            for stream in streams:
                stream.close()

    def _score(self, prompts, answers, prefix) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The teacher's top-k at each token of given answers (a forward per group of rows of
        similar length, the shared part of the prompts taken from `prefix`, as in `_generate`)."""
        shared, prefixes = self._shared(prompts, prefix)
        rows = [(p + a)[shared:] for p, a in zip(prompts, answers)]
        out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(rows)  # type: ignore[list-item]
        overhead = cartridges_core.length_group_overhead(self.native.device)
        with torch.no_grad():
            # Rows of similar length together (on the CPU): cloze rows have a few answer tokens, recall rows 128.
            for group in cartridges_core.length_groups([len(r) for r in rows], overhead):
                tokens, lengths = _pad([rows[i] for i in group])
                hidden = self.native.forward_hidden(tokens, num_new=lengths, prefixes=[prefixes] * len(group),
                                                    bfloat16_attention=self.bfloat16_attention)
                # The answers' positions of every row, through the vocabulary a block at a time
                # (one call per block, not per row).
                spans = [(len(prompts[i]) - shared - 1, len(answers[i])) for i in group]  # predicts the answer
                picked = torch.cat([hidden[row, start : start + n] for row, (start, n) in enumerate(spans)])
                ids, values = [], []
                block_tokens = SCORE_BLOCK_TOKENS["cpu" if picked.device.type == "cpu" else "gpu"]
                for block in picked.split(block_tokens):
                    v, k = torch.log_softmax(self.native.logits(block).float(), -1).topk(self.config.top_k, -1)
                    ids.append(k)
                    values.append(v)
                ids_all, values_all = torch.cat(ids).cpu(), torch.cat(values).cpu()
                offset = 0
                for i, (_, n) in zip(group, spans):
                    out[i] = (ids_all[offset : offset + n].contiguous(), values_all[offset : offset + n].contiguous())
                    offset += n
        return out

    def batch(self, corpus: Corpus, view: BatchView, rng: random.Random, n: int) -> list[Conversation]:
        """`n` conversations. Written ones (recall, cloze, verify, topic, fact) take their message and answer from the
        view's chunk, and B scores the answer; for the others A writes a message about the chunk
        and B answers it, both with the view's window in context, its answer cut where it loops.
        Joined ones (config.joined_fraction) quote the chunk and a distant one, and B scores
        their answer with both chunks in context."""
        cfg = self.config
        chunk_text = self.tok.decode(corpus.tokens[view.chunk.start : view.chunk.end])
        seeds = draw_seed_prompts(rng, n, cfg.written_fraction, cfg.verify_fraction, cfg.cloze_fraction,
                                  cfg.topic_fraction, cfg.fact_fraction)
        a_seeds = [rng.getrandbits(31) for _ in range(n)]
        questions, written = [""] * n, {}  # written: row -> its answer, from the chunk
        labelled = set()  # verify rows that train toward their written answer (verify_targets="label")
        correcting = cfg.verify_style == "correct"
        joined = self._joined_rows(corpus, view, rng, n)  # rows that join the chunk with a distant one
        for i, (kind, text) in enumerate(seeds):
            if i in joined.rows:
                continue
            if kind in WRITTEN_HERE:
                questions[i], answer = written_message(kind, text, chunk_text, rng, correction=correcting,
                                                       swap_pool=self._swap_pool(corpus) if correcting else None)
                written[i] = self.tok.encode(answer)[: cfg.max_answer_tokens]
                word = answer.split(". ", 1)[0] if correcting else answer  # "No. The document says: ..."
                if kind == VERIFY and word in VERIFY_ANSWERS and cfg.verify_targets == "label":
                    labelled.add(i)  # (a chunk without whole sentences gives a recall message instead)
                if not written[i]:  # a chunk too short to quote from: A asks a question instead
                    del written[i]
                    seeds[i] = ("question", SEED_PROMPTS["question"][0])
        b_seeds = [rng.getrandbits(31) for _ in range(n)]
        asked = [i for i in range(n) if i not in written and i not in joined.rows]
        window_text, window_kv, window_shared = self.window_kv(corpus, view.window)
        answers: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        if asked:
            # The chunk's KV, once for the batch (the window's when A and B read the same).
            chunk_kv = (window_kv, window_shared) if view.chunk == view.window else self._system_kv(chunk_text)
            a_params = dict(temperature=cfg.question_temperature, max_new_tokens=cfg.max_question_tokens)
            a_results = self._generate([self.prompt(chunk_text, seeds[i][1]) for i in asked], chunk_kv,
                                       [a_seeds[i] for i in asked], a_params)
            for i, result in zip(asked, a_results):
                text = self.tok.decode([t for t in result.tokens if t not in self.stop]).strip()
                questions[i] = text or seeds[i][1]
            # The teacher's top-k come with B's answer, taken while generating (no second pass).
            b_params = dict(temperature=cfg.answer_temperature, max_new_tokens=cfg.max_answer_tokens)
            b_results = self._generate([self.prompt(window_text, questions[i]) for i in asked],
                                       (window_kv, window_shared), [b_seeds[i] for i in asked], b_params,
                                       logprobs=cfg.top_k)
            for i, r in zip(asked, b_results):
                answer = list(r.tokens)
                keep = len(answer) if answer and answer[-1] in self.stop else loop_start(answer)
                ids, lp = _topk_tensors(r.logprobs)
                answers[i] = (answer[:keep], ids[:keep], lp[:keep])
        for i in joined.rows:
            seeds[i], questions[i] = (JOINED, joined.templates[i]), joined.questions[i]
        if joined.rows:  # scored with both chunks in context
            scored = self._score([self.prompt(joined.document, questions[i]) for i in joined.rows],
                                 [joined.answers[i] for i in joined.rows], self._system_kv(joined.document))
            for i, (ids, lp) in zip(joined.rows, scored):
                answers[i] = (joined.answers[i], ids, lp)
        if written:
            rows = list(written)
            scored = self._score([self.prompt(window_text, questions[i]) for i in rows], [written[i] for i in rows],
                                 (window_kv, window_shared))
            for i, (ids, lp) in zip(rows, scored):
                answers[i] = (written[i], *label_targets(written[i], ids)) if i in labelled else (written[i], ids, lp)
        span = (view.chunk.start, view.chunk.end)
        out = [Conversation(seeds[i][0], chunk_text, questions[i], *answers[i], window_text, span) for i in range(n)]
        for i in joined.rows:
            out[i].chunk = out[i].window = joined.document
            out[i].partner_span = joined.partner
        return out

    def _swap_pool(self, corpus: Corpus) -> list[str]:
        """The corpus' numbers and names a "correct" verify statement swaps in, found once per corpus."""
        if self._swaps_of is not corpus:
            self._swaps_of, self._swaps = corpus, swap_candidates(self.tok.decode(corpus.tokens))
        return self._swaps

    def _joined_rows(self, corpus: Corpus, view: BatchView, rng: random.Random, n: int) -> _Joined:
        """Which of the batch's `n` rows are joined conversations (config.joined_fraction), the
        distant chunk they all join the batch's chunk with, and their messages and answers.
        Draws nothing from `rng` when joined_fraction is 0, so that the other conversations
        are those of a config without it."""
        cfg, none = self.config, _Joined([], "", (0, 0), {}, {}, {})
        if cfg.joined_fraction <= 0:
            return none
        rows = [i for i in range(n) if rng.random() < cfg.joined_fraction]
        partner = partner_chunk(len(corpus), view.chunk, rng) if rows else None
        if partner is None or 2 * len(view.chunk) + 16 > self.budget:  # too short a corpus, or no room for both
            return none
        first, second = sorted((view.chunk, partner), key=lambda s: s.start)
        texts = [self.tok.decode(corpus.tokens[s.start : s.end]) for s in (first, second)]
        joined = _Joined(rows, JOINED_SEPARATOR.join(texts), (partner.start, partner.end), {}, {}, {})
        half = cfg.max_answer_tokens // 2
        for i in rows:
            joined.templates[i] = rng.choice(JOINED_TEMPLATES)
            joined.questions[i], first_rest, second_rest = joined_message(joined.templates[i], *texts, rng)
            # Each passage gets half the answer's length; the two are separated as in the document.
            parts = [self.tok.decode(self.tok.encode(rest)[:half]) for rest in (first_rest, second_rest)]
            joined.answers[i] = self.tok.encode("\n\n".join(parts))[: cfg.max_answer_tokens]
        joined.rows = [i for i in rows if joined.answers[i]]  # chunks too short to quote from: as usual
        return joined


@dataclass
class _Joined:
    rows: list[int]
    document: str  # what the teacher reads: both chunks, in corpus order
    partner: tuple[int, int]  # the distant chunk's span
    templates: dict[int, str]
    questions: dict[int, str]
    answers: dict[int, list[int]]


def signal_by_part(conversations: Sequence[Conversation], corpus_tokens: int, parts: int = 10) -> list[float]:
    """The share of the conversations' answer tokens (the training signal) that comes from each
    of `parts` equal parts of the corpus, in order: a conversation's tokens are shared out over
    the parts its chunk overlaps, by overlap (a joined conversation's, half to each of its two
    chunks). Even coverage gives 1 / parts each."""
    weights = [0.0] * parts
    for c in conversations:
        spans = [s for s in (c.chunk_span, c.partner_span) if s[1] > s[0]]
        for start, end in spans:
            for p in range(parts):
                lo, hi = corpus_tokens * p / parts, corpus_tokens * (p + 1) / parts
                overlap = min(end, hi) - max(start, lo)
                if overlap > 0:
                    weights[p] += len(c.answer) / len(spans) * overlap / (end - start)
    total = sum(weights)
    return [w / total for w in weights] if total else weights


def loop_start(tokens: Sequence[int], max_period: int = 32, min_run: int = 12) -> int:
    """Where an answer that ends in a loop starts repeating itself (the end of the loop's first
    turn), or len(tokens) when it does not: the longest periodic tail, of period at most
    `max_period`, repeating for at least `min_run` tokens and two whole periods."""
    n = len(tokens)
    best = n
    for period in range(1, max_period + 1):
        i = n
        while i - 1 - period >= 0 and tokens[i - 1] == tokens[i - 1 - period]:
            i -= 1
        if n - i >= max(min_run, 2 * period):
            best = min(best, i)
    return best


# The log-probability a label target gives the top-k's other tokens: its exp is 0, and being
# finite it keeps p * log p at 0 (the teacher floor of quality.py) where -inf would make NaN.
LABEL_FLOOR = -1e4


def label_targets(answer: Sequence[int], teacher_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k targets with all the mass on the answer's own tokens: at each position the answer
    token first at log-probability 0, then the teacher's other top tokens at LABEL_FLOOR (the
    shape stays [len(answer), K])."""
    k = teacher_ids.shape[1]
    ids = [[token] + [t for t in row if t != token][: k - 1] for token, row in zip(answer, teacher_ids.tolist())]
    values = torch.full((len(answer), k), LABEL_FLOOR, dtype=torch.float32)
    values[:, 0] = 0.0
    return torch.tensor(ids, dtype=torch.long), values


def _topk_tensors(logprobs) -> tuple[torch.Tensor, torch.Tensor]:
    """[len, K] ids (int64) and log-probabilities (float32) of the teacher's top-k per token."""
    ids = torch.tensor([[t for t, _ in lp.top] for lp in logprobs], dtype=torch.long)
    values = torch.tensor([[v for _, v in lp.top] for lp in logprobs], dtype=torch.float32)
    return ids.contiguous(), values.contiguous()


def batch_rng(seed: int, batch: int) -> random.Random:
    """The random stream of one batch: derived from (seed, batch index) alone, so that a run
    resumed after some batches draws exactly what an uninterrupted run would."""
    return random.Random(f"selfstudy:{seed}:{batch}")


def held_out_rng(seed: int, batch: int) -> random.Random:
    """The random stream of one batch of held-out conversations: separate from the training
    batches' streams, so that asking for held-out conversations changes no training one."""
    return random.Random(f"selfstudy-held-out:{seed}:{batch}")


def synthesize(
    model,
    corpus: Corpus,
    config: TrainConfig,
    on_progress: Callable[[int, int], object] | None = None,
    *,
    done: Sequence[Conversation] = (),
    on_batch: Callable[[list[Conversation]], object] | None = None,
    held_out: int = 0,
) -> list[Conversation]:
    """`config.num_samples` conversations (scaled to the corpus when None) about chunks that
    cover `corpus` evenly, deterministic in `config.seed`, followed by `held_out` more about
    random chunks in each tenth of the corpus alike (`part_view`), drawn from their own random
    stream (`held_out_rng`): the first
    `num_samples` are the same whatever `held_out` is. `on_progress(done, total)` is called
    after each batch, total counting both.

    Resuming: `done` holds the conversations of the batches already made (as `on_batch` last
    saw them); synthesis continues with the next batch. `on_batch(conversations so far)` runs
    after each batch: the place to checkpoint, or to stop by raising."""
    config = config.for_corpus(len(corpus))
    synth = Synthesizer(model, config)
    bs = config.synthesis_batch_size
    # Every batch's random stream and view, training batches then held-out ones.
    plan = synth.plan(corpus, math.ceil(config.num_samples / bs))
    specs = [(view, batch_rng(config.seed, b), min(bs, config.num_samples - b * bs)) for b, view in enumerate(plan)]
    # Held-out conversations spread over the corpus' tenths alike (conversation i in tenth
    # i * PARTS // held_out), in batches of at most bs per tenth.
    per_part = [sum(i * PARTS // held_out == part for i in range(held_out)) for part in range(PARTS)]
    for part, in_part in enumerate(per_part):
        for start in range(0, in_part, bs):
            rng = held_out_rng(config.seed, len(specs) - len(plan))
            specs.append((synth.part_view(corpus, part, PARTS, rng), rng, min(bs, in_part - start)))
    out: list[Conversation] = list(done)
    total = config.num_samples + held_out
    # Resuming: skip the batches done (a checkpoint holds whole batches).
    first, made = 0, 0
    while first < len(specs) and made + specs[first][2] <= len(out):
        made += specs[first][2]
        first += 1
    for view, rng, n in specs[first:]:
        out.extend(synth.batch(corpus, view, rng, n))
        release_free_memory()  # else the process grows by the batch's freed scoring buffers
        if on_progress is not None:
            on_progress(len(out), total)
        if on_batch is not None:  # after on_progress, so that a cancel asked there stops here
            on_batch(out)
    return out


# Passages a student reads beside the cartridge in a `passages_fraction` conversation: two, not
# the chat's four (retrieval.TOP_K), since training costs grow with a conversation's tokens and
# two ~300-token passages already make one about four times as long.
TRAIN_PASSAGES = 2


def student_tokens(tokenizer, question: str, passages: Sequence[str] = ()) -> list[int]:
    """What the student sees before the answer: the user turn, no chunk; with `passages`, the
    system prompt that holds them first, as the chat's `retrieval` option puts them."""
    messages = [{"role": "user", "content": question}]
    if passages:
        messages.insert(0, {"role": "system", "content": passages_prompt(passages)})
    return list(tokenizer.encode_chat(messages, add_generation_prompt=True))


def student_passages(tokenizer, corpus: Corpus, conversations: Sequence[Conversation],
                     config: TrainConfig) -> list[list[str]]:
    """Per conversation, the passages its student reads: for `config.passages_fraction` of them
    (drawn from their own random stream, so that the conversations do not change), the corpus'
    best `TRAIN_PASSAGES` for the message by BM25, as the chat retrieves them (each file chunked
    on its own, so that no passage runs from one file into the next); [] for the rest."""
    out: list[list[str]] = [[] for _ in conversations]
    if config.passages_fraction <= 0 or not conversations:
        return out
    rng = random.Random(f"selfstudy-passages:{config.seed}")
    chosen = [i for i in range(len(conversations)) if rng.random() < config.passages_fraction]
    if chosen:
        index = Retriever.from_texts(tokenizer, list(corpus.texts) or [tokenizer.decode(corpus.tokens)])
        for i, passages in zip(chosen, index.search_many([conversations[i].question for i in chosen],
                                                         TRAIN_PASSAGES)):
            out[i] = passages
    return out


def fitting(model, conversations: Sequence[Conversation], prefix_tokens: int) -> list[Conversation]:
    """The conversations whose question leaves room for an answer token next to the prefix in
    the context: those training_data keeps, in order, when given no passages."""
    context = native_model(model).config.max_position_embeddings
    return [c for c in conversations
            if context - prefix_tokens - len(student_tokens(model.tokenizer, c.question)) >= 1]


def training_data(model, conversations: Sequence[Conversation], prefix_tokens: int,
                  passages: Sequence[Sequence[str]] | None = None) -> cartridges_core.TrainingData:
    """Conversations as the student sees them (no chunk; `passages[i]` in the prompt of
    conversation i where given), right-padded, with the teacher's top-k at each answer token.
    Answers are cut so that prefix + conversation fit the context; a conversation whose prompt
    alone leaves no room is left out (as `fitting` finds, without passages)."""
    context = native_model(model).config.max_position_embeddings
    passages = passages or [()] * len(conversations)
    rows, targets_ids, targets_lp, spans = [], [], [], []
    for c, p in zip(conversations, passages):
        prompt = student_tokens(model.tokenizer, c.question, p)
        room = context - prefix_tokens - len(prompt)
        if room < 1:
            continue
        n = min(len(c.answer), room)
        rows.append(prompt + c.answer[:n])
        spans.append((len(prompt) - 1, n))
        targets_ids.append(c.topk_ids[:n])
        targets_lp.append(c.topk_logprobs[:n])
    if not rows:
        raise ValueError("no conversation fits the model's context next to the cartridge")
    tokens, lengths = _pad(rows)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for i, (start, n) in enumerate(spans):
        mask[i, start : start + n] = True
    return cartridges_core.TrainingData(
        tokens, torch.tensor(lengths, dtype=torch.long), mask, torch.cat(targets_ids), torch.cat(targets_lp)
    )


def next_token_data(corpus: Corpus, config: TrainConfig, context: int) -> cartridges_core.TrainingData:
    """The ablation: random windows of the corpus, every next token a target (K = 1, p = 1)."""
    rng = random.Random(config.seed)
    length = min(config.max_question_tokens + config.max_answer_tokens, context - config.num_tokens, len(corpus))
    if length < 2:
        raise ValueError("the corpus or the context is too short for next-token training")
    rows = []
    for _ in range(config.num_samples):
        start = rng.randint(0, len(corpus) - length)
        rows.append(corpus.tokens[start : start + length])
    tokens = torch.tensor(rows, dtype=torch.long)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, :-1] = True
    ids = tokens[:, 1:].reshape(-1, 1).contiguous()
    return cartridges_core.TrainingData(
        tokens, torch.full((len(rows),), length, dtype=torch.long), mask, ids, torch.zeros(ids.shape, dtype=torch.float32)
    )
