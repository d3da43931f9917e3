"""Tools that run kernels on a GPU: sanitizer, debug, benchmark harness, measured cases."""
