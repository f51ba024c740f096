"""flashinfer_triton: FlashInfer's attention API in Python with Triton kernels (being built)."""
