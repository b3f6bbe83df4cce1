"""Quality gates of the upcycle recipe, next to verify's L1 thresholds: ``verify.max_ppl_ratio`` (student /
teacher held-out perplexity), ``verify.max_delta_nll`` (student - teacher held-out loss, nats/token),
``verify.min_kv_reduction`` (teacher / student KV bytes per token, analytic) and ``verify.max_accuracy_drop``
(teacher - student accuracy, the larger of the passkey drop over all its trials and the behaviour-suite drop).

The first three are judged from what the verify phase knows; the accuracy gate needs the benchmark's results.
``judge`` is called once, after the last of verify/benchmark that runs, so a failed gate comes after every
report is written; with ``verify.on_fail=fail`` it raises ``core.config.GateFailed`` (exit code 3, distinct from
bad input's 2), with ``warn`` it prints a warning. The verdicts go to ``gates.json`` in the run folder and into
``benchmark/results.*`` when the benchmark ran.
"""
from __future__ import annotations

from purestep.core.io.cache import write_json
from purestep.core.config import GateFailed
from purestep.recipes.upcycle.phases import ppl

GATES = ("max_ppl_ratio", "max_delta_nll", "min_kv_reduction", "max_accuracy_drop")


def accuracy_drop(results: dict) -> float | None:
    """Teacher - student accuracy: the larger of the passkey (pooled trials) and the behaviour (all cases) drop."""
    drops = []
    for kind, rows in (("passkey", results.get("passkey") or []), ("behaviour", results.get("behaviour") or [])):
        acc = {}
        for r in rows:
            if kind == "behaviour" and r["type"] != "all" or r.get("accuracy") is None:
                continue
            n, c = acc.get(r["model"], (0, 0))
            acc[r["model"]] = (n + r.get("trials", r.get("cases", 0)), c + r["correct"])
        if "teacher" in acc and "student" in acc and acc["teacher"][0] and acc["student"][0]:
            drops.append(acc["teacher"][1] / acc["teacher"][0] - acc["student"][1] / acc["student"][0])
    return max(drops) if drops else None


def judge(vc, losses: dict, kv: dict, results: dict | None) -> list[dict]:
    """One verdict per gate that is set: its value, limit and whether it passed (``passed`` None: not judged,
    with why)."""
    values = {"max_ppl_ratio": ppl(losses["student"]) / ppl(losses["teacher"]),
              "max_delta_nll": losses["student"] - losses["teacher"],
              "min_kv_reduction": kv["teacher"] / kv["student"],
              "max_accuracy_drop": accuracy_drop(results) if results is not None else None}
    out = []
    for gate in GATES:
        limit = getattr(vc, gate)
        if limit is None:
            continue
        value = values[gate]
        if value is None:
            out.append({"gate": gate, "limit": limit, "value": None, "passed": None,
                        "note": "needs the benchmark phase's passkey or behaviour results"})
            continue
        passed = value >= limit if gate.startswith("min_") else value <= limit
        out.append({"gate": gate, "limit": limit, "value": value, "passed": passed})
    return out


def enforce(verdicts: list, folder, on_fail: str, say) -> None:
    """Write ``gates.json``; then raise GateFailed (``on_fail=fail``) or warn when a gate was missed."""
    write_json(folder / "gates.json", {"gates": verdicts, "passed": all(v["passed"] is not False for v in verdicts)})
    for v in verdicts:
        shown = "not judged" if v["value"] is None else f"{v['value']:.4g}"
        say(f"gate verify.{v['gate']}={v['limit']:g}: {shown} "
            + {True: "passed", False: "MISSED", None: f"({v.get('note', '')})"}[v["passed"]])
    missed = [v for v in verdicts if v["passed"] is False]
    if not missed:
        return
    message = "; ".join(f"verify.{v['gate']}={v['limit']:g} missed ({v['value']:.4g})" for v in missed) \
        + f"; reports in {folder} (gates.json, verify/, benchmark/)"
    if on_fail == "fail":
        raise GateFailed(message)
    say(f"warning: gate failed: {message} (verify.on_fail=warn: continuing)")
