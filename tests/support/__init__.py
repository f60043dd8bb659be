"""Helpers the tests share (not tests themselves): emulators of the CUDA kernels' fragment
layouts, the host executor's parity harness, f64 gradient checks, ptxas reports, the
references built by transformers and converted by llama.cpp."""
