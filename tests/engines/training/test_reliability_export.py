"""Issue 23, no data lost: `tandem export CKPT DIR` replaces DIR only when that loses nothing of the user's."""

from __future__ import annotations

import os

import pytest

from tandem.cli import main
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
from tandem.engines.training.fsdp.export import EXPORT_MARKER
from tandem.models import ModelConfig

from .helpers import TINY, make_batch, token_mean_pg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    engine = FSDPEngine(FSDPConfig(model=ModelConfig(name=TINY), optimizer=OptimizerConfig(lr=1e-2),
                                   micro_batch_tokens=32))
    engine.train_step(make_batch(), token_mean_pg)
    path = tmp_path_factory.mktemp("export") / "ckpt"
    engine.save(str(path))
    return path


def _refused(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: refusing") and "\n" not in err, err
    return err


def test_a_folder_that_is_not_an_export_is_kept_unless_forced(tmp_path, checkpoint, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert "--force" in _refused(capsys, str(checkpoint), str(mine))
    assert (mine / "notes.txt").read_text() == "keep me"
    assert main(["export", str(checkpoint), str(mine), "--force"]) == 0
    assert (mine / EXPORT_MARKER).is_file() and not (mine / "notes.txt").exists()


def test_a_previous_export_and_an_empty_folder_are_replaced(tmp_path, checkpoint):
    out = tmp_path / "hf"
    out.mkdir()  # empty: nothing to lose
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert (out / EXPORT_MARKER).is_file() and (out / "config.json").is_file()
    (out / "stale.txt").write_text("from the last export")
    assert main(["export", str(checkpoint), str(out), "--dtype", "bfloat16"]) == 0  # a previous export
    assert not (out / "stale.txt").exists() and '"bfloat16"' in (out / EXPORT_MARKER).read_text()


def test_never_the_current_directory_its_parents_or_the_checkpoint(tmp_path, checkpoint, capsys, monkeypatch):
    work = tmp_path / "work" / "sub"
    work.mkdir(parents=True)
    (work / "code.py").write_text("precious")
    monkeypatch.chdir(work)
    for target in (".", "..", str(work), os.path.relpath(tmp_path)):
        assert "current directory" in _refused(capsys, str(checkpoint), target, "--force")
    assert "holds the checkpoint" in _refused(capsys, str(checkpoint), str(checkpoint), "--force")
    assert "holds the checkpoint" in _refused(capsys, str(checkpoint), str(checkpoint.parent), "--force")
    (work / "file.bin").write_text("x")
    assert "is a file" in _refused(capsys, str(checkpoint), "file.bin", "--force")
    assert (work / "code.py").read_text() == "precious" and (checkpoint / "tandem_checkpoint.json").is_file()
