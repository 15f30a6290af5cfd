"""The report: one row per check (name, status, detail, what to do), grouped in sections,
and the document `--json` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ddpcli.checkenv.facts import Master, NodeFacts

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Row:
    """One line of the report. `fix` says what to do; it is empty for an ok row."""

    name: str
    status: str
    detail: str
    fix: str = ""
    section: str = ""


def ok(name: str, detail: str) -> Row:
    return Row(name, OK, detail)


def warn(name: str, detail: str, fix: str) -> Row:
    return Row(name, WARN, detail, fix)


def fail(name: str, detail: str, fix: str) -> Row:
    return Row(name, FAIL, detail, fix)


def in_section(section: str, rows: list[Row]) -> list[Row]:
    return [replace(row, section=section) for row in rows]


@dataclass(frozen=True)
class Report:
    rows: list[Row]
    facts: NodeFacts
    master: Master
    probe: dict | None = None  # the probe's own document, when it ran

    @property
    def counts(self) -> dict[str, int]:
        return {status: sum(r.status == status for r in self.rows) for status in (OK, WARN, FAIL)}

    @property
    def failed(self) -> bool:
        return self.counts[FAIL] > 0

    def with_probe(self, rows: list[Row], document: dict) -> Report:
        """This report with the probe's rows (section "probe") and document added."""
        return Report([*self.rows, *in_section("probe", rows)], self.facts, self.master, document)

    def to_json(self) -> dict:
        return {
            "ok": not self.failed,
            "exit_code": 1 if self.failed else 0,
            "counts": self.counts,
            "checks": [asdict(row) for row in self.rows],
            "host": self.facts.host,
            "versions": self.facts.versions,
            "backends": self.facts.backends,
            "gpus": [asdict(gpu) for gpu in self.facts.gpus],
            "cuda_visible_devices": self.facts.cuda_visible_devices,
            "interfaces": [asdict(iface) for iface in self.facts.interfaces],
            "environment": self.facts.environment,
            "master": asdict(self.master),
            "probe": self.probe,
        }
