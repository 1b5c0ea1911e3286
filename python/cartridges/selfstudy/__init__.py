"""Self-study: chunk the corpus, synthesize conversations about it, and turn them into
training data for a cartridge."""

from .chunking import Corpus
from .config import TrainConfig
from .prompts import KINDS, SEED_PROMPTS
from .synthesize import Conversation, Synthesizer, next_token_data, synthesize, training_data

__all__ = [
    "KINDS",
    "SEED_PROMPTS",
    "Conversation",
    "Corpus",
    "Synthesizer",
    "TrainConfig",
    "next_token_data",
    "synthesize",
    "training_data",
]
