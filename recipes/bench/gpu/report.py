"""The GPU bench's report: ``report.json`` and ``report.md``, rewritten after every item, so a run stopped at any
point (a machine taken back, a time limit) leaves everything measured until then.

An item is one check, one recipe command or one measurement: ``{"name", "ok", "seconds", ...}`` with ``ok`` True,
False (and an ``error`` line plus the traceback's tail) or None (skipped, with ``reason``).
"""
from __future__ import annotations

import json
import os
import platform
import threading
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from purestep.core.io.cache import write_file
from purestep.core.io.logging import progress


def machine(device: torch.device) -> dict:
    """What ran: the card, torch, CUDA, Python, CPU count, the date and the command line."""
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["purestep", *sys.argv[1:]])}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    return info


class Report:
    """Items grouped by section, written to ``folder`` as JSON and Markdown after each one."""

    def __init__(self, folder: Path, meta: dict):
        self.folder, self.meta, self.sections, self.start = folder, meta, {}, time.perf_counter()
        self.lock = threading.Lock()   # the checks and the jobs' thread both add items
        folder.mkdir(parents=True, exist_ok=True)
        self.write()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def add(self, section: str, item: dict) -> dict:
        with self.lock:
            self.sections.setdefault(section, []).append(item)
            self.write()
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[item.get("ok")]
        why = item.get("error") or item.get("reason") or item.get("summary") or ""
        progress(f"  [{mark}] {section}/{item['name']} ({item.get('seconds', 0):.1f}s) {why}")
        return item

    @contextmanager
    def item(self, section: str, name: str):
        """``with report.item("checks", "donation") as item: item.update(...)``: timed; an exception marks it failed
        (its message and traceback tail kept) and is not raised, so the next item runs."""
        item, start = {"name": name, "ok": True}, time.perf_counter()
        try:
            yield item
        except Skip as e:
            item.update(ok=None, reason=str(e))
        except Exception as e:   # noqa: BLE001 - every failure is a finding to report, not a reason to stop
            item.update(ok=False, error=f"{type(e).__name__}: {e}".splitlines()[0][:500],
                        traceback=traceback.format_exc()[-3000:])
        item["seconds"] = round(time.perf_counter() - start, 2)
        self.add(section, item)

    def summary(self) -> dict:
        items = [i for items in self.sections.values() for i in items]
        return {"passed": sum(i["ok"] is True for i in items), "failed": sum(i["ok"] is False for i in items),
                "skipped": sum(i["ok"] is None for i in items), "seconds": round(self.elapsed(), 1)}

    def write(self) -> None:
        data = {"machine": self.meta, "summary": self.summary(), "sections": self.sections}
        _atomic(self.folder / "report.json", json.dumps(data, indent=1, default=str) + "\n")
        _atomic(self.folder / "report.md", markdown(data))


class Skip(Exception):
    """Raised inside :meth:`Report.item` when the item cannot run here; the message says why."""


def _atomic(path: Path, text: str) -> None:
    write_file(path, lambda f: f.write(text), binary=False)


def markdown(data: dict) -> str:
    """The report as Markdown: the machine, the summary, then one table per section."""
    m, s = data["machine"], data["summary"]
    lines = ["# bench.gpu report", "",
             f"{m.get('card', m['device'])}, torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, "
             f"{m['cpus']} CPUs, {m['date']}", "", f"`{m['command']}`", "",
             f"**{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped** in {s['seconds']} s", ""]
    for section, items in data["sections"].items():
        lines += [f"## {section}", "", "| item | result | seconds | details |", "|---|---|---:|---|"]
        for i in items:
            result = {True: "ok", False: "**FAIL**", None: "skipped"}[i["ok"]]
            details = i.get("error") or i.get("reason") or i.get("summary") or ""
            lines.append(f"| {i['name']} | {result} | {i.get('seconds', 0)} | {str(details).replace('|', '/')} |")
        lines.append("")
        for i in items:
            if "table" in i:
                lines += [f"### {section}/{i['name']}", "", i["table"], ""]
    return "\n".join(lines)
