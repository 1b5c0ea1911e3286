"""PEFT CARTRIDGE adapters through the server (docs/formats.md): an adapter made by PEFT,
added with `cartridges import`, answers through /v1/chat/completions as PEFT's own generate
does; a datablock downloads as a PEFT adapter (owner only) that PEFT loads to the same
distribution, and `cartridges export` writes the same."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cartridges import Cartridge
from peft_adapters import PEFT_WARNINGS, hf_model, make_peft_adapter

from .conftest import LiveServer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, PEFT_WARNINGS]
TOL = 1e-4
MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cartridges.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def imported(chat_server: LiveServer, tiny_model_dir: Path, tokenizer, tmp_path_factory) -> dict:
    """A PEFT-made adapter, imported for a new user through the CLI."""
    out = tmp_path_factory.mktemp("peft") / "adapter"
    made, _ = make_peft_adapter(tiny_model_dir, tokenizer, out)
    name = "peft-user"
    key = chat_server.add_user(name)
    done = cli("import", str(out), "--user", name, "--name", "bells", "--model", str(chat_server.model),
               "--data-dir", str(chat_server.data_dir))
    assert done.returncode == 0, done.stderr
    return {"key": key, "id": done.stdout.strip(), "model": made, "dir": out}


def test_a_peft_adapter_serves_as_peft_generates(chat_server: LiveServer, imported: dict, tokenizer) -> None:
    assert imported["id"].startswith("peft-user/bells/")
    client = chat_server.openai(imported["key"])
    block = chat_server.http(imported["key"]).get(f"/v1/datablocks/{imported['id']}").json()
    assert block["status"] == "succeeded" and block["imported_from"] == "adapter" and block["num_tokens"] == 12
    reply = client.chat.completions.create(model=imported["id"], messages=MESSAGES, temperature=0, max_tokens=8)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=False)
    with torch.no_grad():
        generated = imported["model"].generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                               max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(generated[0, prompt.shape[1]:], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    # without the cartridge the answer differs: the adapter is what made it
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content != expected


def test_a_datablock_downloads_as_a_peft_adapter(chat_server: LiveServer, imported: dict, tiny_model_dir: Path,
                                                tokenizer, tmp_path: Path) -> None:
    http = chat_server.http(imported["key"])
    response = http.get(f"/v1/datablocks/{imported['id']}/content", params={"format": "peft"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    assert response.headers["content-disposition"].endswith('-peft.zip"')
    zipfile.ZipFile(io.BytesIO(response.content)).extractall(tmp_path / "download")
    downloaded = peft.PeftModel.from_pretrained(hf_model(tiny_model_dir), str(tmp_path / "download")).eval()
    tokens = torch.tensor([tokenizer("The second bell")["input_ids"]])
    with torch.no_grad():
        diff = (downloaded(input_ids=tokens).logits - imported["model"](input_ids=tokens).logits).abs().max()
    assert diff.item() <= TOL

    stored = Cartridge.from_peft(imported["dir"])
    raw = http.get(f"/v1/datablocks/{imported['id']}/content")
    assert raw.status_code == 200
    (tmp_path / "c.safetensors").write_bytes(raw.content)
    assert all(torch.equal(a, b) for a, b in zip(Cartridge.load(tmp_path / "c.safetensors").keys, stored.keys))
    pt = http.get(f"/v1/datablocks/{imported['id']}/content", params={"format": "pt"})
    (tmp_path / "c.pt").write_bytes(pt.content)
    assert all(torch.equal(a, b) for a, b in zip(Cartridge.import_pt(tmp_path / "c.pt").values, stored.values))

    # the CLI writes the same adapter from the store
    done = cli("export", imported["id"], str(tmp_path / "exported"), "--data-dir", str(chat_server.data_dir))
    assert done.returncode == 0, done.stderr
    # (safetensors writes its metadata in no fixed order: compare what the files hold, not their bytes)
    exported, downloaded_files = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("exported", "download"))
    assert torch.equal(exported["prompt_embeddings"], downloaded_files["prompt_embeddings"])
    assert (tmp_path / "exported" / "adapter_config.json").read_text() == \
        (tmp_path / "download" / "adapter_config.json").read_text()


def test_downloads_are_the_owners_only_and_need_a_cartridge(chat_server: LiveServer, imported: dict) -> None:
    other = chat_server.http(chat_server.add_user())
    for fmt in ("peft", "safetensors", "pt"):
        response = other.get(f"/v1/datablocks/{imported['id']}/content", params={"format": fmt})
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    bad = chat_server.http(imported["key"]).get(f"/v1/datablocks/{imported['id']}/content", params={"format": "gguf"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"


def test_import_refuses_what_does_not_fit(chat_server: LiveServer, imported: dict, tmp_path: Path) -> None:
    wrong = Cartridge([torch.randn(3, 4, 8)] * 2, [torch.randn(3, 4, 8)] * 2).to_peft(tmp_path / "wrong")
    chat_server.add_user("importer")
    done = cli("import", str(wrong), "--user", "importer", "--model", str(chat_server.model),
               "--data-dir", str(chat_server.data_dir))
    assert done.returncode == 1 and "error:" in done.stderr
    missing = cli("import", str(tmp_path / "nothing"), "--user", "importer", "--model", str(chat_server.model),
                  "--data-dir", str(chat_server.data_dir))
    assert missing.returncode == 1 and "error:" in missing.stderr
    unwritable = cli("export", str(imported["dir"]), str(tmp_path / "no" / "such" / "dir" / "c.pt"))
    assert unwritable.returncode == 1 and "cannot write" in unwritable.stderr
    unknown = cli("export", "alice/none/zzzzzzzzzzzz", str(tmp_path / "x"), "--data-dir", str(chat_server.data_dir))
    assert unknown.returncode == 1 and "neither a file nor a datablock" in unknown.stderr
    nobody = cli("import", str(imported["dir"]), "--user", "nobody", "--model", str(chat_server.model),
                 "--data-dir", str(chat_server.data_dir))
    assert nobody.returncode == 1 and "no user 'nobody'" in nobody.stderr


def test_a_compacted_cartridge_serves_and_downloads_only_as_a_cartridge_file(
        chat_server: LiveServer, imported: dict, tmp_path: Path) -> None:
    """A cartridge with attention biases (as compaction makes) is imported, answers chat with
    its biases (another reply than without them), and downloads as a cartridge file; PEFT and
    `.pt`, which cannot hold the biases, are refused with a 400 that names the way out."""
    made = Cartridge.from_peft(imported["dir"])
    biased = Cartridge(made.keys, made.values, made.num_frozen, made.fingerprint, made.config,
                       biases=[torch.full(k.shape[:2], 4.0) for k in made.keys])
    biased.save(tmp_path / "biased.safetensors")
    key = chat_server.add_user("compactor")
    done = cli("import", str(tmp_path / "biased.safetensors"), "--user", "compactor", "--name", "compact",
               "--model", str(chat_server.model), "--data-dir", str(chat_server.data_dir))
    assert done.returncode == 0, done.stderr
    block_id = done.stdout.strip()
    http = chat_server.http(key)
    for fmt in ("peft", "pt"):
        refused = http.get(f"/v1/datablocks/{block_id}/content", params={"format": fmt})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "format_unavailable" and error["param"] == "format"
        assert "attention biases" in error["message"] and "format=safetensors" in error["message"]
    raw = http.get(f"/v1/datablocks/{block_id}/content")
    assert raw.status_code == 200
    (tmp_path / "back.safetensors").write_bytes(raw.content)
    assert Cartridge.load(tmp_path / "back.safetensors") == biased
    exported = cli("export", block_id, str(tmp_path / "adapter"), "--data-dir", str(chat_server.data_dir))
    assert exported.returncode == 1 and "attention biases" in exported.stderr

    client = chat_server.openai(key)
    with_biases = client.chat.completions.create(model=block_id, messages=MESSAGES, temperature=0, max_tokens=8)
    without = chat_server.openai(imported["key"]).chat.completions.create(
        model=imported["id"], messages=MESSAGES, temperature=0, max_tokens=8)
    assert with_biases.choices[0].message.content != without.choices[0].message.content
