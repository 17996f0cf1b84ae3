"""How the suite shares two cores (docs/testing.md): tests marked `ranks` start processes of several ranks (the rank
pools of tests/launch.py, torchrun, the launcher); they run one at a time, on one pytest-xdist worker, first (the
longest share), while the other worker runs the single-process tests, a module at a time (module fixtures are
computed once). The rank pools end with the test run."""

import pytest

from tests import launch


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group("ranks" if _starts_ranks(item) else item.module.__name__))
    items.sort(key=lambda item: not _starts_ranks(item))  # stable: modules keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    launch.may_start_ranks(_starts_ranks(item), item.nodeid)


def pytest_sessionfinish(session, exitstatus):
    launch.close_pools()


def _starts_ranks(item) -> bool:
    return item.get_closest_marker("ranks") is not None
