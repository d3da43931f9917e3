"""``python -m flash_attention.kernels rewrite FILE...`` / ``name OLD...``: kernel names of the
old scheme in files, or given, as they are now (legacy.main)."""

from .legacy import main

raise SystemExit(main())
