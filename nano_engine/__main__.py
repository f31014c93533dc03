"""`python -m nano_engine [serve | bench-serve | vllm-args] ...`: the command line (nano_engine/cli/)."""

import sys

from .cli.main import main

sys.exit(main())
