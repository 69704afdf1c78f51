"""``python -m bana_sglang.launch``: see :mod:`bana_sglang.launch.cli`."""

import sys

from bana_sglang.launch.cli import main

sys.exit(main())
