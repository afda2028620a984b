"""load_component checks a .pte against checksums.sha256 before the ExecuTorch runtime reads it."""

from __future__ import annotations

import pytest

from hfexport.errors import IntegrityError
from hfexport.integrity import write_checksums
from hfexport_executorch.generation import load_component


def test_a_changed_program_is_refused_before_loading(tmp_path):
    (tmp_path / "decode.pte").write_bytes(b"program bytes")
    write_checksums(tmp_path)
    (tmp_path / "decode.pte").write_bytes(b"changed bytes")
    with pytest.raises(
        IntegrityError, match=r"decode\.pte does not match its checksum in .*checksums\.sha256"
    ):
        load_component(tmp_path / "decode.pte", {"in_spec": "unused", "out_spec": "unused"})
