"""checksums.sha256: written in sha256sum's format, verified before loading, clear errors."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess

import pytest

from hfexport.errors import HfExportError, IntegrityError
from hfexport.integrity import (
    CHECKSUMS_NAME,
    compute_checksums,
    read_checksums,
    verify_checksums,
    verify_file,
    write_checksums,
)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "model.pt2").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "config.json").write_text('{"a": 1}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"\x00" * 10)
    return tmp_path


def test_written_list_is_sha256sum_output_and_verifies_with_coreutils(folder):
    digests = write_checksums(folder)
    expected = {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("config.json", "model.pt2", "sub/w.bin")
    }
    assert digests == expected
    lines = (folder / CHECKSUMS_NAME).read_text().splitlines()
    assert lines == [f"{expected[n]}  {n}" for n in sorted(expected)]
    assert read_checksums(folder) == expected
    assert verify_checksums(folder) == expected
    if shutil.which("sha256sum") is None:
        pytest.skip("coreutils sha256sum is not installed on this machine")
    check = subprocess.run(["sha256sum", "-c", CHECKSUMS_NAME], cwd=folder, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == 3


def test_a_flipped_byte_names_the_file_and_both_digests(folder):
    write_checksums(folder)
    before = hashlib.sha256((folder / "model.pt2").read_bytes()).hexdigest()
    data = bytearray((folder / "model.pt2").read_bytes())
    data[1234] ^= 0x40
    (folder / "model.pt2").write_bytes(bytes(data))
    after = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(IntegrityError) as caught:
        verify_checksums(folder)
    message = str(caught.value)
    assert message.startswith(
        f"{folder / 'model.pt2'} does not match its checksum in {folder / CHECKSUMS_NAME}"
    )
    assert f"expected SHA-256 {before}, got {after}" in message
    assert "re-export it (or download it again)" in message
    assert isinstance(caught.value, HfExportError) and isinstance(caught.value, ValueError)
    with pytest.raises(IntegrityError, match=r"model\.pt2 does not match"):
        verify_file(folder / "model.pt2")
    assert verify_file(folder / "config.json") is not None  # the other files still verify


def test_missing_unlisted_and_malformed(folder, caplog):
    write_checksums(folder)
    (folder / "sub" / "w.bin").unlink()
    with pytest.raises(IntegrityError, match=r"sub/w\.bin is listed in .*checksums\.sha256 but missing"):
        verify_checksums(folder)
    (folder / "extra.onnx").write_bytes(b"x")
    with pytest.raises(IntegrityError, match=r"extra\.onnx is not listed in .*checksums\.sha256"):
        verify_checksums(folder, ["extra.onnx"])
    assert verify_checksums(folder, ["extra.onnx"], require_listed=False) == {}
    assert verify_file(folder / "extra.onnx") is None
    (folder / CHECKSUMS_NAME).write_text("not a checksum line\n")
    with pytest.raises(IntegrityError, match=r"line 1 is not a sha256sum line"):
        verify_checksums(folder)


def test_a_folder_without_a_list_warns_once_and_proceeds(tmp_path, caplog):
    (tmp_path / "model.pt2").write_bytes(b"abc")
    with caplog.at_level(logging.WARNING, logger="hfexport.integrity"):
        assert verify_checksums(tmp_path) is None
        assert verify_file(tmp_path / "model.pt2") is None
        assert verify_checksums(tmp_path / "absent") is None  # no folder: nothing to warn about
    warnings = [r.getMessage() for r in caplog.records if r.name == "hfexport.integrity"]
    assert len(warnings) == 1
    assert f"{tmp_path} has no checksums.sha256" in warnings[0]


def test_names_needing_escapes_round_trip(tmp_path):
    (tmp_path / "a\\b.bin").write_bytes(b"1")
    (tmp_path / "plain.bin").write_bytes(b"2")
    digests = write_checksums(tmp_path)
    text = (tmp_path / CHECKSUMS_NAME).read_text()
    assert text.startswith("\\")  # coreutils marks an escaped name with a leading backslash
    assert read_checksums(tmp_path) == digests
    assert verify_checksums(tmp_path) == digests
    assert compute_checksums(tmp_path, ["plain.bin"]) == {"plain.bin": digests["plain.bin"]}


def test_digests_hashed_ahead_follow_the_file_through_a_rename(tmp_path, monkeypatch):
    import hashlib
    import os

    from hfexport import integrity

    folder = tmp_path / "staging"
    folder.mkdir()
    (folder / "model.bin").write_bytes(b"weights" * 100_000)
    (folder / "other.bin").write_bytes(b"x" * 10)
    integrity.hash_in_background(folder)
    for future in list(integrity._ahead.values()):
        future.result()
    reads = []
    monkeypatch.setattr(integrity, "_read_sha256", lambda path: reads.append(path) or "recomputed")
    # a rename keeps the file's identity: the digest computed ahead is used, not a second read
    os.rename(folder / "model.bin", tmp_path / "model.bin")
    assert integrity.file_sha256(tmp_path / "model.bin") == hashlib.sha256(b"weights" * 100_000).hexdigest()
    assert reads == []
    # a file changed after it was hashed ahead is hashed again
    (folder / "other.bin").write_bytes(b"y" * 11)
    assert integrity.file_sha256(folder / "other.bin") == "recomputed"
    assert reads == [folder / "other.bin"]
    # each precomputed digest is used once; later calls read the file
    assert integrity.file_sha256(tmp_path / "model.bin") == "recomputed"
