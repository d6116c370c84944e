"""What reading a corpus kept, skipped and repaired: the counts, the sidecar's ``report`` and the
lines that say it on stderr (``tokenize``, ``train-tokenizer``) and in ``inspect``.

Nothing a user gives the data tools is dropped without a count here: empty documents, documents
with undecodable UTF-8, records skipped by ``--skip-bad`` and files that ``--skip-bad`` read only
up to their damage, each file with the records read from it (and, for a parquet file, whose
footer says how many rows it holds, the rows not read).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

_LISTED_FILES = 10
"""Damaged files named one per line; the others are counted in one more line."""


@dataclass(frozen=True)
class CutFile:
    """A file ``--skip-bad`` read only up to its damage."""

    path: str
    problem: str
    """What is wrong and where it starts (``not a readable zstd file after the record at line
    971 (...)``)."""
    records_read: int | None
    """Records of the file read before the damage (lines, paragraphs or rows; the skipped and
    empty ones among them); None in a report written before this was recorded."""
    records_not_read: int | None = None
    """Records of the file after the damage, where the file says how many it holds (a parquet
    file's footer); None where nothing tells (a .gz or .zst cut short)."""

    def describe(self) -> str:
        if self.records_read is None:
            return f"{self.path}: {self.problem}"
        unread = ("the rest of the file unread, its length unknown"
                  if self.records_not_read is None else f"{self.records_not_read:,} not read")
        return (f"{self.path}: {self.problem.rstrip('.')} ({self.records_read:,} record(s) read, "
                f"{unread})")


@dataclass
class DocumentCounts:
    """What decoding kept, skipped and repaired; ``first_*`` locate the first case as FILE:LINE."""

    documents: int = 0
    empty: int = 0
    first_empty: str | None = None
    undecodable: int = 0
    first_undecodable: str | None = None
    empty_kept: int = 0
    """Empty documents written (--keep-empty)."""
    bad: int = 0
    """Records skipped by --skip-bad (not JSON, no text field, null)."""
    first_bad: str | None = None
    cut_files: list[CutFile] = field(default_factory=list)
    """Files --skip-bad read only up to where they turned out unreadable (a corrupt or truncated
    .gz, .zst or .parquet; a parquet file without the text column, wholly), in input order."""

    @property
    def bad_files(self) -> int:
        return len(self.cut_files)

    def add(self, later: DocumentCounts) -> None:
        """Fold in the counts of input that comes after this one's."""
        self.documents += later.documents
        self.empty += later.empty
        self.first_empty = self.first_empty or later.first_empty
        self.undecodable += later.undecodable
        self.first_undecodable = self.first_undecodable or later.first_undecodable
        self.empty_kept += later.empty_kept
        self.bad += later.bad
        self.first_bad = self.first_bad or later.first_bad
        self.cut_files.extend(later.cut_files)

    def as_report(self, policy: str) -> dict:
        report = {"empty_documents_skipped": self.empty, "first_empty_document": self.first_empty,
                  "undecodable_documents": self.undecodable, "undecodable_policy": policy,
                  "first_undecodable_document": self.first_undecodable}
        # Only when there are any: the reports of runs without them read as they always have.
        if self.empty_kept:
            report["empty_documents_kept"] = self.empty_kept
        if self.bad:
            report.update(bad_records_skipped=self.bad, first_bad_record=self.first_bad)
        if self.cut_files:
            report.update(bad_files_cut=len(self.cut_files),
                          first_bad_file=f"{self.cut_files[0].path}: {self.cut_files[0].problem}",
                          cut_files=[asdict(cut) for cut in self.cut_files])
        return report

    @classmethod
    def from_report(cls, report: dict) -> DocumentCounts:
        """The counts a sidecar's ``report`` holds (``documents`` is not among them: 0)."""
        cut = [CutFile(**entry) for entry in report.get("cut_files", [])]
        if not cut and report.get("bad_files_cut"):  # a report written before the list existed
            path, _, problem = (report.get("first_bad_file") or "").partition(": ")
            cut = [CutFile(path or "(not recorded)", problem or "damaged", None)]
            cut += [CutFile("(not recorded)", "damaged", None)] * (report["bad_files_cut"] - 1)
        return cls(empty=report.get("empty_documents_skipped", 0),
                   first_empty=report.get("first_empty_document"),
                   undecodable=report.get("undecodable_documents", 0),
                   first_undecodable=report.get("first_undecodable_document"),
                   empty_kept=report.get("empty_documents_kept", 0),
                   bad=report.get("bad_records_skipped", 0),
                   first_bad=report.get("first_bad_record"), cut_files=cut)


def merged_report(reports: list[dict]) -> dict:
    """One report for datasets concatenated in order (``merge``): every count summed, the first
    location of each kind kept, the damaged files listed in order."""
    total = DocumentCounts()
    for report in reports:
        total.add(DocumentCounts.from_report(report))
    policies = {report["undecodable_policy"] for report in reports
                if report.get("undecodable_policy")}
    return total.as_report(policies.pop() if len(policies) == 1 else
                           "mixed" if policies else "replace")


def report_lines(report: dict) -> list[str]:
    """What a ``report`` says was skipped, repaired or cut, one warning (or note) per line;
    empty when everything was read and kept as it was."""
    lines = []
    if report.get("empty_documents_skipped"):
        lines.append(f"warning: {report['empty_documents_skipped']:,} empty document(s) skipped "
                     f"(first at {report['first_empty_document']})")
    if report.get("bad_records_skipped"):
        lines.append(f"warning: {report['bad_records_skipped']:,} bad record(s) skipped (first "
                     f"at {report['first_bad_record']}); --skip-bad was given")
    if report.get("bad_files_cut"):
        cut = DocumentCounts.from_report(report).cut_files
        lines.append(f"warning: {len(cut):,} damaged file(s) read only up to the damage, the "
                     "rest of each skipped; --skip-bad was given:")
        lines += [f"warning:   {entry.describe()}" for entry in cut[:_LISTED_FILES]]
        if len(cut) > _LISTED_FILES:
            lines.append(f"warning:   and {len(cut) - _LISTED_FILES:,} more (the sidecar's "
                         "report.cut_files lists them all)")
    if report.get("empty_documents_kept"):
        lines.append(f"note: {report['empty_documents_kept']:,} empty document(s) written without "
                     "tokens (--keep-empty)")
    if report.get("undecodable_documents"):
        action = {"replace": "bad bytes replaced by U+FFFD", "skip": "skipped"}.get(
            report.get("undecodable_policy"), "replaced or skipped")
        lines.append(f"warning: {report['undecodable_documents']:,} document(s) with undecodable "
                     f"UTF-8, {action} (first at {report['first_undecodable_document']}); "
                     "--on-bad-utf8 chooses")
    return lines
