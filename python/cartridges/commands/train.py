"""`cartridges train FILE... --out CART.safetensors`: self-study from text files to a cartridge."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

from . import add_device_argument, add_model_argument, load_model_or_report

def _config_argument(parser: argparse.ArgumentParser, name: str, info: Any, summary: str) -> None:
    """The flag of TrainConfig field `name`: its type, choices and default from the field."""
    from ..selfstudy.config import DECIDED_FROM_CORPUS, field_aliases

    # The field's own name, and the other names it is read by (--lr for --learning-rate).
    names = [name, *(alias for alias, field in field_aliases().items() if field == name)]
    flags = ["--" + n.replace("_", "-") for n in names]
    summary = summary.replace("%", "%%")  # argparse formats help with %
    kind = info.annotation
    if typing.get_origin(kind) is not typing.Literal and typing.get_args(kind):  # X | None: X
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if info.default is None and typing.get_origin(kind) is typing.Literal:
        parser.add_argument(*flags, dest=name, default=None, choices=typing.get_args(kind),
                            help=f"{summary} (default: {DECIDED_FROM_CORPUS[name]})")
    elif info.default is None:
        parser.add_argument(*flags, dest=name, type=kind, default=None, metavar="N",
                            help=f"{summary} (default: {DECIDED_FROM_CORPUS[name]})")
    elif kind is bool:
        parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=info.default,
                            help=f"{summary} (default: {info.default})")
    elif typing.get_origin(kind) is typing.Literal:
        parser.add_argument(*flags, dest=name, default=info.default, choices=typing.get_args(kind),
                            help=f"{summary} (default: {info.default})")
    else:
        parser.add_argument(*flags, dest=name, type=kind, default=info.default, help=f"{summary} (default: {info.default})")


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..selfstudy.config import TrainConfig, field_summaries

    parser = subparsers.add_parser(
        "train",
        help="train a cartridge for text files by self-study",
        description="Train a cartridge for one or more text files (.txt, .md, or .pdf) by self-study on the "
        "default model (or --model), and write it as a .safetensors file (or a research .pt with --out X.pt). "
        "Every training setting is a flag; docs/configuration.md explains them.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="the corpus: text, markdown or PDF files; several are "
                        "joined in order, each under its file name as a heading")
    parser.add_argument("--out", required=True, metavar="CART", help="where to write the cartridge")
    add_model_argument(parser)
    add_device_argument(parser, "trains on (synthesis, compaction and training)")
    parser.add_argument("--checkpoint", metavar="PATH", help="keep training state here (PATH and files beside it "
                        "named PATH.*); without --resume an earlier run's state there is replaced")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint (needs it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--parts", action=argparse.BooleanOptionalAction, help="cut the corpus at headings (or "
                        "paragraphs) into parts of about --part-tokens (a part can run a little over, to end at a "
                        "heading), train a cartridge per part and write them all to CART as one file, which chat "
                        "and the server compose by mixture; with --checkpoint, each part's state is kept and "
                        "--resume goes on from it. Default: in parts for a corpus of more than four of the model's "
                        "contexts (32,768 tokens for the default model), one cartridge otherwise (and always for a "
                        ".pt); --no-parts for one cartridge however long the corpus")
    parser.add_argument("--part-tokens", type=int, metavar="N", help="about how many tokens a part holds; implies "
                        "--parts (default: two of the model's contexts, 16,384 tokens for the default model)")
    summaries = field_summaries()
    for name, info in TrainConfig.model_fields.items():
        _config_argument(parser, name, info, summaries[name])
    parser.set_defaults(run=run)


class InputError(Exception):
    """A problem with the command's files, found before the model loads: the message says which."""


def read_text(path: Path) -> str:
    """A file's text; InputError naming it when it cannot be read or holds no text."""
    if path.suffix.lower() == ".pdf":
        from pypdf import PdfReader

        try:
            text = "\n\n".join(page.extract_text() or "" for page in PdfReader(str(path)).pages)
        except OSError:
            raise
        except Exception as error:  # pypdf raises many types on damaged files
            raise InputError(f"{path}: not a readable PDF ({error})") from None
        if not text.strip():
            raise InputError(f"{path}: no extractable text (a scanned PDF? run OCR on it first)")
        return text
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"{path}: empty, no text to train on")
    return text


def check_paths(files: list[str], out: str, checkpoint: str | None, resume: bool, parts: bool | None = False,
                part_tokens: int | None = None) -> None:
    """What would fail only after hours of training, or destroy a file, refused up front."""
    if resume and checkpoint is None:
        raise InputError("--resume needs --checkpoint: the path of the training state to continue from")
    if part_tokens is not None and parts is False:
        raise InputError("--part-tokens is the size of a part: it cannot go with --no-parts")
    from ..parts import MIN_PART_TOKENS

    if part_tokens is not None and part_tokens < MIN_PART_TOKENS:
        raise InputError(f"--part-tokens must be at least {MIN_PART_TOKENS}")
    if (parts or part_tokens is not None) and Path(out).suffix == ".pt":
        raise InputError("--parts writes a cartridge file (.safetensors): the research .pt format holds one "
                         "cartridge, not parts")
    inputs = {Path(f).resolve() for f in files}
    for flag, value in (("--out", out), ("--checkpoint", checkpoint)):
        if value is None:
            continue
        path = Path(value)
        if path.resolve() in inputs:
            raise InputError(f"{flag} {value} is one of the input files; it would be overwritten")
        if path.is_dir():
            raise InputError(f"{flag} {value} is a directory; give a file path")
        parent = path.resolve().parent
        if not parent.is_dir():
            raise InputError(f"{flag} {value}: the directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise InputError(f"{flag} {value}: the directory {parent} is not writable")
    if checkpoint is not None and Path(checkpoint).resolve() == Path(out).resolve():
        raise InputError("--checkpoint and --out name the same file")


def save(cartridges: Any, out: Path) -> Path:
    """Writes the cartridge (or a list: the parts of one corpus, as one file) to `out`; if that
    fails (a full disk, a directory removed meanwhile), to a temporary file instead, so that the
    training is not lost: returns where it went."""
    from ..cartridge import save_cartridges

    cartridges = cartridges if isinstance(cartridges, list) else [cartridges]

    def write(path: Path) -> None:
        cartridges[0].export_pt(path) if path.suffix == ".pt" else save_cartridges(cartridges, path)

    try:
        write(out)
        return out
    except Exception as error:
        import tempfile

        fallback = Path(tempfile.gettempdir()) / f"cartridge-{os.getpid()}-{out.stem}{out.suffix or '.safetensors'}"
        print(f"error: cannot write {out} ({error}); writing {fallback} instead", file=sys.stderr)
        write(fallback)
        return fallback


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ..cartridge import Cartridge
    from ..selfstudy.chunking import named_texts
    from ..selfstudy.config import TrainConfig, describe
    from ..training import CheckpointMismatch, train

    try:
        config = TrainConfig(**{name: getattr(args, name) for name in TrainConfig.model_fields})
    except ValidationError as error:  # a value out of its range: say which, with no traceback
        print(f"error: {describe(error)}", file=sys.stderr)
        return 2
    try:
        check_paths(args.files, args.out, args.checkpoint, args.resume, args.parts, args.part_tokens)
    except InputError as error:  # how the command was called
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        texts = named_texts([(Path(p).name, read_text(Path(p))) for p in args.files])
    except (OSError, InputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    model = load_model_or_report(args.model, args.device)
    if model is None:
        return 1
    if _in_parts(model, texts, args):
        return _train_parts(model, texts, config, args)
    try:
        cartridge: Cartridge = train(model, texts, config, progress=not args.no_progress,
                                     checkpoint=args.checkpoint, resume=args.resume)
    except CheckpointMismatch as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = save(cartridge, Path(args.out))
    describe_trained(cartridge, out)
    return 0 if out == Path(args.out) else 1


def _in_parts(model: Any, texts: list[str], args: argparse.Namespace) -> bool:
    """--parts or --part-tokens: in parts; --no-parts or a .pt: one cartridge; neither: in parts
    past four contexts (`cartridges.parts.in_parts_by_default`), said on stderr."""
    if args.parts is not None or args.part_tokens is not None:
        return args.parts is not False
    if Path(args.out).suffix == ".pt":
        return False
    from ..parts import PARTS_PAST_CONTEXTS, in_parts_by_default
    from ..selfstudy import Corpus

    tokens = len(Corpus.from_texts(model.tokenizer, texts))
    if not in_parts_by_default(model, tokens):
        return False
    print(f"the corpus has {tokens:,} tokens, more than {PARTS_PAST_CONTEXTS} of the model's contexts: training a "
          "cartridge per part (--no-parts for one cartridge)", file=sys.stderr)
    return True


def _train_parts(model: Any, texts: list[str], config: Any, args: argparse.Namespace) -> int:
    from ..parts import train_parts
    from ..training import CheckpointMismatch

    def trained(part: int, count: int, cartridge: Any) -> None:
        if count > 1:
            print(f"part {part} of {count}: {_trained_summary(cartridge)}", file=sys.stderr)

    try:
        cartridges = train_parts(model, texts, config, args.part_tokens, progress=not args.no_progress,
                                 checkpoint=args.checkpoint, resume=args.resume, on_trained=trained)
    except CheckpointMismatch as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = save(cartridges, Path(args.out))
    if len(cartridges) == 1:
        describe_trained(cartridges[0], out)
    else:
        size = sum(c.nbytes for c in cartridges) / 2**20
        corpus = " ".join(shlex.quote(path) for path in args.files)
        print(f"wrote {out}: {len(cartridges)} parts of {', '.join(str(c.num_tokens) for c in cartridges)} tokens, "
              f"{size:.1f} MiB; chat with it, each message answered by the part it is about:\n  cartridges chat "
              f"--cartridge {shlex.quote(str(out))} --corpus {corpus}\n(with --retrieval the corpus' best passages "
              "for each message go in the prompt too, for literal detail; without --corpus its parts are composed "
              "by mixture)", file=sys.stderr)
    return 0 if out == Path(args.out) else 1


def _trained_summary(cartridge: Any) -> str:
    stats = cartridge.stats
    return (f"{cartridge.num_tokens} tokens, {cartridge.nbytes / 2**20:.1f} MiB; "
            f"{stats['num_conversations']} conversations, {stats['steps']} steps, final loss "
            f"{stats['losses'][-1] if stats['losses'] else float('nan'):.4f}; initialization {stats['init_s']:.0f} s, "
            f"synthesis {stats['synthesis_s']:.0f} s, training {stats['training_s']:.0f} s")


def describe_trained(cartridge: Any, out: Path) -> None:
    """What was written and how the training went, on stderr."""
    stats = cartridge.stats
    print(f"wrote {out}: {_trained_summary(cartridge)}", file=sys.stderr)
    if stats.get("signal_by_part"):
        print("training signal by tenth of the corpus: "
              + " ".join(f"{share:.0%}" for share in stats["signal_by_part"]), file=sys.stderr)
    if stats.get("quality") is not None:
        from ..quality import describe as describe_quality

        for line in describe_quality(stats["quality"]):
            print(line, file=sys.stderr)
