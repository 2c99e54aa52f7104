"""Suite-wide settings.

Every test process (and every subprocess a test starts: gloo ranks, torchrun, `openk2 serve`) runs torch with one
intra-op thread. The test workloads are micro models, too small to gain from a second thread, and the
multi-process tests would otherwise put 2-4 ranks x 2 threads on 2 cores, where OpenMP's spinning threads make
each rank many times slower; one thread also keeps the suite's time steady when the machine has other work.
"""

import os

import pytest

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

from tests.tiny_k2 import tiny_k2_checkpoint  # noqa: E402, F401  (one tiny K2 checkpoint for the whole session)


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """Trainers set `train.threads` for the whole process; the next test starts with the suite's one thread."""
    yield
    torch.set_num_threads(1)
