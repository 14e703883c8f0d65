"""What `kvtier engine check` reports: one PASS / FAIL / SKIP per check, each with its figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass
class CheckResult:
    name: str
    status: Status
    figure: str                                   # the number the verdict rests on, in words
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    target: str                                   # what was checked (engine name, model)
    configuration: dict[str, Any]                 # the engine configuration as vLLM resolved it
    checks: list[CheckResult]
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "FAIL"]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "configuration": self.configuration, "ok": self.ok, "failed": self.failed,
                "seconds": round(self.seconds, 1), "checks": [asdict(c) for c in self.checks]}
