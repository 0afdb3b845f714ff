"""A Parquet file is read with bounded memory: the reader holds about one row group's buffers at a time, not every
column chunk it has read so far (pyarrow's pre_buffer default caches them until the file is closed, so a pass over
a 2 GB file ended holding ~2 GB: docs/benchmarks.md, issue 32)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq

from hfport.train.data import iter_records

ROW_GROUPS, ROWS = 32, 512


def test_a_pass_over_a_parquet_file_holds_one_row_group_not_the_file(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "big.parquet"
    schema = pa.schema([("text", pa.string()), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:  # random hex: the file barely compresses
        for g in range(ROW_GROUPS):
            writer.write_table(pa.table({"text": [rng.randbytes(100).hex() for _ in range(ROWS)],
                                         "label": [g] * ROWS}, schema=schema))
    file_bytes = path.stat().st_size
    assert file_bytes > 3 * 2**20  # the file held whole stands far above one row group (~100 KiB)
    before = pa.total_allocated_bytes()
    most = rows = 0
    for record in iter_records(path):
        assert record.values["label"] == record.line // ROWS
        rows += 1
        most = max(most, pa.total_allocated_bytes() - before)
    assert rows == ROW_GROUPS * ROWS
    # with pre_buffer the cache reached the whole file (~file_bytes) by the last row group
    assert most < file_bytes / 4, f"Arrow held {most / 2**20:.1f} MiB reading a {file_bytes / 2**20:.1f} MiB file"
