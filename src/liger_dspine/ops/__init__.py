"""Triton kernels of liger-dspine and the autograd functions around them (imported lazily)."""
