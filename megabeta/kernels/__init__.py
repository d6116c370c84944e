"""The kernels the model's backends run: the history attention operator and its CPU (fused
C++, compiled on first use by torch's extension loader) and Triton implementations, the
elementwise kernels, multi-tensor copies and the launch observers. Where the C++ kernels cannot
be built, `execution.attention = "auto"` selects the reference backend."""
