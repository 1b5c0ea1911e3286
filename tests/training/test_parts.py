"""A corpus far beyond the context as parts (cartridges.parts): where it is cut, what each part
holds, and a cartridge trained per part, by the library and by `cartridges train --parts`."""

import io

import pytest

from cartridges.cartridge import Cartridge
from cartridges.parts import PartSearch, corpus_parts, remaining_estimate, train_parts
from cartridges.selfstudy import TrainConfig


class Words:
    """A tokenizer of one token per word: sizes that are easy to reason about."""

    def encode(self, text):
        return text.split()


def manual(sections=12, paragraphs=4, words=40):
    """A markdown corpus: a title and opening paragraph, then "## N." sections of "###"
    subsections and paragraphs of `words` words."""
    out = ["# The Harbour Manual", "The rules of the harbour of Tessel, section by section."]
    for n in range(1, sections + 1):
        out.append(f"## {n}. Section {n}")
        for k in range(paragraphs):
            if k == 2:
                out.append(f"### Subsection {n}.{k}")
            out.append(" ".join(f"s{n}p{k}w{i}" for i in range(words)))
    return "\n\n".join(out)


def test_parts_cut_before_section_headings_into_near_equal_parts_each_with_the_opening():
    text = manual()
    total = len(text.split())
    parts = corpus_parts(Words(), text, 600)
    assert len(parts) == -(-total // 600)  # the fewest parts of about the limit
    opening = "# The Harbour Manual\n\nThe rules of the harbour of Tessel, section by section."
    assert all(p.startswith(opening + "\n\n## ") for p in parts)  # at a section, never a subsection
    bodies = [p[len(opening) + 2:] for p in parts]
    assert "\n\n".join([opening, *bodies]) == text  # every section once, whole and in order
    sizes = [len(p.split()) for p in parts]
    assert max(sizes) <= 1.25 * min(sizes)
    # A corpus within the limit is one part, the corpus as it is; several texts join as a corpus joins them.
    assert corpus_parts(Words(), text, 10 ** 6) == [text]
    assert corpus_parts(Words(), ["one two", "", "three"], 100) == ["one two\n\nthree"]
    with pytest.raises(ValueError, match="at least 64"):
        corpus_parts(Words(), text, 10)


def test_several_files_are_cut_between_files_when_one_ends_near_the_share():
    from cartridges.selfstudy.chunking import named_texts

    files = [(f"file{n}.md", manual(sections=3, paragraphs=2, words=30)) for n in range(4)]
    parts = corpus_parts(Words(), named_texts(files), 500)  # four files of 208 words: two parts
    opening = "# file0.md\n\n# The Harbour Manual\n\nThe rules of the harbour of Tessel, section by section."
    assert len(parts) == 2 and parts[1].startswith(opening + "\n\n# file2.md\n\n")


def test_a_corpus_without_headings_or_paragraphs_is_cut_between_lines_then_words():
    lines = "\n".join(" ".join(f"l{n}w{i}" for i in range(30)) for n in range(100))  # one paragraph, 3,000 words
    parts = corpus_parts(Words(), lines, 1000)
    assert len(parts) == 3 and "\n".join(parts) == lines  # whole lines: no opening to repeat, none lost
    assert all(abs(len(p.split()) - 1000) <= 250 for p in parts)
    words = " ".join(f"w{i}" for i in range(2500))  # one line
    parts = corpus_parts(Words(), words, 1000)
    assert len(parts) == 3 and " ".join(parts) == words


def test_the_part_a_question_is_about_is_found_by_its_words():
    parts = corpus_parts(Words(), manual(), 600)
    search = PartSearch(Words(), parts)
    assert search.parts == len(parts) >= 3
    for n in range(1, 13):
        holding = [j for j, text in enumerate(parts) if f"## {n}. Section {n}" in text]
        assert search.find(f"What does s{n}p1w7 follow in section {n}?") == holding[:1]
    assert search.find_many(["What is it?", "s12p3w0"]) == [[], [len(parts) - 1]]  # stop words alone: no part
    # A passage two parts share ties them: both parts.
    assert sorted(PartSearch(Words(), ["the quay rules", "the quay rules", "the tide tables"]).find("quay")) == [0, 1]
    # With a looser tie, a near one brings the other part too, the better first; a clear lead does not.
    near = PartSearch(Words(), parts, near_tie=0.9)
    tie = near.find("s1p0w3 s12p0w3")
    assert sorted(tie) == [0, len(parts) - 1] and search.find("s1p0w3 s12p0w3") == tie[:1]
    assert near.find("s1p0w3 s12p0w3 s12p0w5") == [len(parts) - 1]


def test_a_cartridge_is_trained_per_part(model, tmp_path):
    text = manual(sections=4, paragraphs=2, words=30)  # 1,993 characters: the tiny model's tokens
    config = TrainConfig(num_tokens=8, num_samples=2, objective="next_token", seed=1)
    trained = []
    carts = train_parts(model, text, config, max_part_tokens=1500, progress=False,
                        checkpoint=tmp_path / "ck", on_trained=lambda j, k, c: trained.append((j, k, c.num_tokens)))
    assert len(carts) == 2 and trained == [(1, 2, 8), (2, 2, 8)]
    assert all(isinstance(c, Cartridge) for c in carts)
    assert (tmp_path / "ck.part1of2.key").exists() and (tmp_path / "ck.part2of2.key").exists()
    # The default part: two of the model's contexts (1,024 tokens for the tiny model), one part for this corpus.
    assert len(train_parts(model, text[:1500], config, progress=False)) == 1


def test_parts_record_their_cut_so_that_the_corpus_finds_them_again(model):
    from cartridges.parts import UnrecordedCut, part_search_for
    from cartridges.selfstudy.chunking import corpus_digest

    text = manual(sections=4, paragraphs=2, words=30)
    config = TrainConfig(num_tokens=8, num_samples=2, objective="next_token", seed=1)
    carts = train_parts(model, text, config, max_part_tokens=1500, progress=False)
    assert [c.config["part_tokens"] for c in carts] == [1500, 1500]
    search = part_search_for(model.tokenizer, text, carts)
    texts = corpus_parts(model.tokenizer, text, 1500)
    for n in (1, 4):
        holding = [j for j, part in enumerate(texts) if f"## {n}. Section {n}" in part]
        assert search.find(f"What follows s{n}p1w7?") == holding[:1]
    with pytest.raises(ValueError, match="cut into 1 parts .* not the cartridge's 2: give the files"):
        part_search_for(model.tokenizer, text[:900], carts)
    # Each part keeps its text's digest: a corpus that cuts into as many parts but is not the one trained on is refused.
    assert [c.config["corpus_sha256"] for c in carts] == [corpus_digest(t) for t in texts]
    edited = text.replace("s4p1w7", "s4p1w8")
    assert len(corpus_parts(model.tokenizer, edited, 1500)) == 2
    with pytest.raises(ValueError, match="part 2 of 2 was trained on another text"):
        part_search_for(model.tokenizer, edited, carts)
    undigested = [Cartridge(c.keys, c.values, config={"part_tokens": 1500}) for c in carts]  # parts kept before digests
    assert part_search_for(model.tokenizer, edited, undigested).find("What follows s1p1w7?") == [0]
    older_name = [Cartridge(c.keys, c.values, config={"part_tokens": 1500, "part_sha256": c.config["corpus_sha256"]})
                  for c in carts]  # the digest as parts first kept it
    with pytest.raises(ValueError, match="part 2 of 2 was trained on another text"):
        part_search_for(model.tokenizer, edited, older_name)
    one = train_parts(model, text[:900], config, max_part_tokens=1500, progress=False)
    assert "part_tokens" not in one[0].config  # one cartridge is no part, and is found whole
    assert part_search_for(model.tokenizer, text[:900], one).find("What follows s1p1w7?") == [0]
    with pytest.raises(ValueError, match="the cartridge was trained on another text than the files given"):
        part_search_for(model.tokenizer, text[:899], one)  # one cartridge's text is checked whole
    unrecorded = [Cartridge(c.keys, c.values, config={}) for c in carts]
    with pytest.raises(UnrecordedCut, match="do not record how their corpus was cut"):
        part_search_for(model.tokenizer, text, unrecorded)


def test_the_time_left_is_estimated_from_the_parts_done_by_their_tokens():
    assert remaining_estimate(600.0, [1000, 2000, 1000], 1) == "about 30 minutes for the other 2 parts"
    assert remaining_estimate(40.0, [1000, 1000], 1) == "about 40 seconds for the last part"


def test_train_command_writes_the_parts_as_one_file_and_chat_composes_them(model, tmp_path, monkeypatch, capsys):
    import cartridges.model
    from cartridges.cartridge import PartsFileError, load_cartridges, save_cartridges
    from cartridges.cli import main

    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: model)
    (tmp_path / "manual.md").write_text(manual(sections=4, paragraphs=2, words=30))
    out = tmp_path / "manual.safetensors"
    base = ["train", str(tmp_path / "manual.md"), "--out", str(out), "--num-tokens", "8", "--num-samples", "2",
            "--objective", "next_token", "--no-progress"]
    assert main(base + ["--parts", "--part-tokens", "1500"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manual.md", "manual.safetensors"]
    err = capsys.readouterr().err
    assert "part 1 of 2: 8 tokens" in err and "part 2 of 2: 8 tokens" in err
    assert f"2 parts of 8, 8 tokens" in err and f"cartridges chat --cartridge {out} --corpus {tmp_path / 'manual.md'}" in err
    assert [c.num_tokens for c in load_cartridges(out, model)] == [8, 8]
    with pytest.raises(PartsFileError, match="2 parts"):
        Cartridge.load(out)
    # A corpus within one part (1,993 tokens; two contexts of the tiny model: 2,048): one cartridge, at --out.
    assert main(base + ["--parts"]) == 0 and Cartridge.load(out).num_tokens == 8
    # --part-tokens alone means parts of that size; not with --no-parts, and a part of some size;
    # parts are not written as a research .pt.
    assert main(base + ["--part-tokens", "1500"]) == 0 and len(load_cartridges(out)) == 2
    assert main(base + ["--no-parts", "--part-tokens", "1500"]) == 2
    assert "cannot go with --no-parts" in capsys.readouterr().err
    assert main(base + ["--parts", "--part-tokens", "8"]) == 2
    assert "at least 64" in capsys.readouterr().err
    for flag in ("--parts", "--part-tokens=1500"):
        assert main(base[:3] + [str(tmp_path / "manual.pt")] + base[4:] + [flag]) == 2
        assert "holds one cartridge, not parts" in capsys.readouterr().err

    class Chatty:  # the chat command's needs, on the tiny model
        name = "tiny"
        fingerprint = model.fingerprint
        native = model.native
        tokenizer = model.tokenizer

        seen: list = []  # the messages of each reply

        def stream_chat(self, messages, cartridges=(), composition="mixture", **kw):
            self.seen.append(messages)
            yield f"{len(cartridges)} cartridges by {composition}"

    assert main(base + ["--parts", "--part-tokens", "1500"]) == 0
    single = tmp_path / "single.safetensors"
    load_cartridges(out)[0].save(single)
    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: Chatty())
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--cartridge", str(out), str(single)]) == 0  # the file's two parts and one more
    assert "3 cartridges by mixture" in capsys.readouterr().out
    assert main(["chat", "--cartridge", str(out), "--composition", "concatenate"]) == 2
    assert "composed by mixture" in capsys.readouterr().err
    # --corpus: the files it was trained on, and each message is answered by the part it is about.
    corpus = str(tmp_path / "manual.md")
    monkeypatch.setattr("sys.stdin", io.StringIO("What follows s4p1w7?\nwhat is it\n"))
    assert main(["chat", "--cartridge", str(out), "--corpus", corpus]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["1 cartridges by mixture", "2 cartridges by mixture"]  # no word: all parts
    assert "(part 2 of 2)" in captured.err
    # --retrieval: the passages of the --corpus files that match the message, in a system message in
    # front of the conversation (the server's prompt), behind the part found; --passages-only: alone.
    for flags, said in ((["--retrieval", "2"], "1 cartridges by mixture"),
                        (["--retrieval", "2", "--passages-only"], "0 cartridges by mixture")):
        Chatty.seen.clear()
        monkeypatch.setattr("sys.stdin", io.StringIO("What follows s4p1w7?\nthe and of\n"))
        assert main(["chat", "--cartridge", str(out), "--corpus", corpus, "--system", "Be brief.", *flags]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines()[0] == said, flags
        found, nothing = Chatty.seen
        assert found[0]["role"] == "system" and "s4p1w7" in found[0]["content"]
        assert found[0]["content"].endswith("Be brief.") and found[1:] == [{"role": "user", "content": "What follows s4p1w7?"}]
        assert nothing[0] == {"role": "system", "content": "Be brief."}  # stop words alone match no passage
        assert "(passages: manual.md)" in captured.err and "(passages: none matched the message)" in captured.err
    (tmp_path / "other.md").write_text("A short note, not the manual.")
    for args, status, said in (
        (["--composition", "search"], 2, "needs --corpus"),
        (["--corpus", corpus, "--composition", "route"], 2, "--corpus is for search"),
        (["--corpus", corpus, "--cartridge", str(single)], 2, "give one --cartridge"),
        (["--corpus", str(tmp_path / "missing.md")], 1, "no such corpus file"),
        (["--corpus", str(tmp_path / "other.md")], 1, "cut into 1 parts"),
        (["--corpus", corpus, "--server", "http://127.0.0.1:9"], 2, "--corpus is for a local chat"),
        (["--retrieval"], 2, "needs --corpus"),
        (["--corpus", corpus, "--passages-only"], 2, "--passages-only needs --retrieval"),
    ):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
        assert main(["chat", "--cartridge", str(out), *args]) == status, args
        assert said in capsys.readouterr().err, args
    unrecorded = tmp_path / "unrecorded.safetensors"  # parts written before the cut was kept
    save_cartridges([Cartridge(c.keys, c.values, fingerprint=c.fingerprint) for c in load_cartridges(out)], unrecorded)
    assert main(["chat", "--cartridge", str(unrecorded), "--corpus", corpus]) == 1
    assert "do not record how their corpus was cut" in capsys.readouterr().err


def test_train_command_trains_a_corpus_past_four_contexts_in_parts_unless_told(model, tmp_path, monkeypatch, capsys):
    import cartridges.model
    from cartridges.cartridge import load_cartridges
    from cartridges.cli import main
    from cartridges.parts import in_parts_by_default
    from cartridges.selfstudy import Corpus

    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: model)
    long, short = manual(sections=10, paragraphs=2, words=30), manual(sections=4, paragraphs=2, words=30)
    tokens = len(Corpus.from_texts(model.tokenizer, [long]))
    assert tokens > 4 * 1024 and in_parts_by_default(model, tokens)  # four of the tiny model's contexts
    assert not in_parts_by_default(model, 4 * 1024)
    (tmp_path / "long.md").write_text(long)
    (tmp_path / "short.md").write_text(short)
    out = tmp_path / "c.safetensors"
    flags = ["--num-tokens", "8", "--num-samples", "2", "--objective", "next_token", "--no-progress"]
    assert main(["train", str(tmp_path / "long.md"), "--out", str(out), *flags]) == 0
    err = capsys.readouterr().err
    assert f"the corpus has {tokens:,} tokens, more than 4 of the model's contexts" in err and "--no-parts" in err
    parts = load_cartridges(out)
    assert len(parts) == 3 and len(corpus_parts(model.tokenizer, long, 2 * 1024)) == 3  # parts of two contexts
    assert main(["train", str(tmp_path / "long.md"), "--out", str(out), "--no-parts", *flags]) == 0
    assert len(load_cartridges(out)) == 1 and "contexts" not in capsys.readouterr().err
    pt = tmp_path / "c.pt"  # the research format holds one cartridge: one, whatever the length
    assert main(["train", str(tmp_path / "long.md"), "--out", str(pt), *flags]) == 0 and pt.exists()
    assert main(["train", str(tmp_path / "short.md"), "--out", str(out), *flags]) == 0
    assert len(load_cartridges(out)) == 1 and Cartridge.load(out).num_tokens == 8
