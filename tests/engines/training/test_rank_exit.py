"""`exit_rank`: a rank's process ends like a normal exit (threads joined, atexit handlers, flushed output)
minus finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tandem.engines.training.common.rank_exit import exit_rank

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    from tandem.engines.training.common.rank_exit import exit_rank

    class Finalized:  # a normal exit runs this during finalization (sys.exit writes the file); exit_rank never does
        def __del__(self, path=Path(sys.argv[1], "finalized")):  # bound now: finalization clears module globals
            path.write_text("yes")

    keep = Finalized()
    writer = threading.Thread(target=lambda: (time.sleep(0.5), Path(sys.argv[1], "thread").write_text("done")))
    writer.start()  # non-daemon: a normal exit waits for it, and so must exit_rank
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)  # its idle worker is a non-daemon thread too: joining it alone would hang
    pool.submit(int).result()
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
    assert (tmp_path / "thread").read_text() == "done"
    assert not (tmp_path / "after").exists()
    assert not (tmp_path / "finalized").exists()  # module globals were never torn down


def test_exit_rank_refuses_a_code_the_os_would_truncate():
    with pytest.raises(ValueError, match="exit code 256 is outside 0..255"):
        exit_rank(256)
