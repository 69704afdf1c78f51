"""``python -m bana_sglang.envs``: print the settings table (README's "Settings")."""

import sys

from bana_sglang.envs import markdown_table

sys.stdout.write(markdown_table() + "\n")
