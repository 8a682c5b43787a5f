"""bench.mask_write: both paths write the same logits (it exits otherwise) and it reports each row count."""
from __future__ import annotations

import pytest

from bench import mask_write


def test_mask_write_reports_both_paths_per_row_count(capsys):
    results = mask_write.main(["--rows", "1", "3", "--vocab", "1024", "--allowed", "70", "--repeats", "3"])
    assert set(results) == {1, 3}
    assert all(set(r) == {"specjet", "xgrammar"} and min(r.values()) > 0 for r in results.values())
    assert "xgrammar us" in capsys.readouterr().out


def test_mask_write_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        mask_write.parse_args(["--allowed", "99999"])
