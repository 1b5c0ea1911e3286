"""Self-study end to end on a tiny model: synthesis (shared chunk KV = chunk in context),
training data layout, train() determinism and progress."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

import cartridges_core
from cartridges.selfstudy import Conversation, Corpus, Synthesizer, TrainConfig, synthesize, training_data
from cartridges.selfstudy.chunking import corpus_digest
from cartridges.selfstudy.synthesize import signal_by_part
from cartridges.training import multiplies_bfloat16_natively, resolved_training_dtype, train

from .tiny import tiny_model

TEXT = (
    "The village of Quelmor keeps three bells. The oldest, Brannick, was cast in 1402 by a smith "
    "named Odo Ferr. The second bell, Lisel, rings only at weddings. The third bell was lost in a "
    "flood and replaced in 1789 by a bell from the town of Arvand. Every spring the villagers "
    "count the bells' strokes to decide when to sow barley. "
) * 2


def small_config(**kw) -> TrainConfig:
    base = dict(
        num_tokens=24, num_samples=6, chunk_tokens=60, teacher_tokens=120, synthesis_batch_size=3,
        max_question_tokens=10, max_answer_tokens=14, top_k=5, epochs=2, batch_size=2, seed=7,
        written_fraction=0.5,  # both paths: A and B, and conversations written from the chunk
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_teacher_topk_equals_window_in_context(model):
    config = small_config()
    corpus = Corpus.from_texts(model.tokenizer, [TEXT])
    conversations = synthesize(model, corpus, config)
    assert len(conversations) == 6
    assert len({id(c.chunk) for c in conversations}) == 2  # one chunk per batch of 3
    assert len({c.kind for c in conversations}) > 2
    synth = Synthesizer(model, config)
    for c in conversations:
        # The teacher's targets are its top-k with the window (which holds the chunk) in context.
        assert c.chunk in c.window
        prompt = synth.prompt(c.window, c.question)
        logits = model.native.forward(torch.tensor([prompt + c.answer]))[0, len(prompt) - 1 : -1]
        values, ids = torch.log_softmax(logits, -1).topk(config.top_k, -1)
        assert c.topk_ids.shape == (len(c.answer), config.top_k)
        torch.testing.assert_close(c.topk_logprobs, values, rtol=1e-4, atol=1e-4)
        assert torch.equal(c.topk_ids[:, 0], ids[:, 0])
        if c.kind in ("recall", "cloze"):  # the answer is the chunk's own text (after the cue, or blanked)
            assert model.tokenizer.decode(c.answer) in c.chunk
        elif c.kind == "verify":
            assert model.tokenizer.decode(c.answer) in ("Yes", "No")
        else:
            assert c.answer[0] == int(ids[0, 0])  # B answers greedily

    data = training_data(model, conversations, config.num_tokens)
    assert data.topk_ids.shape[0] == sum(len(c.answer) for c in conversations)
    for row, c in enumerate(conversations):
        positions = data.target_mask[row].nonzero().squeeze(1)
        # Each target position predicts the next token of the row: the answer, in order.
        assert data.tokens[row, positions + 1].tolist() == c.answer
        assert c.chunk not in model.tokenizer.decode(data.tokens[row].tolist())


def _verify_row(tok, c):
    assert c.question.endswith("Answer yes or no.")
    assert tok.decode(c.answer) in ("Yes", "No")


def _topic_row(tok, c):
    assert c.question.split('"')[1] in c.chunk  # the topic (or, for a chunk without one, a recall cue)
    assert tok.decode(c.answer) in c.chunk  # the sentences that hold it


def _fact_row(tok, c):
    assert c.question.endswith("?") or c.question.startswith("Continue")  # a chunk without a fact: recall
    assert tok.decode(c.answer).split(". ", 1)[0] in c.chunk  # the fact first


@pytest.mark.parametrize("kind, fraction, check", [("verify", "verify_fraction", _verify_row),
                                                   ("topic", "topic_fraction", _topic_row),
                                                   ("fact", "fact_fraction", _fact_row)])
def test_written_kinds_take_their_answer_from_the_chunk_and_the_teacher_scores_it(model, kind, fraction, check):
    config = small_config(written_fraction=1.0, **{"verify_fraction": 0.0, fraction: 1.0}, max_answer_tokens=40)
    corpus = Corpus.from_texts(model.tokenizer, [TEXT])
    conversations = synthesize(model, corpus, config)
    synth = Synthesizer(model, config)
    assert {c.kind for c in conversations} == {kind}
    for c in conversations:
        check(model.tokenizer, c)
        prompt = synth.prompt(c.window, c.question)
        logits = model.native.forward(torch.tensor([prompt + c.answer]))[0, len(prompt) - 1 : -1]
        values, _ = torch.log_softmax(logits, -1).topk(config.top_k, -1)
        torch.testing.assert_close(c.topk_logprobs, values, rtol=1e-4, atol=1e-4)


def test_verify_conversations_train_toward_their_label_with_verify_targets_label(model):
    """verify_targets="label": a verify row's targets put all the mass on its written answer
    ("Yes" for the chunk's sentence, "No" for a swapped one); the conversations are otherwise
    those of the teacher's targets, and training on them gives finite losses."""
    from cartridges.quality import teacher_floor

    config = small_config(written_fraction=1.0, verify_fraction=0.6, max_answer_tokens=40)
    corpus = Corpus.from_texts(model.tokenizer, [TEXT])
    taught = synthesize(model, corpus, config)
    labelled = synthesize(model, corpus, config.replace(verify_targets="label"))
    assert "verify" in {c.kind for c in taught} and len({c.kind for c in taught}) > 1
    answers = set()
    for t, c in zip(taught, labelled):
        assert (t.kind, t.question, t.answer) == (c.kind, c.question, c.answer)
        if c.kind != "verify":
            assert torch.equal(t.topk_ids, c.topk_ids) and torch.equal(t.topk_logprobs, c.topk_logprobs)
            continue
        answers.add(model.tokenizer.decode(c.answer))
        assert c.topk_ids.shape == t.topk_ids.shape
        assert c.topk_ids[:, 0].tolist() == c.answer  # the written answer, with all the mass
        assert torch.equal(c.topk_logprobs[:, 0], torch.zeros(len(c.answer)))
        assert float(c.topk_logprobs[:, 1:].exp().sum()) == 0.0
        for row_ids, teacher_row, token in zip(c.topk_ids.tolist(), t.topk_ids.tolist(), c.answer):
            assert row_ids[1:] == [i for i in teacher_row if i != token][: config.top_k - 1]
    assert answers == {"Yes", "No"}
    data = training_data(model, labelled, config.num_tokens)
    assert teacher_floor(data, [i for i, c in enumerate(labelled) if c.kind == "verify"]) == 0.0
    cart = train(model, [TEXT], config.replace(verify_targets="label"), progress=False)
    assert all(math.isfinite(loss) for loss in cart.stats["losses"])


def test_verify_style_correct_swaps_from_the_whole_corpus_and_answers_with_the_sentence(model):
    """verify_style="correct": a swapped statement's name or number may come from another chunk
    of the corpus, and every verify answer goes on with the chunk's sentence; the other
    conversations are those of the default style."""
    config = small_config(written_fraction=1.0, verify_fraction=0.6, max_answer_tokens=160, num_samples=12)
    text = TEXT + "Far down the valley the ferry Wake Vell crosses the Tessel at 77 strokes an hour. "
    corpus = Corpus.from_texts(model.tokenizer, [text])
    judged = synthesize(model, corpus, config)
    corrected = synthesize(model, corpus, config.replace(verify_style="correct"))
    words, from_elsewhere = set(), 0
    for j, c in zip(judged, corrected):
        assert j.kind == c.kind
        if c.kind != "verify":
            assert (j.question, j.answer) == (c.question, c.answer)
            continue
        answer = model.tokenizer.decode(c.answer)
        word, said = answer.split(". ", 1)
        words.add(word)
        sentence = said.removeprefix('The document says: "').removesuffix('"')
        assert said.startswith("The document says") and sentence in " ".join(c.chunk.split())
        statement = c.question.split('"')[1]
        assert (statement == sentence) == (word == "Yes")
        assert model.tokenizer.decode(j.answer) in ("Yes", "No")
        swapped_in = set(statement.split()) - set(sentence.split())
        from_elsewhere += bool(swapped_in) and not swapped_in & set(c.chunk.split())
    assert words == {"Yes", "No"}
    assert from_elsewhere  # a swap the chunk itself does not hold
    cart = train(model, [text], config.replace(verify_style="correct"), progress=False)
    assert all(math.isfinite(loss) for loss in cart.stats["losses"])


def test_length_groups_split_short_rows_from_long_ones():
    length_groups = cartridges_core.length_groups
    lengths = [5, 120, 6, 130, 7, 125, 4, 128]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [sorted(lengths[i] for i in g) for g in groups] == [[4, 5, 6, 7], [120, 125, 128, 130]]
    assert length_groups([50] * 6) == [list(range(6))]  # equal rows: one forward
    assert length_groups([110, 100]) == [[1, 0]]  # a second call would cost more than the padding
    assert length_groups([]) == []


def test_each_teacher_window_is_computed_once(model, monkeypatch):
    # 12 batches over 2 windows of 2 or 3 chunks each: later rounds come back to the windows.
    config = small_config(num_samples=36, chunk_tokens=200, teacher_tokens=330, written_fraction=1.0)
    corpus = Corpus.from_texts(model.tokenizer, [TEXT])
    plan = Synthesizer(model, config).plan(corpus, 12)
    windows = [v.window for v in plan]
    assert len(set(windows)) > 1 and len(set(windows)) < sum(a != b for a, b in zip(windows, windows[1:])) + 1
    computed = []
    original = Synthesizer._system_kv
    monkeypatch.setattr(Synthesizer, "_system_kv", lambda self, text: computed.append(text) or original(self, text))
    conversations = synthesize(model, corpus, config)
    assert len(conversations) == 36
    assert len(computed) == len(set(windows)) == len(set(computed))  # written conversations: B's windows only


def test_train_is_deterministic_and_reports_progress(model):
    seen = []
    first = train(model, [TEXT], small_config(), progress=False, on_progress=lambda *a: seen.append(a))
    again = train(model, [TEXT], small_config(), progress=False)
    other = train(model, [TEXT], small_config(seed=8), progress=False)
    assert first == again
    assert first != other
    assert first.num_tokens == 24 and first.fingerprint == model.fingerprint
    assert first.config["seed"] == 7 and first.stats["steps"] == 6
    assert first.config["corpus_sha256"] == corpus_digest(TEXT)  # the text it was trained on, told from others
    stages = [s[0] for s in seen]
    # 6 training conversations in batches of 3, then 8 held-out ones for the quality report,
    # one in each of 8 tenths of the corpus.
    assert stages[:10] == ["synthesis"] * 10 and stages[10:] == ["training"] * 6
    assert [s[1:3] for s in seen[:10]] == [(3, 14), (6, 14)] + [(k, 14) for k in range(7, 15)]
    assert seen[-1][1:3] == (6, 6) and seen[-1][3] == pytest.approx(first.stats["losses"][-1])


def test_auto_training_dtype_is_bfloat16_where_the_cpu_multiplies_it_natively(model):
    """training_dtype="auto" (the default) trains a float32 model in bfloat16 on a CPU with
    AVX-512 BF16 or AMX, in its own dtype elsewhere; the cartridge records the one used."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    native_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    assert multiplies_bfloat16_natively("cpu") == native_bf16
    assert TrainConfig().training_dtype == "auto"
    assert resolved_training_dtype(model.native, "auto") == ("bfloat16" if native_bf16 else "model")
    assert resolved_training_dtype(model.native.with_dtype("bfloat16"), "auto") == "model"
    assert resolved_training_dtype(model.native, "float32") == "float32"  # a choice is kept
    cart = train(model, [TEXT], small_config(quality_samples=0, epochs=1), progress=False)
    assert cart.config["training_dtype"] == resolved_training_dtype(model.native, "auto")


def test_training_in_bfloat16_runs_on_a_twin_and_keeps_the_cartridge_float32(model):
    """training_dtype="bfloat16" trains on a bfloat16 twin of the model's weights: the same
    losses to bfloat16's precision, a float32 cartridge, and the model itself untouched."""
    config = small_config(quality_samples=0, training_dtype="float32")
    f32 = train(model, [TEXT], config, progress=False)
    bf16 = train(model, [TEXT], config.replace(training_dtype="bfloat16"), progress=False, data=f32.stats["data"])
    assert model.native.dtype == "float32" and bf16.config["training_dtype"] == "bfloat16"
    assert all(k.dtype == torch.float32 for k in bf16.keys)
    assert bf16.stats["losses"] == pytest.approx(f32.stats["losses"], rel=0.03)
    assert bf16 != f32
    # Its twin computes the model's own forward to bfloat16's precision.
    tokens = torch.randint(100, (2, 9), generator=torch.Generator().manual_seed(0))
    exact = model.native.forward(tokens)
    twin = model.native.with_dtype("bfloat16")
    assert twin.dtype == "bfloat16" and model.native.with_dtype("float32").dtype == "float32"
    assert ((twin.forward(tokens).float() - exact).abs().max() / exact.abs().max()) < 0.05


def test_the_training_signal_comes_from_every_part_of_the_corpus(model):
    corpus_tokens = len(model.tokenizer.encode(TEXT))
    # 12 batches of 4: one round over the 12 chunks of 60 tokens in windows of 120.
    config = small_config(num_samples=48, synthesis_batch_size=4, epochs=1, batch_size=8, quality_samples=0)
    cart = train(model, [TEXT], config, progress=False)
    shares = cart.stats["signal_by_part"]
    assert len(shares) == 10 and sum(shares) == pytest.approx(1.0)
    assert min(shares) > 0.5 / 10 and max(shares) < 2 / 10, shares  # even, give or take answer lengths
    assert corpus_tokens > 10 * 60  # every tenth is read by some chunk


def test_signal_by_part_shares_answer_tokens_out_by_overlap():
    def conv(span, answer_tokens):
        return Conversation("question", "", "q", [0] * answer_tokens, torch.zeros(0), torch.zeros(0), "", span)

    shares = signal_by_part([conv((0, 50), 10), conv((50, 100), 30), conv((25, 75), 20)], 100, parts=2)
    assert shares == pytest.approx([(10 + 10) / 60, (30 + 10) / 60])
    assert signal_by_part([conv((0, 0), 5)], 100, parts=4) == [0.0] * 4  # no chunk known (old checkpoints)


def test_next_token_objective_and_resume(model, tmp_path):
    config = small_config(objective="next_token", init="text", epochs=3, checkpoint_every=1)
    full = train(model, TEXT, config, progress=False)
    assert full.stats["num_target_tokens"] == 6 * (24 - 1)
    assert full.stats["losses"][-1] < full.stats["losses"][0]
    ckpt = tmp_path / "run.ckpt"
    stopped = []

    def stop_at_four(stage, done, total, loss):
        if stage == "training" and done == 4:
            token.cancel()

    import cartridges_core

    token = cartridges_core.CancelToken()
    part = train(model, TEXT, config, progress=False, checkpoint=ckpt, cancel=token, on_progress=stop_at_four)
    assert part.stats["cancelled"] and part.stats["steps"] == 4
    resumed = train(model, TEXT, config, progress=False, checkpoint=ckpt, resume=True, on_progress=lambda *a: stopped.append(a))
    assert resumed == full
    assert [a[1] for a in stopped] == [5, 6, 7, 8, 9]


def test_a_checkpoint_path_alone_saves_training_every_ten_steps(model, tmp_path):
    """checkpoint_every left at 0: a run with a checkpoint path saves every 10 steps, so one
    stopped at step 12 resumes from step 10, not from the start."""
    import cartridges_core

    config = small_config(objective="next_token", init="text", epochs=5)
    assert config.checkpoint_every == 0
    full = train(model, TEXT, config, progress=False)
    ckpt = tmp_path / "run.ckpt"
    token = cartridges_core.CancelToken()

    def stop_at_twelve(stage, done, total, loss):
        if stage == "training" and done == 12:
            token.cancel()

    part = train(model, TEXT, config, progress=False, checkpoint=ckpt, cancel=token, on_progress=stop_at_twelve)
    assert part.stats["cancelled"] and part.stats["steps"] == 12
    steps = []
    resumed = train(model, TEXT, config, progress=False, checkpoint=ckpt, resume=True,
                    on_progress=lambda stage, done, *_: steps.append(done))
    assert steps == [11, 12, 13, 14, 15]
    assert resumed == full


def test_synthesis_cancelled_then_resumed_gives_the_uninterrupted_cartridge(model, tmp_path, monkeypatch):
    """A synthesis stopped between batches keeps its conversations (CHECKPOINT.synthesis.pt);
    the resumed run makes only the missing batches, and the cartridge is the uninterrupted one."""
    import cartridges_core

    from cartridges.training import TrainingCancelled

    config = small_config(num_samples=8, synthesis_batch_size=2)
    full = train(model, [TEXT], config, progress=False)
    ckpt = tmp_path / "run.ckpt"
    token = cartridges_core.CancelToken()

    def cancel_after_two_batches(stage, done, total, loss):
        if stage == "synthesis" and done == 4:
            token.cancel()

    with pytest.raises(TrainingCancelled):
        train(model, [TEXT], config, progress=False, checkpoint=ckpt, cancel=token, on_progress=cancel_after_two_batches)
    assert (tmp_path / "run.ckpt.synthesis.pt").exists() and not (tmp_path / "run.ckpt.data.pt").exists()

    batches = []
    original = Synthesizer.batch
    monkeypatch.setattr(Synthesizer, "batch", lambda self, corpus, view, rng, n: batches.append(n) or original(self, corpus, view, rng, n))
    resumed = train(model, [TEXT], config, progress=False, checkpoint=ckpt, resume=True)
    # The two training batches the cancelled run did not make, then the 8 held-out conversations
    # (one per tenth of the corpus, in 8 of them).
    assert batches == [2, 2] + [1] * 8
    assert resumed == full
    assert resumed.quality["by_part"] == full.quality["by_part"]
    assert resumed.quality["recovered"] == pytest.approx(full.quality["recovered"])
    assert not (tmp_path / "run.ckpt.synthesis.pt").exists()  # superseded by the data file


LONG_TEXT = "".join(
    f"Section {n}. The harbour of Vell{n} keeps {n + 2} cranes and {3 * n} ferries. "
    f"Its keeper in the year {1700 + n} was named Orm{n}, who counted the boats at dawn. "
    for n in range(1, 13)
)


def test_joined_conversations_quote_two_distant_chunks_and_the_teacher_reads_both(model):
    config = small_config(joined_fraction=1.0, chunk_tokens=40, num_samples=6, max_answer_tokens=20)
    corpus = Corpus.from_texts(model.tokenizer, [LONG_TEXT])
    conversations = synthesize(model, corpus, config)
    synth = Synthesizer(model, config)
    assert {c.kind for c in conversations} == {"joined"}
    for c in conversations:
        (a0, a1), (b0, b1) = c.chunk_span, c.partner_span
        assert abs((a0 + a1) / 2 - (b0 + b1) / 2) >= len(corpus) / 4  # far apart
        first, second = sorted([(a0, a1), (b0, b1)])
        parts = [model.tokenizer.decode(corpus.tokens[s:e]) for s, e in (first, second)]
        assert c.window == parts[0] + "\n\n[...]\n\n" + parts[1]
        # The answer: each passage's continuation, in order, a blank line between (the tiny model's
        # tokenizer writes a newline as "?"; the text has none).
        head, _, tail = model.tokenizer.decode(c.answer).partition("??")
        assert head and tail and head in parts[0] and tail in parts[1]
        # The teacher's targets: its top-k with both chunks in context.
        prompt = synth.prompt(c.window, c.question)
        logits = model.native.forward(torch.tensor([prompt + c.answer]))[0, len(prompt) - 1 : -1]
        values, _ = torch.log_softmax(logits, -1).topk(config.top_k, -1)
        torch.testing.assert_close(c.topk_logprobs, values, rtol=1e-4, atol=1e-4)
    # Their signal is shared out over both chunks' parts of the corpus.
    shares = signal_by_part(conversations, len(corpus))
    assert sum(shares) == pytest.approx(1.0)
    assert sum(s > 0 for s in shares) >= 4


def test_no_joined_conversations_leave_synthesis_as_it_was(model):
    """joined_fraction 0 draws nothing from a batch's random stream, so that every other
    conversation is what it was before joined conversations existed; 0.5 joins some."""
    corpus = Corpus.from_texts(model.tokenizer, [LONG_TEXT])
    synth = Synthesizer(model, small_config(chunk_tokens=40))
    rng = random.Random(3)
    before = rng.getstate()
    assert synth._joined_rows(corpus, synth.plan(corpus, 1)[0], rng, 3).rows == []
    assert rng.getstate() == before
    some = synthesize(model, corpus, small_config(joined_fraction=0.5, chunk_tokens=40))
    assert 0 < sum(c.kind == "joined" for c in some) < len(some)


def test_the_teacher_attends_its_window_in_bfloat16_when_training_is_bfloat16(model):
    """Synthesis asks the core for bfloat16 attention over the teacher's window exactly when
    the cartridge trains in bfloat16; an explicit float32 keeps the teacher float32."""
    bf16 = resolved_training_dtype(model.native, "auto") == "bfloat16"
    assert Synthesizer(model, small_config()).bfloat16_attention == bf16
    assert not Synthesizer(model, small_config(training_dtype="float32")).bfloat16_attention


def test_bfloat16_attention_stays_close_to_float32():
    """The default model (head size 64) behind a prefix: with bfloat16_attention its
    hidden states stay within bfloat16's rounding of the float32 ones where the CPU has AVX-512
    BF16, and are the float32 ones exactly where it has not."""
    import cartridges

    native = cartridges.load_model().native
    g = torch.Generator().manual_seed(0)
    prefix = native.prefix_from_tokens(torch.randint(0, 49152, (300,), generator=g))
    tokens = torch.randint(0, 49152, (2, 40), generator=g)
    exact = native.forward_hidden(tokens, prefixes=[[prefix]] * 2)
    rounded = native.forward_hidden(tokens, prefixes=[[prefix]] * 2, bfloat16_attention=True)
    if multiplies_bfloat16_natively("cpu"):
        assert not torch.equal(rounded, exact)
        assert ((rounded - exact).norm() / exact.norm()).item() < 2e-2
    else:
        assert torch.equal(rounded, exact)


def test_passages_conversations_put_the_best_passages_before_the_message_and_keep_the_targets(model):
    """passages_fraction: the student of a chosen conversation reads the corpus' best BM25
    passages for its message in the chat's retrieval prompt, before the message; the answer
    and the teacher's targets are the conversation's as they were, and the other rows are
    what they are without passages."""
    from cartridges.retrieval import Retriever, passages_prompt
    from cartridges.selfstudy.synthesize import TRAIN_PASSAGES, student_passages, student_tokens

    tok = model.tokenizer
    config = small_config(chunk_tokens=40, num_samples=12, synthesis_batch_size=4)
    corpus = Corpus.from_texts(tok, [LONG_TEXT])
    conversations = synthesize(model, corpus, config)
    assert student_passages(tok, corpus, conversations, config) == [[]] * len(conversations)
    passages = student_passages(tok, corpus, conversations, config.replace(passages_fraction=0.5))
    chosen = [i for i, p in enumerate(passages) if p]
    assert 0 < len(chosen) < len(conversations)
    assert passages == student_passages(tok, corpus, conversations, config.replace(passages_fraction=0.5))
    index = Retriever.from_texts(tok, [tok.decode(corpus.tokens)])
    for i in chosen:
        assert passages[i] == index.search(conversations[i].question, TRAIN_PASSAGES)
    plain = training_data(model, conversations, config.num_tokens)
    data = training_data(model, conversations, config.num_tokens, passages)
    assert torch.equal(data.topk_ids, plain.topk_ids) and torch.equal(data.topk_logprobs, plain.topk_logprobs)
    for row, c in enumerate(conversations):
        prompt = student_tokens(tok, c.question, passages[row])
        assert data.tokens[row, : len(prompt)].tolist() == prompt
        positions = data.target_mask[row].nonzero().squeeze(1)
        assert data.tokens[row, positions + 1].tolist() == c.answer
        if passages[row]:
            assert prompt == list(tok.encode_chat([{"role": "system", "content": passages_prompt(passages[row])},
                                                   {"role": "user", "content": c.question}],
                                                  add_generation_prompt=True))
            text = tok.decode(prompt)  # (the tiny tokenizer has no newline)
            assert text.index(passages[row][0][:40]) < text.index(c.question[:20])
        else:
            assert torch.equal(data.tokens[row, : plain.lengths[row]], plain.tokens[row, : plain.lengths[row]])


def test_training_passages_of_several_files_come_each_from_one_file(model):
    """As the chat's index does, student_passages chunks each file of the corpus on its own: no
    passage runs from the end of one file into the start of the next."""
    from cartridges.selfstudy.chunking import named_texts
    from cartridges.selfstudy.synthesize import student_passages

    tok = model.tokenizer
    other = ("The ferry to Ostrel leaves twice a day. Its captain, Mira Vand, keeps a log of the tides "
             "and of every bell she hears from the shore. ") * 2
    files = named_texts([("bells.md", TEXT), ("ferry.md", other)])
    corpus = Corpus.from_texts(tok, files)
    assert corpus.texts == tuple(files)
    config = small_config(chunk_tokens=40, num_samples=8, synthesis_batch_size=4, passages_fraction=1.0)
    conversations = synthesize(model, corpus, config)
    found = [p for ps in student_passages(tok, corpus, conversations, config) for p in ps]
    assert found and all(any(p.strip() in f for f in files) for p in found)
    assert {f for p in found for f in files if p.strip() in f} == set(files)  # both files searched


def test_train_reads_passages_conversations_with_their_passages(model):
    """train() with passages_fraction 1 trains on every conversation with its passages in the
    student's prompt: the same targets as without, longer rows."""
    from cartridges.selfstudy.synthesize import student_passages

    config = small_config(chunk_tokens=40, quality_samples=0, epochs=1)
    plain = train(model, [LONG_TEXT], config, progress=False)
    read = train(model, [LONG_TEXT], config.replace(passages_fraction=1.0), progress=False)
    corpus = Corpus.from_texts(model.tokenizer, [LONG_TEXT])
    conversations = synthesize(model, corpus, config.for_corpus(len(corpus)))
    passages = student_passages(model.tokenizer, corpus, conversations, config.replace(passages_fraction=1.0))
    expected = training_data(model, conversations, config.num_tokens, passages)
    assert any(passages)  # (a message that shares no word with the corpus gets none)
    assert torch.equal(read.stats["data"].tokens, expected.tokens)
    assert torch.equal(read.stats["data"].topk_ids, plain.stats["data"].topk_ids)
    assert read.stats["data"].lengths.sum() > plain.stats["data"].lengths.sum()
    assert read != plain
