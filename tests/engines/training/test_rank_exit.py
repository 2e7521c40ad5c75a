"""`exit_rank`: a rank's process ends like a normal exit (atexit handlers, flushed output) minus finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tandem.engines.training.common.rank_exit import exit_rank

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path
    from tandem.engines.training.common.rank_exit import exit_rank

    class Finalized:  # a normal exit runs this during finalization (sys.exit writes the file); exit_rank never does
        def __del__(self, path=Path(sys.argv[1], "finalized")):  # bound now: finalization clears module globals
            path.write_text("yes")

    keep = Finalized()
    atexit.register(lambda: Path(sys.argv[1], "atexit").write_text("ran"))
    sys.stdout.write("buffered, no newline")
    sys.stderr.write("to stderr")
    exit_rank(int(sys.argv[2]))
    Path(sys.argv[1], "after").write_text("exit_rank returned")
""")


@pytest.mark.parametrize("code", [0, 3])
def test_exit_rank_runs_atexit_flushes_and_skips_finalization(tmp_path, code):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(code)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == code, run.stderr
    assert run.stdout == "buffered, no newline"  # a pipe is block-buffered: only the flush delivers it
    assert run.stderr == "to stderr"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "after").exists()
    assert not (tmp_path / "finalized").exists()  # module globals were never torn down


def test_exit_rank_refuses_a_code_the_os_would_truncate():
    with pytest.raises(ValueError, match="exit code 256 is outside 0..255"):
        exit_rank(256)
