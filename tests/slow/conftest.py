"""Everything under tests/slow carries the `slow` marker: `make test` runs it with the rest,
`make test-fast` leaves it out (`-m "not slow"`), `make test-slow` runs only it."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
