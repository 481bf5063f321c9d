"""What `export --check` found in a draft folder: its layout, errors, warnings, and what each server would do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Report:
    path: Path
    format: str = "unknown"
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    servers: dict[str, str] = field(default_factory=dict)  # server -> what it would do

    @property
    def ok(self) -> bool:
        return not self.errors

    def text(self) -> str:
        lines = [f"{self.path}: {self.format} draft -> {'OK' if self.ok else 'NOT SERVABLE AS TRAINED'}"]
        lines += [f"  error: {e}" for e in self.errors] + [f"  warning: {w}" for w in self.warnings]
        lines += [f"  {server}: {what}" for server, what in self.servers.items()]
        return "\n".join(lines)
