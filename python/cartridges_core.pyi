"""
C++ core of cartridges: Llama-family forward with KV cache and prefixes, the serving engine, cartridge training, the store.
"""
from __future__ import annotations
import collections.abc
import datetime
import torch
import typing
import typing_extensions
__all__: list[str] = ['Adam', 'ApiKeyInfo', 'BlobContent', 'BlobMirror', 'BlobWriter', 'CacheFullError', 'CancelToken', 'CartridgeCache', 'CartridgeCacheStats', 'CartridgeParams', 'Composition', 'ConflictError', 'ContextLengthError', 'CorruptError', 'DatablockPage', 'DatablockRecord', 'Engine', 'EngineBusyError', 'EngineOptions', 'EngineStats', 'EngineStoppedError', 'Event', 'FilePage', 'FileRecord', 'KVCache', 'KVPrefix', 'LlamaConfig', 'LlamaModel', 'NotFoundError', 'Owner', 'Priority', 'Sampler', 'SamplingParams', 'Store', 'StoreError', 'TrainOptions', 'TrainProgress', 'TrainResult', 'TrainingData', 'UnavailableError', 'User', 'apply_logit_bias', 'channel_lr_scales', 'dequantize_weight', 'distillation_loss_sum', 'filter_top_k', 'filter_top_p', 'layer_lr_scales', 'length_group_overhead', 'length_groups', 'tokens_in_front', 'train_cartridge', 'training_order']
class Adam:
    def __init__(self, params: collections.abc.Sequence[torch.Tensor], lr: typing.SupportsFloat | typing.SupportsIndex = 0.02, beta1: typing.SupportsFloat | typing.SupportsIndex = 0.9, beta2: typing.SupportsFloat | typing.SupportsIndex = 0.999, eps: typing.SupportsFloat | typing.SupportsIndex = 1e-08, anchor: typing.SupportsFloat | typing.SupportsIndex = 0.0, lr_scales: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] = [], channel_scales: collections.abc.Sequence[torch.Tensor] = []) -> None:
        ...
    def step(self, lr: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    def zero_grad(self) -> None:
        ...
    @property
    def steps(self) -> int:
        ...
class ApiKeyInfo:
    @property
    def created_at(self) -> int:
        ...
    @property
    def hint(self) -> str:
        ...
    @property
    def id(self) -> int:
        ...
    @property
    def revoked_at(self) -> int | None:
        ...
    @property
    def user_id(self) -> int:
        ...
    @property
    def user_name(self) -> str:
        ...
class BlobContent:
    """
    Where a stored blob's bytes are read from: local_path, or (empty) the blob mirror's object blob_id.
    """
    @property
    def blob_id(self) -> str:
        ...
    @property
    def bytes(self) -> int:
        ...
    @property
    def local_path(self) -> str:
        ...
class BlobMirror:
    """
    Subclass to keep the store's blobs in a remote object store: upload(blob_id, local_path), download(blob_id, local_path) -> bool (False: no such blob), remove(blob_id), check().
    """
    def __init__(self) -> None:
        ...
    def check(self) -> None:
        ...
    def download(self, blob_id: str, local_path: str) -> bool:
        ...
    def remove(self, blob_id: str) -> None:
        ...
    def upload(self, blob_id: str, local_path: str) -> None:
        ...
class BlobWriter:
    """
    A blob being written to a temporary file; Store.create_file commits it.
    """
    def abort(self) -> None:
        ...
    def write(self, data: typing_extensions.Buffer) -> None:
        ...
    @property
    def bytes(self) -> int:
        ...
    @property
    def open(self) -> bool:
        ...
class CacheFullError(RuntimeError):
    pass
class CancelToken:
    def __init__(self) -> None:
        ...
    def cancel(self) -> None:
        ...
    @property
    def cancelled(self) -> bool:
        ...
class CartridgeCache:
    """
    Cartridges by id under a byte budget; LRU eviction of idle ones.
    """
    def contains(self, arg0: str) -> bool:
        ...
    def get(self, arg0: str) -> KVPrefix:
        ...
    def ids(self) -> list[str]:
        ...
    def put(self, id: str, prefix: KVPrefix) -> None:
        ...
    def remove(self, arg0: str) -> bool:
        ...
    def stats(self) -> CartridgeCacheStats:
        ...
class CartridgeCacheStats:
    @property
    def budget_bytes(self) -> int:
        ...
    @property
    def bytes(self) -> int:
        ...
    @property
    def entries(self) -> int:
        ...
    @property
    def evictions(self) -> int:
        ...
    @property
    def hits(self) -> int:
        ...
    @property
    def loads(self) -> int:
        ...
    @property
    def misses(self) -> int:
        ...
class CartridgeParams:
    """
    Trainable prefix: float32 frozen and trainable keys/values per layer [H_kv, n, D].
    """
    @typing.overload
    def __init__(self, prefix: KVPrefix, num_frozen: typing.SupportsInt | typing.SupportsIndex = 1) -> None:
        ...
    @typing.overload
    def __init__(self, frozen_keys: collections.abc.Sequence[torch.Tensor], frozen_values: collections.abc.Sequence[torch.Tensor], trainable_keys: collections.abc.Sequence[torch.Tensor], trainable_values: collections.abc.Sequence[torch.Tensor], biases: collections.abc.Sequence[torch.Tensor] | None = None) -> None:
        ...
    def to_prefix(self, dtype: str = 'float32', device: str = 'cpu') -> KVPrefix:
        """
        A detached serving copy as a KVPrefix.
        """
    @property
    def biases(self) -> list[torch.Tensor] | None:
        """
        Per-layer attention biases [H_kv, P] (fixed, not trained), or None.
        """
    @property
    def frozen_keys(self) -> list[torch.Tensor]:
        ...
    @property
    def frozen_values(self) -> list[torch.Tensor]:
        ...
    @property
    def num_frozen(self) -> int:
        ...
    @property
    def num_tokens(self) -> int:
        ...
    @property
    def trainable_keys(self) -> list[torch.Tensor]:
        ...
    @property
    def trainable_values(self) -> list[torch.Tensor]:
        ...
class Composition:
    """
    How several cartridges of one request are composed.
    
    Members:
    
      CONCATENATE
    
      MIXTURE
    
      ROUTE
    """
    CONCATENATE: typing.ClassVar[Composition]  # value = <Composition.CONCATENATE: 0>
    MIXTURE: typing.ClassVar[Composition]  # value = <Composition.MIXTURE: 1>
    ROUTE: typing.ClassVar[Composition]  # value = <Composition.ROUTE: 2>
    __members__: typing.ClassVar[dict[str, Composition]]  # value = {'CONCATENATE': <Composition.CONCATENATE: 0>, 'MIXTURE': <Composition.MIXTURE: 1>, 'ROUTE': <Composition.ROUTE: 2>}
    @typing.overload
    def __eq__(self, other: Composition) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: Composition) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class ConflictError(StoreError):
    pass
class ContextLengthError(ValueError):
    pass
class CorruptError(StoreError):
    pass
class DatablockPage:
    @property
    def data(self) -> list[DatablockRecord]:
        ...
    @property
    def has_more(self) -> bool:
        ...
class DatablockRecord:
    """
    A datablock row; JSON columns are JSON strings.
    """
    @property
    def attempts(self) -> int:
        ...
    @property
    def bytes(self) -> int | None:
        ...
    @property
    def claimant(self) -> str:
        ...
    @property
    def config(self) -> str:
        ...
    @property
    def created_at(self) -> int:
        ...
    @property
    def error_code(self) -> str | None:
        ...
    @property
    def error_message(self) -> str | None:
        ...
    @property
    def fingerprint(self) -> str:
        ...
    @property
    def finished_at(self) -> int | None:
        ...
    @property
    def id(self) -> str:
        ...
    @property
    def metrics(self) -> str:
        ...
    @property
    def model(self) -> str:
        ...
    @property
    def model_path(self) -> str:
        ...
    @property
    def num_tokens(self) -> int:
        ...
    @property
    def owner_id(self) -> int:
        ...
    @property
    def owner_name(self) -> str:
        ...
    @property
    def progress(self) -> str:
        ...
    @property
    def project(self) -> str:
        ...
    @property
    def run_id(self) -> str:
        ...
    @property
    def started_at(self) -> int | None:
        ...
    @property
    def status(self) -> str:
        ...
    @property
    def training_files(self) -> list[str]:
        ...
    @property
    def updated_at(self) -> int:
        ...
class Engine:
    """
    The serving engine: one compute thread, many requests.
    """
    def __init__(self, model: LlamaModel, options: EngineOptions = ...) -> None:
        ...
    def cancel(self, id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def events_fd(self) -> int:
        """
        A file descriptor readable when a step publishes events (read 8 bytes, then poll(0)); -1 without eventfd.
        """
    def poll(self, timeout: datetime.timedelta) -> list[Event]:
        """
        Events of finished steps (waits up to timeout for the first).
        """
    def shutdown(self) -> None:
        ...
    def stats(self) -> EngineStats:
        ...
    def submit(self, prompt: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], prefixes: collections.abc.Sequence[KVPrefix], params: SamplingParams, priority: Priority = Priority.INTERACTIVE, composition: Composition = Composition.MIXTURE, weigh_from: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    def submit_all(self, requests: collections.abc.Sequence[tuple[collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], collections.abc.Sequence[KVPrefix], SamplingParams, typing.SupportsInt | typing.SupportsIndex]], priority: Priority = Priority.INTERACTIVE, composition: Composition = Composition.MIXTURE) -> list[int]:
        """
        Queues [(prompt, prefixes, params, weigh_from)] at once (all or none); returns their ids.
        """
    @property
    def cartridges(self) -> CartridgeCache:
        ...
    @property
    def drained(self) -> bool:
        """
        True once shut down and every event has been taken by poll().
        """
    @property
    def num_threads(self) -> int:
        """
        Intra-op threads of the compute thread; a new value applies from the next step.
        """
    @num_threads.setter
    def num_threads(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def options(self) -> EngineOptions:
        ...
    @property
    def running(self) -> bool:
        ...
class EngineBusyError(RuntimeError):
    pass
class EngineOptions:
    cuda_graphs: bool
    fixed_shape_decode: bool
    def __init__(self) -> None:
        ...
    @property
    def cartridge_cache_bytes(self) -> int:
        ...
    @cartridge_cache_bytes.setter
    def cartridge_cache_bytes(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def kv_tokens(self) -> int:
        ...
    @kv_tokens.setter
    def kv_tokens(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_running(self) -> int:
        ...
    @max_running.setter
    def max_running(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_waiting(self) -> int:
        ...
    @max_waiting.setter
    def max_waiting(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def num_threads(self) -> int:
        ...
    @num_threads.setter
    def num_threads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def prefill_tokens_per_step(self) -> int:
        ...
    @prefill_tokens_per_step.setter
    def prefill_tokens_per_step(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class EngineStats:
    @property
    def cancelled(self) -> int:
        ...
    @property
    def cartridges(self) -> CartridgeCacheStats:
        ...
    @property
    def cuda_graph_captures(self) -> int:
        ...
    @property
    def finished(self) -> int:
        ...
    @property
    def fixed_shape_steps(self) -> int:
        ...
    @property
    def generated_tokens(self) -> int:
        ...
    @property
    def kv_bytes(self) -> int:
        ...
    @property
    def kv_compactions(self) -> int:
        ...
    @property
    def kv_tokens_total(self) -> int:
        ...
    @property
    def kv_tokens_used(self) -> int:
        ...
    @property
    def prompt_tokens(self) -> int:
        ...
    @property
    def running(self) -> int:
        ...
    @property
    def steps(self) -> int:
        ...
    @property
    def waiting(self) -> int:
        ...
class EngineStoppedError(RuntimeError):
    pass
class Event:
    @property
    def error(self) -> str:
        ...
    @property
    def finish_reason(self) -> str:
        ...
    @property
    def finished(self) -> bool:
        ...
    @property
    def logprob(self) -> float:
        ...
    @property
    def request(self) -> int:
        ...
    @property
    def token(self) -> int:
        ...
    @property
    def top_ids(self) -> list[int]:
        ...
    @property
    def top_logprobs(self) -> list[float]:
        ...
class FilePage:
    @property
    def data(self) -> list[FileRecord]:
        ...
    @property
    def has_more(self) -> bool:
        ...
class FileRecord:
    @property
    def bytes(self) -> int:
        ...
    @property
    def created_at(self) -> int:
        ...
    @property
    def filename(self) -> str:
        ...
    @property
    def id(self) -> str:
        ...
    @property
    def owner_id(self) -> int:
        ...
    @property
    def purpose(self) -> str:
        ...
    @property
    def status(self) -> str:
        ...
    @property
    def status_details(self) -> str | None:
        ...
class KVCache:
    @property
    def batch(self) -> int:
        ...
    @property
    def capacity(self) -> int:
        ...
    @property
    def keys(self) -> list[torch.Tensor]:
        ...
    @property
    def lengths(self) -> list[int]:
        ...
    @property
    def values(self) -> list[torch.Tensor]:
        ...
class KVPrefix:
    """
    Per-layer keys/values [H_kv, P, D], keys after RoPE at 0..P-1; optionally per-layer float32 attention biases [H_kv, P] added to the logits of every query on these keys.
    """
    def __init__(self, keys: collections.abc.Sequence[torch.Tensor], values: collections.abc.Sequence[torch.Tensor], biases: collections.abc.Sequence[torch.Tensor] | None = None) -> None:
        ...
    @property
    def biases(self) -> list[torch.Tensor] | None:
        """
        Per-layer attention biases [H_kv, P], or None.
        """
    @property
    def keys(self) -> list[torch.Tensor]:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def num_tokens(self) -> int:
        ...
    @property
    def values(self) -> list[torch.Tensor]:
        ...
class LlamaConfig:
    attention_bias: bool
    qk_norm: bool
    rope_type: str
    tie_word_embeddings: bool
    def __init__(self) -> None:
        ...
    def validate(self) -> None:
        ...
    @property
    def head_dim(self) -> int:
        ...
    @head_dim.setter
    def head_dim(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def hidden_size(self) -> int:
        ...
    @hidden_size.setter
    def hidden_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def intermediate_size(self) -> int:
        ...
    @intermediate_size.setter
    def intermediate_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_position_embeddings(self) -> int:
        ...
    @max_position_embeddings.setter
    def max_position_embeddings(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def num_heads(self) -> int:
        ...
    @num_heads.setter
    def num_heads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def num_kv_heads(self) -> int:
        ...
    @num_kv_heads.setter
    def num_kv_heads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @num_layers.setter
    def num_layers(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def rms_norm_eps(self) -> float:
        ...
    @rms_norm_eps.setter
    def rms_norm_eps(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def rope_factor(self) -> float:
        ...
    @rope_factor.setter
    def rope_factor(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def rope_high_freq_factor(self) -> float:
        ...
    @rope_high_freq_factor.setter
    def rope_high_freq_factor(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def rope_low_freq_factor(self) -> float:
        ...
    @rope_low_freq_factor.setter
    def rope_low_freq_factor(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def rope_original_max_position_embeddings(self) -> int:
        ...
    @rope_original_max_position_embeddings.setter
    def rope_original_max_position_embeddings(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def rope_theta(self) -> float:
        ...
    @rope_theta.setter
    def rope_theta(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def vocab_size(self) -> int:
        ...
    @vocab_size.setter
    def vocab_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class LlamaModel:
    def __init__(self, config: LlamaConfig, weights: collections.abc.Mapping[str, torch.Tensor], device: str = 'cpu', dtype: str = 'float32', quantized: collections.abc.Mapping[str, tuple[str, torch.Tensor]] = {}) -> None:
        """
        weights: float32 tensors by Hugging Face name; quantized: name -> (GGUF block format, uint8 [rows, row bytes]) for the CPU decode path.
        """
    def forward(self, tokens: torch.Tensor, num_new: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None, cache: KVCache = None, prefixes: collections.abc.Sequence[collections.abc.Sequence[KVPrefix]] | None = None, last_only: bool = False) -> torch.Tensor:
        """
        Logits [B, S, V] (or [B, V] at each row's last token with last_only) for tokens [B, S].
        """
    def forward_hidden(self, tokens: torch.Tensor, num_new: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None, cache: KVCache = None, prefixes: collections.abc.Sequence[collections.abc.Sequence[KVPrefix]] | None = None, bfloat16_attention: bool = False) -> torch.Tensor:
        """
        The last layer's hidden states [B, S, hidden] for tokens [B, S]. With bfloat16_attention, a float32 model's attention behind the prefixes runs in bfloat16 where the CPU has AVX-512 BF16 (3-6x faster; no gradients).
        """
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...
    def new_cache(self, batch: typing.SupportsInt | typing.SupportsIndex, capacity: typing.SupportsInt | typing.SupportsIndex) -> KVCache:
        ...
    def prefix_from_tokens(self, tokens: torch.Tensor) -> KVPrefix:
        ...
    def queries_and_prefix(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], KVPrefix]:
        """
        Each layer's queries [heads, S, head_dim] after RoPE and the KV prefix of `tokens` [S], from one pass at positions 0..S-1 (what attention matching compacts).
        """
    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """
        x [heads, S, head_dim] rotated by RoPE at `positions` [S]; keys at position i rotated by p - i are at position p.
        """
    def with_dtype(self, dtype: str) -> LlamaModel:
        """
        The same model with its weights in `dtype` ("float32" or "bfloat16"), on the same device: e.g. a bfloat16 twin to train on beside the float32 model that serves.
        """
    @property
    def config(self) -> LlamaConfig:
        ...
    @property
    def device(self) -> str:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def int8_activations(self) -> bool:
        """
        Decode on block-quantized CPU weights with activations rounded to 8 bits (the default, llama.cpp's arithmetic) or kept in float32 (transformers' results); set before generating.
        """
    @int8_activations.setter
    def int8_activations(self, arg1: bool) -> None:
        ...
class NotFoundError(StoreError):
    pass
class Owner:
    """
    Who is asking: a user, or the admin (acts on every user's objects).
    """
    def __init__(self, user_id: typing.SupportsInt | typing.SupportsIndex, admin: bool = False) -> None:
        ...
    def __repr__(self) -> str:
        ...
    @property
    def admin(self) -> bool:
        ...
    @property
    def user_id(self) -> int:
        ...
class Priority:
    """
    Members:
    
      INTERACTIVE
    
      BACKGROUND
    """
    BACKGROUND: typing.ClassVar[Priority]  # value = <Priority.BACKGROUND: 1>
    INTERACTIVE: typing.ClassVar[Priority]  # value = <Priority.INTERACTIVE: 0>
    __members__: typing.ClassVar[dict[str, Priority]]  # value = {'INTERACTIVE': <Priority.INTERACTIVE: 0>, 'BACKGROUND': <Priority.BACKGROUND: 1>}
    @typing.overload
    def __eq__(self, other: Priority) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: Priority) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class Sampler:
    def __init__(self, arg0: SamplingParams) -> None:
        ...
    def sample(self, arg0: torch.Tensor) -> int:
        ...
class SamplingParams:
    def __init__(self, temperature: typing.SupportsFloat | typing.SupportsIndex = 0.0, top_p: typing.SupportsFloat | typing.SupportsIndex = 1.0, top_k: typing.SupportsInt | typing.SupportsIndex = 0, seed: typing.SupportsInt | typing.SupportsIndex = -1, max_new_tokens: typing.SupportsInt | typing.SupportsIndex = 256, stop_token_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], logprobs: typing.SupportsInt | typing.SupportsIndex = 0, logit_bias: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex] = {}) -> None:
        ...
    @property
    def logit_bias(self) -> dict[int, float]:
        ...
    @logit_bias.setter
    def logit_bias(self, arg0: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex]) -> None:
        ...
    @property
    def logprobs(self) -> int:
        ...
    @logprobs.setter
    def logprobs(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_new_tokens(self) -> int:
        ...
    @max_new_tokens.setter
    def max_new_tokens(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def seed(self) -> int:
        ...
    @seed.setter
    def seed(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def stop_token_ids(self) -> list[int]:
        ...
    @stop_token_ids.setter
    def stop_token_ids(self, arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
    @property
    def temperature(self) -> float:
        ...
    @temperature.setter
    def temperature(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def top_k(self) -> int:
        ...
    @top_k.setter
    def top_k(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def top_p(self) -> float:
        ...
    @top_p.setter
    def top_p(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
class Store:
    """
    SQLite metadata + blob directory; every call takes the owner.
    """
    def __init__(self, data_dir: str, sync: bool = True, check_at_open: bool = True, database_url: str = '', blob_mirror: BlobMirror = None) -> None:
        """
        Opens the store: blobs under data_dir, records in SQLite there unless database_url names another
        database (sqlite:///path.db, or postgresql://user:password@host:port/db shared by replicas).
        With a blob_mirror, blobs live in it and data_dir/blobs is their local cache.
        """
    def add_key(self, user_id: typing.SupportsInt | typing.SupportsIndex, key_hash: str, hint: str) -> ApiKeyInfo:
        ...
    def begin_blob(self) -> BlobWriter:
        ...
    def cancel_datablock(self, owner: Owner, datablock_id: str) -> DatablockRecord:
        ...
    def close(self) -> None:
        ...
    def create_datablock(self, owner: Owner, *, project: str, model: str, model_path: str, training_files: collections.abc.Sequence[str], config: str, num_tokens: typing.SupportsInt | typing.SupportsIndex) -> DatablockRecord:
        ...
    def create_file(self, owner: Owner, content: BlobWriter, filename: str, purpose: str) -> FileRecord:
        ...
    def create_user(self, name: str) -> User:
        ...
    def datablock_cartridge_path(self, owner: Owner, datablock_id: str) -> str:
        ...
    def datablock_content(self, owner: Owner, datablock_id: str) -> BlobContent:
        ...
    def delete_datablock(self, owner: Owner, datablock_id: str) -> None:
        ...
    def delete_file(self, owner: Owner, file_id: str) -> None:
        ...
    def fail_datablock(self, owner: Owner, datablock_id: str, code: str, message: str) -> DatablockRecord:
        ...
    def file_content(self, owner: Owner, file_id: str) -> BlobContent:
        ...
    def file_content_path(self, owner: Owner, file_id: str) -> str:
        ...
    def file_text(self, owner: Owner, file_id: str) -> str:
        ...
    def find_user(self, name: str) -> User | None:
        ...
    def get_datablock(self, owner: Owner, datablock_id: str) -> DatablockRecord:
        ...
    def get_file(self, owner: Owner, file_id: str) -> FileRecord:
        ...
    def import_datablock(self, owner: Owner, *, project: str, model: str, model_path: str, config: str, num_tokens: typing.SupportsInt | typing.SupportsIndex, fingerprint: str, cartridge: BlobWriter, progress: str, metrics: str, training_files: collections.abc.Sequence[str] = []) -> DatablockRecord:
        ...
    def job_dir(self, owner: Owner, datablock_id: str) -> str:
        ...
    def list_datablocks(self, owner: Owner, *, status: str | None = None, after: str | None = None, limit: typing.SupportsInt | typing.SupportsIndex = 10000, descending: bool = True) -> DatablockPage:
        ...
    def list_files(self, owner: Owner, *, purpose: str | None = None, status: str | None = None, after: str | None = None, limit: typing.SupportsInt | typing.SupportsIndex = 10000, descending: bool = True) -> FilePage:
        ...
    def list_keys(self) -> list[ApiKeyInfo]:
        ...
    def list_users(self) -> list[User]:
        ...
    def ping(self) -> None:
        """
        Checks that the database and the blob mirror answer; UnavailableError when they do not.
        """
    def recorded_blobs(self) -> list[str]:
        """
        The ids of every recorded blob; a blob mirror's object that is not among them is an orphan once old.
        """
    def revoke_key(self, key_id: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def set_file_error(self, owner: Owner, file_id: str, details: str) -> None:
        ...
    def set_file_processed(self, owner: Owner, file_id: str, text: str | None = None) -> None:
        ...
    def start_datablock(self, owner: Owner, datablock_id: str, fingerprint: str, config: str = '', num_tokens: typing.SupportsInt | typing.SupportsIndex = 0, claimant: str = '', lease_s: typing.SupportsInt | typing.SupportsIndex = 0) -> DatablockRecord:
        ...
    def succeed_datablock(self, owner: Owner, datablock_id: str, cartridge: BlobWriter, progress: str, metrics: str) -> DatablockRecord:
        ...
    def update_datablock_progress(self, owner: Owner, datablock_id: str, progress: str, metrics: str) -> None:
        ...
    def user_for_key(self, key_hash: str) -> User | None:
        ...
    def verify_datablock(self, owner: Owner, datablock_id: str) -> None:
        ...
    def verify_file(self, owner: Owner, file_id: str) -> None:
        ...
    @property
    def data_dir(self) -> str:
        ...
    @property
    def schema_version(self) -> int:
        ...
    @property
    def swept_at_open(self) -> int:
        ...
class StoreError(RuntimeError):
    pass
class TrainOptions:
    checkpoint_path: str
    cosine: bool
    resume: bool
    def __init__(self) -> None:
        ...
    def lr_at(self, step: typing.SupportsInt | typing.SupportsIndex, total: typing.SupportsInt | typing.SupportsIndex) -> float:
        """
        the learning rate of step `step` (0-based) of a run of `total` steps: warmup, then cosine
        """
    def total_steps(self, num_conversations: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    @property
    def anchor(self) -> float:
        """
        see TrainConfig.anchor
        """
    @anchor.setter
    def anchor(self, arg1: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def batch_size(self) -> int:
        ...
    @batch_size.setter
    def batch_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def channel_scaled_lr(self) -> bool:
        """
        see TrainConfig.channel_scaled_lr
        """
    @channel_scaled_lr.setter
    def channel_scaled_lr(self, arg0: bool) -> None:
        ...
    @property
    def checkpoint_every(self) -> int:
        ...
    @checkpoint_every.setter
    def checkpoint_every(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def companion(self) -> KVPrefix:
        """
        a prefix put in front of the cartridge for every companion_every-th conversation (None: never)
        """
    @companion.setter
    def companion(self, arg1: KVPrefix) -> None:
        ...
    @property
    def companion_every(self) -> int:
        ...
    @companion_every.setter
    def companion_every(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def epochs(self) -> int:
        ...
    @epochs.setter
    def epochs(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def grad_accum(self) -> int:
        ...
    @grad_accum.setter
    def grad_accum(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def layer_scaled_lr(self) -> bool:
        """
        see TrainConfig.layer_scaled_lr
        """
    @layer_scaled_lr.setter
    def layer_scaled_lr(self, arg0: bool) -> None:
        ...
    @property
    def learning_rate(self) -> float:
        """
        see TrainConfig.learning_rate
        """
    @learning_rate.setter
    def learning_rate(self, arg1: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    @property
    def loss_weighting(self) -> str:
        """
        How a step's loss is averaged: "step", "token" or "row" (see TrainConfig.loss_weighting).
        """
    @loss_weighting.setter
    def loss_weighting(self, arg1: str) -> None:
        ...
    @property
    def seed(self) -> int:
        ...
    @seed.setter
    def seed(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def warmup(self) -> float:
        """
        see TrainConfig.warmup
        """
    @warmup.setter
    def warmup(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
class TrainProgress:
    @property
    def loss(self) -> float:
        ...
    @property
    def lr(self) -> float:
        ...
    @property
    def step(self) -> int:
        ...
    @property
    def total(self) -> int:
        ...
class TrainResult:
    @property
    def cancelled(self) -> bool:
        ...
    @property
    def losses(self) -> list[float]:
        ...
    @property
    def steps(self) -> int:
        ...
class TrainingData:
    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor, target_mask: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> None:
        ...
    def validate(self, vocab_size: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def lengths(self) -> torch.Tensor:
        ...
    @property
    def target_mask(self) -> torch.Tensor:
        ...
    @property
    def tokens(self) -> torch.Tensor:
        ...
    @property
    def topk_ids(self) -> torch.Tensor:
        ...
    @property
    def topk_logprobs(self) -> torch.Tensor:
        ...
class UnavailableError(StoreError):
    pass
class User:
    @property
    def created_at(self) -> int:
        ...
    @property
    def id(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
def apply_logit_bias(logits: torch.Tensor, bias: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex]) -> torch.Tensor:
    ...
def channel_lr_scales(params: CartridgeParams) -> list[torch.Tensor]:
    """
    Per parameter of params.parameters(): a [H_kv, 1, D] tensor, each channel's RMS over the trainable tokens over the RMS of all keys (or values).
    """
def dequantize_weight(format: str, data: torch.Tensor, in_features: typing.SupportsInt | typing.SupportsIndex) -> torch.Tensor:
    """
    float32 [rows, in_features] of a GGUF block-quantized matrix (format 'Q4_0', 'Q4_1' or 'Q8_0', data uint8 [rows, row bytes]), decoded on all threads: the values the CPU kernel multiplies by.
    """
def distillation_loss_sum(model: LlamaModel, params: CartridgeParams, data: TrainingData, rows: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], companion: KVPrefix = None, companion_every: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[torch.Tensor, int]:
    """
    (loss summed over the rows' targets, differentiable w.r.t. params' trainable tensors; target count). Rows r with r % companion_every == 0 have `companion` in front of the cartridge.
    """
def filter_top_k(arg0: torch.Tensor, arg1: typing.SupportsInt | typing.SupportsIndex) -> torch.Tensor:
    ...
def filter_top_p(arg0: torch.Tensor, arg1: typing.SupportsFloat | typing.SupportsIndex) -> torch.Tensor:
    ...
def layer_lr_scales(params: CartridgeParams) -> list[float]:
    """
    Per parameter of params.parameters(): its layer's RMS over the RMS of all keys (or values).
    """
def length_group_overhead(device: str) -> int:
    """
    What a forward costs beyond its rows on `device` ("cpu", "cuda", ...), in padded row tokens: the `overhead` of length_groups, larger on a GPU, where a small forward's cost is its kernel launches.
    """
def length_groups(lengths: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], overhead: typing.SupportsInt | typing.SupportsIndex = 32) -> list[list[int]]:
    """
    Row indices split into groups of similar length for padded forwards: the cheapest split of the rows sorted by length when a group costs its rows times its longest row plus `overhead`.
    """
def tokens_in_front(cartridge_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], composition: Composition) -> int:
    """
    Context positions cartridges of these lengths take in front of a prompt when composed so: their sum, or for a mixture or a route of two or more the longest.
    """
def train_cartridge(model: LlamaModel, params: CartridgeParams, data: TrainingData, options: TrainOptions, on_progress: collections.abc.Callable | None = None, cancel: CancelToken = None) -> TrainResult:
    """
    Trains params in place with the GIL released. on_progress(TrainProgress) returning False cancels.
    """
def training_order(n: typing.SupportsInt | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, epoch: typing.SupportsInt | typing.SupportsIndex) -> list[int]:
    """
    The order in which epoch `epoch` of a run with `seed` takes n conversations.
    """
