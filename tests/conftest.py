"""Without a GPU, Triton kernels run through Triton's interpreter; it must be chosen before triton
is first imported, so it is set here, before any test module loads. Every test runs under a watchdog
(a_test_that_hangs_fails) and sees only the runs it makes (no_committed_times)."""
import faulthandler
import os
import signal
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

HANG_S = int(os.environ.get("TEST_HANG_S", "300"))   # the slowest: ~35 s on 2 CPU cores, ~95 s in .ci/gpu


@pytest.fixture(autouse=True)
def a_test_that_hangs_fails():
    """A test that hangs (waiting on a lock that a killed child process held, say) would hold the whole
    suite until CI's limit: after HANG_S seconds it fails with every thread's stack, and the suite goes
    on. The stacks come through the test's report, which pytest prints whatever it captured."""
    def hung(signum, frame):
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            stacks = f.read()
        pytest.fail(f"still running after {HANG_S} s; every thread's stack, newest call first:\n{stacks}",
                    pytrace=False)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def no_committed_times(monkeypatch, tmp_path_factory):
    """jobs.time_of also reads this repository's committed runs (jobs.RESULTS): a test sees only the runs
    it makes, unless it points jobs.RESULTS somewhere itself."""
    import jobs
    monkeypatch.setattr(jobs, "RESULTS", tmp_path_factory.getbasetemp() / "no-committed-results")
