"""`python -m megabeta.bench packing --data PREFIX` prints each way's padding share of the
dataset, as the datasets themselves count it."""

from __future__ import annotations

import numpy as np

from data_tools.writer import IndexedDatasetWriter
from megabeta.bench.packing import main
from megabeta.data import BlockAlignedDataset, DocumentDataset, IndexedDataset


def test_the_table_reports_the_datasets_padding(tmp_path, capsys):
    lengths = np.random.default_rng(0).integers(2, 100, 300)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_documents(np.full(int(lengths.sum()), 7, dtype=np.uint16), lengths)
        writer.commit({"tokenizer": {"vocab_size": 100}})
    main(["--data", str(tmp_path / "d"), "--seq-len", "64", "--blocks", "8,32"])
    row = [line for line in capsys.readouterr().out.splitlines() if str(tmp_path) in line][0]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    source = IndexedDataset(tmp_path / "d")
    expected = [0.0, BlockAlignedDataset(source, 64, 8).padding_share,
                BlockAlignedDataset(source, 64, 32).padding_share,
                DocumentDataset(source, 64).padding_share]
    assert cells[1:3] == ["300", str(int(lengths.sum()))]
    assert cells[5:] == [f"{100 * share:.1f} %" for share in expected]
