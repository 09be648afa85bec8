"""The verdicts and the results page of the one-process on-disk run (:mod:`.on_disk`): a function of the stored JSON
alone, so the stored page re-renders from it."""

from __future__ import annotations

from typing import Any

from ..report import table
from .render import GiB

LIMIT_RSS = 1.0  # GiB
LIMIT_FLOOR = 1.3


def _by_phase(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["phase"].split(",")[0].split(":")[0]: p for p in result["here"]["phases"]}


def _verdict(name: str, value: float | None, limit: float, met: bool | None, detail: str) -> dict[str, Any]:
    word = "n/a" if met is None else "PASS" if met else "MISS"
    return {"target": name, "value": value, "limit": limit, "verdict": word, "detail": detail}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every verdict of the run: RSS, time against the floor (and net of the launcher, shown), the page cache
    dropped before each read, and whether the source and the output together exceed the machine's memory."""
    here, phases = result["here"], _by_phase(result)
    floor, reshard, launcher = phases["floor"], phases["reshard 2 -> 3"], phases["launcher"]
    ratio = reshard["seconds"] / floor["seconds"]
    net = (reshard["seconds"] - launcher["seconds"]) / floor["seconds"]
    peak = reshard["peak_rss"] / GiB
    out = [
        _verdict(f"one process: reshard peak RSS <= {LIMIT_RSS:g} GiB (VmHWM, mapped pages included)", peak, LIMIT_RSS,
                 peak <= LIMIT_RSS, f"{reshard['peak_rss']} bytes"),
        _verdict(f"one process: reshard <= {LIMIT_FLOOR}x the read-all-write-all floor", ratio, LIMIT_FLOOR,
                 ratio <= LIMIT_FLOOR, f"{reshard['seconds']:.1f} s vs {floor['seconds']:.1f} s"),
        _verdict("one process: the same, net of the launcher's start-up (shown, not the target)", net, LIMIT_FLOOR,
                 None, f"{reshard['seconds'] - launcher['seconds']:.1f} s vs {floor['seconds']:.1f} s"),
    ]  # fmt: skip
    if "schedstat" in reshard and "schedstat" in floor:
        ours, base = reshard["seconds"] - reshard["schedstat"][1], floor["seconds"] - floor["schedstat"][1]
        out.append(_verdict("one process: the same, each less its run-queue wait (shown, not the target)", ours / base,
                            LIMIT_FLOOR, None, f"{ours:.1f} s vs {base:.1f} s"))  # fmt: skip
    for k, drop in enumerate(here["drops"]):
        after = drop["resident_after"]
        share = None if after is None else after / drop["bytes"]
        out.append(_verdict(f"source dropped from the page cache before read {k + 1} (resident share <= 0.01)", share,
                            0.01, None if share is None else share <= 0.01,
                            f"{drop['resident_before']} -> {after} of {drop['bytes']} bytes resident"))  # fmt: skip
    both = here["input_bytes"] + reshard["bytes_written"]
    out.append(_verdict("source + output exceed the machine's memory", both / here["page_cache_total"], 1.0,
                        both > here["page_cache_total"], f"{both} bytes vs {here['page_cache_total']} bytes of memory"))  # fmt: skip
    return out


def markdown(result: dict[str, Any]) -> str:
    """The results page."""
    here, meta = result["here"], result["meta"]
    lines = [f"# One process, on disk: a {here['gib']:g} GiB reshard", "", f"Command: `{meta['command']}`.", "",
             f"Machine: {meta['machine']}; scratch `{here['scratch']}` ({meta['filesystem']}); commit {meta['commit']}.",
             "", "## Targets", ""]  # fmt: skip
    rows = [[t["target"], "-" if t["value"] is None else f"{t['value']:.3g}", str(t["limit"]), t["verdict"], t["detail"]]
            for t in result["targets"]]  # fmt: skip
    lines += table(["target", "value", "limit", "verdict", "detail"], rows) + ["", "## Phases", ""]
    cells = []
    for p in here["phases"]:
        seconds = p["seconds"]
        moved = p.get("bytes_read", 0) + p.get("bytes_written", 0)
        rate = "-" if not seconds or not moved else f"{moved / seconds / 1e6:.0f}"
        cells.append([p["phase"], "-" if seconds is None else f"{seconds:.1f}", str(p.get("bytes_read", "-")),
                      str(p.get("bytes_written", "-")), rate, str(p["peak_rss"] >> 20) if "peak_rss" in p else "-",
                      *([f"{v:.1f}" for v in p["schedstat"]] if "schedstat" in p else ["-", "-"]),
                      f"{p['load_before'][0]:.2f}", f"{p['load_after'][0]:.2f}" if "load_after" in p else "-"])  # fmt: skip
    lines += table(["phase", "s", "bytes read", "bytes written", "MB/s (read + written)", "peak RSS MiB", "CPU s",
                    "run-queue s", "load before", "load after"], cells)  # fmt: skip
    lines += ["", "## Notes", ""] + [f"- {n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"
