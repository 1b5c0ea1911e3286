"""`cartridges chat`: an interactive chat in the terminal, streaming tokens as they come."""

from __future__ import annotations

import argparse
import sys

from . import add_model_argument, load_model_or_report


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Chat with the default model (or --model) in the terminal. "
        "Type a message and press Enter; /reset clears the conversation; Ctrl-D or /exit quits.",
    )
    add_model_argument(parser)
    parser.add_argument("--cartridge", metavar="FILE", action="append", default=[],
                        help="a trained cartridge (.safetensors, or a research .pt) as context; "
                        "repeat to compose several, in order")
    parser.add_argument("--system", metavar="TEXT", help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 answers greedily (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same reply)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model = load_model_or_report(args.model)
    if model is None:
        return 1
    from ..cartridge import CartridgeFileError, load_cartridge

    try:
        prefixes = [load_cartridge(path, model).prefix(model) for path in args.cartridge]
    except CartridgeFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{model.name} ready. /reset clears the conversation, /exit quits.", file=sys.stderr)

    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        print("assistant> " if interactive else "", end="", flush=True)
        for piece in model.stream_chat(messages, cartridges=prefixes, max_tokens=args.max_tokens,
                                       temperature=args.temperature,
                                       top_p=args.top_p, seed=args.seed):
            reply.append(piece)
            print(piece, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0
