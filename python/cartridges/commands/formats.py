"""`cartridges export` and `cartridges import`: cartridges in and out of this package's format,
Hugging Face PEFT's `CARTRIDGE` adapters and the research code's `.pt` (docs/formats.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FORMATS = ("peft", "pt", "safetensors")


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a cartridge as a PEFT adapter, a research .pt or a cartridge file",
        description="Write a cartridge in another format. SOURCE is a cartridge file (.safetensors, .pt), a PEFT "
        "adapter directory, or the id of a trained datablock in the store (<user>/<project>/<run_id> or the run id).",
        epilog="The format follows OUT unless --format says otherwise: a directory (or a name without a suffix) "
        "is a PEFT adapter directory, .zip a zipped one, .pt the research format, .safetensors ours. A PEFT "
        "adapter loads with PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT).")
    export.add_argument("source", metavar="SOURCE", help="a cartridge file or PEFT directory, or a datablock id")
    export.add_argument("out", metavar="OUT", help="where to write it")
    export.add_argument("--format", choices=FORMATS, help="peft, pt or safetensors (default: from OUT)")
    export.add_argument("--base-model", metavar="ID",
                        help="recorded in a PEFT adapter as base_model_name_or_path (default: the datablock's model)")
    export.add_argument("--data-dir", help="store directory for a datablock id (CARTRIDGES_DATA_DIR)")
    export.set_defaults(run=run_export)

    imported = subparsers.add_parser(
        "import", help="add a cartridge made elsewhere (PEFT adapter, .pt) to the store as a datablock",
        description="Add a cartridge made elsewhere to the store as a trained datablock of USER, which the server "
        "then serves like any other (chat with model=<the printed id>). SOURCE is a PEFT CARTRIDGE adapter "
        "directory, a research .pt or a .safetensors cartridge; it is checked against the base model.",
        epilog="Works while the server runs. The cartridge must fit the server's base model (--model, "
        "CARTRIDGES_MODEL; default: the embedded SmolLM2-135M-Instruct): same layers, key-value heads and head size.")
    imported.add_argument("source", metavar="SOURCE", help="a PEFT adapter directory, a .pt or a .safetensors file")
    imported.add_argument("--user", required=True, help="the user who owns the datablock (must exist)")
    imported.add_argument("--name", default="imported", help="project name (default: imported)")
    imported.add_argument("--training-files", metavar="FILE_ID", action="extend", nargs="+", default=[],
                          help="ids of USER's uploaded files (POST /v1/files) that the cartridge was trained on, in "
                          "order: a cartridge in parts that records its cut is then answered from the part each "
                          "question is about (chat's default `search`), and chat's `retrieval` searches them; files "
                          "that are not the text it (or each part) records it was trained on are refused")
    imported.add_argument("--model", metavar="PATH", help="the server's base model (CARTRIDGES_MODEL)")
    imported.add_argument("--data-dir", help="store directory (CARTRIDGES_DATA_DIR; default ./cartridges-data)")
    imported.set_defaults(run=run_import)


def export_format(out: str, requested: str | None) -> str:
    if requested:
        return requested
    suffix = Path(out).suffix.lower()
    return {".pt": "pt", ".safetensors": "safetensors"}.get(suffix, "peft")


def run_export(args: argparse.Namespace) -> int:
    from ..cartridge import CartridgeFileError, PartsFileError, UnexportableError, load_cartridge

    base_model = args.base_model
    try:
        if Path(args.source).exists():
            cartridge = load_cartridge(args.source)
        else:
            cartridge, model_id = _stored_cartridge(args)
            base_model = base_model or model_id
    except PartsFileError:
        print(f"error: {args.source} was trained in parts, which only the cartridge file holds; the export formats "
              "hold one cartridge", file=sys.stderr)
        return 1
    except (CartridgeFileError, LookupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    fmt = export_format(args.out, args.format)
    try:
        _write(cartridge, args.out, fmt, base_model)
    except (OSError, RuntimeError) as error:  # an unwritable or missing directory (torch.save: RuntimeError)
        print(f"error: cannot write {args.out}: {error}", file=sys.stderr)
        return 1
    except UnexportableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({fmt}, {cartridge.num_tokens} tokens)", file=sys.stderr)
    return 0


def _write(cartridge: Any, out: str, fmt: str, base_model: str | None) -> None:
    if fmt == "pt":
        cartridge.export_pt(out)
    elif fmt == "safetensors":
        cartridge.save(out)
    elif out.lower().endswith(".zip"):
        from ..peft_adapter import save_peft_zip

        save_peft_zip(cartridge, out, base_model=base_model)
    else:
        cartridge.to_peft(out, base_model=base_model)


def _stored_cartridge(args: argparse.Namespace) -> tuple[Any, str]:
    """A datablock's cartridge from the store, and its model id. LookupError when there is none."""
    from ..cartridge import Cartridge
    from ..server.settings import Settings
    from ..store import core, open_store

    try:
        settings = Settings.from_env(data_dir=args.data_dir)
    except ValueError as error:  # a CARTRIDGES_* variable that does not parse
        raise LookupError(str(error)) from None
    if not Path(settings.data_dir).is_dir():  # opening the store would create one there
        raise LookupError(f"'{args.source}' is neither a file nor a datablock (no store at {settings.data_dir})")
    store = open_store(settings.data_dir, database_url=settings.database_url, blob_url=settings.blob_url)
    try:
        admin = core().Owner(0, True)
        try:
            record = store.get_datablock(admin, args.source)
        except core().NotFoundError:
            raise LookupError(f"'{args.source}' is neither a file nor a datablock in {settings.data_dir}") from None
        if record.status != "succeeded":
            raise LookupError(f"datablock '{record.id}' has no cartridge (status: {record.status})")
        return Cartridge.load(store.datablock_cartridge_path(admin, record.id)), record.model
    finally:
        store.close()


def run_import(args: argparse.Namespace) -> int:
    from ..cartridge import CartridgeFileError, cartridges_to_bytes, load_cartridges
    from ..models.default import base_model_id
    from ..parts import check_trained_on, recorded_cut, texts_of_recorded_parts
    from ..selfstudy.chunking import named_texts
    from ..server.settings import Settings
    from ..store import core, open_store
    from . import load_model_or_report

    try:
        settings = Settings.from_env(data_dir=args.data_dir, **({"model": args.model} if args.model else {}))
    except ValueError as error:  # a CARTRIDGES_* variable that does not parse
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not Path(args.source).exists():
        print(f"error: {args.source}: no such file", file=sys.stderr)
        return 1
    model = load_model_or_report(settings.model)
    if model is None:
        return 1
    try:
        cartridges = load_cartridges(args.source, model)
    except CartridgeFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    num_tokens = sum(c.num_tokens for c in cartridges)
    config: dict[str, Any] = {"num_tokens": num_tokens, "imported_from": Path(args.source).name}
    metrics: dict[str, Any] = {}
    if len(cartridges) > 1:  # a cartridge trained in parts: served as one, its part found by search or by mixture
        config["parts"] = True
        if recorded_cut(cartridges) is not None:
            config["part_tokens"] = recorded_cut(cartridges)
        metrics["parts"] = [{"corpus_tokens": None, "num_tokens": c.num_tokens, "num_samples": c.config.get("num_samples"),
                             "loss": None, "quality": c.quality, "signal_by_part": None} for c in cartridges]
    store = open_store(settings.data_dir, database_url=settings.database_url, blob_url=settings.blob_url)
    try:
        user = store.find_user(args.user)
        if user is None:
            print(f"error: no user '{args.user}' (create one with `cartridges keys create --user {args.user}`)",
                  file=sys.stderr)
            return 1
        if args.training_files:  # searched or retrieved from: the text it was trained on, where it says which
            owner = core().Owner(user.id, False)
            files = [store.get_file(owner, file_id) for file_id in args.training_files]
            texts = named_texts([(f.filename, store.file_text(owner, f.id)) for f in files])
            if "part_tokens" in config:  # the parts must be searched in their own text
                texts_of_recorded_parts(model.tokenizer, texts, cartridges)
            elif len(cartridges) == 1:
                check_trained_on(cartridges[0], texts)
        blob = store.begin_blob()
        blob.write(cartridges_to_bytes(cartridges))
        done = {"stage": "done", "completed": 0, "total": 0, "eta_seconds": 0}
        model_path = str(Path(settings.model).resolve()) if settings.model else ""
        record = store.import_datablock(
            core().Owner(user.id, False), project=args.name, model=base_model_id(settings.model),
            model_path=model_path, config=json.dumps(config), num_tokens=num_tokens,
            fingerprint=cartridges[0].fingerprint, cartridge=blob, progress=json.dumps(done),
            metrics=json.dumps(metrics), training_files=args.training_files)
    except core().NotFoundError as error:  # a training file that is not the user's
        print(f"error: {error} of user '{args.user}' (upload it with POST /v1/files and give its id)", file=sys.stderr)
        return 1
    except (ValueError, core().StoreError) as error:  # files unprocessed, unreadable or not the parts' text
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(record.id)
    what = f"{num_tokens}-token cartridge" if len(cartridges) == 1 else f"cartridge in {len(cartridges)} parts"
    print(f"(a {what} of user '{args.user}'; chat with model='{record.id}')", file=sys.stderr)
    if len(cartridges) > 1 and not (args.training_files and "part_tokens" in config):
        why = "without --training-files" if "part_tokens" in config else "its parts do not record their cut"
        print(f"its parts answer by mixture, not by search ({why})", file=sys.stderr)
    return 0
