"""Without a GPU, Triton kernels run through Triton's interpreter; it must be chosen before triton
is first imported, so it is set here, before any test module loads."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
