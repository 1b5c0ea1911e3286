"""The `Cartridge` object: a trained KV prefix, its file format, and the research `.pt` format.

A cartridge holds, per layer, keys and values `[n_kv_heads, num_tokens, head_dim]` (keys
after RoPE at positions `0..num_tokens-1`). The first `num_frozen` tokens were not trained.
A cartridge may also hold per layer float32 attention biases `[n_kv_heads, num_tokens]`
(`compact_prefix(..., bias=True)` makes them), added to the attention logits on its keys so
that a few keys carry the attention mass of the many corpus tokens they stand for; they are
fixed (training does not change them).

File format (safetensors): tensors `layers.{i}.keys` / `layers.{i}.values`, with biases also
`layers.{i}.bias` (float32 whatever `dtype` says) and then `format_version` 2 (1 without, so
that files without biases stay readable by every version), and string metadata:

| key               | value                                                     |
|-------------------|-----------------------------------------------------------|
| `format`          | `cartridges.cartridge`                                    |
| `format_version`  | `1`, or `2` when the file holds attention biases          |
| `fingerprint`     | the base model's fingerprint (empty when unknown)        |
| `num_tokens`      | prefix length                                             |
| `num_frozen`      | leading tokens that were not trained                      |
| `num_layers`, `num_kv_heads`, `head_dim` | the shape                           |
| `dtype`           | dtype of the stored tensors (`float32`, `bfloat16`, ...)  |
| `config`          | JSON of the training configuration; `corpus_sha256`: `sha256:` + the hex digest of the text trained on (UTF-8, files joined as training joins them) |
| `checksum`        | `sha256:` + hex digest of every tensor's bytes: keys and values in layer order, keys before values, then the biases in layer order |
| `quality`         | optional: JSON of the quality report (`cartridges.quality.quality_report`) |

`Cartridge.load` checks all of it and raises `CartridgeFileError` on any mismatch. A file
without `quality` loads with `quality` None; the checksum does not cover it.

A corpus trained in parts (`cartridges.parts`) is one file of `format_version` 3 holding a
cartridge per part: part j's tensors under `parts.{j}.` (`parts.0.layers.0.keys`, ...) and the
metadata `num_parts` and `parts`, a JSON list of each part's metadata as above (its own
checksum, config and quality). Such a cartridge is served as its parts (on the server the part a
question is about, by default; otherwise all of them composed by mixture):
`load_cartridges` reads it as a list, `Cartridge.load` refuses it (`PartsFileError`), and older
versions refuse it by its version rather than read it as one cartridge (parts trained apart and
concatenated recover half as much).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cartridges_core

FORMAT = "cartridges.cartridge"
FORMAT_VERSION = 1  # files without attention biases
FORMAT_VERSION_BIASED = 2  # files with them
FORMAT_VERSION_PARTS = 3  # files holding a cartridge per part of a corpus
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CartridgeFileError(ValueError):
    """A cartridge file that cannot be used: damaged, of another format, or for another model."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class PartsFileError(CartridgeFileError):
    """A file holding a cartridge per part of a corpus where one cartridge was asked for."""


class UnexportableError(ValueError):
    """The cartridge holds what the asked-for format cannot (its attention biases)."""


def native_model(model: Any) -> cartridges_core.LlamaModel:
    """The C++ model behind `model` (a `cartridges.Model`, or a `cartridges_core.LlamaModel`)."""
    return model if isinstance(model, cartridges_core.LlamaModel) else model.native


def model_fingerprint(model: Any) -> str:
    return str(getattr(model, "fingerprint", "") or "")


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported cartridge dtype {dtype}")


@dataclass(eq=False)
class Cartridge:
    keys: list[torch.Tensor]  # per layer [n_kv_heads, num_tokens, head_dim], after RoPE
    values: list[torch.Tensor]  # per layer [n_kv_heads, num_tokens, head_dim]
    num_frozen: int = 1  # leading tokens that were not trained (the attention sink)
    fingerprint: str = ""  # the base model's fingerprint; "" when unknown
    config: dict[str, Any] = field(default_factory=dict)  # how it was trained
    stats: dict[str, Any] = field(default_factory=dict, compare=False)  # from train(): losses, times
    biases: list[torch.Tensor] | None = None  # per layer float32 [n_kv_heads, num_tokens]: attention biases
    _prefixes: dict[tuple[str, str], cartridges_core.KVPrefix] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError("a cartridge needs keys and values for every layer")
        shape = tuple(self.keys[0].shape)
        for k, v in zip(self.keys, self.values):
            if k.dim() != 3 or tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"every layer's keys and values must be {list(shape)}")
        if not 0 <= self.num_frozen <= shape[1]:
            raise ValueError(f"num_frozen must be in [0, {shape[1]}]")
        if self.biases is not None:
            if len(self.biases) != len(self.keys) or any(
                tuple(b.shape) != shape[:2] or b.dtype != torch.float32 for b in self.biases
            ):
                raise ValueError(f"attention biases must be float32 {list(shape[:2])}, one per layer")

    def __eq__(self, other: object) -> bool:
        """Same tensors (bit for bit, same dtype), frozen count, fingerprint and config."""
        if not isinstance(other, Cartridge):
            return NotImplemented
        return (
            (self.num_frozen, self.fingerprint, self.config) == (other.num_frozen, other.fingerprint, other.config)
            and len(self.keys) == len(other.keys)
            and all(torch.equal(a, b) for a, b in zip((*self.keys, *self.values), (*other.keys, *other.values)))
            and (self.biases is None) == (other.biases is None)
            and all(torch.equal(a, b) for a, b in zip(self.biases or [], other.biases or []))
        )

    __hash__ = None  # type: ignore[assignment]

    # -- shape ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def quality(self) -> dict[str, Any] | None:
        """The quality report (`cartridges.quality.quality_report`) from training or from the
        file, `stats["quality"]`; None when there is none."""
        return self.stats.get("quality")

    @property
    def nbytes(self) -> int:
        """KV memory of the cartridge in its own dtype, with its attention biases."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *(self.biases or [])))

    # -- conversions ---------------------------------------------------------------------
    @classmethod
    def from_params(
        cls, params: cartridges_core.CartridgeParams, fingerprint: str = "", config: dict[str, Any] | None = None
    ) -> Cartridge:
        """Detached float32 copy of a trainable prefix."""
        keys = [torch.cat([f, t.detach()], 1).clone() for f, t in zip(params.frozen_keys, params.trainable_keys)]
        values = [
            torch.cat([f, t.detach()], 1).clone() for f, t in zip(params.frozen_values, params.trainable_values)
        ]
        biases = None if params.biases is None else [b.clone() for b in params.biases]
        return cls(keys, values, params.num_frozen, fingerprint, dict(config or {}), biases=biases)

    def to_params(self) -> cartridges_core.CartridgeParams:
        """A trainable float32 copy (to continue training)."""
        f = self.num_frozen
        return cartridges_core.CartridgeParams(
            [k[:, :f] for k in self.keys],
            [v[:, :f] for v in self.values],
            [k[:, f:] for k in self.keys],
            [v[:, f:] for v in self.values],
            self.biases,
        )

    def to(self, dtype: torch.dtype) -> Cartridge:
        """A copy in `dtype`; of the stats, only the quality report comes along."""
        return Cartridge(
            [k.to(dtype) for k in self.keys],
            [v.to(dtype) for v in self.values],
            self.num_frozen,
            self.fingerprint,
            dict(self.config),
            {"quality": self.quality} if self.quality is not None else {},
            biases=None if self.biases is None else [b.clone() for b in self.biases],
        )

    def prefix(self, model: Any) -> cartridges_core.KVPrefix:
        """The cartridge as a KV prefix in the model's dtype and device (made once, then shared)."""
        native = native_model(model)
        self.check_model(model)
        key = (native.dtype, native.device)
        if key not in self._prefixes:
            dtype = _DTYPES[native.dtype]
            self._prefixes[key] = cartridges_core.KVPrefix(
                [k.to(native.device, dtype).contiguous() for k in self.keys],
                [v.to(native.device, dtype).contiguous() for v in self.values],
                None if self.biases is None else [b.to(native.device).contiguous() for b in self.biases],
            )
        return self._prefixes[key]

    def check_model(self, model: Any, path: str | os.PathLike[str] | None = None) -> None:
        """Raise unless the cartridge fits `model` (shape, and fingerprint when both know one)."""
        c = native_model(model).config

        def fail(reason: str) -> None:
            if path is not None:
                raise CartridgeFileError(path, reason)
            raise ValueError(reason)

        got = (self.num_layers, self.num_kv_heads, self.head_dim)
        want = (c.num_layers, c.num_kv_heads, c.head_dim)
        if got != want:
            fail(f"cartridge shape (layers, kv heads, head dim) {got} does not fit the model's {want}")
        fp = model_fingerprint(model)
        if self.fingerprint and fp and self.fingerprint != fp:
            fail(f"cartridge was trained for model {self.fingerprint}, not for this model ({fp})")

    # -- files ---------------------------------------------------------------------------
    def checksum(self) -> str:
        h = hashlib.sha256()
        for t in (*self.keys, *self.values, *(self.biases or [])):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return "sha256:" + h.hexdigest()

    def _tensors_and_metadata(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"layers.{i}.keys"] = k.detach().cpu().contiguous()
            tensors[f"layers.{i}.values"] = v.detach().cpu().contiguous()
        for i, b in enumerate(self.biases or []):
            tensors[f"layers.{i}.bias"] = b.detach().cpu().contiguous()
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION if self.biases is None else FORMAT_VERSION_BIASED),
            "fingerprint": self.fingerprint,
            "num_tokens": str(self.num_tokens),
            "num_frozen": str(self.num_frozen),
            "num_layers": str(self.num_layers),
            "num_kv_heads": str(self.num_kv_heads),
            "head_dim": str(self.head_dim),
            "dtype": _dtype_name(self.dtype),
            "config": json.dumps(self.config, sort_keys=True),
            "checksum": self.checksum(),
        }
        if self.quality is not None:
            metadata["quality"] = json.dumps(self.quality, sort_keys=True)
        return tensors, metadata

    def to_bytes(self) -> bytes:
        """The cartridge file's bytes (what `save` writes), e.g. for a store blob."""
        from safetensors.torch import save

        tensors, metadata = self._tensors_and_metadata()
        return save(tensors, metadata=metadata)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the cartridge as safetensors (see the module doc), atomically."""
        _write_atomically(*self._tensors_and_metadata(), Path(path))

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any | None = None) -> Cartridge:
        """Read a cartridge file; with `model`, also check that it was made for that model."""
        path = Path(path)
        meta, tensors = _read_cartridge_file(path)
        if meta.get("format_version") == str(FORMAT_VERSION_PARTS):
            raise PartsFileError(path, f"holds a cartridge per part of a corpus ({meta.get('num_parts')} parts), "
                                 "served together by mixture: read it with cartridges.load_cartridges")
        return cls._checked(path, meta, tensors, model)

    @classmethod
    def _checked(cls, path: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor],
                 model: Any | None) -> Cartridge:
        """The cartridge of one file's (or one part's) metadata and tensors, all of it checked."""
        names = set(tensors)
        if meta.get("format_version") not in (str(FORMAT_VERSION), str(FORMAT_VERSION_BIASED)):
            raise CartridgeFileError(
                path, f"format version {meta.get('format_version')!r}; this version reads "
                f"{FORMAT_VERSION}, {FORMAT_VERSION_BIASED} and {FORMAT_VERSION_PARTS} (parts)"
            )
        biased = meta["format_version"] == str(FORMAT_VERSION_BIASED)
        try:
            num_layers = int(meta["num_layers"])
            shape = (int(meta["num_kv_heads"]), int(meta["num_tokens"]), int(meta["head_dim"]))
            num_frozen = int(meta["num_frozen"])
            dtype = _DTYPES[meta["dtype"]]
            config = json.loads(meta.get("config") or "{}")
            quality = json.loads(meta["quality"]) if meta.get("quality") else None
            checksum = meta["checksum"]
        except (KeyError, ValueError) as error:
            raise CartridgeFileError(path, f"bad or missing metadata: {error}") from None
        kinds = ("keys", "values", "bias") if biased else ("keys", "values")
        expected = {f"layers.{i}.{kind}" for i in range(num_layers) for kind in kinds}
        if names != expected:
            raise CartridgeFileError(path, f"tensors do not match the metadata's {num_layers} layers"
                                     + (" with attention biases" if biased else ""))
        for name, t in tensors.items():
            want_shape, want_dtype = (shape[:2], torch.float32) if name.endswith(".bias") else (shape, dtype)
            if tuple(t.shape) != want_shape or t.dtype != want_dtype:
                raise CartridgeFileError(
                    path, f"tensor {name} is {list(t.shape)} {t.dtype}, metadata says {list(want_shape)} {want_dtype}"
                )
        cartridge = cls(
            [tensors[f"layers.{i}.keys"] for i in range(num_layers)],
            [tensors[f"layers.{i}.values"] for i in range(num_layers)],
            num_frozen,
            meta.get("fingerprint", ""),
            config,
            {"quality": quality} if quality is not None else {},
            biases=[tensors[f"layers.{i}.bias"] for i in range(num_layers)] if biased else None,
        )
        if cartridge.checksum() != checksum:
            raise CartridgeFileError(path, "checksum mismatch: the file is damaged")
        if model is not None:
            cartridge.check_model(model, path)
        return cartridge

    def check_exportable(self, target: str) -> None:
        """Raise UnexportableError when `target` (a format without attention biases) cannot hold
        this cartridge."""
        if self.biases is not None:
            raise UnexportableError(f"this cartridge has attention biases, which {target} cannot hold: "
                                    "use the cartridge file")

    # -- the original research code's .pt format -----------------------------------------
    def export_pt(self, path: str | os.PathLike[str]) -> None:
        """Write `{trainable_keys, trainable_values, frozen_keys, frozen_values}`, lists of
        per-layer `[1, n_kv_heads, tokens, head_dim]` tensors, as the research code saves them."""
        self.check_exportable("the research .pt format")
        f = self.num_frozen
        torch.save(
            {
                "trainable_keys": [k[None, :, f:].clone() for k in self.keys],
                "trainable_values": [v[None, :, f:].clone() for v in self.values],
                "frozen_keys": [k[None, :, :f].clone() for k in self.keys],
                "frozen_values": [v[None, :, :f].clone() for v in self.values],
            },
            str(path),
        )

    @classmethod
    def import_pt(cls, path: str | os.PathLike[str], model: Any | None = None) -> Cartridge:
        """Read a research-code `.pt` cartridge (frozen tokens first, then trainable ones)."""
        try:
            data = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many kinds for a bad file
            raise CartridgeFileError(path, f"not a readable .pt cartridge: {error}") from None
        if not isinstance(data, Mapping) or "trainable_keys" not in data or "trainable_values" not in data:
            raise CartridgeFileError(path, "expected a dict with trainable_keys and trainable_values")

        def layers(name: str) -> list[torch.Tensor] | None:
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, Mapping):  # a ParameterList's state dict: {"0": t, "1": t, ...}
                value = [value[k] for k in sorted(value, key=lambda k: int(str(k).rsplit(".", 1)[-1]))]
            if not isinstance(value, Sequence):
                raise CartridgeFileError(path, f"{name} must be a list of per-layer tensors")
            out = []
            for t in value:
                t = torch.as_tensor(t).detach()
                if t.dim() == 4:
                    if t.shape[0] != 1:
                        raise CartridgeFileError(path, f"{name}: batch dimension must be 1, got {t.shape[0]}")
                    t = t[0]
                if t.dim() != 3:
                    raise CartridgeFileError(path, f"{name}: expected [1, n_kv_heads, tokens, head_dim] tensors")
                out.append(t)
            return out

        tk, tv = layers("trainable_keys"), layers("trainable_values")
        fk, fv = layers("frozen_keys"), layers("frozen_values")
        assert tk is not None and tv is not None
        if fk is None or fv is None or len(fk) == 0:
            fk = [k[:, :0] for k in tk]
            fv = [v[:, :0] for v in tv]
        if not (len(tk) == len(tv) == len(fk) == len(fv)):
            raise CartridgeFileError(path, "the four lists must have one tensor per layer")
        try:
            cartridge = cls(
                [torch.cat([f, t.to(f.dtype)], 1) for f, t in zip(fk, tk)],
                [torch.cat([f, t.to(f.dtype)], 1) for f, t in zip(fv, tv)],
                num_frozen=int(fk[0].shape[1]),
                config={"imported_from": Path(path).name},
            )
        except (RuntimeError, ValueError) as error:
            raise CartridgeFileError(path, f"inconsistent shapes: {error}") from None
        if model is not None:
            cartridge.check_model(model, path)
            cartridge.fingerprint = model_fingerprint(model)
        return cartridge


    # -- Hugging Face PEFT's CARTRIDGE adapters (peft_adapter.py) --------------------------
    def to_peft(self, directory: str | os.PathLike[str], *, base_model: str | None = None) -> Path:
        """Write a PEFT `CARTRIDGE` adapter directory that `PeftModel.from_pretrained` loads on
        the base model (`base_model`: its Hugging Face id or path, recorded in the config)."""
        from .peft_adapter import save_peft

        return save_peft(self, directory, base_model=base_model)

    @classmethod
    def from_peft(cls, directory: str | os.PathLike[str], model: Any | None = None) -> Cartridge:
        """Read a PEFT `CARTRIDGE` adapter directory (saved by PEFT or by `to_peft`)."""
        from .peft_adapter import load_peft

        return load_peft(directory, model)


def _read_cartridge_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A cartridge file's metadata and tensors, its format checked (not yet its version)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CartridgeFileError(path, "no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CartridgeFileError(path, f"not a readable safetensors file (truncated or damaged?): {error}") from None
    if meta.get("format") != FORMAT:
        raise CartridgeFileError(path, "not a cartridge file (no 'format: cartridges.cartridge' metadata)")
    return meta, tensors


def _parts_tensors_and_metadata(parts: Sequence[Cartridge]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    metadata = []
    for j, part in enumerate(parts):
        part_tensors, part_metadata = part._tensors_and_metadata()
        tensors.update({f"parts.{j}.{name}": t for name, t in part_tensors.items()})
        metadata.append(part_metadata)
    return tensors, {"format": FORMAT, "format_version": str(FORMAT_VERSION_PARTS), "num_parts": str(len(parts)),
                     "parts": json.dumps(metadata, sort_keys=True)}


def _file_contents(cartridges: Sequence[Cartridge]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of one cartridge's file, or of a parts file for several."""
    if not cartridges:
        raise ValueError("no cartridges to write")
    return cartridges[0]._tensors_and_metadata() if len(cartridges) == 1 else _parts_tensors_and_metadata(cartridges)


def cartridges_to_bytes(cartridges: Sequence[Cartridge]) -> bytes:
    """The bytes `save_cartridges` writes (e.g. for a store blob)."""
    from safetensors.torch import save

    tensors, metadata = _file_contents(cartridges)
    return save(tensors, metadata=metadata)


def save_cartridges(cartridges: Sequence[Cartridge], path: str | os.PathLike[str]) -> None:
    """Write one cartridge (as `Cartridge.save`), or the cartridges of a corpus' parts as one
    file (see the module doc), atomically."""
    _write_atomically(*_file_contents(cartridges), Path(path))


def _write_atomically(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_parts(path: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor],
                model: Any | None) -> list[Cartridge]:
    try:
        count = int(meta["num_parts"])
        metadata = json.loads(meta["parts"])
    except (KeyError, ValueError) as error:
        raise CartridgeFileError(path, f"bad or missing metadata: {error}") from None
    if count < 2 or not isinstance(metadata, list) or len(metadata) != count \
            or not all(isinstance(m, dict) for m in metadata):
        raise CartridgeFileError(path, f"the metadata does not describe its {count} parts")
    parts, claimed = [], set()
    for j, part_meta in enumerate(metadata):
        prefix = f"parts.{j}."
        part_tensors = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        claimed.update(prefix + name for name in part_tensors)
        part_meta = {str(k): str(v) for k, v in part_meta.items()}
        try:
            parts.append(Cartridge._checked(path, part_meta, part_tensors, model))
        except CartridgeFileError as error:
            raise CartridgeFileError(path, f"part {j + 1} of {count}: {error.reason}") from None
    if claimed != set(tensors):
        raise CartridgeFileError(path, f"tensors outside its {count} parts")
    return parts


def load_cartridges(path: str | os.PathLike[str], model: Any | None = None) -> list[Cartridge]:
    """The cartridges of a file: one (as `load_cartridge` reads it), or a cartridge per part of
    a corpus (a parts file, see the module doc), in order; serve several composed by mixture."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".pt":
        return [load_cartridge(path, model)]
    meta, tensors = _read_cartridge_file(path)
    if meta.get("format_version") == str(FORMAT_VERSION_PARTS):
        return _load_parts(path, meta, tensors, model)
    return [Cartridge._checked(path, meta, tensors, model)]


def load_cartridge(path: str | os.PathLike[str], model: Any | None = None) -> Cartridge:
    """`Cartridge.load` for `.safetensors`, `Cartridge.import_pt` for `.pt`, `Cartridge.from_peft`
    for a PEFT adapter directory."""
    if Path(path).is_dir():
        return Cartridge.from_peft(path, model)
    if str(path).endswith(".pt"):
        return Cartridge.import_pt(path, model)
    return Cartridge.load(path, model)

