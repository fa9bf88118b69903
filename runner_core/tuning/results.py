"""A sweep's results: the point key that makes a results file resumable, the file itself (CSV or JSON
Lines, a row appended and flushed as soon as it is measured, each naming the machine and commit it was
measured on: a file of another machine's or commit's rows is refused, not resumed), the per-point
aggregation (median and [min, max] over repeats), the best point under a target, the recommendation with
its ties, and the Pareto frontier of tokens/s per user against tokens/s in all."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import statistics
from pathlib import Path

THROUGHPUT = "output_throughput"
PER_USER = "tokens_per_s_per_user"
ROW_META = ("key", "stage", "label", "repeat")
PROVENANCE = ("machine", "commit")  # what a stored row was measured on (runner_core.host) and with


def settings_label(settings: dict) -> str:
    """A point's settings as a short label: "concurrency=8 max_num_seqs=16" ("loaded" when empty; a
    speculative_config as "ngram/k=4", or "off")."""
    return " ".join(f"{k}={_short(k, v)}" for k, v in settings.items()) or "loaded"


def _short(key: str, value) -> str:
    if key != "speculative_config":
        return str(value)
    return "off" if value is None else f"{value.get('method', 'ngram')}/k={value.get('num_speculative_tokens')}"


def target_dict(target) -> dict:
    return {"metric": target.metric, "limit": target.limit, "slo": dict(target.slo)}


def point_key(settings: dict, base: dict, workload, target) -> str:
    """A stable hash of a point (16 hex digits): its settings, the backend's settings the sweep started
    from (the model among them), the sweep's workload and its target."""
    text = json.dumps({"settings": settings, "base": base, "workload": workload.to_dict(),
                       "target": target_dict(target)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


TEXT_COLUMNS = ("key", "label", "stage", "rebuilt", *PROVENANCE)  # read back as written (a hex key can
# look like 1e5..., a commit like a number)


def _cell(text: str):
    """A CSV cell back to its value: "" -> None, True/False, int, float, else the string."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class ResultsFile:
    """A sweep's rows on disk. ".csv": one header, a row per line (None as an empty cell); ".json" or
    ".jsonl": JSON Lines, one row object per line. Each row is appended and flushed when measured; a
    torn last line (an interrupt mid-write) is cut off when the file is read back."""

    def __init__(self, path) -> None:
        self.path = Path(path)
        suffix = self.path.suffix.lower()
        if suffix not in (".csv", ".json", ".jsonl"):
            raise ValueError(f"results file {self.path}: use a .csv or .json (JSON Lines) path")
        self.csv = suffix == ".csv"
        self.columns: list[str] | None = None

    def load(self, provenance: dict | None = None) -> dict[tuple[str, int], dict]:
        """The rows already in the file, by (point key, repeat); with `provenance` ({"machine", "commit"} of
        this run), a ValueError when any row was measured on another machine or commit (or names none)."""
        if not self.path.exists():
            return {}
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
            self.path.write_text(text, encoding="utf-8")
        rows = self._parse(text)
        if provenance is not None:
            self._check(rows, provenance)
        return {(row["key"], int(row["repeat"])): row for row in rows}

    def _check(self, rows: list[dict], here: dict) -> None:
        for row in rows:
            differ = [f"{f} {row.get(f) or 'not recorded'!r} (this run: {here[f]!r})" for f in PROVENANCE
                      if row.get(f) != here[f]]
            if differ:
                raise ValueError(f"results file {self.path} holds rows measured on another machine or commit: "
                                 f"{'; '.join(differ)}. Resuming would mix their figures with this run's: pass a "
                                 "new results path, or delete the file to measure again")

    def _parse(self, text: str) -> list[dict]:
        if not text.strip():
            return []
        if self.csv:
            reader = csv.reader(io.StringIO(text))
            self.columns = next(reader)
            return [{c: v if c in TEXT_COLUMNS else _cell(v) for c, v in zip(self.columns, cells)}
                    for cells in reader if len(cells) == len(self.columns)]
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"results file {self.path} line {n}: not JSON ({e.msg}); "
                                     "remove the line or pass another path") from None
        return rows

    def append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8", newline="") as f:
            if not self.csv:
                f.write(json.dumps(row, default=str) + "\n")
            else:
                writer = csv.writer(f)
                if self.columns is None:
                    self.columns = list(row)
                    if f.tell() == 0:
                        writer.writerow(self.columns)
                extra = [c for c in row if c not in self.columns]
                if extra:
                    raise ValueError(f"results file {self.path} has no columns {extra} (it holds another "
                                     "sweep's rows); pass a new path or a .json one")
                writer.writerow(["" if row.get(c) is None else row.get(c) for c in self.columns])
            f.flush()


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def point_summary(rows: list[dict], settings: dict, setting_fields: list[str]) -> dict:
    """One point from its repeats' rows: key, stage, label, settings (as swept), values (every swept
    field's value as applied), repeats, and the median, min and max over the repeats of every numeric
    column (settings and bookkeeping aside)."""
    skip = set(ROW_META) | set(setting_fields) | {"concurrency"}
    median, low, high = {}, {}, {}
    for c in (c for c in rows[0] if c not in skip):
        values = [r[c] for r in rows if _numeric(r.get(c))]
        if values:
            median[c], low[c], high[c] = statistics.median(values), min(values), max(values)
    first = rows[0]
    return {"key": first["key"], "stage": first["stage"], "label": first["label"], "settings": dict(settings),
            "values": {c: first.get(c) for c in (*setting_fields, "concurrency")},
            "repeats": len(rows), "median": median, "min": low, "max": high}


def judge(point: dict, target) -> None:
    """Adds "met", "margin" (of the median) and "worst_margin" (of the worst repeat) to a point."""
    value, worst = point["median"].get(target.metric), point["max"].get(target.metric)
    point["value"] = value
    point["met"] = value is not None and bool(target.met({target.metric: value}))
    point["margin"] = None if value is None else target.margin({target.metric: value})
    point["worst_margin"] = None if worst is None else target.margin({target.metric: worst})


def best_point(points: list[dict]) -> dict | None:
    """Highest median output_throughput among the points that meet the target; when none does, the
    one closest to meeting it (largest margin)."""
    met = [p for p in points if p["met"]]
    if met:
        return max(met, key=lambda p: p["median"].get(THROUGHPUT, 0.0))
    judged = [p for p in points if p["margin"] is not None]
    return max(judged, key=lambda p: p["margin"]) if judged else None


def _overlaps(a: dict, b: dict) -> bool:
    lo_a, hi_a = a["min"].get(THROUGHPUT), a["max"].get(THROUGHPUT)
    lo_b, hi_b = b["min"].get(THROUGHPUT), b["max"].get(THROUGHPUT)
    return None not in (lo_a, hi_a, lo_b, hi_b) and lo_a <= hi_b and lo_b <= hi_a


def recommend(points: list[dict], target) -> tuple[dict | None, str]:
    """The best point (`best_point`) with its margin, and `ties`: the other points meeting the target
    whose output_throughput [min, max] over repeats overlaps the best's. Returns (recommendation, why)."""
    best = best_point(points)
    if best is None:
        return None, "no point was measured" if not points else f"no point reported {target.metric}"
    ties = [p["settings"] for p in points if p is not best and p["met"] and _overlaps(p, best)]
    if best["met"]:
        why = (f"highest {THROUGHPUT} ({best['median'].get(THROUGHPUT, 0):.1f} tok/s) with median "
               f"{target.metric} {best['value']:.3g} <= {target.limit:g}")
    else:
        why = (f"no point met {target.metric} <= {target.limit:g}: the closest has {best['value']:.3g}, "
               f"{-best['margin']:.0%} over")
    rec = {"settings": best["settings"], "label": best["label"], "key": best["key"], "met": best["met"],
           "value": best["value"], "margin": best["margin"], "worst_margin": best["worst_margin"],
           "throughput": best["median"].get(THROUGHPUT), "ties": ties, "why": why}
    return rec, why


def pareto_frontier(points: list[dict]) -> list[dict]:
    """The points no other point beats on both median tokens_per_s_per_user and output_throughput,
    by rising throughput; each keeps its settings and label."""
    scored = [p for p in points if _numeric(p["median"].get(PER_USER)) and _numeric(p["median"].get(THROUGHPUT))]
    out = []
    for p in scored:
        u, t = p["median"][PER_USER], p["median"][THROUGHPUT]
        beaten = any(q["median"][PER_USER] >= u and q["median"][THROUGHPUT] >= t
                     and (q["median"][PER_USER] > u or q["median"][THROUGHPUT] > t) for q in scored)
        if not beaten:
            out.append({"label": p["label"], "settings": p["settings"], "stage": p["stage"],
                        PER_USER: u, THROUGHPUT: t, "met": p.get("met")})
    return sorted(out, key=lambda f: f[THROUGHPUT])
