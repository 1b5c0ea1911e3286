"""`cartridges train FILE... --out CART.safetensors`: self-study from text files to a cartridge."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from . import add_model_argument, load_model_or_report


def _options():
    from ..selfstudy.config import TrainConfig

    return list(fields(TrainConfig))


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..selfstudy.config import INITS, LOSS_WEIGHTINGS, OBJECTIVES, TrainConfig, field_summaries

    parser = subparsers.add_parser(
        "train",
        help="train a cartridge for text files by self-study",
        description="Train a cartridge for one or more text files (.txt, .md, or .pdf) by self-study on the "
        "default model (or --model), and write it as a .safetensors file (or a research .pt with --out X.pt).",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="the corpus: text, markdown or PDF files; several are joined in order, each under "
                        "its file name as a heading")
    parser.add_argument("--out", required=True, metavar="CART", help="where to write the cartridge")
    add_model_argument(parser)
    parser.add_argument("--checkpoint", metavar="PATH", help="keep training state here (and resume from it)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    defaults = TrainConfig()
    choices = {"init": INITS, "objective": OBJECTIVES, "loss_weighting": LOSS_WEIGHTINGS}
    summaries = field_summaries()
    for f in fields(TrainConfig):
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "num_tokens":  # its default depends on the corpus
            parser.add_argument(flag, type=int, default=None, metavar="N",
                                help="cartridge length in KV tokens (default: an eighth of the corpus, in "
                                     "multiples of 16, at least 64 and at most 2048)")
        elif f.name == "num_samples":  # its default depends on the corpus
            parser.add_argument(flag, type=int, default=None, metavar="N",
                                help="synthetic conversations (default: one per 10 corpus tokens, in batches "
                                     "of 16, at least 128 and at most 8192)")
        elif f.name == "quality_samples":  # its default depends on --num-samples
            parser.add_argument(flag, type=int, default=None, metavar="N",
                                help="held-out conversations for the quality report (default: max(8, "
                                     "num_samples / 16), at most 32; 0: no report)")
        else:
            # argparse formats help with %: a literal % in a docstring must be doubled.
            summary = summaries.get(f.name, "").replace("%", "%%")
            help_text = f"{summary} (default: {value})".strip()
            if isinstance(value, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=help_text)
            else:
                parser.add_argument(flag, type=type(value), default=value, choices=choices.get(f.name),
                                    help=help_text)
    parser.set_defaults(run=run)


def read_text(path: Path) -> str:
    if path.suffix.lower() == ".pdf":
        from pypdf import PdfReader

        return "\n\n".join(page.extract_text() or "" for page in PdfReader(str(path)).pages)
    return path.read_text(encoding="utf-8", errors="replace")


def run(args: argparse.Namespace) -> int:
    from ..cartridge import Cartridge
    from ..selfstudy.chunking import named_texts
    from ..selfstudy.config import TrainConfig
    from ..training import train

    try:
        config = TrainConfig(**{f.name: getattr(args, f.name) for f in _options()})
    except ValueError as error:  # a value out of its range: say which, with no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        texts = named_texts([(Path(p).name, read_text(Path(p))) for p in args.files])
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    model = load_model_or_report(args.model)
    if model is None:
        return 1
    cartridge: Cartridge = train(model, texts, config, progress=not args.no_progress,
                                 checkpoint=args.checkpoint, resume=args.resume)
    out = Path(args.out)
    if out.suffix == ".pt":
        cartridge.export_pt(out)
    else:
        cartridge.save(out)
    stats = cartridge.stats
    print(f"wrote {out}: {cartridge.num_tokens} tokens, {cartridge.nbytes / 2**20:.1f} MiB; "
          f"{stats['num_conversations']} conversations, {stats['steps']} steps, final loss "
          f"{stats['losses'][-1] if stats['losses'] else float('nan'):.4f}; synthesis {stats['synthesis_s']:.0f} s, "
          f"training {stats['training_s']:.0f} s", file=sys.stderr)
    if stats.get("signal_by_part"):
        print("training signal by tenth of the corpus: "
              + " ".join(f"{share:.0%}" for share in stats["signal_by_part"]), file=sys.stderr)
    if stats.get("quality") is not None:
        from ..quality import describe

        for line in describe(stats["quality"]):
            print(line, file=sys.stderr)
    return 0
