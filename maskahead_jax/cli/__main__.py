"""`python -m maskahead_jax.cli ...` is `maskahead ...` without installing."""
import sys

from . import main

sys.exit(main())
