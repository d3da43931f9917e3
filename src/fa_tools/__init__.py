"""Tools around the flash_attention kernels, behind one CLI (``fa-tools`` /
``python -m fa_tools``):

  analysis/   the binary: cubins, SASS, opcode histograms, PTX-to-SASS, the ptxas report,
              kernel names, diffs (no GPU needed)
  gpu/        tools that run kernels: compute-sanitizer, debug against the emulation, the
              benchmark harness and the measured cases
  gate/       the perf gate: static ratchet, sequential A/B with its worker and statistics,
              power study, combined report
"""
