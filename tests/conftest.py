"""Shared test setup: run Triton kernels for real on the CPU when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any test module is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
