"""Analyses of the built binary: cubins, SASS, opcodes, PTX-to-SASS, ptxas report, kernel
names, diffs. No GPU needed."""
