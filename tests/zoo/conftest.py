"""The zoo's tiers: `make test` runs one format per architecture; cells marked `zoo_full` (the other
formats) run only under `make test-zoo` (ZOO_FULL=1) or when `-m` names the marker."""

import os


def pytest_configure(config):
    config.addinivalue_line("markers", "zoo_full: a zoo cell outside the default tier (make test-zoo runs it)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ZOO_FULL") == "1" or "zoo_full" in (config.getoption("markexpr") or ""):
        return
    deselected = [item for item in items if "zoo_full" in item.keywords]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if "zoo_full" not in item.keywords]
