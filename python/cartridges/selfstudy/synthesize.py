"""Self-study synthesis: "A" writes a user message about a chunk, "B" answers it with the
chunk in context; B's top-k log-probabilities per answer token are the teacher's targets.

Conversations of one batch share their chunk: the tokens their prompts have in common (the
system prompt holding the chunk) are run once into a KV prefix that every row reuses, for
A's generation and B's alike. Both run on the model's serving engine as background requests
(interactive chat goes first); B's top-k log-probabilities come with its tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import cartridges_core

from ..cartridge import core_model
from .chunking import Corpus
from .config import TrainConfig
from .prompts import SYSTEM_PROMPT, draw_seed_prompts

# Template tokens around the chunk and the messages, beyond what the config's limits count.
_TEMPLATE_MARGIN = 32


@dataclass
class Conversation:
    kind: str  # seed prompt kind
    chunk: str  # the corpus window both A and B had in context (one string shared by its batch)
    question: str  # A's message, the user turn
    answer: list[int]  # B's tokens, its stop token included when it stopped
    topk_ids: torch.Tensor  # [len(answer), K] int64: the teacher's most likely tokens per answer token
    topk_logprobs: torch.Tensor  # [len(answer), K] float32: their log-probabilities


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return n


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


class Synthesizer:
    def __init__(self, model, config: TrainConfig) -> None:
        self.model = model
        self.core = core_model(model)
        self.engine = model.engine
        self.tok = model.tokenizer
        self.config = config
        self.stop = list(self.tok.eos_token_ids)
        context = self.core.config.max_position_embeddings
        # B's prompt holds the chunk and A's message, then B answers: the chunk gets the rest.
        overhead = len(self.prompt("", "x")) + _TEMPLATE_MARGIN
        self.chunk_budget = context - overhead - config.max_question_tokens - config.max_answer_tokens
        if self.chunk_budget < 1:
            raise ValueError(
                f"the model's context ({context}) leaves no room for a chunk with "
                f"max_question_tokens={config.max_question_tokens} and max_answer_tokens={config.max_answer_tokens}"
            )

    def prompt(self, chunk_text: str, user: str) -> list[int]:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(chunk=chunk_text)},
            {"role": "user", "content": user},
        ]
        return list(self.tok.encode_chat(messages, add_generation_prompt=True))

    def _generate(self, prompts, prefix, seeds: list[int], sampling: dict, logprobs: int = 0):
        """Generate on the model's engine (as background work), with the longest shared part
        of the prompts taken from `prefix` (the KV of tokens every prompt starts with)."""
        kv, available = prefix
        shared = min(common_prefix_len(prompts), available, min(len(p) for p in prompts) - 1)
        prefixes = [slice_prefix(kv, shared)] if shared > 0 else []
        streams = self.engine.submit_many(
            [p[shared:] for p in prompts], prefixes=[prefixes] * len(prompts), seeds=seeds,
            stop_token_ids=self.stop, logprobs=logprobs, priority="background", **sampling,
        )
        try:
            return [s.result() for s in streams]
        finally:
            for stream in streams:
                stream.close()

    def batch(self, corpus: Corpus, rng: random.Random, n: int) -> list[Conversation]:
        cfg = self.config
        chunk = corpus.chunk(rng, min(cfg.chunk_min_tokens, self.chunk_budget), min(cfg.chunk_max_tokens, self.chunk_budget))
        chunk_text = self.tok.decode(chunk)
        seeds = draw_seed_prompts(rng, n)
        a_prompts = [self.prompt(chunk_text, text) for _, text in seeds]
        # The chunk's KV, computed once for the whole batch.
        shared = min(common_prefix_len(a_prompts), min(len(p) for p in a_prompts) - 1)
        kv = self.core.prefix_from_tokens(torch.tensor(a_prompts[0][:shared], dtype=torch.long))
        a_seeds = [rng.getrandbits(31) for _ in range(n)]
        a_params = dict(temperature=cfg.question_temperature, max_new_tokens=cfg.max_question_tokens)
        a_results = self._generate(a_prompts, (kv, shared), a_seeds, a_params)
        questions = []
        for (_, seed_text), result in zip(seeds, a_results):
            text = self.tok.decode([t for t in result.tokens if t not in self.stop]).strip()
            questions.append(text or seed_text)

        b_prompts = [self.prompt(chunk_text, q) for q in questions]
        b_seeds = [rng.getrandbits(31) for _ in range(n)]
        b_params = dict(temperature=cfg.answer_temperature, max_new_tokens=cfg.max_answer_tokens)
        # Check the B prompts really start with the tokens the chunk's KV was made from.
        b_shared = min(shared, common_prefix_len([*b_prompts, a_prompts[0][:shared]]))
        # The teacher's top-k come with B's answer: the log-probabilities of each answer token's
        # distribution, taken while generating (no second forward pass).
        b_results = self._generate(b_prompts, (kv, b_shared), b_seeds, b_params, logprobs=cfg.top_k)
        answers = [list(r.tokens) for r in b_results]
        topk = [_topk_tensors(r.logprobs) for r in b_results]
        return [
            Conversation(kind, chunk_text, q, a, ids, lp)
            for (kind, _), q, a, (ids, lp) in zip(seeds, questions, answers, topk)
        ]


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
    """`config.num_samples` conversations about random chunks of `corpus`, deterministic in
    `config.seed`, followed by `held_out` more drawn from their own random stream
    (`held_out_rng`): the first `num_samples` are the same whatever `held_out` is.
    `on_progress(done, total)` is called after each batch, total counting both.

    Resuming: `done` holds the conversations of the batches already made (as `on_batch` last
    saw them); synthesis continues with the next batch. `on_batch(conversations so far)` runs
    after each batch: the place to checkpoint, or to stop by raising."""
    synth = Synthesizer(model, config)
    out: list[Conversation] = list(done)
    total = config.num_samples + held_out
    bs = config.synthesis_batch_size
    while len(out) < total:
        if len(out) < config.num_samples:
            n = min(bs, config.num_samples - len(out))
            # Only the last training batch is short, so the count done gives the batch index.
            rng = batch_rng(config.seed, len(out) // bs)
        else:
            made = len(out) - config.num_samples
            n = min(bs, held_out - made)
            rng = held_out_rng(config.seed, made // bs)
        out.extend(synth.batch(corpus, rng, n))
        if on_progress is not None:
            on_progress(len(out), total)
        if on_batch is not None:  # after on_progress, so that a cancel asked there stops here
            on_batch(out)
    return out


def student_tokens(tokenizer, question: str) -> list[int]:
    """What the student sees before the answer: the user turn alone, no chunk."""
    return list(tokenizer.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True))


def training_data(model, conversations: Sequence[Conversation], prefix_tokens: int) -> cartridges_core.TrainingData:
    """Conversations as the student sees them (no chunk), right-padded, with the teacher's
    top-k at each answer token. Answers are cut so that prefix + conversation fit the context."""
    context = core_model(model).config.max_position_embeddings
    rows, targets_ids, targets_lp, spans = [], [], [], []
    for c in conversations:
        prompt = student_tokens(model.tokenizer, c.question)
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
