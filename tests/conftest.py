"""How the suite shares two cores (docs/testing.md): tests marked `ranks` start processes of several ranks (the rank
pools of tests/launch.py, torchrun, the launcher); they run one at a time, on one pytest-xdist worker, first (the
longest share). Tests marked `paced` start processes too, slowed or held at a step (tests/faults.py), mostly
waiting: they run as one group on the other worker, before its single-process tests, a module at a time (module
fixtures are computed once). The rank pools end with the test run."""

import pytest

from tests import launch


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    # stable: modules keep their order (run_tests.sh keeps xdist from reordering the groups by size)
    items.sort(key=lambda item: {"ranks": 0, "paced": 1}.get(_group(item), 2))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    launch.may_start_ranks(_group(item) in ("ranks", "paced"), item.nodeid)


def pytest_sessionfinish(session, exitstatus):
    launch.close_pools()


def _group(item) -> str:
    for marker in ("paced", "ranks"):
        if item.get_closest_marker(marker) is not None:
            return marker
    return item.module.__name__
