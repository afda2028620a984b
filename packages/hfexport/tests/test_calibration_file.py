"""Calibration prompt files (hfexport.calibration): bad files are refused with a message naming the file."""

from __future__ import annotations

import pytest
import torch

from hfexport.calibration import _prompt_batches


def test_binary_calibration_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "prompts.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xb7\xff\x00")
    sample = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(
        ValueError, match=r"calibration file .*prompts\.bin is not UTF-8 text \(byte \d+"
    ) as info:
        _prompt_batches(str(path), tokenizer=None, sample_inputs=sample, limit=4)
    assert "one prompt per line" in str(info.value)


def test_blank_calibration_file_is_refused(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompts; give one prompt per line"):
        _prompt_batches(str(path), tokenizer=None, sample_inputs={}, limit=4)
