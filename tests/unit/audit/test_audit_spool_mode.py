"""An auditor that makes the spool first makes it as shared as the volume it lives on."""

from __future__ import annotations

from zerolayer.bpf.journal import JournalSource, create_spool


def test_spool_takes_the_mode_of_the_shared_volume(tmp_path):
    volume = tmp_path / "run"
    volume.mkdir()
    volume.chmod(0o2777)  # an emptyDir under fsGroup
    JournalSource(volume / "audit")
    assert (volume / "audit").stat().st_mode & 0o7777 == 0o2777


def test_spool_in_a_private_directory_stays_private(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    create_spool(private / "audit")
    assert (private / "audit").stat().st_mode & 0o7777 == 0o700


def test_an_existing_spool_is_left_as_it_is(tmp_path):
    spool = tmp_path / "audit"
    spool.mkdir()
    spool.chmod(0o750)
    create_spool(spool)
    assert spool.stat().st_mode & 0o7777 == 0o750
