"""What reading kept, skipped and cut, as the sidecar's report and stderr say it
(data_tools/report.py): merged reports keep every count, a report written before damaged files
were listed keeps its count, and a long list of damaged files is cut to ten lines and a count."""

from __future__ import annotations

from data_tools.report import CutFile, DocumentCounts, merged_report, report_lines


def _report(**counts) -> dict:
    return DocumentCounts(**counts).as_report("replace")


def test_merged_reports_sum_every_count_and_keep_the_first_locations() -> None:
    first = _report(empty=2, first_empty="a.jsonl:4", bad=1, first_bad="a.jsonl:9",
                    cut_files=[CutFile("a.jsonl.zst", "cut", 10)])
    second = _report(empty=1, first_empty="b.jsonl:1", undecodable=3,
                     first_undecodable="b.jsonl:2", empty_kept=5,
                     cut_files=[CutFile("b.parquet", "damaged", 7, 93)])
    merged = merged_report([first, second])
    assert (merged["empty_documents_skipped"], merged["first_empty_document"]) == (3, "a.jsonl:4")
    assert (merged["bad_records_skipped"], merged["first_bad_record"]) == (1, "a.jsonl:9")
    assert merged["undecodable_documents"] == 3 and merged["empty_documents_kept"] == 5
    assert [c["path"] for c in merged["cut_files"]] == ["a.jsonl.zst", "b.parquet"]
    assert merged["bad_files_cut"] == 2 and merged["first_bad_file"] == "a.jsonl.zst: cut"


def test_a_report_without_the_list_of_damaged_files_keeps_its_count() -> None:
    old = {"empty_documents_skipped": 0, "undecodable_documents": 0,
           "undecodable_policy": "replace", "bad_files_cut": 2,
           "first_bad_file": "a.gz: not a readable gzip file after the record at line 3"}
    assert merged_report([old, old])["bad_files_cut"] == 4
    lines = report_lines(old)
    assert "a.gz: not a readable gzip file after the record at line 3" in lines[1]


def test_many_damaged_files_are_listed_ten_and_counted() -> None:
    cut = [CutFile(f"f{i}.zst", "cut", i) for i in range(13)]
    lines = report_lines(_report(cut_files=cut))
    assert lines[0].startswith("warning: 13 damaged file(s)")
    assert [line.split()[1] for line in lines[1:11]] == [f"f{i}.zst:" for i in range(10)]
    assert lines[11] == "warning:   and 3 more (the sidecar's report.cut_files lists them all)"
