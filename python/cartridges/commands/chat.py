"""`cartridges chat`: an interactive chat in the terminal, streaming tokens as they come, with a
model loaded here or, with `--server`, with a running server through the official OpenAI client."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import add_device_argument, load_model_or_report

READY_WAIT_S = 300.0  # how long --server waits for a server that is still loading its model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal, here or on a server",
        description="Chat with the default model (or --model) in the terminal, or with a running server "
        "(--server). Type a message and press Enter; /reset clears the conversation; Ctrl-D or /exit quits.",
        epilog="With --server, --model and --cartridge take ids of that server rather than files: --model is "
        "the base model's id or a cartridge id (default: the server's base model, from GET /v1/status), "
        "--cartridge a cartridge id (<user>/<project>/<run_id> or the bare run id). Cartridges are loaded on "
        "the server before the first message, so that a wrong id or key is reported at once (exit status 1). "
        "A message the server refuses is reported and the conversation goes on; the exit status is then 1.",
    )
    parser.add_argument("--model", metavar="PATH|ID",
                        help="a Hugging Face model directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct); with --server, a model id: the base model's or a cartridge's")
    add_device_argument(parser, "runs on, without --server")
    parser.add_argument("--cartridge", metavar="CART", action="extend", nargs="+", default=[],
                        help="a trained cartridge file (.safetensors, or a research .pt) as context; with --server, "
                        "a cartridge id of that server (not a file); give several (after one --cartridge or "
                        "repeated) to compose them (see --composition); a file of `cartridges train --parts` "
                        "brings all its parts")
    parser.add_argument("--composition", choices=["search", "mixture", "route", "concatenate"], default=None,
                        help="how cartridges are composed: search (the default with --server or --corpus: of a "
                        "cartridge trained in parts, the part whose training text best matches each message, found "
                        "by BM25 before the prompt is read: one cartridge's speed; several cartridges by mixture), "
                        "mixture (each reads the conversation on its own and the one that explains it best speaks; "
                        "the default otherwise), route (as mixture while the prompt is read, then the "
                        "heaviest cartridge alone: one sequence, faster for the parts of `cartridges train --parts`) "
                        "or concatenate (their KV one after another, in order)")
    parser.add_argument("--corpus", metavar="FILE", action="extend", nargs="+", default=[],
                        help="without --server: the files the cartridge was trained on, in the same order (checked "
                        "against the digest it records); a cartridge trained in parts answers each message by the "
                        "part it is about (search), as the server does, and --retrieval finds its passages in "
                        "them; a cartridge file holds no text to search")
    parser.add_argument("--retrieval", metavar="K", type=int, nargs="?", const=4, default=None,
                        help="also put in the prompt the K passages (default 4) of the cartridges' training files "
                        "(with --server) or of the --corpus files (without) that best match each message (BM25), "
                        "behind the cartridges; worth it on corpora beyond the model's context, for literal detail")
    parser.add_argument("--passages-only", action="store_true",
                        help="with --retrieval: the passages alone, the cartridges left out of the context "
                        "(on corpora of 40K tokens and more it answers more questions exactly than one cartridge with "
                        "the passages, about as many as a cartridge in parts with them)")
    parser.add_argument("--server", metavar="URL",
                        help="chat with a running server (e.g. http://127.0.0.1:8000) instead of a local model")
    parser.add_argument("--api-key", metavar="KEY",
                        help="API key for --server (default: CARTRIDGES_API_KEY, then OPENAI_API_KEY)")
    parser.add_argument("--system", metavar="TEXT", help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 answers greedily (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same reply)")
    parser.set_defaults(run=run)


class ReplyError(Exception):
    """One message failed; the conversation goes on without it."""


class FatalError(Exception):
    """The chat cannot go on (server unreachable, key refused)."""


def run(args: argparse.Namespace) -> int:
    from ..retrieval import MAX_PASSAGES

    if args.retrieval is not None and not 1 <= args.retrieval <= MAX_PASSAGES:
        print(f"error: --retrieval takes 1 to {MAX_PASSAGES} passages, got {args.retrieval}", file=sys.stderr)
        return 2
    if args.passages_only and args.retrieval is None:
        print("error: --passages-only needs --retrieval", file=sys.stderr)
        return 2
    if args.server:
        if args.device is not None:
            print("error: --device is for a local model; the server runs its model where it was started",
                  file=sys.stderr)
            return 2
        if args.corpus:
            print("error: --corpus is for a local chat: the server searches the training files it holds",
                  file=sys.stderr)
            return 2
        return _run_server(args)
    if args.api_key:
        print("error: --api-key is for --server", file=sys.stderr)
        return 2
    if args.retrieval is not None and not args.corpus:
        print("error: --retrieval without --server needs --corpus, the files the cartridge was trained on: the "
              "passages are found in them", file=sys.stderr)
        return 2
    if args.composition == "search" and not args.corpus:
        print("error: --composition search without --server needs --corpus, the files the cartridge was trained "
              "on: a cartridge file holds no text to search", file=sys.stderr)
        return 2
    if args.corpus and args.composition not in (None, "search"):
        print(f"error: --corpus is for search: leave it out with --composition {args.composition}", file=sys.stderr)
        return 2
    missing = [path for path in [*args.cartridge, *args.corpus] if not Path(path).is_file()]
    if missing:  # before the model loads
        kind = "cartridge file (a datablock id needs --server)" if missing[0] in args.cartridge else "corpus file"
        print(f"error: {missing[0]}: no such {kind}", file=sys.stderr)
        return 1
    if args.corpus and len(args.cartridge) != 1:
        print("error: --corpus is the text of one cartridge: give one --cartridge", file=sys.stderr)
        return 2
    model = load_model_or_report(args.model, args.device)
    if model is None:
        return 1
    from ..cartridge import CartridgeFileError, load_cartridges
    from ..retrieval import Retriever, with_passages

    try:
        files = [load_cartridges(path, model) for path in args.cartridge]
    except CartridgeFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.composition == "concatenate" and any(len(parts) > 1 for parts in files):
        print("error: a cartridge trained in parts is composed by mixture: leave out --composition concatenate",
              file=sys.stderr)
        return 2
    parts_count = sum(len(parts) for parts in files)
    # With --passages-only the cartridge is read for its digest alone (the corpus check): its KV is not built.
    prefixes = [] if args.passages_only else [cartridge.prefix(model) for parts in files for cartridge in parts]
    search = retriever = None
    if args.corpus:
        texts = _corpus_texts(args.corpus)
        search = _part_search(model, texts, files[0]) if texts is not None else None
        if search is None:
            return 1
        if args.retrieval is not None:  # each passage knows its file (`Hit.source`), as the server's do
            retriever = Retriever.from_texts(model.tokenizer, texts)  # read_text refused blank files
    print(f"{model.name} ready. /reset clears the conversation, /exit quits.", file=sys.stderr)

    def reply(messages: list[dict[str, Any]]) -> Iterator[str]:
        query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        # With --corpus, the parts the last user message is about; all of them where the search cannot say.
        found = search.find(query) if search else []
        passages = retriever.hits(query, args.retrieval) if retriever is not None and query.strip() else []
        composition = "mixture" if args.composition in (None, "search") else args.composition
        context = [] if args.passages_only else [prefixes[j] for j in found] or prefixes
        yield from model.stream_chat(with_passages(messages, [p.text for p in passages]), cartridges=context,
                                     composition=composition, max_tokens=args.max_tokens,
                                     temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        if retriever is not None:  # on stderr, as with --server, so that stdout holds the replies alone
            sources = ", ".join(dict.fromkeys(Path(args.corpus[p.source]).name for p in passages))
            print(f"\n(passages: {sources or 'none matched the message'})", end="", file=sys.stderr, flush=True)
        if parts_count > 1 and found and not args.passages_only:  # which parts answered, as with --server
            print(f"\n(part{'s' if len(found) > 1 else ''} {', '.join(str(j + 1) for j in found)} of "
                  f"{parts_count})", end="", file=sys.stderr, flush=True)

    return _loop(args.system, reply)


def _corpus_texts(corpus: list[str]) -> list[str] | None:
    """The --corpus files as `cartridges train` reads them (one text per file, several under their
    names), or None after saying why not."""
    from ..selfstudy.chunking import named_texts
    from .train import InputError, read_text

    try:
        return named_texts([(Path(p).name, read_text(Path(p))) for p in corpus])
    except (OSError, InputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def _part_search(model: Any, texts: list[str], parts: list[Any]) -> Any:
    """The search over the parts of the cartridge in `parts`, from the texts it was trained on,
    or None after saying why not (the texts are not the ones it was trained on)."""
    from ..parts import UnrecordedCut, part_search_for

    try:
        return part_search_for(model.tokenizer, texts, parts)
    except UnrecordedCut as error:
        print(f"error: {error}; leave out --corpus", file=sys.stderr)
        return None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def _loop(system: str | None, reply: Callable[[list[dict[str, Any]]], Iterator[str]]) -> int:
    """Reads messages from stdin until /exit or end of input, streaming each reply to stdout.
    0, or 1 if a reply failed (ReplyError) or the chat could not go on (FatalError)."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    status = 0
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
        pieces: list[str] = []
        print("assistant> " if interactive else "", end="", flush=True)
        try:
            for piece in reply(messages):
                pieces.append(piece)
                print(piece, end="", flush=True)
        except ReplyError as error:
            print(flush=True)
            print(f"error: {error}", file=sys.stderr, flush=True)
            messages.pop()  # the message that failed is not part of the conversation
            status = 1
            continue
        except FatalError as error:
            print(flush=True)
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 1
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return status


# -- --server ----------------------------------------------------------------------------------


def _run_server(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("CARTRIDGES_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not key:
        print("error: give --api-key or set CARTRIDGES_API_KEY", file=sys.stderr)
        return 2
    base = _base_url(args.server)
    try:
        client, model = _connect(base, key, args.model, args.cartridge)
    except FatalError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    context = f"{model}" + (f" with {', '.join(args.cartridge)}" if args.cartridge else "")
    print(f"connected to {base} ({context}). /reset clears the conversation, /exit quits.", file=sys.stderr)

    options: dict[str, Any] = {"max_completion_tokens": args.max_tokens, "temperature": args.temperature,
                               "top_p": args.top_p}
    if args.seed is not None:
        options["seed"] = args.seed
    extra: dict[str, Any] = {}
    if args.cartridge:
        extra["cartridges"] = list(args.cartridge)
    if args.composition is not None:  # otherwise the server's default
        extra["composition"] = args.composition
    if args.retrieval is not None:
        extra["retrieval"] = {"top_k": args.retrieval, **({"passages_only": True} if args.passages_only else {})}
    if extra:
        options["extra_body"] = extra

    def reply(messages: list[dict[str, Any]]) -> Iterator[str]:
        import openai

        try:
            with client.chat.completions.create(model=model, messages=messages, stream=True,  # type: ignore[call-overload]
                                                **options) as stream:
                sources: list[str] = []
                parts: list[str] = []
                for chunk in stream:
                    sources += _passage_files(chunk)
                    parts += _searched_parts(chunk)
                    for choice in chunk.choices:
                        if choice.index == 0 and choice.delta.content:
                            yield choice.delta.content
                if args.retrieval is not None:  # on stderr, so that stdout holds the replies alone
                    found = ", ".join(dict.fromkeys(sources)) or "none matched the message"
                    print(f"\n(passages: {found})", end="", file=sys.stderr, flush=True)
                if parts:  # composition search: which parts answered
                    print(f"\n({'; '.join(parts)})", end="", file=sys.stderr, flush=True)
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.APIConnectionError) as error:
            raise FatalError(_describe(error, base)) from None
        except openai.APIError as error:
            raise ReplyError(_describe(error, base)) from None

    with client:
        return _loop(args.system, reply)


def _passage_files(chunk: Any) -> list[str]:
    """The files of the passages retrieval put in the prompt, from the stream's first chunk."""
    retrieval = (chunk.model_extra or {}).get("retrieval") or {}
    return [p.get("filename") or p.get("file_id", "?") for p in retrieval.get("passages", [])]


def _searched_parts(chunk: Any) -> list[str]:
    """The parts `composition: "search"` used of each cartridge in parts, from the stream's first
    chunk: "part 3 of 5 of alice/annals/q8w2e4r6t1yu"."""
    search = (chunk.model_extra or {}).get("search") or {}
    return [f"part{'s' if len(c['parts']) > 1 else ''} {', '.join(map(str, c['parts']))} of {c['of']} of {c['id']}"
            for c in search.get("cartridges", [])]


def _base_url(url: str) -> str:
    """The server's root URL, from one given with or without a /v1 or /api/v1 suffix."""
    base = url.rstrip("/")
    for suffix in ("/api/v1", "/v1"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _connect(base: str, key: str, model: str | None, cartridges: list[str]) -> tuple[Any, str]:
    """Checks the server, the key and the cartridges before the first message; returns the
    OpenAI client and the model id to chat with."""
    import httpx
    import openai

    status = _server_status(base)
    deadline = time.monotonic() + READY_WAIT_S
    if status.get("status") == "starting":
        print("waiting for the server to load its model...", file=sys.stderr, flush=True)
    while status.get("status") == "starting" and time.monotonic() < deadline:
        time.sleep(0.5)
        status = _server_status(base)
    if status.get("status") != "ok":
        raise FatalError(f"the server at {base} is not ready (status: {status.get('status')!r}); see its log")
    base_model = status.get("model")
    model = model or base_model
    if not model:
        raise FatalError(f"the server at {base} does not name its model; give --model")

    client = openai.OpenAI(base_url=base + "/v1", api_key=key)
    try:
        client.models.list()  # the key is checked here, before the user types anything
        ids = ([model] if model != base_model else []) + list(cartridges)
        if ids:  # load them now: a wrong id is reported at once, and the first reply is fast
            response = httpx.post(base + "/preload", json=list(dict.fromkeys(ids)), timeout=600,
                                  headers={"Authorization": f"Bearer {key}"})
            if response.status_code != 200:
                raise FatalError(f"could not load the cartridges: {_http_error(response)}")
            try:
                answers = response.json()
                failed = [f"{i}: {r.removeprefix('error: ')}" for i, r in answers.items() if r != "loaded"]
            except (ValueError, AttributeError):
                raise FatalError(f"{base}/preload did not answer as a cartridges server does") from None
            if failed:
                raise FatalError("cartridge " + "; ".join(failed))
    except openai.APIError as error:
        client.close()
        raise FatalError(_describe(error, base)) from None
    except httpx.HTTPError as error:
        client.close()
        raise FatalError(f"cannot reach the server at {base}: {error}") from None
    except FatalError:
        client.close()
        raise
    return client, model


def _server_status(base: str) -> dict[str, Any]:
    """GET /v1/status (no key needed)."""
    import httpx

    try:
        response = httpx.get(base + "/v1/status", timeout=30)
    except httpx.HTTPError as error:
        raise FatalError(f"cannot reach the server at {base}: {error or type(error).__name__}") from None
    if response.status_code != 200:
        raise FatalError(f"GET {base}/v1/status answered {_http_error(response)}; is this a cartridges server?")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise FatalError(f"GET {base}/v1/status did not answer JSON; is this a cartridges server?")
    return body


def _describe(error: Any, base: str) -> str:
    """One line for an openai.APIError: status, code and the server's message."""
    import openai

    if isinstance(error, openai.APITimeoutError):
        return f"the server at {base} did not answer in time"
    if isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error.__context__
        return f"cannot reach the server at {base}" + (f": {cause}" if cause else "")
    body = error.body if isinstance(error.body, dict) else {}
    message = body.get("message") or error.message
    if isinstance(error, openai.AuthenticationError):
        return f"the server refused the API key ({error.status_code} {error.code or 'invalid_api_key'}): {message}"
    status = getattr(error, "status_code", None)
    label = " ".join(str(x) for x in (status, error.code) if x)
    return f"{label}: {message}" if label else str(message)


def _http_error(response: Any) -> str:
    try:
        error = response.json()["error"]
        return f"{response.status_code} {error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{response.status_code} {response.text[:200]}"
