"""Tools around the flash_attention kernels: benchmark harness (and, later, build reports,
SASS analysis and the perf gate), behind one CLI: ``fa-tools`` / ``python -m fa_tools``."""
