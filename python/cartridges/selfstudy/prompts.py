"""Seed prompts for "A", the model instance that writes user messages about a chunk, and the
system prompt both instances see. Five kinds, as in self-study; the wording is ours."""

from __future__ import annotations

import random

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

KINDS = tuple(SEED_PROMPTS)


def draw_seed_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`n` (kind, prompt) pairs: kinds drawn uniformly, then a prompt of that kind."""
    out = []
    for _ in range(n):
        kind = rng.choice(KINDS)
        out.append((kind, rng.choice(SEED_PROMPTS[kind])))
    return out


# For init="text": KV of text unrelated to any corpus.
UNRELATED_TEXT = (
    "The history of bread spans thousands of years. Early farmers ground wild grains between "
    "stones, mixed the flour with water and baked flat cakes on hot rocks. Leavened bread came "
    "later, when dough left in warm air began to rise. Bakers learned to keep a piece of old "
    "dough to start the next batch, and mills powered by water and wind made flour cheaper. "
    "Today bread is made in countless shapes, from long thin loaves to round dense ones, and "
    "each region keeps its own recipes, grains and habits of eating it. "
)
