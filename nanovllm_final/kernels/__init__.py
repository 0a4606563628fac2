"""Triton kernels, one file per operation, each beside the name of the PyTorch reference it is
checked against; `dispatch` decides which of the two runs, `tuning` owns every tile choice."""
