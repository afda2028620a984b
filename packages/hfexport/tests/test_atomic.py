"""Output folders are replaced as a whole: staged beside the target, swapped in with renames,
stale temporary folders of killed runs cleaned, foreign folders refused without overwrite."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfexport import atomic
from hfexport.atomic import atomic_output_dir, check_output_dir
from hfexport.errors import HfExportError, OutputDirectoryError

NEW_FILES = ["export_report.json", "model.onnx", "model.onnx.data"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file below ``folder`` (folders as ``b"<dir>"``)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        out[p.relative_to(folder).as_posix()] = b"<dir>" if p.is_dir() else p.read_bytes()
    return out


def ours(parent: Path) -> list[str]:
    """Our temporary folders (staging, old, trash) in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if ".hfexport-" in p.name)


@pytest.fixture
def previous(tmp_path) -> Path:
    """``tmp_path/out`` holding a previous generation export (manifest, components, report)."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "generation_manifest.json").write_text('{"files": {"decode": "decode.onnx"}}')
    (out / "decode.onnx").write_bytes(b"old graph")
    (out / "decode.onnx.data").write_bytes(bytes(range(256)) * 4)
    (out / "export_report.json").write_text(json.dumps({"export_format": "onnx"}))
    (out / "sub" / "nested.bin").write_bytes(b"\x00\x01")
    return out


def write_new_export(staging: Path) -> None:
    (staging / "model.onnx").write_bytes(b"new graph")
    (staging / "model.onnx.data").write_bytes(b"new weights")
    (staging / "export_report.json").write_text('{"new": true}')


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_plain_export_replaces_a_generation_export_entirely(previous, tmp_path):
    with atomic_output_dir(previous) as staging:
        assert staging.parent == previous.parent and staging.name.startswith(".out.hfexport-staging.")
        assert list(staging.iterdir()) == []
        write_new_export(staging)
    assert sorted(p.name for p in previous.iterdir()) == NEW_FILES
    assert (previous / "model.onnx.data").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging, backup or trash left


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_failed_rename_leaves_the_old_folder_byte_identical(previous, tmp_path, monkeypatch, failing_call):
    before = snapshot(previous)
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == failing_call:  # 1: old folder aside; 2: staging onto the target
            raise OSError(errno.EIO, "injected I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected I/O error"), atomic_output_dir(previous) as staging:
        write_new_export(staging)
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert calls[0][0] == "out" and calls[0][1].startswith(".out.hfexport-old.")
    if failing_call == 2:
        assert calls[1][0].startswith(".out.hfexport-staging.") and calls[1][1] == "out"
        assert calls[2] == (calls[0][1], "out")  # the old folder was renamed back


def test_a_failure_between_two_files_of_one_model_leaves_the_old_pair(previous, tmp_path):
    before = snapshot(previous)
    with pytest.raises(OSError, match="disk full"), atomic_output_dir(previous) as staging:
        (staging / "model.onnx").write_bytes(b"new graph")
        raise OSError(errno.ENOSPC, "disk full")  # before model.onnx.data was written
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_files_are_flushed_before_the_swap(previous, tmp_path, monkeypatch):
    before = snapshot(previous)

    def fsync(fd):
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="fsync failed"), atomic_output_dir(previous) as staging:
        write_new_export(staging)
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_swap_and_restore_both_failing_names_where_the_old_folder_is(previous, tmp_path, monkeypatch):
    before = snapshot(previous)
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) >= 2:
            raise OSError(errno.EIO, "injected I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OutputDirectoryError) as info, atomic_output_dir(previous) as staging:
        write_new_export(staging)
    backup = Path(calls[0])
    assert f"the previous folder is at '{backup}': rename it back by hand" in str(info.value)
    assert snapshot(backup) == before and not previous.exists()
    assert ours(tmp_path) == [backup.name]  # the staging folder is gone
    # a later run of another process restores it: make the backup look left by a dead process
    monkeypatch.setattr(os, "rename", real_rename)
    stale = backup.with_name(backup.name.replace(f".{os.getpid()}.", f".{dead_pid()}.", 1))
    backup.rename(stale)
    with pytest.raises(RuntimeError, match="crash"), atomic_output_dir(previous):
        raise RuntimeError("crash")
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_folder_gets_a_plain_mkdir_mode_and_missing_parents(tmp_path):
    old_umask = os.umask(0o022)
    try:
        target = tmp_path / "a" / "b" / "out"
        with atomic_output_dir(target) as staging:
            write_new_export(staging)
    finally:
        os.umask(old_umask)
    assert (target.stat().st_mode & 0o777) == 0o755  # not mkdtemp's 0o700
    assert sorted(p.name for p in target.iterdir()) == NEW_FILES
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_a_replaced_folder_keeps_its_permission_bits(previous):
    previous.chmod(0o750)
    with atomic_output_dir(previous) as staging:
        write_new_export(staging)
    assert (previous.stat().st_mode & 0o777) == 0o750


def test_a_symlinked_output_folder_is_followed_and_the_link_kept(previous, tmp_path):
    link = tmp_path / "links" / "current"
    link.parent.mkdir()
    link.symlink_to(previous, target_is_directory=True)
    with atomic_output_dir(link) as staging:
        assert staging.parent == previous.parent
        write_new_export(staging)
    assert link.is_symlink() and link.resolve() == previous.resolve()
    assert (link / "model.onnx").read_bytes() == b"new graph"
    assert not (previous / "generation_manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links", "out"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["current"]


def test_the_working_directory_inside_the_target_follows_the_new_folder(previous, monkeypatch):
    monkeypatch.chdir(previous / "sub")
    with atomic_output_dir(previous) as staging:
        (staging / "sub").mkdir()
        write_new_export(staging)
    assert os.getcwd() == str(previous / "sub")
    assert sorted(os.listdir("..")) == ["export_report.json", "model.onnx", "model.onnx.data", "sub"]


def test_nested_use_as_the_cli_does_with_save_components(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as outer:
        with atomic_output_dir(outer) as inner:
            (inner / "decode.pt2").write_bytes(b"component")
        (outer / "export_report.json").write_text(json.dumps({"export_format": "onnx"}))
    assert sorted(p.name for p in out.iterdir()) == ["decode.pt2", "export_report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_stale_temporary_folders_of_dead_runs_are_cleaned_and_nothing_else(previous, tmp_path):
    host = atomic._HOST
    dead = dead_pid()
    stale_staging = tmp_path / f".out.hfexport-staging.{dead}.{host}.0123abcd"
    stale_trash = tmp_path / f".out.hfexport-trash.{dead}.{host}.0123abce"
    finished_old = tmp_path / f".out.hfexport-old.{dead}.{host}.0123abcf"  # target exists: swap had finished
    old_by_age = tmp_path / f".out.hfexport-staging.{os.getppid()}.{host}.89abcdef"  # live pid, 2 days old
    live = tmp_path / f".out.hfexport-staging.{os.getppid()}.{host}.0badcafe"
    other_host = tmp_path / f".out.hfexport-staging.{dead}.ffffffff.0badcaff"
    other_target = tmp_path / f".other.hfexport-staging.{dead}.{host}.0123abcd"
    legacy = tmp_path / ".out.staging.k2j3h4"  # an older hfexport's mkdtemp name: not ours to judge
    foreign = tmp_path / ".out.backup"
    kept = [live, other_host, other_target, legacy, foreign]
    for folder in (stale_staging, stale_trash, finished_old, old_by_age, *kept):
        folder.mkdir()
        (folder / "model.onnx.data").write_bytes(b"partial")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old_by_age, (two_days_ago, two_days_ago))
    a_file = tmp_path / f".out.hfexport-staging.{dead}.{host}.0123abd0"
    a_file.write_text("a file with our name is not our folder")
    with atomic_output_dir(previous) as staging:
        write_new_export(staging)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", live.name, other_host.name, other_target.name, legacy.name, foreign.name, a_file.name]
    )
    assert (live / "model.onnx.data").read_bytes() == b"partial"


def test_nested_temporary_folders_of_a_killed_run_are_cleaned_with_their_outer_one(previous, tmp_path):
    # the CLI's generation export runs save_components (an atomic_output_dir) inside its staging folder
    host, dead = atomic._HOST, dead_pid()
    outer = tmp_path / f".out.hfexport-staging.{dead}.{host}.aaaaaaaa"
    inner = tmp_path / f".{outer.name}.hfexport-staging.{dead}.{host}.bbbbbbbb"
    for folder in (outer, inner):
        folder.mkdir()
        (folder / "decode.pt2").write_bytes(b"partial")
    with atomic_output_dir(previous) as staging:
        write_new_export(staging)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_old_folder_left_mid_swap_by_a_killed_run_is_restored(previous, tmp_path):
    before = snapshot(previous)
    backup = tmp_path / f".out.hfexport-old.{dead_pid()}.{atomic._HOST}.0123abcd"
    previous.rename(backup)  # killed between "old folder aside" and "staging onto the target"
    check_output_dir(previous)  # a missing target is fine
    with pytest.raises(KeyError), atomic_output_dir(previous):
        raise KeyError("this run fails too")
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_swap_whose_new_folder_was_already_in_is_rolled_back(previous, tmp_path):
    """Killed between "new folder onto the target" and "previous folder to the trash" (fault point
    move:3): the target holds the killed run's folder, its breadcrumb is left, its staging folder
    is gone. The next run (or the supervising CLI) puts the previous folder back: a killed export
    changes nothing."""
    before = snapshot(previous)
    host, dead = atomic._HOST, dead_pid()
    backup = tmp_path / f".out.hfexport-old.{dead}.{host}.0123abcd"
    previous.rename(backup)
    previous.mkdir()
    (previous / "model.onnx").write_bytes(b"the killed run's complete export")
    crumb = tmp_path / f".out.hfexport-staging.{dead}.{host}.0123abce{atomic._BREADCRUMB}"
    crumb.write_text("swap\n")
    atomic.clean_stale(previous)
    assert snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # a finished swap (no breadcrumb) keeps its new folder: only the leftover -old folder goes
    backup.mkdir()
    (backup / "model.onnx").write_bytes(b"older")
    atomic.clean_stale(previous)
    assert snapshot(previous) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_foreign_folder_is_refused_without_overwrite_and_replaced_with_it(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("do not lose me")
    (out / ".hidden").write_text("x")
    with pytest.raises(OutputDirectoryError) as info:
        check_output_dir(out)
    message = str(info.value)
    assert message.startswith(f"output folder '{out}' is not empty and is not a previous hfexport export")
    assert "it holds .hidden, notes.txt but no export_report.json or generation_manifest.json" in message
    assert "Pass --overwrite (overwrite=True) to replace it, or pick an empty or new folder" in message
    assert info.value.path == str(out)
    assert isinstance(info.value, ValueError) and isinstance(info.value, HfExportError)
    with pytest.raises(OutputDirectoryError, match="is not empty"), atomic_output_dir(out):
        pytest.fail("the body must not run")
    assert sorted(p.name for p in out.iterdir()) == [".hidden", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    check_output_dir(out, overwrite=True)
    with atomic_output_dir(out, overwrite=True) as staging:
        write_new_export(staging)
    assert sorted(p.name for p in out.iterdir()) == NEW_FILES


@pytest.mark.parametrize("marker", ["export_report.json", "generation_manifest.json"])
def test_empty_new_and_previous_export_folders_are_accepted(tmp_path, marker):
    check_output_dir(tmp_path / "new" / "deeper")
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty")
    (tmp_path / "prev").mkdir()
    key = "export_format" if marker == "export_report.json" else "manifest_version"
    (tmp_path / "prev" / marker).write_text(json.dumps({key: 1}))
    (tmp_path / "prev" / "model.pt2").write_bytes(b"x")
    check_output_dir(tmp_path / "prev")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "prev"]  # the check writes nothing


def test_a_marker_hfexport_did_not_write_or_a_file_added_later_is_refused(tmp_path):
    from hfexport.integrity import write_checksums

    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "export_report.json").write_text("{}")
    (fake / "thesis.docx").write_text("precious")
    with pytest.raises(OutputDirectoryError, match=r"its export_report\.json is not one hfexport wrote"):
        check_output_dir(fake)
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "export_report.json").write_text(json.dumps({"export_format": "onnx"}))
    (prev / "model.onnx").write_bytes(b"graph")
    write_checksums(prev)
    check_output_dir(prev)  # every file listed: a previous export
    (prev / "notes.txt").write_text("added after the export")
    with pytest.raises(OutputDirectoryError) as info:
        check_output_dir(prev)
    assert "notes.txt is not among the files the export listed in checksums.sha256" in str(info.value)
    assert (prev / "notes.txt").read_text() == "added after the export" and (fake / "thesis.docx").exists()
    check_output_dir(prev, overwrite=True)


def test_a_file_or_a_path_under_a_file_is_refused(tmp_path):
    a_file = tmp_path / "model.onnx"
    a_file.write_bytes(b"x")
    with pytest.raises(OutputDirectoryError) as info:
        check_output_dir(a_file)
    assert str(info.value).startswith(f"output folder '{a_file}' is a file, not a folder; pick a folder path")
    with pytest.raises(OutputDirectoryError) as info:
        check_output_dir(a_file / "sub" / "out")
    assert str(info.value) == (
        f"output folder '{a_file / 'sub' / 'out'}' cannot be created: '{a_file}' is a file, not a folder; "
        "pick another folder"
    )
    with pytest.raises(OutputDirectoryError, match="is a file, not a folder"), atomic_output_dir(a_file):
        pytest.fail("the body must not run")
    assert a_file.read_bytes() == b"x"


def test_an_unwritable_parent_is_refused(tmp_path, monkeypatch):
    # root ignores permission bits, so deny through os.access (what the check consults)
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if Path(p) == parent else real_access(p, mode, **kw)
    )
    for target in (parent / "out", parent / "a" / "b"):
        with pytest.raises(OutputDirectoryError) as info:
            check_output_dir(target)
        assert str(info.value).startswith(
            f"output folder '{target}' cannot be written: no write permission on '{parent}'"
        )
        assert str(info.value).endswith("fix the permissions or pick another folder")
    (parent / "out").mkdir()  # an existing target needs its parent writable too (the swap renames it)
    with pytest.raises(OutputDirectoryError, match="no write permission"):
        check_output_dir(parent / "out")


def test_the_home_folder_and_kept_paths_are_never_replaced(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models" / "bert").mkdir(parents=True)
    (home / "models" / "bert" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    for target in (home, tmp_path):
        with pytest.raises(OutputDirectoryError) as info:
            check_output_dir(target, overwrite=True)
        assert str(info.value).startswith(
            f"output folder '{target}' is or contains your home folder, which an export would delete"
        )
    model = home / "models" / "bert"
    for target in (model, home / "models"):
        with pytest.raises(OutputDirectoryError) as info:
            check_output_dir(target, overwrite=True, keep=["tiny:bert", model])
        assert str(info.value).startswith(f"output folder '{target}' is or contains '{model}'")
        assert f"pick a new folder for the export, e.g. '{target / 'export'}'" in str(info.value)
    check_output_dir(model / "export", keep=[model])
    with pytest.raises(OutputDirectoryError, match="file-system root"):
        check_output_dir("/", overwrite=True)


def test_a_single_file_is_flushed_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    good = tmp_path / "model.pt2"
    good.write_bytes(b"good")

    def fsync(fd):
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="fsync failed"), atomic.atomic_path(good) as tmp:
        tmp.write_bytes(b"new")
    assert good.read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]


# ---- write-once folders (atomic_new_dir: cache entries) -------------------------------------------


def test_a_new_folder_appears_whole_and_a_failed_body_leaves_nothing(tmp_path):
    target = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError, match="midway"), atomic.atomic_new_dir(target) as staging:
        (staging / "config.json").write_text("{}")
        assert not target.exists()
        raise RuntimeError("midway")
    assert list((tmp_path / "cache").iterdir()) == []
    with atomic.atomic_new_dir(target) as staging:
        assert staging.parent == target.parent and staging.name.startswith(".entry.hfexport-staging.")
        (staging / "config.json").write_text('{"a": 1}')
    assert snapshot(target) == {"config.json": b'{"a": 1}'}
    assert ours(target.parent) == []


def test_a_folder_another_process_created_first_is_kept(tmp_path):
    target = tmp_path / "entry"
    with atomic.atomic_new_dir(target) as staging:
        (staging / "model.safetensors").write_bytes(b"ours")
        target.mkdir()  # the other process's rename lands first
        (target / "model.safetensors").write_bytes(b"theirs")
    assert snapshot(target) == {"model.safetensors": b"theirs"}
    assert ours(tmp_path) == []


def test_a_new_folder_cleans_stale_staging_and_refuses_a_file(tmp_path):
    stale = tmp_path / f".entry.hfexport-staging.{dead_pid()}.{atomic._HOST}.0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    with atomic.atomic_new_dir(tmp_path / "entry") as staging:
        (staging / "x").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a folder"), atomic.atomic_new_dir(tmp_path / "file"):
        pytest.fail("body ran")
