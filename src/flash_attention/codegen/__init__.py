"""Build-time code of the extension, apart from the runtime: the generator of one translation
unit per kernel config and the registry of a build (generate.py, a template per kind in
templates.py), the generator of the wgmma wrappers header (wgmma.py) and the compile wrapper
that keeps ptxas reports and caches objects (nvcc_wrapper.py, run as a script by setup.py).
"""
