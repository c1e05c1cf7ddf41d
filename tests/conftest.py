"""Without a GPU, Triton kernels run through Triton's interpreter; it must be chosen before triton
is first imported, so it is set here, before any test module loads."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def no_committed_times(monkeypatch, tmp_path_factory):
    """jobs.time_of also reads this repository's committed runs (jobs.RESULTS): a test sees only the runs
    it makes, unless it points jobs.RESULTS somewhere itself."""
    import jobs
    monkeypatch.setattr(jobs, "RESULTS", tmp_path_factory.getbasetemp() / "no-committed-results")
