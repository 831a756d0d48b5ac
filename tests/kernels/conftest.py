"""Triton kernels run under Triton's interpreter on machines without a GPU.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before
any test module imports `atelier.kernels.triton_ops`."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
