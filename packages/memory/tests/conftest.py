import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (run by the nox gpu(package=...) sessions)")
