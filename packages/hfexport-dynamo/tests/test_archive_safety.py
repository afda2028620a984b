"""Archives zip readers could read differently, corrupt archives, checksums, and the weights-only guard.

Every malicious archive is built here from a program saved by ``hfexport_dynamo.save``; its
"payload" only creates a marker file in the test's temporary folder.
"""

from __future__ import annotations

import io
import pickle
import re
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from hfexport.errors import IntegrityError
from hfexport.integrity import write_checksums
from hfexport.testing.pt2 import (
    SAMPLE_INPUTS,
    Pool,
    archive_members,
    member_data_offset,
    pickle_payload,
    pool_program,
    write_archive,
)
from hfexport_dynamo import (
    CorruptArtifactError,
    DynamoExporter,
    UnsafeArtifactError,
    check_archive,
    load,
    save,
)
from hfexport_dynamo import serialization as serialization_module
from hfexport_dynamo.safety import weights_only_loading

SAMPLE = SAMPLE_INPUTS


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "pool.pt2"
    save(pool_program(), path)
    return path


def _duplicate_sample_inputs(pool_file: Path, dst: Path, evil: bytes) -> Path:
    """The evil sample inputs first, the original copy moved to where torch's reader picks the evil one.

    Python's zipfile reads the last copy (the original); torch's reader (miniz, binary search over
    the sorted central directory) reads the first for one of these layouts, found by asking it.
    """
    members = archive_members(pool_file)
    root = members[0][0].split("/", 1)[0]
    name = f"{root}/{SAMPLE}"
    original = next(m for m in members if m[0] == name)
    rest = [m for m in members if m[0] != name]
    for position in range(len(rest), 0, -1):
        order = [(name, evil), *rest[:position], original, *rest[position:]]
        write_archive(dst, order)
        if torch._C.PyTorchFileReader(str(dst)).get_record(SAMPLE) == evil:
            with zipfile.ZipFile(dst) as zf:
                assert zf.read(name) == original[1]  # what the old inspection read
            return dst
    raise AssertionError("no layout makes torch's reader pick the first copy; this test proves nothing")


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")  # zipfile warns while we craft the file
@pytest.mark.parametrize("trust", [False, True])
def test_duplicate_member_is_refused_and_never_runs(tmp_path, pool_file, trust):
    marker = tmp_path / "marker"
    evil = _duplicate_sample_inputs(pool_file, tmp_path / "evil.pt2", pickle_payload(marker))
    with pytest.raises(UnsafeArtifactError) as caught:
        load(evil, trust_remote_code=trust)
    message = str(caught.value)
    assert message.startswith(f"refusing to load {evil}: zip readers could read different content from it")
    assert f"duplicate member 'archive/{SAMPLE}' (2 copies)" in message
    assert "trust_remote_code" not in message and "re-export the model" in message
    assert caught.value.problems == [
        f"duplicate member 'archive/{SAMPLE}' (2 copies): torch may read one copy and a check another"
    ]
    assert not marker.exists()


def test_names_torch_reads_as_one_record_are_refused(tmp_path, pool_file):
    members = archive_members(pool_file)
    extra = ("archive/data/sample_inputs/MODEL.pt", pickle_payload(tmp_path / "marker"))
    assert torch._C.PyTorchFileReader(str(pool_file)).has_record(SAMPLE.upper())  # case-insensitive
    crafted = write_archive(tmp_path / "case.pt2", [extra, *members])
    with pytest.raises(UnsafeArtifactError, match=r"differ only in case, separators or Unicode") as caught:
        load(crafted)
    assert "MODEL.pt" in str(caught.value) and "trust_remote_code" not in str(caught.value)
    assert not (tmp_path / "marker").exists()


def test_bytes_outside_the_listed_members_are_refused(tmp_path, pool_file):
    prefixed = tmp_path / "prefixed.pt2"
    prefixed.write_bytes(b"PK\x03\x04 hidden member" + pool_file.read_bytes())
    with pytest.raises(UnsafeArtifactError, match=r"data before the first member"):
        load(prefixed)


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("kind", ["truncated", "text", "crc"])
def test_corrupt_archives_are_reported_as_corrupt(tmp_path, pool_file, kind, trust):
    data = pool_file.read_bytes()
    path = tmp_path / f"{kind}.pt2"
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
        reason = r"not a zip archive"
    elif kind == "text":
        path.write_text("this is a README, not a model\n")
        reason = r"not a zip archive"
    else:  # one weight byte flipped, no checksums.sha256: the zip CRC still catches it
        start = member_data_offset(pool_file, "archive/data/weights/weight_0")
        flipped = bytearray(data)
        flipped[start + 5] ^= 0x10
        path.write_bytes(bytes(flipped))
        reason = r"member 'archive/data/weights/weight_0' fails its CRC-32 check"
    with pytest.raises(CorruptArtifactError) as caught:
        load(path, trust_remote_code=trust)
    message = str(caught.value)
    assert message.startswith(f"{path} is not a valid torch.export archive (.pt2): ")
    assert re.search(reason, message), message
    assert message.endswith("The file is truncated or corrupt: re-export it (or download it again).")
    assert "trust_remote_code" not in message and "could run code" not in message
    assert caught.value.path == str(path)


def test_a_flipped_weight_byte_fails_the_checksum(tmp_path, pool_file):
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "model.pt2"
    target.write_bytes(pool_file.read_bytes())
    (folder / "config.json").write_text("{}")
    write_checksums(folder)
    assert load(target) is not None  # verifies, loads
    start = member_data_offset(target, "archive/data/weights/weight_0")
    data = bytearray(target.read_bytes())
    data[start + 5] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.pt2 does not match its checksum in .*checksums\.sha256: "
                       r"expected SHA-256 [0-9a-f]{64}, got [0-9a-f]{64}\. .*re-export it"):  # fmt: skip
        load(target, trust_remote_code=True)
    # a file copied on its own, into a folder whose list does not name it, still loads (unchecked)
    copy = folder / "copy.pt2"
    copy.write_bytes(pool_file.read_bytes())
    assert load(copy) is not None


def test_the_guard_stops_full_unpickling_the_inspection_missed(tmp_path, pool_file, monkeypatch):
    marker = tmp_path / "marker"
    members = [
        (n, pickle_payload(marker) if n.endswith(SAMPLE) else d) for n, d in archive_members(pool_file)
    ]
    evil = write_archive(tmp_path / "evil.pt2", members)
    monkeypatch.setattr(serialization_module, "inspect_pt2", lambda handle, path=None: [])  # a missed case
    original_load = torch.load
    with pytest.raises(UnsafeArtifactError, match=r"torch\.export\.load asked to unpickle a payload in full"):
        load(evil)
    assert not marker.exists()
    assert torch.load is original_load  # the guard is gone afterwards


def test_the_guard_holds_in_its_thread_only(tmp_path):
    marker = tmp_path / "marker"
    payload = pickle_payload(marker)
    other: list[object] = []
    with weights_only_loading("x.pt2"):
        with pytest.raises(UnsafeArtifactError, match=r"refusing to load x\.pt2"):
            torch.load(io.BytesIO(payload), weights_only=False)
        assert not marker.exists()
        with pytest.raises(UnsafeArtifactError, match="opaque Python object"):
            from torch.export.pt2_archive import _package

            _package.pickle.loads(pickle.dumps(1))
        thread = threading.Thread(
            target=lambda: other.append(torch.load(io.BytesIO(payload), weights_only=False))
        )
        thread.start()
        thread.join()
    assert marker.exists()  # the other thread was not restricted (its own, trusted, load)
    assert len(other) == 1


def test_check_archive_accepts_what_save_writes_and_the_exporter_loads_it(pool_file):
    with open(pool_file, "rb") as handle:
        check_archive(handle, path=str(pool_file))
    program = DynamoExporter().load(pool_file)
    x = torch.randn(2, 7, 4)
    torch.testing.assert_close(program.module()(x=x), Pool().eval()(x), rtol=0, atol=0)
