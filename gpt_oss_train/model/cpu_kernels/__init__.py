"""CPU kernels the model calls through XLA's FFI where XLA's own lowering is slow
(C++ sources built on first use by `build.py`)."""
