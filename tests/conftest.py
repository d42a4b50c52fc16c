import os

import torch

# Triton kernels run in the interpreter on machines without a GPU. This must be set before any module
# defining @triton.jit functions is imported, so it lives here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
