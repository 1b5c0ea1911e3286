"""The Cartridge object: exactness of the corpus initialization, files (.safetensors and the
research .pt format) and their refusals, generation with several cartridges."""

from __future__ import annotations

import pytest
import torch

import cartridges_core
from cartridges.cartridge import Cartridge, CartridgeFileError, load_cartridge
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.training import init_params, spread_tokens

from .tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def corpus_cartridge(model, text: str, num_tokens: int = 64) -> Cartridge:
    corpus = Corpus.from_texts(model.tokenizer, [text])
    params = init_params(model, corpus, TrainConfig(num_tokens=num_tokens))
    return Cartridge.from_params(params, model.fingerprint, {"num_tokens": num_tokens})


def trained_like(model, seed: int = 0) -> Cartridge:
    """A cartridge whose tensors are not those of any text (as after training)."""
    c = corpus_cartridge(model, "Some text to start from.")
    g = torch.Generator().manual_seed(seed)
    return Cartridge([k + torch.randn(k.shape, generator=g) for k in c.keys],
                     [v + torch.randn(v.shape, generator=g) for v in c.values], 1, c.fingerprint, c.config)


def test_untrained_corpus_cartridge_equals_corpus_in_context(model):
    text = "The lighthouse of Varnholm was lit in 1731."
    cart = corpus_cartridge(model, text)  # the corpus fits in num_tokens
    corpus = model.tokenizer.encode(text)
    assert cart.num_tokens == len(corpus) and cart.num_frozen == 1
    conversation = model.tokenizer.encode_chat([{"role": "user", "content": "When was it lit?"}])
    in_context = model.native.forward(torch.tensor([corpus + conversation]))[0, len(corpus):]
    with_cartridge = model.native.forward(torch.tensor([conversation]), prefixes=[[cart.prefix(model)]])[0]
    assert (in_context - with_cartridge).abs().max() <= 1e-4


def test_spread_initialization_takes_runs_from_all_over_the_corpus(model):
    corpus = Corpus(list(range(1000)))
    tokens = spread_tokens(corpus, 250)
    assert len(tokens) == len(set(tokens)) == 250
    assert tokens[:32] == list(range(32)) and tokens[-31:] == list(range(969, 1000))  # first and last runs
    assert sum(b != a + 1 for a, b in zip(tokens, tokens[1:])) == 7  # 8 runs
    assert spread_tokens(Corpus(list(range(100))), 256) == list(range(100))  # a short corpus whole
    text = "The lighthouse of Varnholm was lit in 1731. " * 40
    params = init_params(model, Corpus.from_texts(model.tokenizer, [text]), TrainConfig(num_tokens=64, init="spread"))
    assert params.num_tokens == 64


def test_generation_with_several_cartridges_equals_texts_in_context(model):
    a, b = "First part: the key is blue.", " Second part: the door is red."
    ta = model.tokenizer.encode(a)
    first = corpus_cartridge(model, a)
    # The second cartridge continues after the first (positions |a|..): built from the joined KV.
    both = corpus_cartridge(model, a + b)
    second = Cartridge([k[:, len(ta):] for k in both.keys], [v[:, len(ta):] for v in both.values], 0, model.fingerprint)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "Colors?"}])
    both_prefixes = [first.prefix(model), second.prefix(model)]
    kwargs = dict(max_new_tokens=12, stop_token_ids=[])
    composed = [model.engine.submit(p, prefixes=[first, second], composition="concatenate", **kwargs)
                for p in (prompt, prompt[:5])]
    text = model.tokenizer.encode(a + b)
    plain = [model.engine.submit(text + p, **kwargs) for p in (prompt, prompt[:5])]
    assert [s.result().tokens for s in composed] == [s.result().tokens for s in plain]
    assert first.prefix(model) is both_prefixes[0]  # made once, shared by every request


def test_save_load_round_trip_is_exact(model, tmp_path):
    cart = trained_like(model)
    cart.config = {"lr": 0.02, "seed": 3}
    path = tmp_path / "c.safetensors"
    cart.save(path)
    loaded = Cartridge.load(path, model)
    assert loaded == cart
    assert all(torch.equal(x, y) for x, y in zip(loaded.keys + loaded.values, cart.keys + cart.values))
    assert loaded.config == {"lr": 0.02, "seed": 3} and loaded.fingerprint == model.fingerprint
    half = cart.to(torch.bfloat16)
    half.save(path)
    assert Cartridge.load(path, model).dtype == torch.bfloat16
    assert Cartridge.load(path) == half
    # The continued-training copy carries the same tensors.
    params = cart.to_params()
    assert Cartridge.from_params(params, cart.fingerprint, cart.config) == cart


def test_pt_import_export_round_trip_is_exact(model, tmp_path):
    cart = trained_like(model, seed=1)
    path = tmp_path / "research.pt"
    cart.export_pt(path)
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"trainable_keys", "trainable_values", "frozen_keys", "frozen_values"}
    assert tuple(raw["trainable_keys"][0].shape) == (1, cart.num_kv_heads, cart.num_tokens - 1, cart.head_dim)
    assert tuple(raw["frozen_values"][1].shape) == (1, cart.num_kv_heads, 1, cart.head_dim)
    back = load_cartridge(path, model)
    assert back.num_frozen == 1 and back.fingerprint == model.fingerprint
    assert all(torch.equal(x, y) for x, y in zip(back.keys + back.values, cart.keys + cart.values))
    back.export_pt(tmp_path / "again.pt")
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    for name in raw:
        assert all(torch.equal(x, y) for x, y in zip(raw[name], again[name]))


def biased_like(model, seed: int = 2) -> Cartridge:
    """A trained-like cartridge with attention biases, as compaction gives."""
    c = trained_like(model, seed)
    g = torch.Generator().manual_seed(seed)
    c.biases = [torch.randn(k.shape[:2], generator=g) for k in c.keys]
    return c


def test_attention_biases_travel_with_the_cartridge(model, tmp_path):
    cart = biased_like(model)
    path = tmp_path / "biased.safetensors"
    cart.save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format_version"] == "2" and "layers.1.bias" in set(f.keys())
    loaded = Cartridge.load(path, model)
    assert loaded == cart and all(torch.equal(a, b) for a, b in zip(loaded.biases, cart.biases))
    assert loaded != trained_like(model, seed=2)  # the same KV without the biases is another cartridge
    assert cart.nbytes == trained_like(model, seed=2).nbytes + sum(b.numel() * 4 for b in cart.biases)
    # bfloat16 KV keeps float32 biases; continued training keeps them as they are
    half = cart.to(torch.bfloat16)
    assert half.biases[0].dtype == torch.float32
    half.save(path)
    assert Cartridge.load(path, model) == half
    params = cart.to_params()
    assert all(torch.equal(a, b) for a, b in zip(params.biases, cart.biases))
    assert Cartridge.from_params(params, cart.fingerprint, cart.config) == cart
    prefix = cart.prefix(model)
    assert all(torch.equal(a, b) for a, b in zip(prefix.biases, cart.biases))
    # a file without biases stays version 1
    trained_like(model).save(tmp_path / "plain.safetensors")
    with safe_open(str(tmp_path / "plain.safetensors"), framework="pt") as f:
        assert f.metadata()["format_version"] == "1"


def test_biases_change_what_the_model_reads_on_every_path(model):
    """The engine (packed steps) and the forward (training, scoring) add a cartridge's biases
    alike; a zero bias is no bias, and a large one on every key moves the model's predictions."""
    from cartridges.cartridge import Cartridge as C

    plain = trained_like(model, seed=3)
    zero = C(plain.keys, plain.values, 1, plain.fingerprint, plain.config,
             biases=[torch.zeros(k.shape[:2]) for k in plain.keys])
    loud = C(plain.keys, plain.values, 1, plain.fingerprint, plain.config,
             biases=[torch.full(k.shape[:2], 3.0) for k in plain.keys])
    prompt = model.tokenizer.encode("The lighthouse")

    def last_logits(cart):
        return model.native.forward(torch.tensor([prompt]), prefixes=[[cart.prefix(model)]])[0, -1]

    assert torch.allclose(last_logits(zero), last_logits(plain), atol=1e-5)
    assert not torch.allclose(last_logits(loud), last_logits(plain), atol=1e-3)
    # the engine's decode reads the same numbers as the forward: its logprobs equal the forward's
    for cart in (plain, loud):
        out = model.engine.submit(prompt, prefixes=[cart], max_new_tokens=4, stop_token_ids=[], logprobs=1).result()
        tokens = prompt + out.tokens
        logits = model.native.forward(torch.tensor([tokens]), prefixes=[[cart.prefix(model)]])[0]
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(out.tokens)[:, None])[:, 0]
        got = torch.tensor([entry.logprob for entry in out.logprobs])
        assert torch.allclose(got, expected, atol=1e-3), (got, expected)


def test_biased_cartridges_refuse_formats_without_biases(model, tmp_path):
    cart = biased_like(model)
    from cartridges.cartridge import UnexportableError

    with pytest.raises(UnexportableError, match="attention biases"):
        cart.export_pt(tmp_path / "c.pt")
    with pytest.raises(UnexportableError, match="PEFT adapter"):
        cart.to_peft(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_the_parts_of_a_corpus_are_one_file_read_as_a_list(model, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from cartridges.cartridge import PartsFileError, cartridges_to_bytes, load_cartridges, save_cartridges

    parts = [trained_like(model, seed=1), biased_like(model), trained_like(model, seed=3).to(torch.bfloat16)]
    parts[0].config = {"part": 1}
    parts[1].stats = {"quality": {"recovered": 0.5}}
    path = tmp_path / "parts.safetensors"
    save_cartridges(parts, path)
    loaded = load_cartridges(path, model)
    (tmp_path / "blob.safetensors").write_bytes(cartridges_to_bytes(parts))  # what a datablock's blob holds
    assert load_cartridges(tmp_path / "blob.safetensors") == parts
    assert loaded == parts and loaded[0].config == {"part": 1} and loaded[1].quality == {"recovered": 0.5}
    assert loaded[2].dtype == torch.bfloat16 and loaded[1].biases is not None
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format_version"] == "3" and f.metadata()["num_parts"] == "3"
    # One cartridge's reader refuses it (concatenated, parts trained apart lose half their gain)...
    with pytest.raises(PartsFileError, match="3 parts.*load_cartridges"):
        Cartridge.load(path, model)
    # ... and load_cartridges reads one cartridge's file as a list of one.
    save_cartridges(parts[:1], tmp_path / "one.safetensors")
    assert Cartridge.load(tmp_path / "one.safetensors") == parts[0]
    assert load_cartridges(tmp_path / "one.safetensors") == parts[:1]
    # Every part is checked: a damaged tensor, a part for another model, a tensor outside the parts.
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors["parts.1.layers.0.values"] = tensors["parts.1.layers.0.values"] + 1
    save_file(tensors, str(tmp_path / "damaged.safetensors"), metadata=meta)
    with pytest.raises(CartridgeFileError, match="part 2 of 3: checksum mismatch"):
        load_cartridges(tmp_path / "damaged.safetensors")
    with pytest.raises(CartridgeFileError, match="part 1 of 3: cartridge was trained for model"):
        load_cartridges(path, tiny_model(seed=1))
    tensors = load_file(str(path))
    tensors["parts.3.layers.0.keys"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "extra.safetensors"), metadata=meta)
    with pytest.raises(CartridgeFileError, match="outside its 3 parts"):
        load_cartridges(tmp_path / "extra.safetensors")
    save_file(load_file(str(path)), str(tmp_path / "nometa.safetensors"), metadata={**meta, "parts": "[]"})
    with pytest.raises(CartridgeFileError, match="does not describe its 3 parts"):
        load_cartridges(tmp_path / "nometa.safetensors")
    # One cartridge's bytes are its own file's (what `Cartridge.load` reads); none is refused.
    (tmp_path / "one_blob.safetensors").write_bytes(cartridges_to_bytes(parts[:1]))
    assert Cartridge.load(tmp_path / "one_blob.safetensors") == parts[0]
    with pytest.raises(ValueError, match="no cartridges"):
        cartridges_to_bytes([])


def test_bad_files_are_refused(model, tmp_path):
    cart = trained_like(model)
    path = tmp_path / "c.safetensors"
    cart.save(path)
    data = path.read_bytes()

    other = tiny_model(seed=1)  # same shapes, other weights
    with pytest.raises(CartridgeFileError, match="trained for model"):
        Cartridge.load(path, other)
    wider = tiny_model(context=512)
    wider.native = cartridges_core.LlamaModel(
        _with(wider.config, num_layers=3), _three_layers(wider.weights), "cpu", "float32"
    )
    with pytest.raises(CartridgeFileError, match="does not fit"):
        Cartridge.load(path, wider)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(CartridgeFileError, match="truncated or damaged"):
        Cartridge.load(truncated, model)

    flipped = bytearray(data)
    flipped[-5] ^= 0x40  # inside the last tensor's bytes
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(flipped))
    with pytest.raises(CartridgeFileError, match="checksum"):
        Cartridge.load(damaged, model)

    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(CartridgeFileError, match="not a cartridge"):
        Cartridge.load(tmp_path / "weights.safetensors", model)
    with pytest.raises(CartridgeFileError, match="no such file"):
        Cartridge.load(tmp_path / "absent.safetensors", model)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(CartridgeFileError, match="not a readable"):
        Cartridge.import_pt(tmp_path / "junk.pt", model)


def _with(config, **changes):
    c = cartridges_core.LlamaConfig()
    for name in dir(config):
        if not name.startswith("_") and name != "validate":
            setattr(c, name, getattr(config, name))
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def _three_layers(weights):
    w = dict(weights)
    for name, t in weights.items():
        if name.startswith("model.layers.0."):
            w[name.replace("layers.0.", "layers.2.")] = t
    return w


def test_train_and_chat_commands(model, tmp_path, monkeypatch, capsys):
    import io

    import cartridges.model
    from cartridges.cli import main

    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: model)
    (tmp_path / "doc.txt").write_text("The harbor of Tessel opens at dawn. " * 6)
    out = tmp_path / "cart.safetensors"
    args = ["train", str(tmp_path / "doc.txt"), "--out", str(out), "--num-tokens", "16", "--num-samples", "2",
            "--objective", "next_token", "--no-progress", "--seed", "3"]
    assert main(args) == 0
    cart = Cartridge.load(out, model)
    assert cart.num_tokens == 16 and cart.config["seed"] == 3 and cart.config["objective"] == "next_token"
    assert "wrote" in capsys.readouterr().err

    class Chatty:  # the chat command's needs, on the tiny model
        name = "tiny"
        fingerprint = model.fingerprint
        native = model.native

        def stream_chat(self, messages, cartridges=(), composition="mixture", **kw):
            assert [p.num_tokens for p in cartridges] == [16, 16]
            yield f"ok {composition}"

    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: Chatty())
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--cartridge", str(out), "--cartridge", str(out)]) == 0
    assert "ok mixture" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--cartridge", str(out), "--cartridge", str(out), "--composition", "concatenate"]) == 0
    assert "ok concatenate" in capsys.readouterr().out
    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: pytest.fail("loaded the model"))
    assert main(["chat", "--cartridge", str(tmp_path / "nope.safetensors")]) == 1  # checked before the model loads
    assert "no such cartridge file" in capsys.readouterr().err
    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: Chatty())
    out.write_bytes(out.read_bytes()[:-8])
    assert main(["chat", "--cartridge", str(out)]) == 1
    err = capsys.readouterr().err
    assert "truncated or damaged" in err or "checksum" in err


def test_train_command_takes_the_device_the_model_trains_on(model, tmp_path, monkeypatch, capsys):
    """--device: auto (the default) is cuda when torch sees a GPU; cuda without one is refused
    before anything loads, with what to do instead."""
    import cartridges.model
    from cartridges.cli import main

    devices = []
    monkeypatch.setattr(cartridges.model, "load_model",
                        lambda path=None, device="cpu", **kw: devices.append(device) or model)
    (tmp_path / "doc.txt").write_text("The harbor of Tessel opens at dawn. " * 6)
    base = ["train", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "c.safetensors"), "--num-tokens", "16",
            "--num-samples", "2", "--objective", "next_token", "--no-progress"]
    assert main(base + ["--device", "cpu"]) == 0 and main(base) == 0
    assert devices == ["cpu", "cuda" if torch.cuda.is_available() else "cpu"]
    assert "loading model (cpu)" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(base + ["--device", "cuda"]) == 1
    assert "sees no CUDA device" in capsys.readouterr().err and len(devices) == 2
    with pytest.raises(SystemExit):
        main(base + ["--device", "tpu"])


def test_chat_command_takes_a_device_for_a_local_model_only(model, monkeypatch, capsys):
    import io

    import cartridges.model
    from cartridges.cli import main

    class Chatty:  # the chat command's needs, on the tiny model
        name = "tiny"
        fingerprint = model.fingerprint
        native = model.native

        def stream_chat(self, messages, cartridges=(), composition="mixture", **kw):
            yield "ok"

    devices = []
    monkeypatch.setattr(cartridges.model, "load_model",
                        lambda path=None, device="cpu", **kw: devices.append(device) or Chatty())
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--device", "cpu"]) == 0 and devices == ["cpu"]
    assert "ok" in capsys.readouterr().out
    assert main(["chat", "--server", "http://127.0.0.1:9", "--device", "cpu"]) == 2
    assert "--device is for a local model" in capsys.readouterr().err and devices == ["cpu"]


def test_train_command_refuses_what_would_fail_late_or_destroy_a_file(model, tmp_path, monkeypatch, capsys):
    """Checked before the model loads: a training of hours must not end in a traceback at
    save time, nor overwrite the user's documents."""
    import cartridges.model
    from cartridges.cli import main

    loaded = []
    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: loaded.append(1) or model)
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbor of Tessel opens at dawn. " * 6)
    (tmp_path / "empty.md").write_text("  \n")
    (tmp_path / "bad.pdf").write_bytes(b"%PDF-1.4\nnot really a pdf")
    base = ["train", str(doc), "--num-tokens", "16", "--num-samples", "2", "--objective", "next_token",
            "--no-progress"]
    cases = [
        (["--out", str(tmp_path / "nodir" / "c.safetensors")], 2, "does not exist"),
        (["--out", str(doc)], 2, "one of the input files"),
        (["--out", str(tmp_path)], 2, "is a directory"),
        (["--out", str(tmp_path / "c.safetensors"), "--checkpoint", str(doc)], 2, "one of the input files"),
        (["--out", str(tmp_path / "c.safetensors"), "--resume"], 2, "--resume needs --checkpoint"),
    ]
    for extra, status, message in cases:
        assert main(base + extra) == status, extra
        assert message in capsys.readouterr().err, extra
    for name, message in (("empty.md", "empty, no text"), ("bad.pdf", "not a readable PDF")):
        assert main(["train", str(doc), str(tmp_path / name), "--out", str(tmp_path / "c.safetensors")]) == 1
        assert message in capsys.readouterr().err
    assert loaded == [] and doc.read_text().startswith("The harbor")  # no model loaded, nothing overwritten
    assert not (tmp_path / "c.safetensors").exists()


def test_a_run_without_resume_never_removes_a_file_it_did_not_write(model, tmp_path):
    """Starting over removes an earlier run's checkpoint, recognized by its key file, and never a
    file of the user's that happens to sit at the checkpoint path."""
    import cartridges

    config = TrainConfig(num_tokens=16, num_samples=2, objective="next_token", checkpoint_every=1)
    theirs = tmp_path / "notes.ckpt"
    theirs.write_text("the user's own file")
    cartridges.train(model, "The harbor of Tessel opens at dawn. " * 6, config, progress=False,
                     checkpoint=tmp_path / "other.ckpt")
    assert (tmp_path / "other.ckpt").exists() and (tmp_path / "other.ckpt.key").exists()
    (tmp_path / "notes.ckpt.data.pt").write_text("stale")  # ours by its name: removed
    from cartridges.training import _claim_checkpoint

    _claim_checkpoint(theirs, "key", resume=False)
    assert theirs.read_text() == "the user's own file" and not (tmp_path / "notes.ckpt.data.pt").exists()
    _claim_checkpoint(tmp_path / "other.ckpt", "key", resume=False)  # our earlier run's: its key says so
    assert not (tmp_path / "other.ckpt").exists()
