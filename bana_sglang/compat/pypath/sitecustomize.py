"""Interpreter start-up hook of the CPU layer (bana_sglang.compat).

On ``PYTHONPATH`` only on machines without CUDA, so that SGLang's ``spawn``-ed
children get the torchvision import fix before anything imports torchvision.
"""

from bana_sglang.compat._torchvision import install

install()
