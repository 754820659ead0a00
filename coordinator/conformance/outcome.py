"""What the kit found: one verdict per section of docs/PROTOCOL.md, printed one line each.

A section is SKIP only where it does not apply (a trainer fetches no release, a device without a
signing key seals nothing) or where an earlier failure left nothing to check; the kit passes
when no section failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Verdict(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Section:
    """One part of the contract the kit checks: `refs` are the sections of docs/PROTOCOL.md."""

    key: str
    refs: str
    title: str


SECTIONS = (
    Section("registration", "§12 §7", "registration: HELLO -> WELCOME"),
    Section("envelope", "§3 §4", "envelopes and arrays decode"),
    Section("chunking", "§5", "chunked messages: reassembled, a corrupted blob dropped"),
    Section("training", "§7 §9", "training reply (TRAIN -> TRAIN_RES)"),
    Section("evaluation", "§7 §9", "evaluation reply (EVALUATE -> EVAL_RES)"),
    Section("release", "§10", "release: RELEASE -> FETCH -> ARTIFACT, prototypes"),
    Section("duplicates", "§6", "a repeated request gets the cached reply"),
    Section("rejection", "§12 §11", "bad requests get no reply"),
    Section("signing", "§15", "seals"),
    Section("nack", "§7 §11", "NACK: logged, the device goes on"),
    Section("rejoin", "§12 §13", "a new coordinator incarnation: HELLO again, join the new run"),
    Section("codecs", "§8", "upload codecs int8, topk and q4"),
)
BY_KEY = {section.key: section for section in SECTIONS}


@dataclass(frozen=True)
class Outcome:
    section: Section
    verdict: Verdict
    reason: str


class SectionFailed(Exception):
    """Raised inside a section: the section fails with this reason."""


class SectionSkipped(Exception):
    """Raised inside a section: the section does not apply, for this reason."""


@dataclass
class Report:
    """The verdicts so far, by section key."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def record(self, key: str, verdict: Verdict, reason: str) -> None:
        self.outcomes[key] = Outcome(BY_KEY[key], verdict, reason)

    def verdict(self, key: str) -> Verdict | None:
        outcome = self.outcomes.get(key)
        return None if outcome is None else outcome.verdict

    @property
    def passed(self) -> bool:
        """No section failed, and registration passed (without it nothing was checked)."""
        return (self.verdict("registration") is Verdict.PASS
                and all(outcome.verdict is not Verdict.FAIL for outcome in self.outcomes.values()))

    def lines(self) -> list[str]:
        """One line per section, in the order of SECTIONS: verdict, section, references, reason."""
        width = max(len(section.key) for section in SECTIONS)
        out = []
        for section in SECTIONS:
            outcome = self.outcomes.get(section.key) or Outcome(section, Verdict.SKIP, "not reached")
            out.append(f"{outcome.verdict.value}  {section.key:<{width}}  {section.refs:<8} {outcome.reason}")
        return out
