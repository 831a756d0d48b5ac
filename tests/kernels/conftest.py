"""Triton kernels run under Triton's interpreter on machines without a GPU (tests/conftest.py sets
TRITON_INTERPRET before anything imports Triton)."""
