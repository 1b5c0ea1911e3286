"""Composition: the neighbour, a built-in text that stands for another context in front of the
cartridge during training.

A trained cartridge composed with another one is in the company of keys that were trained to
be attended to. Trained alone, a cartridge also learns to draw the attention of questions that
are not about its document: put in front of another document's questions, our two-epoch
cartridges cost them more than a nat per answer token, and composed they took most of the other
cartridge's gain away (benchmarks/README.md). So a share of the training conversations is about
the neighbour instead: the teacher answers them with the neighbour in context, the student
with the neighbour's KV *and the cartridge* in front, and the cartridge learns to leave other
contexts' questions alone (the student matches the teacher exactly when the cartridge draws no
attention from them). The on-topic conversations that have the neighbour in front
(`companion_every`) teach the other half: to answer its own questions beside another context.

The neighbour's conversations depend on the model and the synthesis settings, never on the
corpus: they are made once per process and reused by every training that asks for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import cartridges_core

from ..cartridge import core_model
from .chunking import Corpus
from .config import TrainConfig
from .synthesize import Synthesizer, padded_data, synthesize

# Invented facts of several kinds (prose, figures, a procedure, people), about nothing a
# corpus is likely to hold.
NEIGHBOUR_TEXT = """\
The Harbour of Tesswick

Tesswick is a small harbour town on the northern shore of the Lantern Sea. It was founded in 1312
by salt traders from the inland city of Orvale, who needed a port that stayed free of ice in winter.
The town grew around a single stone quay, which is still in use and is known locally as the Long Step.

Ferries. Three ferries leave Tesswick every day. The Grey Heron sails to the island of Mullion at
7:15 and returns at 11:40; the crossing takes 95 minutes. The Marigold sails to Port Anse at 9:00
and 16:30. The night ferry, the Slow Tom, leaves at 22:10 for Carrow and arrives at 5:50. A single
adult ticket to Mullion costs 14 crowns; children under twelve travel for half price, and bicycles
cost 2 crowns extra.

The lighthouse. The Tesswick light stands 41 metres tall on Gull Point, two kilometres east of the
quay. It was built in 1871 by the engineer Hester Vane and was the first on the coast to use a
rotating lens. Its beam turns once every 12 seconds and can be seen 19 nautical miles away. The
last keeper, Arne Loddick, left in 1968, when the light was made automatic.

Fishing. In a good year the town's 23 boats land about 640 tonnes of fish, mostly herring and cod.
The herring season runs from late August to early November. Since 2004 the catch has been sold at
the covered market on Weir Street, which opens at 4:30 on weekdays.

How to moor at the Long Step. Call the harbour office on channel 12 at least twenty minutes before
arrival and give the name and length of the boat. Enter between the red and green buoys and keep to
a speed of no more than 4 knots. Moor on the inner side of the quay if the boat is shorter than 15
metres, on the outer side otherwise. Pay the mooring fee of 9 crowns per night at the office, which
is open from 8:00 to 18:00.

People. The harbour master, Ilse Brannock, has run the port since 2015; before that she
captained the Marigold for nine years. The town's best-known painter, Corwin Ashby, lived in the
yellow house beside the lighthouse and painted the Long Step more than two hundred times. His
brother Tobin Ashby founded the Tesswick rowing club in 1923; its annual race to Mullion and back,
held on the first Sunday of June, is won in a little under three hours.
"""


@dataclasses.dataclass
class Neighbour:
    """The neighbour's context as a KV prefix (the teacher's prompt up to its user turn) and its
    conversations as the student sees them (the rest of the teacher's prompt, then the answer;
    None when none were asked for)."""

    companion: cartridges_core.KVPrefix
    data: cartridges_core.TrainingData | None


def neighbour_samples(config: TrainConfig) -> int:
    """Conversations about the neighbour: `neighbour_fraction` of the training ones, in whole
    synthesis batches (none when the fraction is 0)."""
    assert config.num_samples is not None, "decide num_samples first (TrainConfig.for_corpus)"
    n = config.num_samples * config.neighbour_fraction
    if n == 0:
        return 0
    bs = config.synthesis_batch_size
    return max(1, round(n / bs)) * bs


# Fields that change training only: the neighbour's conversations do not depend on them.
_TRAINING_ONLY = ("lr", "epochs", "batch_size", "grad_accum", "cosine", "companion_every", "checkpoint_every",
                  "num_tokens", "num_frozen", "init", "neighbour_fraction", "num_samples", "quality_samples")


def make_neighbour(model: Any, config: TrainConfig, n: int, cartridge_tokens: int) -> Neighbour | None:
    """The neighbour's KV and `n` conversations about it, synthesized as a corpus's are (same
    settings and seed), cut to fit the context behind the neighbour and a cartridge of
    `cartridge_tokens`. None when the neighbour would leave a conversation less than half the
    context, or the teacher cannot read it whole. A `cartridges.Model` keeps them for the
    process: they do not depend on the corpus."""
    cache = model.__dict__.setdefault("_neighbours", {}) if hasattr(model, "__dict__") else {}
    key = (n, cartridge_tokens, tuple(sorted((k, repr(v)) for k, v in config.to_dict().items()
                                             if k not in _TRAINING_ONLY)))
    if key in cache:
        return cache[key]
    corpus = Corpus.from_texts(model.tokenizer, [NEIGHBOUR_TEXT])
    cfg = dataclasses.replace(config, num_samples=max(n, 1), quality_samples=0)
    context = core_model(model).config.max_position_embeddings
    try:
        synth = Synthesizer(model, cfg)
    except ValueError:  # the model's context holds no window at all
        return None
    if synth.window_tokens < len(corpus) or 2 * (len(corpus) + cartridge_tokens) > context:
        return None
    document = model.tokenizer.decode(corpus.tokens)
    companion, shared = synth.system_kv(document)
    data = None
    if n:
        conversations = synthesize(model, corpus, cfg)
        assert all(c.window == document for c in conversations), "the teacher read the whole neighbour"
        prompts = [synth.prompt(document, c.question)[shared:] for c in conversations]
        data = padded_data(prompts, conversations, context - shared - cartridge_tokens)
    cache[key] = Neighbour(companion, data)
    return cache[key]


def with_neighbour(data: cartridges_core.TrainingData, neighbour: Neighbour,
                   companion_every: int) -> cartridges_core.TrainingData:
    """`data` (a corpus's conversations) followed by the neighbour's, flagged to be trained with
    the neighbour in front: all of the neighbour's, and every companion_every-th of the corpus's
    (none when 0)."""
    flags = torch.zeros(data.tokens.shape[0], dtype=torch.bool)
    if companion_every:
        flags[::companion_every] = True
    other = neighbour.data
    if other is None:
        return cartridges_core.TrainingData(data.tokens, data.lengths, data.target_mask, data.topk_ids,
                                            data.topk_logprobs, flags)
    width = max(data.tokens.shape[1], other.tokens.shape[1])

    def widen(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    return cartridges_core.TrainingData(
        torch.cat([widen(data.tokens), widen(other.tokens)]),
        torch.cat([data.lengths, other.lengths]),
        torch.cat([widen(data.target_mask), widen(other.target_mask)]),
        torch.cat([data.topk_ids, other.topk_ids]),
        torch.cat([data.topk_logprobs, other.topk_logprobs]),
        torch.cat([flags, torch.ones(other.tokens.shape[0], dtype=torch.bool)]),
    )
