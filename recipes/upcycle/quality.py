"""Quality beyond the held-out perplexity of fixed windows: strided perplexity at long windows, and a behaviour
suite of small cases.

- **Strided perplexity** (the sliding-window evaluation of Hugging Face's "Perplexity of fixed-length models"):
  windows of ``W`` tokens moved by ``stride`` over the first ``ppl_tokens`` held-out tokens; each window scores
  only the tokens it has not scored before (its last ``stride``, the first window all of them), so every token
  is scored once, with up to ``W - stride`` tokens of context. Only the scored positions go through the head.
- **Behaviour cases**, one JSON object per line: ``{"type": "choice_logprob", "prompt": P, "choices": [..],
  "answer": i}`` (correct when choice ``i`` has the highest summed log-probability after ``P``) or ``{"type":
  "exact_match_greedy", "prompt": P, "target": T}`` (correct when the greedy continuation of ``len(tokens(T))``
  tokens decodes to ``T``, whitespace-stripped). ``BUILTIN`` holds a few that need no download. A case whose
  texts the tokenizer cannot write and read back (``recipes/upcycle/spelling.py``: digits for a char tokenizer of
  tiny shakespeare) is skipped with one line saying why; the others run.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from purestep.core.data import jsonl
from purestep.core.config import UserError
from purestep.models import llama
from purestep.recipes.upcycle.spelling import spell
from purestep.recipes.upcycle.sweep import greedy

BUILTIN = [
    {"type": "choice_logprob", "prompt": "The capital of France is", "choices": [" Paris", " London", " Berlin"],
     "answer": 0},
    {"type": "choice_logprob", "prompt": "One, two, three, four,", "choices": [" nine", " five", " twelve"],
     "answer": 1},
    {"type": "choice_logprob", "prompt": "The opposite of hot is", "choices": [" green", " tall", " cold"],
     "answer": 2},
    {"type": "choice_logprob", "prompt": "Monday, Tuesday,", "choices": [" Wednesday", " April", " Sunday"],
     "answer": 0},
    {"type": "exact_match_greedy", "prompt": "1, 2, 3, 4, 5, 6,", "target": " 7, 8"},
    {"type": "exact_match_greedy", "prompt": "A B C D E F G", "target": " H I"},
    {"type": "exact_match_greedy", "prompt": "red blue green. red blue green. red blue", "target": " green"},
]
TYPES = ("choice_logprob", "exact_match_greedy")


def load_cases(spec: str) -> list[dict]:
    """``builtin``, ``none`` or a JSONL file of cases (each checked: one line names the bad line and why)."""
    if spec == "none":
        return []
    if spec == "builtin":
        return BUILTIN
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"benchmark.behaviour={spec}: no such file (builtin, none, or a JSONL file of cases)")
    cases = []
    for i, line in jsonl.lines(str(path)):                       # the project's JSONL reader (core.data.jsonl)
        case = jsonl.parse(line, f"{path}:{i}")
        ok = isinstance(case, dict) and case.get("type") in TYPES and isinstance(case.get("prompt"), str) and (
            case["type"] == "exact_match_greedy" and isinstance(case.get("target"), str) or
            case["type"] == "choice_logprob" and isinstance(case.get("choices"), list) and len(case["choices"]) > 1
            and isinstance(case.get("answer"), int) and 0 <= case["answer"] < len(case["choices"]))
        if not ok:
            raise UserError(f"{path}:{i}: a case needs type {' or '.join(TYPES)}, a prompt, and choices + answer "
                            f"(an index) or a target")
        cases.append(case)
    if not cases:
        raise UserError(f"benchmark.behaviour={spec}: the file holds no cases")
    return cases


@torch.no_grad()
def _choice_logprobs(m, tokenizer, prompt: str, choices: list, device) -> list[float]:
    ids = tokenizer.encode(prompt)
    out = []
    for choice in choices:
        c = tokenizer.encode(choice)
        x = torch.tensor([ids + c], device=device)
        logp = m.module.apply(m.params, x, m.cfg)[0, len(ids) - 1:-1].float().log_softmax(-1)
        out.append(logp.gather(-1, torch.tensor(c, device=device)[:, None]).sum().item())
    return out


def unwritable(tokenizer, case: dict) -> str:
    """Why ``tokenizer`` cannot run ``case`` (a text it cannot write and read back), or ""."""
    texts = [case["prompt"], *case.get("choices", ()), *([case["target"]] if "target" in case else [])]
    return next((why for why in (spell(tokenizer, t)[1] for t in texts) if why), "")


def run_behaviour(models: list, tokenizer, cases: list, device, say) -> tuple[list[dict], list[dict]]:
    """One row per model and case type (and ``all``): cases, correct, accuracy; and the cases skipped, with why."""
    skipped, runnable = [], []
    for i, case in enumerate(cases, 1):
        why = unwritable(tokenizer, case)
        if not why:
            runnable.append(case)
            continue
        skipped.append({"item": f"behaviour case {i}", "reason": why})
        say(f"benchmark: behaviour case {i} ({case['type']}, prompt {case['prompt']!r}) skipped: {why}")
    rows = []
    for m in models:
        tally = {t: [0, 0] for t in (*TYPES, "all")}
        for case in runnable:
            if case["type"] == "choice_logprob":
                scores = _choice_logprobs(m, tokenizer, case["prompt"], case["choices"], device)
                right = max(range(len(scores)), key=scores.__getitem__) == case["answer"]
            else:
                target = tokenizer.encode(case["target"])
                out = greedy(m, torch.tensor([tokenizer.encode(case["prompt"])], device=device), len(target))
                right = tokenizer.decode(out[0].tolist()).strip() == case["target"].strip()
            for key in (case["type"], "all"):
                tally[key][0] += 1
                tally[key][1] += bool(right)
        rows += [{"model": m.name, "type": t, "cases": n, "correct": c, "accuracy": c / n if n else None}
                 for t, (n, c) in tally.items() if n]
    return rows, skipped


@torch.no_grad()
def strided_loss(m, tokens, window: int, stride: int, n_tokens: int, device) -> tuple[float, int]:
    """Mean next-token loss over the first ``n_tokens + 1`` tokens, sliding ``window`` by ``stride``."""
    data = torch.as_tensor(tokens[:n_tokens + 1].astype("int64"), device=device)
    total, count, scored_to = 0.0, 0, 0       # targets data[1..scored_to] are done
    for begin in range(0, len(data) - 1, stride):
        end = min(begin + window, len(data) - 1)
        x, y = data[begin:end][None], data[begin + 1:end + 1]
        new = end - max(scored_to, begin)
        hidden = m.module.apply(m.params, x, m.cfg, return_hidden="only")[-1][0, -new:]
        logits = F.linear(llama.rms_norm(hidden, m.params["norm"], m.cfg.norm_eps), llama.lm_head(m.params))
        total += F.cross_entropy(logits.float(), y[-new:], reduction="sum").item()
        count, scored_to = count + new, end
        if end == len(data) - 1:
            break
    return total / count, count


def run_strided(models: list, tokens, contexts, stride: int, n_tokens: int, device) -> list[dict]:
    rows = []
    for window in contexts:
        step = min(stride or max(window // 2, 1), window)
        for m in models:
            loss, count = strided_loss(m, tokens, window, step, n_tokens, device)
            rows.append({"model": m.name, "context": window, "stride": step, "tokens": count, "loss": loss,
                         "perplexity": math.exp(min(loss, 50.0))})
    return rows
